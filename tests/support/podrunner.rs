//! A test pod runner (test support, loopback only): plays, for the objects of one Helm release
//! in one namespace, the minimum of the Deployment, ReplicaSet and Job controllers and of a
//! kubelet that the local control plane (API server, etcd, garbage collector; no scheduler, no
//! kubelet) lacks, so that `helm install --wait`, `helm upgrade --wait` and `helm uninstall`
//! with its pre-delete hook go through Helm's own code and the chart's pod specs really run.
//!
//! What it plays, polling the API server every 300 ms (level-triggered, as controllers are):
//! - Deployment -> ReplicaSet: one ReplicaSet per pod template (`<name>-<hash>`, label
//!   `pod-template-hash`, owned by the Deployment); rolling update with the Deployment's
//!   `maxSurge`/`maxUnavailable` (new pods up, then old ReplicaSets scaled down as new pods get
//!   Ready); Deployment status (`observedGeneration`, `replicas`, `updatedReplicas`,
//!   `readyReplicas`, `availableReplicas`, conditions Available and Progressing with reason
//!   `NewReplicaSetAvailable` once complete), which is what Helm's kstatus waiting reads.
//! - ReplicaSet -> Pod: creates and deletes pods to `spec.replicas`; writes its status.
//! - Job -> Pod: one pod at a time until one succeeds or more than `backoffLimit` failed; Job
//!   status (`startTime`, `active`, `succeeded`/`failed`, `completionTime`, conditions
//!   SuccessCriteriaMet + Complete, or FailureTarget + Failed, as the Job API validates them).
//! - Scheduler: binds every pod of the release to [`NODE`], a node name with no Node object
//!   (nothing is scheduled on the simulated GPU nodes; deletion is then graceful, as for a
//!   pod on a kubelet). No nodeSelector, affinity or toleration is evaluated.
//! - Kubelet, per pod: the container runs from the built image (tests/support/image.rs):
//!   the layer unpacked into a root filesystem of its own, `chroot` into it as the uid/gid of
//!   the security context (container over pod over the image's `User`; `runAsNonRoot`
//!   refused for uid 0; `allowPrivilegeEscalation: false` sets no_new_privs); command/args
//!   over the image's Entrypoint/Cmd; the image's Env, `KUBERNETES_SERVICE_HOST/PORT`,
//!   `HOSTNAME` and the pod's env with downward-API values (`metadata.name`,
//!   `metadata.namespace`, `metadata.uid`, labels, annotations, `spec.serviceAccountName`,
//!   `spec.nodeName`); a TokenRequest token bound to the pod, the cluster CA and namespace at
//!   the projected ServiceAccount path. Each pod gets its own network namespace (only `lo`, as
//!   a pod sandbox has its own): its ports clash with no other pod's and nothing it listens on
//!   (even `0.0.0.0`) is reachable from outside; inside it, `KUBERNETES_SERVICE_HOST` is
//!   127.0.0.1 on the API server's port, forwarded to the API server on the host's loopback.
//!   httpGet readiness probes every 0.5 s (faster than the kubelet's `periodSeconds`, for short
//!   tests) and liveness probes at their `periodSeconds` and `failureThreshold`, inside the
//!   pod's network namespace; status through `pods/status`
//!   (phase, PodScheduled/Initialized/ContainersReady/Ready, containerStatuses with state,
//!   restartCount, exit codes); restarts per `restartPolicy` (back-off 1 s doubling to 10 s);
//!   on deletion SIGTERM, SIGKILL after `terminationGracePeriodSeconds`, then the pod object
//!   removed with grace period 0 (with its UID as precondition), as the kubelet does.
//!
//! What it does not play: the scheduler's placement, `minReadySeconds`, progress deadlines,
//! `Recreate`, Job `activeDeadlineSeconds`, parallelism and indexes, PID and mount namespaces,
//! pod IPs, Services and endpoints. A pod that needs more than it plays (more than one
//! container or init containers, volumes, `envFrom`, env from Secrets, ConfigMaps or resource
//! fields, `$(VAR)` references, startup probes or probes other than httpGet) waits with reason
//! `CreateContainerConfigError` naming what; a pod whose image is not the built one waits with
//! `ErrImagePull`. Ignored, as they do not change what a well-behaved container does: resource
//! requests and limits, capabilities (the pod's uid has none), seccomp, a read-only root
//! filesystem (its files belong to root), a readiness probe's `initialDelaySeconds`.
//!
//! Tests reach a pod's ports as `kubectl port-forward` would ([`PodRunner::connect`],
//! [`PodRunner::http_get`]) and read what it did ([`PodRunner::pods`], [`PodRunner::describe`]:
//! events and container logs for failure messages; `POD_RUNNER_VERBOSE=1` prints the events as
//! they happen). Needs root (chroot, network namespaces).

use std::collections::{BTreeMap, BTreeSet};
use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use k8s_openapi::api::apps::v1::{Deployment, ReplicaSet};
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{Container, Pod, ServiceAccount};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};
use serde_json::{Value, json};
use tokio::sync::watch;

use super::image::{self, Image};
use testkit::TestCluster;

/// The node name pods are bound to (no Node object has it).
pub const NODE: &str = "test-pod-runner";

const TICK: Duration = Duration::from_millis(300);
const READINESS_PERIOD: Duration = Duration::from_millis(500);

/// What the runner did with one pod (its "kubelet" side).
#[derive(Clone, Debug, Default)]
pub struct RunPod {
    pub name: String,
    pub uid: String,
    pub labels: BTreeMap<String, String>,
    /// PID of the container's process while it runs (the operator itself: chroot execs it).
    pub pid: Option<u32>,
    /// Whether its readiness probe passes (or it has none and runs).
    pub ready: bool,
    /// Every exit of its container, in order (`exit status: 0`, `signal: 15 (SIGTERM)`, ...).
    pub exits: Vec<String>,
    pub restarts: u32,
    /// Set when the pod was stopped because it was deleted.
    pub stopped: bool,
    /// Why its container could not start, if so.
    pub waiting: Option<String>,
    /// The container's stdout and stderr.
    pub log: PathBuf,
    /// The pod's network namespace (for [`PodRunner::http_get`]).
    netns: Option<Arc<File>>,
}

impl RunPod {
    pub fn running(&self) -> bool {
        self.pid.is_some()
    }
}

struct PodHandle {
    record: Arc<Mutex<RunPod>>,
    stop: watch::Sender<bool>,
    task: tokio::task::JoinHandle<()>,
}

struct Shared {
    client: Client,
    namespace: String,
    selector: String,
    image: Image,
    api_port: u16,
    ca: Vec<u8>,
    dir: tempfile::TempDir,
    pods: Mutex<BTreeMap<String, PodHandle>>,
    /// What it did, in order (as `kubectl get events` would show), and errors.
    events: Mutex<Vec<String>>,
}

impl Shared {
    fn event(&self, what: String) {
        if std::env::var_os("POD_RUNNER_VERBOSE").is_some() {
            eprintln!("pod-runner: {what}");
        }
        self.events.lock().unwrap().push(what);
    }
}

