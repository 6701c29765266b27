//! Staged rollouts: a policy's node changes go out in waves of at most `maxUnavailable`
//! unconfirmed nodes, a node that fails or does not confirm in time halts the rollout until the
//! next generation, and `paused` stops new changes.
//!
//! Everything that decides what was rolled out lives in the cluster, not in memory: a node we
//! start changing carries the annotation [`ANNOTATION_ROLLOUT`] (`<generation>/<since>/<target>`),
//! and a halt is recorded in the policy's status (`rollout.haltedGeneration`). A restarted
//! operator counts the same unconfirmed nodes and resumes where the last one stopped.

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

use crate::api::crd::{
    DEFAULT_DRAIN_TIMEOUT_SECONDS, DEFAULT_NODE_TIMEOUT_SECONDS, GpuSharingPolicySpec,
};
use crate::api::names::{
    ANNOTATION_CONFIG_WRITTEN, ANNOTATION_CORDONED, ANNOTATION_ROLLOUT, LABEL_DEPLOY_DEVICE_PLUGIN,
    LABEL_DEVICE_PLUGIN_CONFIG, LABEL_MIG_CONFIG, LABEL_MIG_STATE, LABEL_POLICY, LABEL_VGPU_CONFIG,
    LABEL_VGPU_STATE, LABEL_WORKLOAD,
};
use crate::api::state::{HoldReason, NodeState};
use crate::nvidia::DEFAULT_KEY;
use crate::nvidia::state::{ConfigState, deployed};

use super::drain::{Drain, drain_nodes};
use super::facts::{gfd_behind, is_vm_host, sandbox_resources};
use super::node::Outcome;
use super::policies::Prepared;
use super::{facts::NodeFacts, input::PlanInput};

/// Defined with the per-node transition that makes it (drains read it too); kept here for
/// callers.
pub use super::node::Entry;

/// Default budget when `spec.rollout.maxUnavailable` is unset: 25% of the policy's nodes.
const DEFAULT_PERCENT: u64 = 25;

/// The budget in nodes: an integer, or a percentage of `governed` rounded up (as a DaemonSet's
/// `maxUnavailable`); at least 1.
pub fn budget(spec: &GpuSharingPolicySpec, governed: usize) -> usize {
    let from_percent = |p: u64| (governed as u64 * p).div_ceil(100) as usize;
    let n = match spec
        .rollout
        .as_ref()
        .and_then(|r| r.max_unavailable.as_ref())
    {
        None => from_percent(DEFAULT_PERCENT),
        Some(IntOrString::Int(i)) => (*i).max(0) as usize,
        Some(IntOrString::String(s)) => s
            .strip_suffix('%')
            .and_then(|p| p.parse::<u64>().ok())
            .map_or_else(|| from_percent(DEFAULT_PERCENT), from_percent),
    };
    n.max(1)
}

/// How long a started node may stay unconfirmed: `nodeTimeoutSeconds`, plus
/// `drainTimeoutSeconds` when the node is drained first.
fn node_timeout(spec: &GpuSharingPolicySpec, drains: bool) -> i64 {
    let confirm = spec
        .rollout
        .as_ref()
        .and_then(|r| r.node_timeout_seconds)
        .unwrap_or(DEFAULT_NODE_TIMEOUT_SECONDS);
    let drain = if drains {
        spec.disruption
            .as_ref()
            .and_then(|d| d.drain_timeout_seconds)
            .unwrap_or(DEFAULT_DRAIN_TIMEOUT_SECONDS)
    } else {
        0
    };
    confirm + drain
}

/// The rollout mark on a node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mark {
    pub generation: i64,
    /// Unix seconds of the first write of this change.
    pub since: i64,
    pub target: String,
}

impl Mark {
    pub fn parse(s: &str) -> Option<Mark> {
        let mut it = s.splitn(3, '/');
        Some(Mark {
            generation: it.next()?.parse().ok()?,
            since: it.next()?.parse().ok()?,
            target: it.next()?.to_string(),
        })
    }
}

impl std::fmt::Display for Mark {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}/{}", self.generation, self.since, self.target)
    }
}

