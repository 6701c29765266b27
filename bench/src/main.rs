//! Scale and speed benchmark of the operator against a real kube-apiserver (issue 6).
//!
//! For every requested (nodes N, policies P) it starts fresh `kube-local` control planes (no
//! seeded nodes), creates N GPU nodes spread over P groups and P policies (one group each,
//! alternating time-slicing and MPS), and compares:
//!
//! - baseline: the minimal writes (device-plugin ConfigMap, ClusterPolicy, one label apply per
//!   node, one status apply per policy), computed with the same planner and issued directly
//!   with a tight concurrent client loop;
//! - operator: `gpu-sharing-operator run` as a child process; time from creating the policies
//!   until every node carries its label and every policy is Ready with all its nodes applied;
//!   then one policy edit (replicas) until it converges again; then a steady window.
//!
//! Writes are counted from kube-apiserver's `apiserver_request_total` (verbs POST, PUT, PATCH,
//! APPLY, DELETE, DELETECOLLECTION) before and after every phase, restricted to the resources
//! the operator writes; the benchmark's own writes (policy creation, the edit) are subtracted.
//! This is a measurement tool: nothing here asserts on timings.
//!
//! ```sh
//! make bench
//! cargo run --release --bin scale-bench -- --nodes 100,1000,5000 --policies 1,20,100
//! cargo run --release --bin scale-bench -- --configs 100x1,1000x20,5000x100
//! cargo run --release --bin scale-bench -- --flood 3000
//! ```

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context as _, anyhow, bail};
use clap::Parser;
use futures::{StreamExt, TryStreamExt, stream};
use k8s_openapi::api::core::v1::{ConfigMap, Node};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{
    Api, DynamicObject, GetParams, ListParams, PartialObjectMeta, Patch, PatchParams, PostParams,
};
use kube::{Client, CustomResourceExt, ResourceExt};
use serde_json::json;
use std::process::{Child, Command};

use gpu_sharing_operator::api::crd::GpuSharingPolicy;
use gpu_sharing_operator::api::names::{self, LABEL_DEVICE_PLUGIN_CONFIG, LABEL_POLICY, MANAGER};
use gpu_sharing_operator::plan::{self, NodeFacts, PlanInput};
use gpu_sharing_operator::runtime::controller::cluster_policy_resource;
use testkit::{ClusterOptions, TestCluster};

mod baseline;
mod converge;
mod demand;
mod fixtures;
mod flood;
mod metrics;
mod operator;
mod planonly;
mod procstats;
mod report;
mod rollout;

use baseline::*;
use converge::*;
use fixtures::*;
use metrics::*;
use operator::*;
use procstats::*;
use report::*;

const NAMESPACE: &str = "gpu-operator";
const GROUP_LABEL: &str = "bench.gpusharing.io/group";
/// Field manager of the benchmark's own setup writes (never the operator's).
const BENCH_MANAGER: &str = "scale-bench";