/// The runner; stops every container it runs when dropped.
pub struct PodRunner {
    shared: Arc<Shared>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for PodRunner {
    fn drop(&mut self) {
        self.task.abort();
        for (_, p) in std::mem::take(&mut *self.shared.pods.lock().unwrap()) {
            // The task owns the child (killed on drop) and the network namespace.
            p.task.abort();
        }
    }
}

impl PodRunner {
    /// Plays the controllers and the kubelet for the Deployments, ReplicaSets, Jobs and pods of
    /// `namespace` matching the label `selector` (e.g. `app.kubernetes.io/instance=<release>`),
    /// running containers from `image`.
    pub fn start(
        cluster: &TestCluster,
        namespace: &str,
        selector: &str,
        image: Image,
    ) -> PodRunner {
        assert!(
            image::is_root(),
            "the test pod runner needs root (chroot, network namespaces)"
        );
        if let Err(e) = netns::create(0) {
            panic!("the test pod runner needs network namespaces (CAP_SYS_ADMIN): {e}");
        }
        let (host, api_port, ca) = image::api_server(&cluster.kubeconfig);
        assert!(
            host == "127.0.0.1" || host == "localhost",
            "the pod runner forwards to a loopback API server only, not {host}"
        );
        let shared = Arc::new(Shared {
            client: cluster.client.clone(),
            namespace: namespace.into(),
            selector: selector.into(),
            image,
            api_port,
            ca,
            dir: tempfile::Builder::new()
                .prefix("pod-runner-")
                .tempdir()
                .unwrap(),
            pods: Mutex::new(BTreeMap::new()),
            events: Mutex::new(Vec::new()),
        });
        let s = shared.clone();
        let task = tokio::spawn(async move {
            loop {
                if let Err(e) = tick(&s).await {
                    s.event(format!("error: {e:#}"));
                }
                tokio::time::sleep(TICK).await;
            }
        });
        PodRunner { shared, task }
    }

    /// Every pod it has run or tried to, by name.
    pub fn pods(&self) -> BTreeMap<String, RunPod> {
        self.shared
            .pods
            .lock()
            .unwrap()
            .values()
            .map(|p| {
                let r = p.record.lock().unwrap().clone();
                (r.name.clone(), r)
            })
            .collect()
    }

    pub fn pod(&self, name: &str) -> Option<RunPod> {
        self.pods().remove(name)
    }

    /// The container log of pod `name` (all its restarts).
    pub fn log(&self, name: &str) -> String {
        self.pod(name)
            .and_then(|p| std::fs::read_to_string(p.log).ok())
            .unwrap_or_default()
    }

    /// What the runner did, and every pod's state and last log lines: for failure messages.
    pub fn describe(&self) -> String {
        let mut out = String::from("pod runner events:\n");
        for e in self.shared.events.lock().unwrap().iter() {
            out.push_str(&format!("  {e}\n"));
        }
        for (name, p) in self.pods() {
            out.push_str(&format!(
                "pod {name}: pid {:?}, ready {}, restarts {}, exits {:?}, waiting {:?}\n",
                p.pid, p.ready, p.restarts, p.exits, p.waiting
            ));
            let log = std::fs::read_to_string(&p.log).unwrap_or_default();
            let lines: Vec<&str> = log.lines().collect();
            for l in &lines[lines.len().saturating_sub(15)..] {
                out.push_str(&format!("  | {l}\n"));
            }
        }
        out
    }

    /// A TCP connection to `port` inside pod `name`'s network namespace (as `kubectl
    /// port-forward` makes one).
    pub async fn connect(&self, name: &str, port: u16) -> std::io::Result<tokio::net::TcpStream> {
        netns::connect(&self.netns_of(name)?, port, Duration::from_secs(5)).await
    }

    /// `GET path` over plain HTTP on `port` inside pod `name`'s network namespace: the raw
    /// response.
    pub async fn http_get(&self, name: &str, port: u16, path: &str) -> std::io::Result<String> {
        netns::http_get(&self.netns_of(name)?, port, path, Duration::from_secs(5)).await
    }

