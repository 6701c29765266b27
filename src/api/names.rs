//! Every name the operator writes or reads on other objects: node labels and annotations, the
//! field manager, the finalizer, the labels and names of the ConfigMaps it owns. One place, so
//! that what is written in one module and read in another cannot drift apart.

/// Node label that selects the device-plugin config key.
pub const LABEL_DEVICE_PLUGIN_CONFIG: &str = "nvidia.com/device-plugin.config";
/// Node label that selects the MIG layout.
pub const LABEL_MIG_CONFIG: &str = "nvidia.com/mig.config";
/// Node label where the MIG manager reports progress.
pub const LABEL_MIG_STATE: &str = "nvidia.com/mig.config.state";
/// The GPU Operator's per-node switch of the device-plugin DaemonSet (it selects `"true"`).
/// `false` on nodes a DRA policy governs: the DRA driver alone advertises their GPUs.
pub const LABEL_DEPLOY_DEVICE_PLUGIN: &str = "nvidia.com/gpu.deploy.device-plugin";
/// The per-node switch of NVIDIA's DRA kubelet plugin (the GPU Operator's label; the DRA
/// driver's chart selects it with `kubeletPlugin.nodeSelector`): `true` on the nodes a policy
/// with `dra.extendedResources` has moved, once the device plugin has withdrawn its resources.
pub const LABEL_DEPLOY_DRA_DRIVER: &str = "nvidia.com/gpu.deploy.dra-driver";
/// NVIDIA's DRA driver's name, as its ResourceSlices, claims and device attributes carry it.
pub const DRA_DRIVER: &str = "gpu.nvidia.com";
/// The GPU Operator's per-node workload: `container`, `vm-passthrough` or `vm-vgpu` (read only
/// while `ClusterPolicy.spec.sandboxWorkloads.enabled` is true).
pub const LABEL_WORKLOAD: &str = "nvidia.com/gpu.workload.config";
/// Node label naming the vGPU Device Manager's config (`vm-vgpu` nodes).
pub const LABEL_VGPU_CONFIG: &str = "nvidia.com/vgpu.config";
/// Node label where the vGPU Device Manager reports progress (`pending`, `success`, `failed`).
pub const LABEL_VGPU_STATE: &str = "nvidia.com/vgpu.config.state";
/// The GPU Operator's per-node switches of the sandbox device plugin and the vGPU Device
/// Manager (a VM strategy cannot work where they are `false`).
pub const LABEL_DEPLOY_SANDBOX_DEVICE_PLUGIN: &str = "nvidia.com/gpu.deploy.sandbox-device-plugin";
pub const LABEL_DEPLOY_VGPU_DEVICE_MANAGER: &str = "nvidia.com/gpu.deploy.vgpu-device-manager";
/// Node label naming the policy that governs the node (informational, ours).
pub const LABEL_POLICY: &str = "gpusharing.io/policy";
pub const LABEL_GPU_COUNT: &str = "nvidia.com/gpu.count";
pub const LABEL_GPU_MEMORY: &str = "nvidia.com/gpu.memory";
pub const LABEL_GPU_PRODUCT: &str = "nvidia.com/gpu.product";
pub const LABEL_GPU_REPLICAS: &str = "nvidia.com/gpu.replicas";
/// GFD: `none`, `time-slicing` or `mps`.
pub const LABEL_GPU_SHARING_STRATEGY: &str = "nvidia.com/gpu.sharing-strategy";
pub const LABEL_MIG_CAPABLE: &str = "nvidia.com/mig.capable";
pub const LABEL_CC_MAJOR: &str = "nvidia.com/gpu.compute.major";
pub const LABEL_CC_MINOR: &str = "nvidia.com/gpu.compute.minor";

/// Node label GPU Feature Discovery sets to the unix time (seconds) of its last labelling.
pub const LABEL_GFD_TIMESTAMP: &str = "nvidia.com/gfd.timestamp";

/// Node annotation (ours): unix time (seconds) at which we last changed the node's
/// `nvidia.com/device-plugin.config`. GFD's timestamp newer than it confirms the new config.
pub const ANNOTATION_CONFIG_WRITTEN: &str = "gpusharing.io/device-plugin-config-written";
/// Node annotation (ours): `<layout>@<content hash>`, the MIG layout we labelled the node with
/// and what that name meant then. A named layout whose content changes later (a GPU Operator
/// upgrade) is detected by comparing it with what the name means now.
pub const ANNOTATION_MIG_LAYOUT: &str = "gpusharing.io/mig-layout-content";
/// Default key of the readiness taint (`run --readiness-taint`): new GPU nodes registered with
/// it (`NoSchedule`) get it removed once their sharing config is confirmed.
pub const DEFAULT_READINESS_TAINT: &str = "gpusharing.io/unconfigured";