#[derive(Parser, Debug)]
#[command(
    name = "scale-bench",
    about = "Scale benchmark: operator vs. minimal direct writes"
)]
struct Args {
    /// Node counts (comma-separated).
    #[arg(long, value_delimiter = ',', default_values_t = vec![100usize, 1000, 5000])]
    nodes: Vec<usize>,
    /// Policy counts (comma-separated).
    #[arg(long, value_delimiter = ',', default_values_t = vec![1usize, 20, 100])]
    policies: Vec<usize>,
    /// Explicit configurations instead of the cross product, e.g. 100x1,1000x20,5000x100.
    #[arg(long, value_delimiter = ',')]
    configs: Vec<String>,
    /// Seconds of the steady-state window (nothing changes; writes must be 0).
    #[arg(long, default_value_t = 60)]
    steady_secs: u64,
    /// Requests in flight for the baseline and the setup.
    #[arg(long, default_value_t = 32)]
    concurrency: usize,
    /// Give up waiting for convergence after this many seconds (reported as a timeout).
    #[arg(long, default_value_t = 900)]
    timeout_secs: u64,
    /// Skip the baseline side.
    #[arg(long)]
    no_baseline: bool,
    /// The operator binary (default: target/release/gpu-sharing-operator next to this one).
    #[arg(long)]
    operator_bin: Option<PathBuf>,
    /// The kube-local binary (default: $KUBE_LOCAL_BIN, else `tests/cluster/cluster.sh path`).
    #[arg(long)]
    kube_local: Option<PathBuf>,
    /// Output directory (results.md, logs).
    #[arg(long, default_value = "target/bench")]
    out: PathBuf,
    /// Run the rollout benchmark on this many nodes instead of the scale matrix (see
    /// rollout.rs): one policy, maxUnavailable as given, a simulated GFD confirming each node's
    /// config after --confirm-delay-ms.
    #[arg(long)]
    rollout: Option<usize>,
    /// maxUnavailable of the rollout benchmark.
    #[arg(long, default_value = "10%")]
    rollout_max_unavailable: String,
    /// How long the rollout benchmark's simulated GFD takes to confirm a node's new config.
    #[arg(long, default_value_t = 1000)]
    confirm_delay_ms: u64,
    /// Run the flood benchmark on this many nodes instead of the scale matrix (see flood.rs):
    /// the time from a node label change to the operator's write, quiet and under floods of
    /// pending pods (kube-scheduler runs); writes flood.md.
    #[arg(long)]
    flood: Option<usize>,
    /// Label changes timed per scenario of the flood benchmark.
    #[arg(long, default_value_t = 15)]
    flood_samples: usize,
    /// Requests a second of the flood benchmark's token flood (made-up bearer tokens on
    /// /metrics; 0: no such scenario).
    #[arg(long, default_value_t = 200)]
    flood_token_rate: u32,
    /// Pending non-GPU pods of the flood benchmark's last scenario.
    #[arg(long, default_value_t = 3000)]
    flood_pending: usize,
    /// Measure the planner alone, in memory, at the configurations (no API server).
    #[arg(long)]
    plan_only: bool,
    /// Replay a seeded demand trace on simulated A100 nodes, in memory: static MIG layouts
    /// (uniform, the best per-node assignment, an admin's split) against `spec.mig.dynamic`
    /// (see demand/mod.rs); writes demand.md.
    #[arg(long)]
    demand_trace: Option<u64>,
    /// Nodes of the demand trace.
    #[arg(long, default_value_t = 8)]
    demand_nodes: usize,
    /// Seconds over which the demand trace's pods arrive.
    #[arg(long, default_value_t = 3600)]
    demand_seconds: i64,
    /// Pods per second of the demand trace (comma-separated: one set of tables each).
    #[arg(long, value_delimiter = ',', default_values_t = vec![0.3, 0.4])]
    demand_rate: Vec<f64>,
    /// Kinds of demand trace (comma-separated): a mix that shifts each third, or one that stays.
    #[arg(long, value_enum, value_delimiter = ',', default_values_t = vec![demand::Kind::Shifting, demand::Kind::Stationary])]
    demand_kind: Vec<demand::Kind>,
    /// Scheduler models of the demand replay (comma-separated).
    #[arg(long, value_enum, value_delimiter = ',', default_values_t = vec![demand::Scheduler::FirstFit, demand::Scheduler::KubeDefault, demand::Scheduler::Pack])]
    demand_scheduler: Vec<demand::Scheduler>,
    /// Seconds the MIG manager takes to reshape a node in the dynamic replays (comma-separated).
    #[arg(long, value_delimiter = ',', default_values_t = vec![10i64, 60, 120])]
    demand_mig_delays: Vec<i64>,
    /// The dynamic policy's quietSeconds, maxDelaySeconds, idleSeconds and
    /// minLayoutLifetimeSeconds in the replays (comma-separated; default: the CRD's defaults).
    #[arg(long, value_delimiter = ',')]
    demand_timers: Option<Vec<i64>>,
    /// Replay a small seeded demand trace live, in real time (minutes per configuration), on
    /// the local control plane with kube-scheduler, the node simulator and the operator binary,
    /// beside the model's replay of it (see demand/live.rs); `--demand-kind` picks the kinds;
    /// writes demand-live.md.
    #[arg(long)]
    demand_live: Option<u64>,
    /// Nodes of the live demand trace.
    #[arg(long, default_value_t = 6)]
    demand_live_nodes: usize,
    /// Seconds over which the live trace's pods arrive.
    #[arg(long, default_value_t = 180)]
    demand_live_seconds: i64,
    /// Run time of a live trace's pod: uniform between these two, in seconds.
    #[arg(long, value_delimiter = ',', num_args = 2, default_values_t = vec![20i64, 90])]
    demand_live_run: Vec<i64>,
    /// Offered load the live trace's rate is chosen for (a fraction of the pool's slices).
    #[arg(long, default_value_t = 0.65)]
    demand_live_load: f64,
    /// Seconds the simulator's MIG manager takes to reshape a node in the live runs.
    #[arg(long, default_value_t = 10)]
    demand_live_mig_delay: i64,
    /// Configurations of the live runs (comma-separated).
    #[arg(long, value_enum, value_delimiter = ',', default_values_t = vec![demand::LiveConfig::Oracle, demand::LiveConfig::Admin, demand::LiveConfig::Dynamic])]
    demand_live_configs: Vec<demand::LiveConfig>,
    /// The node simulator (default: target/nvidia/gpu-node-simulator; `bash tests/nvidia/build.sh`).
    #[arg(long)]
    simulator_bin: Option<PathBuf>,
}

