//! Demand-driven MIG against the best static layout (`--demand-trace SEED`): a seeded trace of
//! MIG requests replayed, in memory and in simulated seconds, on simulated A100 80GB nodes,
//! once with each layout of the catalogue fixed on every node and once with `spec.mig.dynamic`.
//!
//! Every second of the replay:
//! 1. pods whose run time is over finish and free their instances;
//! 2. the trace's pods arriving now join the pending queue;
//! 3. a scheduler model binds pending pods, highest priority then oldest first, to the first
//!    node (by name) whose free allocatable holds the whole request; a node whose MIG manager
//!    is reconfiguring offers nothing (the MIG manager stops the device plugin);
//! 4. the operator's planner plans a pass (the same [`plan::Planner`] the controller keeps),
//!    with the pods it could not bind as demand, and its writes are applied (labels,
//!    annotations, the layout demand chose);
//! 5. NVIDIA's components answer: a MIG layout is confirmed `--mig-delay` seconds after it was
//!    asked for, and the device plugin then advertises it (`plan::converge::nvidia_succeeds`).
//!
//! Reported per configuration: pods' mean and p95 wait (arrival to binding; a pod never served
//! counts with its wait until the replay ends), pods never served (still pending when the
//! replay ends, 900 s after the last arrival and the longest run time), GPU slice-hours used, and
//! reshapes (MIG layout changes after the start). The scheduler is a model (first fit), not kube-scheduler: the end-to-end
//! test `tests/e2e_demand.rs` shows the real one placing the pods; this compares policies over
//! a long trace. Also measured: the planner's time per pass during the dynamic replay, and a
//! pass at 1,000 nodes with 500 pending pods.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Instant;

use gpu_sharing_operator::api::names::{LABEL_MIG_CONFIG, LABEL_MIG_STATE};
use gpu_sharing_operator::plan::input::PendingPod;
use gpu_sharing_operator::plan::{Labels, NodeView, Planner, converge};

use super::*;

/// MIG profiles of an A100 80GB, with their compute slices and the trace's mix (per cent) in
/// each third of the trace: small pods first, then medium, then whole GPUs.
const PROFILES: [(&str, i64, [u32; 3]); 5] = [
    ("1g.10gb", 1, [60, 20, 10]),
    ("2g.20gb", 2, [20, 20, 10]),
    ("3g.40gb", 3, [10, 40, 20]),
    ("4g.40gb", 4, [5, 15, 20]),
    ("7g.80gb", 7, [5, 5, 40]),
];
/// The catalogue: every single-profile layout of an A100 80GB, and NVIDIA's mixed one.
const LAYOUTS: [&str; 6] = [
    "all-1g.10gb",
    "all-2g.20gb",
    "all-3g.40gb",
    "all-4g.40gb",
    "all-7g.80gb",
    "all-balanced",
];
const START: i64 = 1_800_000_000;
/// Seconds the replay goes on after the last arrival and the longest run time.
const DRAIN: i64 = 900;

/// The replay's settings.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Trace {
    pub seed: u64,
    pub nodes: usize,
    /// Seconds over which pods arrive.
    pub seconds: i64,
    /// Pods per second on average.
    pub rate: f64,
    /// Run time of a pod: uniform between these, in seconds.
    pub run: (i64, i64),
    /// Seconds the MIG manager takes to apply a layout.
    pub mig_delay: i64,
}

/// One pod of the trace.
#[derive(Clone, Debug)]
struct Arrival {
    id: String,
    at: i64,
    profile: &'static str,
    slices: i64,
    run: i64,
}

/// xorshift64*: a few lines instead of a dependency, the same trace on every machine.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
}

fn trace(t: &Trace) -> Vec<Arrival> {
    let mut rng = Rng(t.seed.max(1));
    let mut out = Vec::new();
    let mut at = 0.0f64;
    loop {
        // Exponential gaps: a Poisson arrival process.
        at += -(1.0 - rng.unit()).ln() / t.rate;
        if at >= t.seconds as f64 {
            return out;
        }
        let third = ((at as i64 * 3) / t.seconds).min(2) as usize;
        let mut pick = (rng.unit() * 100.0) as u32;
        let (profile, slices, _) = *PROFILES
            .iter()
            .find(|(_, _, mix)| {
                if pick < mix[third] {
                    true
                } else {
                    pick -= mix[third];
                    false
                }
            })
            .unwrap_or(&PROFILES[0]);
        let run = t.run.0 + (rng.unit() * (t.run.1 - t.run.0) as f64) as i64;
        out.push(Arrival {
            id: format!("trace/pod-{:05}", out.len()),
            at: at as i64,
            profile,
            slices,
            run,
        });
    }
}

