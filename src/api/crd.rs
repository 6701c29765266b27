//! The `GpuSharingPolicy` custom resource (`gpusharing.io/v1alpha1`, cluster-scoped).
//!
//! Everything that can be checked without knowing the nodes is checked at admission, through the
//! OpenAPI schema and CEL rules generated from these types (`crds/` is generated from here).
//! What depends on the nodes (GPU model, GPU count, compute capability) is checked by the planner
//! and reported as a status condition.

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, Time};
use kube::{CustomResource, KubeSchema};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::state::{ConditionStatus, ConditionType, NodeState, Reason};

/// API group of our resources.
pub const GROUP: &str = "gpusharing.io";

/// Longest policy name: the device-plugin ConfigMap key `<name>-<8 hex>` must fit a label value
/// (63 characters), because the node label `nvidia.com/device-plugin.config` carries it.
pub const MAX_POLICY_NAME: usize = 54;

/// Desired GPU sharing for the nodes a label selector picks.
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "gpusharing.io",
    version = "v1alpha1",
    kind = "GpuSharingPolicy",
    plural = "gpusharingpolicies",
    shortname = "gsp",
    status = "GpuSharingPolicyStatus",
    derive = "PartialEq",
    doc = "GpuSharingPolicy declares how the GPUs of the selected nodes are shared: exclusive, time-slicing, MPS or MIG for containers; vGPU or passthrough for virtual machines.",
    cel,
    validation = Rule::new("size(self.metadata.name) <= 54").message("metadata.name must be at most 54 characters: the device-plugin config key <name>-<hash> is carried in a node label (63 characters at most)"),
    validation = Rule::new("self.metadata.name.matches('^[a-z0-9]([-a-z0-9]*[a-z0-9])?$')").message("metadata.name must consist of lower-case letters, digits and '-' (it becomes part of a ConfigMap key and a node label value)"),
    printcolumn(name = "Strategy", type_ = "string", json_path = ".spec.strategy"),
    printcolumn(name = "Replicas", type_ = "integer", json_path = ".status.replicas"),
    printcolumn(name = "Nodes", type_ = "string", json_path = ".status.nodes", description = "applied/matched nodes"),
    printcolumn(name = "Ready", type_ = "string", json_path = ".status.conditions[?(@.type==\"Ready\")].status"),
    printcolumn(name = "Schedulable", type_ = "integer", json_path = ".status.capacity.schedulableReplicas", description = "nvidia.com/gpu (or MIG) devices the applied nodes advertise", priority = 1),
    printcolumn(name = "MiB/Client", type_ = "integer", json_path = ".status.capacity.memoryPerClientMib", description = "memory a client can count on", priority = 1),
    printcolumn(name = "Progress", type_ = "string", json_path = ".status.conditions[?(@.type==\"Progressing\")].reason", description = "rollout progress (reason of the Progressing condition)", priority = 1),
    printcolumn(name = "Config", type_ = "string", json_path = ".status.deviceConfigKey", description = "device-plugin ConfigMap key", priority = 1),
    printcolumn(name = "MIG", type_ = "string", json_path = ".status.migConfig", description = "MIG layout", priority = 1),
    printcolumn(name = "vGPU", type_ = "string", json_path = ".status.vgpuConfig", description = "vGPU Device Manager config", priority = 1),
    printcolumn(name = "Age", type_ = "date", json_path = ".metadata.creationTimestamp")
)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("self.strategy == 'timeSlicing' ? has(self.timeSlicing) : !has(self.timeSlicing)").message("spec.timeSlicing must be set when, and only when, strategy is timeSlicing"))]
#[x_kube(validation = Rule::new("self.strategy == 'mps' ? has(self.mps) : !has(self.mps)").message("spec.mps must be set when, and only when, strategy is mps"))]
#[x_kube(validation = Rule::new("self.strategy == 'mig' ? has(self.mig) : !has(self.mig)").message("spec.mig must be set when, and only when, strategy is mig (MPS cannot be combined with MIG)"))]
#[x_kube(validation = Rule::new("self.strategy == 'vgpu' ? has(self.vgpu) : !has(self.vgpu)").message("spec.vgpu must be set when, and only when, strategy is vgpu"))]
#[x_kube(validation = Rule::new("!(self.strategy in ['vgpu', 'passthrough']) || !has(self.backend) || self.backend == 'devicePlugin'").message("strategies vgpu and passthrough serve virtual machines through the GPU Operator's sandbox device plugin: backend must be devicePlugin"))]
#[x_kube(validation = Rule::new("(has(self.backend) && self.backend == 'dra') == has(self.dra)").message("spec.dra must be set when, and only when, backend is dra"))]
#[x_kube(validation = Rule::new("!(has(self.backend) && self.backend == 'dra' && self.strategy == 'mig') || (has(self.dra) && has(self.dra.extendedResources) && self.dra.extendedResources)").message("backend dra serves MIG only with dra.extendedResources (pods keep asking for nvidia.com/mig-<profile>); with ResourceClaimTemplates MIG goes through the device plugin"))]
#[x_kube(validation = Rule::new("!(has(self.dra) && has(self.dra.extendedResources) && self.dra.extendedResources && self.strategy == 'mig') || (has(self.mig) && self.mig.migStrategy == 'mixed' && !has(self.mig.dynamic) && !has(self.mig.timeSlicing))").message("MIG through dra.extendedResources needs migStrategy: mixed (one DeviceClass per profile), no dynamic layouts and no mig.timeSlicing (the DRA driver's MIG devices take one claim each, whatever its consumableShares)"))]
#[x_kube(validation = Rule::new("!(has(self.dra) && has(self.dra.extendedResources) && self.dra.extendedResources && self.strategy == 'mps')").message("MPS cannot be served through DRA extended resources: the DRA driver cannot prepare an MPS claim while consumable shares are on; use extendedResources: false (ResourceClaimTemplates) or backend: devicePlugin"))]
#[x_kube(validation = Rule::new("!(has(self.dra) && has(self.dra.extendedResources) && self.dra.extendedResources && has(self.timeSlicing) && has(self.timeSlicing.resources) && size(self.timeSlicing.resources) > 0)").message("with dra.extendedResources, time-slicing takes one replicas value for every GPU (the DRA driver's consumable shares): timeSlicing.resources does not apply"))]
pub struct GpuSharingPolicySpec {
    /// Nodes this policy applies to. Admins usually label nodes (for example
    /// `gpusharing.io/profile=l4-heavy`) to pick a profile.
    pub node_selector: LabelSelector,

