//! Which busy nodes a policy's change may drain or reserve, and which pods a drain leaves
//! alone: `disruption` for any change, `spec.mig.dynamic`'s `drainBusyNodes` and
//! `reserveBusyNodes` for a layout demand chose.

use crate::api::crd::{DemandDrain, DemandReserve, GpuSharingPolicySpec};

use super::facts::NodeFacts;
use super::input::NodeView;
use super::labels::{Labels, selector_matches};
use super::policies::Prepared;
use super::targets::node_layout;

/// The node's target is a layout demand recorded on it (`spec.mig.dynamic`).
pub fn demand_reshape(w: &Prepared, n: &NodeFacts) -> bool {
    w.spec.mig.as_ref().is_some_and(|m| m.dynamic.is_some()) && node_layout(w, n).is_some()
}

/// `spec.mig.dynamic.drainBusyNodes`: which busy nodes demand may drain. Only with a
/// `namespaceSelector`: admission refuses drains without one, and a policy stored before that
/// rule gets no drains either.
pub fn demand_drain(spec: &GpuSharingPolicySpec) -> Option<&DemandDrain> {
    let dynamic = spec.mig.as_ref()?.dynamic.as_ref()?;
    dynamic.namespace_selector.as_ref()?;
    dynamic.drain_busy_nodes.as_ref()
}

/// Under drains or reservations a layout stays at least this long, whatever a policy stored
/// before the admission rule says.
pub const MIN_LIFETIME_WITH_BUSY_NODES: i64 = 60;

/// `spec.mig.dynamic.reserveBusyNodes`: demand may cordon busy nodes and wait for them.
pub fn demand_reserve(spec: &GpuSharingPolicySpec) -> Option<&DemandReserve> {
    spec.mig
        .as_ref()?
        .dynamic
        .as_ref()?
        .reserve_busy_nodes
        .as_ref()
}

impl Prepared<'_> {
    /// Whether node `n`'s change drains it when its GPUs are busy: a layout demand recorded
    /// under `drainBusyNodes` or `reserveBusyNodes` (a drain that evicts nothing: the cordon
    /// alone, until the pods finish), any other change under `disruption.mode: drain`.
    pub fn drains_node(&self, n: &NodeFacts) -> bool {
        if demand_reshape(self, n) {
            demand_drain(self.spec).is_some() || demand_reserve(self.spec).is_some()
        } else {
            self.drains()
        }
    }

    /// Whether a drain for this policy leaves GPU pod `pod` of node `v` alone:
    /// `disruption.neverEvict` selects it, or, in a drain for demand, it is above the priority
    /// ceiling.
    pub fn never_evicts(&self, v: &NodeView, pod: &str, demand: bool) -> bool {
        let details = v.gpu_pod_details.get(pod);
        let labels = details.map(|d| &d.labels);
        let priority = details.map_or(0, |d| d.priority);
        let never = self
            .spec
            .disruption
            .as_ref()
            .and_then(|d| d.never_evict.as_ref())
            .is_some_and(|sel| selector_matches(sel, labels.unwrap_or(&Labels::default())));
        never || demand && demand_drain(self.spec).is_some_and(|d| priority > d.max_pod_priority)
    }
}
