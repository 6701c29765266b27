//! From Kubernetes objects to the planner's facts, one way for every reader of the cluster.
//!
//! The controller reads its caches, `plan` lists the cluster once, `render` reads files; each
//! puts what it read into a [`ClusterView`] and [`plan_input`] turns it into the planner's input.
//! What the controller alone knows (its flags: [`Settings`]; what it remembers between passes:
//! [`Memory`]) comes in beside the view. Pure: no client, no clock.
//!
//! - [`node`]: Node -> `NodeFacts` (labels, our owned keys from managedFields, allocatable).
//! - [`managed`]: what our field manager owns on an object.
//! - [`pods`]: pods using GPUs or running VMs, by node.
//! - [`claims`]: allocated DRA claims, by node.
//! - [`slices`]: what NVIDIA's DRA driver publishes, by node.
//! - [`classes`]: DeviceClasses that map extended resource names.
//! - [`quotas`]: ResourceQuotas limiting GPU requests.
//! - [`gpu_operator`]: the ClusterPolicy in force, its settings, NVIDIA's ConfigMaps.
//! - [`karpenter`]: Karpenter's NodePools and NodeOverlays, when served.

pub mod claims;
pub mod classes;
pub mod gpu_operator;
pub mod karpenter;
pub mod managed;
pub mod node;
pub mod pods;
pub mod quotas;
pub mod slices;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::{DeviceClass, ResourceClaim, ResourceSlice};
use kube::api::DynamicObject;

use crate::api::crd::GpuSharingPolicy;
use crate::api::names::{DEFAULT_MIG_CONFIGMAP, DEFAULT_VGPU_CONFIGMAP, INSTANCE_TYPES_CONFIGMAP};
pub use crate::plan::Settings;
use crate::plan::input::PendingPod;
use crate::plan::taint::{ReadinessTaint, Taint};
use crate::plan::{self, ClusterFacts, NodeFacts, NodeView, PlanInput};

/// What one reader saw of the cluster: the objects the planner's facts come from.
#[derive(Debug, Clone, Default)]
pub struct ClusterView<'a> {
    pub policies: Vec<GpuSharingPolicy>,
    /// Nodes, already as facts (see [`node::facts`]).
    pub nodes: Vec<Arc<NodeFacts>>,
    /// Pods bound to nodes (running or about to).
    pub pods: Vec<&'a Pod>,
    /// Pods the scheduler could not place that ask for MIG instances (see
    /// [`pods::demand`]).
    pub demand: Vec<PendingPod>,
    /// What the bounds of demand admission left out ([`crate::plan::admit`]).
    pub demand_ignored: Vec<crate::api::crd::IgnoredDemand>,
    /// ResourceClaims (only allocated `gpu.nvidia.com` ones count).
    pub claims: Vec<&'a ResourceClaim>,
    /// ResourceSlices (only `gpu.nvidia.com` ones of a node count).
    pub slices: Option<Vec<&'a ResourceSlice>>,
    /// DeviceClasses; `None` when they cannot be read.
    pub device_classes: Option<Vec<&'a DeviceClass>>,
    /// ResourceQuotas; `None` when they cannot be read.
    pub quotas: Option<Vec<&'a k8s_openapi::api::core::v1::ResourceQuota>>,
    /// Every ClusterPolicy; `None` when there is no cluster to ask (`render`): then the
    /// ClusterPolicy is assumed to be there and to serve VM policies (vGPU Manager on).
    pub cluster_policies: Option<Vec<&'a DynamicObject>>,
    /// Names of the GPU Operator's DRA-only `GPUCluster` objects.
    pub gpu_clusters: Vec<String>,
    /// Data of the ConfigMaps in the GPU Operator's namespace, by name (ours and NVIDIA's
    /// defaults; others are not read).
    pub configmaps: BTreeMap<String, BTreeMap<String, String>>,
    /// Namespaces that exist; `None` when unknown (every namespace is assumed to exist).
    pub namespaces: Option<BTreeSet<String>>,
    /// With `--readiness-taint`: its key and the nodes that carry it.
    pub tainted: Option<(String, BTreeMap<String, Taint>)>,
    /// Karpenter's NodePools and NodeOverlays, when the NodeOverlay kind is served.
    pub karpenter: Option<karpenter::KarpenterView<'a>>,
    /// Unix seconds when the view was taken.
    pub now: i64,
}

