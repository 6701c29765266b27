//! Flood benchmark: does a flood of pending pods delay the operator's other work?
//!
//! One control plane with kube-scheduler in-process (`kube-local --scheduler`: it marks the
//! pods no node fits `PodScheduled=False`, reason `Unschedulable`, the only pending pods the
//! operator reads as demand; without it they would stay Pending with no condition at all), N
//! GPU nodes in two groups, two time-slicing policies `bench-000` (`g0`) and `bench-001` (`g1`)
//! and the operator as a child process. (Not the fixtures' MPS for `g1`: the dynamic MIG policy
//! of the third scenario makes the cluster-wide MIG strategy `mixed`, under which the operator
//! takes every MPS node off MPS, whether that policy matches nodes or not.) Once converged and
//! quiet, every scenario times K label changes: a node is moved to the other group (its
//! `bench.gpusharing.io/group` label patched), so its policy changes and the operator rewrites
//! its `nvidia.com/device-plugin.config` to the other policy's key. Latency = from the patch
//! returning to the new value arriving on a watch of that node opened before the patch.
//! Samples start on a fixed schedule ~1 s apart (they overlap if the operator stalls); 64
//! nodes take turns, each moving back and forth.
//!
//! Scenarios, in this order on the same control plane:
//! - quiet: nothing else happens;
//! - bogus flood: while sampling, 120 pods in namespace `flood`, one every 0.3 s, each asking
//!   `nvidia.com/mig-9g.999gb: 1` with a node selector key of its own (`flood.example/k<i>`),
//!   and no dynamic MIG policy: nobody's demand;
//! - valid-profile flood: the same asking `nvidia.com/mig-1g.10gb`, with a dynamic MIG policy
//!   (matching no node) whose catalogue offers it and whose `namespaceSelector` selects `flood`:
//!   demand, as far as the cap of 32 node label keys pending pods may select on lets it (the
//!   rest is reported ignored; an operator whose node cache grows with those keys lists every
//!   node again for each);
//! - pending: `--flood-pending` non-GPU pods selecting no node, created (and marked
//!   unschedulable by kube-scheduler) before sampling;
//! - token flood: while sampling, `--flood-token-rate` requests a second to the operator's
//!   `/metrics`, each on a new TLS connection with a made-up bearer token of its own (so each
//!   may cost a TokenReview), and once a second a scrape with a ServiceAccount token that may
//!   `get /metrics`, as Prometheus makes it. /metrics is served as `run` serves it by default:
//!   HTTPS, a self-signed certificate, TokenReview and SubjectAccessReview.
//!
//! Per scenario: the node LIST requests kube-apiserver served (its `apiserver_request_total`;
//! the benchmark lists no node while measuring, kube-scheduler only at its start, so they are
//! the operator's: pages of 100, one full re-list of N nodes is ceil(N/100) of them), the
//! operator's "listing nodes again" log lines, its passes and CPU seconds, over the window from
//! the first sample to the quiet after the flood. This is a measurement tool: nothing here
//! asserts on timings.

use std::path::{Path, PathBuf};

use std::sync::atomic::{AtomicBool, Ordering};

use k8s_openapi::api::core::v1::{Namespace, Pod, ServiceAccount};
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding};
use kube::api::{DeleteParams, WatchEvent, WatchParams};

use super::*;

const FLOOD_NS: &str = "flood";
const FLOOD_PODS: usize = 120;
const FLOOD_EVERY: Duration = Duration::from_millis(300);
const DYNAMIC_POLICY: &str = "flood-dynamic";
/// Nodes moved between the groups, in turn: a node comes back after PROBES samples, i.e. after
/// more than [`SAMPLE_TIMEOUT`].
const PROBES: usize = 64;
/// The operator's node list page (`NODE_LIST_PAGE` of src/runtime/watches.rs).
const NODE_LIST_PAGE: usize = 100;
const SAMPLE_TIMEOUT: Duration = Duration::from_secs(60);
const SAMPLE_EVERY: Duration = Duration::from_secs(1);

/// What happens while a scenario samples.
#[derive(Clone, Copy, Debug)]
enum Load {
    Quiet,
    /// 120 pods asking for `nvidia.com/mig-<profile>`, with a dynamic policy or not.
    Flood {
        profile: &'static str,
        dynamic: bool,
    },
    /// Pending non-GPU pods created before sampling.
    Pending(usize),
    /// Requests a second to /metrics with made-up tokens, while sampling.
    Tokens(u32),
}