/// Node annotation marking a change the operator started on the node for a policy's rollout:
/// `<policy generation>/<unix seconds>/<target>` (target: the config key, `+<MIG layout>` for
/// MIG). A node whose mark names its policy's current target and is not confirmed counts
/// against the rollout budget, whatever happened to the operator in between.
pub const ANNOTATION_ROLLOUT: &str = "gpusharing.io/rollout";
/// The taint Kubernetes puts on a cordoned node (`spec.unschedulable`): demand planning judges
/// a cordon as this taint, unless the cordon is one of our drains' (it goes when the node is
/// confirmed).
pub const TAINT_UNSCHEDULABLE: &str = "node.kubernetes.io/unschedulable";

/// The taint (`PreferNoSchedule`, no value) the operator keeps on the idle nodes of a dynamic MIG
/// policy with `preferBusyNodes`, so that kube-scheduler fills busy nodes first and idle ones stay
/// free for a reshape. Soft: a pod that fits nowhere else still lands there.
pub const TAINT_SPARE: &str = "gpusharing.io/spare";
/// The effect of [`TAINT_SPARE`].
pub const TAINT_SPARE_EFFECT: &str = "PreferNoSchedule";
/// The kind under which a refused write of [`TAINT_SPARE`] is remembered (its retry delay) and
/// shown in `status.refusedWrites`: apart from the node's label writes, so it holds no rollout.
pub const REFUSED_SPARE_TAINT: &str = "NodeTaint";

/// Node annotation: the operator cordoned this node to drain it (`spec.unschedulable` is set in
/// the same apply). Only a node with it is ever uncordoned by the operator, so a cordon of
/// someone else's (e.g. the GPU Operator's driver upgrade) is left alone, across restarts.
pub const ANNOTATION_CORDONED: &str = "gpusharing.io/cordoned";
/// Node annotation: `<layout>@<unix seconds>`, the MIG layout demand (`spec.mig.dynamic`) chose
/// for the node and since when. Written by its own field manager ([`DEMAND_MANAGER`]), so the
/// node's other metadata applies never remove it; the node's layout follows it.
pub const ANNOTATION_MIG_DEMAND: &str = "gpusharing.io/mig-demand-layout";
/// The field manager of [`ANNOTATION_MIG_DEMAND`].
pub const DEMAND_MANAGER: &str = "gpu-sharing-operator-demand";
/// The annotations the planner reads on a node: ours, and the demand's layout.
pub const OBSERVED_ANNOTATIONS: [&str; 5] = [
    ANNOTATION_CONFIG_WRITTEN,
    ANNOTATION_MIG_LAYOUT,
    ANNOTATION_ROLLOUT,
    ANNOTATION_CORDONED,
    ANNOTATION_MIG_DEMAND,
];
/// The annotations this operator may own on a node.
pub const MANAGED_ANNOTATIONS: [&str; 4] = [
    ANNOTATION_CONFIG_WRITTEN,
    ANNOTATION_MIG_LAYOUT,
    ANNOTATION_ROLLOUT,
    ANNOTATION_CORDONED,
];
/// Policy annotation: while present, nodes whose named MIG layout changed content since they
/// were configured are re-applied through `all-disabled`.
pub const ANNOTATION_REAPPLY_MIG: &str = "gpusharing.io/reapply-mig-layout";

/// The labels this operator may own on a node.
pub const MANAGED_LABELS: [&str; 9] = [
    LABEL_DEVICE_PLUGIN_CONFIG,
    LABEL_MIG_CONFIG,
    LABEL_MIG_STATE,
    LABEL_POLICY,
    LABEL_DEPLOY_DEVICE_PLUGIN,
    LABEL_DEPLOY_DRA_DRIVER,
    LABEL_WORKLOAD,
    LABEL_VGPU_CONFIG,
    LABEL_VGPU_STATE,
];

