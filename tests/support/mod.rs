//! Helpers shared by the end-to-end tests: the operator in-process, the node simulator, and
//! small queries. Each test gets its own control plane (testkit) and they run one at a time.
#![allow(dead_code)]

pub mod allowed;
#[allow(unused_imports)] // not every test binary scrapes
pub use testkit::https;
pub mod image;
pub mod invariants;
pub mod ownership;
pub mod podrunner;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use gpu_sharing_operator::api::crd::GpuSharingPolicy;
use gpu_sharing_operator::runtime::controller;
use k8s_openapi::api::core::v1::{ConfigMap, Node};
use kube::api::{Api, DynamicObject};
use kube::{Client, CustomResourceExt, ResourceExt};
use serde_json::json;
use testkit::{self, TestCluster};
use tokio::sync::oneshot;

pub static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

pub const NS: &str = "gpu-operator";
pub const DP_CM: &str = "gpu-sharing-device-plugin-config";

/// The operator, running in this process against the test cluster.
pub struct Operator {
    stop: Option<oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<()>,
    metrics: Arc<gpu_sharing_operator::telemetry::metrics::Metrics>,
}

impl Operator {
    pub fn start(client: Client, namespace: Option<&str>) -> Operator {
        Operator::start_with(
            client,
            controller::Config {
                namespace: namespace.map(String::from),
                resync: Duration::from_secs(30),
                ..Default::default()
            },
        )
    }

    pub fn start_with(client: Client, config: controller::Config) -> Operator {
        let metrics = config.metrics.clone();
        let (tx, rx) = oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            controller::run(client, config, async {
                rx.await.ok();
            })
            .await
            .expect("controller runs");
        });
        Operator {
            stop: Some(tx),
            task,
            metrics,
        }
    }

    /// Its passes so far (`gpu_sharing_reconciles_total`).
    pub fn passes(&self) -> u64 {
        passes_in(&self.metrics.render()).unwrap_or(0)
    }

    pub async fn stop(mut self) {
        if let Some(s) = self.stop.take() {
            s.send(()).ok();
        }
        let _ = tokio::time::timeout(Duration::from_secs(10), &mut self.task).await;
    }
}

impl Drop for Operator {
    fn drop(&mut self) {
        self.task.abort();
    }
}

pub async fn install_crd(client: &Client) {
    let crd_yaml = serde_saphyr::to_string(&GpuSharingPolicy::crd()).unwrap();
    testkit::apply_yaml(client, &crd_yaml)
        .await
        .expect("CRD applies");
    testkit::wait_crd_established(
        client,
        "gpusharingpolicies.gpusharing.io",
        Duration::from_secs(30),
    )
    .await
    .expect("CRD established");
}

/// The test-only simulator of NVIDIA's node components (tests/nvidia), as a child process that
/// exits with us (its stdin is our pipe).
pub struct Simulator(pub std::process::Child);

