//! Live mode (`--demand-live SEED`): a small trace of the same generator replayed in real time
//! on the local control plane (see [`livekube`]) with the real kube-scheduler, the node simulator
//! and the operator binary, and replayed in the model (the kube-default scheduler model, the same
//! policies, the same MIG delay) beside it, to show how far the model's figures hold.
//!
//! Per kind of trace, the configurations are the oracle's per-node static assignment (computed
//! by [`statics::oracle`] on the same small trace under the kube-default model), the admin's split
//! ([`statics::admin`]), and `spec.mig.dynamic` from all-balanced with short timers (and with
//! `reserveBusyNodes` if asked). Static assignments are applied live as one policy per layout,
//! each selecting its nodes by a label ([`pool::static_policy`]); dynamic is the very policy
//! object the model replays ([`pool::timed_policy`]). Every live run starts a fresh control
//! plane. Writes `<out>/demand-live.md`.

use std::fmt::Write as _;
use std::path::PathBuf;
use std::time::Instant;

use gpu_sharing_operator::api::crd::GpuSharingPolicy;

use super::cluster::Scheduler;
use super::livekube::{self, Bins, LiveNode, Measured};
use super::pool::{self, Busy, DYNAMIC_START, LAYOUT_LABEL, LAYOUTS, POOL_LABEL, Timers};
use super::statics::{self, Split};
use super::trace::{Arrival, Kind, PROFILES, SLICES_PER_GPU, Trace};
use super::{Outcome, dynamic};

/// What to replay live.
pub(crate) struct LiveSettings {
    pub seed: u64,
    pub nodes: usize,
    /// Seconds over which pods arrive.
    pub seconds: i64,
    /// Run time of a pod: uniform between these, in seconds.
    pub run: (i64, i64),
    /// The offered load the rate is chosen for (a fraction of the pool's slice-seconds).
    pub load: f64,
    /// Seconds the simulator's MIG manager takes to reshape a node (`--mig-delay`).
    pub mig_delay: i64,
    pub kinds: Vec<Kind>,
    pub configs: Vec<LiveConfig>,
    /// The command line that reruns this, for the report.
    pub command: String,
    pub out: PathBuf,
}

/// A live configuration.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum LiveConfig {
    /// The oracle's per-node static assignment.
    Oracle,
    /// The admin's split.
    Admin,
    /// `spec.mig.dynamic` from all-balanced.
    Dynamic,
    /// The same with `reserveBusyNodes`.
    DynamicReserve,
    /// The same with `preferBusyNodes`.
    DynamicPrefer,
    /// The same with `preferBusyNodes` and `reserveBusyNodes`.
    DynamicPreferReserve,
}

/// The timers of the dynamic policy of the live mode: short, for a trace of minutes.
pub(crate) const LIVE_TIMERS: Timers = Timers {
    quiet: 2,
    max_delay: 5,
    idle: 5,
    min_lifetime: 30,
};

/// With `reserveBusyNodes` the CRD asks for a lifetime of at least 60 s.
const RESERVE_TIMERS: Timers = Timers {
    min_lifetime: 60,
    ..LIVE_TIMERS
};

/// How long a static run waits, once nothing runs, before the pods still pending are never
/// served (nothing can reshape; kube-scheduler's retries are seconds apart).
const STATIC_SETTLE: i64 = 20;

/// One configuration, ready to run both ways.
struct Setup {
    name: String,
    nodes: Vec<LiveNode>,
    policies: Vec<GpuSharingPolicy>,
    model: Outcome,
    /// The model under the other scheduler models (dynamic only: static rows are the same
    /// under every one).
    others: Vec<(Scheduler, Outcome)>,
    settle: i64,
}

