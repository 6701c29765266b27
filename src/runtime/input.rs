//! The planner's input, read from the caches (and a few facts only this process remembers:
//! how long a node's MIG state has been pending, how often the ClusterPolicy was reverted).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{ConfigMap, Pod};
use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::ResourceExt;
use kube::api::DynamicObject;
use kube::runtime::reflector::ObjectRef;

use crate::api::crd::GpuSharingPolicy;
use crate::api::names::*;
use crate::nvidia::{self, MIG_PARTED_KEY};
use crate::plan::{NodeFacts, PlanInput, selector_keys};
use crate::runtime::controller::Context;

/// Drift repairs of the ClusterPolicy within this window that make it "contested".
const CONTEST_WINDOW: Duration = Duration::from_secs(600);
const CONTEST_REPAIRS: usize = 3;

/// Whether a pod asks for NVIDIA GPU resources (full GPUs, shared replicas or MIG devices).
fn uses_gpu(p: &Pod) -> bool {
    p.spec.iter().flat_map(|s| &s.containers).any(|c| {
        let r = c.resources.as_ref();
        r.and_then(|r| r.limits.as_ref())
            .into_iter()
            .chain(r.and_then(|r| r.requests.as_ref()))
            .flat_map(|m| m.keys())
            .any(|k| k.starts_with("nvidia.com/gpu") || k.starts_with("nvidia.com/mig-"))
    })
}

/// Whether a pod asks for a resource of NVIDIA's sandbox device plugin (a VM's GPU or vGPU:
/// `nvidia.com/<PCI device name>` or `nvidia.com/<mdev type>`, as KubeVirt's virt-launcher pods
/// do).
fn uses_vm_gpu(p: &Pod) -> bool {
    p.spec.iter().flat_map(|s| &s.containers).any(|c| {
        let r = c.resources.as_ref();
        r.and_then(|r| r.limits.as_ref())
            .into_iter()
            .chain(r.and_then(|r| r.requests.as_ref()))
            .flat_map(|m| m.keys())
            .any(|k| k.starts_with("nvidia.com/") && !crate::plan::is_device_plugin_resource(k))
    })
}

/// Puts the pods that use GPUs into the planner's input: by node (`namespace/name`, sorted; the
/// idle-GPU wait before MIG changes, and drains), with their labels (`disruption.neverEvict`);
/// and the VM pods (sandbox device plugin resources) by node.
pub fn read_gpu_pods<'a>(input: &mut PlanInput, pods: impl Iterator<Item = &'a Pod>) {
    input.gpu_pods.clear();
    input.gpu_pod_labels.clear();
    input.vm_pods.clear();
    for p in pods {
        let (gpu, vm) = (uses_gpu(p), uses_vm_gpu(p));
        let Some(node) = p.spec.as_ref().and_then(|s| s.node_name.clone()) else {
            continue;
        };
        if !gpu && !vm {
            continue;
        }
        let id = format!("{}/{}", p.namespace().unwrap_or_default(), p.name_any());
        if vm {
            input
                .vm_pods
                .entry(node.clone())
                .or_default()
                .push(id.clone());
        }
        if gpu {
            input
                .gpu_pod_labels
                .insert(id.clone(), p.labels().clone().into());
            input.gpu_pods.entry(node).or_default().push(id);
        }
    }
    for v in input
        .gpu_pods
        .values_mut()
        .chain(input.vm_pods.values_mut())
    {
        v.sort();
    }
}

/// The vGPU-devices configs of a ConfigMap's `config.yaml`.
pub fn vgpu_configs(cm: Option<Arc<ConfigMap>>) -> Option<BTreeMap<String, serde_json::Value>> {
    cm.and_then(|c| c.data.as_ref()?.get(nvidia::vgpu::VGPU_KEY).cloned())
        .and_then(|t| nvidia::vgpu::parse_vgpu_configs(&t).ok())
}

