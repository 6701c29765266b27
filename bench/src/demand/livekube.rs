//! The live side of `--demand-live`: one configuration of a trace replayed in real time on a
//! fresh local control plane, with kube-scheduler in-process (`kube-local --scheduler`), the node
//! simulator (tests/nvidia: MIG manager, device plugin, GFD and kubelet) and the operator binary.
//!
//! The nodes are the fixture's A100 80GB node (8 GPUs), renamed and labelled for the policies.
//! Once every node carries its starting layout and every policy is Ready on its nodes, the
//! trace's pods are created at their arrival seconds; watches of the pods and nodes record when
//! each pod is bound (`spec.nodeName` first seen) and running, and each change of a node's
//! `nvidia.com/mig.config`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use futures::StreamExt;
use gpu_sharing_operator::api::crd::GpuSharingPolicy;
use gpu_sharing_operator::api::names::{LABEL_MIG_CONFIG, LABEL_MIG_STATE};
use k8s_openapi::api::core::v1::{Namespace, Node, Pod};
use kube::api::{Api, PostParams};
use kube::runtime::watcher;
use kube::{Client, ResourceExt};
use serde_json::json;

use super::trace::{Arrival, PROFILES};

/// The namespace of the trace's pods (the trace's ids are `trace/pod-NNNNN`).
pub(crate) const TRACE_NS: &str = "trace";

/// The simulator's kubelet runs a bound pod this long, then lets it Succeed.
const RUN_SECONDS: &str = "simulator.gpusharing.io/run-seconds";

/// The binaries and where logs go.
pub(crate) struct Bins<'a> {
    pub kube_local: &'a Path,
    pub operator: &'a Path,
    pub simulator: &'a Path,
    pub logs: PathBuf,
}

/// One node of a live run: the label its policy selects on and the layout it starts with.
#[derive(Clone, Debug)]
pub(crate) struct LiveNode {
    pub label: (String, String),
    pub layout: &'static str,
}

/// What one live run measured.
#[derive(Debug, Default)]
pub(crate) struct Measured {
    /// Each bound pod's wait, its creation request to `spec.nodeName` first seen, in seconds.
    pub waits: Vec<f64>,
    /// The same by pod name, with the node it was bound to.
    pub by_pod: BTreeMap<String, (f64, String)>,
    /// Each bound pod's wait to its phase first seen Running (the kubelet started it).
    pub run_waits: Vec<f64>,
    /// Each bound pod's `PodScheduled` condition time less its creation time (whole seconds).
    pub condition_waits: Vec<f64>,
    /// Pods still pending at the end.
    pub never_served: usize,
    /// Changes of a node's `nvidia.com/mig.config` after the trace's start.
    pub reshapes: usize,
    /// Pods bound to a node while its MIG manager was at work (state `pending`).
    pub bound_while_reshaping: usize,
    /// The latest a pod was created after its arrival second, in seconds.
    pub late: f64,
    /// Seconds to reach the starting layouts, from the control plane's start.
    pub setup_s: f64,
    /// Seconds from the first arrival to the end.
    pub took_s: f64,
    pub notes: Vec<String>,
}

/// What the watches saw of one pod.
#[derive(Clone, Debug, Default)]
struct Seen {
    created: Option<Instant>,
    bound: Option<(Instant, String)>,
    running: Option<Instant>,
    done: bool,
    condition_wait: Option<f64>,
    on_reshaping: bool,
}

/// What the watches saw, shared with their tasks.
#[derive(Default)]
struct Watched {
    pods: BTreeMap<String, Seen>,
    /// Each node's (`nvidia.com/mig.config`, `nvidia.com/mig.config.state`).
    nodes: BTreeMap<String, (Option<String>, Option<String>)>,
    reshapes: usize,
    /// When a pod was last bound or a node's MIG label or state last changed.
    last_change: Option<Instant>,
}

type Shared = Arc<Mutex<Watched>>;

/// The child processes of a run, stopped when dropped.
struct Children(Vec<Child>);

