//! The controller: watches policies, nodes (metadata only), the GPU Operator namespace's
//! ConfigMaps and the ClusterPolicy into caches; on any change computes one cluster-wide plan with
//! the pure planner and applies only the difference, with server-side apply under one field
//! manager. A steady cluster gets no writes.
//!
//! A pass: [`Context::plan_input`] (caches and memory -> input) -> [`Planner::plan`](crate::plan::Planner::plan)
//! (incremental: only what changed is planned again) -> appliers in
//! a safe order (ConfigMaps, ClusterPolicy, node metadata, ResourceClaimTemplates, unused
//! mig-parted ConfigMap) -> finalizers and statuses. Every write lands in the pass's
//! [`WriteReport`], which feeds the metrics and the pass's tracing span; what the writes taught
//! goes from the same report into the control loop's [`ControllerMemory`], the only state kept
//! from one pass to the next (the planner's memos included).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use kube::api::{Api, DynamicObject};
use kube::runtime::events::{Recorder, Reporter};
use kube::{Client, ResourceExt};
use tokio::sync::Notify;
use tracing::{Instrument, debug, info, info_span, warn};

use crate::api::names::*;
use crate::observe::gpu_operator;
use crate::plan::{Plan, PlanInput};
use crate::runtime::apply::{self, WriteReport};
use crate::runtime::finalize;
use crate::runtime::memory::ControllerMemory;
use crate::runtime::watches;

// The controller's types live in their own files (the appliers, finalizers and watches import
// them from there); they stay reachable here, where the binary and the tests name them.
pub use crate::runtime::context::{Config, Context, EvictionClient};
pub use crate::runtime::error::Error;
pub use crate::runtime::resources::cluster_policy_resource;

/// A pass starts once no watch event has arrived for this long after a pass that wrote nothing
/// (at rest, an edit arrives as one event: a short wait is latency the admin sees)...
const COALESCE_QUIET_AT_REST: Duration = Duration::from_millis(50);
/// ...or for this long after a pass that wrote (its own writes come back as bursts of events
/// over a rollout, and every extra pass over 20,000 nodes costs a plan)...
const COALESCE_QUIET_WRITING: Duration = Duration::from_millis(100);
/// ...or this long after the previous pass, whichever comes first.
const COALESCE_MAX: Duration = Duration::from_secs(1);

/// How long the watches must be quiet before the next pass, given whether the last one wrote.
fn quiet_period(last_pass_wrote: bool) -> Duration {
    if last_pass_wrote {
        COALESCE_QUIET_WRITING
    } else {
        COALESCE_QUIET_AT_REST
    }
}

/// Finds the GPU Operator's namespace: the `status.namespace` of the oldest (active)
/// ClusterPolicy.
pub async fn detect_namespace(client: &Client) -> Option<String> {
    let api: Api<DynamicObject> = Api::all_with(client.clone(), &cluster_policy_resource());
    let list = api.list(&Default::default()).await.ok()?;
    gpu_operator::active_cluster_policy(&list.items).and_then(gpu_operator::status_namespace)
}

/// The GPU Operator namespace: configured, else detected, else `gpu-operator`.
async fn namespace(client: &Client, config: &Config) -> String {
    if let Some(n) = &config.namespace {
        return n.clone();
    }
    match detect_namespace(client).await {
        Some(n) => {
            info!(namespace = %n, "GPU Operator namespace detected from the ClusterPolicy status");
            n
        }
        None => {
            warn!(
                "no ClusterPolicy with status.namespace found; using gpu-operator (pass --namespace to choose)"
            );
            gpu_operator::DEFAULT_NAMESPACE.into()
        }
    }
}