/// Where a policy's rollout stands after the gate.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Progress {
    pub max_unavailable: usize,
    /// Written and not confirmed (or failed) nodes, started ones first.
    pub unavailable: usize,
    pub queued: Vec<String>,
    /// `Some` when the rollout of this generation is halted, with the nodes and why.
    pub halted: Option<Vec<String>>,
    pub paused: bool,
    /// Config keys the policy's nodes still use besides the current one.
    pub previous_keys: BTreeSet<String>,
}

/// How one governed node stands in its policy's rollout.
enum Phase {
    /// Nothing to write and nothing to wait for (applied, or held for another reason).
    Settled,
    /// Written (now or earlier) and not confirmed: counts against the budget. `Some` when it
    /// failed or timed out, with why.
    Unavailable(Option<String>),
    /// Needs a change that has not started.
    Candidate,
    /// Needs a change that has not started, but an earlier change of ours (for another target)
    /// is not confirmed yet: it counts as unavailable and waits for that confirmation.
    CandidateUnavailable,
}

/// An earlier change of ours on the node that NVIDIA's components have not confirmed, whatever
/// it was for: GFD has not relabelled since our last device-plugin config write (when GFD
/// stamps the node, and only where the device plugin runs: not on a VM host, where GFD does not
/// run, nor where the device plugin is switched off, whose config no component loads), or the
/// MIG manager (the vGPU Device Manager) has not reported on our last layout (vGPU config).
pub fn last_change_unconfirmed(n: &NodeFacts) -> bool {
    let pending = |config: &str, state: &str| {
        n.owned.contains(config)
            && ConfigState::parse(n.labels.get(state)) == Some(ConfigState::Pending)
    };
    let vm = is_vm_host(n);
    let device_plugin = deployed(n.labels.get(LABEL_DEPLOY_DEVICE_PLUGIN));
    let gfd = !vm
        && device_plugin
        && gfd_behind(n, n.annotations.get(ANNOTATION_CONFIG_WRITTEN)).is_some();
    // A VM host of ours is confirmed by the sandbox device plugin advertising its GPUs.
    let sandbox = vm && n.owned.contains(LABEL_WORKLOAD) && sandbox_resources(n).is_empty();
    gfd || sandbox
        || pending(LABEL_MIG_CONFIG, LABEL_MIG_STATE)
        || pending(LABEL_VGPU_CONFIG, LABEL_VGPU_STATE)
}

fn phase(e: &Entry, w: &Prepared, now: i64) -> Phase {
    // Most nodes, most of the time: nothing to write or wait for (the match below says the
    // same, after reading the node's mark).
    let state = e.outcome.state;
    if state == Some(NodeState::Applied) && e.in_sync
        || matches!(
            state,
            Some(NodeState::Rejected | NodeState::Invalid | NodeState::Stale)
        )
    {
        return Phase::Settled;
    }
    let n: &NodeFacts = e.node;
    let target = e.target.unwrap_or_default();
    let state = e.outcome.state;
    let changes = !e.in_sync;
    let mark = n.annotations.get(ANNOTATION_ROLLOUT).and_then(Mark::parse);
    let started = mark.as_ref().is_some_and(|m| m.target == target);
    let drains = w.drains_node(n);
    let drainable = e.outcome.reason.is_none_or(|r| r.ended_by_drain());
    let timeout = node_timeout(w.spec, drains);
    // A new generation gives nodes still in flight a new timeout (see `gate`).
    let generation = w.policy.metadata.generation.unwrap_or(0);
    let overdue = mark
        .as_ref()
        .filter(|m| started && m.generation >= generation)
        .map(|m| now - m.since)
        .filter(|age| *age > timeout);
    let earlier = e.earlier_unconfirmed;
    // A layout demand chose that failed, or a demand drain that overran: the node is held or
    // given up on its own (demand moves on), not a failure of the policy's rollout.
    let demand = super::disruption::demand_reshape(w, n);
    match state {
        Some(NodeState::Failed) if started && !demand => Phase::Unavailable(Some(format!(
            "{}: {}",
            n.name, e.outcome.message
        ))),
        Some(NodeState::Applied) if !changes => Phase::Settled,
        Some(
            NodeState::Rejected | NodeState::Invalid | NodeState::Failed | NodeState::Stale,
        ) => Phase::Settled,
        // Busy GPUs under `drain`: starting the node means draining it.
        // Demand drains only under `drainBusyNodes`.
        Some(NodeState::Waiting) if drains && drainable && !started && earlier => {
            Phase::CandidateUnavailable
        }
        Some(NodeState::Waiting) if drains && drainable && !started => {
            Phase::Candidate
        }
        _ if changes && !started && !e.hold && earlier => Phase::CandidateUnavailable,
        _ if changes && !started && !e.hold => Phase::Candidate,
        _ if !started && !earlier && state != Some(NodeState::Pending) => Phase::Settled,
        _ => Phase::Unavailable(overdue.filter(|_| !demand).map(|age| {
            format!(
                "{}: not confirmed {age}s after the change started (nodeTimeoutSeconds {timeout}): {}",
                n.name, e.outcome.message
            )
        })),
    }
}

