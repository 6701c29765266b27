//! A policy's status from what the per-node transitions found: conditions with typed reasons,
//! node counts, capacity and bounded per-node details.

use crate::api::crd::{
    Capacity, Condition, GpuSharingPolicyStatus, NodeDetail, RefusedWrite, RolloutStatus,
};
use crate::api::names::ANNOTATION_REAPPLY_MIG;
use crate::api::state::{ConditionType, NodeState, Reason};
use crate::nvidia::MIG_DISABLED_LAYOUT;

use super::backing::Kind;
use super::policies::Prepared;

/// Most per-node entries kept in a policy's status.
pub const MAX_NODE_DETAILS: usize = 50;

/// What the nodes a policy governs came to, gathered while planning them.
#[derive(Debug, Default)]
pub struct Tally {
    /// One entry per governed node not `Applied`, and the first [`MAX_NODE_DETAILS`] applied
    /// ones in name order (all a status lists; conflicts are added by [`status`]).
    pub details: Vec<NodeDetail>,
    /// Governed nodes.
    pub governed: usize,
    /// Governed nodes held as they are, by why.
    pub held: std::collections::BTreeMap<crate::api::state::HoldReason, i32>,
    pub applied: i32,
    /// Summed over applied nodes; `None` until one is applied.
    pub capacity: Option<Capacity>,
    /// Some applied node's replicas are unknown (a MIG layout we cannot read).
    pub capacity_unknown: bool,
    /// The rollout gate's view (accepted policies).
    pub rollout: Option<super::rollout::Progress>,
    /// Governed nodes by the backend that serves their GPUs now (see
    /// [`super::backend::dra::served_by`]).
    pub served_by: std::collections::BTreeMap<&'static str, i32>,
    /// Some governed node's backend is worth reporting (see
    /// [`super::backend::dra::shows_served_by`]): then `status.servedBy` counts every node.
    pub served_by_shown: bool,
}

impl Tally {
    /// Counts a governed node in `state`, held for `reason`; keeps its detail when a status
    /// may list it.
    pub fn add(
        &mut self,
        state: NodeState,
        reason: Option<crate::api::state::HoldReason>,
        detail: impl FnOnce() -> NodeDetail,
    ) {
        self.governed += 1;
        if let Some(r) = reason {
            *self.held.entry(r).or_insert(0) += 1;
        }
        if state == NodeState::Applied {
            self.applied += 1;
            if self.applied as usize > MAX_NODE_DETAILS {
                return;
            }
        }
        self.details.push(detail());
    }

    fn in_state(&self, s: NodeState) -> Vec<&NodeDetail> {
        self.details.iter().filter(|d| d.state == s).collect()
    }

    /// The nodes the policy cannot run on, left as they were (see [`NodeState::refused`]).
    fn refused(&self) -> Vec<&NodeDetail> {
        self.details.iter().filter(|d| d.state.refused()).collect()
    }
}

/// Cluster facts every status reports on.
pub struct Cluster<'a> {
    pub cluster_policy_found: bool,
    pub cluster_policy_contested: Option<&'a str>,
    /// The readiness taint's key, when the GPU Operator's DaemonSets do not tolerate it.
    pub untolerated_taint: Option<&'a str>,
    /// The GPU Operator's DRA-only `GPUCluster`, when one exists.
    pub gpu_cluster: Option<&'a str>,
    /// The GPU Operator's namespace, when it does not exist (nothing can be written there).
    pub gpu_operator_namespace_missing: Option<&'a str>,
    /// The last fence check's result, when one was conclusive.
    pub fence: Option<&'a super::input::Fence>,
    /// Writes the API server refused (see [`refused_for`]).
    pub refused: &'a [RefusedWrite],
    /// ResourceQuotas limiting GPU requests, when they can be read.
    pub quotas: Option<&'a [super::input::QuotaFact]>,
}

/// At most this many refused writes on a status.
pub const MAX_REFUSED_WRITES: usize = 10;

/// The refused writes that concern a policy: its matched nodes, its claim templates, and
/// the cluster-wide objects every policy needs (ConfigMaps, the ClusterPolicy, overlays).
fn refused_for(refused: &[RefusedWrite], p: &Prepared, place: &Placement) -> Vec<RefusedWrite> {
    let mine = |w: &&RefusedWrite| match w.kind.as_str() {
        "DeviceClass" => p.extended().is_some(),
        "Node" | crate::api::names::REFUSED_SPARE_TAINT => {
            place.matched.binary_search(&w.name.as_str()).is_ok()
        }
        "ResourceClaimTemplate" => place.templates.contains(&w.name),
        _ => true,
    };
    refused
        .iter()
        .filter(mine)
        .take(MAX_REFUSED_WRITES)
        .cloned()
        .collect()
}