impl Drop for Simulator {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

pub fn start_simulator(cluster: &TestCluster) -> Simulator {
    start_simulator_with(cluster, &[])
}

/// [`start_simulator`] with extra flags (e.g. `--instance-types FILE`).
pub fn start_simulator_with(cluster: &TestCluster, extra: &[String]) -> Simulator {
    let root = testkit::repo_root();
    let out = std::process::Command::new("bash")
        .arg(root.join("tests/nvidia/build.sh"))
        .arg("path")
        .output()
        .expect("tests/nvidia/build.sh runs");
    assert!(
        out.status.success(),
        "simulator build failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let dir = String::from_utf8(out.stdout).unwrap().trim().to_string();
    let log = std::fs::File::create(cluster.dir.path().join("simulator.log")).unwrap();
    let child = std::process::Command::new(format!("{dir}/gpu-node-simulator"))
        .args(["--kubeconfig"])
        .arg(&cluster.kubeconfig)
        .args([
            "--namespace",
            &cluster.gpu_operator_namespace,
            "--mig-delay",
            "300ms",
            "--exit-on-stdin-eof",
        ])
        .args(extra)
        .stdin(std::process::Stdio::piped())
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .spawn()
        .expect("simulator starts");
    Simulator(child)
}

/// A free loopback port.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// The raw HTTP/1.1 response to `GET path` on a loopback port.
pub fn http_get_raw(port: u16, path: &str) -> String {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut resp = String::new();
    s.read_to_string(&mut resp).unwrap();
    resp
}

/// `config/`'s namespace, ServiceAccount and RBAC, then the `extra` files, applied as `admin`.
pub async fn apply_config(admin: &Client, extra: &[&str]) {
    let root = testkit::repo_root();
    let base = [
        "config/namespace.yaml",
        "config/serviceaccount.yaml",
        "config/rbac.yaml",
    ];
    for f in base.iter().chain(extra) {
        testkit::apply_path(admin, &root.join(f)).await.unwrap();
    }
}

/// Waits (up to [`LONG`]) until policy `name` is Ready on `n` nodes; panics with the log of the
/// operator that should have got it there.
pub async fn ready_on_or_log(
    client: &Client,
    name: &str,
    n: i64,
    log: &std::path::Path,
) -> serde_json::Value {
    let found = tokio::time::timeout(LONG, async {
        loop {
            if let Some(s) = ready_on(client, name, n).await {
                return s;
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    })
    .await;
    found.unwrap_or_else(|_| {
        panic!(
            "{name} not Ready on {n} nodes:\n{}",
            std::fs::read_to_string(log).unwrap_or_default()
        )
    })
}

/// The operator binary as a child process; killed with the test.
pub struct Proc(pub std::process::Child, pub std::path::PathBuf);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl Proc {
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.1).unwrap_or_default()
    }
}

pub fn spawn_operator(cluster: &TestCluster, name: &str, args: &[&str]) -> Proc {
    let log = cluster.dir.path().join(format!("{name}.log"));
    let out = std::fs::File::create(&log).unwrap();
    let child = std::process::Command::new(env!("CARGO_BIN_EXE_gpu-sharing-operator"))
        .arg("run")
        .args(args)
        .env("KUBECONFIG", &cluster.kubeconfig)
        .env("POD_NAME", name)
        .env("RUST_LOG", "info,kube=warn")
        .stdin(std::process::Stdio::null())
        .stdout(out.try_clone().unwrap())
        .stderr(out)
        .spawn()
        .expect("operator starts");
    Proc(child, log)
}

/// The holder of the operator's leader-election Lease, if any.
pub async fn lease_holder(c: &Client) -> Option<String> {
    let lease = Api::<k8s_openapi::api::coordination::v1::Lease>::namespaced(c.clone(), "default")
        .get_opt("gpu-sharing-operator")
        .await
        .ok()??;
    lease.spec?.holder_identity.filter(|h| !h.is_empty())
}

/// The fixture's node `template` (e.g. `l4-node-0`) as YAML, renamed.
pub fn fixture_node(template: &str, name: &str) -> String {
    let fixtures =
        std::fs::read_to_string(testkit::repo_root().join("tests/cluster/fixtures/nodes.yaml"))
            .unwrap();
    fixtures
        .split("\n---\n")
        .find(|d| d.contains(&format!("name: {template}\n")))
        .unwrap_or_else(|| panic!("{template} in the fixtures"))
        .replace(template, name)
}

/// The fixture's L4 node as YAML, renamed.
pub fn l4_node(name: &str) -> String {
    fixture_node("l4-node-0", name)
}

/// A nodes file in `dir` with `n` copies of the fixture's node `template`, named
/// `<prefix>-00`, `<prefix>-01`, ...
pub fn fleet(dir: &std::path::Path, template: &str, prefix: &str, n: usize) -> std::path::PathBuf {
    let docs: Vec<String> = (0..n)
        .map(|i| fixture_node(template, &format!("{prefix}-{i:02}")))
        .collect();
    let path = dir.join(format!("{prefix}-fleet.yaml"));
    std::fs::write(&path, docs.join("\n---\n")).unwrap();
    path
}

/// A nodes file in `dir` with `n` copies of the fixture's L4 node, named `l4-00`, `l4-01`, ...
pub fn l4_fleet(dir: &std::path::Path, n: usize) -> std::path::PathBuf {
    fleet(dir, "l4-node-0", "l4", n)
}

/// The passes that ended without an error in a metrics text (one reading for tests and the
/// benchmark).
pub use testkit::metrics::passes_in;

/// Nothing written at rest, as kube-apiserver itself counts writes (a server-side apply that
/// changes nothing keeps the resourceVersion, so comparing resourceVersions cannot see a
/// redundant write). Twice, the test annotates policy `policy` (a write of its own that wakes
/// the operator) and waits until `passes` (the operator's passes that ended without an error)
/// moved: the second pass seen starts after the first ended, so at least one whole pass runs
/// between the two reads of the counters. After a second's quiet (events are sent off the
/// pass), every write kube-apiserver counted meanwhile must be the two pokes; leases (the API
/// server's identity, leader election) and dry runs (the fence check) aside.
pub async fn assert_nothing_written_at_rest<F, Fut>(c: &Client, policy: &str, passes: F)
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = u64>,
{
    use kube::api::{Patch, PatchParams};
    use testkit::apiserver::{describe, diff, write_counts};
    let api = Api::<GpuSharingPolicy>::all(c.clone());
    let poke = |i: u32| {
        let api = api.clone();
        async move {
            api.patch(
                policy,
                &PatchParams::default(),
                &Patch::Merge(
                    json!({"metadata": {"annotations": {"test.gpusharing.io/poke": i.to_string()}}}),
                ),
            )
            .await
            .expect("poke the policy");
        }
    };
    // At rest first: no write for two seconds (the node simulator relabels a second after a
    // config change, so the last of a convergence may still be on its way).
    let quiet =
        |d: &testkit::apiserver::Counts| d.keys().all(|(group, ..)| group == "coordination.k8s.io");
    let mut before = write_counts(c).await.expect("kube-apiserver's /metrics");
    let mut last = Vec::new();
    let settled = tokio::time::timeout(Duration::from_secs(60), async {
        loop {
            tokio::time::sleep(Duration::from_secs(2)).await;
            let now = write_counts(c).await.expect("kube-apiserver's /metrics");
            let d = diff(&now, &before);
            before = now;
            if quiet(&d) {
                return;
            }
            last = describe(&d);
        }
    })
    .await;
    assert!(settled.is_ok(), "never at rest: still writing {last:?}");
    for i in 0..2 {
        let p0 = passes().await;
        poke(i).await;
        testkit::until("a pass after the poke", Duration::from_secs(30), || async {
            (passes().await > p0).then_some(())
        })
        .await;
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    let after = write_counts(c).await.expect("kube-apiserver's /metrics");
    let mut moved = diff(&after, &before);
    moved.retain(|(group, ..), _| group != "coordination.k8s.io");
    let pokes = (
        "gpusharing.io".to_string(),
        "gpusharingpolicies".to_string(),
        String::new(),
        "PATCH".to_string(),
        "200".to_string(),
    );
    assert_eq!(
        moved.remove(&pokes),
        Some(2.0),
        "the test's two pokes: {:?}",
        describe(&diff(&after, &before))
    );
    assert!(
        moved.is_empty(),
        "written at rest (kube-apiserver's counters, besides the test's two pokes): {:?}",
        describe(&moved)
    );
}

/// resourceVersions of everything the operator may write.
pub async fn resource_versions(c: &Client) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    for n in Api::<Node>::all(c.clone())
        .list(&Default::default())
        .await
        .unwrap()
    {
        out.insert(
            format!("node/{}", n.name_any()),
            n.resource_version().unwrap_or_default(),
        );
    }
    for cm in Api::<ConfigMap>::namespaced(c.clone(), NS)
        .list(&Default::default())
        .await
        .unwrap()
    {
        out.insert(
            format!("cm/{}", cm.name_any()),
            cm.resource_version().unwrap_or_default(),
        );
    }
    for p in Api::<GpuSharingPolicy>::all(c.clone())
        .list(&Default::default())
        .await
        .unwrap()
    {
        out.insert(
            format!("gsp/{}", p.name_any()),
            p.resource_version().unwrap_or_default(),
        );
    }
    let cps: Api<DynamicObject> = Api::all_with(c.clone(), &controller::cluster_policy_resource());
    for cp in cps.list(&Default::default()).await.unwrap() {
        out.insert(
            format!("cp/{}", cp.name_any()),
            cp.resource_version().unwrap_or_default(),
        );
    }
    out
}

/// Held for the whole of an end-to-end test: the tests run one at a time, and the invariant
/// watcher (tests/support/invariants.rs) judges every state of every node, our ConfigMaps and
/// the ClusterPolicy from the start of the test to its end. A violation is printed when seen
/// and fails the test when this guard is dropped (or at [`InvariantWatcher::check`]).
pub struct Serial {
    _lock: tokio::sync::MutexGuard<'static, ()>,
    invariants: Option<Arc<invariants::InvariantWatcher>>,
}

impl Serial {
    /// This test's invariant watcher (for hand edits and intermediate checks).
    pub fn invariants(&self) -> &invariants::InvariantWatcher {
        self.invariants
            .as_ref()
            .expect("the invariant watcher was turned off by this test")
    }

    /// Turns the watcher off, for a test that breaks the invariants on purpose and does not
    /// repair them (the watcher's own test); says why in the test log.
    pub fn unwatched(&mut self, why: &str) {
        eprintln!("invariant watcher off: {why}");
        if let Some(w) = self.invariants.take() {
            w.turn_off();
        }
    }
}

/// The final check runs when the test's cluster is dropped, before its control plane stops
/// (the watcher waits out its reorder window then, and events in flight still arrive); a
/// cluster that outlives this guard is checked here instead.
impl Drop for Serial {
    fn drop(&mut self) {
        if let Some(w) = self.invariants.take()
            && !std::thread::panicking()
            && let Some(n) = w.final_check()
        {
            w.turn_off();
            eprintln!("invariant watcher: {n} node states checked, no violation");
        }
    }
}

/// A fresh control plane with our CRD, the node simulator (GPU Feature Discovery's labels are
/// what "applied" is checked against) and the invariant watcher.
pub async fn setup() -> (Serial, TestCluster, Simulator) {
    setup_with(testkit::ClusterOptions::default()).await
}

/// [`setup`] with cluster options (e.g. another GPU Operator namespace).
pub async fn setup_with(opts: testkit::ClusterOptions) -> (Serial, TestCluster, Simulator) {
    setup_with_simulator(opts, &[]).await
}

/// [`setup_with`], the simulator started with extra flags.
pub async fn setup_with_simulator(
    opts: testkit::ClusterOptions,
    simulator_flags: &[String],
) -> (Serial, TestCluster, Simulator) {
    let lock = SERIAL.lock().await;
    let cluster = TestCluster::start_with(opts).await;
    install_crd(&cluster.client).await;
    // The simulator first, as before the watcher existed: its device plugins load (and GFD
    // stamps) about a second after it starts, and a test whose operator writes within that
    // same second would wait for GFD's next periodic report, which the simulator does not
    // play (docs/reliability.md, Known).
    let sim = start_simulator_with(&cluster, simulator_flags);
    let invariants = Arc::new(
        invariants::InvariantWatcher::start(&cluster.kubeconfig, &cluster.gpu_operator_namespace)
            .await,
    );
    let mut cluster = cluster;
    let w = invariants.clone();
    cluster.before_stop(move || {
        if !std::thread::panicking()
            && let Some(n) = w.final_check()
        {
            w.turn_off();
            eprintln!("invariant watcher: {n} node states checked, no violation");
        }
    });
    (
        Serial {
            _lock: lock,
            invariants: Some(invariants),
        },
        cluster,
        sim,
    )
}

pub use testkit::until;

pub async fn labels(client: &Client, node: &str) -> BTreeMap<String, String> {
    Api::<Node>::all(client.clone())
        .get(node)
        .await
        .unwrap()
        .labels()
        .clone()
}

/// Waits (up to [`LONG`]) until `node` carries `key=value`.
pub async fn until_labelled(client: &Client, node: &str, key: &str, value: &str) {
    until(&format!("{node} labelled {key}={value}"), LONG, || async {
        (labels(client, node).await.get(key).map(String::as_str) == Some(value)).then_some(())
    })
    .await
}

/// Sets (`Some`) or removes (`None`) one label on a node, as an admin would
/// ([`testkit::set_node_labels`]).
pub async fn label_node(client: &Client, node: &str, key: &str, value: Option<&str>) {
    testkit::set_node_labels(client, node, &[(key, value)])
        .await
        .unwrap();
}

pub async fn policy_status(client: &Client, name: &str) -> Option<serde_json::Value> {
    let p = Api::<GpuSharingPolicy>::all(client.clone())
        .get(name)
        .await
        .ok()?;
    Some(serde_json::to_value(p.status?).unwrap())
}

pub fn condition<'a>(status: &'a serde_json::Value, type_: &str) -> Option<&'a serde_json::Value> {
    status["conditions"]
        .as_array()?
        .iter()
        .find(|c| c["type"] == type_)
}

