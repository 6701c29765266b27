//! Incremental planning: what planning each node found in the last pass, and what it found it
//! from, so that a pass re-plans only the nodes whose view, governing policy or cluster-wide
//! inputs changed (see [`super::Planner`]).
//!
//! Two things are remembered per node. Which policies select it: a function of its labels and
//! of every policy's selector and precedence. Its plan before the rollout gate (decision,
//! labels, annotations, state, target, capacity): a function of its [`NodeView`], the policy
//! that governs it (its spec, key, errors, the cluster-wide blocks), a few cluster-wide inputs
//! (MIG layouts, custom layouts, the DRA-only `GPUCluster`, the ClusterPolicy's sandbox
//! settings), and of the clock when it reads it (a config label it changes is stamped with the
//! time). A memo is reused only when all of these are equal: policies and cluster-wide inputs
//! are compared through versions that change whenever their canonical text does (exact, no
//! hashing), the view field by field, and a plan that read the clock is never reused. What the
//! whole cluster decides together (which policy wins a node, rollout budgets, drains, capacity
//! sums, statuses, outputs) is computed every pass from the memos.

use std::collections::HashMap;
use std::sync::{Arc, Weak};

use crate::api::names::{LABEL_DEVICE_PLUGIN_CONFIG, LABEL_MIG_CONFIG, LABEL_VGPU_CONFIG};

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
    /// Its labels and annotations as planned here are exactly ours on it now: nothing to write
    /// unless the rollout gate changes them (see `node::metadata_in_sync`).
    pub metadata_in_sync: bool,
    /// An earlier change of ours on it is not confirmed yet (see
    /// `rollout::last_change_unconfirmed`).
    pub earlier_unconfirmed: bool,
}

/// The config labels a node carries (whoever set them), shared with its facts: what the
/// whole-cluster outputs read of every node, read once per change of its facts.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Named {
    pub device_config: Option<Arc<str>>,
    pub mig_config: Option<Arc<str>>,
    pub vgpu_config: Option<Arc<str>>,
}

/// What a node's plan was made under besides its view.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Under {
    /// The governing policy's version, when one governs.
    pub policy: Option<u64>,
    /// The version of the cluster-wide inputs.
    pub cluster: u64,
}

/// What planning one node found, and what from.
#[derive(Debug, Clone)]
pub struct NodeMemo {
    /// Shared with the plan, which names its nodes with it.
    name: Arc<str>,
    /// The facts planned from, by identity: the node cache keeps a node's facts while they do
    /// not change. Weak, so the memo does not keep facts the cache has let go (only their
    /// allocation, which also means no other facts can appear at that address meanwhile).
    facts: Weak<NodeFacts>,
    /// Its config labels.
    named: Named,
    /// The policies that select it (indices in precedence order), under a selection version.
    selected: Option<(u64, Vec<usize>)>,
    /// Its plan before the gate, what it was made under, and whether it read the clock.
    pre: Option<(Under, PreGate, bool)>,
    /// What runs on the node and its flags, as planned from.
    gpu_pods: Vec<String>,
    vm_pods: Vec<String>,
    dra_claims: Vec<String>,
    mig_stuck: bool,
    vgpu_stuck: bool,
}

impl NodeMemo {
    fn new(v: &NodeView) -> Self {
        NodeMemo {
            name: v.facts.name.as_str().into(),
            facts: Arc::downgrade(&v.facts),
            named: Named {
                device_config: v.facts.labels.get_shared(LABEL_DEVICE_PLUGIN_CONFIG),
                mig_config: v.facts.labels.get_shared(LABEL_MIG_CONFIG),
                vgpu_config: v.facts.labels.get_shared(LABEL_VGPU_CONFIG),
            },
            selected: None,
            pre: None,
            gpu_pods: Vec::new(),
            vm_pods: Vec::new(),
            dra_claims: Vec::new(),
            mig_stuck: false,
            vgpu_stuck: false,
        }
    }

    /// Planned from these facts (the same shared facts, or equal ones still held elsewhere).
    fn same_facts(&self, v: &NodeView) -> bool {
        self.same_allocation(v) || self.facts.upgrade().is_some_and(|f| *f == *v.facts)
    }

    /// Planned from the very facts of `v` (the weak reference keeps the allocation, so no
    /// other node's facts can have taken its address).
    fn same_allocation(&self, v: &NodeView) -> bool {
        std::ptr::eq(self.facts.as_ptr(), Arc::as_ptr(&v.facts))
    }

    /// The node's name, shared.
    pub fn name(&self) -> &Arc<str> {
        &self.name
    }

    /// The same pods, claims and flags as when planned.
    fn same_rest(&self, v: &NodeView) -> bool {
        self.gpu_pods == v.gpu_pods
            && self.vm_pods == v.vm_pods
            && self.dra_claims == v.dra_claims
            && self.mig_stuck == v.mig_stuck
            && self.vgpu_stuck == v.vgpu_stuck
    }

    /// The config labels the node carries.
    pub fn named(&self) -> &Named {
        &self.named
    }