fn policy(layout: &str, dynamic: bool) -> GpuSharingPolicy {
    let dynamic = if dynamic {
        format!(
            "    dynamic: {{layouts: [{}]}}\n",
            LAYOUTS
                .iter()
                .filter(|l| **l != layout)
                .copied()
                .collect::<Vec<_>>()
                .join(", ")
        )
    } else {
        String::new()
    };
    let yaml = format!(
        "apiVersion: gpusharing.io/v1alpha1\nkind: GpuSharingPolicy\nmetadata: {{name: a100, generation: 1}}\nspec:\n  nodeSelector: {{matchLabels: {{bench.gpusharing.io/pool: a100}}}}\n  strategy: mig\n  mig:\n    migStrategy: mixed\n    layout: {layout}\n{dynamic}  rollout: {{maxUnavailable: 25%}}\n"
    );
    gpu_sharing_operator::api::yaml::from_str(&yaml).expect("the benchmark's policy parses")
}

/// Node `i` of the pool: the shared A100 80GB fixture, with its compute capability.
fn a100(i: usize) -> NodeFacts {
    let mut n = testkit::fixtures::a100_node(&format!("a100-{i:04}"));
    n.labels.insert("bench.gpusharing.io/pool", "a100");
    n.labels.insert("nvidia.com/gpu.compute.major", "8");
    n
}

/// `n` nodes configured with the policy's own layout (plan, apply, NVIDIA answers, until
/// nothing changes).
fn configured(p: &GpuSharingPolicy, n: usize) -> PlanInput {
    let mut input = PlanInput::new(vec![p.clone()], (0..n).map(a100).collect());
    input.cluster.base_mig_configs = Some(gpu_sharing_operator::nvidia::default_mig_configs());
    input.cluster.now = START;
    for _ in 0..20 {
        let plan = plan::plan(&input);
        let mut changed = converge::apply(&mut input, &plan);
        let answer = input.cluster.now + 1;
        changed.extend(converge::nvidia_succeeds(&mut input, answer));
        input.cluster.now += 2;
        if changed.is_empty() {
            break;
        }
    }
    input
}

/// What one replay measured.
#[derive(Debug, Default)]
pub(crate) struct Outcome {
    pub config: String,
    pub pods: usize,
    pub waits: Vec<i64>,
    pub never_served: usize,
    pub slice_hours: f64,
    pub reshapes: usize,
    pub pass_ms: Vec<f64>,
}

struct Running {
    node: usize,
    resource: String,
    ends: i64,
}

