//! The controller: watches policies, nodes (metadata only), the GPU Operator namespace's
//! ConfigMaps and the ClusterPolicy into caches; on any change computes one cluster-wide plan with
//! the pure planner and applies only the difference, with server-side apply under one field
//! manager. A steady cluster gets no writes.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use futures::{StreamExt, TryStreamExt, stream};
use k8s_openapi::api::core::v1::{ConfigMap, Node, Pod};
use k8s_openapi::api::resource::v1::ResourceClaimTemplate;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ManagedFieldsEntry, Time};
use kube::api::{Api, DynamicObject, PartialObjectMeta, Patch, PatchParams};
use kube::core::{ApiResource, GroupVersionKind};
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::runtime::finalizer::{self, Event as FinalizerEvent};
use kube::runtime::reflector::{self, Store};
use kube::runtime::{WatchStreamExt, controller::Action, watcher};
use kube::{Client, Resource, ResourceExt};
use serde_json::json;
use tokio::sync::Notify;
use tracing::{debug, info, warn};

use crate::api::crd::{Condition, GpuSharingPolicy, GpuSharingPolicyStatus};
use crate::api::names::*;
use crate::nvidia::{self, MIG_PARTED_KEY};
use crate::plan::{self, NodeFacts, Plan, PlanInput};
use crate::runtime::nodecache::NodeCache;

/// Drift repairs of the ClusterPolicy within this window that make it "contested".
const CONTEST_WINDOW: Duration = Duration::from_secs(600);
const CONTEST_REPAIRS: usize = 3;

/// A pass starts once no watch event has arrived for this long...
const COALESCE_QUIET: Duration = Duration::from_millis(100);
/// ...or this long after the previous pass, whichever comes first.
const COALESCE_MAX: Duration = Duration::from_secs(1);

/// Nodes per list page when the node watch (re)lists.
const NODE_LIST_PAGE: u32 = 100;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("Kubernetes API error: {0}")]
    Kube(#[from] kube::Error),
    #[error("finalizer: {0}")]
    Finalizer(#[source] Box<finalizer::Error<Error>>),
    #[error("policy {0} still has nodes or config keys to clean up")]
    CleanupPending(String),
    #[error("JSON: {0}")]
    Json(#[from] serde_json::Error),
}

/// Settings of `gpu-sharing-operator run`.
#[derive(Debug, Clone)]
pub struct Config {
    /// GPU Operator namespace; detected from the ClusterPolicy status when `None`.
    pub namespace: Option<String>,
    pub device_configmap: String,
    pub mig_configmap: String,
    /// Full resync period (drift is also caught by the watches).
    pub resync: Duration,
    /// Where to count what happens (served on /metrics by the binary).
    pub metrics: Arc<crate::telemetry::metrics::Metrics>,
    /// How long `nvidia.com/mig.config.state=pending` may last before the node is reported
    /// Degraded and left alone.
    pub mig_timeout: Duration,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            namespace: None,
            device_configmap: DEVICE_PLUGIN_CONFIGMAP.into(),
            mig_configmap: MIG_PARTED_CONFIGMAP.into(),
            resync: Duration::from_secs(300),
            metrics: Arc::default(),
            mig_timeout: Duration::from_secs(600),
        }
    }
}

/// The ClusterPolicy resource (GPU Operator, `nvidia.com/v1`, cluster-scoped).
pub fn cluster_policy_resource() -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("nvidia.com", "v1", "ClusterPolicy"),
        "clusterpolicies",
    )
}

/// Leaf paths under `f:spec` our field manager owns on the ClusterPolicy.
fn owned_spec_paths(entries: &[ManagedFieldsEntry]) -> BTreeSet<String> {
    fn walk(v: &serde_json::Value, prefix: &str, out: &mut BTreeSet<String>) {
        match v.as_object() {
            Some(m) if !m.is_empty() => {
                for (k, c) in m {
                    if let Some(name) = k.strip_prefix("f:") {
                        walk(c, &format!("{prefix}.{name}"), out);
                    }
                }
            }
            _ => {
                out.insert(prefix.to_string());
            }
        }
    }
    let mut out = BTreeSet::new();
    for e in entries.iter().filter(|e| {
        e.manager.as_deref() == Some(MANAGER) && e.operation.as_deref() == Some("Apply")
    }) {
        if let Some(spec) = e.fields_v1.as_ref().and_then(|f| f.0.get("f:spec")) {
            walk(spec, "spec", &mut out);
        }
    }
    out
}

fn leaf_paths(v: &serde_json::Value, prefix: &str, out: &mut BTreeMap<String, serde_json::Value>) {
    match v.as_object() {
        Some(m) if !m.is_empty() => {
            for (k, c) in m {
                leaf_paths(c, &format!("{prefix}.{k}"), out);
            }
        }
        _ => {
            out.insert(prefix.to_string(), v.clone());
        }
    }
}

fn lookup<'a>(v: &'a serde_json::Value, path: &str) -> Option<&'a serde_json::Value> {
    path.split('.').skip(1).try_fold(v, |acc, k| acc.get(k))
}

