//! Demand-driven MIG against static MIG layouts (`--demand-trace SEED`): a seeded trace of MIG
//! requests replayed, in memory and in simulated seconds, on simulated A100 80GB nodes.
//!
//! For each kind of trace (`--demand-kind`: a mix that shifts each third, or a stationary one),
//! each rate (`--demand-rate`) and each scheduler model (`--demand-scheduler`), the replays are:
//! - every layout of the catalogue on every node (the uniform pools);
//! - the oracle: every per-node assignment of the catalogue's layouts, C(nodes + 5, 5) of them,
//!   the best kept (fewest pods never served, then served pods' p95 wait, then their mean wait).
//!   It knows the whole trace, which no admin does: an upper bound for static layouts;
//! - the admin's split: the assignment whose compute slices per profile best match the demand
//!   of the trace's first fifth (see [`statics::admin`]);
//! - `spec.mig.dynamic`, once per MIG manager cost (`--demand-mig-delays`), with the operator's
//!   planner in the loop (see [`dynamic`]).
//!
//! Static replays need no operator (nothing ever reshapes), so they are a scheduler-only loop
//! from event to event, cheap enough for the exhaustive search. Every replay goes on until
//! nothing more can change, so "never served" is exact and the served pods' waits (arrival to
//! binding) depend on no cut-off.
//!
//! The scheduler is a model (see [`Scheduler`]), not kube-scheduler: the end-to-end test
//! `tests/e2e_demand.rs` shows the real one placing the pods; this compares policies over a long
//! trace. Also measured: the planner's time per pass during the dynamic replays, and a pass at
//! 1,000 nodes with 500 pending pods.
//!
//! `--demand-live SEED` replays a smaller trace in real time on the local control plane instead,
//! with kube-scheduler, the node simulator and the operator binary, beside the model's replay of
//! the same trace (see [`live`]).

mod cluster;
mod dynamic;
mod live;
mod livekube;
mod pool;
mod statics;
mod trace;

use std::fmt::Write as _;
use std::time::Instant;

use gpu_sharing_operator::api::crd::GpuSharingPolicy;
use gpu_sharing_operator::plan::Planner;
use gpu_sharing_operator::plan::input::PendingPod;

pub(crate) use cluster::Scheduler;
pub(crate) use live::{LiveConfig, LiveSettings, run as run_live};
pub(crate) use livekube::Bins;
pub(crate) use pool::Timers;
use pool::{Busy, DYNAMIC_START, LAYOUTS};
use statics::{ADMIN_SAMPLE, Split};
pub(crate) use trace::Kind;
use trace::{Arrival, PerProfile, SLICES_PER_GPU, Trace};

/// What to replay.
#[derive(Clone, Debug)]
pub(crate) struct Settings {
    pub seed: u64,
    pub nodes: usize,
    /// Seconds over which pods arrive.
    pub seconds: i64,
    /// Pods per second on average: one set of tables each.
    pub rates: Vec<f64>,
    /// Run time of a pod: uniform between these, in seconds.
    pub run: (i64, i64),
    pub kinds: Vec<Kind>,
    pub schedulers: Vec<Scheduler>,
    /// Seconds the MIG manager takes to reshape a node (dynamic rows only).
    pub mig_delays: Vec<i64>,
    /// The dynamic policy's timers; `None`: the defaults of `spec.mig.dynamic`.
    pub timers: Option<pool::Timers>,
    /// The command line that reruns this, for the report.
    pub command: String,
}

/// What one replay measured.
#[derive(Debug, Default)]
pub(crate) struct Outcome {
    /// Each served pod's wait, arrival to binding, in seconds.
    pub waits: Vec<i64>,
    /// The served pods, by index in the trace, in the order of [`Outcome::waits`].
    pub served: Vec<usize>,
    /// Pods still pending when nothing more could change.
    pub never_served: usize,
    /// Compute slice-hours the served pods held.
    pub slice_hours: f64,
    /// MIG layout changes after the start.
    pub reshapes: usize,
    /// The planner's time per pass (dynamic only).
    pub pass_ms: Vec<f64>,
    /// The replay was cut before it came to rest (a guard; never seen): never served is then
    /// an upper bound.
    pub cut: bool,
}

impl Outcome {
    fn mean_wait(&self) -> f64 {
        if self.waits.is_empty() {
            return 0.0;
        }
        self.waits.iter().sum::<i64>() as f64 / self.waits.len() as f64
    }

    /// The served pods' 95th percentile wait (nearest rank).
    fn p95_wait(&self) -> i64 {
        let mut s = self.waits.clone();
        s.sort_unstable();
        let rank = (s.len() as f64 * 0.95).ceil() as usize;
        s.get(rank.saturating_sub(1)).copied().unwrap_or(0)
    }

    /// The oracle's order, lowest best: pods never served, then the served pods' p95 wait,
    /// then their mean wait.
    fn rank(&self) -> (usize, i64, f64) {
        (self.never_served, self.p95_wait(), self.mean_wait())
    }
}