    /// When several policies select a node, the highest priority wins; ties go to the oldest
    /// policy, then to the name.
    #[serde(default)]
    pub priority: i32,

    /// How the GPUs are shared.
    pub strategy: Strategy,

    /// Settings for `strategy: timeSlicing`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub time_slicing: Option<TimeSlicing>,

    /// Settings for `strategy: mps`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mps: Option<Mps>,

    /// Settings for `strategy: mig`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mig: Option<Mig>,

    /// Settings for `strategy: vgpu`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vgpu: Option<Vgpu>,

    /// How the sharing reaches the nodes: NVIDIA's device plugin (ConfigMaps and node labels,
    /// the default) or NVIDIA's DRA driver (ResourceClaimTemplates with a GpuConfig).
    #[serde(default, skip_serializing_if = "Backend::is_device_plugin")]
    pub backend: Backend,

    /// Settings for `backend: dra`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dra: Option<Dra>,

    /// How changes reach the nodes: in waves of at most `maxUnavailable` unconfirmed nodes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rollout: Option<Rollout>,

    /// Stop starting node changes (as `kubectl rollout pause` does); status stays current and
    /// nodes already changing finish their transition.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub paused: bool,

    /// What to do when a change needs idle GPUs (a MIG layout change; with `drain`, also an
    /// MPS change while MPS clients run) and pods use them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disruption: Option<Disruption>,
}

/// Default of `spec.disruption.drainTimeoutSeconds`.
pub const DEFAULT_DRAIN_TIMEOUT_SECONDS: i64 = 600;

/// How a node is made idle for a change that needs idle GPUs.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Default, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Disruption {
    /// `wait` (the default): wait until no pod uses the node's GPUs, and report the pods.
    /// `drain`: cordon the node, evict the pods that use its GPUs through the Eviction API
    /// (PodDisruptionBudgets are respected), apply, then uncordon what the operator cordoned.
    #[serde(default)]
    pub mode: DisruptionMode,

    /// With `drain`: seconds the drain may take before the rollout halts. Default 600.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 10, max = 86400))]
    pub drain_timeout_seconds: Option<i64>,

    /// Pods that must never be evicted: a node running one waits until it finishes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub never_evict: Option<LabelSelector>,
}

/// `wait` or `drain`.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub enum DisruptionMode {
    #[default]
    Wait,
    Drain,
}

/// Default of `spec.rollout.maxUnavailable`.
pub const DEFAULT_MAX_UNAVAILABLE: &str = "25%";
/// Default of `spec.rollout.nodeTimeoutSeconds`.
pub const DEFAULT_NODE_TIMEOUT_SECONDS: i64 = 600;

/// Staged rollout of a policy's node changes.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Default, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct Rollout {
    /// Most nodes of this policy that may be unconfirmed at once: from the write that changes a
    /// node's config until NVIDIA's components confirm it. An integer, or a percentage of the
    /// policy's nodes rounded up (like a DaemonSet's); at least 1 node. Default `25%`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("type(self) == int ? self >= 1 : self.matches('^(100|[1-9][0-9]?)%$')").message("maxUnavailable must be an integer >= 1 or a percentage from 1% to 100%"))]
    pub max_unavailable: Option<k8s_openapi::apimachinery::pkg::util::intstr::IntOrString>,

    /// Seconds a node may stay unconfirmed before the rollout halts (`Progressing=False`,
    /// `RolloutHalted`). Default 600.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 10, max = 86400))]
    pub node_timeout_seconds: Option<i64>,
}

/// `devicePlugin` or `dra`.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub enum Backend {
    #[default]
    DevicePlugin,
    Dra,
}

impl Backend {
    pub fn is_device_plugin(&self) -> bool {
        *self == Backend::DevicePlugin
    }
}

/// Sharing through NVIDIA's DRA driver (`gpu.nvidia.com`), one of two ways: the operator
/// renders a `resource.k8s.io/v1` ResourceClaimTemplate with a `resource.nvidia.com/v1beta1`
/// GpuConfig in each of `namespaces`, and pods reference it in `resourceClaims`; or, with
/// `extendedResources`, pods keep asking for `nvidia.com/gpu` and kube-scheduler serves the
/// request through the DRA driver on the nodes already moved (KEP-5004).
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Default, KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("!has(self.namespaces) || self.namespaces.all(n, self.namespaces.exists_one(m, m == n))").message("namespaces must be unique"))]
#[x_kube(validation = Rule::new("(has(self.extendedResources) && self.extendedResources) || (has(self.namespaces) && size(self.namespaces) > 0)").message("namespaces must name at least one namespace (or set extendedResources: true to serve pods' unchanged nvidia.com/gpu requests)"))]
#[x_kube(validation = Rule::new("!(has(self.extendedResources) && self.extendedResources) || ((!has(self.namespaces) || size(self.namespaces) == 0) && !has(self.templateName) && !has(self.mps))").message("with extendedResources pods keep their nvidia.com/gpu requests and get no ResourceClaimTemplate: namespaces, templateName and mps do not apply"))]
pub struct Dra {
    /// Namespaces that get the ResourceClaimTemplate (not with `extendedResources`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 64), inner(length(min = 1, max = 63)))]
    #[x_kube(validation = Rule::new("self.all(n, n.matches('^[a-z0-9]([-a-z0-9]*[a-z0-9])?$'))").message("namespaces must be DNS labels"))]
    pub namespaces: Vec<String>,

