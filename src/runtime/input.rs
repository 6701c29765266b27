//! The planner's input from the caches: the controller's [`ClusterView`] (turned into facts by
//! [`crate::observe`], as `plan` and `render` do with theirs), its flags, and what the control
//! loop remembers between passes ([`ControllerMemory`]).

use std::sync::Arc;
use std::time::Instant;

use k8s_openapi::api::core::v1::ConfigMap;
use kube::ResourceExt;
use kube::api::DynamicObject;
use kube::runtime::reflector::ObjectRef;

use crate::api::crd::GpuSharingPolicy;
use crate::api::names::*;
use crate::observe::karpenter::KarpenterView;
use crate::observe::{self, ClusterView, Settings};
use crate::plan::{PlanInput, admit, dynamic_selectors, selector_keys};
use crate::runtime::controller::Context;
use crate::runtime::memory::ControllerMemory;

impl Context {
    /// A ConfigMap of the GPU Operator namespace, from the cache (only those
    /// [`Config::configmaps_read`](crate::runtime::context::Config::configmaps_read) names are
    /// watched).
    pub(crate) fn configmap(&self, name: &str) -> Option<Arc<ConfigMap>> {
        self.caches.configmaps.get(name)
    }

    /// A policy, from the cache.
    pub(crate) fn policy(&self, name: &str) -> Option<Arc<GpuSharingPolicy>> {
        self.caches.policies.get(&ObjectRef::new(name))
    }

    /// The planner's input from the caches and the control loop's memory; `None` while the node
    /// cache is listing nodes again for a label a policy newly selects on (see
    /// [`crate::runtime::nodecache`]).
    pub(crate) fn plan_input(&self, memory: &mut ControllerMemory) -> Option<PlanInput> {
        let policies: Vec<GpuSharingPolicy> = self
            .caches
            .policies
            .state()
            .iter()
            .map(|p| (**p).clone())
            .collect();
        // Checked before the snapshot: the cache's listed labels only grow. Pending pods'
        // label keys need no list: the nodes they may be demand for keep every label.
        let keys = selector_keys(&policies);
        if !self
            .caches
            .nodes
            .require(&keys, &dynamic_selectors(&policies))
        {
            return None;
        }
        let admitted = self.admitted_demand(&policies, &keys);
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
        let configmaps = self
            .config
            .configmaps_read()
            .into_iter()
            .filter_map(|name| Some((name.to_string(), self.configmap(name)?.data.clone()?)))
            .collect();
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs() as i64);
        let busy = pods
            .iter()
            .filter(|p| observe::pods::uses_gpu(p))
            .filter_map(|p| p.spec.as_ref()?.node_name.as_deref());
        memory.note_busy(busy, &nodes, now);
        let mut memory = memory.recall(&self.caches.nodes.pending(), Instant::now());
        memory.carried.fence = self.config.fence.get();
        let karpenter = self
            .caches
            .karpenter
            .as_ref()
            .map(|(pools, overlays)| (pools.state(), overlays.state()));
        let slices = self.caches.slices.as_ref().map(|s| s.state());
        let device_classes = self.caches.device_classes.as_ref().map(|s| s.state());
        let quotas = self.caches.quotas.as_ref().map(|s| s.state());
        let view = ClusterView {
            policies,
            nodes,
            pods: pods.iter().map(|p| &**p).collect(),
            demand: admitted.pods,
            demand_ignored: admitted.ignored,
            claims: claims.iter().map(|c| &**c).collect(),
            slices: refs(&slices),
            device_classes: refs(&device_classes),
            quotas: refs(&quotas),
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
            karpenter: karpenter.as_ref().map(|(pools, overlays)| KarpenterView {
                node_pools: pools.iter().map(|p| &**p).collect(),
                overlays: overlays.iter().map(|o| &**o).collect(),
            }),
            now,
        };
        Some(observe::plan_input(view, &settings, memory))
    }

    /// The pending pods admitted as demand ([`admit`]). Their node selectors and affinity are
    /// judged against node labels too, but only those of admitted pods, and only so many keys
    /// over the node cache's life (tenants write them).
    fn admitted_demand(
        &self,
        policies: &[GpuSharingPolicy],
        keys: &std::collections::BTreeSet<String>,
    ) -> admit::Admitted {
        let demand = observe::pods::demand(self.caches.pending.state().iter().map(|p| &**p));
        let sources = admit::Sources {
            mig_configs: || self.mig_catalogue(),
            namespaces: || self.namespace_labels(),
        };
        let filter = self.caches.nodes.filter();
        let budget = admit::KeyBudget {
            policy: keys,
            filter: &filter,
        };
        admit::admit(policies, sources, &budget, demand)
    }

    /// NVIDIA's named MIG layouts: the GPU Operator's default config, else the embedded copy
    /// (which profiles a dynamic policy's catalogue can offer).
    fn mig_catalogue(&self) -> std::collections::BTreeMap<String, serde_json::Value> {
        let cm = self.configmap(DEFAULT_MIG_CONFIGMAP);
        observe::gpu_operator::mig_configs(cm.as_ref().and_then(|c| c.data.as_ref()))
            .unwrap_or_else(crate::nvidia::default_mig_configs)
    }

    /// Each namespace's labels, when the operator may list namespaces.
    fn namespace_labels(&self) -> admit::NamespaceLabels {
        let store = self.caches.namespaces.as_ref()?;
        Some(
            store
                .state()
                .iter()
                .map(|n| (n.name_any(), n.labels().clone()))
                .collect(),
        )
    }

    /// The ClusterPolicy in force (the oldest: the GPU Operator ignores the others).
    pub(crate) fn active_cluster_policy(&self) -> Option<Arc<DynamicObject>> {
        let all = self.caches.cluster_policies.as_ref()?.state();
        let active = observe::gpu_operator::active_cluster_policy(all.iter().map(|c| &**c))?;
        all.iter().find(|c| std::ptr::eq(&***c, active)).cloned()
    }
}

/// The objects of a cache's snapshot (`None`: no cache), by reference.
fn refs<K>(state: &Option<Vec<Arc<K>>>) -> Option<Vec<&K>> {
    state.as_ref().map(|s| s.iter().map(|o| &**o).collect())
}