pub async fn ready(client: &Client, name: &str) -> Option<serde_json::Value> {
    let s = policy_status(client, name).await?;
    (condition(&s, "Ready")?["status"] == "True").then_some(s)
}

pub async fn configmap_data(client: &Client, name: &str) -> Option<BTreeMap<String, String>> {
    configmap_data_in(client, NS, name).await
}

pub async fn configmap_data_in(
    client: &Client,
    ns: &str,
    name: &str,
) -> Option<BTreeMap<String, String>> {
    let cm = Api::<ConfigMap>::namespaced(client.clone(), ns)
        .get(name)
        .await
        .ok()?;
    Some(cm.data.unwrap_or_default().into_iter().collect())
}

pub async fn cluster_policy(client: &Client) -> serde_json::Value {
    let api: Api<DynamicObject> =
        Api::all_with(client.clone(), &controller::cluster_policy_resource());
    api.get("cluster-policy").await.unwrap().data
}

pub const LONG: Duration = Duration::from_secs(60);

/// Ready, with `n` nodes applied.
pub async fn ready_on(client: &Client, name: &str, n: i64) -> Option<serde_json::Value> {
    let s = ready(client, name).await?;
    (s["appliedNodes"] == n).then_some(s)
}

/// The test cluster's kubeconfig, authenticated as ServiceAccount `namespace/name` with a bound
/// token from the TokenRequest API instead of the admin certificate: RBAC applies exactly as in
/// a cluster.
pub async fn service_account_kubeconfig(
    cluster: &TestCluster,
    namespace: &str,
    name: &str,
) -> kube::config::Kubeconfig {
    let token = service_account_token(cluster, namespace, name).await;
    let mut kc = kube::config::Kubeconfig::read_from(&cluster.kubeconfig).unwrap();
    for named in &mut kc.auth_infos {
        let mut auth = kube::config::AuthInfo {
            token: Some(token.clone().into()),
            ..Default::default()
        };
        std::mem::swap(
            named.auth_info.get_or_insert_with(Default::default),
            &mut auth,
        );
    }
    kc
}