/// Shared state of the running controller.
pub struct Context {
    pub client: Client,
    pub config: Config,
    pub namespace: String,
    policies: Store<GpuSharingPolicy>,
    nodes: Arc<NodeCache>,
    configmaps: Store<ConfigMap>,
    pods: Store<Pod>,
    cluster_policies: Option<Store<DynamicObject>>,
    /// Our ResourceClaimTemplates (DRA backend), when resource.k8s.io/v1 is served.
    claim_templates: Option<Store<ResourceClaimTemplate>>,
    recorder: Recorder,
    /// ClusterPolicy fields this process has applied: a later change by someone else is drift.
    cluster_policy_applied: std::sync::Mutex<BTreeSet<String>>,
    /// Since when each node has reported MIG state pending, for which layout.
    mig_pending_since: std::sync::Mutex<BTreeMap<String, (String, std::time::Instant)>>,
    /// When we had to put our ClusterPolicy settings back (drift repairs), for contest detection.
    cluster_policy_repairs: std::sync::Mutex<Vec<(std::time::Instant, String)>>,
}

/// Finds the GPU Operator's namespace: the `status.namespace` of the oldest (active)
/// ClusterPolicy.
pub async fn detect_namespace(client: &Client) -> Option<String> {
    let api: Api<DynamicObject> = Api::all_with(client.clone(), &cluster_policy_resource());
    let list = api.list(&Default::default()).await.ok()?;
    let mut items = list.items;
    items.sort_by_key(|o| (o.metadata.creation_timestamp.clone(), o.name_any()));
    items.first().and_then(|o| {
        o.data
            .get("status")?
            .get("namespace")?
            .as_str()
            .map(String::from)
    })
}