    /// Serve pods' unchanged extended-resource requests (`nvidia.com/gpu`, or
    /// `nvidia.com/gpu.shared` with `timeSlicing.renameByDefault`; under `strategy: mig`,
    /// `nvidia.com/mig-<profile>`) through the DRA driver (Kubernetes' DRA extended resources,
    /// KEP-5004: beta and on by default from 1.36). The operator moves the policy's nodes from
    /// the device plugin to the DRA driver's kubelet plugin in rollout waves, each only once no
    /// device-plugin GPU pod runs on it (and a MIG layout is applied), and owns a DeviceClass
    /// mapping each name. Time-slicing `replicas: N` needs the driver's consumable shares N
    /// (`consumableShares: N`), exclusive GPUs need them off; MIG devices take one pod each
    /// whatever the shares (not time-sliced). Back to `backend: devicePlugin` moves the nodes
    /// back once their pods' claims are gone.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub extended_resources: bool,

    /// Name of the ResourceClaimTemplate (default: the policy's name).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 253))]
    #[x_kube(validation = Rule::new("self.matches('^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$')").message("templateName must be a DNS subdomain"))]
    pub template_name: Option<String>,

    /// Time-slice length for `strategy: timeSlicing`.
    #[serde(default)]
    pub time_slicing_interval: TimeSliceInterval,

    /// MPS settings beyond the defaults derived from `spec.mps.replicas`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mps: Option<DraMps>,

    /// The feature gates the DRA driver runs with (its Helm values): they decide what it accepts.
    #[serde(default)]
    pub driver_feature_gates: DraFeatureGates,
}

/// `Default`, `Short`, `Medium` or `Long`.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default, JsonSchema)]
pub enum TimeSliceInterval {
    #[default]
    Default,
    Short,
    Medium,
    Long,
}

/// MPS settings of the DRA driver's GpuConfig.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Default, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct DraMps {
    /// Share of SM threads per client; default 100 / replicas.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0, max = 100))]
    pub default_active_thread_percentage: Option<i32>,

    /// Pinned device memory per client (a Quantity, at least 1Mi); default GPU memory / replicas.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 32))]
    #[x_kube(validation = Rule::new("self.matches('^[0-9]+([.][0-9]+)?(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E|[eE][0-9]+)?$')").message("a memory quantity such as 10Gi, 1.5Gi or 35942Mi"))]
    pub default_pinned_device_memory_limit: Option<String>,

    /// Per-device overrides: device index or UUID -> Quantity.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    #[schemars(extend("maxProperties" = 64))]
    pub per_device_pinned_memory_limits: BTreeMap<String, String>,

    /// Start the MPS control daemon in multi-user mode (driver v0.5.0+, Volta or newer).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub multi_user: bool,
}

/// DRA driver feature gates that matter for sharing.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Default, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct DraFeatureGates {
    /// `MPSSupport` (alpha): needed for MPS.
    #[serde(default, rename = "MPSSupport")]
    pub mps_support: bool,
    /// `TimeSlicingSettings` (alpha): needed for time-slicing.
    #[serde(default, rename = "TimeSlicingSettings")]
    pub time_slicing_settings: bool,
    /// `DynamicMIG`: cannot be on together with MPSSupport.
    #[serde(default, rename = "DynamicMIG")]
    pub dynamic_mig: bool,
    /// `ConsumableShares` in a non-disabled mode: MPS claims cannot be prepared with it.
    #[serde(default, rename = "ConsumableShares")]
    pub consumable_shares: bool,
}

/// The sharing strategy.
#[derive(
    Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, JsonSchema,
)]
#[serde(rename_all = "camelCase")]
pub enum Strategy {
    /// One pod per GPU (no `sharing` section in the device-plugin config).
    Exclusive,
    /// CUDA time-slicing: replicas interleave on a GPU, without memory or fault isolation.
    TimeSlicing,
    /// CUDA MPS: replicas run concurrently, each limited to 1/replicas of memory and threads.
    Mps,
    /// Multi-Instance GPU partitions, optionally time-sliced.
    Mig,
    /// NVIDIA vGPU for virtual machines (KubeVirt): the vGPU Device Manager creates the vGPU
    /// devices, the sandbox device plugin advertises them as `nvidia.com/<mdev type>`.
    Vgpu,
    /// Whole GPUs handed to virtual machines through VFIO, advertised as
    /// `nvidia.com/<PCI device name>`.
    Passthrough,
}

impl Strategy {
    pub fn as_str(self) -> &'static str {
        match self {
            Strategy::Exclusive => "exclusive",
            Strategy::TimeSlicing => "timeSlicing",
            Strategy::Mps => "mps",
            Strategy::Mig => "mig",
            Strategy::Vgpu => "vgpu",
            Strategy::Passthrough => "passthrough",
        }
    }

    /// A strategy for virtual machines (the GPU Operator's sandbox workloads).
    pub fn is_vm(self) -> bool {
        matches!(self, Strategy::Vgpu | Strategy::Passthrough)
    }

    /// The node's `nvidia.com/gpu.workload.config` under this strategy.
    pub fn workload(self) -> &'static str {
        match self {
            Strategy::Vgpu => "vm-vgpu",
            Strategy::Passthrough => "vm-passthrough",
            _ => "container",
        }
    }
}

