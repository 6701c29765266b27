//! The active ClusterPolicy: our fields of its `spec` (device-plugin and MIG manager configs,
//! the cluster-wide MIG strategy, sandbox workloads, the vGPU Device Manager), with drift
//! detection when someone else changed a field we had applied.

use std::collections::{BTreeMap, BTreeSet};

use kube::ResourceExt;
use kube::api::{Api, DynamicObject, Patch};
use serde_json::json;
use tracing::{info, warn};

use super::{WriteReport, apply_params};
use crate::api::names::MANAGER;
use crate::plan::Plan;
use crate::runtime::context::Context;
use crate::runtime::error::Error;
use crate::runtime::managed::owned_leaf_paths;
use crate::runtime::resources::cluster_policy_resource;

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

pub(super) fn lookup<'a>(v: &'a serde_json::Value, path: &str) -> Option<&'a serde_json::Value> {
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
