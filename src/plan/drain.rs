//! Drains (`disruption.mode: drain`): a started node whose change needs idle GPUs is cordoned
//! (our annotation plus `spec.unschedulable` in the same apply) and the pods that use its GPUs
//! are evicted through the Eviction API, so PodDisruptionBudgets are respected. The cordon stays
//! until the node's new config is confirmed; only a node carrying our annotation is ever
//! uncordoned.

use std::collections::BTreeMap;

use crate::api::names::ANNOTATION_CORDONED;
use crate::api::state::NodeState;

use super::decision::some_of;
use super::input::PlanInput;
use super::node::Entry;
use super::policies::Prepared;

/// One node's drain: the pods to evict, and those `disruption.neverEvict` protects.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Drain {
    /// The policy the node is drained for (its events name the blocked evictions).
    pub policy: String,
    pub evict: Vec<String>,
    pub protected: Vec<String>,
}

/// For one policy's started nodes: drains those waiting for idle GPUs, and keeps the cordon of
/// those still in flight. `in_flight` says whether an entry is started for the policy's current
/// target and not yet confirmed.
pub fn drain_nodes(
    entries: &mut [Entry],
    idx: &[usize],
    w: &Prepared,
    input: &PlanInput,
    in_flight: impl Fn(&Entry) -> bool,
) -> BTreeMap<String, Drain> {
    let mut out = BTreeMap::new();
    for &i in idx {
        let e = &mut entries[i];
        if !in_flight(e) {
            continue;
        }
        let view = e.node;
        let demand = super::disruption::demand_reshape(w, view);
        // A node demand reserved is cordoned and waits for its pods: it evicts none.
        let reserve = demand && super::disruption::demand_reserve(w.spec).is_some();
        // A node leaving the DRA driver waits for the claims of the pods it served.
        let (protected, evict): (Vec<String>, Vec<String>) = (view.gpu_pods.iter())
            .chain(&view.dra_pods)
            .cloned()
            .partition(|p| reserve || w.never_evicts(view, p, demand));
        // Demand never drains a node running a pod it may not evict: demand planning gives the
        // choice up in this same pass, so the node is neither cordoned nor drained.
        if demand && !reserve && !protected.is_empty() {
            continue;
        }
        let owned = view.owned_annotations.contains(ANNOTATION_CORDONED)
            && view.annotations.get(ANNOTATION_CORDONED).is_some();
        let draining = w.drains_node(view)
            && e.outcome.state == Some(NodeState::Waiting)
            && e.outcome.reason.is_none_or(|r| r.ended_by_drain());
        if owned || draining && !view.foreign_cordon {
            e.outcome
                .to_mut()
                .annotations
                .insert(ANNOTATION_CORDONED.to_string(), "true".to_string());
        }
        if !draining {
            continue;
        }
        if reserve {
            let o = e.outcome.to_mut();
            o.state = Some(NodeState::Draining);
            o.reason = None;
            o.message = format!(
                "cordoned (reserved for demand); waiting for its GPU pods to finish: {}",
                some_of(&protected)
            );
            continue;
        }
        let blocked: Vec<String> = evict
            .iter()
            .filter_map(|p| Some(format!("{p}: {}", input.memory.eviction_blocked.get(p)?)))
            .collect();
        let mut msg = format!("cordoned; evicting {}", some_of(&evict));
        if !blocked.is_empty() {
            msg.push_str(&format!("; blocked: {}", some_of(&blocked)));
        }
        if !protected.is_empty() {
            msg.push_str(&format!(
                "; protected by disruption.neverEvict (waiting for them to finish): {}",
                some_of(&protected)
            ));
        }
        let o = e.outcome.to_mut();
        o.state = Some(NodeState::Draining);
        o.reason = None;
        o.message = msg;
        out.insert(
            e.node.name.clone(),
            Drain {
                policy: w.name.clone(),
                evict,
                protected,
            },
        );
    }
    out
}
