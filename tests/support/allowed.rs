//! What the operator may write, reviewed and written out here once, literally: NVIDIA's keys
//! it drives and its own bookkeeping. Not taken from the operator's constants, so a key added
//! to the operator (or to an admission policy) without review fails the tests that compare
//! them with this list (`tests/e2e_admission.rs`), and the ownership check
//! ([`super::ownership`]) judges writes against this list, not against the operator's idea of
//! itself.

/// Node labels: NVIDIA's selectors the operator sets (device-plugin config, MIG layout and the
/// `pending` it writes with a layout change, the device-plugin switch for DRA and the DRA
/// kubelet plugin's switch for extended resources, the sandbox workload and vGPU config with
/// its `pending`), and our policy label.
pub const NODE_LABELS: [&str; 9] = [
    "nvidia.com/device-plugin.config",
    "nvidia.com/mig.config",
    "nvidia.com/mig.config.state",
    "gpusharing.io/policy",
    "nvidia.com/gpu.deploy.device-plugin",
    "nvidia.com/gpu.deploy.dra-driver",
    "nvidia.com/gpu.workload.config",
    "nvidia.com/vgpu.config",
    "nvidia.com/vgpu.config.state",
];

/// Node annotations: our bookkeeping only (the last, the layout demand chose, under the
/// demand's own field manager).
pub const NODE_ANNOTATIONS: [&str; 5] = [
    "gpusharing.io/device-plugin-config-written",
    "gpusharing.io/mig-layout-content",
    "gpusharing.io/rollout",
    "gpusharing.io/cordoned",
    "gpusharing.io/mig-demand-layout",
];

/// Taints the operator may remove (its readiness taint, `gpusharing.io/unconfigured` by
/// default, configurable under this prefix).
pub const TAINT_PREFIX: &str = "gpusharing.io/";

/// The node's own fields the operator may set besides labels and annotations: the cordon of a
/// drain.
pub const NODE_SPEC_FIELDS: [&str; 1] = ["spec.unschedulable"];

/// ClusterPolicy settings that point NVIDIA's components at our configs: all the operator may
/// change in a ClusterPolicy (`config/clusterpolicy-admission-policy.yaml` lets its
/// ServiceAccount change nothing else).
pub const CLUSTER_POLICY_FIELDS: [&str; 7] = [
    "spec.devicePlugin.config.name",
    "spec.devicePlugin.config.default",
    "spec.migManager.config.name",
    "spec.mig.strategy",
    "spec.sandboxWorkloads.enabled",
    "spec.vgpuDeviceManager.config.name",
    "spec.vgpuDeviceManager.config.default",
];

/// The label marking a ConfigMap as ours (only such ConfigMaps may be written).
pub const CONFIGMAP_OWNER_LABEL: (&str, &str) =
    ("app.kubernetes.io/managed-by", "gpu-sharing-operator");

/// Our field manager.
pub const FIELD_MANAGER: &str = "gpu-sharing-operator";

/// The demand's field manager: it may hold, and change, one node annotation only (the last of
/// [`NODE_ANNOTATIONS`], the layout demand chose), and nothing else anywhere.
pub const DEMAND_FIELD_MANAGER: &str = "gpu-sharing-operator-demand";
pub const DEMAND_NODE_ANNOTATION: &str = "gpusharing.io/mig-demand-layout";

/// The same strings as a sorted list, for comparing with another list in any order.
pub fn sorted(list: &[&str]) -> Vec<String> {
    let mut v: Vec<String> = list.iter().map(|s| s.to_string()).collect();
    v.sort();
    v
}
