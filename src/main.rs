use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use kube::CustomResourceExt;

use gpu_sharing_operator::api::crd::GpuSharingPolicy;
use gpu_sharing_operator::nvidia;
use gpu_sharing_operator::offline::render;
use gpu_sharing_operator::runtime::controller;

/// Declare how NVIDIA GPUs are shared; make the cluster match.
#[derive(Parser)]
#[command(name = "gpu-sharing-operator", version)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Print the GpuSharingPolicy CustomResourceDefinition (YAML).
    Crd {
        /// Print the field reference as a Markdown table instead (docs/crd-reference.md).
        #[arg(long)]
        markdown: bool,
    },
    /// Run the controller (in-cluster config, or $KUBECONFIG / ~/.kube/config).
    Run(RunArgs),
    /// Show what applying these policies would change in the cluster (kubeconfig or
    /// in-cluster; read-only). Exit code 0: no change, 2: changes, 1: invalid input or error.
    Plan(PlanArgs),
    /// Uninstall step (the Helm chart's pre-delete hook runs it): delete every GpuSharingPolicy
    /// and wait until the running operator has released their nodes and removed its finalizer.
    /// Exit code 0: done, 1: timed out (says what is left) or an error.
    Cleanup {
        /// Give up after this many seconds.
        #[arg(long, default_value_t = 300)]
        timeout_seconds: u64,
        /// Log format.
        #[arg(long, value_enum, default_value = "pretty")]
        log_format: LogFormat,
    },
    /// Print, without a cluster, every object the operator would write for these policies.
    Render {
        /// A policy file or a directory of them (*.yaml, *.yml).
        #[arg(short = 'f', long = "filename")]
        file: PathBuf,
        /// Nodes (Node objects or a NodeList, as `kubectl get nodes -o yaml` prints) to plan for.
        #[arg(long)]
        nodes: Option<PathBuf>,
        /// The GPU Operator's namespace: the device plugin ignores ConfigMaps elsewhere.
        #[arg(long, default_value = "gpu-operator")]
        namespace: String,
        /// The GPU Operator's mig-parted ConfigMap (or its config.yaml), whose named layouts
        /// are kept next to custom ones and checked against.
        /// Without it, NVIDIA's default config embedded from the GPU Operator is used.
        #[arg(long)]
        mig_parted_config: Option<PathBuf>,
        /// With --nodes: print the first planning pass only, not the converged result (what
        /// the operator writes first; for debugging).
        #[arg(long)]
        single_pass: bool,
        /// Karpenter's NodePools and NodeOverlays (and the operator's instance-type table, the
        /// ConfigMap gpu-sharing-instance-types): render the policies' NodeOverlays too.
        #[arg(long)]
        karpenter: Option<PathBuf>,
    },
    /// Show the MIG geometry layouts are checked against: with no argument, the GPU models
    /// known; with --product, that model's profiles and placements; with profiles too, where
    /// one GPU's instances go. Exit code 0: placed, 1: they do not fit, 2: unknown model.
    MigGeometry {
        /// The GPU as GPU Feature Discovery labels it (`nvidia.com/gpu.product`), e.g.
        /// NVIDIA-A100-SXM4-80GB.
        #[arg(long)]
        product: Option<String>,
        /// `nvidia.com/gpu.memory` (MiB), where the product name leaves several models.
        #[arg(long)]
        memory: Option<u64>,
        /// One GPU's instances, one profile per instance (e.g. 3g.40gb 2g.20gb 1g.10gb).
        profiles: Vec<String>,
        /// Read `PRODUCT<TAB>MEMORY_MIB<TAB>PROFILE,PROFILE,...` lines from stdin and print
        /// one verdict line for each (feasible, infeasible, unknown-model).
        #[arg(long, conflicts_with_all = ["product", "profiles"])]
        batch: bool,
    },
}