/// Time-slicing settings (NVIDIA device plugin `sharing.timeSlicing`).
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Default, KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("has(self.replicas) || (has(self.resources) && size(self.resources) > 0)").message("set replicas, or at least one entry in resources"))]
#[x_kube(validation = Rule::new("!has(self.resources) || self.resources.all(r, self.resources.exists_one(s, s.name == r.name))").message("resource names must be unique: duplicate entries make the device plugin and GPU Feature Discovery disagree"))]
pub struct TimeSlicing {
    /// Replicas of every GPU (or, for MIG, of every MIG instance) when `resources` is empty.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 2, max = 1024))]
    pub replicas: Option<i32>,

    /// Advertise shared resources as `<name>.shared` instead of `<name>`.
    #[serde(default)]
    pub rename_by_default: bool,

    /// Reject pods that ask for more than one replica (they would not get more GPU time).
    #[serde(default)]
    pub fail_requests_greater_than_one: bool,

    /// Per-resource entries, for example to time-slice `nvidia.com/mig-1g.10gb`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 32))]
    pub resources: Vec<SharedResource>,
}

/// One resource to replicate.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Default, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct SharedResource {
    /// Resource name: `nvidia.com/gpu` or `nvidia.com/mig-<profile>` (the `nvidia.com/` prefix is
    /// added when missing).
    #[schemars(length(min = 1, max = 63))]
    #[x_kube(validation = Rule::new("self.matches('^(nvidia\\\\.com/)?[a-z0-9]([-a-z0-9.]*[a-z0-9])?$')").message("resource name must be lower-case RFC 1123 (letters, digits, '-', '.') under nvidia.com/, e.g. nvidia.com/gpu or nvidia.com/mig-1g.10gb"))]
    pub name: String,

    /// Replicas of each device of this resource.
    #[schemars(range(min = 2, max = 1024))]
    pub replicas: i32,

    /// Name to advertise instead. Accepted by NVIDIA's parser but ignored at runtime by the
    /// device plugin (v0.20): the status carries a warning when set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 63))]
    #[x_kube(validation = Rule::new("self.matches('^(nvidia\\\\.com/)?[a-z0-9]([-a-z0-9.]*[a-z0-9])?$')").message("rename must be a lower-case RFC 1123 resource name"))]
    pub rename: Option<String>,

    /// Devices to replicate (indices or UUIDs); all when absent. Accepted by NVIDIA's parser but
    /// ignored at runtime: the status carries a warning when set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 64), inner(length(min = 1, max = 64)))]
    #[x_kube(validation = Rule::new("self.all(d, d.matches('^([0-9]+(:[0-9]+)?|(GPU|MIG)-[0-9a-fA-F-]+)$'))").message("a device is an index such as \"0\" (or \"0:1\" for a MIG device) or a GPU-/MIG- UUID"))]
    pub devices: Option<Vec<String>>,
}

/// MPS settings (NVIDIA device plugin `sharing.mps`). MPS only shares full GPUs
/// (`nvidia.com/gpu`) and cannot be combined with MIG.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Default, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Mps {
    /// Clients per GPU; each gets about 1/replicas of the memory and of the SM threads. At most 48
    /// (16 on GPUs of compute capability below 7.5).
    #[schemars(range(min = 2, max = 48))]
    pub replicas: i32,

    /// Advertise `nvidia.com/gpu.shared` instead of `nvidia.com/gpu`.
    #[serde(default)]
    pub rename_by_default: bool,
}

/// vGPU settings: which vGPU devices NVIDIA's vGPU Device Manager creates on each GPU.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("has(self.type) != has(self.customLayout)").message("set exactly one of type (a named entry of the vGPU Device Manager's config) and customLayout"))]
pub struct Vgpu {
    /// A named entry of the vGPU Device Manager's configuration (NVIDIA's default names one per
    /// vGPU type, e.g. `A100-1-5C`, `L4-6Q`, `H200-141C`); written to the node label
    /// `nvidia.com/vgpu.config`.
    #[serde(default, rename = "type", skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 63))]
    #[x_kube(validation = Rule::new("self.matches('^[a-zA-Z0-9]([-a-zA-Z0-9_.]*[a-zA-Z0-9])?$')").message("type must be a valid label value (it is written to the node label nvidia.com/vgpu.config)"))]
    pub type_: Option<String>,

    /// A custom layout: device groups with their vGPU type counts. Rendered into the operator's
    /// vGPU-devices ConfigMap under a content-addressed name, `custom-<policy>-<hash>`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 16))]
    pub custom_layout: Option<Vec<VgpuDeviceGroup>>,
}

/// One group of GPUs with the same vGPU devices.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("self.vgpuDevices.all(t, t.matches('^[A-Z0-9]+(-[a-zA-Z]+)*-(0|[1-9][0-9]*)[ABCQ]$') || t.matches('^[A-Z0-9]+-[1-9]-(0|[1-9][0-9]*)[ABCQ](ME|NOME|MEALL|GFX)?$'))").message("vGPU type names look like A10-12Q, L4-6Q, A100-40C (time-sliced) or A100-1-5C, H200-1-18CME (MIG-backed)"))]
#[x_kube(validation = Rule::new("self.vgpuDevices.all(t, self.vgpuDevices[t] >= 1 && self.vgpuDevices[t] <= 64)").message("vGPU device counts must be between 1 and 64"))]
#[x_kube(validation = Rule::new("self.vgpuDevices.all(t, t.matches('^[A-Z0-9]+-[1-9]-')) || self.vgpuDevices.all(t, !t.matches('^[A-Z0-9]+-[1-9]-'))").message("a group cannot mix time-sliced and MIG-backed vGPU types (the vGPU Device Manager refuses it)"))]
pub struct VgpuDeviceGroup {
    /// GPUs of this group: `all`, or a list of GPU indices (0-15), as the vGPU Device Manager
    /// writes them; all GPUs when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub devices: Option<GpuSelection>,