/// Runs the controller until the future is dropped.
pub async fn run(
    client: Client,
    config: Config,
    shutdown: impl std::future::Future<Output = ()>,
) -> Result<(), Error> {
    // Every error label is exposed from the start (at 0), so that alerts and dashboards find
    // the series before the first failure.
    config.metrics.declare_errors(Error::METRIC_LABELS);
    let namespace = namespace(&client, &config).await;
    let notify = Arc::new(Notify::new());
    let (caches, events) = watches::start(
        &client,
        &namespace,
        &config.configmaps_read(),
        config.readiness_taint.as_deref(),
        notify.clone(),
    )
    .await;
    let recorder = Recorder::new(
        client.clone(),
        Reporter {
            controller: MANAGER.into(),
            instance: std::env::var("POD_NAME").ok(),
        },
    );
    let ctx = Arc::new(Context::new(client, config, namespace, caches, recorder));
    tokio::select! {
        _ = events => warn!("watch streams ended"),
        _ = control_loop(ctx, notify) => {},
        _ = shutdown => info!("shutting down"),
    }
    Ok(())
}

/// Passes forever: after each, wait for a watch event (or the resync, or a short recheck while
/// something is in progress, or the moment demand may act, or the backoff after an error), then
/// for the watches to go quiet.
async fn control_loop(ctx: Arc<Context>, notify: Arc<Notify>) {
    ctx.caches.wait_until_ready().await;
    info!(namespace = %ctx.namespace, "caches ready; reconciling");
    let mut memory = ControllerMemory::new(ctx.config.mig_timeout);
    let mut backoff = Duration::from_millis(500);
    loop {
        let (result, wrote) = pass(&ctx, &mut memory).await;
        match result {
            Ok(recheck) => {
                backoff = Duration::from_millis(500);
                let wait = recheck.map_or(ctx.config.resync, |r| r.min(ctx.config.resync));
                tokio::select! {
                    _ = notify.notified() => {},
                    _ = ctx.config.fence.changed() => {},
                    _ = tokio::time::sleep(wait) => {},
                }
            }
            Err(e) => {
                warn!(error = %e, retry_in = ?backoff, "reconcile failed");
                ctx.caches.lag.mark();
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(60));
            }
        }
        // Coalesce bursts of watch events (`kubectl apply -f dir/`, a relabel of many nodes)
        // into one pass: wait until the watches are quiet, within a bound.
        let quiet = quiet_period(wrote);
        let deadline = tokio::time::Instant::now() + COALESCE_MAX;
        loop {
            tokio::select! {
                _ = notify.notified() => {
                    if tokio::time::Instant::now() >= deadline {
                        break;
                    }
                }
                _ = tokio::time::sleep(quiet) => break,
            }
        }
    }
}

/// One pass in its tracing span (pass number, nodes changed, writes); its writes and duration
/// feed the metrics, and what it learnt the memory, whether it succeeded or not. Also says
/// whether it wrote anything.
async fn pass(
    ctx: &Context,
    memory: &mut ControllerMemory,
) -> (Result<Option<Duration>, Error>, bool) {
    let id = ctx.next_pass();
    let span = info_span!(
        "pass",
        id,
        nodes_changed = tracing::field::Empty,
        writes = tracing::field::Empty
    );
    let started = std::time::Instant::now();
    let mut report = WriteReport::default();
    let result = reconcile_all(ctx, memory, &mut report)
        .instrument(span.clone())
        .await;
    memory.record(&report, std::time::Instant::now());
    span.record("nodes_changed", report.count("Node"));
    span.record("writes", report.writes.len());
    let m = &ctx.config.metrics;
    for (kind, n) in report.by_kind() {
        m.count_writes(kind, n);
    }
    let failure = result.as_ref().err().map(Error::metric_label);
    m.observe_reconcile(started.elapsed(), failure);
    m.set_ready();
    let wrote = !report.is_empty();
    if wrote {
        span.in_scope(|| debug!(writes = report.writes.len(), "pass wrote"));
    }
    (result, wrote)
}

