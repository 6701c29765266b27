//! Demand-driven MIG: the layout demand chose for a node, recorded in its annotation under the
//! demand's own field manager (the node's other metadata applies never touch it), and an Event
//! on each pending pod the operator reshapes a node for.

use k8s_openapi::api::core::v1::{Node, ObjectReference};
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::events::{Event, EventType};
use serde_json::json;
use tracing::{debug, info};

use super::WriteReport;
use crate::api::names::{ANNOTATION_MIG_DEMAND, DEMAND_MANAGER};
use crate::plan::Plan;
use crate::runtime::context::Context;
use crate::runtime::error::Error;

/// Writes the annotations that differ from the node cache's, then the pods' events.
pub async fn apply_demand(
    ctx: &Context,
    plan: &Plan,
    report: &mut WriteReport,
) -> Result<(), Error> {
    let api: Api<Node> = Api::all(ctx.client.clone());
    let params = PatchParams::apply(DEMAND_MANAGER).force();
    let nodes = ctx.caches.nodes.snapshot();
    let mut wrote = false;
    for (node, want) in &plan.demand.annotations {
        let have = nodes
            .iter()
            .find(|n| n.name == *node)
            .and_then(|n| n.annotations.get(ANNOTATION_MIG_DEMAND));
        if have == want.as_deref() {
            continue;
        }
        match want {
            Some(v) => {
                let patch = json!({
                    "apiVersion": "v1",
                    "kind": "Node",
                    "metadata": {"name": node, "annotations": {ANNOTATION_MIG_DEMAND: v}},
                });
                if let Err(e) = api.patch(node, &params, &Patch::Apply(&patch)).await {
                    report.refused("Node", node, e.into())?;
                    continue;
                }
            }
            // Whoever set it: an apply removes only what its manager owns.
            None => {
                let patch = json!({"metadata": {"annotations": {ANNOTATION_MIG_DEMAND: null}}});
                let merge = PatchParams {
                    field_manager: Some(DEMAND_MANAGER.into()),
                    ..Default::default()
                };
                if let Err(e) = api.patch(node, &merge, &Patch::Merge(&patch)).await {
                    report.refused("Node", node, e.into())?;
                    continue;
                }
            }
        }
        let why = match want {
            Some(v) => format!("demand chose layout {v}"),
            None => "demand layout no longer applies".to_string(),
        };
        info!(node = %node, reason = %why, "recorded demand layout");
        report.record("Node", node.clone(), why);
        wrote |= want.is_some();
    }
    if wrote {
        for (pod, node, note) in &plan.demand.events {
            let Some((namespace, name)) = pod.split_once('/') else {
                continue;
            };
            let reference = ObjectReference {
                api_version: Some("v1".into()),
                kind: Some("Pod".into()),
                namespace: Some(namespace.into()),
                name: Some(name.into()),
                ..Default::default()
            };
            let ev = Event {
                type_: EventType::Normal,
                reason: "ReshapingNode".into(),
                note: Some(note.clone()),
                action: "Reshape".into(),
                // The node as the related object: one event per node reshaped for the pod.
                secondary: Some(ObjectReference {
                    api_version: Some("v1".into()),
                    kind: Some("Node".into()),
                    name: Some(node.clone()),
                    ..Default::default()
                }),
            };
            if let Err(e) = ctx.publish(&ev, &reference).await {
                debug!(error = %e, pod = %pod, "event not published");
            }
        }
    }
    Ok(())
}
