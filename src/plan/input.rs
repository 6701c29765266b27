//! What the planner reads, in three parts that change for different reasons:
//!
//! - the cluster as observed: the policies, one [`NodeView`] per node (its facts together with
//!   what runs on it and the flags the control loop keeps for it), and the cluster-wide facts
//!   ([`ClusterFacts`]: NVIDIA's and our ConfigMaps, the ClusterPolicy, namespaces, the clock);
//! - how the operator was told to run ([`Settings`], its flags);
//! - what the control loop learnt in earlier passes and carries to the next ([`Memory`]).
//!
//! A leaf of `plan/` besides [`super::decision`] and [`super::taint`]: everything else in the
//! planner reads these types.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use crate::api::crd::GpuSharingPolicy;
use crate::api::names::{DEVICE_PLUGIN_CONFIGMAP, MIG_PARTED_CONFIGMAP, VGPU_DEVICES_CONFIGMAP};
use crate::nvidia;

use super::taint::ReadinessTaint;
use super::{facts::NodeFacts, labels::Labels};

/// Everything the planner reads.
#[derive(Debug, Clone, Default)]
pub struct PlanInput {
    pub policies: Vec<GpuSharingPolicy>,
    /// Every node, in any order (the planner sorts by name).
    pub nodes: Vec<NodeView>,
    pub cluster: ClusterFacts,
    pub settings: Settings,
    pub memory: Memory,
}

/// One node as the planner sees it: its facts, what runs on it, and the flags the control loop
/// keeps for it. Room for more per-node inputs (pending demand) without new maps by name.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct NodeView {
    /// Shared with the controller's node cache: a pass copies no labels.
    pub facts: Arc<NodeFacts>,
    /// Pods using GPUs on the node (`namespace/name`, sorted): the idle-GPU wait before MIG
    /// changes, and what a drain evicts.
    pub gpu_pods: Vec<String>,
    /// What drains read of the pods in `gpu_pods` and `dra_pods`, by `namespace/name`.
    pub gpu_pod_details: BTreeMap<String, GpuPod>,
    /// Pods whose GPU requests kube-scheduler served through the DRA driver (extended
    /// resources), `namespace/name`, sorted: not device-plugin pods, but what a drain evicts
    /// from a node leaving the DRA driver (their claims hold it there).
    pub dra_pods: Vec<String>,
    /// Pods using the sandbox device plugin's resources (VMs), `namespace/name`, sorted.
    pub vm_pods: Vec<String>,
    /// Allocated `gpu.nvidia.com` ResourceClaims on the node (`namespace/name`): a node leaves
    /// DRA for the device plugin only when it has none.
    pub dra_claims: Vec<String>,
    /// What NVIDIA's DRA driver publishes for the node (`None`: no `gpu.nvidia.com`
    /// ResourceSlice).
    pub dra_slice: Option<DraSlice>,
    /// `nvidia.com/mig.config.state` has said `pending` for longer than the MIG timeout (the MIG
    /// manager can exit early and never report).
    pub mig_stuck: bool,
    /// `nvidia.com/vgpu.config.state` has said `pending` past the timeout.
    pub vgpu_stuck: bool,
    /// Someone else had cordoned the node when a drain of ours started: it is drained without
    /// claiming the cordon.
    pub foreign_cordon: bool,
    /// NVIDIA resources the pods in `gpu_pods` request (`nvidia.com/mig-1g.10gb` -> 2): what
    /// of the node's allocatable is taken.
    pub gpu_requests: BTreeMap<String, i64>,
    /// Unix seconds the node was last seen running a GPU pod (or, not seen so since the
    /// operator started, its start): how long it has been idle.
    pub last_busy: i64,
}

impl NodeView {
    /// A node with nothing running on it and no flags.
    pub fn idle(facts: NodeFacts) -> Self {
        NodeView {
            facts: Arc::new(facts),
            ..Default::default()
        }
    }

    pub fn name(&self) -> &str {
        &self.facts.name
    }
}

impl std::ops::Deref for NodeView {
    type Target = NodeFacts;
    fn deref(&self) -> &NodeFacts {
        &self.facts
    }
}