    /// vGPU type -> number of vGPU devices per GPU.
    #[schemars(extend("minProperties" = 1, "maxProperties" = 8))]
    pub vgpu_devices: BTreeMap<String, i32>,
}

/// MIG settings.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("has(self.layout) != has(self.customLayout)").message("set exactly one of layout (a named mig-parted layout) and customLayout"))]
#[x_kube(validation = Rule::new("!has(self.dynamic) || self.migStrategy == 'mixed'").message("dynamic needs migStrategy: mixed: under single every MIG device is advertised as nvidia.com/gpu, so pods cannot ask for a profile"))]
pub struct Mig {
    /// How MIG devices are advertised: `single` (all as `nvidia.com/gpu`) or `mixed`
    /// (`nvidia.com/mig-<profile>`). Cluster-wide in the GPU Operator.
    pub mig_strategy: MigStrategy,

    /// A named layout of the mig-parted configuration, e.g. `all-1g.10gb`, `all-balanced`,
    /// `all-disabled`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 63))]
    #[x_kube(validation = Rule::new("self.matches('^[a-z0-9A-Z]([-a-z0-9A-Z_.]*[a-z0-9A-Z])?$')").message("layout must be a valid label value (it is written to the node label nvidia.com/mig.config)"))]
    pub layout: Option<String>,

    /// A custom layout: device groups with their MIG profiles. Rendered into the mig-parted
    /// ConfigMap as `custom-<policy name>`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 16))]
    pub custom_layout: Option<Vec<MigDeviceGroup>>,

    /// Time-slicing of the MIG instances.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub time_slicing: Option<TimeSlicing>,

    /// Change the MIG layout even while pods that use GPUs run on the node. Off by default: MIG
    /// changes need idle GPUs (the MIG manager fails with "In use by another client"), so the
    /// operator waits (`Progressing`, reason `WaitingForIdleGPUs`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub proceed_with_busy_gpus: bool,

    /// Layouts that follow demand: an idle node may be reshaped to another layout of this
    /// catalogue when pending pods ask for MIG profiles no node offers (`mixed` only). The
    /// node starts with `layout`/`customLayout`, which stays in the catalogue.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dynamic: Option<DynamicMig>,
}

/// Demand-driven MIG: which layouts a node may be given for pending pods, and how cautiously.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("!(has(self.drainBusyNodes) && has(self.reserveBusyNodes))").message("set at most one of drainBusyNodes (evict) and reserveBusyNodes (wait for the pods to finish)"))]
#[x_kube(validation = Rule::new("!has(self.drainBusyNodes) || has(self.namespaceSelector)").message("drainBusyNodes needs a namespaceSelector: only pods of the namespaces it selects may make the operator evict other pods"))]
#[x_kube(validation = Rule::new("!(has(self.drainBusyNodes) || has(self.reserveBusyNodes)) || !has(self.minLayoutLifetimeSeconds) || self.minLayoutLifetimeSeconds >= 60").message("with drainBusyNodes or reserveBusyNodes, minLayoutLifetimeSeconds must be at least 60: a node may not be drained or cordoned again and again"))]
pub struct DynamicMig {
    /// Named mig-parted layouts (besides the policy's own) a node may be reshaped to. MIG must
    /// be enabled on every GPU they configure: switching MIG mode needs a GPU reset, which the
    /// catalogue never asks for.
    #[schemars(length(min = 1, max = 16), inner(length(min = 1, max = 63)))]
    #[x_kube(validation = Rule::new("self.all(l, l != 'all-disabled')").message("all-disabled switches MIG mode off: the catalogue holds MIG-enabled layouts only"))]
    #[x_kube(validation = Rule::new("self.all(l, l.matches('^[a-z0-9A-Z]([-a-z0-9A-Z_.]*[a-z0-9A-Z])?$'))").message("each layout must be a valid label value (it is written to the node label nvidia.com/mig.config)"))]
    pub layouts: Vec<String>,

    /// Only pods in the namespaces this selects count as demand (absent: every namespace).
    /// Required with `drainBusyNodes`. A pod elsewhere never reshapes a node, whatever it asks.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace_selector: Option<LabelSelector>,

    /// Seconds without new pending demand before the operator acts on it (batches a burst).
    #[serde(default = "default_quiet_seconds")]
    #[schemars(range(min = 0, max = 300))]
    pub quiet_seconds: i64,

    /// The longest demand waits for a quiet moment, in seconds.
    #[serde(default = "default_max_delay_seconds")]
    #[schemars(range(min = 0, max = 3600))]
    pub max_delay_seconds: i64,

    /// Seconds a node must have run no GPU pod before it may be reshaped.
    #[serde(default = "default_idle_seconds")]
    #[schemars(range(min = 0, max = 86400))]
    pub idle_seconds: i64,

    /// Seconds a layout stays on a node before demand may change it again (against flapping).
    #[serde(default = "default_min_layout_lifetime_seconds")]
    #[schemars(range(min = 0, max = 604800))]
    pub min_layout_lifetime_seconds: i64,

    /// Nodes running GPU pods may be drained to reshape them: the node is cordoned and its GPU
    /// pods are evicted through the Eviction API (PodDisruptionBudgets hold), then the MIG
    /// manager applies the layout. Absent (the default): demand waits for an idle node.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub drain_busy_nodes: Option<DemandDrain>,

    /// Nodes running GPU pods may be reserved to reshape them without evicting anything: the
    /// node is cordoned, so no new pod lands there, and reshaped once its GPU pods have
    /// finished; the cordon goes when the new layout is confirmed. What kube-scheduler's
    /// default profile needs: it spreads pods, so nodes seldom go idle by themselves.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reserve_busy_nodes: Option<DemandReserve>,