#[derive(clap::Args)]
struct PlanArgs {
    /// The desired policies: a file or a directory of them (*.yaml, *.yml).
    #[arg(short = 'f', long = "filename")]
    file: PathBuf,
    /// The files are the complete set: cluster policies they do not name are shown as removed
    /// (like `kubectl diff --prune`). Without it, those policies stay as they are.
    #[arg(long)]
    prune: bool,
    /// The GPU Operator's namespace; detected from the ClusterPolicy's status.namespace when
    /// omitted.
    #[arg(long, env = "GPU_OPERATOR_NAMESPACE")]
    namespace: Option<String>,
    /// Output format.
    #[arg(short = 'o', long, value_enum, default_value = "table")]
    output: PlanOutput,
    /// The controller's own flags, as it runs with them.
    #[command(flatten)]
    flags: RunFlags,
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum PlanOutput {
    Table,
    Yaml,
    Json,
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum LogFormat {
    Pretty,
    Json,
}

fn init_tracing(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info,kube=warn"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Pretty => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
}

/// The flags of `run` that change what the controller plans; `plan` takes them too, so that it
/// previews the controller as it runs.
#[derive(clap::Args)]
struct RunFlags {
    /// Start no node change for any policy (as `spec.paused` does for one); status stays
    /// current and nodes already changing finish their transition.
    #[arg(long, env = "GPU_SHARING_PAUSE_ROLLOUTS")]
    pause_rollouts: bool,
    /// Remove this NoSchedule taint from GPU nodes once their sharing config is confirmed (or,
    /// for nodes no policy selects, once GPU Feature Discovery labelled them). Register GPU
    /// nodes with it; the GPU Operator's DaemonSets must tolerate it. Without a value:
    /// gpusharing.io/unconfigured.
    #[arg(long, num_args = 0..=1, default_missing_value = gpu_sharing_operator::api::names::DEFAULT_READINESS_TAINT)]
    readiness_taint: Option<String>,
}

#[derive(clap::Args)]
struct RunArgs {
    /// The GPU Operator's namespace, where the device plugin reads ConfigMaps; detected from
    /// the ClusterPolicy's status.namespace when omitted.
    #[arg(long, env = "GPU_OPERATOR_NAMESPACE")]
    namespace: Option<String>,
    /// Log format.
    #[arg(long, value_enum, default_value = "pretty")]
    log_format: LogFormat,
    /// Seconds between full resyncs (watches catch changes in between).
    #[arg(long, default_value_t = 300)]
    resync_seconds: u64,
    /// Address of /metrics ("" to disable): HTTPS, answered only for a bearer token that passes
    /// a TokenReview and whose user may `get` the non-resource URL /metrics (SubjectAccessReview).
    #[arg(long, default_value = "0.0.0.0:8443")]
    metrics_addr: String,
    /// Serve /metrics over plain HTTP to anyone, without authentication (local use).
    #[arg(long)]
    metrics_insecure: bool,
    /// Directory with tls.crt and tls.key for /metrics (e.g. a mounted cert-manager Secret),
    /// read again when they change; without it a self-signed certificate is made at start.
    #[arg(long, conflicts_with = "metrics_insecure")]
    metrics_cert_dir: Option<PathBuf>,
    /// Address of /healthz and /readyz, plain HTTP without authentication, for probes ("" to
    /// disable).
    #[arg(long, default_value = "0.0.0.0:8081")]
    health_addr: String,
    /// Run several replicas: only the holder of a coordination.k8s.io Lease writes.
    #[arg(long)]
    leader_elect: bool,
    /// Namespace of the leader Lease (defaults to the pod's namespace, else "default").
    #[arg(long, env = "POD_NAMESPACE", default_value = "default")]
    lease_namespace: String,
    /// Seconds a leader's lease lasts without renewal before a standby takes over.
    #[arg(long, default_value_t = 15)]
    lease_duration_seconds: u64,
    /// Seconds between lease renewals.
    #[arg(long, default_value_t = 5)]
    lease_renew_seconds: u64,
    /// Seconds a node may report nvidia.com/mig.config.state=pending before it is reported
    /// Degraded and left alone.
    #[arg(long, default_value_t = 600)]
    mig_timeout_seconds: u64,
    #[command(flatten)]
    flags: RunFlags,
    /// Seconds between checks that the admission policies fence this operator (dry-run writes
    /// they must refuse: a foreign node label, a ClusterPolicy driver image, a policy label;
    /// metric gpu_sharing_fenced). Checked at start too; 0: at start only.
    #[arg(long, default_value_t = 600)]
    fence_check_seconds: u64,
    /// Fail /readyz while the last fence check did not find every forbidden write refused (or
    /// before the first check).
    #[arg(long)]
    require_fenced: bool,
}

/// Aborts a background task when `run` returns.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

async fn run(args: RunArgs) -> anyhow::Result<()> {
    let kube_config = kube::Config::infer().await?;
    let client = gpu_sharing_operator::runtime::depth::client(kube_config.clone())?;
    // Evictions without kube's retry of 429: that answer is a PodDisruptionBudget's refusal.
    let mut no_retry = kube_config.clone();
    no_retry.default_retry = false;
    let eviction_client = kube::Client::try_from(no_retry)?;
    // The token and access reviews of /metrics: a client (and connection pool) of their own, so
    // that a flood of scrapes with made-up tokens never queues behind the controller's requests
    // or they behind it; each review answers within seconds or fails the scrape.
    let mut review_config = kube_config.clone();
    review_config.read_timeout = Some(std::time::Duration::from_secs(10));
    let review_client = kube::Client::try_from(review_config)?;
    let metrics = std::sync::Arc::new(gpu_sharing_operator::telemetry::metrics::Metrics::default());
    let endpoints = gpu_sharing_operator::telemetry::server::Config {
        metrics_addr: Some(args.metrics_addr).filter(|a| !a.is_empty()),
        metrics_insecure: args.metrics_insecure,
        metrics_cert_dir: args.metrics_cert_dir,
        health_addr: Some(args.health_addr).filter(|a| !a.is_empty()),
    };
    // Every replica checks its fence (dry-run writes), leader or not.
    metrics.require_fenced(args.require_fenced);
    let fence_state = std::sync::Arc::new(gpu_sharing_operator::runtime::fence::State::default());
    let fence = tokio::spawn(gpu_sharing_operator::runtime::fence::watch(
        client.clone(),
        metrics.clone(),
        fence_state.clone(),
        std::time::Duration::from_secs(args.fence_check_seconds),
    ));
    let _fence = AbortOnDrop(fence);
    // Served until `run` returns.
    let _endpoints =
        gpu_sharing_operator::telemetry::server::start(&endpoints, metrics.clone(), review_client)
            .await?;
    let signal = async {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .expect("signal handler");
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {},
            _ = term.recv() => {},
        }
    };
    let config = controller::Config {
        namespace: args.namespace,
        resync: std::time::Duration::from_secs(args.resync_seconds),
        metrics: metrics.clone(),
        mig_timeout: std::time::Duration::from_secs(args.mig_timeout_seconds),
        pause_rollouts: args.flags.pause_rollouts,
        readiness_taint: args.flags.readiness_taint,
        eviction_client: Some(controller::EvictionClient(eviction_client)),
        fence: fence_state,
        ..Default::default()
    };
    if !args.leader_elect {
        metrics.set_leader(true);
        controller::run(client, config, signal).await?;
        return Ok(());
    }
    let identity = std::env::var("POD_NAME")
        .or_else(|_| std::env::var("HOSTNAME"))
        .unwrap_or_else(|_| "gpu-sharing-operator".into());
    let lead_cfg = gpu_sharing_operator::runtime::leader::LeaderConfig {
        namespace: args.lease_namespace,
        name: "gpu-sharing-operator".into(),
        identity: format!("{identity}-{}", std::process::id()),
        lease_duration: std::time::Duration::from_secs(args.lease_duration_seconds),
        renew: std::time::Duration::from_secs(args.lease_renew_seconds),
    };
    lead_cfg.check().map_err(anyhow::Error::msg)?;
    tokio::pin!(signal);
    let (mut leading, release) = tokio::select! {
        l = gpu_sharing_operator::runtime::leader::lead(client.clone(), lead_cfg) => l,
        _ = &mut signal => return Ok(()),
    };
    metrics.set_leader(true);
    let mut lost = false;
    let stop = async {
        tokio::select! {
            _ = &mut signal => {},
            _ = leading.wait_for(|l| !*l) => { lost = true; },
        }
    };
    controller::run(client, config, stop).await?;
    metrics.set_leader(false);
    metrics.clear_policies();
    if lost {
        anyhow::bail!("lost leadership; exiting so that this replica restarts as a standby");
    }
    let _ = release.send(());
    // Give the release a moment to reach the API server.
    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    Ok(())
}

/// The named mig-parted layouts render checks against: the given file, or NVIDIA's default
/// embedded in the binary (said on stderr).
fn read_mig_base(
    path: Option<&PathBuf>,
) -> Result<std::collections::BTreeMap<String, serde_json::Value>, String> {
    let Some(path) = path else {
        eprintln!(
            "render: no --mig-parted-config given: using NVIDIA's default mig-parted config embedded from {}",
            nvidia::DEFAULT_MIG_PARTED_SOURCE
        );
        return Ok(nvidia::default_mig_configs());
    };
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    nvidia::mig_configs_of_document(&text)
        .map_err(|e| format!("{}: mig-configs: {e}", path.display()))
}

/// `plan`: 0 no change, 2 changes, 1 invalid input or an error.
async fn plan(args: PlanArgs) -> u8 {
    use gpu_sharing_operator::preview::{self, diff};
    let files = match render::load_policies(&args.file) {
        Ok(p) => p,
        Err(errs) => {
            for e in errs {
                eprintln!("error: {e}");
            }
            return 1;
        }
    };
    let client = match kube::Client::try_default().await {
        Ok(c) => c,
        Err(e) => {
            eprintln!("error: no cluster to compare with: {e}");
            return 1;
        }
    };
    let flags = preview::RunFlags {
        readiness_taint: args.flags.readiness_taint,
        pause_rollouts: args.flags.pause_rollouts,
    };
    let snap = match preview::snapshot(&client, args.namespace, &flags).await {
        Ok(s) => s,
        Err(e) => {
            eprintln!("error: {e}");
            return 1;
        }
    };
    let checked = files.iter().map(kube::ResourceExt::name_any).collect();
    let desired = diff::desired(&snap.input.policies, files, args.prune);
    let mut p = match diff::preview(
        &snap.input,
        snap.cluster_policy_spec.as_ref(),
        desired,
        &checked,
    ) {
        Ok(p) => p,
        Err(e) => {
            for line in e.to_string().lines() {
                eprintln!("error: {line}");
            }
            return 1;
        }
    };
    p.assumptions = snap.assumptions;
    match args.output {
        PlanOutput::Table => print!("{}", preview::print::text(&p)),
        PlanOutput::Yaml => print!("{}", serde_saphyr::to_string(&p).expect("serializable")),
        PlanOutput::Json => println!(
            "{}",
            serde_json::to_string_pretty(&p).expect("serializable")
        ),
    }
    if p.changed { 2 } else { 0 }
}

/// glibc's allocator gives each thread that contends for it an arena of its own, and memory
/// freed in one arena serves only that arena. The planner runs on the blocking pool's thread
/// while the runtime thread decodes watch events and writes: two heaps, each keeping its own
/// free pockets at its high-water mark. With one arena the two threads share them (a lock taken
/// by two threads, one of them mostly waiting on I/O). Other C libraries have no such setting.
fn one_malloc_arena() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only sets a tunable of glibc's allocator; called before any other
    // thread exists.
    unsafe {
        libc::mallopt(libc::M_ARENA_MAX, 1);
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Plan(args) => {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("tokio runtime");
            ExitCode::from(rt.block_on(plan(args)))
        }
        Command::Run(args) => {
            one_malloc_arena();
            init_tracing(args.log_format);
            // One runtime thread: the work is I/O-bound, and few allocator arenas keep memory
            // small at thousands of nodes. Planning runs on the blocking pool (one thread at a
            // time), so lease renewal, watches and probes never wait for it.
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("tokio runtime");
            match rt.block_on(run(args)) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("error: {e:#}");
                    ExitCode::from(1)
                }
            }
        }
        Command::Cleanup {
            timeout_seconds,
            log_format,
        } => {
            init_tracing(log_format);
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("tokio runtime");
            let done = rt.block_on(async {
                let client = kube::Client::try_default().await?;
                gpu_sharing_operator::runtime::cleanup::run(
                    client,
                    std::time::Duration::from_secs(timeout_seconds),
                )
                .await
                .map_err(anyhow::Error::from)
            });
            match done {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("error: {e:#}");
                    ExitCode::from(1)
                }
            }
        }
        Command::Crd { markdown: true } => {
            print!("{}", gpu_sharing_operator::offline::docs::crd_reference());
            ExitCode::SUCCESS
        }
        Command::Crd { markdown: false } => {
            print!(
                "{}",
                serde_saphyr::to_string(&GpuSharingPolicy::crd()).expect("CRD serializes")
            );
            ExitCode::SUCCESS
        }
        Command::Render {
            file,
            nodes,
            namespace,
            mig_parted_config,
            single_pass,
            karpenter,
        } => {
            let policies = match render::load_policies(&file) {
                Ok(p) => p,
                Err(errs) => {
                    for e in errs {
                        eprintln!("error: {e}");
                    }
                    return ExitCode::from(1);
                }
            };
            let nodes = match nodes.map(|n| render::load_nodes(&n)).transpose() {
                Ok(n) => n,
                Err(e) => {
                    eprintln!("error: {e}");
                    return ExitCode::from(1);
                }
            };
            let base = match read_mig_base(mig_parted_config.as_ref()) {
                Ok(b) => b,
                Err(e) => {
                    eprintln!("error: {e}");
                    return ExitCode::from(1);
                }
            };
            let karpenter = match karpenter.map(|k| render::load_documents(&k)).transpose() {
                Ok(k) => k,
                Err(e) => {
                    eprintln!("error: {e}");
                    return ExitCode::from(1);
                }
            };
            let options = render::RenderOptions {
                namespace,
                base_mig_configs: base,
                single_pass,
                karpenter,
            };
            match render::render_text(policies, nodes, &options) {
                Ok(r) => {
                    if let Some(p) = r.passes {
                        eprintln!(
                            "render: converged after {p} planning passes ({} rounds of writes)",
                            p - 1
                        );
                    }
                    print!("{}", r.text);
                    ExitCode::SUCCESS
                }
                Err(errs) => {
                    for e in errs {
                        eprintln!("error: {e}");
                    }
                    ExitCode::from(1)
                }
            }
        }
        Command::MigGeometry {
            product,
            memory,
            profiles,
            batch,
        } => mig_geometry(product, memory, &profiles, batch),
    }
}