/// One scenario's figures.
struct Scenario {
    name: String,
    samples: Vec<Option<Duration>>,
    node_lists: f64,
    relists_logged: usize,
    passes: Option<u64>,
    cpu_s: f64,
    /// kube-local's (apiserver, etcd, kube-scheduler) CPU seconds.
    kl_cpu_s: f64,
    window: Duration,
    notes: Vec<String>,
}

/// The running benchmark: the cluster, the operator, the probe nodes' groups.
struct Bench<'a> {
    args: &'a Args,
    client: Client,
    kl_pid: u32,
    op_pid: u32,
    op_log: PathBuf,
    metrics_port: u16,
    /// A token allowed to `get /metrics` (the benchmark's scraper).
    scrape_token: String,
    /// Group (0 or 1) of each probe node now.
    groups: Vec<usize>,
    next: usize,
    /// Device-plugin config key of policy 0 and policy 1.
    keys: [String; 2],
}

/// Runs the flood benchmark on `n` nodes; returns (and writes to `<out>/flood.md`) the report.
pub async fn run(args: &Args, kl: &Path, op: &Path, n: usize) -> anyhow::Result<String> {
    anyhow::ensure!(n >= PROBES, "--flood needs at least {PROBES} nodes");
    let kl_log = args.out.join(format!("logs/flood-{n}-kube-local.log"));
    let cluster = start_cluster_with(kl, &kl_log, &["--scheduler"]).await?;
    let client = cluster.client.clone();
    let op_log = args.out.join(format!("logs/flood-{n}-operator.log"));
    let mut child: Option<Child> = None;
    let res = async {
        install_crd(&client).await?;
        create_nodes(&client, n, 2, args.concurrency).await?;
        wait_idle(cluster.pid(), Duration::from_secs(120)).await;
        let metrics_port = std::net::TcpListener::bind("127.0.0.1:0")?
            .local_addr()?
            .port();
        let scrape_token = create_scraper(&client).await?;
        // /metrics as `run` serves it by default: HTTPS, TokenReview, SubjectAccessReview.
        let c = start_operator_with(op, &cluster.kubeconfig, &op_log, metrics_port, &[]).await?;
        let op_pid = c.id();
        child = Some(c);
        wait_quiet(&client, Duration::from_secs(3), Duration::from_secs(60)).await?;
        let start = Instant::now();
        create_time_slicing_policies(&client).await?;
        let timeout = Duration::from_secs(args.timeout_secs);
        let per_group = nodes_per_group(n, 2);
        let t = wait_converged(&client, &per_group, &BTreeMap::new(), start, timeout).await?;
        let t = t.ok_or_else(|| anyhow!("not converged within {} s", args.timeout_secs))?;
        eprintln!(
            "scale-bench: flood {n}: converged in {:.1} s",
            t.as_secs_f64()
        );
        let ns: Namespace =
            serde_json::from_value(json!({"metadata": {"name": FLOOD_NS}})).expect("namespace");
        Api::<Namespace>::all(client.clone())
            .create(&PostParams::default(), &ns)
            .await?;
        let mut b = Bench {
            args,
            client: client.clone(),
            kl_pid: cluster.pid(),
            op_pid,
            op_log: op_log.clone(),
            metrics_port,
            scrape_token,
            groups: (0..PROBES).map(|i| group_of(i, 2)).collect(),
            next: 0,
            keys: policy_keys(&client).await?,
        };
        let mut rows = Vec::new();
        for (name, load) in scenarios(args) {
            eprintln!("scale-bench: flood {n}: {name}");
            let row = b.scenario(&name, load).await;
            eprintln!("scale-bench: flood {n}: {}", render_row(&row).trim_end());
            rows.push(row);
        }
        Ok::<_, anyhow::Error>(rows)
    }
    .await;
    if let Some(mut c) = child {
        let _ = c.kill();
        let _ = c.wait();
    }
    drop(cluster); // kube-local stops, its directory is removed
    let md = render(args, n, &res?);
    std::fs::create_dir_all(&args.out)?;
    std::fs::write(args.out.join("flood.md"), &md)?;
    Ok(md)
}

fn scenarios(args: &Args) -> Vec<(String, Load)> {
    let mut v = vec![
        ("quiet".to_string(), Load::Quiet),
        (
            format!(
                "bogus flood: {FLOOD_PODS} pods `mig-9g.999gb`, a new selector key each, no dynamic policy"
            ),
            Load::Flood {
                profile: "9g.999gb",
                dynamic: false,
            },
        ),
        (
            format!(
                "valid-profile flood: {FLOOD_PODS} pods `mig-1g.10gb`, a new selector key each, a dynamic policy selecting their namespace"
            ),
            Load::Flood {
                profile: "1g.10gb",
                dynamic: true,
            },
        ),
    ];
    if args.flood_token_rate > 0 {
        v.push((
            format!(
                "token flood: {} requests/s to /metrics, a made-up bearer token each",
                args.flood_token_rate
            ),
            Load::Tokens(args.flood_token_rate),
        ));
    }
    if args.flood_pending > 0 {
        v.push((
            format!("{} pending non-GPU pods", args.flood_pending),
            Load::Pending(args.flood_pending),
        ));
    }
    v
}