/// Runs every configuration; returns the markdown report.
pub(crate) fn run(s: &Settings) -> String {
    let started = Instant::now();
    let caps = pool::capacities();
    let slices = s.nodes as i64 * pool::gpus_per_node() * SLICES_PER_GPU;
    let mut md = header(s);
    let mut pass_ms = Vec::new();
    for &kind in &s.kinds {
        for &rate in &s.rates {
            let trace = Trace {
                seed: s.seed,
                kind,
                seconds: s.seconds,
                rate,
                run: s.run,
            };
            md.push_str(&section(s, &trace, &caps, slices, &mut pass_ms));
        }
    }
    md.push_str(&planner_timings(s, pass_ms));
    let _ = writeln!(
        md,
        "\nThe whole run took {:.0} s (release build).",
        started.elapsed().as_secs_f64()
    );
    md
}

/// One trace: its load, then a table per scheduler model. `slices` is the pool's.
fn section(
    s: &Settings,
    trace: &Trace,
    caps: &[PerProfile; LAYOUTS.len()],
    slices: i64,
    pass_ms: &mut Vec<f64>,
) -> String {
    let arrivals = trace.arrivals();
    let (load, thirds) = trace.offered_load(&arrivals, slices);
    let mut md = format!(
        "\n## {} trace, {} pods/s\n\n{} pods; offered load {:.0}% of the pool's compute slice-seconds (thirds: {:.0}%, {:.0}%, {:.0}%).\n",
        trace.kind.name(),
        trace.rate,
        arrivals.len(),
        load * 100.0,
        thirds[0] * 100.0,
        thirds[1] * 100.0,
        thirds[2] * 100.0
    );
    let admin = statics::admin(&arrivals, caps, s.nodes, slices);
    for &scheduler in &s.schedulers {
        eprintln!(
            "scale-bench: demand trace: {} {}/s, {}",
            trace.kind.name(),
            trace.rate,
            scheduler.name()
        );
        md.push_str(&table(s, &arrivals, caps, admin, scheduler, pass_ms));
    }
    md
}

/// The dynamic policy of the replays: from [`DYNAMIC_START`], at the timers asked for.
fn dynamic_policy(s: &Settings, busy: Busy) -> GpuSharingPolicy {
    match s.timers {
        Some(t) => pool::timed_policy(DYNAMIC_START, busy, t),
        None => pool::policy(DYNAMIC_START, Some(busy)),
    }
}

/// What every table shares: the pool, the pods, the rules of the replays, how to rerun.
fn header(s: &Settings) -> String {
    let d = dynamic_policy(s, Busy::Wait)
        .spec
        .mig
        .and_then(|m| m.dynamic)
        .expect("a dynamic policy");
    format!(
        "# Demand-driven MIG against static layouts\n\n\
         Seed {seed}. Rerun: `{command}`\n\n\
         - **Pool**: {nodes} A100 80GB nodes, {gpus} GPUs, {slices} compute slices.\n\
         - **Pods**: single-instance MIG pods arriving over {secs} s (Poisson), each running {r0}-{r1} s (uniform). The shifting mix changes each third (mostly 1g, then 3g/4g, then 7g); the stationary one is their average throughout. Offered load: the pods' slice-seconds over the pool's during the arrivals.\n\
         - **Replay**: until nothing more can change (static: every pod arrived and none runs; dynamic: besides, no node reconfiguring and no operator write for longer than its timers). Waits are arrival to binding, of served pods only; never served counts the pods still pending then.\n\
         - **Schedulers**: first-fit binds to the first node by name that fits; kube-default is kube-scheduler's default profile as v1.35 scores it: the pods request no CPU or memory, so only NodeResourcesFit's LeastAllocated score (each pod counted as 100m and 200Mi, on the 96-CPU, 1,152 GiB fixture nodes) tells nodes apart, in whole points that move one per about ten pods; ties, which are most choices, at random (seeded), as its selectHost breaks them; pack is a MostAllocated profile over the `nvidia.com/mig-*` resources (the feasible node with the most compute slices allocated, ties at random). None binds to a node whose MIG manager is at work or whose taints the pods do not tolerate. Static rows are the same under every scheduler: each pod asks for one instance, so which node takes it changes nothing for the next.\n\
         - **Uniform**: one layout on every node. **Oracle** (knows the whole trace): the best of all {tried} per-node assignments of the catalogue's {layouts} layouts, by fewest never served, then served p95, then served mean. **Admin's split**: from the first {sample:.0}% of arrivals, the assignment whose compute slices per profile are closest (least total absolute difference) to each profile's share of the slice-seconds observed times the pool's slices.\n\
         - **Dynamic**: starts {start} on every node; quietSeconds {quiet}, maxDelaySeconds {delay}, idleSeconds {idle}, minLayoutLifetimeSeconds {life}, maxUnavailable 25%; no drains. Rows with reserveBusyNodes may also choose a busy node: it is cordoned (no new pod lands there, none is evicted) and reshaped once its pods finish. While the MIG manager reshapes a node (the MIG cost), the whole node offers nothing.\n",
        seed = s.seed,
        command = s.command,
        nodes = s.nodes,
        gpus = s.nodes as i64 * pool::gpus_per_node(),
        slices = s.nodes as i64 * pool::gpus_per_node() * SLICES_PER_GPU,
        secs = s.seconds,
        r0 = s.run.0,
        r1 = s.run.1,
        tried = Split::all(s.nodes).len(),
        layouts = LAYOUTS.len(),
        sample = ADMIN_SAMPLE * 100.0,
        start = DYNAMIC_START,
        quiet = d.quiet_seconds,
        delay = d.max_delay_seconds,
        idle = d.idle_seconds,
        life = d.min_layout_lifetime_seconds,
    )
}

