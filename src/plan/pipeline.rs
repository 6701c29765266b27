//! The pipeline: prepare the policies, assign nodes, plan each node (memoized), gate the
//! changes through each policy's rollout, render the outputs and statuses, plan demand and the
//! Karpenter overlays. [`plan`] from scratch, [`Planner`] pass after pass.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use crate::api::crd::{Capacity, GpuSharingPolicyStatus, NodeDetail};
use crate::api::names::*;
use crate::api::state::NodeState;
use crate::nvidia::state::Workload;
use crate::validate::FieldError;

use super::decision::{Decision, Env};
use super::desired::Plan;
use super::facts::NodeFacts;
use super::input::{NodeView, PlanInput};
use super::labels::SmallMap;
use super::nodemap::NodeMap;
use super::policies::Prepared;
use super::status::{Cluster, Placement, Tally};
use super::{
    assign, autoscaling, backend, capacity, demand, drain, geometry, memo, node, outputs, policies,
    rollout, status, targets,
};

/// What planning the nodes produced.
#[derive(Default)]
struct NodePlans<'n> {
    /// By node, in the nodes' order: the labels and annotations we want to own.
    labels: Vec<SmallMap>,
    annotations: Vec<SmallMap>,
    /// Per policy (index in precedence order).
    tallies: BTreeMap<usize, Tally>,
    /// Per policy: the nodes it governs and does not reject.
    accepted: BTreeMap<usize, Vec<&'n NodeFacts>>,
    /// Nodes whose labels or annotations must be written, in name order.
    to_write: Vec<String>,
    /// By value of our policy label in the plan: how many nodes carry it (`labelled_by`: those
    /// labelled with their governing policy's name, by its index).
    labelled: BTreeMap<String, u64>,
    labelled_by: Vec<u64>,
    /// Device-plugin config keys that node labels we keep or write name.
    used_keys: BTreeSet<String>,
    /// Tainted nodes ready to lose the readiness taint.
    untaint: Vec<String>,
    /// Nodes whose spare taint is to be added (true) or removed (false).
    spare: Vec<(String, bool)>,
    drains: BTreeMap<String, drain::Drain>,
}

/// Runs the per-node transition on every node, gates the changes through each policy's rollout
/// budget, and gathers what it found per policy.
fn plan_nodes<'n>(
    input: &PlanInput,
    prepared: &[Prepared],
    nodes: &[&'n NodeView],
    winner: &[Option<usize>],
    memos: &[memo::NodeMemo],
) -> NodePlans<'n> {
    let mut entries: Vec<node::Entry<'n, '_>> = Vec::with_capacity(nodes.len());
    for ((&v, &wi), m) in nodes.iter().zip(winner).zip(memos) {
        let pre = m.pre();
        entries.push(node::Entry {
            node: v,
            policy: wi,
            target: pre.target.as_deref(),
            hold: pre.hold,
            outcome: std::borrow::Cow::Borrowed(&pre.outcome),
            capacity: pre.capacity,
            in_sync: pre.in_sync,
            earlier_unconfirmed: pre.earlier_unconfirmed,
        });
    }
    let (progress, drains) = rollout::gate(&mut entries, prepared, input, node::queued);
    let mut out = NodePlans {
        drains,
        labelled_by: vec![0; prepared.len()],
        ..Default::default()
    };
    for (i, p) in progress {
        out.tallies.entry(i).or_default().rollout = Some(p);
    }
    for (
        node::Entry {
            node: v,
            policy: wi,
            target: _,
            hold,
            outcome: o,
            capacity: c,
            ..
        },
        m,
    ) in entries.into_iter().zip(memos)
    {
        let n: &'n NodeFacts = &v.facts;
        // Remembered unless the gate changed the outcome.
        let in_sync = match &o {
            std::borrow::Cow::Borrowed(_) => m.pre().metadata_in_sync,
            std::borrow::Cow::Owned(o) => node::metadata_in_sync(n, &o.labels, &o.annotations),
        };
        if !in_sync {
            out.to_write.push(n.name.clone());
        }
        // Borrowed from the memo unless the gate changed it: what the plan keeps is shared.
        let o: &node::Outcome = &o;
        match (o.labels.get(LABEL_POLICY), wi) {
            // Nearly always its governing policy's name: counted without a lookup by name.
            (Some(p), Some(i)) if *p == prepared[i].name => out.labelled_by[i] += 1,
            (Some(p), _) => *out.labelled.entry(p.clone()).or_default() += 1,
            (None, _) => {}
        }
        taints(&mut out, input, v, wi.map(|i| &prepared[i]), o);
        // A held node keeps every label value; otherwise only its config key names a key.
        let held = o.labels.values().filter(|_| hold);
        let written = o.labels.get(LABEL_DEVICE_PLUGIN_CONFIG).filter(|_| !hold);
        for k in held.chain(written) {
            if !out.used_keys.contains(k) {
                out.used_keys.insert(k.clone());
            }
        }
        if let (Some(i), Some(state)) = (wi, o.state) {
            let t = out.tallies.entry(i).or_default();
            let by = backend::dra::served_by(n, v.dra_slice.as_ref());
            *t.served_by.entry(by).or_default() += 1;
            let shown = backend::dra::shows_served_by(&prepared[i], n, by);
            t.served_by_shown |= shown;
            if state == NodeState::Applied {
                let c = c.expect("a node applied after the gate was applied before it");
                let total = t.capacity.get_or_insert_with(|| Capacity {
                    memory_isolation: true,
                    ..Default::default()
                });
                t.capacity_unknown |= !capacity::add_capacity(total, &c);
            }
            if !state.refused() {
                out.accepted.entry(i).or_default().push(n);
            }
            t.add(state, o.reason, || NodeDetail {
                name: n.name.clone(),
                state,
                message: o.message.clone(),
                reason: o.reason,
                served_by: shown.then(|| by.to_string()),
            });
        }
        out.labels.push(o.labels.clone());
        out.annotations.push(o.annotations.clone());
    }
    out
}

