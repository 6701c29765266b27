//! What the control loop remembers between passes, none of which is in the cluster's objects:
//! since when nodes have reported a MIG or vGPU change pending, which ClusterPolicy fields we
//! applied and how often someone reverted them, the evictions refused, the nodes someone else
//! had cordoned, whether the GPU Operator's namespace was missing.
//!
//! One owner, the control loop, and two ways in and out: [`ControllerMemory::recall`] gives the
//! next pass its [`Memory`] (from the node facts it plans with), [`ControllerMemory::record`]
//! takes what a pass's appliers learnt ([`Learnt`], in their [`WriteReport`]). The appliers
//! never write it. Pure: the clock comes in as an argument.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::api::names::{LABEL_MIG_CONFIG, LABEL_MIG_STATE, LABEL_VGPU_CONFIG, LABEL_VGPU_STATE};
use crate::nvidia::state::ConfigState;
use crate::observe::Memory;
use crate::plan::{self, NodeFacts};
use crate::runtime::apply::{Learnt, WriteReport};

/// Drift repairs of the ClusterPolicy within this window that make it "contested".
const CONTEST_WINDOW: Duration = Duration::from_secs(600);
const CONTEST_REPAIRS: usize = 3;

/// The control loop's memory between passes.
#[derive(Debug)]
pub struct ControllerMemory {
    /// How long a state label may say `pending` before the node counts as stuck.
    pending_timeout: Duration,
    /// By (state label, node): the config label's value it is pending for, and since when.
    pending_since: BTreeMap<(String, String), (String, Instant)>,
    /// When we had to put our ClusterPolicy settings back, and what.
    repairs: Vec<(Instant, String)>,
    /// ClusterPolicy fields this process has applied.
    cluster_policy_applied: BTreeSet<String>,
    /// Evictions the last pass that tried them all could not make, by pod, with why.
    eviction_blocked: BTreeMap<String, String>,
    /// Nodes being drained that someone else had cordoned.
    foreign_cordons: BTreeSet<String>,
    /// The GPU Operator's namespace, when our last ConfigMap write found it missing.
    namespace_missing: Option<String>,
    /// The planner, with what it planned for each node (it re-plans only what changed).
    planner: plan::Planner,
    /// Unix seconds each node was last seen running GPU pods.
    last_busy: BTreeMap<String, i64>,
    /// The nodes the last pass saw running GPU pods.
    busy: BTreeSet<String>,
    /// Unix seconds of the first pass (a node not seen busy since counts as idle from then).
    started: Option<i64>,
    /// Writes the API server refused, by (kind, object), oldest first.
    refused: BTreeMap<(&'static str, String), Refusal>,
}

/// A write the API server refused: why, how often in a row, and when to try it again.
#[derive(Debug, Clone)]
struct Refusal {
    why: String,
    attempts: u32,
    retry_at: Instant,
}

/// The longest wait before a refused write is tried again.
const REFUSED_RETRY_MAX: Duration = Duration::from_secs(60);

impl ControllerMemory {
    /// Nothing remembered yet; a `pending` state lasting longer than `pending_timeout` makes the
    /// node stuck.
    pub fn new(pending_timeout: Duration) -> Self {
        ControllerMemory {
            pending_timeout,
            pending_since: BTreeMap::new(),
            repairs: Vec::new(),
            cluster_policy_applied: BTreeSet::new(),
            eviction_blocked: BTreeMap::new(),
            foreign_cordons: BTreeSet::new(),
            namespace_missing: None,
            planner: plan::Planner::default(),
            last_busy: BTreeMap::new(),
            busy: BTreeSet::new(),
            started: None,
            refused: BTreeMap::new(),
        }
    }

    /// Notes at `now` (unix seconds) the nodes that run GPU pods: how long a node has been
    /// idle is what `spec.mig.dynamic.idleSeconds` asks. A node the last pass saw busy and this
    /// one sees idle was busy until now, as far as is known (passes may be minutes apart);
    /// after that it keeps its time. A node deleted is forgotten when `known` no longer has it.
    pub fn note_busy<'a>(
        &mut self,
        busy: impl Iterator<Item = &'a str>,
        known: &[Arc<NodeFacts>],
        now: i64,
    ) {
        self.started.get_or_insert(now);
        let busy: BTreeSet<String> = busy.map(str::to_string).collect();
        for n in busy.union(&self.busy) {
            self.last_busy.insert(n.clone(), now);
        }
        self.busy = busy;
        if self.last_busy.len() > known.len() {
            let names: BTreeSet<&str> = known.iter().map(|n| n.name.as_str()).collect();
            self.last_busy.retain(|n, _| names.contains(n.as_str()));
        }
    }

