//! Node writes: our labels and annotations (with our cordon riding in the same apply), and the
//! removal of the readiness taint once a node's sharing config is confirmed. The taint patch
//! itself lives in [`crate::runtime::taints`], beside the reading the watches share.

use std::collections::BTreeMap;

use futures::{StreamExt, stream};
use k8s_openapi::api::core::v1::Node;
use kube::ResourceExt;
use kube::api::{Api, Patch};
use kube::runtime::events::EventType;
use serde_json::json;
use tracing::{debug, info};

use super::{Learnt, WriteReport, apply_params};
use crate::api::names::*;
use crate::plan::{self, Plan};
use crate::runtime::context::Context;
use crate::runtime::error::Error;

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
    // The same device-plugin label (and, for a node handed back from VMs, the same workload).
    let server = |key: &str| n.labels().get(key).map(String::as_str);
    let same = server(LABEL_DEVICE_PLUGIN_CONFIG) == Some(planned)
        && (labels.get(LABEL_WORKLOAD)).is_none_or(|w| server(LABEL_WORKLOAD) == Some(w.as_str()));
    // Only a time our own manager wrote: a forged one in the future would hold the node back.
    let managed = n.metadata.managed_fields.as_deref().unwrap_or_default();
    let ours = crate::observe::node::believed_annotations(managed, MANAGER)
        .contains(ANNOTATION_CONFIG_WRITTEN);
    if let (true, true, Some(t)) = (same, ours, n.annotations().get(ANNOTATION_CONFIG_WRITTEN)) {
        debug!(node = %name, written = %t, "config label already in place: keeping its write time");
        annotations.insert(ANNOTATION_CONFIG_WRITTEN.to_string(), t.clone());
    }
    Ok(annotations)
}

/// Applies our labels and annotations to one node. A node to cordon that someone else had
/// cordoned sets `foreign` (even when the write then fails).
async fn apply_node(
    ctx: &Context,
    api: &Api<Node>,
    name: &str,
    labels: &plan::SmallMap,
    mut annotations: plan::SmallMap,
    foreign: &mut bool,
) -> Result<(), Error> {
    let mut obj = json!({"apiVersion": "v1", "kind": "Node",
        "metadata": {"name": name, "labels": labels}});
    if annotations.contains_key(ANNOTATION_CORDONED) {
        // Our cordon rides in the same apply as its annotation; a node someone else
        // cordoned is drained without claiming (and so never lifting) the cordon.
        let n = api.get(name).await?;
        let unschedulable = n.spec.as_ref().and_then(|s| s.unschedulable) == Some(true);
        // Our mark only where our field manager owns it: a forged one is someone's cordon.
        let managed = n.metadata.managed_fields.as_deref().unwrap_or_default();
        let ours = n.annotations().contains_key(ANNOTATION_CORDONED)
            && crate::observe::node::believed_annotations(managed, MANAGER)
                .contains(ANNOTATION_CORDONED);
        if unschedulable && !ours {
            *foreign = true;
            annotations = annotations
                .into_iter()
                .filter(|(k, _)| k != ANNOTATION_CORDONED)
                .collect();
        } else {
            obj["spec"] = json!({"unschedulable": true});
        }
    }
    let annotations = keep_server_write_time(ctx, api, name, labels, annotations).await?;
    obj["metadata"]["annotations"] = json!(annotations);
    // Answered with the node's metadata only: at 20,000 nodes the whole Node of every answer
    // would be parsed (and held, many writes in flight) for nothing.
    api.patch_metadata(name, &apply_params(), &Patch::Apply(&obj))
        .await?;
    Ok(())
}

/// Node writes in flight at once: as many as the minimal-write baseline of `make bench` keeps
/// (at 20,000 nodes a policy edit or a first apply is one pass of node writes, whose time is
/// the API server's answers, not the operator's work).
pub const NODE_WRITES_IN_FLIGHT: usize = 32;

