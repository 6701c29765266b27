//! The active ClusterPolicy: our fields of its `spec` (device-plugin and MIG manager configs,
//! the cluster-wide MIG strategy, sandbox workloads, the vGPU Device Manager), with drift
//! detection when someone else changed a field we had applied (which fields we applied is the
//! control loop's memory: read here, reported back in the [`WriteReport`]).

use std::collections::BTreeSet;

use kube::ResourceExt;
use kube::api::{Api, DynamicObject, Patch};
use serde_json::json;
use tracing::{info, warn};

use super::{Learnt, WriteReport, apply_params};
use crate::api::names::MANAGER;
use crate::observe::managed::owned_leaf_paths;
use crate::plan::Plan;
use crate::runtime::cluster_policy_diff;
use crate::runtime::context::Context;
use crate::runtime::error::Error;
use crate::runtime::resources::cluster_policy_resource;

/// Points the active ClusterPolicy at our ConfigMaps (and the cluster-wide MIG strategy) when
/// its values or our ownership differ. A field we had `applied` (in earlier passes) that someone
/// changed is drift: it is put back, logged as a warning and reported for contest detection.
pub async fn apply_cluster_policy(
    ctx: &Context,
    plan: &Plan,
    applied: &BTreeSet<String>,
    report: &mut WriteReport,
) -> Result<(), Error> {
    let Some(cp) = ctx.active_cluster_policy() else {
        return Ok(());
    };
    let spec = &plan.cluster_policy_spec;
    let changes = cluster_policy_diff::changes(cp.data.get("spec"), spec, None);
    let want = cluster_policy_diff::fields(spec);
    let owned = owned_leaf_paths(
        cp.metadata.managed_fields.as_deref().unwrap_or_default(),
        MANAGER,
        "spec",
    );
    if changes.is_empty() && owned == want.keys().cloned().collect::<BTreeSet<_>>() {
        return Ok(());
    }
    // Drift: a field we owned now has another value (a first apply over the Helm defaults is not).
    let drift: Vec<String> = changes
        .iter()
        .filter(|c| applied.contains(&c.key))
        .filter_map(|c| {
            let (was, v) = (c.current.as_ref()?, c.wanted.as_ref()?);
            Some(format!("{}={v} (was {was})", c.key))
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
    report.learn(Learnt::ClusterPolicyApplied {
        fields: want.keys().cloned().collect(),
    });
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
        report.learn(Learnt::ClusterPolicyRepaired {
            what: drift.join(", "),
        });
    }
    Ok(())
}
