//! Our Karpenter NodeOverlays: applied when what we want differs from what is there (their
//! spec and our labels), deleted when no policy renders them any more.

use std::collections::BTreeMap;
use std::sync::Arc;

use kube::ResourceExt;
use kube::api::{Api, DynamicObject, Patch};
use tracing::info;

use super::claims::json_contains;
use super::{WriteReport, apply_params};
use crate::observe::karpenter::{is_ours, node_overlay_resource};
use crate::plan::Plan;
use crate::runtime::context::Context;
use crate::runtime::error::Error;

/// Applies the plan's NodeOverlays and deletes ours it no longer has. Nothing when the kind
/// is not served.
pub async fn apply_node_overlays(
    ctx: &Context,
    plan: &Plan,
    report: &mut WriteReport,
) -> Result<(), Error> {
    let Some((_, store)) = &ctx.caches.karpenter else {
        return Ok(());
    };
    let ours: BTreeMap<String, Arc<DynamicObject>> = store
        .state()
        .into_iter()
        .filter(|o| is_ours(o))
        .map(|o| (o.name_any(), o))
        .collect();
    let api: Api<DynamicObject> = Api::all_with(ctx.client.clone(), &node_overlay_resource());
    for (name, want) in &plan.node_overlays {
        let same = ours.get(name).is_some_and(|cur| {
            json_contains(&cur.data["spec"], &want["spec"])
                && want["spec"].as_object().map(|m| m.len())
                    == cur.data["spec"].as_object().map(|m| m.len())
                && want["metadata"]["labels"]
                    .as_object()
                    .into_iter()
                    .flatten()
                    .all(|(k, v)| cur.labels().get(k).map(String::as_str) == v.as_str())
        });
        if same {
            report.learn(super::Learnt::InSync {
                kind: "NodeOverlay",
                object: name.clone(),
            });
            continue;
        }
        if let Err(e) = api.patch(name, &apply_params(), &Patch::Apply(want)).await {
            report.refused("NodeOverlay", name, e.into())?;
            continue;
        }
        let why = if ours.contains_key(name) {
            "capacity or instance types changed"
        } else {
            "a policy's nodes can be launched by Karpenter"
        };
        info!(overlay = %name, reason = why, "applied NodeOverlay");
        report.record("NodeOverlay", name.clone(), why);
    }
    for name in ours.keys().filter(|n| !plan.node_overlays.contains_key(*n)) {
        match api.delete(name, &Default::default()).await {
            Ok(_) => {}
            Err(kube::Error::Api(e)) if e.code == 404 => {}
            Err(e) => {
                report.refused("NodeOverlay", name, e.into())?;
                continue;
            }
        }
        let why = "no policy renders it any more";
        info!(overlay = %name, reason = why, "deleted NodeOverlay");
        report.record("NodeOverlay", name.clone(), why);
    }
    Ok(())
}