/// The policies governing a node (by index); without nodes (`render`), all of them, so that
/// cluster-wide conflicts are still reported.
fn governing(prepared: &[Prepared], winner: &[Option<usize>]) -> BTreeSet<usize> {
    if winner.is_empty() {
        return (0..prepared.len()).collect();
    }
    winner.iter().flatten().copied().collect()
}

/// Refuses the extended-resource policies that cannot be served (see
/// [`backend::dra::extended_conflicts`]).
fn extended_conflicts(
    prepared: &mut [Prepared],
    governing: &BTreeSet<usize>,
    c: &super::input::ClusterFacts,
) {
    let cluster = backend::dra::ClusterDra {
        classes: c.device_classes.as_deref(),
        slices_readable: !c.slices_unreadable,
        gpu_cluster: c.gpu_cluster.as_deref(),
    };
    backend::dra::extended_conflicts(prepared, governing, &cluster);
}

/// Karpenter's NodeOverlays for the policies' nodes, with what each policy's status says of
/// them (none without Karpenter).
fn node_overlays(
    prepared: &[Prepared],
    input: &PlanInput,
    statuses: &mut BTreeMap<String, GpuSharingPolicyStatus>,
) -> BTreeMap<String, serde_json::Value> {
    let c = &input.cluster;
    let Some(a) = &c.autoscaling else {
        return BTreeMap::new();
    };
    let (overlays, found) = autoscaling::plan(
        prepared,
        &input.nodes,
        a,
        c.base_mig_configs.as_ref(),
        &c.sandbox,
    );
    for (name, st) in found {
        if let Some(s) = statuses.get_mut(&name) {
            s.autoscaling = Some(st);
        }
    }
    overlays
}

/// The node's taint changes: the readiness taint's removal once it is configured, the spare
/// taint (`preferBusyNodes`) on or off.
fn taints(
    out: &mut NodePlans,
    input: &PlanInput,
    v: &NodeView,
    p: Option<&Prepared>,
    o: &node::Outcome,
) {
    let n = &v.facts;
    if let Some(t) = input.cluster.readiness_taint.as_ref()
        && t.tolerated_on(&n.name)
        && super::facts::ready_to_untaint(n, p.is_some(), o.state)
    {
        out.untaint.push(n.name.clone());
    }
    let refused = o.state.is_none_or(|s| s.refused());
    let spare = super::demand::wants_spare(p, refused, v);
    if spare != n.spare {
        out.spare.push((n.name.clone(), spare));
    }
}

