//! The end of a pass: finalizers (a policy goes only once its nodes and config keys are
//! released) and statuses.

use std::collections::BTreeSet;
use std::sync::Arc;

use futures::{StreamExt, stream};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::controller::Action;
use kube::runtime::events::EventType;
use kube::runtime::finalizer::{self, Event as FinalizerEvent};
use kube::{Resource, ResourceExt};
use serde_json::json;
use tracing::{debug, info};

use crate::api::crd::{Condition, GpuSharingPolicy, GpuSharingPolicyStatus};
use crate::api::names::*;
use crate::api::state::Reason;
use crate::nvidia;
use crate::plan::{Plan, PlanInput};
use crate::runtime::apply::{Write, WriteReport};
use crate::runtime::context::Context;
use crate::runtime::error::Error;

/// Policies being deleted whose node labels or config keys are still there (in the state this
/// pass planned from, or in its plan), or while a node that no policy governs any more still
/// carries the spare taint (`preferBusyNodes`): its policy label goes in the same pass as the
/// taint, so the taint cannot be traced to the policy any more, and every policy being deleted
/// waits for it (whether or not its removal waits out a retry delay).
pub fn cleanup_pending(input: &PlanInput, plan: &Plan) -> BTreeSet<String> {
    let untainting = input.nodes.iter().any(|n| {
        let governed = plan
            .node_labels
            .get(&n.name)
            .is_some_and(|l| l.get(LABEL_POLICY).is_some());
        n.spare && !governed
    });
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
                        .is_some_and(|k| nvidia::is_key_of(name, k))
            });
            let keys_left = input
                .cluster
                .current_device_config
                .keys()
                .chain(plan.device_config.keys())
                .any(|k| nvidia::is_key_of(name, k));
            labelled || keys_left || untainting
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
                // claim template or NodeOverlay of its is left.
                let templates_left = ctx.caches.claim_templates.as_ref().is_some_and(|s| {
                    s.state()
                        .iter()
                        .any(|t| t.labels().get(LABEL_POLICY) == Some(&name))
                });
                let overlays_left = ctx.caches.karpenter.as_ref().is_some_and(|(_, s)| {
                    s.state()
                        .iter()
                        .any(|o| o.labels().get(LABEL_POLICY) == Some(&name))
                });
                if cleanup_pending.contains(&name) || templates_left || overlays_left {
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

/// Writes a policy's status when it differs (conditions keep their transition time while their
/// status stays), and emits an event for each condition that changed. Returns the write, if any.
async fn write_status(
    ctx: &Context,
    p: &GpuSharingPolicy,
    mut status: GpuSharingPolicyStatus,
) -> Result<Option<Write>, Error> {
    let old = p.status.clone().unwrap_or_default();
    let now = Time(k8s_openapi::jiff::Timestamp::now());
    merge_conditions(&old.conditions, &mut status.conditions, &now);
    if old == status {
        return Ok(None);
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
    debug!(policy = %p.name_any(), "status updated");
    condition_events(ctx, p, &old, &status).await;
    Ok(Some(Write {
        kind: "GpuSharingPolicyStatus",
        object: p.name_any(),
        reason: "status changed".into(),
    }))
}

/// Events for condition changes: warnings for bad news, and every change of Ready.
async fn condition_events(
    ctx: &Context,
    p: &GpuSharingPolicy,
    old: &GpuSharingPolicyStatus,
    status: &GpuSharingPolicyStatus,
) {
    for c in &status.conditions {
        let before = old.conditions.iter().find(|o| o.type_ == c.type_);
        if before.is_none_or(|b| b.status != c.status || b.reason != c.reason) {
            let bad = matches!(
                (c.type_.as_str(), c.status.as_str()),
                ("Accepted", "False") | ("Conflicted", "True") | ("Degraded", "True")
            ) || c.reason == Reason::RolloutHalted;
            let rollout = matches!(c.reason, Reason::Paused | Reason::RollingOut);
            // An override is news when it starts or ends, not when a policy is created
            // without one.
            let override_news = c.type_ == "Overridden" && (c.status == "True" || before.is_some());
            if bad || rollout || c.type_ == "Ready" || override_news {
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
}

/// Runs every policy's finalizer and, when `write_statuses`, writes its status (16 at a time).
/// Returns whether a deleted policy still waits for its cleanup.
pub async fn finish_policies(
    ctx: &Context,
    plan: &Plan,
    cleanup_pending: &BTreeSet<String>,
    write_statuses: bool,
    report: &mut WriteReport,
) -> Result<bool, Error> {
    let jobs: Vec<Arc<GpuSharingPolicy>> = ctx.caches.policies.state();
    let results: Vec<Result<(bool, Option<Write>), Error>> = stream::iter(jobs)
        .map(|p: Arc<GpuSharingPolicy>| async move {
            let pending = match finalize(ctx, p.clone(), cleanup_pending).await {
                Ok(_) => false,
                Err(Error::Finalizer(e))
                    if matches!(
                        *e,
                        finalizer::Error::CleanupFailed(Error::CleanupPending(_))
                    ) =>
                {
                    true
                }
                Err(e) => return Err(e),
            };
            let mut written = None;
            if p.metadata.deletion_timestamp.is_none()
                && write_statuses
                && let Some(s) = plan.statuses.get(&p.name_any())
            {
                written = write_status(ctx, &p, s.clone()).await?;
            }
            Ok((pending, written))
        })
        .buffer_unordered(16)
        .collect()
        .await;
    let mut pending = false;
    let mut first_err = None;
    for r in results {
        match r {
            Ok((p, w)) => {
                pending |= p;
                report.writes.extend(w);
            }
            Err(e) => first_err = first_err.or(Some(e)),
        }
    }
    first_err.map_or(Ok(pending), Err)
}