    /// The policies that select the node, when known under `selection`.
    pub fn selected(&self, selection: u64) -> Option<&[usize]> {
        match &self.selected {
            Some((v, s)) if *v == selection => Some(s),
            _ => None,
        }
    }

    pub fn set_selected(&mut self, selection: u64, s: Vec<usize>) {
        self.selected = Some((selection, s));
    }

    /// The plan before the gate, when it was made under `under` from the node's view as it is
    /// and did not read the clock.
    fn reusable(&self, v: &NodeView, under: Under) -> bool {
        matches!(&self.pre, Some((u, _, false)) if *u == under) && self.same_rest(v)
    }

    /// The plan before the gate (after [`Memo::plan_node`]).
    pub fn pre(&self) -> &PreGate {
        &self.pre.as_ref().expect("planned").1
    }
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

/// The versions a pass plans under.
pub struct Pass {
    /// By policy, in precedence order.
    pub policies: Vec<u64>,
    pub cluster: u64,
}

/// The memos of the last pass, in its nodes' order, and the versions they were made under.
#[derive(Debug, Default, Clone)]
pub struct Memo {
    nodes: Vec<Option<NodeMemo>>,
    policies: Versions,
    cluster: Versions,
    /// Nodes planned (not reused) in the last pass.
    pub replanned: usize,
}

impl Memo {
    /// The version of every policy's selector, in precedence order (which policies select a
    /// node follows from it and the node's labels).
    pub fn selection(&mut self, prepared: &[Prepared]) -> u64 {
        let selectors: Vec<String> = prepared
            .iter()
            .map(|p| format!("{}={:?}", p.name, p.spec.node_selector))
            .collect();
        self.cluster.version("selection", selectors.join("\n"))
    }

    /// Starts planning the nodes: the versions of every policy (in precedence order) and of the
    /// cluster-wide inputs, as the node transitions read them.
    pub fn begin(&mut self, prepared: &[Prepared], cluster: &ClusterFacts) -> Pass {
        self.replanned = 0;
        let names: std::collections::HashSet<&str> =
            prepared.iter().map(|p| p.name.as_str()).collect();
        self.policies
            .by_name
            .retain(|name, _| names.contains(name.as_str()));
        let policies = prepared
            .iter()
            .map(|p| self.policies.version(&p.name, policy_text(p)))
            .collect();
        let cluster = self
            .cluster
            .version("cluster", cluster_text(prepared, cluster));
        Pass { policies, cluster }
    }

    /// The last pass's memos of these nodes (in their order) whose facts are the same; fresh
    /// memos for the others.
    /// `in_order`: [`Memo::in_order`] is already known to hold.
    pub fn recall(&mut self, views: &[&NodeView], in_order: bool) -> Vec<NodeMemo> {
        let same_order = in_order || self.in_order(views);
        let mut old = std::mem::take(&mut self.nodes);
        let index: HashMap<Arc<str>, usize> = if same_order {
            HashMap::new()
        } else {
            old.iter()
                .enumerate()
                .filter_map(|(i, m)| Some((m.as_ref()?.name.clone(), i)))
                .collect()
        };
        views
            .iter()
            .enumerate()
            .map(|(pos, v)| {
                let at = if same_order {
                    Some(pos)
                } else {
                    index.get(v.facts.name.as_str()).copied()
                };
                at.and_then(|i| old[i].take())
                    .filter(|m| m.same_facts(v))
                    .map(|mut m| {
                        // The same facts, perhaps through another allocation.
                        if !m.same_allocation(v) {
                            m.facts = Arc::downgrade(&v.facts);
                        }
                        m
                    })
                    .unwrap_or_else(|| NodeMemo::new(v))
            })
            .collect()
    }

    /// Whether `views` are the nodes of the last pass in its order (which was name order): the
    /// same facts by identity, or else the same name. Comparing pointers first spares reading
    /// every node's name each pass.
    pub fn in_order(&self, views: &[&NodeView]) -> bool {
        self.nodes.len() == views.len()
            && self.nodes.iter().zip(views).all(|(m, v)| {
                m.as_ref()
                    .is_some_and(|m| m.same_allocation(v) || *m.name == *v.facts.name)
            })
    }

    /// Makes sure the memo holds the node's plan before the gate under `under`: kept when it
    /// is reusable, else made by `plan()` (which also says whether it read the clock).
    pub fn plan_node(
        &mut self,
        m: &mut NodeMemo,
        v: &NodeView,
        under: Under,
        plan: impl FnOnce() -> (PreGate, bool),
    ) {
        if m.reusable(v, under) {
            return;
        }
        self.replanned += 1;
        let (pre, read_clock) = plan();
        m.pre = Some((under, pre, read_clock));
        m.gpu_pods.clone_from(&v.gpu_pods);
        m.vm_pods.clone_from(&v.vm_pods);
        m.dra_claims.clone_from(&v.dra_claims);
        m.mig_stuck = v.mig_stuck;
        m.vgpu_stuck = v.vgpu_stuck;
    }

    /// Ends a pass: these memos (in the pass's node order) are what the next pass recalls.
    pub fn finish(&mut self, memos: Vec<NodeMemo>) {
        self.nodes = memos.into_iter().map(Some).collect();
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