    fn netns_of(&self, name: &str) -> std::io::Result<Arc<File>> {
        let pods = self.shared.pods.lock().unwrap();
        let p = pods
            .values()
            .find(|p| p.record.lock().unwrap().name == name)
            .ok_or_else(|| std::io::Error::other(format!("no pod {name}")))?;
        let ns = p.record.lock().unwrap().netns.clone();
        ns.ok_or_else(|| std::io::Error::other(format!("pod {name} has no sandbox")))
    }
}

fn now() -> Value {
    serde_json::to_value(Time(k8s_openapi::jiff::Timestamp::now())).unwrap()
}

fn owned_by(meta: &kube::api::ObjectMeta, uid: &str) -> bool {
    meta.owner_references
        .iter()
        .flatten()
        .any(|o| o.uid == uid && o.controller == Some(true))
}

fn controller_ref(kind: &str, api_version: &str, name: &str, uid: &str) -> Value {
    json!([{
        "apiVersion": api_version, "kind": kind, "name": name, "uid": uid,
        "controller": true, "blockOwnerDeletion": true,
    }])
}

fn is_terminal(p: &Pod) -> bool {
    matches!(
        p.status.as_ref().and_then(|s| s.phase.as_deref()),
        Some("Succeeded" | "Failed")
    )
}

fn is_ready(p: &Pod) -> bool {
    p.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

/// Pods that count for a ReplicaSet: neither terminating nor finished.
fn is_active(p: &Pod) -> bool {
    p.metadata.deletion_timestamp.is_none() && !is_terminal(p)
}

/// One pass of every role.
async fn tick(s: &Arc<Shared>) -> anyhow::Result<()> {
    let lp = ListParams::default().labels(&s.selector);
    let c = &s.client;
    let deploys = Api::<Deployment>::namespaced(c.clone(), &s.namespace)
        .list(&lp)
        .await?
        .items;
    let rss = Api::<ReplicaSet>::namespaced(c.clone(), &s.namespace)
        .list(&lp)
        .await?
        .items;
    let jobs = Api::<Job>::namespaced(c.clone(), &s.namespace)
        .list(&lp)
        .await?
        .items;
    let pods = Api::<Pod>::namespaced(c.clone(), &s.namespace)
        .list(&lp)
        .await?
        .items;
    for d in deploys
        .iter()
        .filter(|d| d.metadata.deletion_timestamp.is_none())
    {
        sync_deployment(s, d, &rss, &pods).await?;
    }
    for rs in &rss {
        // Only ReplicaSets of a live Deployment: orphans are the garbage collector's.
        let owner = deploys
            .iter()
            .find(|d| owned_by(&rs.metadata, &d.uid().unwrap()));
        if owner.is_some_and(|d| d.metadata.deletion_timestamp.is_none())
            && rs.metadata.deletion_timestamp.is_none()
        {
            sync_replicaset(s, rs, &pods).await?;
        }
    }
    for j in jobs
        .iter()
        .filter(|j| j.metadata.deletion_timestamp.is_none())
    {
        sync_job(s, j, &pods).await?;
    }
    kubelet(s, &pods).await
}

// ---------------------------------------------------------------------------------------------
// Deployment controller

fn template_hash(t: &k8s_openapi::api::core::v1::PodTemplateSpec) -> String {
    use sha2::Digest;
    let h = sha2::Sha256::digest(serde_json::to_vec(t).unwrap());
    h.iter().take(5).map(|b| format!("{b:02x}")).collect()
}

/// `maxSurge`/`maxUnavailable` of a rolling update as pod counts (surge rounds up, unavailable
/// down; both zero means one unavailable), as the Deployment controller resolves them.
fn rolling(d: &Deployment, desired: i32) -> anyhow::Result<(i32, i32)> {
    let strategy = d.spec.as_ref().and_then(|s| s.strategy.as_ref());
    if let Some(t) = strategy.and_then(|s| s.type_.as_deref())
        && t != "RollingUpdate"
    {
        anyhow::bail!("strategy {t} is not played by the test pod runner");
    }
    let ru = strategy.and_then(|s| s.rolling_update.as_ref());
    let resolve = |v: Option<&IntOrString>, up: bool| -> i32 {
        match v {
            Some(IntOrString::Int(i)) => *i,
            Some(IntOrString::String(p)) => {
                let pct: f64 = p.trim_end_matches('%').parse().unwrap_or(25.0);
                let x = pct * desired as f64 / 100.0;
                (if up { x.ceil() } else { x.floor() }) as i32
            }
            None => {
                let x = 0.25 * desired as f64;
                (if up { x.ceil() } else { x.floor() }) as i32
            }
        }
    };
    let surge = resolve(ru.and_then(|r| r.max_surge.as_ref()), true);
    let mut unavailable = resolve(ru.and_then(|r| r.max_unavailable.as_ref()), false);
    if surge == 0 && unavailable == 0 {
        unavailable = 1;
    }
    Ok((surge, unavailable))
}

async fn sync_deployment(
    s: &Arc<Shared>,
    d: &Deployment,
    rss: &[ReplicaSet],
    pods: &[Pod],
) -> anyhow::Result<()> {
    let name = d.name_any();
    let uid = d.uid().unwrap();
    let spec = d.spec.clone().unwrap_or_default();
    let desired = spec.replicas.unwrap_or(1);
    let (surge, unavailable) = rolling(d, desired)?;
    let hash = template_hash(&spec.template);
    let rs_api = Api::<ReplicaSet>::namespaced(s.client.clone(), &s.namespace);
    let mut owned: Vec<&ReplicaSet> = rss
        .iter()
        .filter(|rs| owned_by(&rs.metadata, &uid))
        .collect();
    owned.sort_by_key(|rs| rs.metadata.creation_timestamp.clone().map(|t| t.0));
    let is_new = |rs: &ReplicaSet| {
        rs.labels().get("pod-template-hash").map(String::as_str) == Some(hash.as_str())
    };
    let replicas_of = |rs: &ReplicaSet| rs.spec.as_ref().and_then(|s| s.replicas).unwrap_or(0);
    let pods_of = |rs: &ReplicaSet| -> Vec<&Pod> {
        let rs_uid = rs.uid().unwrap();
        pods.iter()
            .filter(|p| owned_by(&p.metadata, &rs_uid) && is_active(p))
            .collect()
    };
    let total_spec: i32 = owned.iter().map(|rs| replicas_of(rs)).sum();

    let Some(new) = owned.iter().copied().find(|rs| is_new(rs)) else {
        // A new ReplicaSet for the current template, as large as the surge allows.
        let room = (desired + surge - total_spec).max(0);
        let mut template = serde_json::to_value(&spec.template)?;
        template["metadata"]["labels"]["pod-template-hash"] = json!(hash);
        let mut selector = serde_json::to_value(&spec.selector)?;
        selector["matchLabels"]["pod-template-hash"] = json!(hash);
        let rs_name = format!("{name}-{hash}");
        let body = json!({
            "apiVersion": "apps/v1", "kind": "ReplicaSet",
            "metadata": {
                "name": rs_name, "namespace": s.namespace,
                "labels": template["metadata"]["labels"],
                "ownerReferences": controller_ref("Deployment", "apps/v1", &name, &uid),
            },
            "spec": {"replicas": desired.min(room), "selector": selector, "template": template},
        });
        let rs: ReplicaSet = serde_json::from_value(body)?;
        match rs_api.create(&PostParams::default(), &rs).await {
            Ok(_) => s.event(format!(
                "deployment {name}: created replicaset {rs_name} ({} of {desired})",
                desired.min(room)
            )),
            Err(kube::Error::Api(e)) if e.code == 409 => {}
            Err(e) => return Err(e.into()),
        }
        return Ok(());
    };

    // Rolling update: the new ReplicaSet up within the surge, old ones down as far as the
    // ready pods allow.
    let scale = |rs: &ReplicaSet, n: i32| {
        let api = rs_api.clone();
        let rs_name = rs.name_any();
        async move {
            api.patch(
                &rs_name,
                &PatchParams::default(),
                &Patch::Merge(json!({"spec": {"replicas": n}})),
            )
            .await
            .map(|_| ())
        }
    };
    let new_spec = replicas_of(new);
    if new_spec < desired && total_spec < desired + surge {
        let to = desired.min(new_spec + (desired + surge - total_spec));
        scale(new, to).await?;
        s.event(format!(
            "deployment {name}: scaled {} to {to}",
            new.name_any()
        ));
    } else if new_spec > desired {
        scale(new, desired).await?;
    }
    let all_pods: i32 = owned.iter().map(|rs| pods_of(rs).len() as i32).sum();
    let new_ready = pods_of(new).iter().filter(|p| is_ready(p)).count() as i32;
    let new_unavailable = (new_spec.min(desired) - new_ready).max(0);
    let mut can_remove = all_pods - (desired - unavailable) - new_unavailable;
    for old in owned.iter().filter(|rs| !is_new(rs) && replicas_of(rs) > 0) {
        if can_remove <= 0 {
            break;
        }
        let by = replicas_of(old).min(can_remove);
        scale(old, replicas_of(old) - by).await?;
        s.event(format!(
            "deployment {name}: scaled {} down to {}",
            old.name_any(),
            replicas_of(old) - by
        ));
        can_remove -= by;
    }

    // Status, from the pods (as the controller derives it from its ReplicaSets').
    let replicas = all_pods;
    let updated = pods_of(new).len() as i32;
    let ready: i32 = owned
        .iter()
        .map(|rs| pods_of(rs).iter().filter(|p| is_ready(p)).count() as i32)
        .sum();
    let available = ready;
    let complete = updated == desired && replicas == desired && available == desired;
    let old = d.status.clone().unwrap_or_default();
    let cond = |type_: &str, status: &str, reason: &str, message: String| {
        let prev = old
            .conditions
            .iter()
            .flatten()
            .find(|c| c.type_ == type_)
            .cloned();
        let same = prev
            .as_ref()
            .is_some_and(|p| p.status == status && p.reason.as_deref() == Some(reason));
        let t = if same {
            serde_json::to_value(prev.unwrap().last_transition_time).unwrap()
        } else {
            now()
        };
        json!({"type": type_, "status": status, "reason": reason, "message": message,
               "lastTransitionTime": t, "lastUpdateTime": t})
    };
    let available_cond = if available >= desired - unavailable {
        cond(
            "Available",
            "True",
            "MinimumReplicasAvailable",
            "Deployment has minimum availability.".into(),
        )
    } else {
        cond(
            "Available",
            "False",
            "MinimumReplicasUnavailable",
            "Deployment does not have minimum availability.".into(),
        )
    };
    let rs_name = new.name_any();
    let progressing = if complete {
        cond(
            "Progressing",
            "True",
            "NewReplicaSetAvailable",
            format!("ReplicaSet \"{rs_name}\" has successfully progressed."),
        )
    } else {
        cond(
            "Progressing",
            "True",
            "ReplicaSetUpdated",
            format!("ReplicaSet \"{rs_name}\" is progressing."),
        )
    };
    let status = json!({
        "observedGeneration": d.metadata.generation,
        "replicas": replicas,
        "updatedReplicas": updated,
        "readyReplicas": ready,
        "availableReplicas": available,
        "unavailableReplicas": (desired - available).max(0),
        "conditions": [available_cond, progressing],
    });
    // Timestamps aside (and zeros, which the API omits), as the controller writes status only
    // when it changes.
    let essence = |st: &Value| {
        let mut st = st.clone();
        st.as_object_mut()
            .unwrap()
            .retain(|_, v| *v != json!(0) && !v.is_null());
        for c in st["conditions"].as_array_mut().into_iter().flatten() {
            c.as_object_mut()
                .unwrap()
                .retain(|k, _| k == "type" || k == "status" || k == "reason");
        }
        st
    };
    let mut current = serde_json::to_value(&old)?;
    current
        .as_object_mut()
        .unwrap()
        .retain(|k, _| status.get(k).is_some());
    let changed = essence(&current) != essence(&status);
    if changed {
        Api::<Deployment>::namespaced(s.client.clone(), &s.namespace)
            .patch_status(
                &name,
                &PatchParams::default(),
                &Patch::Merge(json!({"status": status})),
            )
            .await?;
        s.event(format!(
            "deployment {name}: status replicas {replicas} updated {updated} ready {ready}{}",
            if complete { ", complete" } else { "" }
        ));
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// ReplicaSet controller

fn pod_from_template(
    template: &k8s_openapi::api::core::v1::PodTemplateSpec,
    generate_name: &str,
    namespace: &str,
    owner: Value,
) -> anyhow::Result<Pod> {
    let t = serde_json::to_value(template)?;
    let body = json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {
            "generateName": generate_name, "namespace": namespace,
            "labels": t["metadata"]["labels"], "annotations": t["metadata"]["annotations"],
            "ownerReferences": owner,
        },
        "spec": t["spec"],
    });
    Ok(serde_json::from_value(body)?)
}

async fn sync_replicaset(s: &Arc<Shared>, rs: &ReplicaSet, pods: &[Pod]) -> anyhow::Result<()> {
    let name = rs.name_any();
    let uid = rs.uid().unwrap();
    let spec = rs.spec.clone().unwrap_or_default();
    let want = spec.replicas.unwrap_or(1);
    let mut mine: Vec<&Pod> = pods
        .iter()
        .filter(|p| owned_by(&p.metadata, &uid) && is_active(p))
        .collect();
    let api = Api::<Pod>::namespaced(s.client.clone(), &s.namespace);
    let have = mine.len() as i32;
    if have < want {
        let template = spec.template.clone().unwrap_or_default();
        for _ in have..want {
            let pod = pod_from_template(
                &template,
                &format!("{name}-"),
                &s.namespace,
                controller_ref("ReplicaSet", "apps/v1", &name, &uid),
            )?;
            let p = api.create(&PostParams::default(), &pod).await?;
            s.event(format!("replicaset {name}: created pod {}", p.name_any()));
        }
    } else if have > want {
        // Not ready first, then the newest.
        mine.sort_by_key(|p| {
            (
                is_ready(p),
                std::cmp::Reverse(p.metadata.creation_timestamp.clone().map(|t| t.0)),
            )
        });
        for p in mine.iter().take((have - want) as usize) {
            api.delete(&p.name_any(), &DeleteParams::default()).await?;
            s.event(format!("replicaset {name}: deleted pod {}", p.name_any()));
        }
    }
    let ready = mine.iter().filter(|p| is_ready(p)).count() as i64;
    let status = json!({
        "observedGeneration": rs.metadata.generation,
        "replicas": have,
        "fullyLabeledReplicas": have,
        "readyReplicas": ready,
        "availableReplicas": ready,
    });
    let old = serde_json::to_value(rs.status.clone().unwrap_or_default())?;
    if ["observedGeneration", "replicas", "readyReplicas"]
        .iter()
        .any(|k| old[k].as_i64().unwrap_or(0) != status[k].as_i64().unwrap_or(0))
    {
        Api::<ReplicaSet>::namespaced(s.client.clone(), &s.namespace)
            .patch_status(
                &name,
                &PatchParams::default(),
                &Patch::Merge(json!({"status": status})),
            )
            .await?;
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Job controller

async fn sync_job(s: &Arc<Shared>, j: &Job, pods: &[Pod]) -> anyhow::Result<()> {
    let name = j.name_any();
    let uid = j.uid().unwrap();
    let status = j.status.clone().unwrap_or_default();
    let finished = status
        .conditions
        .iter()
        .flatten()
        .any(|c| (c.type_ == "Complete" || c.type_ == "Failed") && c.status == "True");
    if finished {
        return Ok(());
    }
    let spec = j.spec.clone().unwrap_or_default();
    let mine: Vec<&Pod> = pods
        .iter()
        .filter(|p| owned_by(&p.metadata, &uid))
        .collect();
    let phase = |p: &Pod| {
        p.status
            .as_ref()
            .and_then(|s| s.phase.clone())
            .unwrap_or_default()
    };
    let succeeded = mine.iter().filter(|p| phase(p) == "Succeeded").count() as i32;
    let failed = mine.iter().filter(|p| phase(p) == "Failed").count() as i32;
    let active: Vec<&&Pod> = mine
        .iter()
        .filter(|p| !is_terminal(p) && p.metadata.deletion_timestamp.is_none())
        .collect();
    let jobs = Api::<Job>::namespaced(s.client.clone(), &s.namespace);
    let patch = |st: Value| {
        let jobs = jobs.clone();
        let name = name.clone();
        async move {
            jobs.patch_status(
                &name,
                &PatchParams::default(),
                &Patch::Merge(json!({"status": st})),
            )
            .await
            .map(|_| ())
        }
    };
    if status.start_time.is_none() {
        patch(json!({"startTime": now()})).await?;
    }
    let completions = spec.completions.unwrap_or(1);
    if completions != 1 || spec.parallelism.unwrap_or(1) != 1 {
        anyhow::bail!("job {name}: completions/parallelism other than 1 are not played");
    }
    if succeeded >= 1 && active.is_empty() {
        let t = now();
        patch(json!({
            "active": 0, "ready": 0, "terminating": 0, "succeeded": succeeded, "failed": failed,
            "completionTime": t,
            "conditions": [
                {"type": "SuccessCriteriaMet", "status": "True", "reason": "CompletionsReached",
                 "message": "Reached expected number of succeeded pods", "lastTransitionTime": t, "lastProbeTime": t},
                {"type": "Complete", "status": "True", "reason": "CompletionsReached",
                 "message": "Reached expected number of succeeded pods", "lastTransitionTime": t, "lastProbeTime": t},
            ],
        }))
        .await?;
        s.event(format!("job {name}: complete"));
    } else if failed > spec.backoff_limit.unwrap_or(6) && active.is_empty() {
        let t = now();
        let msg = "Job has reached the specified backoff limit";
        patch(json!({
            "active": 0, "ready": 0, "terminating": 0, "succeeded": succeeded, "failed": failed,
            "conditions": [
                {"type": "FailureTarget", "status": "True", "reason": "BackoffLimitExceeded",
                 "message": msg, "lastTransitionTime": t, "lastProbeTime": t},
                {"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded",
                 "message": msg, "lastTransitionTime": t, "lastProbeTime": t},
            ],
        }))
        .await?;
        s.event(format!("job {name}: failed"));
    } else if active.is_empty() && succeeded == 0 {
        let pod = pod_from_template(
            &spec.template,
            &format!("{name}-"),
            &s.namespace,
            controller_ref("Job", "batch/v1", &name, &uid),
        )?;
        let p = Api::<Pod>::namespaced(s.client.clone(), &s.namespace)
            .create(&PostParams::default(), &pod)
            .await?;
        s.event(format!("job {name}: created pod {}", p.name_any()));
        patch(json!({"active": 1, "ready": 0, "failed": failed})).await?;
    } else {
        let ready = active.iter().filter(|p| is_ready(p)).count() as i32;
        if status.active.unwrap_or(0) != active.len() as i32
            || status.ready.unwrap_or(0) != ready
            || status.failed.unwrap_or(0) != failed
        {
            patch(json!({"active": active.len(), "ready": ready, "failed": failed})).await?;
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Scheduler and kubelet

async fn kubelet(s: &Arc<Shared>, pods: &[Pod]) -> anyhow::Result<()> {
    let api = Api::<Pod>::namespaced(s.client.clone(), &s.namespace);
    let mut seen = BTreeSet::new();
    for p in pods {
        let name = p.name_any();
        let uid = p.uid().unwrap();
        seen.insert(uid.clone());
        let node = p.spec.as_ref().and_then(|s| s.node_name.clone());
        let deleting = p.metadata.deletion_timestamp.is_some();
        let running = s.pods.lock().unwrap().contains_key(&uid);
        if deleting {
            if running {
                let pods = s.pods.lock().unwrap();
                pods[&uid].stop.send_replace(true);
            } else if node.as_deref() == Some(NODE) {
                // Never started (or already finished): nothing to stop.
                finalize(&api, &name, &uid).await;
            }
            continue;
        }
        match node.as_deref() {
            None => {
                let binding = json!({
                    "apiVersion": "v1", "kind": "Binding",
                    "metadata": {"name": name, "namespace": s.namespace},
                    "target": {"apiVersion": "v1", "kind": "Node", "name": NODE},
                });
                match api
                    .create_subresource::<_, Value>(
                        "binding",
                        &name,
                        &PostParams::default(),
                        &binding,
                    )
                    .await
                {
                    Ok(_) => s.event(format!("pod {name}: bound to {NODE}")),
                    Err(kube::Error::Api(e)) if e.code == 409 => {}
                    Err(e) => return Err(e.into()),
                }
            }
            Some(NODE) if !running && !is_terminal(p) => {
                let log = s.dir.path().join(format!("{name}.log"));
                let record = Arc::new(Mutex::new(RunPod {
                    name: name.clone(),
                    uid: uid.clone(),
                    labels: p.labels().clone(),
                    log,
                    ..Default::default()
                }));
                let (stop, stop_rx) = watch::channel(false);
                let task = tokio::spawn(run_pod(s.clone(), p.clone(), record.clone(), stop_rx));
                s.pods
                    .lock()
                    .unwrap()
                    .insert(uid, PodHandle { record, stop, task });
                s.event(format!("pod {name}: starting"));
            }
            _ => {}
        }
    }
    // Pods gone from the API (deleted at once, e.g. finished ones): stop what still runs.
    for (uid, p) in s.pods.lock().unwrap().iter() {
        if !seen.contains(uid) {
            p.stop.send_replace(true);
        }
    }
    Ok(())
}

/// Removes a stopped pod's object, as the kubelet does once its containers are gone.
async fn finalize(api: &Api<Pod>, name: &str, uid: &str) {
    let dp = DeleteParams {
        grace_period_seconds: Some(0),
        preconditions: Some(kube::api::Preconditions {
            uid: Some(uid.to_string()),
            resource_version: None,
        }),
        ..Default::default()
    };
    let _ = api.delete(name, &dp).await;
}

/// How a container is started: everything resolved from the pod and the image.
struct Prepared {
    rootfs: PathBuf,
    argv: Vec<String>,
    env: Vec<(String, String)>,
    uid: u32,
    gid: u32,
    no_new_privs: bool,
    netns: Arc<File>,
    log: PathBuf,
}

impl Prepared {
    fn spawn(&self) -> std::io::Result<tokio::process::Child> {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)?;
        let mut cmd = tokio::process::Command::new(image::chroot());
        cmd.arg(format!("--userspec={}:{}", self.uid, self.gid))
            .arg(format!("--groups={}", self.gid))
            .arg(&self.rootfs)
            .args(&self.argv)
            .env_clear()
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .stdin(std::process::Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .kill_on_drop(true);
        let ns = self.netns.as_raw_fd();
        let nnp = self.no_new_privs;
        // SAFETY: only async-signal-safe system calls between fork and exec.
        unsafe {
            cmd.pre_exec(move || {
                netns::enter(ns)?;
                if nnp {
                    netns::no_new_privs()?;
                }
                Ok(())
            });
        }
        cmd.spawn()
    }
}

/// The one container of `pod`, or why it cannot be run here.
/// What would make the container run otherwise than the pod asks is refused, named.
fn container_of(pod: &Pod) -> Result<&Container, String> {
    let spec = pod.spec.as_ref().ok_or("no spec")?;
    let not_played = |what: &str| Err(format!("{what} not played by the test pod runner"));
    if spec.containers.len() != 1 || spec.init_containers.as_ref().is_some_and(|c| !c.is_empty()) {
        return not_played("more than one container, or init containers:");
    }
    let c = &spec.containers[0];
    if spec.volumes.as_ref().is_some_and(|v| !v.is_empty())
        || c.volume_mounts.as_ref().is_some_and(|v| !v.is_empty())
    {
        return not_played("volumes:");
    }
    if c.startup_probe.is_some()
        || [&c.readiness_probe, &c.liveness_probe]
            .into_iter()
            .flatten()
            .any(|p| p.http_get.is_none())
    {
        return not_played("startup probes and probes other than httpGet:");
    }
    if c.command
        .iter()
        .chain(&c.args)
        .flatten()
        .any(|a| a.contains("$("))
    {
        return not_played("$(VAR) references in command or args:");
    }
    Ok(c)
}

/// The environment of the container: the image's, the API server's, the pod's.
fn env_of(s: &Shared, pod: &Pod, c: &Container) -> Result<Vec<(String, String)>, String> {
    let mut env: Vec<(String, String)> = Vec::new();
    let mut set = |k: &str, v: String| {
        env.retain(|(e, _)| e != k);
        env.push((k.to_string(), v));
    };
    for e in s.image.config["config"]["Env"]
        .as_array()
        .into_iter()
        .flatten()
    {
        if let Some((k, v)) = e.as_str().and_then(|e| e.split_once('=')) {
            set(k, v.to_string());
        }
    }
    set("HOSTNAME", pod.name_any());
    set("KUBERNETES_SERVICE_HOST", "127.0.0.1".into());
    set("KUBERNETES_SERVICE_PORT", s.api_port.to_string());
    set("KUBERNETES_SERVICE_PORT_HTTPS", s.api_port.to_string());
    if c.env_from.as_ref().is_some_and(|e| !e.is_empty()) {
        return Err("envFrom is not played by the test pod runner".into());
    }
    let meta = &pod.metadata;
    let spec = pod.spec.as_ref().unwrap();
    for e in c.env.iter().flatten() {
        let v = match (&e.value, &e.value_from) {
            (_, Some(from)) => {
                let Some(f) = &from.field_ref else {
                    return Err(format!(
                        "env {}: only fieldRef is played by the test pod runner",
                        e.name
                    ));
                };
                let path = f.field_path.as_str();
                let from_map = |m: &Option<BTreeMap<String, String>>, prefix: &str| {
                    let key = path.strip_prefix(prefix)?.strip_suffix("']")?;
                    Some(m.as_ref()?.get(key).cloned().unwrap_or_default())
                };
                match path {
                    "metadata.name" => pod.name_any(),
                    "metadata.namespace" => s.namespace.clone(),
                    "metadata.uid" => pod.uid().unwrap_or_default(),
                    "spec.serviceAccountName" => {
                        spec.service_account_name.clone().unwrap_or_default()
                    }
                    "spec.nodeName" => NODE.into(),
                    _ => from_map(&meta.labels, "metadata.labels['")
                        .or_else(|| from_map(&meta.annotations, "metadata.annotations['"))
                        .ok_or_else(|| format!("env {}: fieldRef {path} is not played", e.name))?,
                }
            }
            (v, None) => v.clone().unwrap_or_default(),
        };
        set(&e.name, v);
    }
    Ok(env)
}

/// Resolves the container and sets up its sandbox: root filesystem, ServiceAccount token,
/// network namespace with the API server forwarded into it. Err: (reason, message).
async fn prepare(
    s: &Arc<Shared>,
    pod: &Pod,
    log: &Path,
) -> Result<(Prepared, tokio::task::JoinHandle<()>), (String, String)> {
    let config_err = |m: String| ("CreateContainerConfigError".to_string(), m);
    let c = container_of(pod).map_err(config_err)?;
    let image_name = c.image.clone().unwrap_or_default();
    if !s.image.is(&image_name) {
        return Err((
            "ErrImagePull".into(),
            format!(
                "{image_name} is not the built image {} (tests/image/build.sh)",
                s.image.ref_name()
            ),
        ));
    }
    let spec = pod.spec.as_ref().unwrap();
    let psc = spec.security_context.clone().unwrap_or_default();
    let csc = c.security_context.clone().unwrap_or_default();
    let (image_uid, image_gid) = s.image.user();
    let uid = csc
        .run_as_user
        .or(psc.run_as_user)
        .map(|u| u as u32)
        .unwrap_or(image_uid);
    let gid = csc
        .run_as_group
        .or(psc.run_as_group)
        .map(|g| g as u32)
        .unwrap_or(image_gid);
    if csc.run_as_non_root.or(psc.run_as_non_root) == Some(true) && uid == 0 {
        return Err(config_err(
            "container has runAsNonRoot and image will run as root".into(),
        ));
    }
    let env = env_of(s, pod, c).map_err(config_err)?;
    let config = &s.image.config["config"];
    let strings =
        |v: &Value| -> Vec<String> { serde_json::from_value(v.clone()).unwrap_or_default() };
    let mut argv = c
        .command
        .clone()
        .unwrap_or_else(|| strings(&config["Entrypoint"]));
    argv.extend(match (&c.command, &c.args) {
        (_, Some(a)) => a.clone(),
        (None, None) => strings(&config["Cmd"]),
        (Some(_), None) => vec![],
    });
    if argv.is_empty() {
        return Err(config_err("no command".into()));
    }

    let rootfs = s.dir.path().join(format!("{}.rootfs", pod.name_any()));
    s.image.unpack(&rootfs);
    image::add_default_devices(&rootfs);
    if spec.automount_service_account_token != Some(false) {
        let sa = spec.service_account_name.as_deref().unwrap_or("default");
        let token = bound_token(s, sa, pod)
            .await
            .map_err(|e| config_err(format!("token of ServiceAccount {sa}: {e}")))?;
        image::write_service_account(&rootfs, &token, &s.ca, &s.namespace);
    }
    let (netns, listener) = netns::create(s.api_port)
        .map_err(|e| ("CreatePodSandboxError".to_string(), e.to_string()))?;
    let forward = tokio::spawn(netns::forward(listener, s.api_port));
    let prepared = Prepared {
        rootfs,
        argv,
        env,
        uid,
        gid,
        no_new_privs: csc.allow_privilege_escalation == Some(false),
        netns: Arc::new(netns),
        log: log.to_path_buf(),
    };
    Ok((prepared, forward))
}

/// A token of ServiceAccount `sa` bound to the pod (invalid once the pod is gone), an hour.
async fn bound_token(s: &Shared, sa: &str, pod: &Pod) -> kube::Result<String> {
    use k8s_openapi::api::authentication::v1::{
        BoundObjectReference, TokenRequest, TokenRequestSpec,
    };
    let tr = TokenRequest {
        spec: TokenRequestSpec {
            audiences: vec![],
            expiration_seconds: Some(3600),
            bound_object_ref: Some(BoundObjectReference {
                api_version: Some("v1".into()),
                kind: Some("Pod".into()),
                name: Some(pod.name_any()),
                uid: pod.uid(),
            }),
        },
        ..Default::default()
    };
    let r = Api::<ServiceAccount>::namespaced(s.client.clone(), &s.namespace)
        .create_token_request(sa, &PostParams::default(), &tr)
        .await?;
    Ok(r.status.map(|s| s.token).unwrap_or_default())
}

/// What the kubelet reports for the pod's one container.
struct State {
    phase: &'static str,
    started: Value,
    ready: bool,
    ready_since: Value,
    restarts: u32,
    /// `{"running": ...}`, `{"waiting": ...}` or `{"terminated": ...}`.
    state: Value,
    last: Value,
}

impl State {
    fn status(&self, pod: &Pod, image: &Image) -> Value {
        let c = pod
            .spec
            .as_ref()
            .and_then(|s| s.containers.first())
            .cloned()
            .unwrap_or_default();
        let cond = |t: &str, ok: bool, since: &Value| json!({"type": t, "status": if ok {"True"} else {"False"}, "lastTransitionTime": since});
        let running = self.state.get("running").is_some();
        json!({
            "phase": self.phase,
            "startTime": self.started,
            "hostIP": "127.0.0.1",
            "conditions": [
                cond("PodScheduled", true, &self.started),
                cond("Initialized", true, &self.started),
                cond("ContainersReady", self.ready, &self.ready_since),
                cond("Ready", self.ready, &self.ready_since),
            ],
            "containerStatuses": [{
                "name": c.name,
                "image": c.image,
                "imageID": format!("{}@{}", image.ref_name(), image.digest()),
                "ready": self.ready,
                "started": running,
                "restartCount": self.restarts,
                "state": self.state,
                "lastState": self.last,
            }],
        })
    }
}

async fn write_status(s: &Shared, pod: &Pod, st: &State) {
    let api = Api::<Pod>::namespaced(s.client.clone(), &s.namespace);
    let _ = api
        .patch_status(
            &pod.name_any(),
            &PatchParams::default(),
            &Patch::Merge(json!({"status": st.status(pod, &s.image)})),
        )
        .await;
}

/// An httpGet probe's result (2xx/3xx), inside the pod's network namespace.
async fn probe(ns: &Arc<File>, c: &Container, p: &k8s_openapi::api::core::v1::Probe) -> bool {
    let Some(h) = &p.http_get else {
        unreachable!("refused by container_of");
    };
    let port = match &h.port {
        IntOrString::Int(i) => *i as u16,
        IntOrString::String(n) => match c
            .ports
            .iter()
            .flatten()
            .find(|p| p.name.as_deref() == Some(n))
        {
            Some(p) => p.container_port as u16,
            None => return false,
        },
    };
    let timeout = Duration::from_secs(p.timeout_seconds.unwrap_or(1).max(1) as u64);
    let path = h.path.as_deref().unwrap_or("/");
    match netns::http_get(ns, port, path, timeout).await {
        Ok(resp) => resp
            .split_whitespace()
            .nth(1)
            .and_then(|c| c.parse::<u16>().ok())
            .is_some_and(|c| (200..400).contains(&c)),
        Err(_) => false,
    }
}

enum Outcome {
    Exited(std::process::ExitStatus),
    Stop,
    Unhealthy,
}

/// Sends SIGTERM, then SIGKILL after `grace`.
async fn terminate(child: &mut tokio::process::Child, grace: Duration) -> std::process::ExitStatus {
    if let Some(pid) = child.id() {
        netns::signal(pid, 15);
    }
    match tokio::time::timeout(grace, child.wait()).await {
        Ok(st) => st.unwrap(),
        Err(_) => {
            let _ = child.start_kill();
            child.wait().await.unwrap()
        }
    }
}

fn terminated(st: &std::process::ExitStatus, started: &Value) -> Value {
    use std::os::unix::process::ExitStatusExt;
    let code = st.code().unwrap_or(128 + st.signal().unwrap_or(0));
    json!({"terminated": {
        "exitCode": code, "reason": if code == 0 {"Completed"} else {"Error"},
        "startedAt": started, "finishedAt": now(),
    }})
}

/// Until the pod is to be stopped.
async fn stopped(stop: &mut watch::Receiver<bool>) {
    let _ = stop.wait_for(|s| *s).await;
}

/// The kubelet's side of one pod: runs its container until the pod is deleted.
async fn run_pod(
    s: Arc<Shared>,
    pod: Pod,
    rec: Arc<Mutex<RunPod>>,
    mut stop: watch::Receiver<bool>,
) {
    let api = Api::<Pod>::namespaced(s.client.clone(), &s.namespace);
    let name = pod.name_any();
    let uid = pod.uid().unwrap();
    let spec = pod.spec.clone().unwrap_or_default();
    let grace = Duration::from_secs(spec.termination_grace_period_seconds.unwrap_or(30) as u64);
    let policy = spec
        .restart_policy
        .clone()
        .unwrap_or_else(|| "Always".into());
    let t0 = now();
    let mut st = State {
        phase: "Pending",
        started: t0.clone(),
        ready: false,
        ready_since: t0.clone(),
        restarts: 0,
        state: json!({"waiting": {"reason": "ContainerCreating"}}),
        last: json!({}),
    };
    let log = rec.lock().unwrap().log.clone();
    let (prepared, forward) = match prepare(&s, &pod, &log).await {
        Ok(p) => p,
        Err((reason, message)) => {
            s.event(format!("pod {name}: {reason}: {message}"));
            rec.lock().unwrap().waiting = Some(format!("{reason}: {message}"));
            st.state = json!({"waiting": {"reason": reason, "message": message}});
            write_status(&s, &pod, &st).await;
            stopped(&mut stop).await;
            finalize(&api, &name, &uid).await;
            return;
        }
    };
    rec.lock().unwrap().netns = Some(prepared.netns.clone());
    let c = container_of(&pod).unwrap().clone();
    let mut backoff = Duration::from_secs(1);
    loop {
        let mut child = match prepared.spawn() {
            Ok(c) => c,
            Err(e) => {
                s.event(format!("pod {name}: cannot start: {e}"));
                st.state =
                    json!({"waiting": {"reason": "RunContainerError", "message": e.to_string()}});
                write_status(&s, &pod, &st).await;
                stopped(&mut stop).await;
                break;
            }
        };
        let started = now();
        rec.lock().unwrap().pid = child.id();
        st.phase = "Running";
        st.state = json!({"running": {"startedAt": started}});
        st.ready = c.readiness_probe.is_none();
        st.ready_since = started.clone();
        rec.lock().unwrap().ready = st.ready;
        write_status(&s, &pod, &st).await;
        s.event(format!("pod {name}: started pid {:?}", child.id()));

        let liveness_period = Duration::from_secs(
            c.liveness_probe
                .as_ref()
                .and_then(|p| p.period_seconds)
                .unwrap_or(10) as u64,
        );
        let liveness_threshold = c
            .liveness_probe
            .as_ref()
            .and_then(|p| p.failure_threshold)
            .unwrap_or(3);
        let mut liveness_at = tokio::time::Instant::now()
            + Duration::from_secs(
                c.liveness_probe
                    .as_ref()
                    .and_then(|p| p.initial_delay_seconds)
                    .unwrap_or(0) as u64,
            );
        let mut liveness_failures = 0;
        let outcome = loop {
            tokio::select! {
                r = child.wait() => break Outcome::Exited(r.unwrap()),
                _ = stopped(&mut stop) => break Outcome::Stop,
                _ = tokio::time::sleep(READINESS_PERIOD) => {
                    if let Some(p) = &c.readiness_probe {
                        let ok = probe(&prepared.netns, &c, p).await;
                        if ok != st.ready {
                            st.ready = ok;
                            st.ready_since = now();
                            rec.lock().unwrap().ready = ok;
                            write_status(&s, &pod, &st).await;
                            s.event(format!("pod {name}: ready {ok}"));
                        }
                    }
                    if let Some(p) = &c.liveness_probe
                        && tokio::time::Instant::now() >= liveness_at
                    {
                        liveness_at += liveness_period;
                        if probe(&prepared.netns, &c, p).await {
                            liveness_failures = 0;
                        } else {
                            liveness_failures += 1;
                            if liveness_failures >= liveness_threshold {
                                break Outcome::Unhealthy;
                            }
                        }
                    }
                }
            }
        };
        let exit = match outcome {
            Outcome::Exited(e) => e,
            Outcome::Unhealthy => {
                s.event(format!("pod {name}: liveness probe failed, killing"));
                terminate(&mut child, grace).await
            }
            Outcome::Stop => {
                let e = terminate(&mut child, grace).await;
                s.event(format!("pod {name}: stopped ({e})"));
                let mut r = rec.lock().unwrap();
                r.exits.push(e.to_string());
                r.pid = None;
                r.stopped = true;
                r.ready = false;
                break;
            }
        };
        {
            let mut r = rec.lock().unwrap();
            r.exits.push(exit.to_string());
            r.pid = None;
            r.ready = false;
        }
        s.event(format!("pod {name}: container exited ({exit})"));
        st.ready = false;
        st.ready_since = now();
        let again = policy == "Always" || (policy == "OnFailure" && !exit.success());
        if !again {
            st.phase = if exit.success() {
                "Succeeded"
            } else {
                "Failed"
            };
            st.state = terminated(&exit, &started);
            write_status(&s, &pod, &st).await;
            stopped(&mut stop).await;
            break;
        }
        st.last = terminated(&exit, &started);
        st.state = json!({"waiting": {"reason": "CrashLoopBackOff",
            "message": format!("back-off {}s restarting failed container", backoff.as_secs())}});
        write_status(&s, &pod, &st).await;
        tokio::select! {
            _ = tokio::time::sleep(backoff) => {},
            _ = stopped(&mut stop) => break,
        }
        backoff = (backoff * 2).min(Duration::from_secs(10));
        st.restarts += 1;
        rec.lock().unwrap().restarts = st.restarts;
    }
    forward.abort();
    finalize(&api, &name, &uid).await;
    let _ = std::fs::remove_dir_all(&prepared.rootfs);
}

/// Network namespaces: one per pod, with only `lo`; entered by the container before exec and
/// by short-lived threads for probes (never by a pooled thread).
mod netns {
    use std::fs::File;
    use std::net::{Ipv4Addr, SocketAddr, TcpStream};
    use std::os::fd::AsRawFd;
    use std::os::raw::{c_int, c_ulong};
    use std::sync::Arc;
    use std::time::Duration;

    unsafe extern "C" {
        fn unshare(flags: c_int) -> c_int;
        fn setns(fd: c_int, nstype: c_int) -> c_int;
        fn kill(pid: c_int, sig: c_int) -> c_int;
        fn prctl(option: c_int, a2: c_ulong, a3: c_ulong, a4: c_ulong, a5: c_ulong) -> c_int;
        fn ioctl(fd: c_int, request: c_ulong, ...) -> c_int;
    }
    const CLONE_NEWNET: c_int = 0x4000_0000;
    const PR_SET_NO_NEW_PRIVS: c_int = 38;
    const SIOCGIFFLAGS: c_ulong = 0x8913;
    const SIOCSIFFLAGS: c_ulong = 0x8914;
    const IFF_UP: i16 = 1;

    #[repr(C)]
    struct IfReq {
        name: [u8; 16],
        flags: i16,
        _pad: [u8; 22],
    }

    fn check(r: c_int) -> std::io::Result<()> {
        if r < 0 {
            Err(std::io::Error::last_os_error())
        } else {
            Ok(())
        }
    }

    /// Moves the calling thread (or process, before exec) into the namespace `fd`.
    pub fn enter(fd: c_int) -> std::io::Result<()> {
        check(unsafe { setns(fd, CLONE_NEWNET) })
    }

    pub fn no_new_privs() -> std::io::Result<()> {
        check(unsafe { prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) })
    }

    pub fn signal(pid: u32, sig: c_int) {
        unsafe { kill(pid as c_int, sig) };
    }

    /// A new network namespace with `lo` up and a listener on 127.0.0.1:`api_port` inside it
    /// (the API server as the pod sees it), made on a thread of its own that then ends.
    pub fn create(api_port: u16) -> std::io::Result<(File, std::net::TcpListener)> {
        std::thread::spawn(move || {
            check(unsafe { unshare(CLONE_NEWNET) })?;
            let ns = File::open("/proc/thread-self/ns/net")?;
            let sock = std::net::UdpSocket::bind((Ipv4Addr::UNSPECIFIED, 0))?;
            let mut req = IfReq {
                name: [0; 16],
                flags: 0,
                _pad: [0; 22],
            };
            req.name[..2].copy_from_slice(b"lo");
            check(unsafe { ioctl(sock.as_raw_fd(), SIOCGIFFLAGS, &mut req as *mut IfReq) })?;
            req.flags |= IFF_UP;
            check(unsafe { ioctl(sock.as_raw_fd(), SIOCSIFFLAGS, &mut req as *mut IfReq) })?;
            let l = std::net::TcpListener::bind((Ipv4Addr::LOCALHOST, api_port))?;
            l.set_nonblocking(true)?;
            Ok((ns, l))
        })
        .join()
        .expect("network namespace thread")
    }

    /// Forwards every connection to the listener (inside a pod) to the API server on the host's
    /// loopback.
    pub async fn forward(listener: std::net::TcpListener, api_port: u16) {
        let listener = tokio::net::TcpListener::from_std(listener).unwrap();
        let mut conns = tokio::task::JoinSet::new();
        while let Ok((mut inside, _)) = listener.accept().await {
            conns.spawn(async move {
                if let Ok(mut out) =
                    tokio::net::TcpStream::connect((Ipv4Addr::LOCALHOST, api_port)).await
                {
                    let _ = tokio::io::copy_bidirectional(&mut inside, &mut out).await;
                }
            });
        }
    }

    /// A TCP connection to 127.0.0.1:`port` inside the namespace (its socket made on a thread
    /// of its own), for the runtime.
    pub async fn connect(
        ns: &Arc<File>,
        port: u16,
        timeout: Duration,
    ) -> std::io::Result<tokio::net::TcpStream> {
        let ns = ns.try_clone()?;
        let (tx, rx) = tokio::sync::oneshot::channel();
        std::thread::spawn(move || {
            let r = (|| -> std::io::Result<TcpStream> {
                enter(ns.as_raw_fd())?;
                let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
                let s = TcpStream::connect_timeout(&addr, timeout)?;
                s.set_nonblocking(true)?;
                Ok(s)
            })();
            let _ = tx.send(r);
        });
        let s = rx.await.map_err(std::io::Error::other)??;
        tokio::net::TcpStream::from_std(s)
    }

    /// `GET path` over plain HTTP on 127.0.0.1:`port` inside the namespace: the raw response.
    pub async fn http_get(
        ns: &Arc<File>,
        port: u16,
        path: &str,
        timeout: Duration,
    ) -> std::io::Result<String> {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let get = async {
            let mut s = connect(ns, port, timeout).await?;
            s.write_all(
                format!("GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
                    .as_bytes(),
            )
            .await?;
            let mut raw = Vec::new();
            s.read_to_end(&mut raw).await?;
            Ok(String::from_utf8_lossy(&raw).into_owned())
        };
        tokio::time::timeout(timeout, get)
            .await
            .map_err(|_| std::io::Error::new(std::io::ErrorKind::TimedOut, "timed out"))?
    }
}
