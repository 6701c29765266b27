//! Demand-driven MIG: the operator's planner in the loop, every simulated second.
//!
//! Each second: pods whose run is over finish; the trace's pods arriving join the queue; the
//! scheduler model binds what the nodes offer; the planner (the same [`Planner`] the controller
//! keeps) plans a pass with the pods still pending as demand, and its writes are applied (labels,
//! annotations, the layout demand chose); NVIDIA's components answer, the MIG manager
//! `mig_delay` seconds after it was asked for a layout, and the device plugin then advertises it.

use std::collections::HashSet;
use std::ops::Range;
use std::time::Instant;

use gpu_sharing_operator::api::crd::GpuSharingPolicy;
use gpu_sharing_operator::api::names::{ANNOTATION_CORDONED, LABEL_MIG_CONFIG, LABEL_MIG_STATE};
use gpu_sharing_operator::converge;
use gpu_sharing_operator::nvidia::state::ConfigState;
use gpu_sharing_operator::plan::input::{GpuPod, PendingPod};
use gpu_sharing_operator::plan::{NodeView, PlanInput, Planner};

use super::Outcome;
use super::cluster::{Cluster, Node, Scheduler};
use super::pool::configured;
use super::trace::{Arrival, PROFILES};

/// How many times its longest wait ([`settled_after`]) a replay may go on after the last
/// arrival before it is cut: a guard against a model that never comes to rest.
const GUARD: i64 = 100;

/// Replays the trace under `p`, a dynamic policy of the pool (see [`super::pool::policy`] and
/// [`super::pool::timed_policy`]): its nodes start on its layout. It ends when every pod has
/// been served, or when nothing runs, no node is reconfiguring and the operator has
/// written nothing for longer than its timers ([`settled_after`]): then nothing can change any
/// more, and the pods still pending are never served.
pub(crate) fn replay(
    arrivals: &[Arrival],
    nodes: usize,
    scheduler: Scheduler,
    p: &GpuSharingPolicy,
    mig_delay: i64,
    seed: u64,
) -> Outcome {
    let settled = settled_after(p) + mig_delay;
    let mut input = configured(p, nodes);
    let t0 = input.cluster.now;
    let mut planner = Planner::default();
    let mut c = Cluster::new(arrivals, vec![Node::default(); nodes], scheduler, seed);
    // The trace's pods: no node selector, no toleration.
    let any_pod = PendingPod::default();
    let mut asked: Vec<Option<i64>> = vec![None; nodes];
    let mut layouts = mig_layouts(&input.nodes);
    let mut last_write = 0;
    let last_arrival = arrivals.last().map_or(0, |a| a.at);
    for s in 0.. {
        let now = t0 + s;
        input.cluster.now = now;
        c.finish(s);
        let arrived = c.admit(s);
        observe(&mut c.nodes, &input.nodes, &any_pod);
        let bound = c.bind(s);
        report_pods(&mut c.nodes, &mut input.nodes, arrivals, (t0, now));
        update_demand(&mut input.cluster.demand, arrivals, arrived, &bound, t0);
        let started = Instant::now();
        let plan = planner.plan(&input);
        c.out.pass_ms.push(started.elapsed().as_secs_f64() * 1000.0);
        let mut wrote = !converge::apply(&mut input, &plan).is_empty();
        wrote |= nvidia_answers(&mut input, &mut asked, mig_delay, now);
        if wrote {
            last_write = s;
        }
        c.out.reshapes += reshaped(&mut layouts, &input.nodes);
        if c.at_rest() {
            let quiet = asked.iter().all(Option::is_none) && s - last_write > settled;
            if c.pending() == 0 || quiet {
                break;
            }
        }
        if s > last_arrival + GUARD * settled {
            c.out.cut = true;
            break;
        }
    }
    c.into_outcome()
}

/// Seconds after which every timer of the policy's `spec.mig.dynamic` has run out: the quiet
/// period and the longest delay of demand, a node's idle time and a layout's lifetime.
pub(crate) fn settled_after(p: &GpuSharingPolicy) -> i64 {
    let d = p
        .spec
        .mig
        .as_ref()
        .and_then(|m| m.dynamic.as_ref())
        .expect("a dynamic policy");
    d.quiet_seconds + d.max_delay_seconds + d.idle_seconds + d.min_layout_lifetime_seconds
}