    /// What the next pass plans with, from the nodes it sees at `now` (at least those whose MIG
    /// or vGPU change is pending; the others have no timer): this also starts, resets
    /// (config label changed) and forgets (no longer pending) the pending timers, and forgets
    /// repairs older than the contest window.
    pub fn recall(&mut self, nodes: &[Arc<NodeFacts>], now: Instant) -> Memory {
        Memory {
            carried: plan::Memory {
                eviction_blocked: self.eviction_blocked.clone(),
                cluster_policy_contested: self.contested(now),
                gpu_operator_namespace_missing: self.namespace_missing.clone(),
                fence: None,
                refused_writes: (self.refused.iter())
                    .map(|((kind, name), r)| crate::api::crd::RefusedWrite {
                        kind: kind.to_string(),
                        name: name.clone(),
                        message: r.why.clone(),
                    })
                    .collect(),
            },
            foreign_cordons: self.foreign_cordons.clone(),
            mig_stuck: self.stuck(nodes, LABEL_MIG_CONFIG, LABEL_MIG_STATE, now),
            vgpu_stuck: self.stuck(nodes, LABEL_VGPU_CONFIG, LABEL_VGPU_STATE, now),
            last_busy: self.last_busy.clone(),
            started: self.started.unwrap_or(0),
        }
    }

    /// What a pass's appliers learnt, in order, at `now`. Refused evictions replace the last
    /// ones only when the pass tried all of its evictions ([`Learnt::EvictionsTried`]).
    pub fn record(&mut self, report: &WriteReport, now: Instant) {
        let mut blocked = BTreeMap::new();
        for learnt in &report.learnt {
            match learnt {
                Learnt::EvictionBlocked { pod, why } => {
                    blocked.insert(pod.clone(), why.clone());
                }
                Learnt::EvictionsTried { draining } => {
                    self.eviction_blocked = std::mem::take(&mut blocked);
                    self.foreign_cordons.retain(|n| draining.contains(n));
                }
                Learnt::ForeignCordon(node) => {
                    self.foreign_cordons.insert(node.clone());
                }
                Learnt::NamespaceMissing(namespace) => {
                    self.namespace_missing = Some(namespace.clone());
                }
                Learnt::NamespaceFound => self.namespace_missing = None,
                Learnt::ClusterPolicyApplied { fields } => {
                    self.cluster_policy_applied.extend(fields.iter().cloned());
                }
                Learnt::ClusterPolicyRepaired { what } => self.repairs.push((now, what.clone())),
                Learnt::InSync { kind, object } => {
                    self.refused.remove(&(kind, object.clone()));
                }
                Learnt::WriteRefused { kind, object, why } => {
                    let r = (self.refused)
                        .entry((kind, object.clone()))
                        .or_insert(Refusal {
                            why: String::new(),
                            attempts: 0,
                            retry_at: now,
                        });
                    r.attempts += 1;
                    r.why = why.clone();
                    // 2, 4, 8... seconds, at most a minute.
                    let wait = Duration::from_secs(1u64 << r.attempts.min(6));
                    r.retry_at = now + wait.min(REFUSED_RETRY_MAX);
                }
            }
        }
        // A write that went through is no longer refused (unless another write of the same
        // object was refused in this pass, e.g. a node's labels through, its demand layout not).
        let refused_now: BTreeSet<(&str, &str)> =
            report.refusals().map(|(k, o, _)| (k, o)).collect();
        for w in &report.writes {
            if !refused_now.contains(&(w.kind, w.object.as_str())) {
                self.refused.remove(&(w.kind, w.object.clone()));
            }
        }
    }

    /// Whether the write of `kind` `object` was refused and waits before it is tried again.
    pub fn refused_waits(&self, kind: &'static str, object: &str, now: Instant) -> bool {
        (self.refused.get(&(kind, object.to_string()))).is_some_and(|r| now < r.retry_at)
    }