/// `bench-000` on `g0` and `bench-001` on `g1`, both time-slicing (replicas 4: what the nodes
/// advertise), so with different config keys.
async fn create_time_slicing_policies(client: &Client) -> anyhow::Result<()> {
    let pol: Api<GpuSharingPolicy> = Api::all(client.clone());
    for g in 0..2 {
        let mut v = serde_json::to_value(policy_object(0, 4))?;
        v["metadata"]["name"] = json!(policy_name(g));
        v["spec"]["nodeSelector"]["matchLabels"][GROUP_LABEL] = json!(format!("g{g}"));
        pol.create(&PostParams::default(), &serde_json::from_value(v)?)
            .await?;
    }
    Ok(())
}

/// The device-plugin config keys of the two policies.
async fn policy_keys(client: &Client) -> anyhow::Result<[String; 2]> {
    let pol: Api<GpuSharingPolicy> = Api::all(client.clone());
    let mut keys = [String::new(), String::new()];
    for (g, key) in keys.iter_mut().enumerate() {
        *key = pol
            .get(&policy_name(g))
            .await?
            .status
            .and_then(|s| s.device_config_key)
            .ok_or_else(|| anyhow!("{} has no config key", policy_name(g)))?;
    }
    anyhow::ensure!(
        keys[0] != keys[1],
        "both policies have config key {}",
        keys[0]
    );
    Ok(keys)
}