/// Gauges from the plan: nodes per strategy, conflicted policies, the node cache's size.
fn record_plan_metrics(ctx: &Context, input: &PlanInput, plan: &Plan) {
    let strategy_of: BTreeMap<String, &str> = input
        .policies
        .iter()
        .map(|p| (p.name_any(), p.spec.strategy.as_str()))
        .collect();
    let mut per_strategy: BTreeMap<String, u64> = BTreeMap::new();
    for (policy, nodes) in &plan.labelled_nodes {
        if let Some(s) = strategy_of.get(policy) {
            *per_strategy.entry(s.to_string()).or_default() += nodes;
        }
    }
    let m = &ctx.config.metrics;
    m.set_nodes_per_strategy(per_strategy);
    let conflicted = plan
        .statuses
        .values()
        .filter(|s| s.conflicting_nodes > 0)
        .count();
    m.set_conflicted_policies(conflicted as u64);
    m.set_policies(&plan.statuses);
    m.set_node_cache(input.nodes.len() as u64, ctx.caches.nodes.strings() as u64);
}

/// One pass: plan (with what `memory` recalls), then apply the difference in a safe order,
/// recording every write and what it taught in `report` (the caller records that in `memory`).
/// Returns when to look again without watch events: soon ([`IN_PROGRESS_RECHECK`]) while
/// something is in progress, when time alone lets demand act (its quiet period, idle time or
/// cooldown running out), or `None` (the resync).
pub async fn reconcile_all(
    ctx: &Context,
    memory: &mut ControllerMemory,
    report: &mut WriteReport,
) -> Result<Option<Duration>, Error> {
    let Some(input) = ctx.plan_input(memory) else {
        // The node cache is listing nodes again (a new selector key); its last event wakes us.
        return Ok(Some(IN_PROGRESS_RECHECK));
    };
    let (mut plan, input) = plan_off_thread(memory, input).await;
    record_plan_metrics(ctx, &input, &plan);
    // What the writes below need of the input, taken now: the pass then holds no node facts
    // while it writes, so the cache can let each node's old facts go as the watch reports our
    // label changes (otherwise a first pass over every node holds two copies of all of them).
    let has_policies = !input.policies.is_empty();
    // A node write the API server refused waits its turn; one no longer planned is forgotten.
    let now = std::time::Instant::now();
    let planned: BTreeSet<&str> = plan.nodes_to_write.iter().map(String::as_str).collect();
    memory.keep_refused("Node", |n| planned.contains(n));
    let templates = &plan.claim_templates;
    memory.keep_refused("ResourceClaimTemplate", |t| templates.contains_key(t));
    let overlays = &plan.node_overlays;
    memory.keep_refused("NodeOverlay", |o| overlays.contains_key(o));
    let classes = &plan.device_classes;
    memory.keep_refused(apply::DEVICE_CLASS, |c| classes.contains_key(c));
    // The spare taint's writes likewise, under their own kind: a refused one holds no rollout.
    let spared: BTreeSet<&str> = plan.spare.iter().map(|(n, _)| n.as_str()).collect();
    memory.keep_refused(REFUSED_SPARE_TAINT, |n| spared.contains(n));
    plan.spare
        .retain(|(n, _)| !memory.refused_waits(REFUSED_SPARE_TAINT, n, now));
    let (changes, waiting): (Vec<String>, Vec<String>) =
        (plan.nodes_to_write.iter().cloned()).partition(|n| !memory.refused_waits("Node", n, now));
    let cleanup_pending = finalize::cleanup_pending(&input, &plan);
    let planned_namespace_missing = input.memory.gpu_operator_namespace_missing.is_some();
    drop(input);

    // 1. ConfigMaps first: a key exists before any node label points to it. Without the GPU
    //    Operator's namespace nothing else is written; the statuses say why.
    if let Err(e) = apply::apply_configmaps(ctx, &plan, has_policies, report).await {
        // (Statuses only from a plan that knew: the pass that finds out retries at once.)
        if matches!(e, Error::NamespaceMissing(_)) && planned_namespace_missing {
            finalize::finish_policies(ctx, &plan, &cleanup_pending, true, report).await?;
        }
        return Err(e);
    }
    // 2. The ClusterPolicy points at our ConfigMaps.
    let applied = memory.cluster_policy_applied();
    apply::apply_cluster_policy(ctx, &plan, applied, report).await?;
    // 3. Node labels and annotations.
    apply::apply_nodes(ctx, &plan, changes, report).await?;
    // A drain's cordon rides in its node's write: no eviction on a node whose write was
    // refused or waits its retry (it is still schedulable, and its pods could land back).
    let refused: BTreeSet<String> = (report.refusals())
        .filter(|(kind, _, _)| *kind == "Node")
        .map(|(_, node, _)| node.to_string())
        .chain(waiting)
        .collect();
    plan.drains.retain(|node, _| !refused.contains(node));
    // 3b. The layouts demand chose (the next pass brings the nodes there).
    apply::apply_demand(ctx, &plan, report).await?;
    // 4. Drains: evict the GPU pods of cordoned nodes (PodDisruptionBudgets apply).
    apply::evict(ctx, &plan, report).await?;
    // 5. Readiness taints of nodes whose config is confirmed.
    apply::remove_readiness_taints(ctx, &plan, report).await?;
    apply::set_spare_taints(ctx, &plan, report).await?;
    // 6. ResourceClaimTemplates and DeviceClasses of DRA policies, Karpenter NodeOverlays; the
    // mig-parted ConfigMap once unused.
    apply::apply_claim_templates(ctx, &plan, report).await?;
    let class_waits = |c: &str| memory.refused_waits(apply::DEVICE_CLASS, c, now);
    apply::apply_device_classes(ctx, &plan, class_waits, report).await?;
    apply::apply_node_overlays(ctx, &plan, report).await?;
    apply::delete_unused_mig_configmap(ctx, &plan, report).await?;
    apply::delete_unused_vgpu_configmap(ctx, &plan, report).await?;

    // 7. Finalizers and status. A pass that changed something writes no status: the watch
    // events of its own writes bring the next pass at once, and that one reports the outcome
    // (one status write per change instead of an intermediate one).
    let changed = !report.is_empty();
    let unconfirmed = !plan.node_labels.is_empty()
        && plan
            .statuses
            .values()
            .any(|s| s.applied_nodes < s.matched_nodes - s.conflicting_nodes - s.overridden_nodes);
    let cleanup = finalize::finish_policies(ctx, &plan, &cleanup_pending, !changed, report).await?;
    if changed || unconfirmed || cleanup {
        return Ok(Some(IN_PROGRESS_RECHECK));
    }
    Ok(plan
        .demand
        .recheck_in
        .map(|s| Duration::from_secs(s.max(1) as u64)))
}