/// Whether the policy's status records a halt of its current generation.
pub(super) fn recorded_halt(w: &Prepared) -> Option<Vec<String>> {
    let r = w.policy.status.as_ref()?.rollout.as_ref()?;
    let generation = w.policy.metadata.generation?;
    (r.halted_generation == Some(generation)).then(|| r.halted_nodes.clone())
}

/// One policy's nodes, sorted by what the gate does with them.
#[derive(Default)]
struct Sorted {
    /// Need a change that has not started.
    candidates: Vec<usize>,
    /// Need a change, but an earlier change is not confirmed: they wait for it.
    unconfirmed: Vec<usize>,
}

/// Sorts one policy's nodes, counts the unavailable ones and their failures, and gives nodes
/// still in flight from an earlier generation a new mark (the edit resumes them with a new
/// timeout).
fn sort(
    entries: &mut [Entry],
    idx: &[usize],
    w: &Prepared,
    now: i64,
    progress: &mut Progress,
) -> Sorted {
    let mut sorted = Sorted::default();
    let mut failures = Vec::new();
    let generation = w.policy.metadata.generation.unwrap_or(0);
    for &i in idx {
        match phase(&entries[i], w, now) {
            Phase::Settled => drop_stale_mark(&mut entries[i]),
            Phase::Candidate => sorted.candidates.push(i),
            Phase::CandidateUnavailable => {
                progress.unavailable += 1;
                sorted.unconfirmed.push(i);
            }
            Phase::Unavailable(failure) => {
                progress.unavailable += 1;
                failures.extend(failure);
                let e = &mut entries[i];
                let old = e
                    .node
                    .annotations
                    .get(ANNOTATION_ROLLOUT)
                    .and_then(Mark::parse);
                if old.is_some_and(|m| {
                    Some(m.target.as_str()) == e.target && m.generation < generation
                }) {
                    set_mark(e, generation, now);
                }
            }
        }
    }
    if !failures.is_empty() && progress.halted.is_none() {
        progress.halted = Some(failures);
    }
    sorted
}

/// Drops the node's mark when it is of no change the node is making: a change to another
/// target (queued since, or its policy edited), or any change on a node the policy now
/// refuses. Kept, it would count the node as started, past the budget, should the policy
/// come back to that target.
fn drop_stale_mark(e: &mut Entry) {
    let refused = e.outcome.state.is_some_and(NodeState::refused);
    let stale = (e.outcome.annotations.get(ANNOTATION_ROLLOUT))
        .and_then(|m| Mark::parse(m))
        .is_some_and(|m| refused || Some(m.target.as_str()) != e.target);
    if stale {
        e.outcome.to_mut().annotations.remove(ANNOTATION_ROLLOUT);
    }
}

fn set_mark(e: &mut Entry, generation: i64, since: i64) {
    let mark = Mark {
        generation,
        since,
        target: e.target.unwrap_or_default().to_string(),
    };
    e.outcome
        .to_mut()
        .annotations
        .insert(ANNOTATION_ROLLOUT.to_string(), mark.to_string());
}