impl Bench<'_> {
    /// The operator's passes so far, scraped as its scraper.
    async fn passes(&self) -> Option<u64> {
        operator_passes_tls(self.metrics_port, &self.scrape_token).await
    }

    /// Measures one scenario, then removes what it created (errors become notes).
    async fn scenario(&mut self, name: &str, load: Load) -> Scenario {
        let mut s = Scenario {
            name: name.to_string(),
            samples: Vec::new(),
            node_lists: 0.0,
            relists_logged: 0,
            passes: None,
            cpu_s: 0.0,
            kl_cpu_s: 0.0,
            window: Duration::ZERO,
            notes: Vec::new(),
        };
        if let Err(e) = self.measure(&mut s, load).await {
            s.notes.push(format!("error: {e:#}"));
        }
        if let Err(e) = self.clean_up(load).await {
            s.notes.push(format!("clean-up: {e:#}"));
        }
        s
    }

    /// Until the writes stop and kube-local (apiserver, etcd, scheduler) is idle.
    async fn settle(&self) -> anyhow::Result<()> {
        wait_quiet(
            &self.client,
            Duration::from_secs(3),
            Duration::from_secs(120),
        )
        .await?;
        wait_idle(self.kl_pid, Duration::from_secs(60)).await;
        Ok(())
    }

    async fn measure(&mut self, s: &mut Scenario, load: Load) -> anyhow::Result<()> {
        self.settle().await?;
        match load {
            Load::Pending(count) => self.prepare_pending(s, count).await?,
            Load::Flood { dynamic: true, .. } => self.create_dynamic_policy(s).await?,
            _ => {}
        }
        let lists0 = node_lists(&self.client).await?;
        let cpu0 = proc_stats(self.op_pid).cpu_s;
        let kl_cpu0 = proc_stats(self.kl_pid).cpu_s;
        let logged0 = relists_logged(&self.op_log);
        let passes0 = self.passes().await;
        let reviews0 = apiserver_requests(&self.client, "POST", "tokenreviews").await?;
        let t0 = Instant::now();
        let flood = match load {
            Load::Flood { profile, .. } => Some(tokio::spawn(flood(self.client.clone(), profile))),
            _ => None,
        };
        let stop = Arc::new(AtomicBool::new(false));
        let tokens = match load {
            Load::Tokens(rate) => Some(tokio::spawn(token_flood(
                self.metrics_port,
                rate,
                self.scrape_token.clone(),
                stop.clone(),
            ))),
            _ => None,
        };
        let sampled = self.samples(s).await;
        stop.store(true, Ordering::Relaxed);
        if let Some(t) = tokens {
            s.notes.push(t.await?.note());
        }
        let flooded = match flood {
            Some(f) if sampled.is_ok() => Some(f.await?),
            Some(f) => {
                f.abort();
                None
            }
            None => None,
        };
        sampled?;
        // The flood's after-effects (re-lists, passes) count.
        self.settle().await?;
        if let Some(r) = flooded {
            let took = r?;
            let (_, unschedulable) = unschedulable(&self.client).await?;
            s.notes.push(format!(
                "{FLOOD_PODS} pods created in {:.1} s, {unschedulable} marked Unschedulable by kube-scheduler",
                took.as_secs_f64()
            ));
        }
        s.window = t0.elapsed();
        s.node_lists = node_lists(&self.client).await? - lists0;
        s.cpu_s = proc_stats(self.op_pid).cpu_s - cpu0;
        s.kl_cpu_s = proc_stats(self.kl_pid).cpu_s - kl_cpu0;
        s.relists_logged = relists_logged(&self.op_log).saturating_sub(logged0);
        let reviews = apiserver_requests(&self.client, "POST", "tokenreviews").await? - reviews0;
        if matches!(load, Load::Tokens(_)) {
            s.notes.push(format!(
                "TokenReviews the API server answered: {reviews:.0}"
            ));
        }
        s.passes = match (passes0, self.passes().await) {
            (Some(a), Some(b)) => Some(b.saturating_sub(a)),
            _ => None,
        };
        if matches!(load, Load::Flood { dynamic: true, .. }) {
            s.notes.push(demand_note(&self.client).await?);
        }
        Ok(())
    }

    /// K samples on a fixed schedule, ~1 s apart whatever each one takes (they overlap when the
    /// operator stalls, so a stall shows in every sample it covers). The latency under a flood
    /// depends on when the change comes between two flood pods, so sample k comes at the phase
    /// frac(k x golden ratio) of the flood's period (from its start, just before the first
    /// sample): spread evenly over the period, where a plain 1 s period would sweep it slowly.
    async fn samples(&mut self, s: &mut Scenario) -> anyhow::Result<()> {
        let t0 = tokio::time::Instant::now();
        let period = FLOOD_EVERY.as_secs_f64();
        let mut tasks = Vec::new();
        for k in 0..self.args.flood_samples {
            let periods = (k as f64 * SAMPLE_EVERY.as_secs_f64() / period).ceil();
            let phase = (k as f64 * 0.618_034).fract();
            let at = Duration::from_secs_f64((periods + phase) * period);
            tokio::time::sleep_until(t0 + at).await;
            let i = self.next % PROBES;
            self.next += 1;
            let to = 1 - self.groups[i];
            self.groups[i] = to;
            let (client, want) = (self.client.clone(), self.keys[to].clone());
            tasks.push(tokio::spawn(sample(client, node_name(i), to, want)));
        }
        for t in tasks {
            s.samples.push(t.await??);
        }
        Ok(())
    }

    /// Creates the pending non-GPU pods and waits until kube-scheduler marked them all (its
    /// client's rate limit paces that); what it cost goes into a note.
    async fn prepare_pending(&self, s: &mut Scenario, count: usize) -> anyhow::Result<()> {
        let lists0 = node_lists(&self.client).await?;
        let cpu0 = proc_stats(self.op_pid).cpu_s;
        let t = Instant::now();
        let api: Api<Pod> = Api::namespaced(self.client.clone(), FLOOD_NS);
        stream::iter(0..count)
            .map(|i| {
                let api = api.clone();
                async move { api.create(&PostParams::default(), &pending_pod(i)).await }
            })
            .buffer_unordered(self.args.concurrency)
            .try_collect::<Vec<_>>()
            .await?;
        let created = t.elapsed();
        let mut marked = 0;
        while t.elapsed() < Duration::from_secs(self.args.timeout_secs) {
            marked = unschedulable(&self.client).await?.1;
            if marked >= count {
                break;
            }
            tokio::time::sleep(Duration::from_secs(2)).await;
        }
        let marked_in = t.elapsed();
        self.settle().await?;
        s.notes.push(format!(
            "before sampling: {count} pods created in {:.1} s, {marked} marked Unschedulable after {:.1} s; meanwhile operator CPU {:.1} s, node LISTs {:.0}",
            created.as_secs_f64(),
            marked_in.as_secs_f64(),
            proc_stats(self.op_pid).cpu_s - cpu0,
            node_lists(&self.client).await? - lists0,
        ));
        Ok(())
    }

    /// The dynamic MIG policy of the valid-profile flood; its Ready condition goes into a note.
    async fn create_dynamic_policy(&self, s: &mut Scenario) -> anyhow::Result<()> {
        let pol: Api<GpuSharingPolicy> = Api::all(self.client.clone());
        pol.create(&PostParams::default(), &dynamic_policy())
            .await?;
        let t = Instant::now();
        let ready = loop {
            let st = pol.get(DYNAMIC_POLICY).await?.status;
            let cond = st
                .iter()
                .flat_map(|s| &s.conditions)
                .find(|c| c.type_ == "Ready")
                .map(|c| format!("Ready={} ({}: {})", c.status, c.reason, c.message));
            if let Some(c) = cond {
                break c;
            }
            if t.elapsed() > Duration::from_secs(60) {
                break "no Ready condition after 60 s".into();
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        };
        s.notes
            .push(format!("dynamic policy {DYNAMIC_POLICY}: {ready}"));
        self.settle().await
    }

    /// Deletes the scenario's pods and dynamic policy, and waits until they are gone.
    async fn clean_up(&self, load: Load) -> anyhow::Result<()> {
        if matches!(load, Load::Quiet) {
            return Ok(());
        }
        let pods: Api<Pod> = Api::namespaced(self.client.clone(), FLOOD_NS);
        pods.delete_collection(&DeleteParams::default(), &ListParams::default())
            .await?;
        let pol: Api<GpuSharingPolicy> = Api::all(self.client.clone());
        if matches!(load, Load::Flood { dynamic: true, .. }) {
            pol.delete(DYNAMIC_POLICY, &DeleteParams::default()).await?;
        }
        let t = Instant::now();
        loop {
            let left = pods
                .list_metadata(&ListParams::default())
                .await?
                .items
                .len();
            let policy = pol.get_opt(DYNAMIC_POLICY).await?.is_some();
            if left == 0 && !policy {
                break;
            }
            if t.elapsed() > Duration::from_secs(120) {
                bail!(
                    "after 120 s: {left} pods left, dynamic policy gone: {}",
                    !policy
                );
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        self.settle().await
    }
}

/// Moves node `name` to group `to`; the time from the patch until its config label is `want`
/// (None after [`SAMPLE_TIMEOUT`]).
async fn sample(
    client: Client,
    name: String,
    to: usize,
    want: String,
) -> anyhow::Result<Option<Duration>> {
    // A WATCH, no LIST (node LISTs are counted): from version "0" it starts with the node as it
    // is (an old version may have left the watch cache: 410 Gone), then its changes.
    let meta: Api<PartialObjectMeta<Node>> = Api::all(client.clone());
    let wp = WatchParams::default()
        .fields(&format!("metadata.name={name}"))
        .timeout(SAMPLE_TIMEOUT.as_secs() as u32 + 5);
    let mut events = meta.watch(&wp, "0").await?.boxed();
    match events.next().await {
        Some(Ok(WatchEvent::Added(_))) => {}
        other => bail!("watch of {name}: {other:?} first"),
    }
    let patch = json!({"metadata": {"labels": {GROUP_LABEL: format!("g{to}")}}});
    let pp = PatchParams {
        field_manager: Some(BENCH_MANAGER.into()),
        ..Default::default()
    };
    Api::<Node>::all(client)
        .patch(&name, &pp, &Patch::Merge(&patch))
        .await?;
    let start = Instant::now();
    let seen = tokio::time::timeout(SAMPLE_TIMEOUT, async {
        while let Some(ev) = events.next().await {
            match ev? {
                WatchEvent::Modified(n) | WatchEvent::Added(n)
                    if n.labels().get(LABEL_DEVICE_PLUGIN_CONFIG) == Some(&want) =>
                {
                    return Ok(start.elapsed());
                }
                WatchEvent::Error(e) => bail!("watch of {name}: {e}"),
                _ => {}
            }
        }
        bail!("watch of {name} ended")
    })
    .await;
    match seen {
        Ok(r) => r.map(Some),
        Err(_) => Ok(None),
    }
}

/// Creates the flood's pods, one every [`FLOOD_EVERY`]; returns how long that took.
async fn flood(client: Client, profile: &'static str) -> anyhow::Result<Duration> {
    let api: Api<Pod> = Api::namespaced(client, FLOOD_NS);
    let mut tick = tokio::time::interval(FLOOD_EVERY);
    let t = Instant::now();
    for i in 0..FLOOD_PODS {
        tick.tick().await;
        api.create(&PostParams::default(), &flood_pod(i, profile))
            .await?;
    }
    Ok(t.elapsed())
}

/// A pod asking for one `nvidia.com/mig-<profile>` and selecting a node label key of its own
/// that no node has.
fn flood_pod(i: usize, profile: &str) -> Pod {
    let res = json!({format!("nvidia.com/mig-{profile}"): "1"});
    serde_json::from_value(json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": format!("flood-{i:04}"), "namespace": FLOOD_NS},
        "spec": {
            "nodeSelector": {format!("flood.example/k{i}"): "x"},
            "containers": [{"name": "c", "image": "registry.k8s.io/pause:3.10",
                "resources": {"requests": res.clone(), "limits": res}}],
        },
    }))
    .expect("valid pod")
}