/// Per-node values, given in the nodes' (name) order, by node name (built in one sweep).
fn by_name(names: &[Arc<str>], values: Vec<SmallMap>) -> NodeMap<SmallMap> {
    NodeMap::from_sorted(names.iter().cloned().zip(values).collect())
}

/// The nodes policy `i` selects that another policy governs, with that policy's index.
fn matched_winners<'a>(
    a: &'a assign::Assignment,
    i: usize,
) -> impl Iterator<Item = (&'a str, usize)> + 'a {
    a.matched[i]
        .iter()
        .zip(&a.matched_at[i])
        .filter_map(move |(name, pos)| {
            let w = a.winner[*pos].expect("a matched node has a winner");
            (w != i).then_some((*name, w))
        })
}

/// What the plan says per policy.
#[derive(Default)]
struct PerPolicy {
    statuses: BTreeMap<String, GpuSharingPolicyStatus>,
    claim_templates: BTreeMap<String, serde_json::Value>,
    invalid: BTreeMap<String, Vec<FieldError>>,
}

/// Each policy's status, claim templates and errors, from what planning its nodes found (taken
/// out of `np`, which also gets its labelled-node counts by name).
fn per_policy(
    prepared: &[Prepared],
    assignment: &assign::Assignment,
    np: &mut NodePlans,
    input: &PlanInput,
    cluster: &Cluster,
) -> PerPolicy {
    let mut out = PerPolicy::default();
    for (i, p) in prepared.iter().enumerate() {
        if np.labelled_by[i] > 0 {
            *np.labelled.entry(p.name.clone()).or_default() += np.labelled_by[i];
        }
        let accepted = np.accepted.remove(&i).unwrap_or_default();
        let (templates, missing_namespaces) =
            outputs::claim_templates(p, &accepted, input.cluster.namespaces.as_ref());
        let matched: &[&str] = &assignment.matched[i];
        // A node another policy wins is overridden when that policy has the higher priority
        // (intended), and a conflict when only age or name decided.
        let (mut conflicting, mut overridden) = (Vec::new(), Vec::new());
        for (n, w) in matched_winners(assignment, i) {
            let w = &prepared[w];
            if w.spec.priority > p.spec.priority {
                overridden.push(format!("{n} (overridden by {})", w.name));
            } else {
                conflicting.push(format!("{n} (won by {})", w.name));
            }
        }
        let (gpu_models, unverified_products) = geometry::gpu_models(p.spec, &accepted);
        let place = Placement {
            matched,
            conflicting,
            overridden,
            missing_namespaces,
            templates: templates.iter().map(|(id, _)| id.clone()).collect(),
            gpu_models,
            unverified_products,
        };
        let tally = np.tallies.remove(&i).unwrap_or_default();
        out.statuses
            .insert(p.name.clone(), status::status(p, tally, place, cluster));
        out.claim_templates.extend(templates);
        if !p.errors.is_empty() {
            out.invalid.insert(p.name.clone(), p.errors.clone());
        }
    }
    out
}

/// One node's plan before the rollout gate, and whether it read the clock. Its inputs are
/// its memo's key (see `memo`).
fn plan_node(i: &memo::NodeInputs) -> (memo::PreGate, bool) {
    let n: &NodeFacts = i.facts;
    let policy = i.policy;
    let hash = |name: &str| i.cluster.layout_hash(name);
    let env = Env::of(i, &hash);
    let decision = node::decide(n, policy, &env);
    let hold = matches!(decision, Decision::Hold { .. });
    let mut outcome = node::outcome(n, policy, &env, decision);
    if let Some(w) = policy {
        rollout::keep_mark(n, &mut outcome, &w.name);
        // A refused policy changes nothing on its nodes, nor a policy on a node it refuses
        // (one whose GPUs cannot take it): no drain or reservation of it goes on there, so its
        // cordon goes (the node is left as it was otherwise).
        if !w.accepted() || outcome.state.is_some_and(NodeState::refused) {
            outcome.annotations.remove(ANNOTATION_CORDONED);
        }
    }
    // The memo keeps these maps until the node changes: no unused room in them.
    outcome.labels.shrink();
    outcome.annotations.shrink();
    let capacity = policy
        .filter(|_| outcome.state == Some(NodeState::Applied))
        .map(|p| backend::node_capacity(p, n, i.cluster.mig_layouts));
    let pre = memo::PreGate {
        in_sync: outcome.labels == node::owned_labels(n),
        metadata_in_sync: node::metadata_in_sync(n, &outcome.labels, &outcome.annotations),
        earlier_unconfirmed: rollout::last_change_unconfirmed(n),
        hold,
        target: policy
            .and_then(|w| targets::node_target(w, n))
            .map(|t| t.mark()),
        outcome,
        capacity,
    };
    (pre, env.read_clock())
}

/// Whether some node's device-plugin config label names an MPS config of our ConfigMap as it
/// is now: a node whose device plugin runs MPS.
fn mps_running(input: &PlanInput, named: &[memo::NodeMemo]) -> bool {
    let mps_keys: BTreeSet<&str> = input
        .cluster
        .current_device_config
        .iter()
        .filter(|(_, text)| {
            text.contains("mps:")
                && crate::api::yaml::from_str::<serde_json::Value>(text)
                    .is_ok_and(|v| v["sharing"]["mps"].is_object())
        })
        .map(|(k, _)| k.as_str())
        .collect();
    !mps_keys.is_empty()
        && named.iter().any(|m| {
            m.named()
                .device_config
                .as_deref()
                .is_some_and(|k| mps_keys.contains(k))
        })
}

/// The cluster facts every status reports on.
fn cluster_of(input: &PlanInput) -> Cluster<'_> {
    let c = &input.cluster;
    Cluster {
        cluster_policy_found: c.cluster_policy_found,
        cluster_policy_contested: input.memory.cluster_policy_contested.as_deref(),
        untolerated_taint: c
            .readiness_taint
            .as_ref()
            .filter(|t| t.untolerated())
            .map(|t| t.key.as_str()),
        gpu_cluster: c.gpu_cluster.as_deref(),
        gpu_operator_namespace_missing: input.memory.gpu_operator_namespace_missing.as_deref(),
        fence: input.memory.fence.as_ref(),
        refused: &input.memory.refused_writes,
        quotas: c.quotas.as_deref(),
    }
}

