//! The GPU Operator's objects -> facts: which ClusterPolicy is in force (the GPU Operator acts
//! on the oldest only), its namespace, its sandbox settings and DaemonSet tolerations, and the
//! layouts and configs of the mig-parted and vGPU-devices ConfigMaps.

use std::collections::BTreeMap;

use kube::ResourceExt;
use kube::api::DynamicObject;

use crate::nvidia::{self, MIG_PARTED_KEY};
use crate::plan::decision::Sandbox;
use crate::plan::taint::{self, Toleration};

/// Where the GPU Operator runs when neither `--namespace` nor a ClusterPolicy's
/// `status.namespace` says: its Helm chart's default.
pub const DEFAULT_NAMESPACE: &str = "gpu-operator";

/// The ClusterPolicy in force: the oldest (then the first by name); the GPU Operator ignores
/// the others.
pub fn active_cluster_policy<'a>(
    all: impl IntoIterator<Item = &'a DynamicObject>,
) -> Option<&'a DynamicObject> {
    all.into_iter()
        .min_by_key(|o| (o.metadata.creation_timestamp.clone(), o.name_any()))
}

/// The namespace the GPU Operator reports on its ClusterPolicy (`status.namespace`).
pub fn status_namespace(cp: &DynamicObject) -> Option<String> {
    cp.data
        .get("status")?
        .get("namespace")?
        .as_str()
        .map(String::from)
}

/// The ClusterPolicy's sandbox settings the operator checks but does not set.
pub fn sandbox_of(cp: Option<&DynamicObject>) -> Sandbox {
    let spec = cp.and_then(|c| c.data.get("spec"));
    Sandbox {
        mode: spec
            .and_then(|s| s.pointer("/sandboxWorkloads/mode"))
            .and_then(|m| m.as_str())
            .map(str::to_string),
        vgpu_manager_enabled: spec
            .and_then(|s| s.pointer("/vgpuManager/enabled"))
            .and_then(|e| e.as_bool())
            == Some(true),
    }
}

/// The ClusterPolicy's `spec.mig.strategy`, when set.
pub fn mig_strategy_of(cp: Option<&DynamicObject>) -> Option<String> {
    cp.and_then(|c| c.data.get("spec")?.pointer("/mig/strategy")?.as_str())
        .map(str::to_string)
}

/// The tolerations of the GPU Operator's DaemonSets (`spec.daemonsets.tolerations`).
pub fn daemonset_tolerations(cp: Option<&DynamicObject>) -> Vec<Toleration> {
    let tolerations = cp.and_then(|c| c.data.get("spec")?.get("daemonsets")?.get("tolerations"));
    taint::tolerations(tolerations)
}

/// The mig-parted layouts of a ConfigMap's data (`config.yaml`).
pub fn mig_configs(
    data: Option<&BTreeMap<String, String>>,
) -> Option<BTreeMap<String, serde_json::Value>> {
    data?
        .get(MIG_PARTED_KEY)
        .and_then(|t| nvidia::parse_mig_configs(t).ok())
}

/// The vGPU-devices configs of a ConfigMap's data (`config.yaml`).
pub fn vgpu_configs(
    data: Option<&BTreeMap<String, String>>,
) -> Option<BTreeMap<String, serde_json::Value>> {
    data?
        .get(nvidia::vgpu::VGPU_KEY)
        .and_then(|t| nvidia::vgpu::parse_vgpu_configs(t).ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cp(name: &str, created: &str) -> DynamicObject {
        serde_json::from_value(serde_json::json!({
            "apiVersion": "nvidia.com/v1", "kind": "ClusterPolicy",
            "metadata": {"name": name, "creationTimestamp": created},
            "status": {"namespace": format!("ns-{name}")},
        }))
        .unwrap()
    }

    #[test]
    fn the_oldest_cluster_policy_is_in_force_then_the_first_by_name() {
        let all = [
            cp("b", "2026-01-02T00:00:00Z"),
            cp("c", "2026-01-01T00:00:00Z"),
            cp("a", "2026-01-02T00:00:00Z"),
        ];
        let active = active_cluster_policy(&all).unwrap();
        assert_eq!(active.name_any(), "c");
        assert_eq!(status_namespace(active).as_deref(), Some("ns-c"));
        let tie = [all[0].clone(), all[2].clone()];
        assert_eq!(active_cluster_policy(&tie).unwrap().name_any(), "a");
        assert!(active_cluster_policy(&[]).is_none());
    }
}