/// A pod asking for no GPU, selecting a node label no node has.
fn pending_pod(i: usize) -> Pod {
    serde_json::from_value(json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": format!("pending-{i:05}"), "namespace": FLOOD_NS},
        "spec": {
            "nodeSelector": {"flood.example/nowhere": "x"},
            "containers": [{"name": "c", "image": "registry.k8s.io/pause:3.10"}],
        },
    }))
    .expect("valid pod")
}

/// A dynamic MIG policy whose catalogue offers `1g.10gb` (layouts all-1g.10gb and all-balanced
/// on A100/H100), taking demand from namespace `flood` only and selecting no node (a group no
/// node is in: no new selector key either).
fn dynamic_policy() -> GpuSharingPolicy {
    serde_json::from_value(json!({
        "apiVersion": "gpusharing.io/v1alpha1",
        "kind": "GpuSharingPolicy",
        "metadata": {"name": DYNAMIC_POLICY},
        "spec": {
            "nodeSelector": {"matchLabels": {GROUP_LABEL: "flood-none"}},
            "strategy": "mig",
            "mig": {
                "migStrategy": "mixed",
                "layout": "all-7g.80gb",
                "dynamic": {
                    "layouts": ["all-1g.10gb", "all-balanced"],
                    "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": FLOOD_NS}},
                },
            },
        },
    }))
    .expect("valid policy")
}