/// Plans on the blocking pool, not on the runtime's only thread: a pass from scratch over
/// 20,000 nodes takes hundreds of milliseconds, which lease renewal, the watches and the
/// health probes must not wait for. The planner (with its memos) moves there and back.
async fn plan_off_thread(memory: &mut ControllerMemory, input: PlanInput) -> (Plan, PlanInput) {
    let mut planner = std::mem::take(memory.planner());
    let done = tokio::task::spawn_blocking(move || {
        let plan = planner.plan(&input);
        (planner, plan, input)
    })
    .await;
    let (planner, plan, input) = match done {
        Ok(done) => done,
        // The planner's panic is the pass's, as if it had run here.
        Err(e) => std::panic::resume_unwind(e.into_panic()),
    };
    *memory.planner() = planner;
    (plan, input)
}

/// How soon a pass looks again while a change is in progress (the MIG manager, the device
/// plugin, a drain), watch events or not.
pub const IN_PROGRESS_RECHECK: Duration = Duration::from_secs(2);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_edit_at_rest_waits_less_than_the_echo_of_a_pass_that_wrote() {
        assert_eq!(quiet_period(false), Duration::from_millis(50));
        assert_eq!(quiet_period(true), Duration::from_millis(100));
        assert!(quiet_period(true) < COALESCE_MAX);
    }
}