/// What the status needs of the policy's place among the others.
pub struct Placement<'a> {
    /// Nodes the selector matches, in name order.
    pub matched: &'a [&'a str],
    /// Matched nodes another policy of the same priority governs, as `<node> (won by <policy>)`.
    pub conflicting: Vec<String>,
    /// Matched nodes a policy of higher priority governs, as `<node> (overridden by <policy>)`.
    pub overridden: Vec<String>,
    /// `namespace/name` of its ResourceClaimTemplates.
    pub templates: Vec<String>,
    /// Namespaces its DRA settings list that do not exist (their templates wait for them).
    pub missing_namespaces: Vec<String>,
    /// For a custom MIG layout: the GPU models of the nodes it runs on, with a geometry table
    /// (by name) and without one (by product).
    pub gpu_models: std::collections::BTreeSet<&'static str>,
    pub unverified_products: std::collections::BTreeSet<String>,
}

pub fn condition(
    type_: ConditionType,
    status: bool,
    reason: Reason,
    message: String,
    generation: Option<i64>,
) -> Condition {
    Condition {
        type_,
        status: status.into(),
        reason,
        message,
        last_transition_time: None,
        observed_generation: generation,
    }
}

/// Up to `n` details as `<node>: <message>`, joined by "; ", and how many more there are.
fn listed(details: &[&NodeDetail], n: usize) -> String {
    let shown: Vec<String> = details
        .iter()
        .take(n)
        .map(|d| format!("{}: {}", d.name, d.message))
        .collect();
    match details.len().saturating_sub(n) {
        0 => shown.join("; "),
        more => format!("{}; and {more} more", shown.join("; ")),
    }
}

/// The `Invalid` nodes, by why (the layout's field, the model and the reason): one sentence per
/// distinct reason, naming its nodes.
fn infeasible_geometry(t: &Tally) -> Option<String> {
    let invalid = t.in_state(NodeState::Invalid);
    if invalid.is_empty() {
        return None;
    }
    let mut by_why: std::collections::BTreeMap<&str, Vec<&str>> = Default::default();
    for d in &invalid {
        by_why.entry(&d.message).or_default().push(&d.name);
    }
    let reasons: Vec<String> = by_why
        .into_iter()
        .map(|(why, nodes)| format!("{why} (nodes {})", names_of(&nodes, 5)))
        .collect();
    Some(format!(
        "the custom MIG layout cannot be created on the GPUs of {} nodes, left as they were: {}",
        invalid.len(),
        reasons.join("; ")
    ))
}

fn accepted(p: &Prepared, t: &Tally) -> (bool, Reason, String) {
    let rejected = t.refused();
    if !p.errors.is_empty() {
        let msgs: Vec<String> = p.errors.iter().map(|e| e.to_string()).collect();
        (false, Reason::InvalidSpec, msgs.join("; "))
    } else if let Some(reason) = &p.blocked {
        (false, Reason::ClusterWideConflict, reason.clone())
    } else if !rejected.is_empty() {
        let msg = format!(
            "{} of {} nodes cannot run this policy and were left untouched: {}",
            rejected.len(),
            t.governed,
            listed(&rejected, 5)
        );
        (false, Reason::IncompatibleNodes, msg)
    } else {
        let msg = "spec is valid for every matched node".to_string();
        (true, Reason::Valid, msg)
    }
}

fn ready(
    p: &Prepared,
    t: &Tally,
    missing_namespaces: &[String],
    c: &Cluster,
) -> (bool, Reason, String) {
    let won = t.governed as i32;
    let stale = t.in_state(NodeState::Stale).len();
    let all = t.applied == won && t.refused().is_empty();
    if !p.accepted() {
        (
            false,
            Reason::NotAccepted,
            "the policy is not accepted".into(),
        )
    } else if let Some(ns) = c.gpu_operator_namespace_missing {
        let msg = format!(
            "the GPU Operator's namespace {ns} does not exist: the device-plugin config cannot be \
             written there, so no node is labelled until it does (install the GPU Operator, or \
             give the operator its namespace with --namespace)"
        );
        (false, Reason::NamespaceMissing, msg)
    } else if !missing_namespaces.is_empty() {
        let msg = format!(
            "namespaces {} do not exist: their ResourceClaimTemplates are created as soon as they do",
            missing_namespaces.join(", ")
        );
        (false, Reason::NamespaceMissing, msg)
    } else if won == 0 {
        let msg = "no node is governed by this policy".to_string();
        (true, Reason::NoNodes, msg)
    } else if all {
        (
            true,
            Reason::Converged,
            format!("all {won} nodes are configured"),
        )
    } else if stale > 0 {
        let msg = format!(
            "{} of {won} nodes are configured; {stale} run an older version of their MIG layout",
            t.applied
        );
        (false, Reason::MigLayoutChanged, msg)
    } else {
        let msg = format!("{} of {won} nodes are configured", t.applied);
        (false, Reason::Progressing, msg)
    }
}