/// Runs the controller until the future is dropped.
pub async fn run(
    client: Client,
    config: Config,
    shutdown: impl std::future::Future<Output = ()>,
) -> Result<(), Error> {
    let cp_api: Api<DynamicObject> = Api::all_with(client.clone(), &cluster_policy_resource());
    let cluster_policy_served = cp_api.list(&Default::default()).await.is_ok();
    let namespace = match &config.namespace {
        Some(n) => n.clone(),
        None => match detect_namespace(&client).await {
            Some(n) => {
                info!(namespace = %n, "GPU Operator namespace detected from the ClusterPolicy status");
                n
            }
            None => {
                warn!(
                    "no ClusterPolicy with status.namespace found; using gpu-operator (pass --namespace to choose)"
                );
                "gpu-operator".into()
            }
        },
    };
    let notify = Arc::new(Notify::new());

    let (policies, pw) = reflector::store();
    let nodes = Arc::new(NodeCache::new(MANAGER));
    let (configmaps, cw) = reflector::store();
    let (pods, podw) = reflector::store();

    let policy_stream = reflector::reflector(
        pw,
        watcher(
            Api::<GpuSharingPolicy>::all(client.clone()),
            watcher::Config::default(),
        )
        .default_backoff(),
    )
    .boxed();
    // Node cache: only what the planner reads, built from each event (see nodecache).
    let node_stream = {
        let nodes = nodes.clone();
        watcher(
            Api::<PartialObjectMeta<Node>>::all(client.clone()),
            // Small list pages: a page of nodes with all their managedFields is decoded at
            // once before it is reduced to facts.
            watcher::Config::default().page_size(NODE_LIST_PAGE),
        )
        .default_backoff()
        .map_ok(move |ev| nodes.apply(ev))
        .boxed()
    };
    let cm_stream = reflector::reflector(
        cw,
        watcher(
            Api::<ConfigMap>::namespaced(client.clone(), &namespace),
            watcher::Config::default(),
        )
        .default_backoff(),
    )
    .boxed();
    // Pods that may hold GPUs (MIG changes wait for idle GPUs): only bound, unfinished pods,
    // stripped to what the check needs.
    let pod_stream = reflector::reflector(
        podw,
        watcher(
            Api::<Pod>::all(client.clone()),
            watcher::Config::default()
                .fields("spec.nodeName!=,status.phase!=Succeeded,status.phase!=Failed"),
        )
        .default_backoff()
        .modify(|p: &mut Pod| {
            p.metadata.managed_fields = None;
            p.metadata.annotations = None;
            p.metadata.labels = None;
            p.metadata.owner_references = None;
            p.status = None;
            if let Some(spec) = p.spec.as_mut() {
                spec.volumes = None;
                spec.init_containers = None;
                spec.affinity = None;
                spec.tolerations = None;
                for c in &mut spec.containers {
                    c.env = None;
                    c.command = None;
                    c.args = None;
                    c.volume_mounts = None;
                    c.ports = None;
                    c.liveness_probe = None;
                    c.readiness_probe = None;
                    c.startup_probe = None;
                }
            }
        }),
    )
    .boxed();
    let mut streams = vec![
        pod_stream.map_ok(|_| ()).boxed(),
        policy_stream.map_ok(|_| ()).boxed(),
        node_stream.map_ok(|_| ()).boxed(),
        cm_stream.map_ok(|_| ()).boxed(),
    ];
    // ResourceClaimTemplates we own, in any namespace (resource.k8s.io/v1, Kubernetes 1.34+).
    let rct_api: Api<ResourceClaimTemplate> = Api::all(client.clone());
    let managed = format!("{}={}", MANAGED_BY.0, MANAGED_BY.1);
    let claim_templates = if rct_api
        .list(&kube::api::ListParams::default().labels(&managed).limit(1))
        .await
        .is_ok()
    {
        let (store, w) = reflector::store();
        streams.push(
            reflector::reflector(
                w,
                watcher(rct_api, watcher::Config::default().labels(&managed)).default_backoff(),
            )
            .map_ok(|_| ())
            .boxed(),
        );
        Some(store)
    } else {
        warn!(
            "resource.k8s.io/v1 ResourceClaimTemplates are not served: policies with backend dra cannot be applied"
        );
        None
    };
    let cluster_policies = if cluster_policy_served {
        let cpw = reflector::store::Writer::new(cluster_policy_resource());
        let cps = cpw.as_reader();
        streams.push(
            reflector::reflector(
                cpw,
                watcher(cp_api, watcher::Config::default()).default_backoff(),
            )
            .map_ok(|_| ())
            .boxed(),
        );
        Some(cps)
    } else {
        warn!(
            "the ClusterPolicy CRD (nvidia.com/v1) is not served: nodes are labelled, but no device plugin reads the config"
        );
        None
    };
    let events = {
        let notify = notify.clone();
        stream::select_all(streams).for_each(move |r| {
            if let Err(e) = r {
                warn!(error = %e, "watch error");
            }
            notify.notify_one();
            futures::future::ready(())
        })
    };

    let recorder = Recorder::new(
        client.clone(),
        Reporter {
            controller: MANAGER.into(),
            instance: std::env::var("POD_NAME").ok(),
        },
    );
    let ctx = Arc::new(Context {
        client,
        config,
        namespace,
        policies,
        nodes,
        configmaps,
        pods,
        cluster_policies,
        claim_templates,
        cluster_policy_repairs: Default::default(),
        mig_pending_since: Default::default(),
        cluster_policy_applied: Default::default(),
        recorder,
    });
    let loop_ctx = ctx.clone();
    let control = async move {
        loop_ctx.policies.wait_until_ready().await.ok();
        loop_ctx.nodes.wait_until_ready().await;
        loop_ctx.configmaps.wait_until_ready().await.ok();
        loop_ctx.pods.wait_until_ready().await.ok();
        if let Some(c) = &loop_ctx.cluster_policies {
            c.wait_until_ready().await.ok();
        }
        if let Some(c) = &loop_ctx.claim_templates {
            c.wait_until_ready().await.ok();
        }
        info!(namespace = %loop_ctx.namespace, "caches ready; reconciling");
        let mut backoff = Duration::from_millis(500);
        loop {
            let started = std::time::Instant::now();
            let result = reconcile_all(&loop_ctx).await;
            loop_ctx
                .config
                .metrics
                .observe_reconcile(started.elapsed(), result.is_ok());
            loop_ctx
                .config
                .metrics
                .ready
                .store(true, std::sync::atomic::Ordering::Relaxed);
            match result {
                Ok(requeue) => {
                    backoff = Duration::from_millis(500);
                    let wait = if requeue {
                        Duration::from_secs(2)
                    } else {
                        loop_ctx.config.resync
                    };
                    tokio::select! {
                        _ = notify.notified() => {},
                        _ = tokio::time::sleep(wait) => {},
                    }
                }
                Err(e) => {
                    warn!(error = %e, retry_in = ?backoff, "reconcile failed");
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(60));
                }
            }
            // Coalesce bursts of watch events (`kubectl apply -f dir/`, a relabel of many
            // nodes) into one pass: wait until the watches are quiet, within a bound.
            let deadline = tokio::time::Instant::now() + COALESCE_MAX;
            loop {
                tokio::select! {
                    _ = notify.notified() => {
                        if tokio::time::Instant::now() >= deadline {
                            break;
                        }
                    }
                    _ = tokio::time::sleep(COALESCE_QUIET) => break,
                }
            }
        }
    };
    tokio::select! {
        _ = events => warn!("watch streams ended"),
        _ = control => {},
        _ = shutdown => info!("shutting down"),
    }
    Ok(())
}

