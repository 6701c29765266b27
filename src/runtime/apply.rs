//! The appliers: each writes only what differs from the caches, with server-side apply under our
//! field manager, and records every write (object and reason) in the pass's [`WriteReport`],
//! from which logs and metrics are fed.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use futures::{StreamExt, stream};
use k8s_openapi::api::core::v1::{ConfigMap, Node};
use k8s_openapi::api::resource::v1::ResourceClaimTemplate;
use kube::ResourceExt;
use kube::api::{Api, DynamicObject, Patch, PatchParams};
use kube::runtime::events::EventType;
use serde_json::json;
use tracing::{debug, info, warn};

use crate::api::names::*;
use crate::nvidia::MIG_PARTED_KEY;
use crate::plan::{self, NodeFacts, Plan};
use crate::runtime::controller::{Context, Error, cluster_policy_resource};
use crate::runtime::managed::owned_leaf_paths;

/// One write to the API server.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Write {
    /// Kind of object (`Node`, `ConfigMap`, `ClusterPolicy`, `ResourceClaimTemplate`,
    /// `GpuSharingPolicyStatus`).
    pub kind: &'static str,
    pub object: String,
    pub reason: String,
}

/// Every write of a pass.
#[derive(Debug, Default, Clone)]
pub struct WriteReport {
    pub writes: Vec<Write>,
}

impl WriteReport {
    pub fn record(
        &mut self,
        kind: &'static str,
        object: impl Into<String>,
        reason: impl Into<String>,
    ) {
        self.writes.push(Write {
            kind,
            object: object.into(),
            reason: reason.into(),
        });
    }

    pub fn is_empty(&self) -> bool {
        self.writes.is_empty()
    }

    /// Writes of one kind.
    pub fn count(&self, kind: &str) -> usize {
        self.writes.iter().filter(|w| w.kind == kind).count()
    }

    /// Writes per kind.
    pub fn by_kind(&self) -> BTreeMap<&'static str, u64> {
        let mut out = BTreeMap::new();
        for w in &self.writes {
            *out.entry(w.kind).or_default() += 1;
        }
        out
    }
}

fn apply_params() -> PatchParams {
    PatchParams::apply(MANAGER).force()
}

/// Applies a ConfigMap when its data or our labels differ from the cache.
async fn apply_configmap(
    ctx: &Context,
    name: &str,
    kind: &str,
    data: &BTreeMap<String, String>,
    why: &str,
    report: &mut WriteReport,
) -> Result<(), Error> {
    let current = ctx.configmap(name);
    let same = current.as_ref().is_some_and(|c| {
        let cur: BTreeMap<String, String> =
            c.data.clone().unwrap_or_default().into_iter().collect();
        let labels = c.labels();
        cur == *data
            && labels.get(MANAGED_BY.0).map(String::as_str) == Some(MANAGED_BY.1)
            && labels.get(CONFIG_LABEL).map(String::as_str) == Some(kind)
    });
    if same {
        return Ok(());
    }
    let obj = plan::configmap(name, &ctx.namespace, kind, data);
    let api: Api<ConfigMap> = Api::namespaced(ctx.client.clone(), &ctx.namespace);
    let missing = &ctx.namespace_missing;
    match api.patch(name, &apply_params(), &Patch::Apply(&obj)).await {
        Ok(_) => missing.store(false, std::sync::atomic::Ordering::Relaxed),
        Err(kube::Error::Api(e)) if e.code == 404 => {
            missing.store(true, std::sync::atomic::Ordering::Relaxed);
            return Err(Error::NamespaceMissing(ctx.namespace.clone()));
        }
        Err(e) => return Err(e.into()),
    }
    let id = format!("{}/{name}", ctx.namespace);
    info!(configmap = %id, keys = data.len(), reason = why, "applied ConfigMap");
    report.record("ConfigMap", id, why);
    Ok(())
}