/// The ClusterPolicy's sandbox settings the operator checks but does not set.
pub fn sandbox_of(cp: Option<&DynamicObject>) -> crate::plan::vm::Sandbox {
    let spec = cp.and_then(|c| c.data.get("spec"));
    crate::plan::vm::Sandbox {
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

/// The DRA driver whose claims keep a node on DRA.
pub const DRA_DRIVER: &str = "gpu.nvidia.com";

/// The nodes an allocated claim's `gpu.nvidia.com` devices are on: the allocation's node
/// selector (`metadata.name` fields, as the scheduler writes it for node-local devices), else
/// the devices' pools (NVIDIA's driver names each node's pool after the node).
fn claim_nodes(c: &ResourceClaim) -> BTreeSet<String> {
    let Some(a) = c.status.as_ref().and_then(|s| s.allocation.as_ref()) else {
        return BTreeSet::new();
    };
    let results = a.devices.iter().flat_map(|d| d.results.iter().flatten());
    let ours: Vec<_> = results.filter(|r| r.driver == DRA_DRIVER).collect();
    if ours.is_empty() {
        return BTreeSet::new();
    }
    let by_selector: BTreeSet<String> = a
        .node_selector
        .iter()
        .flat_map(|s| &s.node_selector_terms)
        .flat_map(|t| t.match_fields.iter().flatten())
        .filter(|f| f.key == "metadata.name" && f.operator == "In")
        .flat_map(|f| f.values.iter().flatten().cloned())
        .collect();
    if by_selector.is_empty() {
        ours.iter().map(|r| r.pool.clone()).collect()
    } else {
        by_selector
    }
}

/// Puts the allocated `gpu.nvidia.com` claims into the planner's input, by node
/// (`namespace/name`, sorted).
pub fn read_dra_claims<'a>(input: &mut PlanInput, claims: impl Iterator<Item = &'a ResourceClaim>) {
    input.dra_claims.clear();
    for c in claims {
        let id = format!("{}/{}", c.namespace().unwrap_or_default(), c.name_any());
        for node in claim_nodes(c) {
            input.dra_claims.entry(node).or_default().push(id.clone());
        }
    }
    for v in input.dra_claims.values_mut() {
        v.sort();
    }
}

/// The mig-parted layouts of a ConfigMap's `config.yaml`.
pub fn mig_configs(cm: Option<Arc<ConfigMap>>) -> Option<BTreeMap<String, serde_json::Value>> {
    cm.and_then(|c| c.data.as_ref()?.get(MIG_PARTED_KEY).cloned())
        .and_then(|t| nvidia::parse_mig_configs(&t).ok())
}

impl Context {
    /// A ConfigMap of the GPU Operator namespace, from the cache.
    pub(crate) fn configmap(&self, name: &str) -> Option<Arc<ConfigMap>> {
        let key = ObjectRef::new(name).within(&self.namespace);
        self.caches.configmaps.get(&key)
    }

    /// A policy, from the cache.
    pub(crate) fn policy(&self, name: &str) -> Option<Arc<GpuSharingPolicy>> {
        self.caches.policies.get(&ObjectRef::new(name))
    }

    /// The planner's input from the caches; `None` while the node cache is listing nodes again
    /// for a label a policy newly selects on (see [`crate::runtime::nodecache`]).
    pub(crate) fn plan_input(&self) -> Option<PlanInput> {
        let policies: Vec<GpuSharingPolicy> = self
            .caches
            .policies
            .state()
            .iter()
            .map(|p| (**p).clone())
            .collect();
        // Checked before the snapshot: the cache's listed labels only grow.
        if !self.caches.nodes.require(&selector_keys(&policies)) {
            return None;
        }
        let mut input = PlanInput::new(policies, vec![]);
        input.nodes = self.caches.nodes.snapshot();
        input.current_device_config = self
            .configmap(&self.config.device_configmap)
            .and_then(|c| c.data.clone())
            .unwrap_or_default()
            .into_iter()
            .collect();
        input.base_mig_configs = mig_configs(self.configmap(DEFAULT_MIG_CONFIGMAP));
        input.current_mig_configs =
            mig_configs(self.configmap(&self.config.mig_configmap)).unwrap_or_default();
        input.now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs() as i64);
        read_gpu_pods(&mut input, self.caches.pods.state().iter().map(|p| &**p));
        if let Some(claims) = &self.caches.claims {
            read_dra_claims(&mut input, claims.state().iter().map(|c| &**c));
        }
        input.gpu_cluster = self
            .caches
            .gpu_clusters
            .as_ref()
            .and_then(|s| s.state().iter().map(|c| c.name_any()).min());
        input.gpu_operator_namespace_missing = self
            .namespace_missing
            .load(std::sync::atomic::Ordering::Relaxed)
            .then(|| self.namespace.clone());
        input.eviction_blocked = self.eviction_blocked.lock().expect("eviction lock").clone();
        input.foreign_cordons = self.foreign_cordons.lock().expect("cordon lock").clone();
        input.namespaces = self
            .caches
            .namespaces
            .as_ref()
            .map(|s| s.state().iter().map(|n| n.name_any()).collect());
        input.cluster_policy_found = self.active_cluster_policy().is_some();
        input.cluster_policy_contested = self.contested();
        input.mig_stuck = self.stuck(&input.nodes, LABEL_MIG_CONFIG, LABEL_MIG_STATE);
        input.vgpu_stuck = self.stuck(&input.nodes, LABEL_VGPU_CONFIG, LABEL_VGPU_STATE);
        if let Some(base) = vgpu_configs(self.configmap(DEFAULT_VGPU_CONFIGMAP)) {
            input.base_vgpu_configs = Arc::new(base);
        }
        input.current_vgpu_configs =
            vgpu_configs(self.configmap(&self.config.vgpu_configmap)).unwrap_or_default();
        input.vgpu_configmap_name = self.config.vgpu_configmap.clone();
        input.sandbox = sandbox_of(self.active_cluster_policy().as_deref());
        input.pause_rollouts = self.config.pause_rollouts;
        input.readiness_taint = self.caches.tainted.as_ref().map(|t| {
            let cp = self.active_cluster_policy();
            let tolerations = cp
                .as_ref()
                .and_then(|c| c.data.get("spec")?.get("daemonsets")?.get("tolerations"));
            crate::plan::taint::ReadinessTaint {
                key: t.key().to_string(),
                tolerations: crate::plan::taint::tolerations(tolerations),
                tainted: t.snapshot(),
            }
        });
        input.device_configmap_name = self.config.device_configmap.clone();
        input.mig_configmap_name = self.config.mig_configmap.clone();
        Some(input)
    }

    /// The oldest ClusterPolicy: the GPU Operator ignores the others.
    pub(crate) fn active_cluster_policy(&self) -> Option<Arc<DynamicObject>> {
        let mut all = self.caches.cluster_policies.as_ref()?.state();
        all.sort_by_key(|o| (o.metadata.creation_timestamp.clone(), o.name_any()));
        all.into_iter().next()
    }

    /// Nodes whose `state_label` has said `pending` for the same `config_label` value for longer
    /// than the MIG timeout (the MIG manager and the vGPU Device Manager can exit early and
    /// never report).
    fn stuck(
        &self,
        nodes: &[Arc<NodeFacts>],
        config_label: &str,
        state_label: &str,
    ) -> BTreeSet<String> {
        let mut since = self.mig_pending_since.lock().expect("pending lock");
        let mut stuck = BTreeSet::new();
        let mut seen = BTreeSet::new();
        for n in nodes {
            if n.labels.get(state_label) != Some("pending") {
                continue;
            }
            let config = n.labels.get(config_label).unwrap_or_default().to_string();
            let key = format!("{state_label}|{}", n.name);
            seen.insert(key.clone());
            let entry = since
                .entry(key)
                .or_insert_with(|| (config.clone(), Instant::now()));
            if entry.0 != config {
                *entry = (config, Instant::now());
            }
            if entry.1.elapsed() > self.config.mig_timeout {
                stuck.insert(n.name.clone());
            }
        }
        let prefix = format!("{state_label}|");
        since.retain(|k, _| !k.starts_with(&prefix) || seen.contains(k));
        stuck
    }

    /// Reverted by someone else at least 3 times in 10 minutes: a fight, not a one-off edit.
    fn contested(&self) -> Option<String> {
        let mut repairs = self.cluster_policy_repairs.lock().expect("repairs lock");
        repairs.retain(|(t, _)| t.elapsed() < CONTEST_WINDOW);
        (repairs.len() >= CONTEST_REPAIRS).then(|| {
            format!(
                "{} reverts in the last {} minutes, last: {}",
                repairs.len(),
                CONTEST_WINDOW.as_secs() / 60,
                repairs.last().map(|(_, d)| d.as_str()).unwrap_or_default()
            )
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn claim(name: &str, status: serde_json::Value) -> ResourceClaim {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": name, "namespace": "team"},
            "spec": {},
            "status": status,
        }))
        .unwrap()
    }

    #[test]
    fn allocated_nvidia_claims_are_read_by_node() {
        let result = |driver: &str, pool: &str| serde_json::json!({"request": "gpu", "driver": driver, "pool": pool, "device": "gpu-0"});
        let by_selector = claim(
            "a",
            serde_json::json!({"allocation": {
                "devices": {"results": [result(DRA_DRIVER, "pool-x")]},
                "nodeSelector": {"nodeSelectorTerms": [{"matchFields": [
                    {"key": "metadata.name", "operator": "In", "values": ["node-1"]}]}]}}}),
        );
        let by_pool = claim(
            "b",
            serde_json::json!({"allocation": {"devices": {"results": [result(DRA_DRIVER, "node-2")]}}}),
        );
        let other_driver = claim(
            "c",
            serde_json::json!({"allocation": {"devices": {"results": [result("net.example.com", "node-1")]}}}),
        );
        let unallocated = claim("d", serde_json::json!({}));
        let mut input = PlanInput::default();
        let all = [by_selector, by_pool, other_driver, unallocated];
        read_dra_claims(&mut input, all.iter());
        assert_eq!(input.dra_claims.len(), 2);
        assert_eq!(input.dra_claims["node-1"], ["team/a"]);
        assert_eq!(input.dra_claims["node-2"], ["team/b"]);
    }
}
