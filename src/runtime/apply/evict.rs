//! Drains: pod evictions through the Eviction API (PodDisruptionBudgets apply), with the API
//! server's refusals reported on the policy.

use futures::{StreamExt, stream};
use kube::api::Api;
use kube::runtime::events::EventType;
use tracing::info;

use super::{Learnt, WriteReport};
use crate::plan::Plan;
use crate::runtime::context::Context;
use crate::runtime::error::Error;

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
/// yet, 500 when several budgets select the pod, 403 when an admission policy or RBAC forbids
/// it).
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
        // 403: the admission policy's fence (no eviction in system namespaces) or RBAC; reported
        // on the policy like a budget's refusal rather than failing the whole pass.
        Ok(Err(kube::Error::Api(e))) if matches!(e.code, 403 | 429 | 500) => Ok(Some(refusal(&e))),
        Ok(Err(e)) => Err(e.into()),
        Err(_) => Ok(Some(format!(
            "the Eviction API did not answer within {}s; trying again",
            EVICTION_WAIT.as_secs()
        ))),
    }
}

/// Evicts the pods of the nodes being drained through the Eviction API (PodDisruptionBudgets
/// apply), 16 at a time. Once all are tried, reports the evictions refused, by pod, with why
/// (429 while a budget forbids it or its status is not computed yet, 500 when several budgets
/// select the pod), and the nodes being drained.
pub async fn evict(ctx: &Context, plan: &Plan, report: &mut WriteReport) -> Result<(), Error> {
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
    let mut blocked = Vec::new();
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
                blocked.push(Learnt::EvictionBlocked { pod: id, why });
            }
        }
    }
    report.learnt.extend(blocked);
    report.learn(Learnt::EvictionsTried {
        draining: plan.drains.keys().cloned().collect(),
    });
    Ok(())
}