/// Labels that change as a result of what this operator does (directly, or through GPU Feature
/// Discovery reacting to the new config). A selector over them would make a node flap in and out
/// of its own policy, so they are refused in `nodeSelector`.
pub const UNSTABLE_LABELS: [&str; 13] = [
    LABEL_DEVICE_PLUGIN_CONFIG,
    LABEL_DEPLOY_DEVICE_PLUGIN,
    LABEL_DEPLOY_DRA_DRIVER,
    LABEL_WORKLOAD,
    LABEL_VGPU_CONFIG,
    LABEL_VGPU_STATE,
    LABEL_MIG_CONFIG,
    LABEL_MIG_STATE,
    LABEL_POLICY,
    LABEL_GPU_REPLICAS,
    LABEL_GPU_SHARING_STRATEGY,
    "nvidia.com/mps.capable",
    LABEL_GFD_MIG_STRATEGY,
];

/// GFD's report of the device plugin's MIG strategy (the ClusterPolicy's `mig.strategy`).
pub const LABEL_GFD_MIG_STRATEGY: &str = "nvidia.com/mig.strategy";

/// GFD appends `-SHARED` to the product when a GPU is shared without renaming.
pub const SHARED_SUFFIX: &str = "-SHARED";

/// Our server-side apply field manager.
pub const MANAGER: &str = "gpu-sharing-operator";
/// Finalizer on policies: their node labels and config keys are removed before they go.
pub const FINALIZER: &str = "gpusharing.io/cleanup";
/// The GPU Operator's ConfigMap with the standard named MIG layouts.
pub const DEFAULT_MIG_CONFIGMAP: &str = "default-mig-parted-config";

/// Label on the ConfigMaps we own.
pub const MANAGED_BY: (&str, &str) = ("app.kubernetes.io/managed-by", "gpu-sharing-operator");
/// Label that says which config a ConfigMap holds.
pub const CONFIG_LABEL: &str = "gpusharing.io/config";

/// Default name of the device-plugin ConfigMap the operator owns.
pub const DEVICE_PLUGIN_CONFIGMAP: &str = "gpu-sharing-device-plugin-config";
/// The GPU Operator's ConfigMap with NVIDIA's named vGPU-devices configs.
pub const DEFAULT_VGPU_CONFIGMAP: &str = "default-vgpu-devices-config";
/// Default name of the vGPU-devices ConfigMap the operator owns (custom vGPU layouts).
pub const VGPU_DEVICES_CONFIGMAP: &str = "gpu-sharing-vgpu-devices-config";
/// Default name of the mig-parted ConfigMap the operator owns.
pub const MIG_PARTED_CONFIGMAP: &str = "gpu-sharing-mig-parted-config";
/// The admin's table of instance types and their GPUs, for Karpenter NodeOverlays (key
/// `instance-types.yaml`; the admin writes it, the operator only reads it).
pub const INSTANCE_TYPES_CONFIGMAP: &str = "gpu-sharing-instance-types";

/// Kubernetes' well-known instance-type label (Karpenter's too).
pub const LABEL_INSTANCE_TYPE: &str = "node.kubernetes.io/instance-type";
/// The label Karpenter puts on a NodePool's nodes (and matches overlays on).
pub const LABEL_NODEPOOL: &str = "karpenter.sh/nodepool";
/// The suffix of a DeviceClass's device-count quota (`<class>.deviceclass.resource.k8s.io/devices`).
pub const DEVICE_CLASS_QUOTA_SUFFIX: &str = ".deviceclass.resource.k8s.io/devices";
/// Karpenter's label on a node whose NodeClaim it initialized (Ready, startup taints gone, every
/// resource its pods asked for registered).
pub const LABEL_KARPENTER_INITIALIZED: &str = "karpenter.sh/initialized";
/// The providers' GPU-count labels on Karpenter's instance types: a NodePool that pins one has
/// nodes of that many GPUs whatever the instance type.
pub const PROVIDER_COUNT_LABELS: [&str; 2] = [
    "karpenter.k8s.aws/instance-gpu-count",
    "karpenter.azure.com/sku-gpu-count",
];
/// Cloud providers' GPU labels on Karpenter's instance types (AWS, Azure), kept from nodes so
/// that NodePool requirements on them can be judged.
pub const PROVIDER_GPU_LABELS: [&str; 5] = [
    "karpenter.k8s.aws/instance-gpu-count",
    "karpenter.k8s.aws/instance-gpu-name",
    "karpenter.k8s.aws/instance-gpu-memory",
    "karpenter.azure.com/sku-gpu-count",
    "karpenter.azure.com/sku-gpu-name",
];