/// Starts candidates (in name order) while the budget has room; queues the rest.
#[allow(clippy::too_many_arguments)]
fn start_or_queue(
    entries: &mut [Entry],
    sorted: Sorted,
    generation: i64,
    now: i64,
    progress: &mut Progress,
    queue: &impl Fn(&NodeFacts, String, HoldReason) -> Outcome,
) {
    let stopped = progress.halted.is_some() || progress.paused;
    let slots = if stopped {
        0
    } else {
        progress
            .max_unavailable
            .saturating_sub(progress.unavailable)
    };
    let unavailable_before = progress.unavailable;
    let order = sorted
        .candidates
        .iter()
        .map(|i| (*i, true))
        .chain(sorted.unconfirmed.iter().map(|i| (*i, false)));
    let mut started = 0;
    for (i, may_start) in order {
        let e = &mut entries[i];
        if may_start && started < slots {
            started += 1;
            set_mark(e, generation, now);
            progress.unavailable += 1;
            continue;
        }
        let (reason, why) = if progress.halted.is_some() {
            let why = "the rollout is halted; edit the policy to resume";
            (HoldReason::RolloutHalted, why.to_string())
        } else if progress.paused {
            (
                HoldReason::RolloutPaused,
                "the rollout is paused".to_string(),
            )
        } else if !may_start {
            let why = "waiting for NVIDIA's components to confirm an earlier change";
            (HoldReason::WaitingForConfirmation, why.to_string())
        } else {
            let why = format!(
                "waiting for its rollout wave ({unavailable_before} of at most {} nodes unavailable)",
                progress.max_unavailable
            );
            (HoldReason::WaitingForRolloutWave, why)
        };
        e.outcome = std::borrow::Cow::Owned(queue(e.node, why, reason));
        drop_stale_mark(e);
        e.hold = true;
        progress.queued.push(e.node.name.clone());
    }
}

/// A busy node demand chose (reserved, or drained under `drainBusyNodes`) is cordoned at once,
/// even while its change waits for its wave or for NVIDIA's components to confirm an earlier
/// change: the cordon is what lets it empty (no new pod lands there); evictions wait for the
/// change to start. Not while the rollout is paused or halted, nor on a node running a pod
/// demand may not evict (demand gives that choice up).
fn cordon_queued_demand(entries: &mut [Entry], idx: &[usize], w: &Prepared) {
    let reserve = super::disruption::demand_reserve(w.spec).is_some();
    if !reserve && super::disruption::demand_drain(w.spec).is_none() {
        return;
    }
    for &i in idx {
        let e = &mut entries[i];
        let waits = matches!(
            e.outcome.reason,
            Some(HoldReason::WaitingForConfirmation | HoldReason::WaitingForRolloutWave)
        );
        let n = e.node;
        let evictable = || reserve || n.gpu_pods.iter().all(|p| !w.never_evicts(n, p, true));
        if e.hold
            && waits
            && !n.foreign_cordon
            && !n.gpu_pods.is_empty()
            && super::disruption::demand_reshape(w, n)
            && evictable()
        {
            e.outcome
                .to_mut()
                .annotations
                .insert(ANNOTATION_CORDONED.to_string(), "true".to_string());
        }
    }
}

/// Keeps the rollout mark we own on a node `policy` governs (the gate replaces it when a change
/// starts), unless the node was last labelled for another policy (`gpusharing.io/policy`): that
/// mark is of a change of the other policy, and kept it would count the node as started should
/// it come back to the same target, past the rollout budget. Dropped in the write that
/// relabels the node for its new policy.
pub fn keep_mark(n: &NodeFacts, outcome: &mut Outcome, policy: &str) {
    if let Some(m) = n.annotations.get(ANNOTATION_ROLLOUT)
        && n.owned_annotations.contains(ANNOTATION_ROLLOUT)
        && n.labels.get(LABEL_POLICY).is_none_or(|p| p == policy)
    {
        outcome
            .annotations
            .insert(ANNOTATION_ROLLOUT.to_string(), m.to_string());
    }
}