fn progressing(p: &Prepared, t: &Tally) -> (bool, Reason, String) {
    let waiting = t.in_state(NodeState::Waiting);
    let pending = t.in_state(NodeState::Pending);
    let generation = p.policy.metadata.generation.unwrap_or(0);
    if let Some(r) = &t.rollout {
        if let Some(why) = &r.halted {
            let msg = format!(
                "the rollout of generation {generation} halted: {}; {} nodes not started. Fix the nodes, then edit the policy (a new generation) to resume",
                why.join("; "),
                r.queued.len()
            );
            return (false, Reason::RolloutHalted, msg);
        }
        if r.paused && !r.queued.is_empty() {
            let msg = format!(
                "the rollout is paused: {} nodes wait ({}); {} unavailable",
                r.queued.len(),
                names_of(&r.queued, 5),
                r.unavailable
            );
            return (false, Reason::Paused, msg);
        }
        let draining = t.in_state(NodeState::Draining);
        if !draining.is_empty() {
            return (true, Reason::Draining, listed(&draining, 5));
        }
        if !r.queued.is_empty() {
            let msg = format!(
                "{} of {} nodes updated, {} unavailable (maxUnavailable {}), {} queued ({})",
                t.applied,
                t.governed,
                r.unavailable,
                r.max_unavailable,
                r.queued.len(),
                names_of(&r.queued, 5)
            );
            return (true, Reason::RollingOut, msg);
        }
    }
    if !waiting.is_empty() {
        (true, Reason::WaitingForIdleGPUs, listed(&waiting, 5))
    } else if !pending.is_empty() {
        let msg = format!(
            "{} nodes are being reconfigured: {}",
            pending.len(),
            listed(&pending, 5)
        );
        (true, Reason::Reconfiguring, msg)
    } else {
        (false, Reason::Idle, "nothing in progress".into())
    }
}

/// Up to `n` names, and how many more there are.
fn names_of<S: AsRef<str>>(names: &[S], n: usize) -> String {
    let shown = names
        .iter()
        .take(n)
        .map(AsRef::as_ref)
        .collect::<Vec<_>>()
        .join(", ");
    match names.len().saturating_sub(n) {
        0 => shown,
        more => format!("{shown} and {more} more"),
    }
}

/// A conflict is what priority does not decide: an overlap with a policy of the same priority
/// (won by age or name), or a clash with the cluster-wide MIG strategy.
fn conflicted(p: &Prepared, conflicting: &[String]) -> (bool, Reason, String) {
    if let (true, Some(why)) = (conflicting.is_empty(), &p.blocked) {
        (true, Reason::ClusterWideConflict, why.clone())
    } else if conflicting.is_empty() {
        let msg = "no other policy of the same priority selects these nodes".to_string();
        (false, Reason::NoOverlap, msg)
    } else {
        let msg = governed(conflicting, "another policy");
        (true, Reason::OverlappingPolicy, msg)
    }
}

/// `N matched nodes are governed by <by>: <up to 10 of them>`.
fn governed(nodes: &[String], by: &str) -> String {
    let shown: Vec<&str> = nodes.iter().take(10).map(String::as_str).collect();
    format!(
        "{} matched nodes are governed by {by}: {}",
        nodes.len(),
        shown.join(", ")
    )
}

/// An override is intended: a policy of higher priority takes some of the nodes.
fn overridden(overridden: &[String]) -> (bool, Reason, String) {
    if overridden.is_empty() {
        let msg = "no policy of higher priority selects these nodes".to_string();
        (false, Reason::NotOverridden, msg)
    } else {
        let msg = governed(overridden, "a policy of higher priority");
        (true, Reason::HigherPriorityPolicy, msg)
    }
}

