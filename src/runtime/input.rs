//! The planner's input from the caches: the controller's [`ClusterView`] (turned into facts by
//! [`crate::observe`], as `plan` and `render` do with theirs), its flags, and a few facts only
//! this process remembers: how long a node's MIG state has been pending, how often the
//! ClusterPolicy was reverted.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::ConfigMap;
use kube::ResourceExt;
use kube::api::DynamicObject;
use kube::runtime::reflector::ObjectRef;

use crate::api::crd::GpuSharingPolicy;
use crate::api::names::*;
use crate::observe::{self, ClusterView, Memory, Settings};
use crate::plan::{NodeFacts, PlanInput, selector_keys};
use crate::runtime::controller::Context;

/// Drift repairs of the ClusterPolicy within this window that make it "contested".
const CONTEST_WINDOW: Duration = Duration::from_secs(600);
const CONTEST_REPAIRS: usize = 3;

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
        let nodes = self.caches.nodes.snapshot();
        let pods = self.caches.pods.state();
        let claims = self
            .caches
            .claims
            .as_ref()
            .map(|c| c.state())
            .unwrap_or_default();
        let cluster_policies = self
            .caches
            .cluster_policies
            .as_ref()
            .map(|s| s.state())
            .unwrap_or_default();
        let settings = Settings {
            device_configmap: self.config.device_configmap.clone(),
            mig_configmap: self.config.mig_configmap.clone(),
            vgpu_configmap: self.config.vgpu_configmap.clone(),
            pause_rollouts: self.config.pause_rollouts,
        };
        let configmaps = [
            settings.device_configmap.as_str(),
            settings.mig_configmap.as_str(),
            settings.vgpu_configmap.as_str(),
            DEFAULT_MIG_CONFIGMAP,
            DEFAULT_VGPU_CONFIGMAP,
        ]
        .into_iter()
        .filter_map(|name| Some((name.to_string(), self.configmap(name)?.data.clone()?)))
        .collect();
        let memory = Memory {
            eviction_blocked: self.eviction_blocked.lock().expect("eviction lock").clone(),
            foreign_cordons: self.foreign_cordons.lock().expect("cordon lock").clone(),
            mig_stuck: self.stuck(&nodes, LABEL_MIG_CONFIG, LABEL_MIG_STATE),
            vgpu_stuck: self.stuck(&nodes, LABEL_VGPU_CONFIG, LABEL_VGPU_STATE),
            cluster_policy_contested: self.contested(),
            gpu_operator_namespace_missing: self
                .namespace_missing
                .load(std::sync::atomic::Ordering::Relaxed)
                .then(|| self.namespace.clone()),
        };
        let view = ClusterView {
            policies,
            nodes,
            pods: pods.iter().map(|p| &**p).collect(),
            claims: claims.iter().map(|c| &**c).collect(),
            cluster_policies: Some(cluster_policies.iter().map(|c| &**c).collect()),
            gpu_clusters: self
                .caches
                .gpu_clusters
                .as_ref()
                .map(|s| s.state().iter().map(|c| c.name_any()).collect())
                .unwrap_or_default(),
            configmaps,
            namespaces: self
                .caches
                .namespaces
                .as_ref()
                .map(|s| s.state().iter().map(|n| n.name_any()).collect()),
            tainted: self
                .caches
                .tainted
                .as_ref()
                .map(|t| (t.key().to_string(), t.snapshot())),
            now: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs() as i64),
        };
        Some(observe::plan_input(view, &settings, memory))
    }

    /// The ClusterPolicy in force (the oldest: the GPU Operator ignores the others).
    pub(crate) fn active_cluster_policy(&self) -> Option<Arc<DynamicObject>> {
        let all = self.caches.cluster_policies.as_ref()?.state();
        let active = observe::gpu_operator::active_cluster_policy(all.iter().map(|c| &**c))?;
        all.iter().find(|c| std::ptr::eq(&***c, active)).cloned()
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