/// [`service_account_kubeconfig`] written to a file in the cluster's directory (removed with
/// it), for processes run as that ServiceAccount.
pub async fn service_account_kubeconfig_file(
    cluster: &TestCluster,
    namespace: &str,
    name: &str,
) -> std::path::PathBuf {
    let kc = service_account_kubeconfig(cluster, namespace, name).await;
    let path = cluster
        .dir
        .path()
        .join(format!("{namespace}-{name}.kubeconfig"));
    std::fs::write(&path, serde_saphyr::to_string(&kc).unwrap()).unwrap();
    path
}

/// A bound token of ServiceAccount `namespace/name` from the TokenRequest API (one hour).
pub async fn service_account_token(cluster: &TestCluster, namespace: &str, name: &str) -> String {
    testkit::service_account_token(&cluster.client, namespace, name)
        .await
        .expect("token request")
}

/// A client for the test cluster built as `run` builds the operator's
/// (`runtime::depth::client`: GpuSharingPolicy JSON nested too deep is cut).
pub async fn operator_client(cluster: &TestCluster) -> Client {
    let kc = kube::config::Kubeconfig::read_from(&cluster.kubeconfig).unwrap();
    let cfg = kube::Config::from_custom_kubeconfig(kc, &Default::default())
        .await
        .unwrap();
    gpu_sharing_operator::runtime::depth::client(cfg).unwrap()
}