/// Our ConfigMaps, before anything points to what they hold. With no policy and no ConfigMap
/// yet there is nothing to write.
pub async fn apply_configmaps(
    ctx: &Context,
    plan: &Plan,
    has_policies: bool,
    report: &mut WriteReport,
) -> Result<(), Error> {
    if has_policies || ctx.configmap(&ctx.config.device_configmap).is_some() {
        let name = &ctx.config.device_configmap;
        let why = "policies changed";
        apply_configmap(ctx, name, "device-plugin", &plan.device_config, why, report).await?;
    }
    if let Some(m) = &plan.mig_config {
        let mut data = BTreeMap::new();
        data.insert(MIG_PARTED_KEY.to_string(), m.clone());
        let why = "custom MIG layouts changed";
        apply_configmap(
            ctx,
            &ctx.config.mig_configmap,
            "mig-parted",
            &data,
            why,
            report,
        )
        .await?;
    }
    if let Some(v) = &plan.vgpu_config {
        let mut data = BTreeMap::new();
        data.insert(crate::nvidia::vgpu::VGPU_KEY.to_string(), v.clone());
        let why = "custom vGPU layouts changed";
        let name = &ctx.config.vgpu_configmap;
        apply_configmap(ctx, name, "vgpu-devices", &data, why, report).await?;
    }
    Ok(())
}

/// The vGPU-devices ConfigMap goes only once nothing points to it.
pub async fn delete_unused_vgpu_configmap(
    ctx: &Context,
    plan: &Plan,
    report: &mut WriteReport,
) -> Result<(), Error> {
    if plan.vgpu_config.is_some() {
        return Ok(());
    }
    let name = &ctx.config.vgpu_configmap;
    let exists = ctx.configmap(name).is_some();
    let referenced = ctx.active_cluster_policy().is_some_and(|cp| {
        lookup(&cp.data, ".spec.vgpuDeviceManager.config.name").and_then(|v| v.as_str())
            == Some(name.as_str())
    });
    if exists && !referenced {
        let api: Api<ConfigMap> = Api::namespaced(ctx.client.clone(), &ctx.namespace);
        api.delete(name, &Default::default()).await?;
        let why = "no custom vGPU layout left";
        info!(configmap = %name, reason = why, "deleted vGPU-devices ConfigMap");
        report.record("ConfigMap", format!("{}/{name}", ctx.namespace), why);
    }
    Ok(())
}

/// The mig-parted ConfigMap goes only once nothing points to it.
pub async fn delete_unused_mig_configmap(
    ctx: &Context,
    plan: &Plan,
    report: &mut WriteReport,
) -> Result<(), Error> {
    if plan.mig_config.is_some() {
        return Ok(());
    }
    let name = &ctx.config.mig_configmap;
    let exists = ctx.configmap(name).is_some();
    let referenced = ctx.active_cluster_policy().is_some_and(|cp| {
        lookup(&cp.data, ".spec.migManager.config.name").and_then(|v| v.as_str())
            == Some(name.as_str())
    });
    if exists && !referenced {
        let api: Api<ConfigMap> = Api::namespaced(ctx.client.clone(), &ctx.namespace);
        api.delete(name, &Default::default()).await?;
        let why = "no custom layout left";
        info!(configmap = %name, reason = why, "deleted mig-parted ConfigMap");
        report.record("ConfigMap", format!("{}/{name}", ctx.namespace), why);
    }
    Ok(())
}