    /// Keep idle nodes free for reshapes: the operator puts the taint `gpusharing.io/spare`
    /// (`PreferNoSchedule`) on this policy's nodes that run no GPU pod, and takes it off a node
    /// once one runs there. kube-scheduler then fills busy nodes first and uses an idle one only
    /// when no other fits; no pod is refused. What its default profile needs: it spreads pods
    /// over nodes, so none stays idle long enough to be reshaped.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub prefer_busy_nodes: bool,
}

/// How long a reserved node may wait for its GPU pods to finish.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct DemandReserve {
    /// Seconds from the choice after which a node whose GPU pods still run is given back
    /// (uncordoned, keeping its layout); demand may then choose another.
    #[serde(default = "default_max_wait_seconds")]
    #[schemars(range(min = 60, max = 86400))]
    pub max_wait_seconds: i64,
}

fn default_max_wait_seconds() -> i64 {
    900
}

/// Which busy nodes demand may drain.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct DemandDrain {
    /// The priority ceiling: a node running a GPU pod of higher priority (or one
    /// `disruption.neverEvict` protects) is never drained for demand. A node is drained only
    /// when its layout serves more pending pods, priority level by level from the highest, than
    /// it evicts.
    #[serde(default)]
    #[schemars(range(min = -2147483648, max = 1000000000))]
    pub max_pod_priority: i32,

    /// At most this many nodes of the policy drained for demand in any hour (default 1).
    #[serde(default = "default_max_drains_per_hour")]
    #[schemars(range(min = 1, max = 100))]
    pub max_drains_per_hour: i32,
}

fn default_max_drains_per_hour() -> i32 {
    1
}

fn default_quiet_seconds() -> i64 {
    2
}
fn default_max_delay_seconds() -> i64 {
    10
}
fn default_idle_seconds() -> i64 {
    30
}
fn default_min_layout_lifetime_seconds() -> i64 {
    600
}

/// `single` or `mixed`.
#[derive(
    Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, JsonSchema,
)]
#[serde(rename_all = "camelCase")]
pub enum MigStrategy {
    Single,
    Mixed,
}

impl Mig {
    /// This MIG spec with the named `layout` in place of its own (named or custom): what a node
    /// runs when demand gave it another layout of `dynamic.layouts`.
    pub fn with_layout(&self, layout: &str) -> Mig {
        Mig {
            layout: Some(layout.into()),
            custom_layout: None,
            ..self.clone()
        }
    }
}

impl GpuSharingPolicySpec {
    /// This spec with its MIG layout replaced by the named `layout` (see [`Mig::with_layout`]).
    pub fn with_mig_layout(&self, layout: &str) -> GpuSharingPolicySpec {
        GpuSharingPolicySpec {
            mig: self.mig.as_ref().map(|m| m.with_layout(layout)),
            ..self.clone()
        }
    }
}

impl MigStrategy {
    pub fn as_str(self) -> &'static str {
        match self {
            MigStrategy::Single => "single",
            MigStrategy::Mixed => "mixed",
        }
    }
}

/// One group of GPUs with the same MIG setting.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("self.migEnabled ? (has(self.migDevices) && size(self.migDevices) > 0) : (!has(self.migDevices) || size(self.migDevices) == 0)").message("migDevices is required when migEnabled is true and must be empty when it is false"))]
#[x_kube(validation = Rule::new("!has(self.migDevices) || self.migDevices.all(p, p.matches('^([1-9][0-9]?c\\\\.)?[1-9]g\\\\.[0-9]+gb(\\\\+me|\\\\+me\\\\.all|\\\\+gfx|-me)?$'))").message("MIG profile names look like 1g.10gb, 1c.2g.20gb, 1g.10gb+me, 1g.24gb+gfx, 1g.24gb-me or 1g.24gb+me.all"))]
#[x_kube(validation = Rule::new("!has(self.migDevices) || self.migDevices.all(p, self.migDevices[p] >= 1 && self.migDevices[p] <= 7)").message("MIG device counts must be between 1 and 7 (mig-parted rejects 0)"))]
pub struct MigDeviceGroup {
    /// GPUs of this group: `all`, or a list of GPU indices (0-15), as mig-parted writes them;
    /// all GPUs when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub devices: Option<GpuSelection>,

    /// Whether MIG mode is on for these GPUs.
    pub mig_enabled: bool,

    /// MIG profile -> number of instances per GPU.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    #[schemars(extend("maxProperties" = 16))]
    pub mig_devices: BTreeMap<String, i32>,
}

impl MigDeviceGroup {
    /// The GPU indices of this group, `None` for all GPUs (`devices` absent or `all`).
    pub fn indices(&self) -> Option<&[i32]> {
        self.devices.as_ref().and_then(GpuSelection::indices)
    }
}

impl VgpuDeviceGroup {
    /// The GPU indices of this group, `None` for all GPUs (`devices` absent or `all`).
    pub fn indices(&self) -> Option<&[i32]> {
        self.devices.as_ref().and_then(GpuSelection::indices)
    }
}

/// The GPUs a device group applies to, as NVIDIA's mig-parted and vGPU Device Manager configs
/// write `devices`: the word `all`, or a list of GPU indices.
///
/// No admission rule can check this field: a structural schema cannot type "a string or a
/// list" (only int-or-string), so the field keeps what it is given, and CEL cannot see a field
/// without a type. Anything else than `all` or a list of integers is kept as
/// [`GpuSelection::Invalid`], so that the policy still reads, and the planner refuses the
/// policy with a status condition naming the field (`validate`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(from = "RawGpuSelection", into = "RawGpuSelection")]
pub enum GpuSelection {
    /// `devices: all`.
    All,
    /// `devices: [0, 1]`.
    Indices(Vec<i32>),
    /// Anything else, as written.
    Invalid(serde_json::Value),
}