/// A fresh control plane (no seeded nodes) from the test kit, tried twice: kube-local's seeding
/// occasionally races the ClusterPolicy CRD's discovery ("no matches for kind ClusterPolicy")
/// and exits. Its log goes to `log`.
async fn start_cluster(bin: &Path, log: &Path) -> anyhow::Result<TestCluster> {
    start_cluster_with(bin, log, &[]).await
}

/// [`start_cluster`] with extra kube-local flags (e.g. `--scheduler`).
async fn start_cluster_with(bin: &Path, log: &Path, extra: &[&str]) -> anyhow::Result<TestCluster> {
    let mut opts = ClusterOptions::default()
        .namespace(NAMESPACE)
        .without_nodes()
        .bin(bin)
        .log(log);
    for a in extra {
        opts = opts.arg(a);
    }
    match TestCluster::try_start_with(opts.clone()).await {
        Ok(c) => Ok(c),
        Err(e) => {
            eprintln!("scale-bench: {e:#}; retrying once");
            TestCluster::try_start_with(opts).await
        }
    }
}

fn kube_local_bin(args: &Args) -> anyhow::Result<PathBuf> {
    if let Some(p) = &args.kube_local {
        return Ok(p.clone());
    }
    if let Some(p) = std::env::var_os("KUBE_LOCAL_BIN") {
        return Ok(PathBuf::from(p));
    }
    let out = std::process::Command::new("bash")
        .args(["tests/cluster/cluster.sh", "path"])
        .stderr(Stdio::inherit())
        .output()?;
    if !out.status.success() {
        bail!("tests/cluster/cluster.sh path failed");
    }
    let s = String::from_utf8_lossy(&out.stdout);
    Ok(PathBuf::from(s.lines().last().unwrap_or("").trim()))
}

fn operator_bin(args: &Args) -> anyhow::Result<PathBuf> {
    if let Some(p) = &args.operator_bin {
        return Ok(p.clone());
    }
    let me = std::env::current_exe()?;
    let p = me.with_file_name("gpu-sharing-operator");
    if !p.exists() {
        bail!("{} missing: run cargo build --release first", p.display());
    }
    Ok(p)
}

fn parse_configs(args: &Args) -> anyhow::Result<Vec<(usize, usize)>> {
    let mut v: Vec<(usize, usize)> = if args.configs.is_empty() {
        args.nodes
            .iter()
            .flat_map(|&n| args.policies.iter().map(move |&p| (n, p)))
            .collect()
    } else {
        args.configs
            .iter()
            .map(|c| {
                let (n, p) = c
                    .split_once('x')
                    .ok_or_else(|| anyhow!("config {c}: want NxP"))?;
                Ok((n.trim().parse()?, p.trim().parse()?))
            })
            .collect::<anyhow::Result<_>>()?
    };
    // Small ones first, the big ones last.
    v.sort_by_key(|&(n, p)| (n * p.max(1), n, p));
    v.dedup();
    for &(n, p) in &v {
        if p == 0 || n == 0 {
            bail!("N and P must be positive");
        }
    }
    Ok(v)
}