/// Pods in the flood namespace, and how many of them kube-scheduler marked Unschedulable.
async fn unschedulable(client: &Client) -> anyhow::Result<(usize, usize)> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), FLOOD_NS);
    let list = pods.list(&ListParams::default()).await?.items;
    let marked = list
        .iter()
        .filter(|p| {
            p.status
                .iter()
                .flat_map(|s| s.conditions.iter().flatten())
                .any(|c| {
                    c.type_ == "PodScheduled"
                        && c.status == "False"
                        && c.reason.as_deref() == Some("Unschedulable")
                })
        })
        .count();
    Ok((list.len(), marked))
}

/// What the dynamic policy's status says of the flood's demand.
async fn demand_note(client: &Client) -> anyhow::Result<String> {
    let pol: Api<GpuSharingPolicy> = Api::all(client.clone());
    let demand = pol.get(DYNAMIC_POLICY).await?.status.and_then(|s| s.demand);
    let Some(d) = demand else {
        return Ok("dynamic policy status: no demand".into());
    };
    let profiles: Vec<String> = d
        .profiles
        .iter()
        .map(|p| {
            format!(
                "{} pending {} ({})",
                p.profile,
                p.pending,
                p.reason.as_deref().unwrap_or("-")
            )
        })
        .collect();
    let ignored: Vec<String> = d
        .ignored
        .iter()
        .map(|i| format!("{} {} pods", i.reason, i.pods))
        .collect();
    Ok(format!(
        "dynamic policy status after the flood: demand [{}], ignored [{}]",
        profiles.join(", "),
        ignored.join(", ")
    ))
}

/// Node LIST requests kube-apiserver has served (each page counts).
async fn node_lists(client: &Client) -> anyhow::Result<f64> {
    apiserver_requests(client, "LIST", "nodes").await
}