/// Runs every kind and configuration live and in the model; returns the markdown report.
pub(crate) async fn run(s: &LiveSettings, bins: &Bins<'_>) -> anyhow::Result<String> {
    let started = Instant::now();
    let mut md = header(s);
    for &kind in &s.kinds {
        let trace = Trace {
            seed: s.seed,
            kind,
            seconds: s.seconds,
            rate: rate_for(s, kind),
            run: s.run,
        };
        let arrivals = trace.arrivals();
        let (load, thirds) = trace.offered_load(&arrivals, pool_slices(s.nodes));
        let _ = writeln!(
            md,
            "\n## {} trace, {:.2} pods/s\n\n{} pods; offered load {:.0}% (thirds: {:.0}%, {:.0}%, {:.0}%).\n",
            kind.name(),
            trace.rate,
            arrivals.len(),
            load * 100.0,
            thirds[0] * 100.0,
            thirds[1] * 100.0,
            thirds[2] * 100.0
        );
        let mut rows = Vec::new();
        for setup in setups(s, &arrivals) {
            let tag = format!("{}-{}", kind.name(), slug(&setup.name));
            eprintln!("scale-bench: demand live {tag}: {}", setup.name);
            let live = livekube::run(
                bins,
                &tag,
                (&setup.nodes, &setup.policies),
                &arrivals,
                s.mig_delay,
                setup.settle,
            )
            .await;
            match &live {
                Ok(m) => eprintln!(
                    "scale-bench: demand live {tag}: {}",
                    summary(&setup.model, m)
                ),
                Err(e) => eprintln!("scale-bench: demand live {tag}: failed: {e:#}"),
            }
            if let Ok(m) = &live {
                let file = bins.logs.join(format!("demand-live-{tag}-pods.tsv"));
                std::fs::write(file, pods_tsv(&arrivals, &setup.model, m))?;
            }
            rows.push((setup, live));
            let so_far = format!("{md}{}{}", tables(&rows), profile_table(&arrivals, &rows));
            std::fs::write(s.out.join("demand-live.md"), so_far)?;
        }
        md.push_str(&tables(&rows));
        md.push_str(&profile_table(&arrivals, &rows));
    }
    let _ = writeln!(
        md,
        "\nThe whole run took {:.0} s.",
        started.elapsed().as_secs_f64()
    );
    std::fs::write(s.out.join("demand-live.md"), &md)?;
    Ok(md)
}

/// The pool's compute slices.
fn pool_slices(nodes: usize) -> i64 {
    nodes as i64 * pool::gpus_per_node() * SLICES_PER_GPU
}

/// The rate (pods/s) whose pods ask for `s.load` of the pool's slice-seconds on average: the
/// kind's mean slices per pod (over its thirds) times the mean run time.
fn rate_for(s: &LiveSettings, kind: Kind) -> f64 {
    let per_pod: f64 = (0..3)
        .map(|third| {
            kind.mix(third)
                .iter()
                .zip(&PROFILES)
                .map(|(share, p)| share / 100.0 * p.slices as f64)
                .sum::<f64>()
        })
        .sum::<f64>()
        / 3.0;
    let run = (s.run.0 + s.run.1) as f64 / 2.0;
    (s.load * pool_slices(s.nodes) as f64 / (per_pod * run) * 100.0).round() / 100.0
}

/// The configurations asked for, each with its model outcome.
fn setups(s: &LiveSettings, arrivals: &[Arrival]) -> Vec<Setup> {
    let caps = pool::capacities();
    s.configs
        .iter()
        .map(|c| match c {
            LiveConfig::Oracle => {
                let o = statics::oracle(arrivals, &caps, s.nodes, Scheduler::KubeDefault, s.seed);
                static_setup(
                    format!("oracle: {}", o.split.describe()),
                    o.split,
                    o.outcome,
                )
            }
            LiveConfig::Admin => {
                let split = statics::admin(arrivals, &caps, s.nodes, pool_slices(s.nodes));
                let model = statics::replay(arrivals, split, &caps, Scheduler::KubeDefault, s.seed);
                static_setup(format!("admin's split: {}", split.describe()), split, model)
            }
            LiveConfig::Dynamic => dynamic_setup(s, arrivals, Busy::Wait),
            LiveConfig::DynamicReserve => dynamic_setup(s, arrivals, Busy::Reserve),
            LiveConfig::DynamicPrefer => dynamic_setup(s, arrivals, Busy::Prefer),
            LiveConfig::DynamicPreferReserve => dynamic_setup(s, arrivals, Busy::PreferReserve),
        })
        .collect()
}

