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
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Client, CustomResourceExt, ResourceExt};
use serde_json::json;
use std::io::{BufRead, BufReader};
use std::process::{Child, Command};

use gpu_sharing_operator::api::crd::GpuSharingPolicy;
use gpu_sharing_operator::api::names::{self, LABEL_DEVICE_PLUGIN_CONFIG, LABEL_POLICY, MANAGER};
use gpu_sharing_operator::plan::{self, NodeFacts, PlanInput};
use gpu_sharing_operator::runtime::controller::cluster_policy_resource;

mod rollout;

const NAMESPACE: &str = "gpu-operator";
const GROUP_LABEL: &str = "bench.gpusharing.io/group";
/// Field manager of the benchmark's own setup writes (never the operator's).
const BENCH_MANAGER: &str = "scale-bench";
const WRITE_VERBS: [&str; 6] = [
    "POST",
    "PUT",
    "PATCH",
    "APPLY",
    "DELETE",
    "DELETECOLLECTION",
];

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
}

// ---------------------------------------------------------------------------------------------
// kube-local

struct Cluster {
    child: Child,
    client: Client,
    dir: PathBuf,
    kubeconfig: PathBuf,
}

impl Cluster {
    /// `start`, tried twice: kube-local's seeding occasionally races the ClusterPolicy CRD's
    /// discovery ("no matches for kind ClusterPolicy") and exits.
    async fn start_retry(bin: &Path, dir: &Path, log: &Path) -> anyhow::Result<Cluster> {
        match Cluster::start(bin, dir, log).await {
            Ok(c) => Ok(c),
            Err(e) => {
                eprintln!("scale-bench: {e:#}; retrying once");
                let _ = std::fs::remove_dir_all(dir);
                Cluster::start(bin, dir, log).await
            }
        }
    }

