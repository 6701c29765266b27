//! What the planner knows of a node ([`NodeFacts`]), the readings of those facts that several
//! parts of the planner share, and how our writes change them. This file is a leaf of `plan/`: it uses nothing of its siblings, so the
//! per-node transition, the VM transition, capacity, the rollout and the converged view can
//! all read node facts the same way without importing each other.

use crate::api::names::{LABEL_GFD_TIMESTAMP, LABEL_GPU_COUNT, LABEL_GPU_MEMORY, LABEL_WORKLOAD};
use crate::api::state::NodeState;
use crate::nvidia::state::Workload;

use super::labels::{Labels, OwnedKeys, SmallMap};
use super::taint;

/// What the planner knows of a node.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct NodeFacts {
    pub name: String,
    pub labels: Labels,
    /// Managed labels whose value this operator's field manager owns (from managedFields).
    pub owned: OwnedKeys,
    /// The node's annotations under our keys ([`MANAGED_ANNOTATIONS`](crate::api::names::MANAGED_ANNOTATIONS)) only.
    pub annotations: Labels,
    /// Which of [`MANAGED_ANNOTATIONS`](crate::api::names::MANAGED_ANNOTATIONS) this operator's field manager owns.
    pub owned_annotations: OwnedKeys,
    /// `status.allocatable` of NVIDIA's extended resources (`nvidia.com/*`) only: what the
    /// device plugin (or the sandbox device plugin) advertises now. Capacity lingers after a
    /// plugin stops; allocatable drops to 0.
    pub allocatable: Labels,
    /// `NoSchedule` and `NoExecute` taints, with a cordon as `node.kubernetes.io/unschedulable`
    /// unless it is one of our drains': which pending pods the node may take (demand planning).
    pub taints: Vec<taint::Taint>,
    /// The node carries the operator's spare taint (`gpusharing.io/spare:PreferNoSchedule`,
    /// `preferBusyNodes`).
    pub spare: bool,
}

impl NodeFacts {
    /// Allocatable units of an extended resource (0 when absent or unparsable).
    pub fn allocatable(&self, resource: &str) -> i64 {
        self.allocatable
            .get(resource)
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    }

    /// NVIDIA device-plugin resources (`nvidia.com/gpu*`, `nvidia.com/mig-*`) still
    /// allocatable on the node, with their counts.
    pub fn device_plugin_resources(&self) -> Vec<(&str, i64)> {
        self.device_plugin_allocatable().collect()
    }

    /// The device plugin advertises at least one GPU resource on the node (allocatable > 0).
    pub fn advertises_gpus(&self) -> bool {
        self.device_plugin_allocatable().next().is_some()
    }

    fn device_plugin_allocatable(&self) -> impl Iterator<Item = (&str, i64)> {
        self.allocatable
            .iter()
            .filter(|(k, _)| is_device_plugin_resource(k))
            .filter_map(|(k, v)| Some((k, v.parse::<i64>().ok().filter(|c| *c > 0)?)))
    }
}

/// A resource NVIDIA's (container) device plugin advertises.
pub fn is_device_plugin_resource(name: &str) -> bool {
    name.starts_with("nvidia.com/gpu") || name.starts_with("nvidia.com/mig-")
}

/// A node label read as an integer (`None` when absent or not a number).
pub fn label_i64(n: &NodeFacts, key: &str) -> Option<i64> {
    n.labels.get(key).and_then(|v| v.parse().ok())
}

/// The most GPUs a node is believed to have. A node agent writes `nvidia.com/gpu.count`; a
/// value above this (or below 0) is read as unknown, so no loop or product over GPUs can be
/// made arbitrarily long or overflow by a label.
pub const MAX_GPUS_PER_NODE: i64 = 64;

/// The most memory per GPU believed, in MiB (4 TiB); `nvidia.com/gpu.memory` above it (or
/// below 1) is read as unknown.
pub const MAX_GPU_MEMORY_MIB: i64 = 1 << 22;

/// The node's GPU count as GPU Feature Discovery labels it, within [`MAX_GPUS_PER_NODE`].
pub fn gpu_count(n: &NodeFacts) -> Option<i64> {
    label_i64(n, LABEL_GPU_COUNT).filter(|c| (0..=MAX_GPUS_PER_NODE).contains(c))
}

