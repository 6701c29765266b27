//! Rollout benchmark: one policy over N nodes with `maxUnavailable` (default 10%), against the
//! ideal of waves x confirmation time.
//!
//! The nodes carry `nvidia.com/gfd.timestamp`, so the operator waits for GPU Feature Discovery
//! after each config change. A simulated GFD (this module, test code) watches the nodes and,
//! `--confirm-delay-ms` after a node's `nvidia.com/device-plugin.config` changes, stamps a new
//! timestamp, as the real one does after the device plugin restarted. It also counts the nodes
//! between a config change and its confirmation, i.e. what the budget bounds. The ideal rollout
//! takes ceil(N / budget) waves of one confirmation delay each; the operator adds its reaction
//! time per wave (watch event -> pass -> label writes).

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::core::v1::Node;
use kube::api::{Api, ListParams, PartialObjectMeta, Patch, PatchParams, PostParams};
use kube::runtime::watcher;
use kube::{Client, ResourceExt};
use serde_json::json;

use super::*;

/// The simulated GFD: stamps nodes a delay after their config label changed, and counts the
/// nodes in between.
struct Gfd {
    in_flight: AtomicUsize,
    max: AtomicUsize,
    stamped: AtomicUsize,
}

impl Gfd {
    fn reset(&self) {
        self.max
            .store(self.in_flight.load(Ordering::SeqCst), Ordering::SeqCst);
    }

    fn start(self: &Arc<Self>, client: &Client, delay: Duration) -> tokio::task::JoinHandle<()> {
        let gfd = self.clone();
        let api: Api<PartialObjectMeta<Node>> = Api::all(client.clone());
        let nodes: Api<Node> = Api::all(client.clone());
        tokio::spawn(async move {
            let seen: Arc<Mutex<BTreeMap<String, Option<String>>>> = Arc::default();
            let mut stream = watcher(api, watcher::Config::default()).boxed();
            while let Some(ev) = stream.next().await {
                let (Ok(watcher::Event::Apply(n)) | Ok(watcher::Event::InitApply(n))) = ev else {
                    continue;
                };
                let name = n.name_any();
                let dp = n.labels().get(LABEL_DEVICE_PLUGIN_CONFIG).cloned();
                let changed = {
                    let mut seen = seen.lock().unwrap();
                    let old = seen.insert(name.clone(), dp.clone());
                    old.is_some_and(|o| o != dp)
                };
                if !changed {
                    continue;
                }
                let now = gfd.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
                gfd.max.fetch_max(now, Ordering::SeqCst);
                let (gfd, nodes) = (gfd.clone(), nodes.clone());
                tokio::spawn(async move {
                    tokio::time::sleep(delay).await;
                    let ts = std::time::SystemTime::now()
                        .duration_since(std::time::UNIX_EPOCH)
                        .unwrap()
                        .as_secs()
                        .to_string();
                    let patch = json!({"metadata": {"labels": {"nvidia.com/gfd.timestamp": ts}}});
                    let pp = PatchParams {
                        field_manager: Some("gpu-feature-discovery-sim".into()),
                        ..Default::default()
                    };
                    if nodes.patch(&name, &pp, &Patch::Merge(&patch)).await.is_ok() {
                        gfd.stamped.fetch_add(1, Ordering::SeqCst);
                    }
                    gfd.in_flight.fetch_sub(1, Ordering::SeqCst);
                });
            }
        })
    }
}

struct Phase {
    time: Option<Duration>,
    max_unconfirmed: usize,
    writes: Writes,
    /// The simulated GFD's own node patches in this phase (not the operator's).
    stamps: usize,
}

fn row(name: &str, p: &Phase, ideal: Duration) -> String {
    let ratio = p
        .time
        .map(|t| format!("{:.2}", t.as_secs_f64() / ideal.as_secs_f64()))
        .unwrap_or_else(|| "-".into());
    format!(
        "| {name} | {} | {:.1} | {ratio} | {} | {} |\n",
        secs(p.time),
        ideal.as_secs_f64(),
        p.max_unconfirmed,
        p.writes.nodes - p.stamps as i64,
    )
}