    /// Forgets refused writes of `kind` that are no longer planned.
    pub fn keep_refused(&mut self, kind: &'static str, planned: impl Fn(&str) -> bool) {
        self.refused.retain(|(k, o), _| *k != kind || planned(o));
    }

    /// The planner kept from pass to pass.
    pub fn planner(&mut self) -> &mut plan::Planner {
        &mut self.planner
    }

    /// ClusterPolicy fields this process has applied (a change by someone else is drift).
    pub fn cluster_policy_applied(&self) -> &BTreeSet<String> {
        &self.cluster_policy_applied
    }

    /// Nodes whose `state_label` has said `pending` for the same `config_label` value for longer
    /// than the timeout (the MIG manager and the vGPU Device Manager can exit early and never
    /// report).
    fn stuck(
        &mut self,
        nodes: &[Arc<NodeFacts>],
        config_label: &str,
        state_label: &str,
        now: Instant,
    ) -> BTreeSet<String> {
        let mut stuck = BTreeSet::new();
        let mut seen = BTreeSet::new();
        for n in nodes {
            if ConfigState::parse(n.labels.get(state_label)) != Some(ConfigState::Pending) {
                continue;
            }
            let config = n.labels.get(config_label).unwrap_or_default().to_string();
            let key = (state_label.to_string(), n.name.clone());
            seen.insert(key.clone());
            let entry = self
                .pending_since
                .entry(key)
                .or_insert_with(|| (config.clone(), now));
            if entry.0 != config {
                *entry = (config, now);
            }
            if now.saturating_duration_since(entry.1) > self.pending_timeout {
                stuck.insert(n.name.clone());
            }
        }
        self.pending_since
            .retain(|k, _| k.0 != state_label || seen.contains(k));
        stuck
    }