/// The memory of each of the node's GPUs in MiB, within [`MAX_GPU_MEMORY_MIB`].
pub fn gpu_memory_mib(n: &NodeFacts) -> Option<i64> {
    label_i64(n, LABEL_GPU_MEMORY).filter(|m| (1..=MAX_GPU_MEMORY_MIB).contains(m))
}

/// The node is a VM host (by its workload label).
pub fn is_vm_host(n: &NodeFacts) -> bool {
    Workload::parse(n.labels.get(LABEL_WORKLOAD)).is_some_and(Workload::is_vm)
}

/// Resources the sandbox device plugin advertises on the node (`nvidia.com/<PCI device name>`
/// for passthrough, `nvidia.com/<mdev type>` for vGPU): NVIDIA resources that are not the
/// container device plugin's.
pub fn sandbox_resources(n: &NodeFacts) -> Vec<(&str, i64)> {
    n.allocatable
        .iter()
        .filter(|(k, _)| !is_device_plugin_resource(k))
        .filter_map(|(k, v)| Some((k, v.parse::<i64>().ok().filter(|c| *c > 0)?)))
        .collect()
}

/// Whether a sandbox resource is a vGPU type's (`nvidia.com/NVIDIA_<type>`, the mdev type's
/// name); passthrough GPUs go by their PCI device name (`nvidia.com/GA100_A100_SXM4_80GB`).
pub fn is_vgpu_resource(r: &str) -> bool {
    r.starts_with("nvidia.com/NVIDIA_")
}

/// When GPU Feature Discovery stamps the node and has not relabelled it since our device-plugin
/// config write at `written` (unix seconds): that write. A node GFD does not stamp is never
/// behind.
pub fn gfd_behind(n: &NodeFacts, written: Option<&str>) -> Option<i64> {
    let w = written?.parse::<i64>().ok()?;
    let t = label_i64(n, LABEL_GFD_TIMESTAMP)?;
    (t <= w).then_some(w)
}

/// Applies what a plan asks of one node the way server-side apply does for our field manager:
/// keys we owned and no longer want are removed, wanted keys are set and become ours. Returns
/// whether the node changed.
pub fn apply_to_node(n: &mut NodeFacts, labels: &SmallMap, annotations: &SmallMap) -> bool {
    let a = own(&mut n.annotations, &mut n.owned_annotations, annotations);
    let l = own(&mut n.labels, &mut n.owned, labels);
    a || l
}

/// Server-side apply of `want` onto one map our field manager owns `owned` of. Returns whether
/// the map changed.
fn own(have: &mut Labels, owned: &mut OwnedKeys, want: &SmallMap) -> bool {
    let before = have.clone();
    for k in *owned {
        if !want.contains_key(&k) {
            have.remove(&k);
        }
    }
    for (k, v) in want {
        have.insert(k, v.as_str());
    }
    *owned = want.keys().collect();
    before != *have
}

/// Whether a tainted node may lose the taint: its policy's config is confirmed (`Applied`), or
/// no policy governs it and GFD has labelled it (selectors match on GFD labels that do not exist
/// before). A node a policy governs but cannot configure keeps it.
pub fn ready_to_untaint(n: &NodeFacts, governed: bool, state: Option<NodeState>) -> bool {
    if governed {
        state == Some(NodeState::Applied)
    } else {
        n.labels.get(LABEL_GFD_TIMESTAMP).is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn untainted_only_when_confirmed_or_labelled_by_gfd() {
        let mut n = NodeFacts::default();
        assert!(!ready_to_untaint(&n, true, Some(NodeState::Pending)));
        assert!(!ready_to_untaint(&n, true, Some(NodeState::Rejected)));
        assert!(ready_to_untaint(&n, true, Some(NodeState::Applied)));
        assert!(!ready_to_untaint(&n, false, None));
        n.labels.insert(LABEL_GFD_TIMESTAMP, "1800000000");
        assert!(ready_to_untaint(&n, false, None));
    }
}