/// Applies our labels and annotations to the nodes that differ ([`NODE_WRITES_IN_FLIGHT`] at a
/// time), then emits one
/// `NodesLabelled` event per policy. Every successful write is recorded even if another fails,
/// and so is every node found cordoned by someone else.
pub async fn apply_nodes(
    ctx: &Context,
    plan: &Plan,
    changes: Vec<String>,
    report: &mut WriteReport,
) -> Result<(), Error> {
    let api: Api<Node> = Api::all(ctx.client.clone());
    let results: Vec<(String, bool, Result<(), Error>)> = stream::iter(changes)
        .map(|name: String| {
            let api = api.clone();
            let labels = &plan.node_labels[&name];
            let annotations = plan
                .node_annotations
                .get(&name)
                .cloned()
                .unwrap_or_default();
            async move {
                let mut foreign = false;
                let r = apply_node(ctx, &api, &name, labels, annotations, &mut foreign).await;
                (name, foreign, r)
            }
        })
        .buffer_unordered(NODE_WRITES_IN_FLIGHT)
        .collect()
        .await;
    // RBAC refusing every node: our account lost its rights, which is the pass's failure (an
    // admission webhook's denial, 403 too, is one object's).
    let forbidden = |r: &Result<(), Error>| {
        matches!(r, Err(Error::Kube(kube::Error::Api(s)))
            if s.code == 403 && s.message.contains("cannot patch resource"))
    };
    let everywhere = results.len() > 1 && results.iter().all(|(_, _, r)| forbidden(r));
    let mut first_err = None;
    let mut labelled: BTreeMap<&str, Vec<String>> = BTreeMap::new();
    let mut refused: BTreeMap<&str, Vec<String>> = BTreeMap::new();
    for (name, foreign, r) in results {
        if foreign {
            report.learn(Learnt::ForeignCordon(name.clone()));
        }
        let policy = (plan.node_labels[&name].get(LABEL_POLICY)).map_or("", String::as_str);
        match r {
            Ok(()) => {
                let labels = &plan.node_labels[&name];
                info!(node = %name, labels = ?labels, policy = %policy, "applied node labels");
                report.record("Node", name.clone(), format!("policy {policy:?}"));
                labelled.entry(policy).or_default().push(name);
            }
            Err(e) if everywhere => first_err = first_err.or(Some(e)),
            Err(e) => match e.refused_write() {
                Some(why) => {
                    refused
                        .entry(policy)
                        .or_default()
                        .push(format!("{name}: {why}"));
                    report.refused("Node", &name, e)?;
                }
                None => first_err = first_err.or(Some(e)),
            },
        }
    }
    for (policy, nodes) in &refused {
        if let Some(p) = ctx.policy(policy) {
            let note = format!(
                "the API server refused the write to node {}",
                nodes.join("; ")
            );
            ctx.event(&p, EventType::Warning, "WriteRefused", note)
                .await;
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

/// Puts the spare taint on the idle nodes of `preferBusyNodes` policies and takes it off the
/// others, as the plan says, 16 nodes at a time. A node whose taints changed meanwhile (a 422
/// from the guard of the JSON patch) or that is gone is retried on the next pass; a refusal
/// (admission: 403) is remembered under its own kind, with the usual retry delay.
pub async fn set_spare_taints(
    ctx: &Context,
    plan: &Plan,
    report: &mut WriteReport,
) -> Result<(), Error> {
    let results: Vec<(String, bool, Result<bool, kube::Error>)> = stream::iter(plan.spare.clone())
        .map(|(node, present): (String, bool)| {
            let client = ctx.client.clone();
            async move {
                let r = crate::runtime::taints::set_spare(&client, &node, present).await;
                (node, present, r)
            }
        })
        .buffer_unordered(NODE_WRITES_IN_FLIGHT)
        .collect()
        .await;
    for (node, present, r) in results {
        match r {
            Ok(true) => {
                let what = if present { "added" } else { "removed" };
                debug!(%node, "{what} the spare taint");
                report.record(
                    REFUSED_SPARE_TAINT,
                    node.clone(),
                    format!("{what} spare taint"),
                );
            }
            Ok(false) => {}
            Err(kube::Error::Api(e)) if matches!(e.code, 404 | 409 | 422) => {
                debug!(%node, error = %e, "spare taint not changed this pass");
            }
            // A refusal (admission, RBAC by name) is recorded and the pass goes on; an error
            // that concerns every write ends it.
            Err(e) => report.refused(REFUSED_SPARE_TAINT, &node, e.into())?,
        }
    }
    Ok(())
}