/// Applies every policy's rollout budget to its nodes' plans (their outcomes keep their marks,
/// see [`keep_mark`]): starts as many candidates (in
/// name order) as the budget leaves, queues the rest (held as they are), and carries or sets
/// the rollout mark. `queue` makes the held outcome of a queued node.
pub fn gate(
    entries: &mut [Entry],
    prepared: &[Prepared],
    input: &PlanInput,
    queue: impl Fn(&NodeFacts, String, HoldReason) -> Outcome,
) -> (BTreeMap<usize, Progress>, BTreeMap<String, Drain>) {
    let (now, pause_all) = (input.cluster.now, input.settings.pause_rollouts);
    let refused: BTreeSet<&str> = (input.memory.refused_writes.iter())
        .filter(|w| w.kind == "Node")
        .map(|w| w.name.as_str())
        .collect();
    let mut drains = BTreeMap::new();
    let mut by_policy: BTreeMap<usize, Vec<usize>> = BTreeMap::new();
    for (i, e) in entries.iter_mut().enumerate() {
        if let Some(p) = e.policy.filter(|p| prepared[*p].accepted()) {
            by_policy.entry(p).or_default().push(i);
        }
    }
    let mut out = BTreeMap::new();
    for (p, idx) in by_policy {
        let w = &prepared[p];
        if w.key.is_none() {
            continue;
        }
        let governed = idx
            .iter()
            .filter(|i| !entries[**i].outcome.state.is_some_and(NodeState::refused))
            .count();
        let mut progress = Progress {
            max_unavailable: budget(w.spec, governed),
            paused: pause_all || w.spec.paused,
            halted: recorded_halt(w),
            ..Default::default()
        };
        let mut sorted = sort(entries, &idx, w, now, &mut progress);
        // A node whose last write the API server refused starts only when no other candidate
        // needs the room: started first, it would hold a slot its write cannot use.
        sorted
            .candidates
            .sort_by_key(|i| refused.contains(entries[*i].node.name.as_str()));
        let generation = w.policy.metadata.generation.unwrap_or(0);
        start_or_queue(entries, sorted, generation, now, &mut progress, &queue);
        cordon_queued_demand(entries, &idx, w);
        let started = |e: &Entry| {
            // An applied node's labels are the transition's (the gate queues only others); a
            // node the policy refuses is left as it is (no drain or cordon of it goes on).
            let settled = e.outcome.state == Some(NodeState::Applied) && e.in_sync
                || e.outcome.state.is_some_and(NodeState::refused);
            let mark = || {
                e.outcome
                    .annotations
                    .get(ANNOTATION_ROLLOUT)
                    .and_then(|m| Mark::parse(m))
            };
            !settled && mark().is_some_and(|m| Some(m.target.as_str()) == e.target)
        };
        drains.extend(drain_nodes(entries, &idx, w, input, started));
        let current = w.key.as_deref();
        for &i in &idx {
            if let Some(k) = entries[i].outcome.labels.get(LABEL_DEVICE_PLUGIN_CONFIG)
                && Some(k.as_str()) != current
                && k != DEFAULT_KEY
            {
                progress.previous_keys.insert(k.clone());
            }
        }
        out.insert(p, progress);
    }
    (out, drains)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::crd::Rollout;

    fn spec(max: Option<IntOrString>) -> GpuSharingPolicySpec {
        let mut s: GpuSharingPolicySpec =
            crate::api::yaml::from_str("nodeSelector: {}\nstrategy: mps\nmps: {replicas: 2}\n")
                .unwrap();
        s.rollout = Some(Rollout {
            max_unavailable: max,
            node_timeout_seconds: None,
        });
        s
    }

    #[test]
    fn budget_is_a_count_or_a_rounded_up_percentage_and_at_least_one() {
        let pct = |p: &str| Some(IntOrString::String(p.into()));
        assert_eq!(budget(&spec(None), 40), 10);
        assert_eq!(budget(&spec(None), 5), 2);
        assert_eq!(budget(&spec(None), 0), 1);
        assert_eq!(budget(&spec(pct("10%")), 5000), 500);
        assert_eq!(budget(&spec(pct("10%")), 3), 1);
        assert_eq!(budget(&spec(pct("100%")), 7), 7);
        assert_eq!(budget(&spec(Some(IntOrString::Int(3))), 40), 3);
    }

    #[test]
    fn marks_round_trip() {
        let m = Mark {
            generation: 3,
            since: 1_800_000_000,
            target: "a100-6f1e2d3c+custom-a100-0badf00d".into(),
        };
        assert_eq!(Mark::parse(&m.to_string()), Some(m));
        assert_eq!(Mark::parse("garbage"), None);
    }
}