/// Each node's MIG layout (`nvidia.com/mig.config`).
fn mig_layouts(nodes: &[NodeView]) -> Vec<Option<String>> {
    nodes
        .iter()
        .map(|v| v.labels.get(LABEL_MIG_CONFIG).map(str::to_string))
        .collect()
}

/// How many nodes' layouts differ from `before`, which is brought up to date.
fn reshaped(before: &mut Vec<Option<String>>, nodes: &[NodeView]) -> usize {
    let now = mig_layouts(nodes);
    let changed = now
        .iter()
        .zip(before.iter())
        .filter(|(a, b)| a != b)
        .count();
    *before = now;
    changed
}

/// What each node offers the scheduler now: the MIG instances the device plugin advertises;
/// nothing while the MIG manager works (it stops the device plugin), nor past a taint the
/// trace's pods do not tolerate (someone's cordon is one), nor while the operator cordons it
/// (its own cordon mark: the controller sets `spec.unschedulable` in the same apply).
fn observe(nodes: &mut [Node], views: &[NodeView], pod: &PendingPod) {
    for (n, v) in nodes.iter_mut().zip(views) {
        n.allocatable = PROFILES.each_ref().map(|p| v.allocatable(p.resource));
        let cordoned = v.annotations.get(ANNOTATION_CORDONED).is_some();
        n.open = !reconfiguring(v) && !cordoned && pod.fits(v, None);
        n.spare = v.spare;
    }
}

fn reconfiguring(v: &NodeView) -> bool {
    matches!(
        ConfigState::parse(v.labels.get(LABEL_MIG_STATE)),
        Some(ConfigState::Pending | ConfigState::Rebooting)
    )
}

/// Tells the planner what runs where: each node's GPU pods, when each started (bound: the
/// model starts a pod as it binds it) and the instances they hold, and when it last ran one.
fn report_pods(
    nodes: &mut [Node],
    views: &mut [NodeView],
    arrivals: &[Arrival],
    (t0, now): (i64, i64),
) {
    for (n, v) in nodes.iter_mut().zip(views) {
        if !n.pods.is_empty() {
            v.last_busy = now;
        }
        if std::mem::take(&mut n.changed) {
            v.gpu_pods = n.pods.iter().map(|&k| arrivals[k].id.clone()).collect();
            v.gpu_pod_details = n
                .pods
                .iter()
                .map(|&k| {
                    let started = t0 + n.started.get(&k).copied().unwrap_or(0);
                    let d = GpuPod {
                        started,
                        ..Default::default()
                    };
                    (arrivals[k].id.clone(), d)
                })
                .collect();
            v.gpu_requests = n
                .used()
                .iter()
                .zip(&PROFILES)
                .filter(|(count, _)| **count > 0)
                .map(|(count, p)| (p.resource.to_string(), *count))
                .collect();
        }
    }
}

/// The planner's demand: the pods that arrived join it, the pods bound leave it.
fn update_demand(
    demand: &mut Vec<PendingPod>,
    arrivals: &[Arrival],
    arrived: Range<usize>,
    bound: &[usize],
    t0: i64,
) {
    demand.extend(arrivals[arrived].iter().map(|a| PendingPod {
        id: a.id.clone(),
        since: t0 + a.at,
        profiles: [(PROFILES[a.profile].name.to_string(), 1)].into(),
        ..Default::default()
    }));
    if !bound.is_empty() {
        let bound: HashSet<&str> = bound.iter().map(|&k| arrivals[k].id.as_str()).collect();
        demand.retain(|p| !bound.contains(p.id.as_str()));
    }
}

/// NVIDIA's components answer at `now`: the MIG manager confirms a layout `delay` seconds after
/// it was asked for (the node stays `pending` until then), the others at once. Returns whether
/// a node changed.
fn nvidia_answers(input: &mut PlanInput, asked: &mut [Option<i64>], delay: i64, now: i64) -> bool {
    let mut held = Vec::new();
    for (i, v) in input.nodes.iter().enumerate() {
        if reconfiguring(v) {
            let since = *asked[i].get_or_insert(now);
            if now - since < delay {
                held.push(i);
            }
        } else {
            asked[i] = None;
        }
    }
    // The nodes still at work sit the answer out.
    let aside: Vec<(usize, NodeView)> = held
        .iter()
        .rev()
        .map(|&i| (i, input.nodes.remove(i)))
        .collect();
    let changed = !converge::nvidia_succeeds(input, now).is_empty();
    for (i, v) in aside.into_iter().rev() {
        input.nodes.insert(i, v);
    }
    changed
}
