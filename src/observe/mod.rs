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
//! - [`gpu_operator`]: the ClusterPolicy in force, its settings, NVIDIA's ConfigMaps.

pub mod claims;
pub mod gpu_operator;
pub mod managed;
pub mod node;
pub mod pods;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::api::DynamicObject;

use crate::api::crd::GpuSharingPolicy;
use crate::api::names::{
    DEFAULT_MIG_CONFIGMAP, DEFAULT_VGPU_CONFIGMAP, DEVICE_PLUGIN_CONFIGMAP, MIG_PARTED_CONFIGMAP,
    VGPU_DEVICES_CONFIGMAP,
};
use crate::plan::taint::{ReadinessTaint, Taint};
use crate::plan::{NodeFacts, PlanInput};

/// What one reader saw of the cluster: the objects the planner's facts come from.
#[derive(Debug, Clone, Default)]
pub struct ClusterView<'a> {
    pub policies: Vec<GpuSharingPolicy>,
    /// Nodes, already as facts (see [`node::facts`]).
    pub nodes: Vec<Arc<NodeFacts>>,
    /// Pods bound to nodes (running or about to).
    pub pods: Vec<&'a Pod>,
    /// ResourceClaims (only allocated `gpu.nvidia.com` ones count).
    pub claims: Vec<&'a ResourceClaim>,
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
    /// Unix seconds when the view was taken.
    pub now: i64,
}

/// How the operator was told to run (its flags), as far as planning reads them.
#[derive(Debug, Clone)]
pub struct Settings {
    pub device_configmap: String,
    pub mig_configmap: String,
    pub vgpu_configmap: String,
    /// `--pause-rollouts`.
    pub pause_rollouts: bool,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            device_configmap: DEVICE_PLUGIN_CONFIGMAP.into(),
            mig_configmap: MIG_PARTED_CONFIGMAP.into(),
            vgpu_configmap: VGPU_DEVICES_CONFIGMAP.into(),
            pause_rollouts: false,
        }
    }
}

/// What the controller remembers between passes (none of it is in the cluster's objects).
#[derive(Debug, Clone, Default)]
pub struct Memory {
    /// Evictions the last pass could not make, by pod, with why.
    pub eviction_blocked: BTreeMap<String, String>,
    /// Nodes being drained that someone else had cordoned.
    pub foreign_cordons: BTreeSet<String>,
    /// Nodes whose MIG state has said `pending` past the timeout.
    pub mig_stuck: BTreeSet<String>,
    /// Nodes whose vGPU state has said `pending` past the timeout.
    pub vgpu_stuck: BTreeSet<String>,
    /// Another actor keeps reverting our ClusterPolicy settings: what and how often.
    pub cluster_policy_contested: Option<String>,
    /// The GPU Operator's namespace, when our last ConfigMap write found it missing.
    pub gpu_operator_namespace_missing: Option<String>,
}

/// The planner's input from one view of the cluster.
pub fn plan_input(view: ClusterView, settings: &Settings, memory: Memory) -> PlanInput {
    let cm = |name: &str| view.configmaps.get(name);
    let mut input = PlanInput::new(view.policies, vec![]);
    input.nodes = view.nodes;
    input.now = view.now;
    input.current_device_config = cm(&settings.device_configmap).cloned().unwrap_or_default();
    input.base_mig_configs = gpu_operator::mig_configs(cm(DEFAULT_MIG_CONFIGMAP));
    input.current_mig_configs =
        gpu_operator::mig_configs(cm(&settings.mig_configmap)).unwrap_or_default();
    if let Some(base) = gpu_operator::vgpu_configs(cm(DEFAULT_VGPU_CONFIGMAP)) {
        input.base_vgpu_configs = Arc::new(base);
    }
    input.current_vgpu_configs =
        gpu_operator::vgpu_configs(cm(&settings.vgpu_configmap)).unwrap_or_default();
    let pods = pods::gpu_pods(view.pods);
    input.gpu_pods = pods.gpu_pods;
    input.gpu_pod_labels = pods.gpu_pod_labels;
    input.vm_pods = pods.vm_pods;
    input.dra_claims = claims::dra_claims(view.claims);
    input.gpu_cluster = view.gpu_clusters.into_iter().min();
    input.namespaces = view.namespaces;
    match &view.cluster_policies {
        Some(all) => {
            let active = gpu_operator::active_cluster_policy(all.iter().copied());
            input.cluster_policy_found = active.is_some();
            input.sandbox = gpu_operator::sandbox_of(active);
            input.readiness_taint = view.tainted.map(|(key, tainted)| ReadinessTaint {
                key,
                tolerations: gpu_operator::daemonset_tolerations(active),
                tainted,
            });
        }
        None => {
            input.cluster_policy_found = true;
            input.sandbox.vgpu_manager_enabled = true;
        }
    }
    input.device_configmap_name = settings.device_configmap.clone();
    input.mig_configmap_name = settings.mig_configmap.clone();
    input.vgpu_configmap_name = settings.vgpu_configmap.clone();
    input.pause_rollouts = settings.pause_rollouts;
    input.eviction_blocked = memory.eviction_blocked;
    input.foreign_cordons = memory.foreign_cordons;
    input.mig_stuck = memory.mig_stuck;
    input.vgpu_stuck = memory.vgpu_stuck;
    input.cluster_policy_contested = memory.cluster_policy_contested;
    input.gpu_operator_namespace_missing = memory.gpu_operator_namespace_missing;
    input
}