/// `mig-geometry`: see [`gpu_sharing_operator::offline::geometry`].
fn mig_geometry(
    product: Option<String>,
    memory: Option<u64>,
    profiles: &[String],
    batch: bool,
) -> ExitCode {
    use gpu_sharing_operator::offline::geometry;
    if batch {
        let mut input = String::new();
        if let Err(e) = std::io::Read::read_to_string(&mut std::io::stdin(), &mut input) {
            eprintln!("error: reading stdin: {e}");
            return ExitCode::from(1);
        }
        return match geometry::batch(&input) {
            Ok(out) => {
                print!("{out}");
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("error: {e}");
                ExitCode::from(1)
            }
        };
    }
    let Some(product) = product else {
        if !profiles.is_empty() {
            eprintln!("error: name the GPU with --product to place instances");
            return ExitCode::from(2);
        }
        print!("{}", geometry::models());
        return ExitCode::SUCCESS;
    };
    let model = match geometry::model(&product, memory) {
        Ok(m) => m,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    if profiles.is_empty() {
        print!("{}", geometry::profiles(model));
        return ExitCode::SUCCESS;
    }
    let instances: Vec<&str> = profiles.iter().map(String::as_str).collect();
    match geometry::place(model, &instances) {
        Ok(p) => {
            println!("{p}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            println!("{e}");
            ExitCode::from(1)
        }
    }
}