/// A client for [`service_account_kubeconfig`].
pub async fn service_account_client(cluster: &TestCluster, namespace: &str, name: &str) -> Client {
    let kc = service_account_kubeconfig(cluster, namespace, name).await;
    let cfg = kube::Config::from_custom_kubeconfig(kc, &Default::default())
        .await
        .unwrap();
    Client::try_from(cfg).unwrap()
}

/// An independent observer of the rollout budget (test code, not the operator's logic): watches
/// every Node and counts the nodes whose `nvidia.com/device-plugin.config` label changed and
/// whose GPU Feature Discovery has not relabelled them since (a new `nvidia.com/gfd.timestamp`).
pub struct BudgetWatcher {
    state: std::sync::Arc<std::sync::Mutex<BudgetState>>,
    task: tokio::task::JoinHandle<()>,
}

#[derive(Default, Debug)]
pub struct BudgetState {
    /// Node -> its device-plugin config as last seen.
    config: BTreeMap<String, Option<String>>,
    /// Unconfirmed node -> the GFD timestamp it had when its config changed.
    pub unconfirmed: BTreeMap<String, Option<String>>,
    /// The most nodes unconfirmed at once since the last `reset`.
    pub max_unconfirmed: usize,
    /// Every config change seen: (node, new config).
    pub changes: Vec<(String, Option<String>)>,
    ready: bool,
}