/// One table: every configuration under one scheduler model.
fn table(
    s: &Settings,
    arrivals: &[Arrival],
    caps: &[PerProfile; LAYOUTS.len()],
    admin: Split,
    scheduler: Scheduler,
    pass_ms: &mut Vec<f64>,
) -> String {
    let mut rows: Vec<(String, Outcome)> = (0..LAYOUTS.len())
        .map(|l| {
            let o = statics::replay(
                arrivals,
                Split::uniform(l, s.nodes),
                caps,
                scheduler,
                s.seed,
            );
            (format!("static {}", LAYOUTS[l]), o)
        })
        .collect();
    let oracle = statics::oracle(arrivals, caps, s.nodes, scheduler, s.seed);
    rows.push((
        format!(
            "oracle (knows the whole trace): {}",
            oracle.split.describe()
        ),
        oracle.outcome,
    ));
    rows.push((
        format!("admin's split: {}", admin.describe()),
        statics::replay(arrivals, admin, caps, scheduler, s.seed),
    ));
    for busy in Busy::ALL {
        let name = busy.name();
        for &delay in &s.mig_delays {
            let p = dynamic_policy(s, busy);
            let mut o = dynamic::replay(arrivals, s.nodes, scheduler, &p, delay, s.seed);
            pass_ms.append(&mut o.pass_ms);
            rows.push((format!("{name}, MIG {delay} s"), o));
        }
    }
    let mut md = format!(
        "\n### {} scheduler\n\n| configuration | served mean wait s | served p95 wait s | never served | slice-hours used | reshapes |\n|---|---:|---:|---:|---:|---:|\n",
        scheduler.name()
    );
    for (name, o) in &rows {
        let cut = if o.cut { " (cut)" } else { "" };
        let _ = writeln!(
            md,
            "| {name}{cut} | {:.0} | {} | {} | {:.1} | {} |",
            o.mean_wait(),
            o.p95_wait(),
            o.never_served,
            o.slice_hours,
            o.reshapes
        );
    }
    let _ = writeln!(
        md,
        "\nOracle search: {} assignments replayed in {:.2} s; {} as good as the one named; the lowest served mean wait among those serving as many pods: {:.0} s.",
        oracle.tried,
        oracle.took.as_secs_f64(),
        oracle.as_good,
        oracle.best_mean
    );
    md
}

/// The planner's time per pass over every dynamic replay, and one pass at 1,000 nodes.
fn planner_timings(s: &Settings, mut ms: Vec<f64>) -> String {
    let mut md = String::from("\n## Planner\n\n");
    if !ms.is_empty() {
        ms.sort_by(f64::total_cmp);
        let _ = writeln!(
            md,
            "Per pass during the dynamic replays ({} passes, {} nodes): median {:.2} ms, p99 {:.2} ms, max {:.2} ms.",
            ms.len(),
            s.nodes,
            ms[ms.len() / 2],
            ms[(ms.len() * 99 / 100).min(ms.len() - 1)],
            ms[ms.len() - 1]
        );
    }
    let (big, pods) = pass_at(1000, 500, s.seed);
    let _ = writeln!(
        md,
        "A pass at 1,000 idle A100 nodes with {pods} pending pods (warm planner, median of 5): {big:.1} ms."
    );
    md
}

/// The planner's time for one pass at `nodes` idle A100 nodes (NVIDIA's balanced layout) with
/// `pods` pending pods of the shifting trace's first-third mix; the median of 5, with a warm
/// planner.
fn pass_at(nodes: usize, pods: usize, seed: u64) -> (f64, usize) {
    let p = pool::policy(DYNAMIC_START, Some(Busy::Wait));
    let mut input = pool::configured(&p, nodes);
    let t = Trace {
        seed,
        kind: Kind::Shifting,
        seconds: 1_000_000,
        rate: pods as f64 / 1_000_000.0 * 3.0,
        run: (60, 60),
    };
    input.cluster.demand = t
        .arrivals()
        .into_iter()
        .take(pods)
        .map(|a| PendingPod {
            id: a.id,
            since: input.cluster.now - 60,
            profiles: [(trace::PROFILES[a.profile].name.to_string(), 1)].into(),
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
