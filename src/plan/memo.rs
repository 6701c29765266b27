//! Incremental planning: what planning each node found in the last pass, and what it found it
//! from, so that a pass re-plans only the nodes whose view, governing policy or cluster-wide
//! inputs changed (see [`super::Planner`]).
//!
//! A node's plan before the rollout gate (decision, labels, annotations, state, target, capacity)
//! is a function of its [`NodeView`], the policy that governs it (its spec, key, errors, the
//! cluster-wide blocks) and a few cluster-wide inputs (MIG layouts, custom layouts, the
//! DRA-only `GPUCluster`, the ClusterPolicy's sandbox settings), and of the clock when it reads
//! it (a config label it changes is stamped with the time). A memo is reused only when all of
//! these are equal: the policy and the cluster-wide inputs are compared through versions that
//! change whenever their canonical text does (exact, no hashing), the view field by field, and
//! a plan that read the clock is never reused. What the whole cluster decides together (which
//! policy wins a node, rollout budgets, drains, capacity sums, statuses, outputs) is computed
//! every pass from the memos.

use std::collections::HashMap;
use std::sync::{Arc, Weak};

use super::NodeFacts;
use super::capacity::NodeCapacity;
use super::input::{ClusterFacts, NodeView};
use super::node::Outcome;
use super::policies::Prepared;

/// A node's plan before the rollout gate.
#[derive(Debug, Clone, PartialEq)]
pub struct PreGate {
    /// The transition holds the node as it is.
    pub hold: bool,
    /// The rollout target (mark) of its policy's target for it.
    pub target: Option<String>,
    pub outcome: Outcome,
    /// What it offers, when `Applied` before the gate.
    pub capacity: Option<NodeCapacity>,
    /// The labels it wants are the ones we own on it now (no label change).
    pub in_sync: bool,
    /// An earlier change of ours on it is not confirmed yet (see
    /// `rollout::last_change_unconfirmed`).
    pub earlier_unconfirmed: bool,
}

/// What a node's memo was planned under besides its view.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Under {
    /// The governing policy's version, when one governs.
    pub policy: Option<u64>,
    /// The version of the cluster-wide inputs.
    pub cluster: u64,
}

#[derive(Debug, Clone)]
struct NodeMemo {
    /// The facts planned from, by identity: the node cache keeps a node's facts while they do
    /// not change. Weak, so the memo does not keep facts the cache has let go (only their
    /// allocation, which also means no other facts can appear at that address meanwhile).
    facts: Weak<NodeFacts>,
    /// What runs on the node and its flags, as planned from.
    gpu_pods: Vec<String>,
    vm_pods: Vec<String>,
    dra_claims: Vec<String>,
    mig_stuck: bool,
    vgpu_stuck: bool,
    under: Under,
    pre: PreGate,
    /// Its plan read the clock: planned again next pass.
    read_clock: bool,
}

/// Versions of texts by name: the same number while the text stays the same.
#[derive(Debug, Default, Clone)]
struct Versions {
    by_name: HashMap<String, (String, u64)>,
    next: u64,
}

impl Versions {
    fn version(&mut self, name: &str, text: String) -> u64 {
        if let Some((t, v)) = self.by_name.get(name)
            && *t == text
        {
            return *v;
        }
        self.next += 1;
        self.by_name.insert(name.to_string(), (text, self.next));
        self.next
    }
}

/// The memos of the last pass, and the versions they were made under.
#[derive(Debug, Default, Clone)]
pub struct Memo {
    nodes: HashMap<String, NodeMemo>,
    /// Memos made or kept this pass (they replace `nodes` at [`Memo::finish`]).
    next: HashMap<String, NodeMemo>,
    policies: Versions,
    cluster: Versions,
    /// Nodes planned (not reused) in the last pass.
    pub replanned: usize,
}

/// The same view of a node: the same facts (the same shared facts, or equal ones while the old
/// ones are still held elsewhere) and the same pods, claims and flags its transition reads.
fn same_view(m: &NodeMemo, v: &NodeView) -> bool {
    let same_facts = std::ptr::eq(m.facts.as_ptr(), Arc::as_ptr(&v.facts))
        || m.facts.upgrade().is_some_and(|f| *f == *v.facts);
    same_facts
        && m.gpu_pods == v.gpu_pods
        && m.vm_pods == v.vm_pods
        && m.dra_claims == v.dra_claims
        && m.mig_stuck == v.mig_stuck
        && m.vgpu_stuck == v.vgpu_stuck
}

impl Memo {
    /// Starts a pass: the versions of every policy (in precedence order) and of the cluster-wide
    /// inputs, as the node transitions read them.
    pub fn begin(&mut self, prepared: &[Prepared], cluster: &ClusterFacts) -> (Vec<u64>, u64) {
        self.replanned = 0;
        self.next = HashMap::with_capacity(self.nodes.len());
        self.policies
            .by_name
            .retain(|name, _| prepared.iter().any(|p| p.name == *name));
        let versions = prepared
            .iter()
            .map(|p| self.policies.version(&p.name, policy_text(p)))
            .collect();
        let cluster = self.cluster.version("", cluster_text(prepared, cluster));
        (versions, cluster)
    }

    /// The node's plan before the gate: the memo when its view and what it was planned under
    /// are the same, else `plan()` (which also says whether it read the clock).
    pub fn plan_node(
        &mut self,
        view: &NodeView,
        under: Under,
        plan: impl FnOnce() -> (PreGate, bool),
    ) -> &PreGate {
        let name = view.facts.name.clone();
        let kept = self
            .nodes
            .remove(&name)
            .filter(|m| !m.read_clock && m.under == under && same_view(m, view));
        let memo = match kept {
            Some(m) => m,
            None => {
                self.replanned += 1;
                let (pre, read_clock) = plan();
                NodeMemo {
                    facts: Arc::downgrade(&view.facts),
                    gpu_pods: view.gpu_pods.clone(),
                    vm_pods: view.vm_pods.clone(),
                    dra_claims: view.dra_claims.clone(),
                    mig_stuck: view.mig_stuck,
                    vgpu_stuck: view.vgpu_stuck,
                    under,
                    pre,
                    read_clock,
                }
            }
        };
        &self.next.entry(name).or_insert(memo).pre
    }

    /// Ends a pass: the memos of nodes no longer there go.
    pub fn finish(&mut self) {
        self.nodes = std::mem::take(&mut self.next);
    }
}

/// What of a policy its nodes' transitions read, as text.
fn policy_text(p: &Prepared) -> String {
    format!(
        "{}\n{}\n{:?}\n{:?}\n{:?}\n{}\n{}",
        p.name,
        serde_json::to_string(p.spec).unwrap_or_default(),
        p.key,
        p.errors,
        p.blocked,
        p.release_when_blocked,
        p.reapply_requested(),
    )
}

/// The cluster-wide inputs the node transitions read, as text: custom layouts (what a layout
/// name means), NVIDIA's and our MIG configs, the DRA-only `GPUCluster`, the sandbox settings.
fn cluster_text(prepared: &[Prepared], c: &ClusterFacts) -> String {
    let custom: Vec<(&str, &str)> = prepared
        .iter()
        .filter_map(|p| {
            let m = p.mig()?;
            Some((m.layout.as_str(), m.custom.as_ref()?.1.as_str()))
        })
        .collect();
    format!(
        "{custom:?}\n{}\n{}\n{:?}\n{:?}",
        serde_json::to_string(&c.base_mig_configs).unwrap_or_default(),
        serde_json::to_string(&c.current_mig_configs).unwrap_or_default(),
        c.gpu_cluster,
        c.sandbox,
    )
}