impl Context {
    fn plan_input(&self) -> PlanInput {
        let policies: Vec<GpuSharingPolicy> = self
            .policies
            .state()
            .iter()
            .map(|p| (**p).clone())
            .collect();
        let mut gpu_pods: BTreeMap<String, Vec<String>> = BTreeMap::new();
        for p in self.pods.state() {
            let Some(spec) = &p.spec else { continue };
            let Some(node) = &spec.node_name else {
                continue;
            };
            let uses_gpu = spec.containers.iter().any(|c| {
                let r = c.resources.as_ref();
                let keys = r
                    .and_then(|r| r.limits.as_ref())
                    .into_iter()
                    .chain(r.and_then(|r| r.requests.as_ref()))
                    .flat_map(|m| m.keys());
                keys.into_iter()
                    .any(|k| k.starts_with("nvidia.com/gpu") || k.starts_with("nvidia.com/mig-"))
            });
            if uses_gpu {
                gpu_pods.entry(node.clone()).or_default().push(format!(
                    "{}/{}",
                    p.namespace().unwrap_or_default(),
                    p.name_any()
                ));
            }
        }
        for v in gpu_pods.values_mut() {
            v.sort();
        }
        let cms = self.configmaps.state();
        let current_device_config = cms
            .iter()
            .find(|c| c.name_any() == self.config.device_configmap)
            .and_then(|c| c.data.clone())
            .unwrap_or_default()
            .into_iter()
            .collect();
        let base_mig_configs = cms
            .iter()
            .find(|c| c.name_any() == DEFAULT_MIG_CONFIGMAP)
            .and_then(|c| c.data.as_ref()?.get(MIG_PARTED_KEY).cloned())
            .and_then(|t| nvidia::parse_mig_configs(&t).ok());
        let current_mig_configs = cms
            .iter()
            .find(|c| c.name_any() == self.config.mig_configmap)
            .and_then(|c| c.data.as_ref()?.get(MIG_PARTED_KEY).cloned())
            .and_then(|t| nvidia::parse_mig_configs(&t).ok())
            .unwrap_or_default();
        let mut input = PlanInput::new(policies, vec![]);
        input.nodes = self.nodes.snapshot();
        input.current_mig_configs = current_mig_configs;
        input.now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs() as i64);
        input.gpu_pods = gpu_pods;
        input.current_device_config = current_device_config;
        input.base_mig_configs = base_mig_configs;
        input.cluster_policy_found = self.active_cluster_policy().is_some();
        input.cluster_policy_contested = self.contested();
        input.mig_stuck = self.mig_stuck(&input.nodes);
        input.device_configmap_name = self.config.device_configmap.clone();
        input.mig_configmap_name = self.config.mig_configmap.clone();
        input
    }

    /// The oldest ClusterPolicy: the GPU Operator ignores the others.
    fn active_cluster_policy(&self) -> Option<Arc<DynamicObject>> {
        let mut all = self.cluster_policies.as_ref()?.state();
        all.sort_by_key(|o| (o.metadata.creation_timestamp.clone(), o.name_any()));
        all.into_iter().next()
    }

    /// Nodes pending for the same layout for longer than the MIG timeout.
    fn mig_stuck(&self, nodes: &[Arc<NodeFacts>]) -> BTreeSet<String> {
        let mut since = self.mig_pending_since.lock().expect("pending lock");
        let mut stuck = BTreeSet::new();
        let mut seen = BTreeSet::new();
        for n in nodes {
            if n.labels.get(LABEL_MIG_STATE) != Some("pending") {
                continue;
            }
            let layout = n
                .labels
                .get(LABEL_MIG_CONFIG)
                .map(str::to_string)
                .unwrap_or_default();
            seen.insert(n.name.clone());
            let entry = since
                .entry(n.name.clone())
                .or_insert_with(|| (layout.clone(), std::time::Instant::now()));
            if entry.0 != layout {
                *entry = (layout, std::time::Instant::now());
            }
            if entry.1.elapsed() > self.config.mig_timeout {
                stuck.insert(n.name.clone());
            }
        }
        since.retain(|k, _| seen.contains(k));
        stuck
    }

    /// Reverted by someone else at least 3 times in 10 minutes: a fight, not a one-off edit.
    fn contested(&self) -> Option<String> {
        let mut repairs = self.cluster_policy_repairs.lock().expect("repairs lock");
        repairs.retain(|(t, _)| t.elapsed() < CONTEST_WINDOW);
        (repairs.len() >= CONTEST_REPAIRS).then(|| {
            format!(
                "{} reverts in the last {} minutes, last: {}",
                repairs.len(),
                CONTEST_WINDOW.as_secs() / 60,
                repairs.last().map(|(_, d)| d.as_str()).unwrap_or_default()
            )
        })
    }

    fn count_write(&self, kind: &str) {
        self.config.metrics.count_write(kind);
    }

    async fn event(&self, policy: &GpuSharingPolicy, type_: EventType, reason: &str, note: String) {
        let ev = Event {
            type_,
            reason: reason.into(),
            note: Some(note),
            action: "Reconcile".into(),
            secondary: None,
        };
        // Off the critical path: a slow events API never delays the next write.
        let recorder = self.recorder.clone();
        let reference = policy.object_ref(&());
        tokio::spawn(async move {
            if let Err(e) = recorder.publish(&ev, &reference).await {
                debug!(error = %e, "event not published");
            }
        });
    }
}

