//! What each node of a valid policy should end up running: its [`NodeTarget`], with the MIG
//! layout demand recorded on the node in place of the policy's own (`spec.mig.dynamic`), and
//! the policy's spec as that node runs it.

use crate::api::crd::GpuSharingPolicySpec;
use crate::api::names::ANNOTATION_MIG_DEMAND;

use super::backing::{Backing, NodeTarget, Serving, VmTarget};
use super::facts::NodeFacts;
use super::policies::Prepared;

/// What node `n` of the valid policy `w` should end up running: one function for every backend,
/// and the one place a per-node choice goes: the MIG layout demand recorded on the node
/// (`spec.mig.dynamic`, see [`super::demand`]).
pub fn node_target(w: &Prepared, n: &NodeFacts) -> Option<NodeTarget> {
    let serving = match w.backing.as_ref()? {
        Backing::Sharing => Serving::Sharing,
        // Demand may have recorded another layout of the catalogue for this node.
        Backing::Mig(m) => Serving::Mig {
            layout: node_layout(w, n).unwrap_or_else(|| m.layout.clone()),
        },
        Backing::Vm(v) => Serving::Vm(VmTarget {
            workload: v.workload,
            vgpu_config: v.vgpu_config.clone(),
        }),
        Backing::Dra(d) => Serving::Dra {
            extended: d.extended.clone(),
            layout: d.mig.as_ref().map(|m| m.layout.clone()),
        },
    };
    Some(NodeTarget {
        device_config: w.key.clone()?,
        serving,
    })
}

/// The layouts a dynamic policy may put on a node: its own first, then the catalogue's.
pub fn catalogue(w: &Prepared) -> Vec<String> {
    let own = w.mig().map(|m| m.layout.clone());
    let dynamic = w.spec.mig.as_ref().and_then(|m| m.dynamic.as_ref());
    own.into_iter()
        .chain(dynamic.into_iter().flat_map(|d| d.layouts.iter().cloned()))
        .fold(Vec::new(), |mut out, l| {
            if !out.contains(&l) {
                out.push(l);
            }
            out
        })
}

/// The layout demand recorded on a node, and since when (unix seconds; 0 when unreadable):
/// the one parser of [`ANNOTATION_MIG_DEMAND`] (`<layout>@<seconds>`).
pub fn recorded(n: &NodeFacts) -> Option<(&str, i64)> {
    let (l, t) = n.annotations.get(ANNOTATION_MIG_DEMAND)?.rsplit_once('@')?;
    Some((l, t.parse().unwrap_or(0)))
}

/// The layout node `v` of dynamic policy `w` should run: the one demand recorded on it while it
/// is in the catalogue, else the policy's own.
pub fn node_layout(w: &Prepared, v: &NodeFacts) -> Option<String> {
    let (l, _) = recorded(v)?;
    let dynamic = w.spec.mig.as_ref().and_then(|m| m.dynamic.as_ref());
    let in_catalogue =
        w.mig()?.layout == l || dynamic.is_some_and(|d| d.layouts.iter().any(|x| x == l));
    in_catalogue.then(|| l.to_string())
}

/// The policy's spec as node `n` runs it: with the MIG layout demand recorded for the node in
/// place of the policy's own (what the device plugin advertises there, and what the node is
/// judged Ready against).
pub fn node_spec<'a>(w: &'a Prepared, n: &NodeFacts) -> std::borrow::Cow<'a, GpuSharingPolicySpec> {
    spec_on_node(w.spec, n)
}

/// [`node_spec`] from the spec alone: the recorded layout counts when it is one of
/// `spec.mig.dynamic.layouts` (the policy's own layout needs no change).
pub fn spec_on_node<'a>(
    spec: &'a GpuSharingPolicySpec,
    n: &NodeFacts,
) -> std::borrow::Cow<'a, GpuSharingPolicySpec> {
    let recorded = recorded(n).map(|(l, _)| l);
    let mig = spec.mig.as_ref();
    let dynamic = mig.and_then(|m| m.dynamic.as_ref());
    match (recorded, dynamic) {
        (Some(l), Some(d))
            if mig.and_then(|m| m.layout.as_deref()) != Some(l)
                && d.layouts.iter().any(|x| x == l) =>
        {
            std::borrow::Cow::Owned(spec.with_mig_layout(l))
        }
        _ => std::borrow::Cow::Borrowed(spec),
    }
}
