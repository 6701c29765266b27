//! The operator side: `gpu-sharing-operator run` as a child process, its passes from /metrics,
//! the apply, the edit and the steady window.

use super::*;

#[derive(Default)]
pub(crate) struct OperatorResult {
    pub(crate) apply_time: Option<Duration>,
    pub(crate) edit_time: Option<Duration>,
    pub(crate) startup: Writes,
    pub(crate) apply: Writes,
    pub(crate) edit: Writes,
    pub(crate) steady: Writes,
    pub(crate) apply_min: i64,
    pub(crate) edit_min: i64,
    pub(crate) stats: ProcStats,
    /// After the caches synced, before any policy.
    pub(crate) stats_synced: ProcStats,
    pub(crate) cpu_apply: f64,
    pub(crate) cpu_edit: f64,
    pub(crate) apiserver_cpu_apply: f64,
    pub(crate) apiserver_cpu_edit: f64,
    /// The edit, seen on the edited policy's nodes: when the first and the last of them got the
    /// new config label (from the edit), and how many did.
    pub(crate) edit_first_write: Option<Duration>,
    pub(crate) edit_last_write: Option<Duration>,
    pub(crate) edit_nodes_written: usize,
    /// The operator's passes during the edit (its `gpu_sharing_reconciles_total`).
    pub(crate) edit_passes: Option<u64>,
    pub(crate) notes: Vec<String>,
}

/// The operator's passes so far, from its metrics endpoint (`gpu_sharing_reconciles_total`)
/// served over plain HTTP (`--metrics-insecure`).
pub(crate) async fn operator_passes(port: u16) -> Option<u64> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    // One request to a local endpoint; HTTP/1.0 so the server closes when done.
    let mut conn = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .ok()?;
    conn.write_all(b"GET /metrics HTTP/1.0\r\nHost: localhost\r\n\r\n")
        .await
        .ok()?;
    let mut body = String::new();
    conn.read_to_string(&mut body).await.ok()?;
    testkit::metrics::passes_in(&body)
}

/// The same over HTTPS with a bearer token allowed to `get /metrics` (the operator's
/// self-signed certificate is accepted, as a ServiceMonitor with `insecureSkipVerify` would).
pub(crate) async fn operator_passes_tls(port: u16, token: &str) -> Option<u64> {
    let addr = std::net::SocketAddr::from(([127, 0, 0, 1], port));
    let r = testkit::https::get(
        addr,
        "localhost",
        "/metrics",
        Some(token),
        &testkit::https::Trust::Any,
    )
    .await
    .ok()?;
    (r.status == 200)
        .then(|| testkit::metrics::passes_in(&r.body))
        .flatten()
}

/// Records, for the nodes of `group`, when each first carries a device-plugin config other than
/// `old_key` (elapsed since `start`). Ends when dropped (abort the task).
pub(crate) fn watch_relabels(
    client: &Client,
    group: usize,
    old_key: String,
    start: Instant,
) -> (
    tokio::task::JoinHandle<()>,
    std::sync::Arc<std::sync::Mutex<BTreeMap<String, Duration>>>,
) {
    use kube::runtime::watcher;
    let seen = std::sync::Arc::new(std::sync::Mutex::new(BTreeMap::new()));
    let api: Api<PartialObjectMeta<Node>> = Api::all(client.clone());
    let cfg = watcher::Config::default().labels(&format!("{GROUP_LABEL}=g{group}"));
    let s = seen.clone();
    let task = tokio::spawn(async move {
        let mut events = watcher::watcher(api, cfg).boxed();
        while let Some(ev) = events.next().await {
            if let Ok(watcher::Event::Apply(n) | watcher::Event::InitApply(n)) = ev {
                let key = n.labels().get(LABEL_DEVICE_PLUGIN_CONFIG).cloned();
                if key.is_some_and(|k| k != old_key) {
                    s.lock()
                        .unwrap()
                        .entry(n.name_any())
                        .or_insert_with(|| start.elapsed());
                }
            }
        }
    });
    (task, seen)
}

/// Starts `gpu-sharing-operator run` against the cluster, logging to `log`, and waits until its
/// caches are ready (at most 120 s).
pub(crate) async fn start_operator(
    op: &Path,
    kubeconfig: &Path,
    log: &Path,
    metrics_port: u16,
) -> anyhow::Result<Child> {
    // Scraped over plain HTTP (operator_passes).
    start_operator_with(op, kubeconfig, log, metrics_port, &["--metrics-insecure"]).await
}

