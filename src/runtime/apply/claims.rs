//! Our ResourceClaimTemplates (DRA policies): created, replaced when their immutable spec
//! changes, deleted when no policy renders them.

use std::collections::BTreeMap;
use std::sync::Arc;

use k8s_openapi::api::resource::v1::ResourceClaimTemplate;
use kube::ResourceExt;
use kube::api::{Api, Patch};
use tracing::{info, warn};

use super::{WriteReport, apply_params};
use crate::api::names::LABEL_POLICY;
use crate::plan::Plan;
use crate::runtime::context::Context;
use crate::runtime::error::Error;

/// Whether `have` holds everything in `want` (the API server adds defaults, e.g. allocationMode).
pub(super) fn json_contains(have: &serde_json::Value, want: &serde_json::Value) -> bool {
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

const KIND: &str = "ResourceClaimTemplate";

/// Applies one template (`namespace/name`), replacing ours when its spec changed (`ours`).
async fn apply_one(
    ctx: &Context,
    id: &str,
    want: &serde_json::Value,
    ours: bool,
    report: &mut WriteReport,
) -> Result<(), Error> {
    let (ns, name) = id.split_once('/').expect("namespace/name");
    let api: Api<ResourceClaimTemplate> = Api::namespaced(ctx.client.clone(), ns);
    if ours {
        api.delete(name, &Default::default()).await?;
        report.record(KIND, id.to_string(), "spec changed: replaced");
    }
    match api.patch(name, &apply_params(), &Patch::Apply(want)).await {
        Ok(_) => {
            let why = "DRA policy changed";
            info!(template = %id, reason = why, "applied ResourceClaimTemplate");
            report.record(KIND, id.to_string(), why);
        }
        Err(kube::Error::Api(e)) if e.code == 404 => {
            warn!(template = %id, "namespace does not exist; the ResourceClaimTemplate waits for it");
        }
        Err(e) => return Err(e.into()),
    }
    Ok(())
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
        let same = current.get(id).is_some_and(|cur| {
            let cur_spec = serde_json::to_value(&cur.spec).unwrap_or_default();
            json_contains(&cur_spec, &want["spec"])
                && cur.labels().get(LABEL_POLICY).map(String::as_str)
                    == want["metadata"]["labels"][LABEL_POLICY].as_str()
        });
        if same {
            report.learn(super::Learnt::InSync {
                kind: KIND,
                object: id.clone(),
            });
            continue;
        }
        // One template the API server refuses (a tenant's object of the same name, an
        // admission policy) is recorded; the others and the rest of the pass go on.
        if let Err(e) = apply_one(ctx, id, want, current.contains_key(id), report).await {
            report.refused(KIND, id, e)?;
        }
    }
    for (id, cur) in current
        .iter()
        .filter(|(id, _)| !plan.claim_templates.contains_key(*id))
    {
        let api: Api<ResourceClaimTemplate> =
            Api::namespaced(ctx.client.clone(), &cur.namespace().unwrap_or_default());
        match api.delete(&cur.name_any(), &Default::default()).await {
            Ok(_) => {
                let why = "no policy renders it any more";
                info!(template = %id, reason = why, "deleted ResourceClaimTemplate");
                report.record(KIND, id.clone(), why);
            }
            Err(e) => report.refused(KIND, id, e.into())?,
        }
    }
    Ok(())
}