/// Runs the rollout benchmark; returns (and writes to `<out>/rollout.md`) the Markdown report.
pub async fn run(args: &Args, kl: &Path, op: &Path, n: usize) -> anyhow::Result<String> {
    let cluster = start_cluster(
        kl,
        &args.out.join(format!("logs/rollout-{n}-kube-local.log")),
    )
    .await?;
    let client = cluster.client.clone();
    let op_log = args.out.join(format!("logs/rollout-{n}-operator.log"));
    let mut child: Option<Child> = None;
    let delay = Duration::from_millis(args.confirm_delay_ms);
    let gfd = Arc::new(Gfd {
        in_flight: AtomicUsize::new(0),
        max: AtomicUsize::new(0),
        stamped: AtomicUsize::new(0),
    });
    let res = async {
        install_crd(&client).await?;
        let stamp: BTreeMap<String, String> =
            [("nvidia.com/gfd.timestamp".to_string(), "1".to_string())].into();
        create_nodes_with(&client, n, 1, args.concurrency, &stamp).await?;
        wait_idle(cluster.pid(), Duration::from_secs(60)).await;
        let task = gfd.start(&client, delay);
        let metrics_port = std::net::TcpListener::bind("127.0.0.1:0")?
            .local_addr()?
            .port();
        let c = start_operator(op, &cluster.kubeconfig, &op_log, metrics_port).await?;
        let pid = c.id();
        child = Some(c);
        wait_quiet(&client, Duration::from_secs(3), Duration::from_secs(60)).await?;
        let timeout = Duration::from_secs(args.timeout_secs);
        let per_group = vec![n as i32];

        // First enablement.
        let m0 = scrape(&client).await?;
        gfd.reset();
        let s0 = gfd.stamped.load(Ordering::SeqCst);
        let mut policy = policy_object(0, 4);
        policy.spec.rollout = Some(serde_json::from_value(
            json!({"maxUnavailable": args.rollout_max_unavailable}),
        )?);
        let pol: Api<GpuSharingPolicy> = Api::all(client.clone());
        let start = Instant::now();
        pol.create(&PostParams::default(), &policy).await?;
        let time = wait_converged(&client, &per_group, &BTreeMap::new(), start, timeout).await?;
        let m1 = wait_quiet(&client, Duration::from_secs(3), Duration::from_secs(60)).await?;
        let s1 = gfd.stamped.load(Ordering::SeqCst);
        let first = Phase {
            time,
            max_unconfirmed: gfd.max.load(Ordering::SeqCst),
            writes: Writes::from(&diff(&m1, &m0), 1),
            stamps: s1 - s0,
        };
        let status = pol.get(&policy_name(0)).await?.status.unwrap_or_default();
        let budget = status.rollout.map_or(0, |r| r.max_unavailable) as usize;
        let old_key = status.device_config_key.unwrap_or_default();

        // An edit.
        gfd.reset();
        let start = Instant::now();
        pol.patch(
            &policy_name(0),
            &PatchParams::default(),
            &Patch::Merge(edit_patch()),
        )
        .await?;
        let old: BTreeMap<String, String> = [(policy_name(0), old_key)].into();
        let time = wait_converged(&client, &per_group, &old, start, timeout).await?;
        let m2 = wait_quiet(&client, Duration::from_secs(3), Duration::from_secs(60)).await?;
        let edit = Phase {
            time,
            max_unconfirmed: gfd.max.load(Ordering::SeqCst),
            writes: Writes::from(&diff(&m2, &m1), 1),
            stamps: gfd.stamped.load(Ordering::SeqCst) - s1,
        };
        let stats = proc_stats(pid);
        task.abort();
        let nodes: Api<Node> = Api::all(client.clone());
        let labelled = nodes
            .list_metadata(&ListParams::default())
            .await?
            .items
            .len();
        anyhow::ensure!(labelled == n, "{labelled} nodes listed, {n} created");
        Ok::<_, anyhow::Error>((first, edit, budget, stats))
    }
    .await;
    if let Some(mut c) = child {
        let _ = c.kill();
        let _ = c.wait();
    }
    drop(cluster); // kube-local stops, its directory is removed
    let (first, edit, budget, stats) = res?;
    let waves = n.div_ceil(budget.max(1));
    let ideal = delay * waves as u32;
    let mut md = format!(
        "## Rollout benchmark\n\nMachine: {}. {n} nodes, one time-slicing policy, maxUnavailable {} \
         (= {budget} nodes), a simulated GFD confirming each node {} ms after its config label \
         changed. Ideal = {waves} waves x {} ms. `max unconfirmed` is counted by the simulated GFD \
         (config changed, not yet stamped), independently of the operator.\n\n\
         | phase | operator s | ideal s | ratio | max unconfirmed | operator node writes |\n|---|---:|---:|---:|---:|---:|\n",
        machine(),
        args.rollout_max_unavailable,
        args.confirm_delay_ms,
        args.confirm_delay_ms,
    );
    md.push_str(&row("first enablement", &first, ideal));
    md.push_str(&row("edit (failRequestsGreaterThanOne)", &edit, ideal));
    md.push_str(&format!(
        "\nOperator peak RSS {:.1} MiB, CPU {:.1} s. GFD stamps: {}.\n",
        stats.hwm_kib as f64 / 1024.0,
        stats.cpu_s,
        gfd.stamped.load(Ordering::SeqCst)
    ));
    std::fs::create_dir_all(&args.out)?;
    std::fs::write(args.out.join("rollout.md"), &md)?;
    Ok(md)
}