/// The live demand benchmark (`--demand-live SEED`); returns its report.
async fn demand_live(args: &Args, seed: u64, kl: &Path, op: &Path) -> anyhow::Result<String> {
    let simulator = match &args.simulator_bin {
        Some(p) => p.clone(),
        None => testkit::repo_root().join("target/nvidia/gpu-node-simulator"),
    };
    if !simulator.exists() {
        bail!(
            "{} missing: run bash tests/nvidia/build.sh",
            simulator.display()
        );
    }
    let settings = demand::LiveSettings {
        seed,
        nodes: args.demand_live_nodes,
        seconds: args.demand_live_seconds,
        run: (args.demand_live_run[0], args.demand_live_run[1]),
        load: args.demand_live_load,
        mig_delay: args.demand_live_mig_delay,
        kinds: args.demand_kind.clone(),
        configs: args.demand_live_configs.clone(),
        command: std::env::args().collect::<Vec<_>>().join(" "),
        out: args.out.clone(),
    };
    let bins = demand::Bins {
        kube_local: kl,
        operator: op,
        simulator: &simulator,
        logs: args.out.join("logs"),
    };
    demand::run_live(&settings, &bins).await
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    if let Some(seed) = args.demand_trace {
        let md = demand::run(&demand::Settings {
            seed,
            nodes: args.demand_nodes,
            seconds: args.demand_seconds,
            rates: args.demand_rate.clone(),
            run: (60, 540),
            kinds: args.demand_kind.clone(),
            schedulers: args.demand_scheduler.clone(),
            mig_delays: args.demand_mig_delays.clone(),
            timers: match args.demand_timers.as_deref() {
                None => None,
                Some(&[quiet, max_delay, idle, min_lifetime]) => Some(demand::Timers {
                    quiet,
                    max_delay,
                    idle,
                    min_lifetime,
                }),
                Some(_) => anyhow::bail!(
                    "--demand-timers takes four values: quietSeconds,maxDelaySeconds,idleSeconds,minLayoutLifetimeSeconds"
                ),
            },
            command: std::env::args().collect::<Vec<_>>().join(" "),
        });
        std::fs::create_dir_all(&args.out)?;
        std::fs::write(args.out.join("demand.md"), &md)?;
        println!("{md}");
        return Ok(());
    }
    if args.plan_only {
        println!("{}", planonly::run(&parse_configs(&args)?));
        return Ok(());
    }
    let kl = kube_local_bin(&args)?;
    let op = operator_bin(&args)?;
    std::fs::create_dir_all(args.out.join("logs"))?;
    if let Some(seed) = args.demand_live {
        println!("{}", demand_live(&args, seed, &kl, &op).await?);
        return Ok(());
    }
    if let Some(n) = args.rollout {
        let md = rollout::run(&args, &kl, &op, n).await?;
        println!("{md}");
        return Ok(());
    }
    if let Some(n) = args.flood {
        let md = flood::run(&args, &kl, &op, n).await?;
        println!("{md}");
        return Ok(());
    }
    let configs = parse_configs(&args)?;
    let args = Arc::new(args);
    eprintln!("scale-bench: {} ; configurations {:?}", machine(), configs);
    let mut rows: Vec<Row> = Vec::new();
    for (n, p) in configs {
        let t = Instant::now();
        let mut row = Row {
            n,
            p,
            baseline: None,
            op: Err("not run".into()),
            baseline_err: None,
        };
        if !args.no_baseline {
            eprintln!("scale-bench: {n}x{p}: baseline");
            match run_baseline(&args, &kl, n, p).await {
                Ok(b) => {
                    eprintln!(
                        "scale-bench: {n}x{p}: baseline {:.2} s, {} writes",
                        b.time.as_secs_f64(),
                        b.writes
                    );
                    row.baseline = Some(b);
                }
                Err(e) => {
                    eprintln!("scale-bench: {n}x{p}: baseline failed: {e:#}");
                    row.baseline_err = Some(format!("{e:#}"));
                }
            }
        }
        eprintln!("scale-bench: {n}x{p}: operator");
        row.op = run_operator(&args, &kl, &op, n, p)
            .await
            .map_err(|e| format!("{e:#}"));
        match &row.op {
            Ok(o) => eprintln!(
                "scale-bench: {n}x{p}: operator apply {} s, edit {} s",
                secs(o.apply_time),
                secs(o.edit_time)
            ),
            Err(e) => eprintln!("scale-bench: {n}x{p}: operator failed: {e}"),
        }
        eprintln!(
            "scale-bench: {n}x{p}: done in {:.0} s",
            t.elapsed().as_secs_f64()
        );
        rows.push(row);
        write_results(&args, &rows)?;
    }
    let md = write_results(&args, &rows)?;
    println!("{md}");
    Ok(())
}