/// Computes the desired state from scratch (nothing remembered; see [`Planner`]).
pub fn plan(input: &PlanInput) -> Plan {
    Planner::default().plan(input)
}

/// The planner as the controller runs it, pass after pass: it remembers what planning each
/// node found (see [`memo`]) and re-plans only the nodes whose view, governing policy or
/// cluster-wide inputs changed; everything decided across nodes is decided again every pass.
/// Its plan equals [`plan`]'s for the same input, whatever the passes before (a property test
/// in `tests/planner.rs` checks it on random histories).
#[derive(Debug, Default, Clone)]
pub struct Planner {
    memo: memo::Memo,
}

impl Planner {
    /// Nodes planned (not reused) in the last pass.
    pub fn last_replanned(&self) -> usize {
        self.memo.replanned
    }

    /// Makes sure every node's memo holds its plan before the gate (kept, or planned again).
    fn plan_memos(
        &mut self,
        input: &PlanInput,
        prepared: &[Prepared],
        views: &[&NodeView],
        winner: &[Option<usize>],
        memos: &mut [memo::NodeMemo],
    ) {
        let cluster = memo::NodeCluster::of(prepared, &input.cluster);
        let pass = self.memo.begin(prepared, &cluster);
        for ((m, &v), &wi) in memos.iter_mut().zip(views).zip(winner) {
            let policy = wi.map(|i| &prepared[i]);
            let inputs = memo::NodeInputs::of(v, policy, &cluster, input.cluster.now);
            let under = memo::Under {
                policy: wi.map(|i| pass.policies[i]),
                cluster: pass.cluster,
            };
            self.memo
                .plan_node(m, &inputs, under, || plan_node(&inputs));
        }
    }