/// What a drain reads of a pod using GPUs.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct GpuPod {
    /// Its labels (`disruption.neverEvict` selects by them).
    pub labels: Labels,
    /// `spec.priority`, 0 when unset (demand drains evict none above
    /// `drainBusyNodes.maxPodPriority`).
    pub priority: i32,
    /// Unix seconds the kubelet started it (`status.startTime`), 0 while unknown: demand
    /// reserves the busy node whose youngest pod is oldest, the one likely to empty first.
    pub started: i64,
}

/// A pod the scheduler could not place (`PodScheduled=False`, reason `Unschedulable`) that asks
/// for MIG instances: demand for `spec.mig.dynamic` policies.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PendingPod {
    /// `namespace/name`.
    pub id: String,
    pub priority: i32,
    /// Unix seconds the scheduler marked it unschedulable.
    pub since: i64,
    /// MIG profile (`1g.10gb`) -> instances the whole pod asks for (one node gives them all).
    pub profiles: BTreeMap<String, i64>,
    /// `spec.nodeSelector`.
    pub node_selector: BTreeMap<String, String>,
    /// Required node affinity: a node must satisfy every requirement of one term.
    pub affinity: Vec<Vec<Requirement>>,
    /// `spec.tolerations`: a node's `NoSchedule`/`NoExecute` taints must all be tolerated.
    pub tolerations: Vec<super::taint::Toleration>,
    /// The labels of its namespace (each dynamic policy's `namespaceSelector` is judged on
    /// them), filled when it is admitted as demand ([`super::admit`]); `None` when unknown.
    pub namespace_labels: Option<BTreeMap<String, String>>,
}

impl PendingPod {
    /// Whether the pod may be placed on node `n`: its labels (see [`Self::fits_labels`]) and
    /// its taints, each tolerated (but the one with key `ignore`).
    pub fn fits(&self, n: &super::facts::NodeFacts, ignore: Option<&str>) -> bool {
        self.fits_labels(&n.labels)
            && n.taints
                .iter()
                .filter(|t| Some(t.key.as_str()) != ignore)
                .all(|t| self.tolerations.iter().any(|tol| tol.tolerates(t)))
    }

    /// Whether the pod may be placed on a node with these labels (its node selector and
    /// required node affinity).
    pub fn fits_labels(&self, labels: &super::labels::Labels) -> bool {
        self.node_selector
            .iter()
            .all(|(k, v)| labels.get(k).is_some_and(|have| have == v))
            && (self.affinity.is_empty()
                || self
                    .affinity
                    .iter()
                    .any(|term| term.iter().all(|r| r.admits(labels.get(&r.key)))))
    }

    /// The label keys its placement reads (the node cache must keep them).
    pub fn label_keys(&self) -> impl Iterator<Item = &String> {
        self.node_selector
            .keys()
            .chain(self.affinity.iter().flatten().map(|r| &r.key))
    }
}

/// What the cluster says that autoscaling needs; `None` in [`ClusterFacts`] when the
/// NodeOverlay kind is not served (no Karpenter, or its feature is off).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct AutoscalingFacts {
    pub node_pools: Vec<NodePool>,
    /// Overlays not ours (an admin's, another tool's).
    pub foreign_overlays: Vec<Overlay>,
    /// The admin's instance-type table (`instance-types.yaml` of the operator's ConfigMap),
    /// as text, when there is one.
    pub table: Option<String>,
    /// Weight of our overlays.
    pub weight: i32,
}

/// A Karpenter NodePool, as far as selection goes.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct NodePool {
    pub name: String,
    /// `spec.template.metadata.labels`.
    pub labels: BTreeMap<String, String>,
    /// `spec.template.spec.requirements`.
    pub requirements: Vec<Requirement>,
}

/// A node-selector requirement (NodePool template, NodeOverlay).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Requirement {
    pub key: String,
    pub operator: String,
    pub values: Vec<String>,
}