fn record_plan_metrics(ctx: &Context, input: &PlanInput, plan: &Plan) {
    let strategy_of: BTreeMap<String, &str> = input
        .policies
        .iter()
        .map(|p| (p.name_any(), p.spec.strategy.as_str()))
        .collect();
    let mut per_strategy: BTreeMap<String, u64> = BTreeMap::new();
    for labels in plan.node_labels.values() {
        if let Some(s) = labels.get(LABEL_POLICY).and_then(|p| strategy_of.get(p)) {
            *per_strategy.entry(s.to_string()).or_default() += 1;
        }
    }
    ctx.config.metrics.set_nodes_per_strategy(per_strategy);
    let conflicted = plan
        .statuses
        .values()
        .filter(|s| s.conflicting_nodes > 0)
        .count() as u64;
    let m = &ctx.config.metrics;
    m.conflicted_policies
        .store(conflicted, std::sync::atomic::Ordering::Relaxed);
    m.cached_nodes.store(
        input.nodes.len() as u64,
        std::sync::atomic::Ordering::Relaxed,
    );
    m.cached_label_strings.store(
        ctx.nodes.strings() as u64,
        std::sync::atomic::Ordering::Relaxed,
    );
}

/// Applies a ConfigMap when its data or our labels differ from the cache.
async fn apply_configmap(
    ctx: &Context,
    name: &str,
    kind: &str,
    data: &BTreeMap<String, String>,
    why: &str,
) -> Result<bool, Error> {
    let current = ctx
        .configmaps
        .state()
        .into_iter()
        .find(|c| c.name_any() == name);
    let same = current.as_ref().is_some_and(|c| {
        let cur: BTreeMap<String, String> =
            c.data.clone().unwrap_or_default().into_iter().collect();
        let labels = c.labels();
        cur == *data
            && labels.get(MANAGED_BY.0).map(String::as_str) == Some(MANAGED_BY.1)
            && labels.get(CONFIG_LABEL).map(String::as_str) == Some(kind)
    });
    if same {
        return Ok(false);
    }
    let obj = plan::configmap(name, &ctx.namespace, kind, data);
    let api: Api<ConfigMap> = Api::namespaced(ctx.client.clone(), &ctx.namespace);
    api.patch(
        name,
        &PatchParams::apply(MANAGER).force(),
        &Patch::Apply(&obj),
    )
    .await?;
    ctx.count_write("ConfigMap");
    info!(configmap = %format!("{}/{name}", ctx.namespace), keys = data.len(), reason = why, "applied ConfigMap");
    Ok(true)
}

/// Whether the node's labels and annotations already are what we want to own.
fn node_in_sync(
    node: &NodeFacts,
    desired: &BTreeMap<String, String>,
    desired_annotations: &BTreeMap<String, String>,
) -> bool {
    let owned: BTreeSet<&String> = node
        .owned
        .iter()
        .filter(|k| MANAGED_LABELS.contains(&k.as_str()))
        .collect();
    let want: BTreeSet<&String> = desired.keys().collect();
    let owned_annotations: BTreeSet<&String> = node.owned_annotations.iter().collect();
    let want_annotations: BTreeSet<&String> = desired_annotations.keys().collect();
    owned == want
        && desired.iter().all(|(k, v)| node.labels.get(k) == Some(v))
        && owned_annotations == want_annotations
        && desired_annotations
            .iter()
            .all(|(k, v)| node.annotations.get(k) == Some(v))
}