/// What the controller remembers between passes (none of it is in the cluster's objects): what
/// the planner carries as [`plan::Memory`], and per node, which nodes are stuck and which were
/// cordoned by someone else (given to each node's view).
#[derive(Debug, Clone, Default)]
pub struct Memory {
    pub carried: plan::Memory,
    /// Nodes being drained that someone else had cordoned.
    pub foreign_cordons: BTreeSet<String>,
    /// Nodes whose MIG state has said `pending` past the timeout.
    pub mig_stuck: BTreeSet<String>,
    /// Nodes whose vGPU state has said `pending` past the timeout.
    pub vgpu_stuck: BTreeSet<String>,
    /// Unix seconds each node was last seen running GPU pods (absent: not since `started`).
    pub last_busy: BTreeMap<String, i64>,
    /// Unix seconds the controller started.
    pub started: i64,
}

/// The planner's input from one view of the cluster.
pub fn plan_input(view: ClusterView, settings: &Settings, memory: Memory) -> PlanInput {
    let cm = |name: &str| view.configmaps.get(name);
    let mut c = ClusterFacts {
        now: view.now,
        current_device_config: cm(&settings.device_configmap).cloned().unwrap_or_default(),
        base_mig_configs: gpu_operator::mig_configs(cm(DEFAULT_MIG_CONFIGMAP)),
        current_mig_configs: gpu_operator::mig_configs(cm(&settings.mig_configmap))
            .unwrap_or_default(),
        current_vgpu_configs: gpu_operator::vgpu_configs(cm(&settings.vgpu_configmap))
            .unwrap_or_default(),
        gpu_cluster: view.gpu_clusters.into_iter().min(),
        namespaces: view.namespaces,
        autoscaling: view
            .karpenter
            .map(|k| karpenter::facts(k, cm(INSTANCE_TYPES_CONFIGMAP), None)),
        demand: view.demand,
        demand_ignored: view.demand_ignored,
        device_classes: view.device_classes.map(classes::facts),
        quotas: view.quotas.map(quotas::facts),
        ..Default::default()
    };
    if let Some(base) = gpu_operator::vgpu_configs(cm(DEFAULT_VGPU_CONFIGMAP)) {
        c.base_vgpu_configs = Arc::new(base);
    }
    match &view.cluster_policies {
        Some(all) => {
            let active = gpu_operator::active_cluster_policy(all.iter().copied());
            c.cluster_policy_found = active.is_some();
            c.sandbox = gpu_operator::sandbox_of(active);
            c.cluster_mig_strategy = gpu_operator::mig_strategy_of(active);
            c.readiness_taint = view.tainted.map(|(key, tainted)| ReadinessTaint {
                key,
                tolerations: gpu_operator::daemonset_tolerations(active),
                tainted,
            });
        }
        None => {
            c.cluster_policy_found = true;
            c.sandbox.vgpu_manager_enabled = true;
        }
    }
    let mut pods = pods::gpu_pods(view.pods);
    let mut claims = claims::dra_claims(view.claims);
    c.slices_unreadable = view.slices.is_none();
    let mut slices = slices::dra_slices(view.slices.into_iter().flatten());
    let nodes = view
        .nodes
        .into_iter()
        .map(|facts| {
            let name = facts.name.as_str();
            let gpu_pods = pods.gpu_pods.remove(name).unwrap_or_default();
            let dra_pods = pods.dra_pods.remove(name).unwrap_or_default();
            let gpu_pod_details = (gpu_pods.iter().chain(&dra_pods))
                .filter_map(|p| Some((p.clone(), pods.gpu_pod_details.remove(p)?)))
                .collect();
            NodeView {
                gpu_pods,
                gpu_pod_details,
                dra_pods,
                vm_pods: pods.vm_pods.remove(name).unwrap_or_default(),
                dra_claims: claims.remove(name).unwrap_or_default(),
                dra_slice: slices.remove(name),
                mig_stuck: memory.mig_stuck.contains(name),
                vgpu_stuck: memory.vgpu_stuck.contains(name),
                foreign_cordon: memory.foreign_cordons.contains(name),
                gpu_requests: pods.requests.remove(name).unwrap_or_default(),
                last_busy: memory
                    .last_busy
                    .get(name)
                    .copied()
                    .unwrap_or(memory.started),
                facts,
            }
        })
        .collect();
    PlanInput {
        policies: view.policies,
        nodes,
        cluster: c,
        settings: settings.clone(),
        memory: memory.carried,
    }
}
