//! A local Kubernetes control plane for tests and the benchmark: `kube-local` (built from
//! `tests/cluster/` by `tests/cluster/cluster.sh build`; set `KUBE_LOCAL_BIN` to use a prebuilt
//! one), with the NVIDIA GPU Operator's ClusterPolicy and simulated GPU nodes seeded. One
//! private control plane per test ([`TestCluster`]), or one per test binary
//! ([`TestCluster::shared`]).

use std::fs::File;
use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Client, Config};
use tempfile::TempDir;

/// How long `start` waits for `READY`.
pub const READY_TIMEOUT: Duration = Duration::from_secs(120);

/// Options for [`TestCluster::start_with`].
#[derive(Clone, Debug)]
pub struct ClusterOptions {
    /// Namespace of the simulated GPU Operator (ClusterPolicy `status.namespace`).
    pub gpu_operator_namespace: String,
    /// Seed the simulated nodes (`tests/cluster/fixtures/nodes.yaml`).
    pub seed_nodes: bool,
    /// Seed the GPU Operator: namespace, ClusterPolicy CRD and `cluster-policy`,
    /// `default-mig-parted-config` ConfigMap.
    pub seed_gpu_operator: bool,
    /// Nodes manifest to seed instead of the default fixture.
    pub nodes_file: Option<PathBuf>,
    /// Extra manifest files or directories applied after seeding (CRDs are
    /// waited for until Established), e.g. the repository's `crds/`.
    pub manifests: Vec<PathBuf>,
    /// Extra kube-local flags (see `kube-local --help`).
    pub extra_args: Vec<String>,
    /// The kube-local binary to run instead of [`kube_local_bin`]'s.
    pub bin: Option<PathBuf>,
    /// Where kube-local's log goes (default: `kube-local.log` in the cluster's directory,
    /// removed with it).
    pub log: Option<PathBuf>,
}

impl Default for ClusterOptions {
    fn default() -> Self {
        ClusterOptions {
            gpu_operator_namespace: "gpu-operator".into(),
            seed_nodes: true,
            seed_gpu_operator: true,
            nodes_file: None,
            manifests: Vec::new(),
            extra_args: Vec::new(),
            bin: None,
            log: None,
        }
    }
}

impl ClusterOptions {
    pub fn namespace(mut self, ns: &str) -> Self {
        self.gpu_operator_namespace = ns.into();
        self
    }
    pub fn without_nodes(mut self) -> Self {
        self.seed_nodes = false;
        self
    }
    pub fn without_gpu_operator(mut self) -> Self {
        self.seed_gpu_operator = false;
        self
    }
    pub fn nodes_file(mut self, path: impl Into<PathBuf>) -> Self {
        self.nodes_file = Some(path.into());
        self
    }
    pub fn manifest(mut self, path: impl Into<PathBuf>) -> Self {
        self.manifests.push(path.into());
        self
    }
    pub fn arg(mut self, arg: &str) -> Self {
        self.extra_args.push(arg.into());
        self
    }
    pub fn bin(mut self, path: impl Into<PathBuf>) -> Self {
        self.bin = Some(path.into());
        self
    }
    pub fn log(mut self, path: impl Into<PathBuf>) -> Self {
        self.log = Some(path.into());
        self
    }

    fn args(&self) -> Vec<String> {
        let mut a = vec![format!(
            "--gpu-operator-namespace={}",
            self.gpu_operator_namespace
        )];
        if !self.seed_nodes {
            a.push("--no-nodes".into());
        }
        if !self.seed_gpu_operator {
            a.push("--no-gpu-operator".into());
        }
        if let Some(n) = &self.nodes_file {
            a.push(format!("--nodes={}", n.display()));
        }
        for m in &self.manifests {
            a.push(format!("--manifest={}", m.display()));
        }
        a.extend(self.extra_args.iter().cloned());
        a
    }
}

/// Root of the repository (the workspace this crate is a member of).
pub fn repo_root() -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/.."))
}

/// Path of the kube-local binary: `$KUBE_LOCAL_BIN`, or built (if missing or
/// stale) by `tests/cluster/cluster.sh build`, once per test process.
pub fn kube_local_bin() -> PathBuf {
    static BIN: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    BIN.get_or_init(|| {
        if let Some(p) = std::env::var_os("KUBE_LOCAL_BIN") {
            return Ok(PathBuf::from(p));
        }
        let script = repo_root().join("tests/cluster/cluster.sh");
        let out = Command::new("bash")
            .arg(&script)
            .arg("path")
            .stdin(Stdio::null())
            .stderr(Stdio::inherit())
            .output()
            .map_err(|e| format!("running {}: {e}", script.display()))?;
        if !out.status.success() {
            return Err(format!("{} path failed: {}", script.display(), out.status));
        }
        let stdout = String::from_utf8_lossy(&out.stdout);
        let path = stdout.lines().last().unwrap_or("").trim();
        if path.is_empty() {
            return Err(format!("{} path printed nothing", script.display()));
        }
        Ok(PathBuf::from(path))
    })
    .clone()
    .unwrap_or_else(|e| panic!("cannot build kube-local: {e}"))
}