/// Replays the trace under `p`.
fn replay(t: &Trace, p: &GpuSharingPolicy, name: &str) -> Outcome {
    let arrivals = trace(t);
    let mut input = configured(p, t.nodes);
    let t0 = input.cluster.now;
    let mut planner = Planner::default();
    let mut out = Outcome {
        config: name.into(),
        pods: arrivals.len(),
        ..Default::default()
    };
    let mut next = 0;
    let mut pending: Vec<(usize, i64)> = Vec::new(); // (trace index, arrived at)
    let mut running: BTreeMap<String, Running> = BTreeMap::new();
    let mut last_busy = vec![0i64; t.nodes];
    let mut asked: Vec<Option<i64>> = vec![None; t.nodes];
    let mut layouts: Vec<Option<String>> = input
        .nodes
        .iter()
        .map(|v| v.labels.get(LABEL_MIG_CONFIG).map(str::to_string))
        .collect();
    let end = t.seconds + t.run.1 + DRAIN;
    for s in 0..end {
        let now = t0 + s;
        input.cluster.now = now;
        running.retain(|_, r| r.ends > now);
        while next < arrivals.len() && arrivals[next].at <= s {
            pending.push((next, now));
            next += 1;
        }
        schedule(
            &mut input,
            &arrivals,
            &mut pending,
            &mut running,
            &mut out,
            now,
        );
        for (i, v) in input.nodes.iter_mut().enumerate() {
            let pods: Vec<(&String, &Running)> =
                running.iter().filter(|(_, r)| r.node == i).collect();
            if !pods.is_empty() {
                last_busy[i] = now;
            }
            v.gpu_pods = pods.iter().map(|(id, _)| (*id).clone()).collect();
            v.gpu_requests = BTreeMap::new();
            for (_, r) in &pods {
                *v.gpu_requests.entry(r.resource.clone()).or_default() += 1;
            }
            v.last_busy = last_busy[i];
        }
        input.cluster.demand = pending
            .iter()
            .map(|&(k, since)| PendingPod {
                id: arrivals[k].id.clone(),
                since,
                profiles: [(arrivals[k].profile.to_string(), 1)].into(),
                ..Default::default()
            })
            .collect();
        let started = Instant::now();
        let plan = planner.plan(&input);
        out.pass_ms.push(started.elapsed().as_secs_f64() * 1000.0);
        converge::apply(&mut input, &plan);
        nvidia_answers(&mut input, &mut asked, t.mig_delay, now);
        for (i, v) in input.nodes.iter().enumerate() {
            let l = v.labels.get(LABEL_MIG_CONFIG).map(str::to_string);
            if l != layouts[i] {
                out.reshapes += 1;
                layouts[i] = l;
            }
        }
        if next == arrivals.len() && pending.is_empty() && running.is_empty() {
            break;
        }
    }
    out.never_served = pending.len();
    // A pod never served waited until the end at least: it counts with that wait.
    let last = input.cluster.now;
    out.waits
        .extend(pending.iter().map(|&(_, since)| last - since));
    out
}

/// Binds what fits, first fit by node name; pods that do not fit stay pending with the time
/// they were first found unschedulable.
fn schedule(
    input: &mut PlanInput,
    arrivals: &[Arrival],
    pending: &mut Vec<(usize, i64)>,
    running: &mut BTreeMap<String, Running>,
    out: &mut Outcome,
    now: i64,
) {
    let mut free: Vec<BTreeMap<String, i64>> = input
        .nodes
        .iter()
        .enumerate()
        .map(|(i, v)| {
            let reconfiguring = v.labels.get(LABEL_MIG_STATE) == Some("pending");
            v.allocatable
                .iter()
                .filter(|(r, _)| r.starts_with("nvidia.com/mig-") && !reconfiguring)
                .map(|(r, c)| {
                    let used = running
                        .values()
                        .filter(|x| x.node == i && x.resource == r)
                        .count() as i64;
                    (r.to_string(), c.parse::<i64>().unwrap_or(0) - used)
                })
                .collect()
        })
        .collect();
    pending.retain(|&(k, since)| {
        let a = &arrivals[k];
        let resource = format!("nvidia.com/mig-{}", a.profile);
        let Some(i) = free
            .iter()
            .position(|f| f.get(&resource).copied().unwrap_or(0) >= 1)
        else {
            return true;
        };
        *free[i].get_mut(&resource).expect("found") -= 1;
        out.waits.push(now - since);
        out.slice_hours += (a.slices * a.run) as f64 / 3600.0;
        running.insert(
            a.id.clone(),
            Running {
                node: i,
                resource,
                ends: now + a.run,
            },
        );
        false
    });
}

/// The MIG manager confirms a layout `delay` seconds after it was asked for; the other
/// components answer at once.
fn nvidia_answers(input: &mut PlanInput, asked: &mut [Option<i64>], delay: i64, now: i64) {
    let mut held = BTreeSet::new();
    for (i, v) in input.nodes.iter().enumerate() {
        if v.labels.get(LABEL_MIG_STATE) == Some("pending") {
            let since = *asked[i].get_or_insert(now);
            if now - since < delay {
                held.insert(i);
            }
        } else {
            asked[i] = None;
        }
    }
    let all = std::mem::take(&mut input.nodes);
    let (mut answering, mut waiting) = (Vec::new(), Vec::new());
    for (i, v) in all.into_iter().enumerate() {
        if held.contains(&i) {
            waiting.push((i, v));
        } else {
            answering.push((i, v));
        }
    }
    input.nodes = answering.iter().map(|(_, v)| v.clone()).collect();
    converge::nvidia_succeeds(input, now);
    let answered = std::mem::take(&mut input.nodes);
    let mut merged: Vec<(usize, NodeView)> = answering
        .into_iter()
        .map(|(i, _)| i)
        .zip(answered)
        .chain(waiting)
        .collect();
    merged.sort_by_key(|(i, _)| *i);
    input.nodes = merged.into_iter().map(|(_, v)| v).collect();
}