/// One pass: plan, then apply the difference in a safe order. Returns whether something is
/// still in progress (then the caller re-checks soon even without watch events).
pub async fn reconcile_all(ctx: &Context) -> Result<bool, Error> {
    let input = ctx.plan_input();
    let plan = plan::plan(&input);
    record_plan_metrics(ctx, &input, &plan);
    let writes_before = ctx.config.metrics.writes_total();
    // What the writes below need of the input, taken now: the pass then holds no node facts
    // while it writes, so the cache can let each node's old facts go as the watch reports our
    // label changes (otherwise a first pass over every node holds two copies of all of them).
    let has_policies = !input.policies.is_empty();
    let changes: Vec<String> = input
        .nodes
        .iter()
        .filter(|node| {
            let none = BTreeMap::new();
            let annotations = plan.node_annotations.get(&node.name).unwrap_or(&none);
            plan.node_labels
                .get(&node.name)
                .is_some_and(|want| !node_in_sync(node, want, annotations))
        })
        .map(|node| node.name.clone())
        .collect();
    let cleanup_pending = cleanup_pending(&input, &plan);
    drop(input);

    // 1. ConfigMaps first: a key exists before any node label points to it. With no policy and
    // no ConfigMap yet there is nothing to write.
    let cm_exists = ctx
        .configmaps
        .state()
        .iter()
        .any(|c| c.name_any() == ctx.config.device_configmap);
    if cm_exists || has_policies {
        apply_configmap(
            ctx,
            &ctx.config.device_configmap,
            "device-plugin",
            &plan.device_config,
            "policies changed",
        )
        .await?;
    }
    if let Some(m) = &plan.mig_config {
        let mut data = BTreeMap::new();
        data.insert(MIG_PARTED_KEY.to_string(), m.clone());
        apply_configmap(
            ctx,
            &ctx.config.mig_configmap,
            "mig-parted",
            &data,
            "custom MIG layouts changed",
        )
        .await?;
    }

    // 2. The ClusterPolicy points at our ConfigMaps.
    apply_cluster_policy(ctx, &plan).await?;

    // 3. Node labels, concurrently.
    let nodes_api: Api<Node> = Api::all(ctx.client.clone());
    let plan_ref = &plan;
    type Labelled<'a> = (String, &'a BTreeMap<String, String>);
    let results: Vec<Result<Labelled, Error>> = stream::iter(changes)
        .map(|name: String| {
            let api = nodes_api.clone();
            let labels = &plan_ref.node_labels[&name];
            let annotations = plan_ref.node_annotations.get(&name);
            async move {
                let obj = json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": labels, "annotations": annotations.cloned().unwrap_or_default()}});
                api.patch(&name, &PatchParams::apply(MANAGER).force(), &Patch::Apply(&obj)).await?;
                Ok((name, labels))
            }
        })
        .buffer_unordered(16)
        .collect()
        .await;
    let mut first_err = None;
    let mut done = Vec::new();
    for r in results {
        match r {
            Ok(ok) => done.push(ok),
            Err(e) => first_err = first_err.or(Some(e)),
        }
    }
    let mut labelled: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    for (name, labels) in &done {
        ctx.count_write("Node");
        let policy = labels.get(LABEL_POLICY).map_or("", String::as_str);
        info!(node = %name, labels = ?labels, policy = %policy, "applied node labels");
        labelled.entry(policy).or_default().push(name);
    }
    let policies: BTreeMap<String, Arc<GpuSharingPolicy>> = ctx
        .policies
        .state()
        .into_iter()
        .map(|p| (p.name_any(), p))
        .collect();
    for (policy, nodes) in &labelled {
        if let Some(p) = policies.get(*policy) {
            let shown: Vec<&str> = nodes.iter().take(10).copied().collect();
            ctx.event(
                p,
                EventType::Normal,
                "NodesLabelled",
                format!("labelled {} nodes: {}", nodes.len(), shown.join(", ")),
            )
            .await;
        }
    }
    if let Some(e) = first_err {
        return Err(e);
    }

    // 3b. ResourceClaimTemplates of DRA policies.
    apply_claim_templates(ctx, &plan).await?;

    // 4. The mig-parted ConfigMap goes only once nothing points to it.
    if plan.mig_config.is_none() {
        let exists = ctx
            .configmaps
            .state()
            .iter()
            .any(|c| c.name_any() == ctx.config.mig_configmap);
        let referenced = ctx.active_cluster_policy().is_some_and(|cp| {
            lookup(&cp.data, ".spec.migManager.config.name").and_then(|v| v.as_str())
                == Some(ctx.config.mig_configmap.as_str())
        });
        if exists && !referenced {
            let api: Api<ConfigMap> = Api::namespaced(ctx.client.clone(), &ctx.namespace);
            api.delete(&ctx.config.mig_configmap, &Default::default())
                .await?;
            ctx.count_write("ConfigMap");
            info!(configmap = %ctx.config.mig_configmap, "deleted mig-parted ConfigMap: no custom layout left");
        }
    }

    // 5. Finalizers and status. A pass that changed something writes no status: the watch
    // events of its own writes bring the next pass at once, and that one reports the outcome
    // (one status write per change instead of an intermediate one).
    let changed_this_pass = ctx.config.metrics.writes_total() > writes_before;
    let mut in_progress = changed_this_pass
        || !plan.node_labels.is_empty()
            && plan
                .statuses
                .values()
                .any(|s| s.applied_nodes < s.matched_nodes - s.conflicting_nodes);
    let cleanup_ref = &cleanup_pending;
    let jobs: Vec<Arc<GpuSharingPolicy>> = policies.values().cloned().collect();
    let results: Vec<Result<bool, Error>> = stream::iter(jobs)
        .map(move |p: Arc<GpuSharingPolicy>| async move {
            let mut pending = false;
            match finalize(ctx, p.clone(), cleanup_ref).await {
                Ok(_) => {}
                Err(Error::Finalizer(e))
                    if matches!(
                        *e,
                        finalizer::Error::CleanupFailed(Error::CleanupPending(_))
                    ) =>
                {
                    pending = true;
                }
                Err(e) => return Err(e),
            }
            if p.metadata.deletion_timestamp.is_none()
                && !changed_this_pass
                && let Some(s) = plan_ref.statuses.get(&p.name_any())
            {
                write_status(ctx, &p, s.clone()).await?;
            }
            Ok(pending)
        })
        .buffer_unordered(16)
        .collect()
        .await;
    for r in results {
        in_progress |= r?;
    }
    Ok(in_progress)
}

/// Policies being deleted whose node labels or config keys are still there (in the state this
/// pass planned from, or in its plan).
fn cleanup_pending(input: &PlanInput, plan: &Plan) -> BTreeSet<String> {
    input
        .policies
        .iter()
        .filter(|p| p.metadata.deletion_timestamp.is_some())
        .map(|p| p.name_any())
        .filter(|name| {
            let labelled = input.nodes.iter().any(|n| {
                n.labels.get(LABEL_POLICY) == Some(name.as_str())
                    || n.labels
                        .get(LABEL_DEVICE_PLUGIN_CONFIG)
                        .is_some_and(|k| is_key_of(name, k))
            });
            let keys_left = input
                .current_device_config
                .keys()
                .chain(plan.device_config.keys())
                .any(|k| is_key_of(name, k));
            labelled || keys_left
        })
        .collect()
}