impl BudgetState {
    fn observe(&mut self, n: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta) {
        let name = n.name.clone().unwrap_or_default();
        let labels = n.labels.clone().unwrap_or_default();
        let dp = labels.get("nvidia.com/device-plugin.config").cloned();
        let ts = labels.get("nvidia.com/gfd.timestamp").cloned();
        match self.config.insert(name.clone(), dp.clone()) {
            Some(old) if old != dp => {
                self.unconfirmed.insert(name.clone(), ts);
                self.changes.push((name, dp));
            }
            _ => {
                if self.unconfirmed.get(&name).is_some_and(|at| *at != ts) {
                    self.unconfirmed.remove(&name);
                }
            }
        }
        self.max_unconfirmed = self.max_unconfirmed.max(self.unconfirmed.len());
    }
}

impl BudgetWatcher {
    /// Starts watching; returns once the initial list is in.
    pub async fn start(client: &Client) -> BudgetWatcher {
        use futures::StreamExt;
        use kube::runtime::watcher;
        let state = std::sync::Arc::new(std::sync::Mutex::new(BudgetState::default()));
        let s = state.clone();
        let api: Api<kube::core::PartialObjectMeta<Node>> = Api::all(client.clone());
        let task = tokio::spawn(async move {
            let mut stream = watcher(api, watcher::Config::default()).boxed();
            while let Some(ev) = stream.next().await {
                let mut st = s.lock().unwrap();
                match ev {
                    Ok(watcher::Event::Apply(n) | watcher::Event::InitApply(n)) => {
                        st.observe(&n.metadata)
                    }
                    Ok(watcher::Event::InitDone) => st.ready = true,
                    _ => {}
                }
            }
        });
        let w = BudgetWatcher { state, task };
        until("the budget watcher's initial list", LONG, || async {
            w.state.lock().unwrap().ready.then_some(())
        })
        .await;
        w
    }

    pub fn max_unconfirmed(&self) -> usize {
        self.state.lock().unwrap().max_unconfirmed
    }

    pub fn changes(&self) -> usize {
        self.state.lock().unwrap().changes.len()
    }

    /// Starts a new measuring window (nodes still unconfirmed stay counted).
    pub fn reset(&self) {
        let mut s = self.state.lock().unwrap();
        s.max_unconfirmed = s.unconfirmed.len();
    }
}