    /// Computes the desired state.
    pub fn plan(&mut self, input: &PlanInput) -> Plan {
        let c = &input.cluster;
        let mut prepared = policies::prepare_all(&input.policies, c.base_mig_configs.as_ref());
        policies::check_vgpu_types(&mut prepared, &c.base_vgpu_configs);
        // Nodes in name order, whatever order the caches gave them in (the last pass's order
        // is: the controller's cache gives them so).
        let mut views: Vec<&NodeView> = input.nodes.iter().collect();
        let in_order = self.memo.in_order(&views);
        if !in_order {
            views.sort_by(|a, b| a.name.cmp(&b.name));
        }
        let nodes: Vec<&NodeFacts> = views.iter().map(|v| &*v.facts).collect();
        let mut memos = self.memo.recall(&views, in_order);
        let selection = self.memo.selection(&prepared);
        let known: Vec<Option<&[usize]>> = memos.iter().map(|m| m.selected(selection)).collect();
        let (assignment, fresh) = assign::assign(&prepared, &nodes, &known);
        for (pos, s) in fresh {
            memos[pos].set_selected(selection, s);
        }
        let governing = governing(&prepared, &assignment.winner);
        let mut cluster_mig = assign::cluster_mig_strategy(&mut prepared, &governing);
        // `mixed` waits until no node runs MPS any more: NVIDIA's device plugin refuses MPS under
        // mixed, so the MPS nodes go back to exclusive first (their policy is blocked and they are
        // released, see `assign::cluster_mig_strategy`), then the cluster-wide setting changes.
        if cluster_mig == Some(crate::api::crd::MigStrategy::Mixed) && mps_running(input, &memos) {
            cluster_mig = None;
        }
        extended_conflicts(&mut prepared, &governing, c);
        self.plan_memos(input, &prepared, &views, &assignment.winner, &mut memos);
        let mut np = plan_nodes(input, &prepared, &views, &assignment.winner, &memos);

        let named: Vec<&memo::Named> = memos.iter().map(memo::NodeMemo::named).collect();
        let device_config = outputs::device_config(&prepared, input, &named, &np.used_keys);
        let mig_config = outputs::mig_config(&prepared, input, &named, &np.labels);
        let vgpu_config = outputs::vgpu_config(&prepared, input, &named, &np.labels);
        drop(named);
        let names: Vec<Arc<str>> = memos.iter().map(|m| m.name().clone()).collect();
        // Nodes we keep on the DRA driver keep the classes their pods were scheduled through.
        let moved = (np.labels.iter()).any(|l| {
            l.get(LABEL_DEPLOY_DRA_DRIVER).map(String::as_str) == Some(backend::dra::DRA_DEPLOYED)
        });
        let device_classes =
            backend::dra::device_classes(&prepared, &governing, moved, c.device_classes.as_deref());
        self.memo.finish(memos);
        let cluster_policy_spec = outputs::cluster_policy_spec(
            input,
            outputs::Owned {
                any_policy: !prepared.is_empty(),
                mig_config: mig_config.is_some(),
                cluster_mig,
                vm_nodes: np.labels.iter().any(|l| {
                    Workload::parse(l.get(LABEL_WORKLOAD).map(String::as_str))
                        .is_some_and(Workload::is_vm)
                }),
                vgpu_config: vgpu_config.is_some(),
            },
        );
        let cluster = cluster_of(input);
        let mut per_policy = per_policy(&prepared, &assignment, &mut np, input, &cluster);
        let demand = demand::plan(&prepared, &views, &assignment.winner, input);
        // A drain demand gave up before its first eviction evicts nothing.
        for node in &demand.given_up {
            np.drains.remove(node);
        }
        for (name, st) in &demand.statuses {
            if let Some(s) = per_policy.statuses.get_mut(name) {
                s.demand = Some(st.clone());
            }
        }
        let node_overlays = node_overlays(&prepared, input, &mut per_policy.statuses);
        Plan {
            device_config,
            mig_config,
            vgpu_config,
            cluster_policy_spec,
            node_labels: by_name(&names, np.labels),
            node_annotations: by_name(&names, np.annotations),
            statuses: per_policy.statuses,
            claim_templates: per_policy.claim_templates,
            invalid: per_policy.invalid,
            untaint: np.untaint,
            spare: np.spare,
            nodes_to_write: np.to_write,
            labelled_nodes: np.labelled,
            drains: np.drains,
            node_overlays,
            device_classes,
            demand,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::crd::RefusedWrite;
    use crate::plan::testing::{a100_node, policy};

    /// Two idle nodes, a policy with a budget of one: the first in name order starts, unless
    /// the API server refused its last write, which would hold the slot and stall the rollout.
    #[test]
    fn a_node_whose_write_was_refused_starts_after_the_others() {
        let node = |name: &str| NodeFacts {
            name: name.into(),
            ..a100_node(&[])
        };
        let ts = policy(
            "ts",
            "  strategy: timeSlicing\n  timeSlicing: {replicas: 2}\n",
        );
        let mut input = PlanInput::new(vec![ts], vec![node("a"), node("b")]);
        let started = |p: &Plan| p.nodes_to_write.clone();
        assert_eq!(started(&plan(&input)), ["a"]);
        input.memory.refused_writes = vec![RefusedWrite {
            kind: "Node".into(),
            name: "a".into(),
            message: "422 (Invalid): denied".into(),
        }];
        let p = plan(&input);
        assert_eq!(started(&p), ["b"]);
        let status = &p.statuses["ts"];
        assert_eq!(status.refused_writes, input.memory.refused_writes);
        let degraded = (status.conditions.iter())
            .find(|c| c.type_ == crate::api::state::ConditionType::Degraded)
            .map(|c| c.reason);
        assert_eq!(degraded, Some(crate::api::state::Reason::WriteRefused));
    }

    /// Under `disruption.mode: drain`, a node waiting for something evictions cannot bring
    /// (here: our DeviceClass mapping the name) is neither cordoned nor drained.
    #[test]
    fn a_wait_no_eviction_ends_drains_nothing() {
        let mut n = a100_node(&[("nvidia.com/mig.capable", "false")]);
        n.name = "a".into();
        let dra = policy(
            "dra",
            "  strategy: timeSlicing\n  timeSlicing: {replicas: 4}\n  backend: dra\n  dra: {extendedResources: true, driverFeatureGates: {ConsumableShares: true}}\n  disruption: {mode: drain}\n",
        );
        let mut input = PlanInput::new(vec![dra], vec![n]);
        input.nodes[0].gpu_pods = vec!["team/cuda".into()];
        let p = plan(&input);
        let detail = &p.statuses["dra"].node_details[0];
        assert_eq!(
            detail.reason,
            Some(crate::api::state::HoldReason::WaitingForDeviceClass)
        );
        assert!(p.drains.is_empty(), "{:?}", p.drains);
        let cordoned = p
            .node_annotations
            .get("a")
            .is_some_and(|a| a.contains_key(ANNOTATION_CORDONED));
        assert!(!cordoned);
    }

    /// A node moving back from the DRA driver under `disruption.mode: drain`: cordoned, and the
    /// pods kube-scheduler served through DRA on it evicted (their claims hold it there; they
    /// are no device-plugin pods); the DRA switch stays on until the claims are gone.
    #[test]
    fn moving_back_from_dra_drains_the_pods_the_dra_driver_serves() {
        let mut n = a100_node(&[
            ("nvidia.com/mig.capable", "false"),
            (LABEL_DEPLOY_DEVICE_PLUGIN, "false"),
            (LABEL_DEPLOY_DRA_DRIVER, "true"),
        ]);
        n.name = "a".into();
        n.owned.insert(LABEL_DEPLOY_DEVICE_PLUGIN);
        n.owned.insert(LABEL_DEPLOY_DRA_DRIVER);
        n.allocatable = [("nvidia.com/gpu", "0")].into_iter().collect();
        let ts = policy(
            "ts",
            "  strategy: timeSlicing\n  timeSlicing: {replicas: 4}\n  disruption: {mode: drain}\n",
        );
        let mut input = PlanInput::new(vec![ts], vec![n]);
        let v = &mut input.nodes[0];
        v.dra_claims = vec!["team/cuda-extended-resources-x7k2q".into()];
        v.dra_pods = vec!["team/cuda".into()];
        let p = plan(&input);
        let drain = p.drains.get("a").expect("drained");
        assert_eq!(drain.evict, ["team/cuda"]);
        let labels = &p.node_labels["a"];
        assert_eq!(
            labels.get(LABEL_DEPLOY_DRA_DRIVER).map(String::as_str),
            Some("true")
        );
        assert!(p.node_annotations["a"].contains_key(ANNOTATION_CORDONED));
    }
}