async fn finalize(
    ctx: &Context,
    p: Arc<GpuSharingPolicy>,
    cleanup_pending: &BTreeSet<String>,
) -> Result<Action, Error> {
    let api: Api<GpuSharingPolicy> = Api::all(ctx.client.clone());
    let name = p.name_any();
    finalizer::finalizer(&api, FINALIZER, p.clone(), |event| async move {
        match event {
            FinalizerEvent::Apply(_) => Ok(Action::await_change()),
            FinalizerEvent::Cleanup(p) => {
                // Done when no node carries its labels, no config key of its remains and no
                // claim template of its is left.
                let templates_left = ctx.claim_templates.as_ref().is_some_and(|s| {
                    s.state()
                        .iter()
                        .any(|t| t.labels().get(LABEL_POLICY) == Some(&name))
                });
                if cleanup_pending.contains(&name) || templates_left {
                    return Err(Error::CleanupPending(name.clone()));
                }
                ctx.event(
                    &p,
                    EventType::Normal,
                    "CleanedUp",
                    "removed node labels and config keys; finalizer released".into(),
                )
                .await;
                info!(policy = %name, "cleanup complete");
                Ok(Action::await_change())
            }
        }
    })
    .await
    .map_err(|e| Error::Finalizer(Box::new(e)))
}

/// Whether a device-plugin ConfigMap key is one of this policy's (`<name>-<8 hex>`).
fn is_key_of(policy: &str, key: &str) -> bool {
    key.strip_prefix(policy)
        .and_then(|r| r.strip_prefix('-'))
        .is_some_and(|h| h.len() == 8 && h.bytes().all(|b| b.is_ascii_hexdigit()))
}

/// Whether `have` holds everything in `want` (the API server adds defaults, e.g. allocationMode).
fn json_contains(have: &serde_json::Value, want: &serde_json::Value) -> bool {
    match (have, want) {
        (serde_json::Value::Object(h), serde_json::Value::Object(w)) => w
            .iter()
            .all(|(k, v)| h.get(k).is_some_and(|hv| json_contains(hv, v))),
        (serde_json::Value::Array(h), serde_json::Value::Array(w)) => {
            h.len() == w.len() && h.iter().zip(w).all(|(a, b)| json_contains(a, b))
        }
        _ => have == want,
    }
}

/// Creates, updates and deletes our ResourceClaimTemplates to match the plan. Their spec is
/// immutable, so a changed template is deleted and created again (claims are only made from it
/// when pods are created, so existing pods keep theirs).
async fn apply_claim_templates(ctx: &Context, plan: &Plan) -> Result<(), Error> {
    let Some(store) = &ctx.claim_templates else {
        return Ok(());
    };
    let current: BTreeMap<String, Arc<ResourceClaimTemplate>> = store
        .state()
        .into_iter()
        .map(|t| {
            (
                format!("{}/{}", t.namespace().unwrap_or_default(), t.name_any()),
                t,
            )
        })
        .collect();
    for (id, want) in &plan.claim_templates {
        let (ns, name) = id.split_once('/').expect("namespace/name");
        let same = current.get(id).is_some_and(|cur| {
            let cur_spec = serde_json::to_value(&cur.spec).unwrap_or_default();
            json_contains(&cur_spec, &want["spec"])
                && cur.labels().get(LABEL_POLICY).map(String::as_str)
                    == want["metadata"]["labels"][LABEL_POLICY].as_str()
        });
        if same {
            continue;
        }
        let api: Api<ResourceClaimTemplate> = Api::namespaced(ctx.client.clone(), ns);
        if current.contains_key(id) {
            api.delete(name, &Default::default()).await?;
            ctx.count_write("ResourceClaimTemplate");
        }
        match api
            .patch(
                name,
                &PatchParams::apply(MANAGER).force(),
                &Patch::Apply(want),
            )
            .await
        {
            Ok(_) => {
                ctx.count_write("ResourceClaimTemplate");
                info!(template = %id, reason = "DRA policy changed", "applied ResourceClaimTemplate");
            }
            Err(kube::Error::Api(e)) if e.code == 404 => {
                warn!(template = %id, "namespace does not exist; the ResourceClaimTemplate waits for it");
            }
            Err(e) => return Err(e.into()),
        }
    }
    for (id, cur) in &current {
        if plan.claim_templates.contains_key(id) {
            continue;
        }
        let api: Api<ResourceClaimTemplate> =
            Api::namespaced(ctx.client.clone(), &cur.namespace().unwrap_or_default());
        api.delete(&cur.name_any(), &Default::default()).await?;
        ctx.count_write("ResourceClaimTemplate");
        info!(template = %id, reason = "no policy renders it any more", "deleted ResourceClaimTemplate");
    }
    Ok(())
}