/// A static assignment: each node labelled with its layout, one policy per layout used.
fn static_setup(name: String, split: Split, model: Outcome) -> Setup {
    let nodes: Vec<LiveNode> = split
        .layouts()
        .map(|l| LiveNode {
            label: (LAYOUT_LABEL.into(), LAYOUTS[l].into()),
            layout: LAYOUTS[l],
        })
        .collect();
    let mut used: Vec<&str> = nodes.iter().map(|n| n.layout).collect();
    used.dedup();
    Setup {
        name,
        policies: used.into_iter().map(pool::static_policy).collect(),
        nodes,
        model,
        others: Vec::new(),
        settle: STATIC_SETTLE,
    }
}

/// The dynamic policy from all-balanced at the live timers, replayed in the model too.
fn dynamic_setup(s: &LiveSettings, arrivals: &[Arrival], busy: Busy) -> Setup {
    let timers = match busy {
        Busy::Wait | Busy::Prefer => LIVE_TIMERS,
        Busy::Reserve | Busy::PreferReserve => RESERVE_TIMERS,
    };
    let name = busy.name();
    let p = pool::timed_policy(DYNAMIC_START, busy, timers);
    let replay = |sc| dynamic::replay(arrivals, s.nodes, sc, &p, s.mig_delay, s.seed);
    let model = replay(Scheduler::KubeDefault);
    let others = [Scheduler::Pack, Scheduler::FirstFit]
        .map(|sc| (sc, replay(sc)))
        .into();
    let nodes = (0..s.nodes)
        .map(|_| LiveNode {
            label: (POOL_LABEL.0.into(), POOL_LABEL.1.into()),
            layout: DYNAMIC_START,
        })
        .collect();
    Setup {
        name: name.into(),
        nodes,
        settle: dynamic::settled_after(&p) + s.mig_delay,
        policies: vec![p],
        model,
        others,
    }
}

/// A file-name-safe form of a configuration's name.
fn slug(name: &str) -> String {
    let head = name.split(':').next().unwrap_or(name);
    head.chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
        .collect::<String>()
        .replace("--", "-")
}

/// Mean and p95 (nearest rank) of `v`; zeros when empty.
fn stats(v: &[f64]) -> (f64, f64) {
    if v.is_empty() {
        return (0.0, 0.0);
    }
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let rank = (s.len() as f64 * 0.95).ceil() as usize;
    (
        s.iter().sum::<f64>() / s.len() as f64,
        s[rank.saturating_sub(1)],
    )
}

fn model_waits(o: &Outcome) -> Vec<f64> {
    o.waits.iter().map(|w| *w as f64).collect()
}

/// One line for the progress log.
fn summary(model: &Outcome, m: &Measured) -> String {
    let (mm, mp) = stats(&model_waits(model));
    let (lm, lp) = stats(&m.waits);
    format!(
        "model mean {mm:.1} s p95 {mp:.0} s never {} reshapes {}; live mean {lm:.1} s p95 {lp:.1} s never {} reshapes {}",
        model.never_served, model.reshapes, m.never_served, m.reshapes
    )
}

/// Each pod of the trace: its arrival, profile and run, its wait in the model and live (empty:
/// never served), and the node it was bound to live; tab-separated, for a closer look.
fn pods_tsv(arrivals: &[Arrival], model: &Outcome, m: &Measured) -> String {
    let mut waits = vec![None; arrivals.len()];
    for (k, w) in model.served.iter().zip(&model.waits) {
        waits[*k] = Some(*w);
    }
    let mut out =
        String::from("pod\tarrival_s\tprofile\trun_s\tmodel_wait_s\tlive_wait_s\tlive_node\n");
    for (a, model) in arrivals.iter().zip(waits) {
        let name = a.id.rsplit('/').next().unwrap_or(&a.id);
        let (live, node) = m.by_pod.get(name).map_or((String::new(), ""), |(w, n)| {
            (format!("{w:.2}"), n.as_str())
        });
        let model = model.map_or(String::new(), |w| w.to_string());
        let _ = writeln!(
            out,
            "{name}\t{}\t{}\t{}\t{model}\t{live}\t{node}",
            a.at, PROFILES[a.profile].name, a.run
        );
    }
    out
}