fn degraded(
    p: &Prepared,
    t: &Tally,
    c: &Cluster,
    refused: &[RefusedWrite],
) -> (bool, Reason, String) {
    let names = |s: NodeState, n: usize| -> String {
        let v: Vec<&str> = t
            .in_state(s)
            .iter()
            .take(n)
            .map(|d| d.name.as_str())
            .collect();
        v.join(", ")
    };
    // A MIG pool moving to the DRA driver needs the ClusterPolicy's MIG strategy until it moved.
    let contested = c
        .cluster_policy_contested
        .filter(|_| p.kind() != Kind::Dra || p.mig().is_some());
    if let Some(gc) = c.gpu_cluster.filter(|_| p.kind() != Kind::Dra) {
        (
            true,
            Reason::GpuClusterPresent,
            format!(
                "the GPU Operator runs in DRA-only mode (GPUCluster {gc}), which cannot coexist with a ClusterPolicy: no device plugin reads this policy's config, so its nodes are left as they are; use backend: dra"
            ),
        )
    } else if !c.cluster_policy_found && c.gpu_cluster.is_none() {
        (true, Reason::ClusterPolicyMissing, "the GPU Operator ClusterPolicy was not found: nodes are labelled but no device plugin reads the config".into())
    } else if let Some(what) = contested {
        (
            true,
            Reason::ClusterPolicyContested,
            format!(
                "another controller keeps reverting the ClusterPolicy settings this policy needs ({what}); make it leave them alone, e.g. ignore those fields in your GitOps tool"
            ),
        )
    } else if let Some(key) = c.untolerated_taint {
        (
            true,
            Reason::ReadinessTaintNotTolerated,
            format!(
                "the operator runs with --readiness-taint={key}, but ClusterPolicy spec.daemonsets.tolerations does not tolerate {key}: the GPU Operator's driver, device plugin and GPU Feature Discovery would never start on a node with it, so no readiness taint is removed. Add {{key: {key}, operator: Exists, effect: NoSchedule}} there (and to NFD's worker)"
            ),
        )
    } else if let Some(msg) = infeasible_geometry(t) {
        (true, Reason::MigGeometryInfeasible, msg)
    } else if !t.in_state(NodeState::Stale).is_empty() {
        let layout = p
            .spec
            .mig
            .as_ref()
            .and_then(|m| m.layout.as_deref())
            .unwrap_or_default();
        (
            true,
            Reason::MigLayoutChanged,
            format!(
                "the content of MIG layout {layout} changed (e.g. a GPU Operator upgrade) since these nodes were configured, and the MIG manager only acts on a label change: {}; annotate this policy with {ANNOTATION_REAPPLY_MIG}=true to re-apply it through {MIG_DISABLED_LAYOUT}",
                names(NodeState::Stale, 10)
            ),
        )
    } else if !t.in_state(NodeState::Failed).is_empty()
        && p.vm().is_some_and(|v| v.vgpu_config.is_some())
    {
        (
            true,
            Reason::VgpuConfigFailed,
            format!(
                "nvidia.com/vgpu.config.state failed, or pending past the timeout, on: {}",
                names(NodeState::Failed, usize::MAX)
            ),
        )
    } else if !t.in_state(NodeState::Failed).is_empty() {
        (
            true,
            Reason::MigConfigFailed,
            format!(
                "nvidia.com/mig.config.state failed, or pending past the MIG timeout, on: {}",
                names(NodeState::Failed, usize::MAX)
            ),
        )
    } else if let Some(first) = refused.first() {
        (
            true,
            Reason::WriteRefused,
            format!(
                "the API server refused {} write(s) (status.refusedWrites), the first: {} {}: {}",
                refused.len(),
                first.kind,
                first.name,
                first.message
            ),
        )
    } else {
        (false, Reason::Healthy, "no failures".into())
    }
}

fn warnings(p: &Prepared, t: &Tally) -> Vec<String> {
    let mut w = p.warnings.clone();
    if let Some(l) = &p.latent {
        w.push(format!(
            "this policy governs no node yet; once it does: {l}"
        ));
    }
    if t.capacity_unknown {
        w.push(
            "schedulable replicas exclude nodes whose MIG layout's instance count is unknown"
                .into(),
        );
    }
    if !super::backend::memory_isolation(p) {
        w.push("time-slicing gives no memory or fault isolation between replicas".into());
    }
    w
}

/// The tally's node details with the conflicted and overridden nodes, non-ready first, then by
/// name; at most [`MAX_NODE_DETAILS`].
fn node_details(mut details: Vec<NodeDetail>, place: &Placement) -> Vec<NodeDetail> {
    let others = [
        (&place.conflicting, NodeState::Conflicted),
        (&place.overridden, NodeState::Overridden),
    ];
    for (list, state) in others {
        for c in list {
            let node = c.split(' ').next().unwrap_or_default();
            details.push(NodeDetail {
                name: node.into(),
                state,
                message: c.clone(),
                reason: None,
                served_by: None,
            });
        }
    }
    details.sort_by(|a, b| {
        ((a.state == NodeState::Applied), &a.name).cmp(&((b.state == NodeState::Applied), &b.name))
    });
    details.truncate(MAX_NODE_DETAILS);
    details
}