impl Requirement {
    /// Whether `value` (the key's value, `None` when absent) satisfies the requirement.
    pub fn admits(&self, value: Option<&str>) -> bool {
        let num = |s: &str| s.parse::<i64>().ok();
        let bound = self.values.first().and_then(|v| num(v));
        match self.operator.as_str() {
            "In" => value.is_some_and(|v| self.values.iter().any(|x| x == v)),
            "NotIn" => value.is_none_or(|v| self.values.iter().all(|x| x != v)),
            "Exists" => value.is_some(),
            "DoesNotExist" => value.is_none(),
            "Gt" => matches!((value.and_then(num), bound), (Some(v), Some(b)) if v > b),
            "Lt" => matches!((value.and_then(num), bound), (Some(v), Some(b)) if v < b),
            _ => false,
        }
    }
}

/// Another actor's NodeOverlay: what it matches and which resources it sets.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Overlay {
    pub name: String,
    pub weight: i32,
    pub requirements: Vec<Requirement>,
    pub resources: Vec<String>,
}

/// What the cluster says besides its nodes.
#[derive(Debug, Clone)]
pub struct ClusterFacts {
    /// Unix time in seconds, recorded on nodes whose device-plugin config label changes (the
    /// planner reads no clock; the caller passes it).
    pub now: i64,
    /// Current data of our device-plugin ConfigMap (to keep keys nodes still point to).
    pub current_device_config: BTreeMap<String, String>,
    /// Named mig-parted layouts available to nodes (from the GPU Operator's default config).
    /// `None` when unknown: then only custom layouts and `all-disabled` are known.
    pub base_mig_configs: Option<BTreeMap<String, serde_json::Value>>,
    /// Layouts of our own mig-parted ConfigMap as it is now (to keep layouts nodes still name,
    /// and to recognise a node's pre-upgrade `custom-<policy>` layout by its content).
    pub current_mig_configs: BTreeMap<String, serde_json::Value>,
    /// NVIDIA's named vGPU-devices configs (the GPU Operator's `default-vgpu-devices-config`,
    /// else the embedded copy).
    pub base_vgpu_configs: Arc<BTreeMap<String, serde_json::Value>>,
    /// Configs of our own vGPU-devices ConfigMap as it is now (to keep configs nodes still name).
    pub current_vgpu_configs: BTreeMap<String, serde_json::Value>,
    /// Namespaces that exist, when known (`None`: assume every namespace a DRA policy lists
    /// exists, as `render` without a cluster does).
    pub namespaces: Option<BTreeSet<String>>,
    /// Whether the GPU Operator's ClusterPolicy exists.
    pub cluster_policy_found: bool,
    /// The ClusterPolicy's sandbox settings.
    pub sandbox: Sandbox,
    /// The ClusterPolicy's `spec.mig.strategy` as read (`None`: not set, or no ClusterPolicy):
    /// what the device plugin and GFD run with now, cluster-wide.
    pub cluster_mig_strategy: Option<String>,
    /// The readiness taint, when the operator runs with `--readiness-taint`.
    pub readiness_taint: Option<ReadinessTaint>,
    /// The GPU Operator's DRA-only `GPUCluster`, by name, when one exists.
    pub gpu_cluster: Option<String>,
    /// Karpenter's NodePools and NodeOverlays, when the NodeOverlay kind is served.
    pub autoscaling: Option<AutoscalingFacts>,
    /// Pods waiting for MIG instances no node offers, admitted as demand ([`super::admit`]),
    /// sorted by id.
    pub demand: Vec<PendingPod>,
    /// What the bounds of admission left out (reported on every dynamic policy).
    pub demand_ignored: Vec<crate::api::crd::IgnoredDemand>,
    /// DeviceClasses that map an extended resource name (KEP-5004), others' and all of ours,
    /// by name; `None` when DeviceClasses cannot be read (then no policy may use extended
    /// resources).
    pub device_classes: Option<Vec<DeviceClassFact>>,
    /// NVIDIA's DRA driver's ResourceSlices cannot be read (then no policy may use extended
    /// resources).
    pub slices_unreadable: bool,
    /// ResourceQuotas that limit a GPU request's names, by namespace and name; `None` when they
    /// cannot be read.
    pub quotas: Option<Vec<QuotaFact>>,
}

/// A DeviceClass with `spec.extendedResourceName`: which name it maps, and whether it is ours.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct DeviceClassFact {
    pub name: String,
    /// `spec.extendedResourceName` (`None` for ours only: kube-apiserver drops the field while
    /// the `DRAExtendedResource` feature gate is off).
    pub extended_resource_name: Option<String>,
    /// It carries our managed-by label.
    pub ours: bool,
}