/// [`start_operator`] with these arguments of `run` besides the namespace and the addresses
/// (without `--metrics-insecure`, /metrics is HTTPS with a self-signed certificate and needs
/// a token: [`operator_passes_tls`]).
pub(crate) async fn start_operator_with(
    op: &Path,
    kubeconfig: &Path,
    log: &Path,
    metrics_port: u16,
    extra: &[&str],
) -> anyhow::Result<Child> {
    let mut c = Command::new(op)
        .args(["run", "--namespace", NAMESPACE])
        .arg(format!("--metrics-addr=127.0.0.1:{metrics_port}"))
        // No health endpoint.
        .arg("--health-addr=")
        .args(extra)
        .env("KUBECONFIG", kubeconfig)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::from(std::fs::File::create(log)?))
        .spawn()
        .with_context(|| format!("spawn {}", op.display()))?;
    let t = Instant::now();
    while !std::fs::read_to_string(log)
        .unwrap_or_default()
        .contains("caches ready")
    {
        if t.elapsed() > Duration::from_secs(120) {
            let _ = c.kill();
            let _ = c.wait();
            bail!("operator not ready after 120 s (log: {})", log.display());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Ok(c)
}

pub(crate) async fn run_operator(
    args: &Args,
    kl: &Path,
    op: &Path,
    n: usize,
    p: usize,
) -> anyhow::Result<OperatorResult> {
    let cluster = start_cluster(
        kl,
        &args
            .out
            .join(format!("logs/{n}x{p}-operator-kube-local.log")),
    )
    .await?;
    let client = cluster.client.clone();
    let kl_pid = cluster.pid();
    let op_log = args.out.join(format!("logs/{n}x{p}-operator.log"));
    let mut child: Option<Child> = None;
    let res = async {
        install_crd(&client).await?;
        create_nodes(&client, n, p, args.concurrency).await?;
        let per_group = nodes_per_group(n, p);
        let timeout = Duration::from_secs(args.timeout_secs);
        let mut r = OperatorResult::default();

        wait_idle(kl_pid, Duration::from_secs(60)).await;
        // Start the operator and let it settle (it may write the empty config first).
        let m0 = scrape(&client).await?;
        let metrics_port = std::net::TcpListener::bind("127.0.0.1:0")?
            .local_addr()?
            .port();
        let c = start_operator(op, &cluster.kubeconfig, &op_log, metrics_port).await?;
        let pid = c.id();
        child = Some(c);
        let m1 = wait_quiet(&client, Duration::from_secs(3), Duration::from_secs(60)).await?;
        r.startup = Writes::from(&diff(&m1, &m0), 0);
        r.stats_synced = proc_stats(pid);

        // Apply the policies.
        let cpu0 = proc_stats(pid).cpu_s;
        let kcpu0 = proc_stats(kl_pid).cpu_s;
        let start = Instant::now();
        create_policies(&client, p, args.concurrency).await?;
        r.apply_time =
            wait_converged(&client, &per_group, &BTreeMap::new(), start, timeout).await?;
        if r.apply_time.is_none() {
            r.notes.push(format!(
                "apply: not converged within {} s",
                args.timeout_secs
            ));
        }
        let m2 = wait_quiet(&client, Duration::from_secs(3), Duration::from_secs(60)).await?;
        r.cpu_apply = proc_stats(pid).cpu_s - cpu0;
        r.apiserver_cpu_apply = proc_stats(kl_pid).cpu_s - kcpu0;
        r.apply = Writes::from(&diff(&m2, &m1), p as i64);
        r.apply_min = 1 + 1 + n as i64 + p as i64;

        // Edit one policy (a new config key for its nodes, see `edit_patch`).
        let pol: Api<GpuSharingPolicy> = Api::all(client.clone());
        let old_keys: BTreeMap<String, String> = pol
            .list(&ListParams::default())
            .await?
            .items
            .into_iter()
            .filter_map(|p| Some((p.name_any(), p.status?.device_config_key?)))
            .collect();
        let edited = policy_name(0);
        let mut only_edited = BTreeMap::new();
        only_edited.insert(
            edited.clone(),
            old_keys.get(&edited).cloned().unwrap_or_default(),
        );
        let cpu1 = proc_stats(pid).cpu_s;
        let kcpu1 = proc_stats(kl_pid).cpu_s;
        let passes1 = operator_passes(metrics_port).await;
        let start = Instant::now();
        let (relabels, written) = watch_relabels(
            &client,
            0,
            old_keys.get(&edited).cloned().unwrap_or_default(),
            start,
        );
        pol.patch(
            &edited,
            &PatchParams::default(),
            &Patch::Merge(edit_patch()),
        )
        .await?;
        r.edit_time = wait_converged(&client, &per_group, &only_edited, start, timeout).await?;
        if r.edit_time.is_none() {
            r.notes.push(format!(
                "edit: not converged within {} s",
                args.timeout_secs
            ));
        }
        let m3 = wait_quiet(&client, Duration::from_secs(3), Duration::from_secs(60)).await?;
        r.cpu_edit = proc_stats(pid).cpu_s - cpu1;
        r.apiserver_cpu_edit = proc_stats(kl_pid).cpu_s - kcpu1;
        r.edit_passes = match (passes1, operator_passes(metrics_port).await) {
            (Some(a), Some(b)) => Some(b - a),
            _ => None,
        };
        relabels.abort();
        {
            let w = written.lock().unwrap();
            r.edit_first_write = w.values().min().copied();
            r.edit_last_write = w.values().max().copied();
            r.edit_nodes_written = w.len();
        }
        r.edit = Writes::from(&diff(&m3, &m2), 1);
        // New key in, labels of the edited policy's nodes, old key out, its status.
        r.edit_min = 2 + per_group[0] as i64 + 1;

        // Steady state.
        let m4 = scrape(&client).await?;
        tokio::time::sleep(Duration::from_secs(args.steady_secs)).await;
        let m5 = scrape(&client).await?;
        r.steady = Writes::from(&diff(&m5, &m4), 0);
        r.stats = proc_stats(pid);
        if let Ok(s) = std::fs::read_to_string(&op_log) {
            let warns = s.lines().filter(|l| l.contains("WARN")).count();
            if warns > 0 {
                r.notes.push(format!(
                    "operator log: {warns} WARN lines ({})",
                    op_log.display()
                ));
            }
        }
        Ok::<_, anyhow::Error>(r)
    }
    .await;
    if let Some(mut c) = child {
        let _ = c.kill();
        let _ = c.wait();
    }
    drop(cluster); // kube-local stops, its directory is removed
    res
}
