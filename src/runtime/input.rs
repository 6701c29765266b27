//! The planner's input, read from the caches (and a few facts only this process remembers:
//! how long a node's MIG state has been pending, how often the ClusterPolicy was reverted).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{ConfigMap, Pod};
use kube::ResourceExt;
use kube::api::DynamicObject;
use kube::runtime::reflector::ObjectRef;

use crate::api::crd::GpuSharingPolicy;
use crate::api::names::*;
use crate::nvidia::{self, MIG_PARTED_KEY};
use crate::plan::{NodeFacts, PlanInput};
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

/// Puts the pods that use GPUs into the planner's input: by node (`namespace/name`, sorted; the
/// idle-GPU wait before MIG changes, and drains), with their labels (`disruption.neverEvict`).
pub fn read_gpu_pods<'a>(input: &mut PlanInput, pods: impl Iterator<Item = &'a Pod>) {
    input.gpu_pods.clear();
    input.gpu_pod_labels.clear();
    for p in pods.filter(|p| uses_gpu(p)) {
        let Some(node) = p.spec.as_ref().and_then(|s| s.node_name.clone()) else {
            continue;
        };
        let id = format!("{}/{}", p.namespace().unwrap_or_default(), p.name_any());
        input
            .gpu_pod_labels
            .insert(id.clone(), p.labels().clone().into());
        input.gpu_pods.entry(node).or_default().push(id);
    }
    for v in input.gpu_pods.values_mut() {
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

    pub(crate) fn plan_input(&self) -> PlanInput {
        let policies: Vec<GpuSharingPolicy> = self
            .caches
            .policies
            .state()
            .iter()
            .map(|p| (**p).clone())
            .collect();
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
        input.eviction_blocked = self.eviction_blocked.lock().expect("eviction lock").clone();
        input.foreign_cordons = self.foreign_cordons.lock().expect("cordon lock").clone();
        input.namespaces = self
            .caches
            .namespaces
            .as_ref()
            .map(|s| s.state().iter().map(|n| n.name_any()).collect());
        input.cluster_policy_found = self.active_cluster_policy().is_some();
        input.cluster_policy_contested = self.contested();
        input.mig_stuck = self.mig_stuck(&input.nodes);
        input.pause_rollouts = self.config.pause_rollouts;
        input.readiness_taint = self.caches.tainted.as_ref().map(|t| {
            let cp = self.active_cluster_policy();
            let tolerations = cp
                .as_ref()
                .and_then(|c| c.data.get("spec")?.get("daemonsets")?.get("tolerations"));
            crate::plan::taint::ReadinessTaint {
                key: t.key().to_string(),
                tolerated: crate::plan::taint::tolerates(tolerations, t.key()),
                tainted: t.snapshot(),
            }
        });
        input.device_configmap_name = self.config.device_configmap.clone();
        input.mig_configmap_name = self.config.mig_configmap.clone();
        input
    }

    /// The oldest ClusterPolicy: the GPU Operator ignores the others.
    pub(crate) fn active_cluster_policy(&self) -> Option<Arc<DynamicObject>> {
        let mut all = self.caches.cluster_policies.as_ref()?.state();
        all.sort_by_key(|o| (o.metadata.creation_timestamp.clone(), o.name_any()));
        all.into_iter().next()
    }

    /// Nodes pending for the same layout for longer than the MIG timeout.
    fn mig_stuck(&self, nodes: &[Arc<NodeFacts>]) -> BTreeSet<String> {
        let mut since = self.mig_pending_since.lock().expect("pending lock");
        let mut stuck = BTreeSet::new();
        let mut seen = BTreeSet::new();
        for n in nodes {
            if n.labels.get(LABEL_MIG_STATE) != Some("pending") {
                continue;
            }
            let layout = n
                .labels
                .get(LABEL_MIG_CONFIG)
                .unwrap_or_default()
                .to_string();
            seen.insert(n.name.clone());
            let entry = since
                .entry(n.name.clone())
                .or_insert_with(|| (layout.clone(), Instant::now()));
            if entry.0 != layout {
                *entry = (layout, Instant::now());
            }
            if entry.1.elapsed() > self.config.mig_timeout {
                stuck.insert(n.name.clone());
            }
        }
        since.retain(|k, _| seen.contains(k));
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