/// A ResourceQuota limiting GPU requests: the keys of its hard limits that name NVIDIA's
/// extended resources (`requests.nvidia.com/...`) or a DeviceClass's device count.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct QuotaFact {
    pub namespace: String,
    pub name: String,
    pub hard: std::collections::BTreeSet<String>,
}

/// What NVIDIA's DRA driver publishes for one node (its `gpu.nvidia.com` ResourceSlices):
/// whole GPUs, MIG devices by profile, and the consumable shares of its GPUs.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct DraSlice {
    /// Devices of type `gpu`.
    pub gpus: i64,
    /// Devices of type `mig`, by profile.
    pub mig: BTreeMap<String, i64>,
    /// The `shares` capacity of its devices, GPUs and MIG devices (the driver's integer
    /// consumable-shares mode), when every device has the same; `None` when they have none.
    pub shares: Option<i64>,
    /// The devices disagree on `shares` (some have it, others not, or other values).
    pub mixed_shares: bool,
}

impl Default for ClusterFacts {
    fn default() -> Self {
        ClusterFacts {
            now: 0,
            current_device_config: BTreeMap::new(),
            base_mig_configs: None,
            current_mig_configs: BTreeMap::new(),
            base_vgpu_configs: nvidia::vgpu::default_vgpu_configs(),
            current_vgpu_configs: BTreeMap::new(),
            namespaces: None,
            cluster_policy_found: true,
            sandbox: Sandbox::default(),
            cluster_mig_strategy: None,
            readiness_taint: None,
            gpu_cluster: None,
            autoscaling: None,
            demand: Vec::new(),
            demand_ignored: Vec::new(),
            device_classes: Some(Vec::new()),
            slices_unreadable: false,
            quotas: Some(Vec::new()),
        }
    }
}

/// What the ClusterPolicy says about sandbox workloads (the fields the operator cannot set for
/// the user).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Sandbox {
    /// `spec.sandboxWorkloads.mode` (`kubevirt` when absent).
    pub mode: Option<String>,
    /// `spec.vgpuManager.enabled`.
    pub vgpu_manager_enabled: bool,
}

/// How the operator was told to run (its flags), as far as planning reads them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Settings {
    /// Names of the ConfigMaps we own.
    pub device_configmap: String,
    pub mig_configmap: String,
    pub vgpu_configmap: String,
    /// `--pause-rollouts`: start no node change for any policy.
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

/// What the control loop learnt in earlier passes that no object in the cluster says (the
/// per-node part, stuck states and foreign cordons, is in each [`NodeView`]).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Memory {
    /// Evictions the last pass could not make, by pod, with why (PodDisruptionBudget...).
    pub eviction_blocked: BTreeMap<String, String>,
    /// Set when another actor keeps reverting our ClusterPolicy settings (e.g. a GitOps tool):
    /// a description of what was reverted and how often.
    pub cluster_policy_contested: Option<String>,
    /// The GPU Operator's namespace, when our last ConfigMap write found it missing.
    pub gpu_operator_namespace_missing: Option<String>,
    /// The last conclusive fence check (`run --fence-check-seconds`): whether the admission
    /// policies refused every forbidden dry-run write; `None` before one (or offline).
    pub fence: Option<Fence>,
    /// Writes the API server refused in the last passes (still planned), in order.
    pub refused_writes: Vec<crate::api::crd::RefusedWrite>,
}

/// What the fence check found: every policy's `Fenced` condition says it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fence {
    pub fenced: bool,
    /// What was probed, or the writes that went through.
    pub message: String,
}

impl PlanInput {
    /// Policies and idle nodes; everything else at its default.
    pub fn new(policies: Vec<GpuSharingPolicy>, nodes: Vec<NodeFacts>) -> Self {
        PlanInput {
            policies,
            nodes: nodes.into_iter().map(NodeView::idle).collect(),
            ..Default::default()
        }
    }

    /// The view of the node named `name`, when there is one.
    pub fn node_mut(&mut self, name: &str) -> Option<&mut NodeView> {
        self.nodes.iter_mut().find(|v| v.facts.name == name)
    }
}