/// The mean wait per profile of [`PROFILES`] (None: no pod of it served), of `(pod, wait)`
/// pairs, a pod by its index in `arrivals`.
fn per_profile(
    arrivals: &[Arrival],
    waits: impl Iterator<Item = (usize, f64)>,
) -> [Option<f64>; PROFILES.len()] {
    let mut sum = [(0.0, 0usize); PROFILES.len()];
    for (k, w) in waits {
        let s = &mut sum[arrivals[k].profile];
        s.0 += w;
        s.1 += 1;
    }
    sum.map(|(t, n)| (n > 0).then(|| t / n as f64))
}

/// The mean wait per profile, model / live, of one kind's configurations.
fn profile_table(arrivals: &[Arrival], rows: &[(Setup, anyhow::Result<Measured>)]) -> String {
    let names: Vec<&str> = PROFILES.iter().map(|p| p.name).collect();
    let mut md = format!(
        "\n| mean wait per profile s, model / live | {} |\n|---|{}\n",
        names.join(" | "),
        "---:|".repeat(names.len())
    );
    let index: std::collections::HashMap<&str, usize> = arrivals
        .iter()
        .enumerate()
        .map(|(k, a)| (a.id.rsplit('/').next().unwrap_or(&a.id), k))
        .collect();
    let fmt = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v:.1}"));
    for (setup, live) in rows {
        let Ok(m) = live else { continue };
        let o = &setup.model;
        let model = per_profile(
            arrivals,
            o.served.iter().zip(&o.waits).map(|(k, w)| (*k, *w as f64)),
        );
        let live = per_profile(
            arrivals,
            m.by_pod
                .iter()
                .filter_map(|(n, (w, _))| Some((*index.get(n.as_str())?, *w))),
        );
        let cells: Vec<String> = model
            .iter()
            .zip(&live)
            .map(|(a, b)| format!("{} / {}", fmt(*a), fmt(*b)))
            .collect();
        let _ = writeln!(md, "| {} | {} |", setup.name, cells.join(" | "));
    }
    md
}

/// The comparison table and the live details of one kind's configurations.
fn tables(rows: &[(Setup, anyhow::Result<Measured>)]) -> String {
    let mut md = String::from(
        "| configuration | mean wait s: model / live (diff) | p95 wait s: model / live (diff) | never served: model / live | reshapes: model / live |\n|---|---:|---:|---:|---:|\n",
    );
    let mut details = String::from(
        "\n| configuration (live) | mean / p95 wait to Running s | mean / p95 by PodScheduled condition s | bound while the node reshaped | latest creation late s | setup s | trace s | notes |\n|---|---:|---:|---:|---:|---:|---:|---|\n",
    );
    for (setup, live) in rows {
        let (mm, mp) = stats(&model_waits(&setup.model));
        let o = &setup.model;
        match live {
            Ok(m) => {
                let (lm, lp) = stats(&m.waits);
                let _ = writeln!(
                    md,
                    "| {} | {mm:.1} / {lm:.1} ({:+.1}) | {mp:.0} / {lp:.1} ({:+.1}) | {} / {} | {} / {} |",
                    setup.name,
                    lm - mm,
                    lp - mp,
                    o.never_served,
                    m.never_served,
                    o.reshapes,
                    m.reshapes
                );
                let (rm, rp) = stats(&m.run_waits);
                let (cm, cp) = stats(&m.condition_waits);
                let _ = writeln!(
                    details,
                    "| {} | {rm:.1} / {rp:.1} | {cm:.1} / {cp:.0} | {} | {:.2} | {:.0} | {:.0} | {} |",
                    setup.name,
                    m.bound_while_reshaping,
                    m.late,
                    m.setup_s,
                    m.took_s,
                    m.notes.join("; ")
                );
            }
            Err(e) => {
                let _ = writeln!(
                    md,
                    "| {} | {mm:.1} / failed | {mp:.0} / failed | {} / - | {} / - |",
                    setup.name, o.never_served, o.reshapes
                );
                let _ = writeln!(details, "| {} | | | | | | | failed: {e:#} |", setup.name);
            }
        }
    }
    md + &details + &other_models(rows)
}