/// A running kube-local process.
struct Process {
    child: Child,
    log: PathBuf,
    bin: PathBuf,
}

impl Process {
    /// Spawns kube-local and blocks until it prints `READY <kubeconfig>`.
    /// Its stdin is a pipe held by `child`: when this process dies, the pipe
    /// closes and kube-local stops.
    fn spawn(
        bin: PathBuf,
        dir: Option<&Path>,
        log: PathBuf,
        args: &[String],
    ) -> anyhow::Result<(Process, PathBuf)> {
        let log_file = File::create(&log).with_context(|| format!("create {}", log.display()))?;
        let mut cmd = Command::new(&bin);
        if let Some(d) = dir {
            cmd.arg("--dir").arg(d);
        }
        cmd.args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::from(log_file));
        let mut child = cmd
            .spawn()
            .with_context(|| format!("spawn {}", bin.display()))?;
        let stdout = child.stdout.take().expect("piped stdout");
        let (tx, rx) = mpsc::channel::<String>();
        std::thread::spawn(move || {
            let mut reader = BufReader::new(stdout);
            let mut line = String::new();
            while reader.read_line(&mut line).map(|n| n > 0).unwrap_or(false) {
                if let Some(path) = line.trim_end().strip_prefix("READY ") {
                    let _ = tx.send(path.to_string());
                }
                line.clear();
            }
            // Keep draining so kube-local never blocks on a full pipe.
            let _ = std::io::copy(&mut reader.into_inner(), &mut std::io::sink());
        });
        let mut proc = Process { child, log, bin };
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            match rx.recv_timeout(Duration::from_millis(100)) {
                Ok(path) => return Ok((proc, PathBuf::from(path))),
                Err(mpsc::RecvTimeoutError::Timeout) => {}
                Err(mpsc::RecvTimeoutError::Disconnected) => {}
            }
            if let Some(status) = proc.child.try_wait()? {
                bail!(
                    "kube-local exited ({status}) before READY; log {}:\n{}",
                    proc.log.display(),
                    proc.log_tail()
                );
            }
            if Instant::now() > deadline {
                let tail = proc.log_tail();
                proc.kill();
                bail!(
                    "kube-local not READY within {READY_TIMEOUT:?}; log {}:\n{tail}",
                    proc.log.display()
                );
            }
        }
    }

    fn log_tail(&self) -> String {
        let mut s = String::new();
        if let Ok(mut f) = File::open(&self.log) {
            let _ = f.read_to_string(&mut s);
        }
        let lines: Vec<&str> = s.lines().collect();
        lines[lines.len().saturating_sub(60)..].join("\n")
    }

    fn kill(&mut self) {
        // Everything (etcd included) lives in this one process: SIGKILL
        // leaves nothing behind and is instant.
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Builds a client from a kubeconfig file.
pub async fn client_from_kubeconfig(path: &Path) -> anyhow::Result<Client> {
    let kc = Kubeconfig::read_from(path).with_context(|| format!("read {}", path.display()))?;
    let config = Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default()).await?;
    Ok(Client::try_from(config)?)
}

/// Builds a client from a kubeconfig file with kube's default retry (of 429, 503, 504) off, as
/// the operator's eviction client is built.
pub async fn client_without_retries(path: &Path) -> anyhow::Result<Client> {
    let kc = Kubeconfig::read_from(path).with_context(|| format!("read {}", path.display()))?;
    let mut config = Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default()).await?;
    config.default_retry = false;
    Ok(Client::try_from(config)?)
}

/// A private control plane for one test. Dropping it kills kube-local and
/// removes its directory.
pub struct TestCluster {
    pub client: Client,
    pub kubeconfig: PathBuf,
    /// Namespace of the simulated GPU Operator.
    pub gpu_operator_namespace: String,
    /// kube-local's stderr (etcd and kube-apiserver logs).
    pub log: PathBuf,
    // Declared before `dir`: the process is killed before the dir is removed.
    process: Process,
    pub dir: TempDir,
    args: Vec<String>,
    restarts: u32,
    /// Run when the cluster is dropped, before the control plane is stopped (last added,
    /// first run): a final check that still needs the API server.
    before_stop: Vec<Box<dyn FnOnce() + Send>>,
}

impl Drop for TestCluster {
    fn drop(&mut self) {
        while let Some(f) = self.before_stop.pop() {
            f();
        }
    }
}

impl TestCluster {
    /// Starts a cluster with the defaults: GPU Operator in `gpu-operator`,
    /// simulated nodes seeded. Panics on failure (with kube-local's log).
    pub async fn start() -> TestCluster {
        Self::start_with(ClusterOptions::default()).await
    }

    pub async fn start_with(opts: ClusterOptions) -> TestCluster {
        match Self::try_start_with(opts).await {
            Ok(c) => c,
            Err(e) => panic!("starting the test cluster: {e:#}"),
        }
    }