impl Drop for Children {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Replays `arrivals` live on `nodes` under `policies`, the simulator's MIG manager taking
/// `mig_delay` seconds; ends when every pod is bound, or once every pod was created and none
/// runs, and nothing changed for `settle` seconds (the pods pending then are never served).
/// `tag` names the logs.
pub(crate) async fn run(
    bins: &Bins<'_>,
    tag: &str,
    (nodes, policies): (&[LiveNode], &[GpuSharingPolicy]),
    arrivals: &[Arrival],
    mig_delay: i64,
    settle: i64,
) -> anyhow::Result<Measured> {
    let started = Instant::now();
    let log = |what: &str| bins.logs.join(format!("demand-live-{tag}-{what}.log"));
    let cluster =
        crate::start_cluster_with(bins.kube_local, &log("kube-local"), &["--scheduler"]).await?;
    let c = cluster.client.clone();
    let mut children = Children(Vec::new());
    crate::fixtures::install_crd(&c).await?;
    create_nodes(&c, nodes).await?;
    let ns: Namespace = serde_json::from_value(json!({"metadata": {"name": TRACE_NS}}))?;
    Api::<Namespace>::all(c.clone())
        .create(&PostParams::default(), &ns)
        .await?;
    children.0.push(start_simulator(
        bins.simulator,
        &cluster.kubeconfig,
        mig_delay,
        &log("simulator"),
    )?);
    // Its device plugins load (and GFD stamps) about a second after it starts.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    let op =
        crate::operator::start_operator(bins.operator, &cluster.kubeconfig, &log("operator"), port)
            .await?;
    children.0.push(op);
    let pol: Api<GpuSharingPolicy> = Api::all(c.clone());
    for p in policies {
        let mut p = p.clone();
        p.metadata.generation = None;
        pol.create(&PostParams::default(), &p).await?;
    }
    wait_configured(&c, nodes, policies, Duration::from_secs(240)).await?;
    let mut m = Measured {
        setup_s: started.elapsed().as_secs_f64(),
        ..Default::default()
    };
    eprintln!(
        "scale-bench: demand live {tag}: configured in {:.0} s",
        m.setup_s
    );
    let shared: Shared = Arc::default();
    let watches = [
        watch_nodes(&c, shared.clone()).await,
        watch_pods(&c, shared.clone()),
    ];
    let t0 = Instant::now();
    {
        let mut w = shared.lock().unwrap();
        w.reshapes = 0;
        w.last_change = Some(t0);
    }
    let creator = tokio::spawn(create_pods(
        c.clone(),
        arrivals.to_vec(),
        t0,
        shared.clone(),
    ));
    let end = last_arrival(arrivals) + 300 + settle;
    let outcome = follow(&shared, arrivals.len(), (t0, end), settle).await;
    let late = creator.await??;
    for w in watches {
        w.abort();
    }
    m.took_s = t0.elapsed().as_secs_f64();
    m.late = late;
    collect(&shared.lock().unwrap(), &mut m);
    if let Some(why) = outcome {
        m.notes.push(why);
    }
    drop(children);
    drop(cluster); // kube-local stops, its directory is removed
    Ok(m)
}

fn last_arrival(arrivals: &[Arrival]) -> i64 {
    arrivals.last().map_or(0, |a| a.at)
}

/// The fixture's A100 80GB node, renamed `a100-NNNN` and labelled for its policy.
async fn create_nodes(c: &Client, nodes: &[LiveNode]) -> anyhow::Result<()> {
    let path = testkit::repo_root().join("tests/cluster/fixtures/nodes.yaml");
    let fixtures = std::fs::read_to_string(&path).with_context(|| path.display().to_string())?;
    let template = "a100-node-0";
    let doc = fixtures
        .split("\n---\n")
        .find(|d| d.contains(&format!("name: {template}\n")))
        .context("the A100 fixture node")?;
    for (i, n) in nodes.iter().enumerate() {
        let name = node_name(i);
        let hostname = format!("    kubernetes.io/hostname: {name}\n");
        let yaml = doc.replace(template, &name).replacen(
            &hostname,
            &format!("{hostname}    {}: '{}'\n", n.label.0, n.label.1),
            1,
        );
        testkit::apply_yaml(c, &yaml).await?;
    }
    Ok(())
}

pub(crate) fn node_name(i: usize) -> String {
    format!("a100-{i:04}")
}

/// The node simulator as a child process that exits with us (its stdin is our pipe).
fn start_simulator(
    bin: &Path,
    kubeconfig: &Path,
    mig_delay: i64,
    log: &Path,
) -> anyhow::Result<Child> {
    let log = std::fs::File::create(log)?;
    Command::new(bin)
        .arg("--kubeconfig")
        .arg(kubeconfig)
        .args(["--namespace", crate::NAMESPACE, "--exit-on-stdin-eof"])
        .arg(format!("--mig-delay={mig_delay}s"))
        .stdin(Stdio::piped())
        .stdout(log.try_clone()?)
        .stderr(log)
        .spawn()
        .with_context(|| format!("spawn {}", bin.display()))
}

/// Waits until every node carries its starting layout (MIG manager `success`, the device plugin
/// advertising MIG instances) and every policy is Ready on all its nodes.
async fn wait_configured(
    c: &Client,
    nodes: &[LiveNode],
    policies: &[GpuSharingPolicy],
    timeout: Duration,
) -> anyhow::Result<()> {
    let t = Instant::now();
    let node_api: Api<Node> = Api::all(c.clone());
    let pol: Api<GpuSharingPolicy> = Api::all(c.clone());
    loop {
        let mut ok = true;
        for (i, n) in nodes.iter().enumerate() {
            let node = node_api.get(&node_name(i)).await?;
            ok &= node_configured(&node, n.layout);
        }
        for p in policies {
            let want = nodes.iter().filter(|n| n.layout == layout_of(p)).count() as i32;
            let s = pol.get(&p.name_any()).await?.status;
            let ready = s.as_ref().is_some_and(|s| {
                s.applied_nodes == want
                    && s.conditions
                        .iter()
                        .any(|c| c.type_ == "Ready" && c.status == "True")
            });
            ok &= ready;
        }
        if ok {
            return Ok(());
        }
        if t.elapsed() > timeout {
            bail!(
                "the starting layouts not in place within {} s",
                timeout.as_secs()
            );
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

fn layout_of(p: &GpuSharingPolicy) -> &str {
    p.spec
        .mig
        .as_ref()
        .map_or("", |m| m.layout.as_deref().unwrap_or(""))
}

fn node_configured(n: &Node, layout: &str) -> bool {
    let labels = n.labels();
    let mig_instances = n
        .status
        .as_ref()
        .and_then(|s| s.allocatable.as_ref())
        .is_some_and(|a| {
            PROFILES
                .iter()
                .any(|p| a.get(p.resource).is_some_and(|q| q.0 != "0"))
        });
    labels.get(LABEL_MIG_CONFIG).map(String::as_str) == Some(layout)
        && labels.get(LABEL_MIG_STATE).map(String::as_str) == Some("success")
        && mig_instances
}

/// Records each node's MIG label and state, counting changes of the label; returns once the
/// watch has seen every node.
async fn watch_nodes(c: &Client, shared: Shared) -> tokio::task::JoinHandle<()> {
    let mut events = watcher(Api::<Node>::all(c.clone()), watcher::Config::default()).boxed();
    let (tx, rx) = tokio::sync::oneshot::channel();
    let task = tokio::spawn(async move {
        let mut tx = Some(tx);
        while let Some(ev) = events.next().await {
            match ev {
                Ok(watcher::Event::Apply(n) | watcher::Event::InitApply(n)) => {
                    let l = n.labels();
                    let now = (
                        l.get(LABEL_MIG_CONFIG).cloned(),
                        l.get(LABEL_MIG_STATE).cloned(),
                    );
                    let mut w = shared.lock().unwrap();
                    let before = w.nodes.insert(n.name_any(), now.clone());
                    if let Some(b) = before
                        && b != now
                    {
                        w.reshapes += usize::from(b.0 != now.0);
                        w.last_change = Some(Instant::now());
                    }
                }
                Ok(watcher::Event::InitDone) => {
                    if let Some(tx) = tx.take() {
                        let _ = tx.send(());
                    }
                }
                _ => {}
            }
        }
    });
    let _ = tokio::time::timeout(Duration::from_secs(30), rx).await;
    task
}

/// Records when each trace pod is first seen bound and running, and its `PodScheduled` time.
fn watch_pods(c: &Client, shared: Shared) -> tokio::task::JoinHandle<()> {
    let api: Api<Pod> = Api::namespaced(c.clone(), TRACE_NS);
    let mut events = watcher(api, watcher::Config::default()).boxed();
    tokio::spawn(async move {
        while let Some(ev) = events.next().await {
            if let Ok(watcher::Event::Apply(p) | watcher::Event::InitApply(p)) = ev {
                let now = Instant::now();
                let mut w = shared.lock().unwrap();
                seen_pod(&mut w, &p, now);
            }
        }
    })
}

fn seen_pod(w: &mut Watched, p: &Pod, now: Instant) {
    let node = p.spec.as_ref().and_then(|s| s.node_name.clone());
    let phase = p
        .status
        .as_ref()
        .and_then(|s| s.phase.clone())
        .unwrap_or_default();
    let reshaping = node.as_ref().is_some_and(|n| {
        w.nodes
            .get(n)
            .is_some_and(|(_, state)| state.as_deref() == Some("pending"))
    });
    let mut changed = false;
    let s = w.pods.entry(p.name_any()).or_default();
    if let Some(node) = node
        && s.bound.is_none()
    {
        s.bound = Some((now, node));
        s.on_reshaping = reshaping;
        changed = true;
    }
    if (phase == "Running" || phase == "Succeeded") && s.running.is_none() {
        s.running = Some(now);
    }
    s.done |= phase == "Succeeded" || phase == "Failed";
    if s.condition_wait.is_none() {
        s.condition_wait = scheduled_after_creation(p);
    }
    if changed {
        w.last_change = Some(now);
    }
}

/// The `PodScheduled=True` condition's time less the pod's creation time, in seconds.
fn scheduled_after_creation(p: &Pod) -> Option<f64> {
    let created = p.metadata.creation_timestamp.as_ref()?.0.as_second();
    let cond = p
        .status
        .as_ref()?
        .conditions
        .as_ref()?
        .iter()
        .find(|c| c.type_ == "PodScheduled" && c.status == "True")?;
    Some((cond.last_transition_time.as_ref()?.0.as_second() - created) as f64)
}

/// Creates the trace's pods at `t0` plus their arrival seconds; returns how late the latest
/// creation was, in seconds.
async fn create_pods(
    c: Client,
    arrivals: Vec<Arrival>,
    t0: Instant,
    shared: Shared,
) -> anyhow::Result<f64> {
    let api: Api<Pod> = Api::namespaced(c, TRACE_NS);
    let mut late = 0f64;
    for a in &arrivals {
        let due = t0 + Duration::from_secs(a.at as u64);
        tokio::time::sleep_until(due.into()).await;
        let name = a.id.rsplit('/').next().unwrap_or(&a.id).to_string();
        let pod: Pod = serde_json::from_value(json!({
            "metadata": {"name": name, "annotations": {RUN_SECONDS: a.run.to_string()}},
            "spec": {
                "containers": [{"name": "c", "image": "registry.k8s.io/pause:3.10",
                    "resources": {"limits": {PROFILES[a.profile].resource: "1"}}}],
            },
        }))?;
        let now = Instant::now();
        late = late.max((now - due).as_secs_f64());
        shared.lock().unwrap().pods.entry(name).or_default().created = Some(now);
        api.create(&PostParams::default(), &pod).await?;
    }
    Ok(late)
}

/// Follows the run until every pod is bound, or until every pod was created, none runs and
/// nothing changed for `settle` seconds, or past `end` seconds (then says so).
async fn follow(
    shared: &Shared,
    pods: usize,
    (t0, end): (Instant, i64),
    settle: i64,
) -> Option<String> {
    loop {
        tokio::time::sleep(Duration::from_millis(500)).await;
        let w = shared.lock().unwrap();
        let created = w.pods.values().filter(|s| s.created.is_some()).count();
        let bound = w.pods.values().filter(|s| s.bound.is_some()).count();
        if created == pods && bound == pods {
            return None;
        }
        let running = w.pods.values().any(|s| s.bound.is_some() && !s.done);
        let quiet = w
            .last_change
            .is_some_and(|t| t.elapsed() > Duration::from_secs(settle as u64));
        if created == pods && !running && quiet {
            return None;
        }
        if t0.elapsed() > Duration::from_secs(end as u64) {
            return Some(format!("cut after {end} s: {} of {pods} pods bound", bound));
        }
    }
}

/// The measurements from what the watches saw.
fn collect(w: &Watched, m: &mut Measured) {
    for (name, s) in &w.pods {
        let Some(created) = s.created else { continue };
        match &s.bound {
            Some((at, node)) => {
                let wait = at.saturating_duration_since(created).as_secs_f64();
                m.waits.push(wait);
                m.by_pod.insert(name.clone(), (wait, node.clone()));
                if let Some(r) = s.running {
                    m.run_waits
                        .push(r.saturating_duration_since(created).as_secs_f64());
                }
                if let Some(c) = s.condition_wait {
                    m.condition_waits.push(c);
                }
                m.bound_while_reshaping += usize::from(s.on_reshaping);
            }
            None => m.never_served += 1,
        }
    }
    m.reshapes = w.reshapes;
}