/// Keeps `lastTransitionTime` of conditions whose status did not change.
fn merge_conditions(old: &[Condition], new: &mut [Condition], now: &Time) {
    for c in new.iter_mut() {
        let prev = old.iter().find(|o| o.type_ == c.type_);
        c.last_transition_time = match prev {
            Some(o) if o.status == c.status => {
                o.last_transition_time.clone().or_else(|| Some(now.clone()))
            }
            _ => Some(now.clone()),
        };
    }
}

async fn write_status(
    ctx: &Context,
    p: &GpuSharingPolicy,
    mut status: GpuSharingPolicyStatus,
) -> Result<(), Error> {
    let old = p.status.clone().unwrap_or_default();
    let now = Time(k8s_openapi::jiff::Timestamp::now());
    merge_conditions(&old.conditions, &mut status.conditions, &now);
    if old == status {
        return Ok(());
    }
    let api: Api<GpuSharingPolicy> = Api::all(ctx.client.clone());
    let obj = json!({
        "apiVersion": GpuSharingPolicy::api_version(&()),
        "kind": GpuSharingPolicy::kind(&()),
        "status": status,
    });
    api.patch_status(
        &p.name_any(),
        &PatchParams::apply(MANAGER).force(),
        &Patch::Apply(&obj),
    )
    .await?;
    ctx.count_write("GpuSharingPolicyStatus");
    debug!(policy = %p.name_any(), "status updated");
    // Events for condition changes.
    for c in &status.conditions {
        let before = old.conditions.iter().find(|o| o.type_ == c.type_);
        if before.is_none_or(|b| b.status != c.status || b.reason != c.reason) {
            let bad = matches!(
                (c.type_.as_str(), c.status.as_str()),
                ("Accepted", "False") | ("Conflicted", "True") | ("Degraded", "True")
            );
            if bad || c.type_ == "Ready" {
                let t = if bad {
                    EventType::Warning
                } else {
                    EventType::Normal
                };
                ctx.event(
                    p,
                    t,
                    c.reason.as_str(),
                    format!("{}={}: {}", c.type_, c.status, c.message),
                )
                .await;
            }
        }
    }
    Ok(())
}

async fn apply_cluster_policy(ctx: &Context, plan: &Plan) -> Result<(), Error> {
    let Some(cp) = ctx.active_cluster_policy() else {
        return Ok(());
    };
    let mut want = BTreeMap::new();
    leaf_paths(&json!({"spec": plan.cluster_policy_spec}), "", &mut want);
    // `leaf_paths` of an empty spec yields ".spec" -> {}: nothing to own.
    want.retain(|_, v| !v.as_object().is_some_and(|o| o.is_empty()));
    let want: BTreeMap<String, serde_json::Value> = want
        .into_iter()
        .map(|(k, v)| (k.trim_start_matches('.').to_string(), v))
        .collect();
    let owned = owned_spec_paths(cp.metadata.managed_fields.as_deref().unwrap_or_default());
    let values_ok = want
        .iter()
        .all(|(k, v)| lookup(&cp.data, &format!(".{k}")) == Some(v));
    let owned_ok = owned == want.keys().cloned().collect::<BTreeSet<_>>();
    if values_ok && owned_ok {
        return Ok(());
    }
    // Drift: a field we owned now has another value (a first apply over the Helm defaults is not).
    let drift: Vec<String> = want
        .iter()
        .filter(|(k, _)| {
            ctx.cluster_policy_applied
                .lock()
                .expect("applied lock")
                .contains(*k)
        })
        .filter(|(k, v)| lookup(&cp.data, &format!(".{k}")).is_some_and(|cur| cur != *v))
        .map(|(k, v)| {
            format!(
                "{k}={} (was {})",
                v,
                lookup(&cp.data, &format!(".{k}")).unwrap_or(&serde_json::Value::Null)
            )
        })
        .collect();
    let api: Api<DynamicObject> = Api::all_with(ctx.client.clone(), &cluster_policy_resource());
    let obj = json!({
        "apiVersion": "nvidia.com/v1",
        "kind": "ClusterPolicy",
        "metadata": {"name": cp.name_any()},
        "spec": plan.cluster_policy_spec,
    });
    api.patch(
        &cp.name_any(),
        &PatchParams::apply(MANAGER).force(),
        &Patch::Apply(&obj),
    )
    .await?;
    ctx.count_write("ClusterPolicy");
    ctx.cluster_policy_applied
        .lock()
        .expect("applied lock")
        .extend(want.keys().cloned());
    if drift.is_empty() {
        info!(clusterpolicy = %cp.name_any(), spec = %plan.cluster_policy_spec, "applied ClusterPolicy settings");
    } else {
        warn!(clusterpolicy = %cp.name_any(), drift = ?drift, "ClusterPolicy was changed by someone else; put our settings back");
        ctx.cluster_policy_repairs
            .lock()
            .expect("repairs lock")
            .push((std::time::Instant::now(), drift.join(", ")));
    }
    Ok(())
}