    async fn start(bin: &Path, dir: &Path, log: &Path) -> anyhow::Result<Cluster> {
        std::fs::create_dir_all(dir)?;
        let log_file = std::fs::File::create(log)?;
        let mut child = Command::new(bin)
            .arg("--dir")
            .arg(dir)
            .arg("--no-nodes")
            .arg(format!("--gpu-operator-namespace={NAMESPACE}"))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::from(log_file))
            .spawn()
            .with_context(|| format!("spawn {}", bin.display()))?;
        let stdout = child.stdout.take().expect("piped");
        let (tx, rx) = std::sync::mpsc::channel::<PathBuf>();
        // Reads READY, then keeps draining stdout.
        std::thread::spawn(move || {
            for l in BufReader::new(stdout).lines() {
                let Ok(l) = l else { break };
                if let Some(p) = l.trim().strip_prefix("READY ") {
                    let _ = tx.send(PathBuf::from(p));
                }
            }
        });
        let kubeconfig =
            match tokio::task::spawn_blocking(move || rx.recv_timeout(Duration::from_secs(180)))
                .await?
            {
                Ok(p) => p,
                Err(_) => {
                    let _ = child.kill();
                    let _ = child.wait();
                    bail!("kube-local not READY (log: {})", log.display());
                }
            };
        let kc = Kubeconfig::read_from(&kubeconfig)?;
        let mut config =
            kube::Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default()).await?;
        config.read_timeout = Some(Duration::from_secs(120));
        let client = Client::try_from(config)?;
        Ok(Cluster {
            child,
            client,
            dir: dir.to_path_buf(),
            kubeconfig,
        })
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    async fn stop(mut self) {
        drop(self.child.stdin.take()); // EOF: kube-local shuts down
        let t = Instant::now();
        while matches!(self.child.try_wait(), Ok(None)) {
            if t.elapsed() > Duration::from_secs(20) {
                let _ = self.child.kill();
                let _ = self.child.wait();
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

// ---------------------------------------------------------------------------------------------
// metrics

/// (group, resource, subresource, verb, code) -> count, write verbs only.
type Counts = BTreeMap<(String, String, String, String, String), f64>;

async fn scrape(client: &Client) -> anyhow::Result<Counts> {
    let req = kube::core::Request::new("").get("metrics", &GetParams::default())?;
    let text = client.request_text(req).await?;
    let mut out = Counts::new();
    for line in text.lines() {
        let Some(rest) = line.strip_prefix("apiserver_request_total{") else {
            continue;
        };
        let Some((labels, value)) = rest.rsplit_once("} ") else {
            continue;
        };
        let mut m: BTreeMap<&str, &str> = BTreeMap::new();
        for kv in labels.split("\",") {
            if let Some((k, v)) = kv.split_once("=\"") {
                m.insert(k, v.trim_end_matches('"'));
            }
        }
        let verb = m.get("verb").copied().unwrap_or("");
        if !WRITE_VERBS.contains(&verb) {
            continue;
        }
        let key = (
            m.get("group").copied().unwrap_or("").to_string(),
            m.get("resource").copied().unwrap_or("").to_string(),
            m.get("subresource").copied().unwrap_or("").to_string(),
            verb.to_string(),
            m.get("code").copied().unwrap_or("").to_string(),
        );
        *out.entry(key).or_default() += value.trim().parse::<f64>().unwrap_or(0.0);
    }
    Ok(out)
}

fn diff(after: &Counts, before: &Counts) -> Counts {
    let mut d = Counts::new();
    for (k, v) in after {
        let x = v - before.get(k).copied().unwrap_or(0.0);
        if x > 0.5 {
            d.insert(k.clone(), x);
        }
    }
    d
}

/// Writes of one phase, by what the operator writes.
#[derive(Debug, Default, Clone)]
struct Writes {
    nodes: i64,
    configmaps: i64,
    cluster_policy: i64,
    status: i64,
    /// Writes to the policy object itself (finalizers), the benchmark's own removed.
    policy_meta: i64,
    events: i64,
    /// Anything else (e.g. the apiserver's own leases): not the operator's.
    other: i64,
    /// Non-2xx responses among the operator's writes.
    failed: i64,
    detail: Vec<String>,
}

impl Writes {
    fn from(d: &Counts, bench_policy_writes: i64) -> Writes {
        let mut w = Writes::default();
        for ((group, resource, sub, verb, code), v) in d {
            let v = v.round() as i64;
            let ours = match (group.as_str(), resource.as_str(), sub.as_str()) {
                ("", "nodes", "") => {
                    w.nodes += v;
                    true
                }
                ("", "configmaps", "") => {
                    w.configmaps += v;
                    true
                }
                ("nvidia.com", "clusterpolicies", _) => {
                    w.cluster_policy += v;
                    true
                }
                ("gpusharing.io", "gpusharingpolicies", "status") => {
                    w.status += v;
                    true
                }
                ("gpusharing.io", "gpusharingpolicies", "") => {
                    w.policy_meta += v;
                    true
                }
                ("events.k8s.io", "events", _) | ("", "events", _) => {
                    w.events += v;
                    true
                }
                _ => {
                    w.other += v;
                    false
                }
            };
            if ours && !code.starts_with('2') {
                w.failed += v;
            }
            let g = if group.is_empty() { "core" } else { group };
            let s = if sub.is_empty() {
                String::new()
            } else {
                format!("/{sub}")
            };
            w.detail
                .push(format!("{g}/{resource}{s} {verb} {code}: {v}"));
        }
        w.policy_meta -= bench_policy_writes;
        w
    }

    /// Writes the operator issued, events and finalizers not included.
    fn core(&self) -> i64 {
        self.nodes + self.configmaps + self.cluster_policy + self.status
    }

    fn add(&self, o: &Writes) -> Writes {
        Writes {
            nodes: self.nodes + o.nodes,
            configmaps: self.configmaps + o.configmaps,
            cluster_policy: self.cluster_policy + o.cluster_policy,
            status: self.status + o.status,
            policy_meta: self.policy_meta + o.policy_meta,
            events: self.events + o.events,
            other: self.other + o.other,
            failed: self.failed + o.failed,
            detail: self.detail.iter().chain(&o.detail).cloned().collect(),
        }
    }

    fn breakdown(&self) -> String {
        format!(
            "labels {} + ConfigMap {} + ClusterPolicy {} + status {}",
            self.nodes, self.configmaps, self.cluster_policy, self.status
        )
    }
}

// ---------------------------------------------------------------------------------------------
// process accounting

#[derive(Debug, Default, Clone, Copy)]
struct ProcStats {
    hwm_kib: u64,
    rss_kib: u64,
    cpu_s: f64,
}

fn proc_stats(pid: u32) -> ProcStats {
    let mut s = ProcStats::default();
    if let Ok(t) = std::fs::read_to_string(format!("/proc/{pid}/status")) {
        for l in t.lines() {
            let num = |l: &str| {
                l.split_whitespace()
                    .nth(1)
                    .and_then(|x| x.parse().ok())
                    .unwrap_or(0)
            };
            if l.starts_with("VmHWM:") {
                s.hwm_kib = num(l);
            } else if l.starts_with("VmRSS:") {
                s.rss_kib = num(l);
            }
        }
    }
    if let Ok(t) = std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // Fields after the command (which may contain spaces) start at field 3.
        if let Some((_, rest)) = t.rsplit_once(") ") {
            let f: Vec<&str> = rest.split_whitespace().collect();
            let utime: f64 = f.get(11).and_then(|x| x.parse().ok()).unwrap_or(0.0);
            let stime: f64 = f.get(12).and_then(|x| x.parse().ok()).unwrap_or(0.0);
            s.cpu_s = (utime + stime) / clk_tck();
        }
    }
    s
}

fn clk_tck() -> f64 {
    std::process::Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|o| String::from_utf8_lossy(&o.stdout).trim().parse().ok())
        .unwrap_or(100.0)
}

// ---------------------------------------------------------------------------------------------
// setup

async fn install_crd(client: &Client) -> anyhow::Result<()> {
    let crd = GpuSharingPolicy::crd();
    let name = crd.name_any();
    let api: Api<CustomResourceDefinition> = Api::all(client.clone());
    api.patch(
        &name,
        &PatchParams::apply(BENCH_MANAGER).force(),
        &Patch::Apply(&crd),
    )
    .await?;
    let start = Instant::now();
    loop {
        let c = api.get(&name).await?;
        let established = c
            .status
            .as_ref()
            .and_then(|s| s.conditions.as_ref())
            .is_some_and(|cs| {
                cs.iter()
                    .any(|c| c.type_ == "Established" && c.status == "True")
            });
        if established {
            break;
        }
        if start.elapsed() > Duration::from_secs(60) {
            bail!("CRD not established");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // The API is served shortly after Established; wait until a list works.
    let pol: Api<GpuSharingPolicy> = Api::all(client.clone());
    while pol.list(&ListParams::default()).await.is_err() {
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    Ok(())
}

fn node_name(i: usize) -> String {
    format!("gpu-node-{i:05}")
}

fn group_of(i: usize, p: usize) -> usize {
    i % p
}

fn policy_name(g: usize) -> String {
    format!("bench-{g:03}")
}

/// The labels of a GPU node as a real cluster has them: the kubelet's and the cloud provider's,
/// Node Feature Discovery's, GPU Feature Discovery's and the GPU Operator's (56, some unique to
/// the node such as its hostname), plus the benchmark's group. GFD's labels that follow the
/// sharing config (`gpu.replicas`, `gpu.sharing-strategy`, `mps.capable`, `-SHARED` products)
/// are left out: no GFD runs here to update them. For the same reason the nodes look like GFD
/// run with `--no-timestamp` (no `nvidia.com/gfd.timestamp`): with a timestamp the operator
/// waits for GFD to relabel after each config change, which nothing here would do.
fn node_labels(i: usize, p: usize) -> BTreeMap<String, String> {
    let name = node_name(i);
    let zone = format!("us-east-1{}", ["a", "b", "c"][i % 3]);
    let mut l: BTreeMap<String, String> = [
        ("kubernetes.io/hostname", name.as_str()),
        ("kubernetes.io/os", "linux"),
        ("kubernetes.io/arch", "amd64"),
        ("beta.kubernetes.io/os", "linux"),
        ("beta.kubernetes.io/arch", "amd64"),
        ("beta.kubernetes.io/instance-type", "g6.12xlarge"),
        ("node.kubernetes.io/instance-type", "g6.12xlarge"),
        ("topology.kubernetes.io/region", "us-east-1"),
        ("topology.kubernetes.io/zone", zone.as_str()),
        ("failure-domain.beta.kubernetes.io/region", "us-east-1"),
        ("failure-domain.beta.kubernetes.io/zone", zone.as_str()),
        ("node-role.kubernetes.io/gpu", ""),
        ("feature.node.kubernetes.io/cpu-cpuid.AVX", "true"),
        ("feature.node.kubernetes.io/cpu-cpuid.AVX2", "true"),
        ("feature.node.kubernetes.io/cpu-cpuid.AVX512F", "true"),
        ("feature.node.kubernetes.io/cpu-cpuid.AVX512BW", "true"),
        ("feature.node.kubernetes.io/cpu-cpuid.AVX512VNNI", "true"),
        ("feature.node.kubernetes.io/cpu-cpuid.FMA3", "true"),
        ("feature.node.kubernetes.io/cpu-cpuid.SHA", "true"),
        ("feature.node.kubernetes.io/cpu-cpuid.VAES", "true"),
        (
            "feature.node.kubernetes.io/cpu-hardware_multithreading",
            "true",
        ),
        ("feature.node.kubernetes.io/cpu-model.family", "25"),
        ("feature.node.kubernetes.io/cpu-model.id", "1"),
        ("feature.node.kubernetes.io/cpu-model.vendor_id", "AMD"),
        (
            "feature.node.kubernetes.io/kernel-version.full",
            "6.1.0-28-cloud-amd64",
        ),
        ("feature.node.kubernetes.io/kernel-version.major", "6"),
        ("feature.node.kubernetes.io/kernel-version.minor", "1"),
        ("feature.node.kubernetes.io/kernel-version.revision", "0"),
        ("feature.node.kubernetes.io/pci-10de.present", "true"),
        ("feature.node.kubernetes.io/pci-1d0f.present", "true"),
        ("feature.node.kubernetes.io/system-os_release.ID", "debian"),
        (
            "feature.node.kubernetes.io/system-os_release.VERSION_ID",
            "12",
        ),
        (
            "feature.node.kubernetes.io/storage-nonrotationaldisk",
            "true",
        ),
        ("nvidia.com/cuda.driver-version.full", "570.172.08"),
        ("nvidia.com/cuda.driver.major", "570"),
        ("nvidia.com/cuda.driver.minor", "172"),
        ("nvidia.com/cuda.driver.rev", "08"),
        ("nvidia.com/cuda.runtime.major", "12"),
        ("nvidia.com/cuda.runtime.minor", "8"),
        ("nvidia.com/gpu.compute.major", "8"),
        ("nvidia.com/gpu.compute.minor", "9"),
        ("nvidia.com/gpu.count", "4"),
        ("nvidia.com/gpu.family", "ada-lovelace"),
        ("nvidia.com/gpu.machine", "g6.12xlarge"),
        ("nvidia.com/gpu.memory", "23034"),
        ("nvidia.com/gpu.mode", "compute"),
        ("nvidia.com/gpu.present", "true"),
        ("nvidia.com/gpu.product", "NVIDIA-L4"),
        ("nvidia.com/mig.capable", "false"),
        ("nvidia.com/gpu.deploy.container-toolkit", "true"),
        ("nvidia.com/gpu.deploy.dcgm", "true"),
        ("nvidia.com/gpu.deploy.dcgm-exporter", "true"),
        ("nvidia.com/gpu.deploy.device-plugin", "true"),
        ("nvidia.com/gpu.deploy.driver", "true"),
        ("nvidia.com/gpu.deploy.gpu-feature-discovery", "true"),
        ("nvidia.com/gpu.deploy.operator-validator", "true"),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v.to_string()))
    .collect();
    l.insert(GROUP_LABEL.into(), format!("g{}", group_of(i, p)));
    l
}

async fn create_nodes(client: &Client, n: usize, p: usize, conc: usize) -> anyhow::Result<()> {
    create_nodes_with(client, n, p, conc, &BTreeMap::new()).await
}

/// [`create_nodes`] with extra labels on every node.
async fn create_nodes_with(
    client: &Client,
    n: usize,
    p: usize,
    conc: usize,
    extra: &BTreeMap<String, String>,
) -> anyhow::Result<()> {
    let api: Api<Node> = Api::all(client.clone());
    stream::iter(0..n)
        .map(|i| {
            let api = api.clone();
            async move {
                let name = node_name(i);
                let mut labels = node_labels(i, p);
                labels.extend(extra.clone());
                let node: Node = serde_json::from_value(json!({
                    "apiVersion": "v1",
                    "kind": "Node",
                    "metadata": {"name": name, "labels": labels},
                    "spec": {}
                }))?;
                api.create(&PostParams::default(), &node).await?;
                Ok::<_, anyhow::Error>(())
            }
        })
        .buffer_unordered(conc)
        .try_collect::<Vec<_>>()
        .await?;
    Ok(())
}

fn policy_object(g: usize, replicas: i32) -> GpuSharingPolicy {
    let sharing = if g.is_multiple_of(2) {
        json!({"strategy": "timeSlicing", "timeSlicing": {"replicas": replicas}})
    } else {
        json!({"strategy": "mps", "mps": {"replicas": replicas}})
    };
    // maxUnavailable 100%: every node in one wave, as the minimal-write baseline writes them
    // (the rollout benchmark sets its own budget).
    let mut spec = json!({
        "nodeSelector": {"matchLabels": {GROUP_LABEL: format!("g{g}")}},
        "rollout": {"maxUnavailable": "100%"},
    });
    spec.as_object_mut()
        .unwrap()
        .extend(sharing.as_object().unwrap().clone());
    serde_json::from_value(json!({
        "apiVersion": "gpusharing.io/v1alpha1",
        "kind": "GpuSharingPolicy",
        "metadata": {"name": policy_name(g)},
        "spec": spec,
    }))
    .expect("valid policy")
}

async fn create_policies(client: &Client, p: usize, conc: usize) -> anyhow::Result<()> {
    let api: Api<GpuSharingPolicy> = Api::all(client.clone());
    stream::iter(0..p)
        .map(|g| {
            let api = api.clone();
            async move {
                api.create(&PostParams::default(), &policy_object(g, 4))
                    .await?;
                Ok::<_, anyhow::Error>(())
            }
        })
        .buffer_unordered(conc)
        .try_collect::<Vec<_>>()
        .await?;
    Ok(())
}

fn nodes_per_group(n: usize, p: usize) -> Vec<i32> {
    let mut v = vec![0i32; p];
    for i in 0..n {
        v[group_of(i, p)] += 1;
    }
    v
}

// ---------------------------------------------------------------------------------------------
// convergence

/// Polls until every policy in `which` is Ready with all its nodes applied (and, for `edited`,
/// observed the new generation with a new key), then checks the node labels themselves.
/// Returns the elapsed time since `start`, or None on timeout.
async fn wait_converged(
    client: &Client,
    per_group: &[i32],
    old_keys: &BTreeMap<String, String>,
    start: Instant,
    timeout: Duration,
) -> anyhow::Result<Option<Duration>> {
    let pol: Api<GpuSharingPolicy> = Api::all(client.clone());
    let nodes: Api<Node> = Api::all(client.clone());
    let p = per_group.len();
    loop {
        if start.elapsed() > timeout {
            return Ok(None);
        }
        let list = pol.list(&ListParams::default()).await?;
        let mut keys: BTreeMap<String, String> = BTreeMap::new();
        let mut ok = list.items.len() == p;
        for item in &list.items {
            let name = item.name_any();
            let g: usize = name
                .trim_start_matches("bench-")
                .parse()
                .unwrap_or(usize::MAX);
            let Some(s) = &item.status else {
                ok = false;
                break;
            };
            let ready = s
                .conditions
                .iter()
                .any(|c| c.type_ == "Ready" && c.status == "True");
            let gen_ok = s.observed_generation == item.metadata.generation;
            let want = per_group.get(g).copied().unwrap_or(-1);
            let key = s.device_config_key.clone().unwrap_or_default();
            let key_new = old_keys.get(&name).is_none_or(|k| *k != key);
            if !(ready && gen_ok && key_new && s.applied_nodes == want && s.matched_nodes == want)
                || key.is_empty()
            {
                ok = false;
                break;
            }
            keys.insert(name, key);
        }
        if ok {
            let elapsed = start.elapsed();
            // Verify the labels on the nodes themselves.
            let meta = nodes.list_metadata(&ListParams::default()).await?;
            let bad = meta
                .items
                .iter()
                .filter(|n: &&PartialObjectMeta<Node>| {
                    let l = n.labels();
                    let Some(g) = l.get(GROUP_LABEL) else {
                        return false;
                    };
                    let pname = policy_name(g.trim_start_matches('g').parse().unwrap_or(0));
                    l.get(LABEL_POLICY) != Some(&pname)
                        || l.get(LABEL_DEVICE_PLUGIN_CONFIG) != keys.get(&pname)
                })
                .count();
            if bad == 0 {
                return Ok(Some(elapsed));
            }
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Waits until the operator's writes stop (no change of the write counters for `quiet`).
async fn wait_quiet(client: &Client, quiet: Duration, max: Duration) -> anyhow::Result<Counts> {
    let start = Instant::now();
    let mut last = scrape(client).await?;
    let mut since = Instant::now();
    loop {
        tokio::time::sleep(Duration::from_millis(500)).await;
        let now = scrape(client).await?;
        let relevant = |c: &Counts| -> f64 {
            c.iter()
                .filter(|(k, _)| k.0 != "coordination.k8s.io")
                .map(|(_, v)| v)
                .sum()
        };
        if relevant(&now) != relevant(&last) {
            since = Instant::now();
            last = now;
        } else if since.elapsed() >= quiet || start.elapsed() >= max {
            return Ok(now);
        }
    }
}

/// Waits until kube-local (apiserver, etcd, its garbage collector digesting the new nodes) is
/// idle: under 10% of a core for two consecutive seconds, at most `max`.
async fn wait_idle(pid: u32, max: Duration) {
    let start = Instant::now();
    let mut calm = 0;
    let mut last = proc_stats(pid).cpu_s;
    while start.elapsed() < max && calm < 2 {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let now = proc_stats(pid).cpu_s;
        calm = if now - last < 0.1 { calm + 1 } else { 0 };
        last = now;
    }
}

// ---------------------------------------------------------------------------------------------
// the two sides

struct BaselineResult {
    time: Duration,
    writes: i64,
}

async fn run_baseline(
    args: &Args,
    kl: &Path,
    n: usize,
    p: usize,
) -> anyhow::Result<BaselineResult> {
    let dir = args.out.join(format!("run/{n}x{p}-baseline"));
    let cluster = Cluster::start_retry(
        kl,
        &dir,
        &args
            .out
            .join(format!("logs/{n}x{p}-baseline-kube-local.log")),
    )
    .await?;
    let client = cluster.client.clone();
    let res = async {
        install_crd(&client).await?;
        create_nodes(&client, n, p, args.concurrency).await?;
        create_policies(&client, p, args.concurrency).await?;
        // Plan with the same planner the operator uses, outside the timed part.
        let pol: Api<GpuSharingPolicy> = Api::all(client.clone());
        let policies = pol.list(&ListParams::default()).await?.items;
        let nodes_api: Api<Node> = Api::all(client.clone());
        let mut facts: Vec<NodeFacts> = nodes_api
            .list_metadata(&ListParams::default())
            .await?
            .items
            .into_iter()
            .map(|n| NodeFacts {
                name: n.name_any(),
                labels: n.labels().clone().into(),
                ..Default::default()
            })
            .collect();
        facts.sort_by(|a, b| a.name.cmp(&b.name));
        let mut first_input = PlanInput::new(policies.clone(), facts.clone());
        first_input.now = k8s_openapi::jiff::Timestamp::now().as_second();
        let first = plan::plan(&first_input);
        // Statuses as they are once the labels are in place.
        for f in &mut facts {
            if let Some(want) = first.node_labels.get(&f.name) {
                f.labels.extend(want.clone());
                f.owned = want.keys().cloned().collect();
            }
        }
        let mut input = PlanInput::new(policies.clone(), facts);
        input.current_device_config = first.device_config.clone();
        let done = plan::plan(&input);
        // The same node metadata the operator writes: our labels and annotations.
        let label_patches: Vec<(String, serde_json::Value)> = first
            .node_labels
            .iter()
            .filter(|(_, l)| !l.is_empty())
            .map(|(k, v)| {
                let a = first.node_annotations.get(k).cloned().unwrap_or_default();
                (k.clone(), json!({"labels": v, "annotations": a}))
            })
            .collect();
        let now = k8s_openapi::jiff::Timestamp::now().to_string();
        let statuses: Vec<(String, serde_json::Value)> = done
            .statuses
            .iter()
            .map(|(name, s)| {
                let mut v = serde_json::to_value(s).unwrap();
                if let Some(cs) = v.get_mut("conditions").and_then(|c| c.as_array_mut()) {
                    for c in cs {
                        c["lastTransitionTime"] = json!(now);
                    }
                }
                (name.clone(), v)
            })
            .collect();
        let cm = plan::configmap(names::DEVICE_PLUGIN_CONFIGMAP, NAMESPACE, "device-plugin", &first.device_config);
        let cp_obj = json!({
            "apiVersion": "nvidia.com/v1",
            "kind": "ClusterPolicy",
            "metadata": {"name": "cluster-policy"},
            "spec": first.cluster_policy_spec,
        });

        wait_idle(cluster.pid(), Duration::from_secs(60)).await;
        let before = scrape(&client).await?;
        let pp = PatchParams::apply(MANAGER).force();
        let start = Instant::now();
        let cms: Api<ConfigMap> = Api::namespaced(client.clone(), NAMESPACE);
        cms.patch(names::DEVICE_PLUGIN_CONFIGMAP, &pp, &Patch::Apply(&cm)).await?;
        let cps: Api<DynamicObject> = Api::all_with(client.clone(), &cluster_policy_resource());
        cps.patch("cluster-policy", &pp, &Patch::Apply(&cp_obj)).await?;
        stream::iter(label_patches)
            .map(|(name, labels)| {
                let api = nodes_api.clone();
                let pp = pp.clone();
                async move {
                    let mut meta = labels;
                    meta["name"] = json!(name);
                    let obj = json!({"apiVersion": "v1", "kind": "Node", "metadata": meta});
                    api.patch(&name, &pp, &Patch::Apply(&obj)).await?;
                    Ok::<_, anyhow::Error>(())
                }
            })
            .buffer_unordered(args.concurrency)
            .try_collect::<Vec<_>>()
            .await?;
        stream::iter(statuses)
            .map(|(name, status)| {
                let api = pol.clone();
                let pp = pp.clone();
                async move {
                    let obj = json!({"apiVersion": "gpusharing.io/v1alpha1", "kind": "GpuSharingPolicy", "status": status});
                    api.patch_status(&name, &pp, &Patch::Apply(&obj)).await?;
                    Ok::<_, anyhow::Error>(())
                }
            })
            .buffer_unordered(args.concurrency)
            .try_collect::<Vec<_>>()
            .await?;
        let time = start.elapsed();
        let after = scrape(&client).await?;
        let w = Writes::from(&diff(&after, &before), 0);
        Ok::<_, anyhow::Error>(BaselineResult { time, writes: w.core() })
    }
    .await;
    cluster.stop().await;
    res
}

#[derive(Default)]
struct OperatorResult {
    apply_time: Option<Duration>,
    edit_time: Option<Duration>,
    startup: Writes,
    apply: Writes,
    edit: Writes,
    steady: Writes,
    apply_min: i64,
    edit_min: i64,
    stats: ProcStats,
    /// After the caches synced, before any policy.
    stats_synced: ProcStats,
    cpu_apply: f64,
    cpu_edit: f64,
    apiserver_cpu_apply: f64,
    apiserver_cpu_edit: f64,
    /// The edit, seen on the edited policy's nodes: when the first and the last of them got the
    /// new config label (from the edit), and how many did.
    edit_first_write: Option<Duration>,
    edit_last_write: Option<Duration>,
    edit_nodes_written: usize,
    /// The operator's passes during the edit (its `gpu_sharing_reconciles_total`).
    edit_passes: Option<u64>,
    notes: Vec<String>,
}

/// The operator's passes so far, from its metrics endpoint (`gpu_sharing_reconciles_total`).
async fn operator_passes(port: u16) -> Option<u64> {
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
    body.lines()
        .find_map(|l| l.strip_prefix("gpu_sharing_reconciles_total "))
        .and_then(|v| v.trim().parse::<f64>().ok())
        .map(|v| v as u64)
}

/// Records, for the nodes of `group`, when each first carries a device-plugin config other than
/// `old_key` (elapsed since `start`). Ends when dropped (abort the task).
fn watch_relabels(
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
async fn start_operator(
    op: &Path,
    kubeconfig: &Path,
    log: &Path,
    metrics_port: u16,
) -> anyhow::Result<Child> {
    let mut c = Command::new(op)
        .args(["run", "--namespace", NAMESPACE])
        .arg(format!("--metrics-addr=127.0.0.1:{metrics_port}"))
        // Scraped over plain HTTP (operator_passes); no health endpoint.
        .args(["--metrics-insecure", "--health-addr="])
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

async fn run_operator(
    args: &Args,
    kl: &Path,
    op: &Path,
    n: usize,
    p: usize,
) -> anyhow::Result<OperatorResult> {
    let dir = args.out.join(format!("run/{n}x{p}-operator"));
    let cluster = Cluster::start_retry(
        kl,
        &dir,
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

        // Edit one policy's replicas.
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
            &Patch::Merge(json!({"spec": {"timeSlicing": {"replicas": 8}}})),
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
    cluster.stop().await;
    res
}

// ---------------------------------------------------------------------------------------------
// report

struct Row {
    n: usize,
    p: usize,
    baseline: Option<BaselineResult>,
    op: Result<OperatorResult, String>,
    baseline_err: Option<String>,
}

fn secs(d: Option<Duration>) -> String {
    d.map(|d| format!("{:.2}", d.as_secs_f64()))
        .unwrap_or_else(|| "timeout".into())
}

fn render_table(rows: &[Row], steady_secs: u64) -> String {
    let mut s = String::new();
    s.push_str(&format!(
        "| N | P | baseline s | operator s | ratio | edit re-converge s | writes apply (operator / min) | writes edit (operator / min) | events (apply+edit) | finalizer patches | steady writes ({steady_secs} s) | peak RSS MiB | CPU s |\n"
    ));
    s.push_str("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
    for r in rows {
        let base = r
            .baseline
            .as_ref()
            .map(|b| format!("{:.2}", b.time.as_secs_f64()));
        match &r.op {
            Ok(o) => {
                let apply = o.startup.add(&o.apply);
                let ratio = match (&r.baseline, o.apply_time) {
                    (Some(b), Some(t)) => format!("{:.2}", t.as_secs_f64() / b.time.as_secs_f64()),
                    _ => "-".into(),
                };
                let steady = o.steady.core() + o.steady.events + o.steady.policy_meta;
                s.push_str(&format!(
                    "| {} | {} | {} | {} | {} | {} | {} / {} | {} / {} | {} | {} | {} | {:.1} | {:.1} |\n",
                    r.n,
                    r.p,
                    base.unwrap_or_else(|| "-".into()),
                    secs(o.apply_time),
                    ratio,
                    secs(o.edit_time),
                    apply.core(),
                    o.apply_min,
                    o.edit.core(),
                    o.edit_min,
                    apply.events + o.edit.events,
                    apply.policy_meta + o.edit.policy_meta,
                    steady,
                    o.stats.hwm_kib as f64 / 1024.0,
                    o.stats.cpu_s,
                ));
            }
            Err(e) => s.push_str(&format!(
                "| {} | {} | {} | error: {} | | | | | | | | | |\n",
                r.n,
                r.p,
                base.unwrap_or_else(|| "-".into()),
                e.replace('|', "/").lines().next().unwrap_or("")
            )),
        }
    }
    s
}

/// The cost of one policy edit next to the cluster's size, and the API server's CPU next to
/// the operator's.
fn render_edit_table(rows: &[Row]) -> String {
    let mut s = String::from(
        "\n| N | P | edit: nodes relabelled | first label write s | last label write s | operator passes | operator CPU s (per pass ms) | kube-local CPU s (apply / edit) | operator CPU s (apply) |\n|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    for r in rows {
        let Ok(o) = &r.op else { continue };
        let per_pass = o.edit_passes.filter(|p| *p > 0).map_or("-".into(), |p| {
            format!("{:.0}", o.cpu_edit * 1000.0 / p as f64)
        });
        s.push_str(&format!(
            "| {} | {} | {} | {} | {} | {} | {:.2} ({per_pass}) | {:.1} / {:.1} | {:.1} |\n",
            r.n,
            r.p,
            o.edit_nodes_written,
            secs(o.edit_first_write),
            secs(o.edit_last_write),
            o.edit_passes.map_or("?".into(), |p| p.to_string()),
            o.cpu_edit,
            o.apiserver_cpu_apply,
            o.apiserver_cpu_edit,
            o.cpu_apply,
        ));
    }
    s
}

fn render_details(rows: &[Row]) -> String {
    let mut s = String::from("\n### Details\n");
    for r in rows {
        s.push_str(&format!("\n**{} nodes x {} policies**\n\n", r.n, r.p));
        if let Some(b) = &r.baseline {
            s.push_str(&format!(
                "- baseline: {:.2} s, {} writes\n",
                b.time.as_secs_f64(),
                b.writes
            ));
        }
        if let Some(e) = &r.baseline_err {
            s.push_str(&format!("- baseline error: {e}\n"));
        }
        let Ok(o) = &r.op else { continue };
        for (name, w) in [
            ("startup (no policies)", &o.startup),
            ("apply", &o.apply),
            ("edit", &o.edit),
            ("steady", &o.steady),
        ] {
            s.push_str(&format!(
                "- {name}: {} ; events {}, policy patches (finalizer) {}, failed (non-2xx) {}, not the operator's {}\n",
                w.breakdown(),
                w.events,
                w.policy_meta,
                w.failed,
                w.other
            ));
            if !w.detail.is_empty() {
                s.push_str(&format!("  - raw: {}\n", w.detail.join("; ")));
            }
        }
        s.push_str(&format!(
            "- operator CPU: apply {:.2} s, edit {:.2} s, total {:.2} s; kube-local (apiserver+etcd) CPU during apply {:.2} s; peak RSS {:.1} MiB, final RSS {:.1} MiB\n",
            o.cpu_apply,
            o.cpu_edit,
            o.stats.cpu_s,
            o.apiserver_cpu_apply,
            o.stats.hwm_kib as f64 / 1024.0,
            o.stats.rss_kib as f64 / 1024.0
        ));
        s.push_str(&format!(
            "- edit of one policy ({} of its nodes relabelled): first label write {} s, last {} s after the edit; {} operator passes, operator CPU {:.2} s ({}), kube-local CPU {:.2} s\n",
            o.edit_nodes_written,
            secs(o.edit_first_write),
            secs(o.edit_last_write),
            o.edit_passes.map_or("?".into(), |p| p.to_string()),
            o.cpu_edit,
            o.edit_passes
                .filter(|p| *p > 0)
                .map_or("-".into(), |p| format!("{:.0} ms per pass", o.cpu_edit * 1000.0 / p as f64)),
            o.apiserver_cpu_edit
        ));
        s.push_str(&format!(
            "- operator memory after the caches synced (nodes, no policy yet): RSS {:.1} MiB, peak {:.1} MiB\n",
            o.stats_synced.rss_kib as f64 / 1024.0,
            o.stats_synced.hwm_kib as f64 / 1024.0
        ));
        for n in &o.notes {
            s.push_str(&format!("- note: {n}\n"));
        }
    }
    s
}

fn machine() -> String {
    let cores = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(0);
    let mem = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| {
            m.lines()
                .find(|l| l.starts_with("MemTotal:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
        })
        .map(|k| format!("{:.0} GiB", k as f64 / 1024.0 / 1024.0))
        .unwrap_or_default();
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|c| {
            c.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split_once(':').map(|x| x.1.trim().to_string()))
        })
        .unwrap_or_default();
    format!("{cores} cores ({cpu}), {mem} RAM")
}

fn write_results(args: &Args, rows: &[Row]) -> anyhow::Result<String> {
    let mut md = format!(
        "## Scale benchmark\n\nMachine: {}. kube-apiserver v1.35.4 + etcd (kube-local) on the same machine. \
         Times in seconds from creating the policies (operator) or from the first write (baseline) \
         until every node is labelled and every policy Ready. Writes exclude events and finalizer \
         patches (shown separately); minimum = 1 ConfigMap + 1 ClusterPolicy + 1 label patch per node \
         + 1 status per policy (apply), 2 ConfigMap (new key in, old key out) + 1 label patch per node \
         of the edited policy + 1 status (edit).\n\n",
        machine()
    );
    md.push_str(&render_table(rows, args.steady_secs));
    md.push_str(&render_edit_table(rows));
    md.push_str(&render_details(rows));
    std::fs::create_dir_all(&args.out)?;
    std::fs::write(args.out.join("results.md"), &md)?;
    Ok(md)
}

// ---------------------------------------------------------------------------------------------

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

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let kl = kube_local_bin(&args)?;
    let op = operator_bin(&args)?;
    std::fs::create_dir_all(args.out.join("logs"))?;
    if let Some(n) = args.rollout {
        let md = rollout::run(&args, &kl, &op, n).await?;
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