impl Drop for BudgetWatcher {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Every label state of one node the API server's watch showed, in order (test support, not
/// part of the operator): a transition's intermediate states can be checked against an
/// invariant afterwards.
pub struct LabelHistory {
    states: std::sync::Arc<std::sync::Mutex<Vec<BTreeMap<String, String>>>>,
    task: tokio::task::JoinHandle<()>,
}

impl LabelHistory {
    /// Starts watching `node`; returns once its current labels are recorded.
    pub async fn start(client: &Client, node: &str) -> LabelHistory {
        use futures::StreamExt;
        use kube::runtime::watcher;
        let states = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let s = states.clone();
        let api: Api<kube::core::PartialObjectMeta<Node>> = Api::all(client.clone());
        let cfg = watcher::Config::default().fields(&format!("metadata.name={node}"));
        let task = tokio::spawn(async move {
            let mut stream = watcher(api, cfg).boxed();
            while let Some(ev) = stream.next().await {
                if let Ok(watcher::Event::Apply(n) | watcher::Event::InitApply(n)) = ev {
                    let labels: BTreeMap<String, String> = n.metadata.labels.unwrap_or_default();
                    let mut v = s.lock().unwrap();
                    if v.last() != Some(&labels) {
                        v.push(labels);
                    }
                }
            }
        });
        let h = LabelHistory { states, task };
        until("the label history's first state", LONG, || async {
            (!h.states.lock().unwrap().is_empty()).then_some(())
        })
        .await;
        h
    }

