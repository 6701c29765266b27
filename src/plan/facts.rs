//! Readings of one node's facts that several parts of the planner share, and how our writes
//! change those facts. This file is a leaf of `plan/`: it uses nothing of its siblings, so the
//! per-node transition, the VM transition, capacity, the rollout and the converged view can
//! all read node facts the same way without importing each other.

use crate::api::names::{LABEL_GFD_TIMESTAMP, LABEL_WORKLOAD};
use crate::nvidia::state::Workload;

use super::{Labels, NodeFacts, OwnedKeys, SmallMap, is_device_plugin_resource};

/// A node label read as an integer (`None` when absent or not a number).
pub fn label_i64(n: &NodeFacts, key: &str) -> Option<i64> {
    n.labels.get(key).and_then(|v| v.parse().ok())
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