impl GpuSelection {
    /// The listed indices, `None` for `all`; an invalid value lists no GPU.
    pub fn indices(&self) -> Option<&[i32]> {
        match self {
            GpuSelection::All => None,
            GpuSelection::Indices(d) => Some(d),
            GpuSelection::Invalid(_) => Some(&[]),
        }
    }
}

/// The most GPU indices a `devices` list may hold (a node has at most 16 GPUs).
const MAX_GPU_INDICES: usize = 16;

/// The wire form of [`GpuSelection`].
#[derive(Serialize, Deserialize)]
#[serde(untagged)]
enum RawGpuSelection {
    List(Vec<i32>),
    Other(serde_json::Value),
}

impl From<RawGpuSelection> for GpuSelection {
    fn from(raw: RawGpuSelection) -> Self {
        match raw {
            // A GPU index is 0-15: a longer list cannot be valid, and is not kept whole.
            RawGpuSelection::List(d) if d.len() > MAX_GPU_INDICES => {
                GpuSelection::Invalid(format!("a list of {} GPU indices", d.len()).into())
            }
            RawGpuSelection::List(d) => GpuSelection::Indices(d),
            RawGpuSelection::Other(v) if v.as_str() == Some("all") => GpuSelection::All,
            RawGpuSelection::Other(v) => GpuSelection::Invalid(v),
        }
    }
}

impl From<GpuSelection> for RawGpuSelection {
    fn from(s: GpuSelection) -> Self {
        match s {
            GpuSelection::All => RawGpuSelection::Other("all".into()),
            GpuSelection::Indices(d) => RawGpuSelection::List(d),
            GpuSelection::Invalid(v) => RawGpuSelection::Other(v),
        }
    }
}

impl JsonSchema for GpuSelection {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        "GpuSelection".into()
    }

    fn inline_schema() -> bool {
        true
    }

    fn json_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
        schemars::json_schema!({ "x-kubernetes-preserve-unknown-fields": true })
    }
}

/// Observed state, written by the controller.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Default, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct GpuSharingPolicyStatus {
    /// The generation this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,

    /// `Accepted`, `Ready`, `Conflicted`, `Degraded`, `Progressing`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,

    /// Replicas per GPU (or per MIG instance) this policy advertises; 1 for exclusive.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replicas: Option<i32>,

    /// `applied/matched`, for `kubectl get gsp`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nodes: Option<String>,

    /// Nodes the selector matches.
    #[serde(default)]
    pub matched_nodes: i32,

    /// Matched nodes where this policy's configuration is in place.
    #[serde(default)]
    pub applied_nodes: i32,

    /// Matched nodes another policy of the same priority wins (by age or name): a conflict.
    #[serde(default)]
    pub conflicting_nodes: i32,

    /// Matched nodes a policy of higher priority wins: an intended override, not a conflict.
    #[serde(default)]
    pub overridden_nodes: i32,

    /// Key of the device-plugin ConfigMap the nodes are labelled with.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device_config_key: Option<String>,

    /// ResourceClaimTemplates rendered for `backend: dra` (`namespace/name`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub templates: Vec<String>,

    /// Which backend serves the governed nodes' GPUs now, as the nodes report it: `devicePlugin`
    /// (it advertises them), `draDriver` (the DRA driver's ResourceSlice shows them), `none`
    /// (between the two), `both` (never while this operator switches them). Set for DRA
    /// policies and while any governed node is served by the DRA driver.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub served_by: BTreeMap<String, i32>,

    /// Namespaces whose ResourceQuota limits one of the two names a GPU request of this policy
    /// is counted under and not the other (`requests.<name>` and our DeviceClass's
    /// `<class>.deviceclass.resource.k8s.io/devices`; KEP-5004 asks quotas to cover both). For
    /// policies with `dra.extendedResources`; at most 10, then a count.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub quota_gaps: Vec<String>,

    /// mig-parted layout the nodes are labelled with (MIG only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mig_config: Option<String>,

    /// vGPU Device Manager config the nodes are labelled with (vGPU only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vgpu_config: Option<String>,

    /// What the matched nodes offer under this policy.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub capacity: Option<Capacity>,

    /// Per-node detail, at most 50 entries (non-ready nodes first).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub node_details: Vec<NodeDetail>,

    /// Settings NVIDIA accepts but does not act on, and similar caveats.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub warnings: Vec<String>,

    /// Governed nodes whose change is written but not yet confirmed by NVIDIA's components.
    #[serde(default)]
    pub unavailable_nodes: i32,

    /// Progress of the rollout of the current generation.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rollout: Option<RolloutStatus>,

    /// Governed nodes held as they are, by why (every node counted, not only those listed in
    /// `nodeDetails`).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub held_nodes: BTreeMap<crate::api::state::HoldReason, i32>,

    /// A custom MIG layout's instances on each GPU model of its nodes, with the free slots
    /// left: for example `customLayout[0] on A100-SXM4-80GB: [3g.40gb@4][2g.20gb@0]
    /// [1g.10gb@2][1g.10gb@3], free: none` (the start is the first memory slice; the MIG
    /// manager's driver may choose other starts for the same instances).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub mig_geometry: Vec<String>,

    /// What Karpenter is told about the nodes this policy would configure: the NodeOverlays
    /// the operator keeps for it, which NodePools matched and why others did not. Absent when
    /// the NodeOverlay kind is not served.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub autoscaling: Option<AutoscalingStatus>,

    /// Demand-driven MIG (`spec.mig.dynamic`): the pending pods' demand per profile, what
    /// serves it, and why the rest waits.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub demand: Option<DemandStatus>,
    /// Writes for this policy the API server refused (an admission webhook or policy, a
    /// conflicting object it cannot change): the object and the API's answer, at most 10. The
    /// rest of the pass went on; each is retried with a growing delay (up to a minute).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub refused_writes: Vec<RefusedWrite>,
}