    /// The states seen so far.
    pub fn states(&self) -> Vec<BTreeMap<String, String>> {
        self.states.lock().unwrap().clone()
    }
}

impl Drop for LabelHistory {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The test-only fault-injecting TLS proxy (tests/faultproxy, Go standard library only; built
/// here on first use into target/fault-proxy/): the operator talks to it, it talks to the API
/// server as the control plane's admin, and a fraction of requests get 429/500/409, a dropped
/// connection, or an answer lost after the request was applied.
pub struct FaultProxy {
    pub kubeconfig: std::path::PathBuf,
    /// A client through the proxy (it trusts only the proxy's own CA).
    pub client: Client,
    _proc: Proc,
}

impl FaultProxy {
    pub async fn start(cluster: &TestCluster, rate: f64, seed: u64, watch_cut: &str) -> FaultProxy {
        let root = testkit::repo_root();
        let bin = root.join("target/fault-proxy/fault-proxy");
        let built = std::process::Command::new("go")
            .args(["build", "-trimpath", "-o"])
            .arg(&bin)
            .arg(".")
            .current_dir(root.join("tests/faultproxy"))
            .status()
            .expect("go builds the fault proxy");
        assert!(built.success(), "go build tests/faultproxy");
        let server = kube::config::Kubeconfig::read_from(&cluster.kubeconfig)
            .unwrap()
            .clusters[0]
            .cluster
            .as_ref()
            .and_then(|c| c.server.clone())
            .expect("the cluster's server");
        let pki = cluster.kubeconfig.parent().unwrap().join("pki");
        let dir = cluster.dir.path().join("fault-proxy");
        std::fs::create_dir_all(&dir).unwrap();
        let log = dir.join("fault-proxy.log");
        let mut child = std::process::Command::new(&bin)
            .arg(format!("--upstream={server}"))
            .arg(format!("--pki={}", pki.display()))
            .arg(format!("--dir={}", dir.display()))
            .arg(format!("--rate={rate}"))
            .arg(format!("--seed={seed}"))
            .arg(format!("--watch-cut={watch_cut}"))
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::piped())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .expect("fault proxy starts");
        let mut line = String::new();
        std::io::BufRead::read_line(
            &mut std::io::BufReader::new(child.stdout.take().unwrap()),
            &mut line,
        )
        .unwrap();
        let kubeconfig: std::path::PathBuf = line
            .strip_prefix("READY ")
            .unwrap_or_else(|| {
                panic!(
                    "fault proxy not ready: {line:?} {}",
                    std::fs::read_to_string(&log).unwrap_or_default()
                )
            })
            .trim()
            .into();
        let client = testkit::client_from_kubeconfig(&kubeconfig)
            .await
            .expect("client of the fault proxy");
        FaultProxy {
            kubeconfig,
            client,
            _proc: Proc(child, log),
        }
    }

    async fn control(&self, method: &str, path: &str) -> String {
        let req = http::Request::builder()
            .method(method)
            .uri(path)
            .body(Vec::new())
            .unwrap();
        self.client
            .request_text(req)
            .await
            .expect("fault proxy control")
    }

    /// Sets the fraction of requests that get a fault.
    pub async fn set_rate(&self, rate: f64) {
        self.control("POST", &format!("/fault-proxy/rate?value={rate}"))
            .await;
    }

    /// Delays every request whose path ends with `suffix` by `delay` (a slow answer, not an
    /// error); a zero delay removes it.
    pub async fn set_delay(&self, suffix: &str, delay: Duration) {
        self.control(
            "POST",
            &format!(
                "/fault-proxy/delay?suffix={suffix}&value={}ms",
                delay.as_millis()
            ),
        )
        .await;
    }

    /// A client through the proxy that does not retry 429 (as the operator's eviction client).
    pub async fn client_without_retries(&self) -> Client {
        testkit::client_without_retries(&self.kubeconfig)
            .await
            .expect("client of the fault proxy")
    }

    /// The proxy's counts (requests, forwarded, each fault, writes applied, delayed).
    pub async fn stats(&self) -> serde_json::Value {
        serde_json::from_str(&self.control("GET", "/fault-proxy/stats").await).unwrap()
    }
}

/// Where `plan` (a one-shot snapshot of the cluster, as `gpu-sharing-operator plan` reads it)
/// and the controller (its caches) disagree: a policy whose conditions (type, status, reason)
/// differ from those the controller wrote, or a node whose labels of ours `plan` would change.
/// Empty when they agree.
pub async fn plan_disagrees(client: &Client) -> Vec<String> {
    use gpu_sharing_operator::{plan, preview};
    let snap = preview::snapshot(client, Some(NS.into()), &preview::RunFlags::default())
        .await
        .expect("snapshot");
    let p = plan::plan(&snap.input);
    let mut out = Vec::new();
    let policies = Api::<GpuSharingPolicy>::all(client.clone())
        .list(&Default::default())
        .await
        .unwrap();
    let conditions = |status: serde_json::Value| {
        status["conditions"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|c| format!("{}={}/{}", c["type"], c["status"], c["reason"]))
            .collect::<Vec<_>>()
    };
    for live in &policies.items {
        let name = live.name_any();
        let written = live.status.as_ref().map(|s| conditions(json!(s)));
        let planned = p.statuses.get(&name).map(|s| conditions(json!(s)));
        if written != planned {
            out.push(format!(
                "policy {name}: the controller wrote {written:?}, plan computes {planned:?}"
            ));
        }
    }
    for n in &snap.input.nodes {
        let ours = plan::node::owned_labels(n);
        let want = p.node_labels.get(&n.name).cloned().unwrap_or_default();
        if ours != want {
            out.push(format!(
                "node {}: carries {ours:?}, plan would write {want:?}",
                n.name
            ));
        }
    }
    out
}

/// Waits until `plan` and the controller agree (see [`plan_disagrees`]); panics naming the
/// disagreement.
pub async fn plan_agrees(client: &Client) {
    let deadline = tokio::time::Instant::now() + LONG;
    loop {
        let d = plan_disagrees(client).await;
        if d.is_empty() {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "plan and the controller disagree:\n{}",
            d.join("\n")
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// The events on pod `pod` in `default` that `keep` admits, as `reason: message`.
pub async fn pod_events(
    c: &Client,
    pod: &str,
    keep: impl Fn(&k8s_openapi::api::core::v1::Event) -> bool,
) -> Vec<String> {
    pod_events_in(c, "default", pod, keep).await
}

/// [`pod_events`] of a pod in namespace `ns`.
pub async fn pod_events_in(
    c: &Client,
    ns: &str,
    pod: &str,
    keep: impl Fn(&k8s_openapi::api::core::v1::Event) -> bool,
) -> Vec<String> {
    Api::<k8s_openapi::api::core::v1::Event>::namespaced(c.clone(), ns)
        .list(&kube::api::ListParams::default().fields(&format!("involvedObject.name={pod}")))
        .await
        .unwrap()
        .items
        .into_iter()
        .filter(|e| keep(e))
        .map(|e| {
            format!(
                "{}: {}",
                e.reason.unwrap_or_default(),
                e.message.unwrap_or_default()
            )
        })
        .collect()
}