/// The dynamic configurations under the other scheduler models, beside the live run.
fn other_models(rows: &[(Setup, anyhow::Result<Measured>)]) -> String {
    let mut md = String::from(
        "\n| dynamic, model under another scheduler model | mean wait s | p95 wait s | never served | reshapes |\n|---|---:|---:|---:|---:|\n",
    );
    for (setup, _) in rows {
        for (sc, o) in &setup.others {
            let (mean, p95) = stats(&model_waits(o));
            let _ = writeln!(
                md,
                "| {} ({}) | {mean:.1} | {p95:.0} | {} | {} |",
                setup.name,
                sc.name(),
                o.never_served,
                o.reshapes
            );
        }
    }
    md
}

/// The rules of both replays and how to rerun.
fn header(s: &LiveSettings) -> String {
    let d = LIVE_TIMERS;
    format!(
        "# Demand-driven MIG, live against the model\n\n\
         Seed {seed}. Rerun: `{command}`\n\n\
         - **Pool**: {nodes} A100 80GB nodes ({gpus} GPUs, {slices} compute slices).\n\
         - **Pods**: the demand benchmark's trace generator, arrivals over {secs} s, each pod running {r0}-{r1} s, the rate chosen for an offered load of {load:.0}%.\n\
         - **Live**: a fresh `kube-local --scheduler` control plane per configuration (kube-scheduler's default profile), the node simulator (`--mig-delay {delay}s`: MIG manager, device plugin, GFD, kubelet; a bound pod runs for its `simulator.gpusharing.io/run-seconds`), the operator binary. Pods are created at their arrival second once the starting layouts are in place; wait = the creation request to `spec.nodeName` first seen on a watch. Ends when every pod is bound, or when every pod was created, none runs and nothing changed for longer than the policy's timers plus the MIG delay ({static_settle} s for static assignments): the pods pending then are never served. Reshapes: changes of a node's `nvidia.com/mig.config` after the first arrival.\n\
         - **Model**: the same arrivals, the kube-default scheduler model (kube-scheduler's integer scores, ties at random), the same policy objects and MIG delay ({delay} s), waits in whole seconds (binding happens on the model's ticks).\n\
         - **Static**: the oracle's per-node assignment (the best of every assignment on this trace in the model) and the admin's split, one policy per layout selecting its nodes by `{layout_label}`.\n\
         - **Dynamic**: from {start}, the rest of the catalogue; quietSeconds {q}, maxDelaySeconds {md}, idleSeconds {i}, minLayoutLifetimeSeconds {l} ({rl} with reserveBusyNodes, the least the CRD allows), maxUnavailable 25%.\n",
        seed = s.seed,
        command = s.command,
        nodes = s.nodes,
        gpus = s.nodes as i64 * pool::gpus_per_node(),
        slices = pool_slices(s.nodes),
        secs = s.seconds,
        r0 = s.run.0,
        r1 = s.run.1,
        load = s.load * 100.0,
        delay = s.mig_delay,
        static_settle = STATIC_SETTLE,
        layout_label = LAYOUT_LABEL,
        start = DYNAMIC_START,
        q = d.quiet,
        md = d.max_delay,
        i = d.idle,
        l = d.min_lifetime,
        rl = RESERVE_TIMERS.min_lifetime,
    )
}