    pub async fn try_start_with(opts: ClusterOptions) -> anyhow::Result<TestCluster> {
        let dir = tempfile::Builder::new()
            .prefix("kube-local-test-")
            .tempdir()?;
        let log = opts
            .log
            .clone()
            .unwrap_or_else(|| dir.path().join("kube-local.log"));
        let bin = opts.bin.clone().unwrap_or_else(kube_local_bin);
        // --persist: the etcd data and certificates stay in `dir`, so `restart` can start
        // again on them (the dir is removed when the cluster is dropped).
        let mut args = opts.args();
        args.push("--persist".into());
        let (process, kubeconfig) = Process::spawn(bin, Some(dir.path()), log.clone(), &args)?;
        let client = client_from_kubeconfig(&kubeconfig).await?;
        Ok(TestCluster {
            client,
            kubeconfig,
            gpu_operator_namespace: opts.gpu_operator_namespace,
            log,
            process,
            dir,
            args,
            restarts: 0,
            before_stop: Vec::new(),
        })
    }

    /// Runs `f` when the cluster is dropped, while the control plane still runs.
    pub fn before_stop(&mut self, f: impl FnOnce() + Send + 'static) {
        self.before_stop.push(Box::new(f));
    }

    /// Stops the control plane (SIGKILL: etcd and kube-apiserver die at once, mid-request, as
    /// in a crash) and starts it again on the same etcd data, certificates and port: clients
    /// and watches see connection errors, then the same objects. Returns the time the API
    /// server was away.
    pub fn restart(&mut self) -> Duration {
        let server = Kubeconfig::read_from(&self.kubeconfig)
            .expect("kubeconfig")
            .clusters[0]
            .cluster
            .as_ref()
            .and_then(|c| c.server.clone())
            .expect("server");
        let port = server
            .rsplit(':')
            .next()
            .unwrap()
            .trim_end_matches('/')
            .to_string();
        let down = Instant::now();
        self.process.kill();
        self.restarts += 1;
        let log = self
            .dir
            .path()
            .join(format!("kube-local.restart-{}.log", self.restarts));
        let mut args = self.args.clone();
        args.push(format!("--port={port}"));
        let bin = self.process.bin.clone();
        let (process, kubeconfig) = Process::spawn(bin, Some(self.dir.path()), log.clone(), &args)
            .unwrap_or_else(|e| panic!("restarting the control plane: {e:#}"));
        assert_eq!(kubeconfig, self.kubeconfig);
        self.process = process;
        self.log = log;
        down.elapsed()
    }

    /// A new client for this cluster (a `kube::Client` is tied to the tokio
    /// runtime that created it).
    pub async fn new_client(&self) -> Client {
        client_from_kubeconfig(&self.kubeconfig)
            .await
            .expect("client")
    }

    /// The last lines of kube-local's log, e.g. for assertion messages.
    pub fn log_tail(&self) -> String {
        self.process.log_tail()
    }

    /// kube-local's process id (etcd and kube-apiserver run in it), e.g. for its CPU time.
    pub fn pid(&self) -> u32 {
        self.process.child.id()
    }
}

/// A cluster shared by all tests of one test binary (default options), for
/// tests that do not disturb each other (use distinct names/namespaces).
/// It lives until the test process exits: kube-local then sees EOF on its
/// stdin and stops, removing its own temp dir.
pub struct SharedCluster {
    pub kubeconfig: PathBuf,
    pub gpu_operator_namespace: String,
    pub log: PathBuf,
    process: Mutex<Process>,
}

impl SharedCluster {
    /// A client for the shared cluster, bound to the calling test's runtime.
    pub async fn client(&self) -> Client {
        client_from_kubeconfig(&self.kubeconfig)
            .await
            .expect("client")
    }

    pub fn log_tail(&self) -> String {
        self.process
            .lock()
            .map(|p| p.log_tail())
            .unwrap_or_default()
    }
}

impl TestCluster {
    /// The process-wide shared cluster, started on first use.
    pub fn shared() -> &'static SharedCluster {
        static SHARED: OnceLock<Result<SharedCluster, String>> = OnceLock::new();
        SHARED
            .get_or_init(|| {
                let opts = ClusterOptions::default();
                // In target/tmp, one file per test binary, overwritten by the next run.
                let exe = std::env::current_exe().ok();
                let stem = exe
                    .as_ref()
                    .and_then(|p| p.file_stem())
                    .map(|s| s.to_string_lossy().into_owned());
                let tmp = repo_root().join("target/tmp");
                std::fs::create_dir_all(&tmp).map_err(|e| format!("{}: {e}", tmp.display()))?;
                let log = tmp.join(format!(
                    "kube-local-shared-{}.log",
                    stem.unwrap_or_else(|| "tests".into())
                ));
                // No --dir: kube-local makes and removes its own temp dir.
                let (process, kubeconfig) =
                    Process::spawn(kube_local_bin(), None, log.clone(), &opts.args())
                        .map_err(|e| format!("{e:#}"))?;
                Ok(SharedCluster {
                    kubeconfig,
                    gpu_operator_namespace: opts.gpu_operator_namespace,
                    log,
                    process: Mutex::new(process),
                })
            })
            .as_ref()
            .unwrap_or_else(|e| panic!("starting the shared test cluster: {e}"))
    }
}