/// The status of one policy.
pub fn status(p: &Prepared, t: Tally, place: Placement, c: &Cluster) -> GpuSharingPolicyStatus {
    let generation = p.policy.metadata.generation;
    let refused_writes = refused_for(c.refused, p, &place);
    let cond = |type_, (ok, reason, msg): (bool, Reason, String)| {
        condition(type_, ok, reason, msg, generation)
    };
    let mut conditions = vec![
        cond(ConditionType::Accepted, accepted(p, &t)),
        cond(
            ConditionType::Ready,
            ready(p, &t, &place.missing_namespaces, c),
        ),
        cond(ConditionType::Progressing, progressing(p, &t)),
        cond(ConditionType::Conflicted, conflicted(p, &place.conflicting)),
        cond(ConditionType::Overridden, overridden(&place.overridden)),
        cond(ConditionType::Degraded, degraded(p, &t, c, &refused_writes)),
    ];
    if let Some(f) = c.fence {
        let reason = if f.fenced {
            Reason::AdmissionPoliciesEnforced
        } else {
            Reason::NotFenced
        };
        conditions.push(cond(
            ConditionType::Fenced,
            (f.fenced, reason, f.message.clone()),
        ));
    }
    if super::geometry::checks(p.spec) {
        conditions.push(cond(
            ConditionType::MigGeometryUnverified,
            unverified(&place),
        ));
    }
    let warnings = warnings(p, &t);
    let capacity = p.errors.is_empty().then(|| {
        t.capacity.clone().unwrap_or(Capacity {
            memory_isolation: super::backend::memory_isolation(p),
            ..Default::default()
        })
    });
    let held_nodes = t.held;
    let details = node_details(t.details, &place);
    GpuSharingPolicyStatus {
        observed_generation: generation,
        conditions,
        replicas: Some(super::backend::replicas(p)),
        nodes: Some(format!("{}/{}", t.applied, place.matched.len())),
        matched_nodes: place.matched.len() as i32,
        applied_nodes: t.applied,
        conflicting_nodes: place.conflicting.len() as i32,
        overridden_nodes: place.overridden.len() as i32,
        device_config_key: p.key.clone().filter(|_| p.kind().device_plugin()),
        templates: place.templates,
        served_by: (t.served_by.iter())
            .filter(|_| t.served_by_shown)
            .map(|(k, v)| (k.to_string(), *v))
            .collect(),
        quota_gaps: (p.extended().zip(c.quotas))
            .map(|(x, q)| super::backend::dra::quota_gaps(x, q))
            .unwrap_or_default(),
        mig_config: p
            .mig()
            .filter(|_| p.errors.is_empty())
            .map(|m| m.layout.clone()),
        vgpu_config: p.vm().and_then(|v| v.vgpu_config.clone()),
        capacity,
        node_details: details,
        warnings,
        unavailable_nodes: t.rollout.as_ref().map_or(0, |r| r.unavailable as i32),
        rollout: t.rollout.map(|r| RolloutStatus {
            max_unavailable: r.max_unavailable as i32,
            queued_nodes: r.queued.len() as i32,
            previous_device_config_keys: r.previous_keys.into_iter().collect(),
            halted_generation: r.halted.is_some().then_some(generation).flatten(),
            halted_nodes: r.halted.unwrap_or_default(),
        }),
        held_nodes,
        mig_geometry: super::geometry::report(p.spec, &place.gpu_models),
        autoscaling: None,
        demand: None,
        refused_writes,
    }
}

/// Whether the custom MIG layout lands on GPU models without a geometry table.
fn unverified(place: &Placement) -> (bool, Reason, String) {
    if place.unverified_products.is_empty() {
        let models: Vec<&str> = place.gpu_models.iter().copied().collect();
        let msg = if models.is_empty() {
            "no node runs the layout yet".to_string()
        } else {
            format!(
                "the layout was checked against the MIG geometry of {}",
                models.join(", ")
            )
        };
        return (false, Reason::GeometryChecked, msg);
    }
    let products: Vec<&str> = place
        .unverified_products
        .iter()
        .map(String::as_str)
        .collect();
    (
        true,
        Reason::UnknownGpuModel,
        format!(
            "no MIG geometry is known for {}: the layout is applied there unchecked; if the MIG manager cannot create it, the node reports nvidia.com/mig.config.state=failed and the rollout halts",
            products.join(", ")
        ),
    )
}