/// One write the API server refused.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, PartialOrd, Ord, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RefusedWrite {
    /// `Node`, `ResourceClaimTemplate`, `ConfigMap`, `ClusterPolicy`, `NodeOverlay`.
    pub kind: String,
    /// The object (`namespace/name` when namespaced).
    pub name: String,
    /// The API server's answer.
    pub message: String,
}

/// Pending MIG demand of a dynamic policy.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Default, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct DemandStatus {
    /// Per MIG profile (`1g.10gb`...): instances pending pods ask for, how many of them free
    /// instances or nodes being reshaped will serve, and why the rest waits.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub profiles: Vec<ProfileDemand>,
    /// Nodes being reshaped for demand: `node: layout`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub reshaping: Vec<String>,
    /// Pending pods left out of demand by a bound (`TooManyPendingPods`, `TooManyLabelKeys`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ignored: Vec<IgnoredDemand>,
    /// Nodes drained for demand in the last hour, and when (`drainBusyNodes.maxDrainsPerHour`
    /// counts them; the operator keeps this list).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub recent_drains: Vec<RecentDrain>,
}

/// A node drained for demand, at unix seconds `at`.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Default, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RecentDrain {
    pub node: String,
    pub at: i64,
}

/// Pending pods a bound of demand planning left out, and why.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Default, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct IgnoredDemand {
    pub reason: String,
    pub pods: i64,
    pub message: String,
}

/// Demand for one MIG profile.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Default, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ProfileDemand {
    pub profile: String,
    /// Instances asked for by pods the scheduler could not place.
    pub pending: i64,
    /// Of those, instances free now on the policy's nodes.
    pub served: i64,
    /// Of those, instances nodes being reshaped will bring.
    pub coming: i64,
    /// Why demand left over waits (`ProfileNotInCatalogue`, `NoMatchingNode`, `NoIdleNode`,
    /// `Cooldown`, `BudgetExhausted`, `RolloutStopped`, `Infeasible`, `ProfileInUse`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
}

/// Autoscaler-visible capacity of a policy (Karpenter NodeOverlays).
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Default, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct AutoscalingStatus {
    /// The overlays kept for this policy, one per capacity class.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub overlays: Vec<NodeOverlayStatus>,
    /// Every NodePool, whether the policy would select its nodes, and why (not).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub node_pools: Vec<NodePoolMatch>,
    /// Instance types left to another actor's overlay, and errors of the instance-type table.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conflicts: Vec<String>,
    /// What becomes of the nodes Karpenter launches for the policy, where the overlay alone
    /// does not say it (pools served by the DRA driver through extended resources).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub launched_nodes: Option<String>,
}

/// One NodeOverlay of a policy.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Default, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct NodeOverlayStatus {
    pub name: String,
    /// The extended resources it sets, as a node of these instance types will advertise them.
    pub capacity: BTreeMap<String, String>,
    /// The instance types it names; empty when it matches types by a provider's GPU-count label.
    pub instance_types: Vec<String>,
    pub node_pools: Vec<String>,
    /// The provider GPU-count label it matches instance types by (`key=value`), for NodePools
    /// that pin one: types no node or table showed get the capacity too.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu_count_label: Option<String>,
}

/// Whether a NodePool's nodes would be selected by the policy.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Default, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct NodePoolMatch {
    pub name: String,
    pub matched: bool,
    pub reason: String,
}

/// Where the rollout of the current generation stands.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Default, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RolloutStatus {
    /// The budget in nodes (`spec.rollout.maxUnavailable` resolved against the governed nodes).
    pub max_unavailable: i32,
    /// Governed nodes waiting for their wave.
    #[serde(default)]
    pub queued_nodes: i32,
    /// Device-plugin config keys of this policy that nodes still use besides the current one.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub previous_device_config_keys: Vec<String>,
    /// The generation whose rollout halted (a node failed or timed out); a new generation
    /// resumes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub halted_generation: Option<i64>,
    /// The nodes that halted it.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub halted_nodes: Vec<String>,
}

/// A standard Kubernetes condition.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Condition {
    #[serde(rename = "type")]
    pub type_: ConditionType,
    pub status: ConditionStatus,
    pub reason: Reason,
    pub message: String,
    /// When the status last changed. Absent only in offline `render` output.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_transition_time: Option<Time>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
}

/// Effective capacity of the applied nodes.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Default, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Capacity {
    /// Physical GPUs on the applied nodes.
    pub physical_gpus: i64,
    /// Schedulable `nvidia.com/*` units: GPUs (or MIG instances) x replicas.
    pub schedulable_replicas: i64,
    /// Memory a client can use, in MiB (smallest across nodes). MPS: pinned limit
    /// floor(memory / replicas); time-slicing: the whole GPU, shared without isolation; MIG: the
    /// instance's memory.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_per_client_mib: Option<i64>,
    /// Share of the SM threads per client (MPS: 100 / replicas).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub threads_per_client_percent: Option<i64>,
    /// Whether clients are isolated from each other's memory (MPS limits, MIG partitions) or not
    /// (time-slicing).
    pub memory_isolation: bool,
}

/// The state of one matched node.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct NodeDetail {
    pub name: String,
    pub state: NodeState,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub message: String,
    /// Why the node is held as it is (`Waiting` and `Queued` nodes).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<crate::api::state::HoldReason>,
    /// What serves the node's GPUs now (`devicePlugin`, `draDriver`, `none`, `both`): for DRA
    /// policies' nodes and nodes the DRA driver serves.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub served_by: Option<String>,
}