    /// Reverted by someone else at least 3 times in 10 minutes: a fight, not a one-off edit.
    fn contested(&mut self, now: Instant) -> Option<String> {
        self.repairs
            .retain(|(t, _)| now.saturating_duration_since(*t) < CONTEST_WINDOW);
        (self.repairs.len() >= CONTEST_REPAIRS).then(|| {
            format!(
                "{} reverts in the last {} minutes, last: {}",
                self.repairs.len(),
                CONTEST_WINDOW.as_secs() / 60,
                self.repairs
                    .last()
                    .map(|(_, d)| d.as_str())
                    .unwrap_or_default()
            )
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MINUTE: Duration = Duration::from_secs(60);

    fn memory() -> ControllerMemory {
        ControllerMemory::new(10 * MINUTE)
    }

    fn refused(object: &str) -> WriteReport {
        let mut r = WriteReport::default();
        r.learn(Learnt::WriteRefused {
            kind: "Node",
            object: object.into(),
            why: "422 (Invalid): denied".into(),
        });
        r
    }

    #[test]
    fn a_refused_write_waits_longer_each_time_and_is_forgotten_once_through_or_unplanned() {
        let mut m = memory();
        let t0 = Instant::now();
        let s = Duration::from_secs(1);
        m.record(&refused("a"), t0);
        assert!(m.refused_waits("Node", "a", t0 + s));
        assert!(!m.refused_waits("Node", "a", t0 + 2 * s));
        assert!(
            !m.refused_waits("Node", "b", t0),
            "only the refused object waits"
        );
        m.record(&refused("a"), t0 + 2 * s);
        assert!(
            m.refused_waits("Node", "a", t0 + 5 * s),
            "4 s the second time"
        );
        for _ in 0..10 {
            m.record(&refused("a"), t0);
        }
        assert!(
            !m.refused_waits("Node", "a", t0 + MINUTE),
            "at most a minute"
        );
        let listed = m.recall(&[], t0).carried.refused_writes;
        assert_eq!(listed.len(), 1);
        assert_eq!(
            (listed[0].kind.as_str(), listed[0].name.as_str()),
            ("Node", "a")
        );
        assert_eq!(listed[0].message, "422 (Invalid): denied");
        // Through at last: forgotten.
        let mut ok = WriteReport::default();
        ok.record("Node", "a", "policy \"p\"");
        m.record(&ok, t0);
        assert!(m.recall(&[], t0).carried.refused_writes.is_empty());
        // No longer planned: forgotten.
        m.record(&refused("b"), t0);
        m.keep_refused("Node", |n| n != "b");
        assert!(!m.refused_waits("Node", "b", t0));
    }

    fn node(name: &str, labels: &[(&str, &str)]) -> Arc<NodeFacts> {
        Arc::new(NodeFacts {
            name: name.into(),
            labels: labels.iter().copied().collect(),
            ..Default::default()
        })
    }

    fn report(learnt: Vec<Learnt>) -> WriteReport {
        WriteReport {
            learnt,
            ..Default::default()
        }
    }

    fn repaired(what: &str) -> WriteReport {
        report(vec![Learnt::ClusterPolicyRepaired { what: what.into() }])
    }

    fn draining(nodes: &[&str]) -> Learnt {
        Learnt::EvictionsTried {
            draining: nodes.iter().map(|n| n.to_string()).collect(),
        }
    }

    /// Passes may be minutes apart (the loop sleeps until demand may act): a node last seen
    /// busy and now idle counts as busy until this pass, not until the one that last saw it.
    #[test]
    fn a_node_idle_after_a_long_sleep_was_busy_until_the_pass_that_sees_it_idle() {
        let mut m = memory();
        let known = vec![node("a", &[]), node("b", &[])];
        m.note_busy(["a"].into_iter(), &known, 100);
        m.note_busy(std::iter::empty(), &known, 700);
        m.note_busy(std::iter::empty(), &known, 800);
        let r = m.recall(&known, Instant::now());
        assert_eq!(r.last_busy.get("a"), Some(&700));
        assert_eq!(r.last_busy.get("b"), None, "never seen busy");
        assert_eq!(r.started, 100);
    }

    #[test]
    fn three_repairs_within_ten_minutes_make_the_cluster_policy_contested() {
        let mut m = memory();
        let t0 = Instant::now();
        m.record(&repaired("a"), t0);
        m.record(&repaired("b"), t0 + 4 * MINUTE);
        assert_eq!(
            m.recall(&[], t0 + 5 * MINUTE)
                .carried
                .cluster_policy_contested,
            None
        );
        m.record(&repaired("c"), t0 + 8 * MINUTE);
        assert_eq!(
            m.recall(&[], t0 + 9 * MINUTE)
                .carried
                .cluster_policy_contested,
            Some("3 reverts in the last 10 minutes, last: c".into())
        );
        // The first repair leaves the window: two are a one-off, not a fight.
        assert_eq!(
            m.recall(&[], t0 + 11 * MINUTE)
                .carried
                .cluster_policy_contested,
            None
        );
    }

    #[test]
    fn pending_timer_resets_when_the_config_label_changes() {
        let mut m = memory();
        let t0 = Instant::now();
        let pending = |layout| {
            node(
                "n",
                &[(LABEL_MIG_CONFIG, layout), (LABEL_MIG_STATE, "pending")],
            )
        };
        assert!(m.recall(&[pending("a")], t0).mig_stuck.is_empty());
        assert!(
            m.recall(&[pending("a")], t0 + 9 * MINUTE)
                .mig_stuck
                .is_empty()
        );
        // A new layout starts a new wait.
        assert!(
            m.recall(&[pending("b")], t0 + 9 * MINUTE)
                .mig_stuck
                .is_empty()
        );
        assert!(
            m.recall(&[pending("b")], t0 + 15 * MINUTE)
                .mig_stuck
                .is_empty()
        );
        let stuck = m.recall(&[pending("b")], t0 + 20 * MINUTE).mig_stuck;
        assert_eq!(stuck, BTreeSet::from(["n".to_string()]));
        // Not pending any more: the timer goes, and a new pending state waits afresh.
        let done = node(
            "n",
            &[(LABEL_MIG_CONFIG, "b"), (LABEL_MIG_STATE, "success")],
        );
        assert!(m.recall(&[done], t0 + 21 * MINUTE).mig_stuck.is_empty());
        assert!(
            m.recall(&[pending("b")], t0 + 22 * MINUTE)
                .mig_stuck
                .is_empty()
        );
    }

    #[test]
    fn mig_and_vgpu_pending_timers_are_kept_apart() {
        let mut m = memory();
        let t0 = Instant::now();
        let mig = node(
            "m",
            &[(LABEL_MIG_CONFIG, "a"), (LABEL_MIG_STATE, "pending")],
        );
        let vgpu = node(
            "v",
            &[(LABEL_VGPU_CONFIG, "a"), (LABEL_VGPU_STATE, "pending")],
        );
        m.recall(&[mig.clone(), vgpu.clone()], t0);
        let later = m.recall(&[mig, vgpu], t0 + 11 * MINUTE);
        assert_eq!(later.mig_stuck, BTreeSet::from(["m".to_string()]));
        assert_eq!(later.vgpu_stuck, BTreeSet::from(["v".to_string()]));
    }

    #[test]
    fn blocked_evictions_are_replaced_by_the_last_pass_that_tried_them_all() {
        let mut m = memory();
        let t0 = Instant::now();
        let blocked = |pod: &str| Learnt::EvictionBlocked {
            pod: pod.into(),
            why: "eviction refused (429)".into(),
        };
        m.record(
            &report(vec![blocked("ns/a"), blocked("ns/b"), draining(&["n"])]),
            t0,
        );
        let recalled = m.recall(&[], t0).carried.eviction_blocked;
        assert_eq!(recalled.keys().collect::<Vec<_>>(), ["ns/a", "ns/b"]);
        // A pass that failed before trying every eviction leaves the list standing.
        m.record(&report(vec![blocked("ns/c")]), t0);
        assert_eq!(m.recall(&[], t0).carried.eviction_blocked, recalled);
        m.record(&report(vec![blocked("ns/b"), draining(&["n"])]), t0);
        let last = m.recall(&[], t0).carried.eviction_blocked;
        assert_eq!(last.keys().collect::<Vec<_>>(), ["ns/b"]);
        m.record(&report(vec![draining(&[])]), t0);
        assert!(m.recall(&[], t0).carried.eviction_blocked.is_empty());
    }

    #[test]
    fn foreign_cordons_last_while_their_nodes_are_drained() {
        let mut m = memory();
        let t0 = Instant::now();
        let cordon = |n: &str| Learnt::ForeignCordon(n.into());
        m.record(
            &report(vec![cordon("a"), cordon("b"), draining(&["a", "b"])]),
            t0,
        );
        // A pass that failed before its evictions keeps them all.
        m.record(&report(vec![cordon("c")]), t0);
        let all = m.recall(&[], t0).foreign_cordons;
        assert_eq!(all.iter().collect::<Vec<_>>(), ["a", "b", "c"]);
        m.record(&report(vec![draining(&["b"])]), t0);
        let left = m.recall(&[], t0).foreign_cordons;
        assert_eq!(left.iter().collect::<Vec<_>>(), ["b"]);
    }

    #[test]
    fn namespace_missing_lasts_until_a_configmap_write_goes_through() {
        let mut m = memory();
        let t0 = Instant::now();
        let missing =
            |m: &mut ControllerMemory| m.recall(&[], t0).carried.gpu_operator_namespace_missing;
        m.record(
            &report(vec![Learnt::NamespaceMissing("gpu-operator".into())]),
            t0,
        );
        assert_eq!(missing(&mut m), Some("gpu-operator".into()));
        // A pass that wrote no ConfigMap learnt nothing about it.
        m.record(&report(vec![]), t0);
        assert_eq!(missing(&mut m), Some("gpu-operator".into()));
        m.record(&report(vec![Learnt::NamespaceFound]), t0);
        assert_eq!(missing(&mut m), None);
    }

    #[test]
    fn applied_cluster_policy_fields_accumulate() {
        let mut m = memory();
        let t0 = Instant::now();
        let applied = |fields: &[&str]| Learnt::ClusterPolicyApplied {
            fields: fields.iter().map(|f| f.to_string()).collect(),
        };
        m.record(&report(vec![applied(&["spec.a"])]), t0);
        m.record(&report(vec![applied(&["spec.b"])]), t0);
        let fields: Vec<&String> = m.cluster_policy_applied().iter().collect();
        assert_eq!(fields, ["spec.a", "spec.b"]);
    }
}