/// kube-apiserver's `apiserver_request_total` for this verb and resource (no subresource).
async fn apiserver_requests(client: &Client, verb: &str, resource: &str) -> anyhow::Result<f64> {
    let req = kube::core::Request::new("").get("metrics", &GetParams::default())?;
    let text = client.request_text(req).await?;
    let mut total = 0.0;
    for line in text.lines() {
        let Some(rest) = line.strip_prefix("apiserver_request_total{") else {
            continue;
        };
        let Some((labels, value)) = rest.rsplit_once("} ") else {
            continue;
        };
        let has = |kv: &str| labels.split(',').any(|l| l == kv);
        if has(&format!("verb=\"{verb}\""))
            && has(&format!("resource=\"{resource}\""))
            && has(r#"subresource="""#)
        {
            total += value.trim().parse::<f64>().unwrap_or(0.0);
        }
    }
    Ok(total)
}

/// The operator's "listing nodes again" log lines so far (the node cache's filter grew).
fn relists_logged(log: &Path) -> usize {
    std::fs::read_to_string(log)
        .unwrap_or_default()
        .lines()
        .filter(|l| l.contains("listing nodes again"))
        .count()
}

/// Median, p90 (nearest rank) and max in ms of the samples that completed.
fn percentiles(samples: &[Option<Duration>]) -> Option<(f64, f64, f64)> {
    let mut v: Vec<f64> = samples
        .iter()
        .flatten()
        .map(|d| d.as_secs_f64() * 1000.0)
        .collect();
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let k = v.len();
    let median = if k % 2 == 1 {
        v[k / 2]
    } else {
        (v[k / 2 - 1] + v[k / 2]) / 2.0
    };
    let p90 = v[((0.9 * k as f64).ceil() as usize).clamp(1, k) - 1];
    Some((median, p90, v[k - 1]))
}

fn render_row(s: &Scenario) -> String {
    let done = s.samples.iter().flatten().count();
    let (median, p90, max) = percentiles(&s.samples)
        .map(|(a, b, c)| (format!("{a:.0}"), format!("{b:.0}"), format!("{c:.0}")))
        .unwrap_or_else(|| ("-".into(), "-".into(), "-".into()));
    let mut notes = s.notes.clone();
    if done < s.samples.len() {
        notes.push(format!(
            "{} sample(s) timed out ({} s)",
            s.samples.len() - done,
            SAMPLE_TIMEOUT.as_secs()
        ));
    }
    format!(
        "| {} | {done}/{} | {median} | {p90} | {max} | {:.0} | {} | {} | {:.2} | {:.1} | {:.0} | {} |\n",
        s.name,
        s.samples.len(),
        s.node_lists,
        s.relists_logged,
        s.passes.map_or("?".into(), |p| p.to_string()),
        s.cpu_s,
        s.kl_cpu_s,
        s.window.as_secs_f64(),
        notes.join("; ").replace('|', "/"),
    )
}

fn render(args: &Args, n: usize, rows: &[Scenario]) -> String {
    let pages = n.div_ceil(NODE_LIST_PAGE);
    let mut md = format!(
        "## Flood benchmark\n\nMachine: {}. kube-apiserver + etcd + kube-scheduler (`kube-local --scheduler`) and the \
         operator on the same machine. {n} nodes in two groups, two time-slicing policies (one per group). \
         Latency: from a node's group label patch returning to the operator's new `{LABEL_DEVICE_PLUGIN_CONFIG}` on it, \
         seen on a watch of the node; {} samples per scenario, started ~1 s apart on a fixed schedule (overlapping if the \
         operator stalls). Node LISTs: kube-apiserver's node LIST \
         requests during the scenario (the operator's; pages of {NODE_LIST_PAGE}, one full re-list of {n} nodes = \
         {pages}); re-lists logged: the operator's \"listing nodes again\" lines; passes: its \
         `gpu_sharing_reconciles_total`; CPU: the operator's, and kube-local's (apiserver, etcd, kube-scheduler). All over the window from the first sample to the quiet \
         after the flood (flood pods: one every {} ms). Nothing asserts on timings.\n\n\
         | scenario | samples | median ms | p90 ms | max ms | node LISTs | re-lists logged | operator passes | operator CPU s | kube-local CPU s | window s | notes |\n\
         |---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|\n",
        machine(),
        args.flood_samples,
        FLOOD_EVERY.as_millis(),
    );
    for s in rows {
        md.push_str(&render_row(s));
    }
    md.push_str("\nSamples (ms, in order):\n\n");
    for s in rows {
        let v: Vec<String> = s
            .samples
            .iter()
            .map(|d| {
                d.map_or("timeout".into(), |d| {
                    format!("{:.0}", d.as_secs_f64() * 1000.0)
                })
            })
            .collect();
        md.push_str(&format!("- {}: {}\n", s.name, v.join(", ")));
    }
    md.push_str(&format!(
        "\nCommand: `{}`\n",
        std::env::args().collect::<Vec<_>>().join(" ")
    ));
    md
}

/// The benchmark's scraper: ServiceAccount `default/metrics-scraper`, allowed to `get /metrics`
/// (as the chart's metrics-reader ClusterRole allows Prometheus); returns a token of it.
async fn create_scraper(client: &Client) -> anyhow::Result<String> {
    const NAME: &str = "metrics-scraper";
    let sa: ServiceAccount = serde_json::from_value(json!({"metadata": {"name": NAME}}))?;
    Api::<ServiceAccount>::namespaced(client.clone(), "default")
        .create(&PostParams::default(), &sa)
        .await?;
    let role: ClusterRole = serde_json::from_value(json!({
        "metadata": {"name": NAME},
        "rules": [{"nonResourceURLs": ["/metrics"], "verbs": ["get"]}],
    }))?;
    Api::<ClusterRole>::all(client.clone())
        .create(&PostParams::default(), &role)
        .await?;
    let binding: ClusterRoleBinding = serde_json::from_value(json!({
        "metadata": {"name": NAME},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": NAME},
        "subjects": [{"kind": "ServiceAccount", "name": NAME, "namespace": "default"}],
    }))?;
    Api::<ClusterRoleBinding>::all(client.clone())
        .create(&PostParams::default(), &binding)
        .await?;
    testkit::service_account_token(client, "default", NAME).await
}

/// What a token flood got.
#[derive(Default)]
struct TokenFlood {
    sent: usize,
    /// Ticks skipped because [`MAX_OUTSTANDING`] requests were still open.
    skipped: usize,
    by_status: BTreeMap<u16, usize>,
    failed: usize,
    seconds: f64,
    /// The scraper's scrapes meanwhile: status and latency.
    scrapes: Vec<(Option<u16>, Duration)>,
}

/// At most this many flood requests open at once.
const MAX_OUTSTANDING: usize = 256;

impl TokenFlood {
    fn note(&self) -> String {
        let statuses: Vec<String> = self
            .by_status
            .iter()
            .map(|(s, n)| format!("{n} x {s}"))
            .collect();
        let ok = self.scrapes.iter().filter(|(s, _)| *s == Some(200)).count();
        let mut ms: Vec<f64> = self
            .scrapes
            .iter()
            .map(|(_, d)| d.as_secs_f64() * 1000.0)
            .collect();
        ms.sort_by(f64::total_cmp);
        let median = ms.get(ms.len() / 2).copied().unwrap_or(f64::NAN);
        let max = ms.last().copied().unwrap_or(f64::NAN);
        format!(
            "{} flood requests in {:.1} s ({:.0}/s; {} ticks skipped at {MAX_OUTSTANDING} open): {}, {} failed; the scraper's {} scrapes meanwhile: {ok} answered 200, median {median:.0} ms, max {max:.0} ms",
            self.sent,
            self.seconds,
            self.sent as f64 / self.seconds.max(1e-9),
            self.skipped,
            statuses.join(", "),
            self.failed,
            self.scrapes.len(),
        )
    }
}

/// Sends `rate` requests a second to /metrics until `stop`, each on a new TLS connection with a
/// bearer token never seen before, and scrapes with `token` once a second.
async fn token_flood(port: u16, rate: u32, token: String, stop: Arc<AtomicBool>) -> TokenFlood {
    use testkit::https::{Trust, get};
    let addr = std::net::SocketAddr::from(([127, 0, 0, 1], port));
    let mut tick = tokio::time::interval(Duration::from_secs_f64(1.0 / f64::from(rate.max(1))));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    let mut flood = tokio::task::JoinSet::new();
    let mut scrapes = tokio::task::JoinSet::new();
    let mut r = TokenFlood::default();
    let t = Instant::now();
    let mut next_scrape = Duration::ZERO;
    while !stop.load(Ordering::Relaxed) {
        tick.tick().await;
        if t.elapsed() >= next_scrape {
            next_scrape += Duration::from_secs(1);
            let token = token.clone();
            scrapes.spawn(async move {
                let s = Instant::now();
                let got = get(addr, "localhost", "/metrics", Some(&token), &Trust::Any).await;
                (got.ok().map(|g| g.status), s.elapsed())
            });
        }
        while let Some(done) = flood.try_join_next() {
            r.count(done.ok().flatten());
        }
        if flood.len() >= MAX_OUTSTANDING {
            r.skipped += 1;
            continue;
        }
        let bogus = format!("made-up-{}-{:x}", r.sent, t.elapsed().as_nanos());
        r.sent += 1;
        flood.spawn(async move {
            get(addr, "localhost", "/metrics", Some(&bogus), &Trust::Any)
                .await
                .ok()
                .map(|g| g.status)
        });
    }
    while let Some(done) = flood.join_next().await {
        r.count(done.ok().flatten());
    }
    r.seconds = t.elapsed().as_secs_f64();
    r.scrapes = scrapes.join_all().await;
    r
}

impl TokenFlood {
    fn count(&mut self, status: Option<u16>) {
        match status {
            Some(s) => *self.by_status.entry(s).or_default() += 1,
            None => self.failed += 1,
        }
    }
}