/// The planner's time for one pass at `nodes` idle A100 nodes (NVIDIA's balanced layout) with
/// `pods` pending pods of the trace's first-third mix; the median of 5, with a warm planner.
fn pass_at(nodes: usize, pods: usize, seed: u64) -> (f64, usize) {
    let p = policy("all-balanced", true);
    let mut input = configured(&p, nodes);
    let t = Trace {
        seed,
        nodes,
        seconds: 1_000_000,
        rate: pods as f64 / 1_000_000.0 * 3.0,
        run: (60, 60),
        mig_delay: 10,
    };
    input.cluster.demand = trace(&t)
        .into_iter()
        .take(pods)
        .map(|a| PendingPod {
            id: a.id,
            since: input.cluster.now - 60,
            profiles: [(a.profile.to_string(), 1)].into(),
            ..Default::default()
        })
        .collect();
    let demand = input.cluster.demand.len();
    let mut planner = Planner::default();
    drop(planner.plan(&input));
    let ms = super::planonly::median_ms(5, || {
        let mut p = planner.clone();
        drop(p.plan(&input));
    });
    (ms, demand)
}

fn percentile(v: &[i64], p: f64) -> i64 {
    if v.is_empty() {
        return 0;
    }
    let mut s = v.to_vec();
    s.sort_unstable();
    s[((s.len() as f64 * p).ceil() as usize).clamp(1, s.len()) - 1]
}

/// Runs every configuration; returns the markdown report.
pub(crate) fn run(t: &Trace) -> String {
    let mut rows: Vec<Outcome> = LAYOUTS
        .iter()
        .map(|l| {
            eprintln!("scale-bench: demand trace: static {l}");
            replay(t, &policy(l, false), &format!("static {l}"))
        })
        .collect();
    eprintln!("scale-bench: demand trace: dynamic");
    rows.push(replay(
        t,
        &policy("all-balanced", true),
        "dynamic (starts all-balanced)",
    ));
    let capacity = (t.nodes * 8 * 7) as f64;
    let mut md = format!(
        "Seed {}, {} A100 80GB nodes ({} GPUs), {} pods arriving over {} s (Poisson, {:.2}/s; run time {}-{} s; the mix shifts each third: mostly 1g, then 3g/4g, then 7g), MIG manager {} s per layout, replay until {DRAIN} s after the last pod could finish; a pod never served counts with its wait until then. Dynamic: quietSeconds 2, maxDelaySeconds 10, idleSeconds 30, minLayoutLifetimeSeconds 600, maxUnavailable 25%.\n\n| configuration | mean wait s | p95 wait s | never served | slice-hours used | reshapes |\n|---|---:|---:|---:|---:|---:|\n",
        t.seed,
        t.nodes,
        t.nodes * 8,
        rows[0].pods,
        t.seconds,
        t.rate,
        t.run.0,
        t.run.1,
        t.mig_delay
    );
    for r in &rows {
        let mean = if r.waits.is_empty() {
            0.0
        } else {
            r.waits.iter().sum::<i64>() as f64 / r.waits.len() as f64
        };
        md.push_str(&format!(
            "| {} | {:.0} | {} | {} | {:.1} | {} |\n",
            r.config,
            mean,
            percentile(&r.waits, 0.95),
            r.never_served,
            r.slice_hours,
            r.reshapes
        ));
    }
    let dynamic = rows.last().expect("the dynamic row");
    let mut ms = dynamic.pass_ms.clone();
    ms.sort_by(f64::total_cmp);
    md.push_str(&format!(
        "\nCapacity: {capacity:.0} compute slices. Planner per pass during the dynamic replay ({} passes, {} nodes): median {:.2} ms, p99 {:.2} ms, max {:.2} ms.\n",
        ms.len(),
        t.nodes,
        ms[ms.len() / 2],
        ms[(ms.len() * 99 / 100).min(ms.len() - 1)],
        ms[ms.len() - 1]
    ));
    let (big, pods) = pass_at(1000, 500, t.seed);
    md.push_str(&format!(
        "Planner pass at 1,000 idle A100 nodes with {pods} pending pods (warm planner, median of 5): {big:.1} ms.\n"
    ));
    md
}