/// Whether the node's labels and annotations already are what we want to own.
pub fn node_in_sync(
    node: &NodeFacts,
    desired: &plan::SmallMap,
    desired_annotations: &plan::SmallMap,
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

/// Nodes whose labels or annotations differ from the plan.
pub fn nodes_to_change(nodes: &[Arc<NodeFacts>], plan: &Plan) -> Vec<String> {
    let none = plan::SmallMap::default();
    nodes
        .iter()
        .filter(|node| {
            let annotations = plan.node_annotations.get(&node.name).unwrap_or(&none);
            plan.node_labels
                .get(&node.name)
                .is_some_and(|want| !node_in_sync(node, want, annotations))
        })
        .map(|node| node.name.clone())
        .collect()
}

/// After a failed pass or watch the node cache may lag the server: a write whose response was
/// lost (an API server restart) is already in place while the cache still shows the old label.
/// Re-applying it with a new "config written" time would make the node wait for a GPU Feature
/// Discovery report newer than a write that changed nothing (GFD already reported). So while the
/// caches may lag ([`CacheLag`](crate::runtime::watches::CacheLag)), a node write that stamps a
/// new time reads the node first and keeps the server's time when its device-plugin label
/// already is the planned one.
async fn keep_server_write_time(
    ctx: &Context,
    api: &Api<Node>,
    name: &str,
    labels: &crate::plan::SmallMap,
    mut annotations: crate::plan::SmallMap,
) -> Result<crate::plan::SmallMap, Error> {
    let Some(planned) = labels.get(LABEL_DEVICE_PLUGIN_CONFIG) else {
        return Ok(annotations);
    };
    if !annotations.contains_key(ANNOTATION_CONFIG_WRITTEN) || !ctx.caches.lag.suspect() {
        return Ok(annotations);
    }
    let n = api.get(name).await?;
    let same = n
        .labels()
        .get(LABEL_DEVICE_PLUGIN_CONFIG)
        .map(String::as_str)
        == Some(planned);
    if let (true, Some(t)) = (same, n.annotations().get(ANNOTATION_CONFIG_WRITTEN)) {
        debug!(node = %name, written = %t, "config label already in place: keeping its write time");
        annotations.insert(ANNOTATION_CONFIG_WRITTEN.to_string(), t.clone());
    }
    Ok(annotations)
}

/// Applies our labels and annotations to the nodes that differ (16 at a time), then emits one
/// `NodesLabelled` event per policy. Every successful write is recorded even if another fails.
pub async fn apply_nodes(
    ctx: &Context,
    plan: &Plan,
    changes: Vec<String>,
    report: &mut WriteReport,
) -> Result<(), Error> {
    let api: Api<Node> = Api::all(ctx.client.clone());
    let results: Vec<Result<String, Error>> = stream::iter(changes)
        .map(|name: String| {
            let api = api.clone();
            let labels = &plan.node_labels[&name];
            let annotations = plan
                .node_annotations
                .get(&name)
                .cloned()
                .unwrap_or_default();
            async move {
                let mut annotations = annotations;
                let mut obj = json!({"apiVersion": "v1", "kind": "Node",
                    "metadata": {"name": name, "labels": labels}});
                if annotations.contains_key(ANNOTATION_CORDONED) {
                    // Our cordon rides in the same apply as its annotation; a node someone else
                    // cordoned is drained without claiming (and so never lifting) the cordon.
                    let n = api.get(&name).await?;
                    let unschedulable = n.spec.as_ref().and_then(|s| s.unschedulable) == Some(true);
                    let ours = n.annotations().contains_key(ANNOTATION_CORDONED);
                    if unschedulable && !ours {
                        ctx.foreign_cordons
                            .lock()
                            .expect("cordon lock")
                            .insert(name.clone());
                        annotations = annotations
                            .into_iter()
                            .filter(|(k, _)| k != ANNOTATION_CORDONED)
                            .collect();
                    } else {
                        obj["spec"] = json!({"unschedulable": true});
                    }
                }
                let annotations =
                    keep_server_write_time(ctx, &api, &name, labels, annotations).await?;
                obj["metadata"]["annotations"] = json!(annotations);
                api.patch(&name, &apply_params(), &Patch::Apply(&obj))
                    .await?;
                Ok(name)
            }
        })
        .buffer_unordered(16)
        .collect()
        .await;
    let mut first_err = None;
    let mut labelled: BTreeMap<&str, Vec<String>> = BTreeMap::new();
    for r in results {
        match r {
            Ok(name) => {
                let labels = &plan.node_labels[&name];
                let policy = labels.get(LABEL_POLICY).map_or("", String::as_str);
                info!(node = %name, labels = ?labels, policy = %policy, "applied node labels");
                report.record("Node", name.clone(), format!("policy {policy:?}"));
                labelled.entry(policy).or_default().push(name);
            }
            Err(e) => first_err = first_err.or(Some(e)),
        }
    }
    for (policy, nodes) in &labelled {
        if let Some(p) = ctx.policy(policy) {
            let shown: Vec<&str> = nodes.iter().take(10).map(String::as_str).collect();
            let note = format!("labelled {} nodes: {}", nodes.len(), shown.join(", "));
            ctx.event(&p, EventType::Normal, "NodesLabelled", note)
                .await;
        }
    }
    first_err.map_or(Ok(()), Err)
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
pub async fn apply_claim_templates(
    ctx: &Context,
    plan: &Plan,
    report: &mut WriteReport,
) -> Result<(), Error> {
    let Some(store) = &ctx.caches.claim_templates else {
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
            report.record(
                "ResourceClaimTemplate",
                id.clone(),
                "spec changed: replaced",
            );
        }
        match api.patch(name, &apply_params(), &Patch::Apply(want)).await {
            Ok(_) => {
                let why = "DRA policy changed";
                info!(template = %id, reason = why, "applied ResourceClaimTemplate");
                report.record("ResourceClaimTemplate", id.clone(), why);
            }
            Err(kube::Error::Api(e)) if e.code == 404 => {
                warn!(template = %id, "namespace does not exist; the ResourceClaimTemplate waits for it");
            }
            Err(e) => return Err(e.into()),
        }
    }
    for (id, cur) in current
        .iter()
        .filter(|(id, _)| !plan.claim_templates.contains_key(*id))
    {
        let api: Api<ResourceClaimTemplate> =
            Api::namespaced(ctx.client.clone(), &cur.namespace().unwrap_or_default());
        api.delete(&cur.name_any(), &Default::default()).await?;
        let why = "no policy renders it any more";
        info!(template = %id, reason = why, "deleted ResourceClaimTemplate");
        report.record("ResourceClaimTemplate", id.clone(), why);
    }
    Ok(())
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

/// The ClusterPolicy fields the plan wants us to own, as leaf paths (`spec.mig.strategy`).
fn wanted_cluster_policy_fields(plan: &Plan) -> BTreeMap<String, serde_json::Value> {
    let mut want = BTreeMap::new();
    leaf_paths(&json!({"spec": plan.cluster_policy_spec}), "", &mut want);
    // `leaf_paths` of an empty spec yields ".spec" -> {}: nothing to own.
    want.retain(|_, v| !v.as_object().is_some_and(|o| o.is_empty()));
    want.into_iter()
        .map(|(k, v)| (k.trim_start_matches('.').to_string(), v))
        .collect()
}

/// Points the active ClusterPolicy at our ConfigMaps (and the cluster-wide MIG strategy) when
/// its values or our ownership differ. A field we had applied that someone changed is drift: it
/// is put back, logged as a warning and remembered for contest detection.
pub async fn apply_cluster_policy(
    ctx: &Context,
    plan: &Plan,
    report: &mut WriteReport,
) -> Result<(), Error> {
    let Some(cp) = ctx.active_cluster_policy() else {
        return Ok(());
    };
    let want = wanted_cluster_policy_fields(plan);
    let current = |k: &str| lookup(&cp.data, &format!(".{k}"));
    let owned = owned_leaf_paths(
        cp.metadata.managed_fields.as_deref().unwrap_or_default(),
        MANAGER,
        "spec",
    );
    let values_ok = want.iter().all(|(k, v)| current(k) == Some(v));
    if values_ok && owned == want.keys().cloned().collect::<BTreeSet<_>>() {
        return Ok(());
    }
    // Drift: a field we owned now has another value (a first apply over the Helm defaults is not).
    let applied = ctx
        .cluster_policy_applied
        .lock()
        .expect("applied lock")
        .clone();
    let drift: Vec<String> = want
        .iter()
        .filter(|(k, v)| applied.contains(*k) && current(k).is_some_and(|cur| cur != *v))
        .map(|(k, v)| {
            let was = current(k).unwrap_or(&serde_json::Value::Null);
            format!("{k}={v} (was {was})")
        })
        .collect();
    let api: Api<DynamicObject> = Api::all_with(ctx.client.clone(), &cluster_policy_resource());
    let obj = json!({
        "apiVersion": "nvidia.com/v1",
        "kind": "ClusterPolicy",
        "metadata": {"name": cp.name_any()},
        "spec": plan.cluster_policy_spec,
    });
    api.patch(&cp.name_any(), &apply_params(), &Patch::Apply(&obj))
        .await?;
    ctx.cluster_policy_applied
        .lock()
        .expect("applied lock")
        .extend(want.keys().cloned());
    if drift.is_empty() {
        info!(clusterpolicy = %cp.name_any(), spec = %plan.cluster_policy_spec, "applied ClusterPolicy settings");
        report.record("ClusterPolicy", cp.name_any(), "policies changed");
    } else {
        warn!(clusterpolicy = %cp.name_any(), drift = ?drift, "ClusterPolicy was changed by someone else; put our settings back");
        report.record(
            "ClusterPolicy",
            cp.name_any(),
            format!("drift: {}", drift.join(", ")),
        );
        ctx.cluster_policy_repairs
            .lock()
            .expect("repairs lock")
            .push((std::time::Instant::now(), drift.join(", ")));
    }
    Ok(())
}

/// Removes the readiness taint from the nodes the plan found ready (see `plan::taint`). A node
/// whose taints changed meanwhile is retried on the next pass.
pub async fn remove_readiness_taints(
    ctx: &Context,
    plan: &Plan,
    report: &mut WriteReport,
) -> Result<(), Error> {
    let Some(key) = ctx.config.readiness_taint.as_deref() else {
        return Ok(());
    };
    for node in &plan.untaint {
        match crate::runtime::taints::remove(&ctx.client, node, key).await {
            Ok(true) => {
                info!(%node, taint = key, "removed the readiness taint: sharing config confirmed");
                report.record(
                    "Node",
                    node.clone(),
                    format!("removed readiness taint {key}"),
                );
            }
            Ok(false) => {}
            Err(kube::Error::Api(e)) if matches!(e.code, 404 | 409 | 422) => {
                debug!(%node, error = %e, "readiness taint not removed this pass");
            }
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

/// How long an eviction may wait for its answer before the pass goes on (the next pass tries
/// again). Only a 429 the API server sent is reported as a refusal, never a slow answer.
pub const EVICTION_WAIT: std::time::Duration = std::time::Duration::from_secs(20);

/// An eviction's node, policy, pod and result (`None`: done; else why not).
type Evicted = (String, String, String, Result<Option<String>, Error>);

/// What the API server said when it refused an eviction: its code, reason and message, and
/// the causes it gave (for a PodDisruptionBudget: which budget, and why).
fn refusal(e: &kube::core::Status) -> String {
    let causes: Vec<String> = e
        .details
        .as_ref()
        .map(|d| {
            d.causes
                .iter()
                .map(|c| {
                    if c.reason.is_empty() {
                        c.message.clone()
                    } else {
                        format!("{}: {}", c.reason, c.message)
                    }
                })
                .collect()
        })
        .unwrap_or_default();
    let mut out = format!("eviction refused ({} {}): {}", e.code, e.reason, e.message);
    if !causes.is_empty() {
        out.push_str(&format!(" ({})", causes.join("; ")));
    }
    out
}

/// One eviction: `None` when it went through (or the pod is gone), else why not, as the API
/// server said it (429 while a PodDisruptionBudget forbids it or its status is not computed
/// yet, 500 when several budgets select the pod).
async fn evict_pod(ctx: &Context, id: &str) -> Result<Option<String>, Error> {
    let Some((ns, name)) = id.split_once('/') else {
        return Ok(None);
    };
    let client = ctx
        .config
        .eviction_client
        .as_ref()
        .map_or(&ctx.client, |c| &c.0);
    let pods: Api<k8s_openapi::api::core::v1::Pod> = Api::namespaced(client.clone(), ns);
    let params = kube::api::EvictParams::default();
    let call = pods.evict(name, &params);
    match tokio::time::timeout(EVICTION_WAIT, call).await {
        Ok(Ok(_)) => Ok(None),
        Ok(Err(kube::Error::Api(e))) if e.code == 404 => Ok(None),
        Ok(Err(kube::Error::Api(e))) if matches!(e.code, 429 | 500) => Ok(Some(refusal(&e))),
        Ok(Err(e)) => Err(e.into()),
        Err(_) => Ok(Some(format!(
            "the Eviction API did not answer within {}s; trying again",
            EVICTION_WAIT.as_secs()
        ))),
    }
}

/// Evicts the pods of the nodes being drained through the Eviction API (PodDisruptionBudgets
/// apply), 16 at a time. Returns the evictions refused, by pod, with why: 429 while a budget
/// forbids it (or its status is not computed yet), 500 when several budgets select the pod.
pub async fn evict(
    ctx: &Context,
    plan: &Plan,
    report: &mut WriteReport,
) -> Result<BTreeMap<String, String>, Error> {
    let jobs: Vec<(String, String, String)> = plan
        .drains
        .iter()
        .flat_map(|(node, d)| {
            d.evict
                .iter()
                .map(move |id| (node.clone(), d.policy.clone(), id.clone()))
        })
        .collect();
    let results: Vec<Evicted> = stream::iter(jobs)
        .map(|(node, policy, id)| async move {
            let r = evict_pod(ctx, &id).await;
            (node, policy, id, r)
        })
        .buffer_unordered(16)
        .collect()
        .await;
    let mut blocked = BTreeMap::new();
    for (node, policy, id, r) in results {
        match r? {
            None => {
                info!(%node, pod = %id, "evicted a pod to drain the node");
                report.record("Eviction", id.clone(), format!("draining {node}"));
            }
            Some(why) => {
                if let Some(p) = ctx.policy(&policy) {
                    let note = format!("draining {node}: {id}: {why}");
                    ctx.event(&p, EventType::Warning, "EvictionBlocked", note)
                        .await;
                }
                blocked.insert(id.clone(), why);
            }
        }
    }
    Ok(blocked)
}
