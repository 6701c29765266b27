//! Incremental planning: what planning each node found in the last pass, and what it found it
//! from, so that a pass re-plans only the nodes whose view, governing policy or cluster-wide
//! inputs changed (see [`super::pipeline::Planner`]).
//!
//! Two things are remembered per node. Which policies select it: a function of its labels and
//! of every policy's selector and precedence. Its plan before the rollout gate (decision,
//! labels, annotations, state, target, capacity): a function of its [`NodeInputs`], the only
//! argument of the per-node planner, built in one place ([`NodeInputs::of`]):
//! - the node's own part (its facts, what runs on it, its flags), compared field by field;
//! - the governing policy, versioned by the whole [`Prepared`] policy, compared field by field
//!   with a copy of the last one: object, spec, key, errors, blocks, and what it rendered from
//!   NVIDIA's configs (e.g. a vGPU type's entries);
//! - the cluster-wide part, a [`NodeCluster`], versioned whole by its `Debug` text;
//! - the clock, read through `Env::now`: a plan that read it is never reused.
//!
//! A field added to [`NodeInputs`] or [`Prepared`] does not compile until the memo compares it
//! (it destructures both whole), one added to [`ClusterFacts`](super::input::ClusterFacts) not until [`NodeCluster::of`]
//! places it or says who reads it, and one added to [`NodeCluster`] enters its version by
//! itself: a new read of the per-node planner cannot miss the key. Versions change
//! whenever the text does (exact, no hashing). What the whole cluster decides together (which
//! policy wins a node, rollout budgets, drains, capacity sums, statuses, outputs) is computed
//! every pass from the memos.

use std::collections::HashMap;
use std::sync::{Arc, Weak};

use crate::api::names::{LABEL_DEVICE_PLUGIN_CONFIG, LABEL_MIG_CONFIG, LABEL_VGPU_CONFIG};

use super::capacity::NodeCapacity;
use super::facts::NodeFacts;
use super::input::NodeView;
use super::node::Outcome;
pub use super::nodeinputs::{NodeCluster, NodeInputs};
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
    dra_slice: Option<super::input::DraSlice>,
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
            dra_slice: None,
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

    /// Planned from the same inputs as `i` (its facts are: [`Memo::recall`] kept the memo), under
    /// the same versions of its policy and cluster-wide part, without reading the clock.
    fn reusable(&self, i: &NodeInputs, under: Under) -> bool {
        let NodeInputs {
            facts: _, // recall() keeps a memo only for the same facts
            gpu_pods,
            vm_pods,
            dra_claims,
            dra_slice,
            mig_stuck,
            vgpu_stuck,
            policy: _,  // versioned: under.policy
            cluster: _, // versioned: under.cluster
            now: _,     // a plan that read it is not reused
        } = i;
        matches!(&self.pre, Some((u, _, false)) if *u == under)
            && self.gpu_pods == *gpu_pods
            && self.vm_pods == *vm_pods
            && self.dra_claims == *dra_claims
            && self.dra_slice.as_ref() == *dra_slice
            && self.mig_stuck == *mig_stuck
            && self.vgpu_stuck == *vgpu_stuck
    }

    /// Remembers the node's own inputs its plan was made from.
    fn remember(&mut self, i: &NodeInputs) {
        let NodeInputs {
            facts: _, // kept from recall()
            gpu_pods,
            vm_pods,
            dra_claims,
            dra_slice,
            mig_stuck,
            vgpu_stuck,
            policy: _,
            cluster: _,
            now: _,
        } = i;
        self.gpu_pods = gpu_pods.to_vec();
        self.vm_pods = vm_pods.to_vec();
        self.dra_claims = dra_claims.to_vec();
        self.dra_slice = dra_slice.cloned();
        self.mig_stuck = *mig_stuck;
        self.vgpu_stuck = *vgpu_stuck;
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
    policies: PolicyVersions,
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
    pub fn begin(&mut self, prepared: &[Prepared], cluster: &NodeCluster) -> Pass {
        self.replanned = 0;
        let names: std::collections::HashSet<&str> =
            prepared.iter().map(|p| p.name.as_str()).collect();
        self.policies
            .by_name
            .retain(|name, _| names.contains(name.as_str()));
        let policies = prepared.iter().map(|p| self.policies.version(p)).collect();
        let cluster = self.cluster.version("cluster", format!("{cluster:?}"));
        Pass { policies, cluster }
    }

    /// The last pass's memos of these nodes (in their order) whose facts are the same; fresh
    /// memos for the others.
    /// `in_order`: [`Memo::in_order`] is already known to hold.
    pub fn recall(&mut self, views: &[&NodeView], in_order: bool) -> Vec<NodeMemo> {
        let same_order = in_order || self.in_order(views);
        let mut old = std::mem::take(&mut self.nodes);
        if same_order && old.len() == views.len() {
            // In place: the memos' vector is the largest thing a pass holds (some 7 MB at
            // 20,000 nodes), and a second one beside it was the peak of the operator's memory.
            for (slot, v) in old.iter_mut().zip(views) {
                let m = slot.take().filter(|m| m.same_facts(v)).map_or_else(
                    || NodeMemo::new(v),
                    |mut m| {
                        if !m.same_allocation(v) {
                            m.facts = Arc::downgrade(&v.facts);
                        }
                        m
                    },
                );
                *slot = Some(m);
            }
            return old.into_iter().map(|m| m.expect("filled above")).collect();
        }
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
        i: &NodeInputs,
        under: Under,
        plan: impl FnOnce() -> (PreGate, bool),
    ) {
        if m.reusable(i, under) {
            return;
        }
        self.replanned += 1;
        let (pre, read_clock) = plan();
        m.pre = Some((under, pre, read_clock));
        m.remember(i);
    }

    /// Ends a pass: these memos (in the pass's node order) are what the next pass recalls.
    pub fn finish(&mut self, memos: Vec<NodeMemo>) {
        self.nodes = memos.into_iter().map(Some).collect();
    }
}

/// Versions of prepared policies by name: the same number while the whole prepared policy
/// stays equal (compared with an owned copy of the last one, field by field: cheaper than
/// formatting 200 policies a pass).
#[derive(Debug, Default, Clone)]
struct PolicyVersions {
    by_name: HashMap<String, (Box<PolicyCopy>, u64)>,
    next: u64,
}

/// A [`Prepared`] policy, owned.
#[derive(Debug, Clone, PartialEq)]
struct PolicyCopy {
    policy: crate::api::crd::GpuSharingPolicy,
    spec: crate::api::crd::GpuSharingPolicySpec,
    errors: Vec<crate::validate::FieldError>,
    warnings: Vec<String>,
    key: Option<String>,
    config_text: Option<String>,
    backing: Option<super::backing::Backing>,
    blocked: Option<String>,
    release_when_blocked: bool,
    latent: Option<String>,
    waiting: Option<String>,
}

impl PolicyCopy {
    /// Every field of `p` but its name (the key it is kept under): a field added to [`Prepared`]
    /// does not compile here until it is part of the version.
    fn of(p: &Prepared) -> Self {
        let Prepared {
            name: _,
            policy,
            spec,
            errors,
            warnings,
            key,
            config_text,
            backing,
            blocked,
            release_when_blocked,
            latent,
            waiting,
        } = p;
        PolicyCopy {
            policy: (*policy).clone(),
            spec: (*spec).clone(),
            errors: errors.clone(),
            warnings: warnings.clone(),
            key: key.clone(),
            config_text: config_text.clone(),
            backing: backing.clone(),
            blocked: blocked.clone(),
            release_when_blocked: *release_when_blocked,
            latent: latent.clone(),
            waiting: waiting.clone(),
        }
    }

    /// Equal to `p` (every field but its name), without copying it.
    fn same(&self, p: &Prepared) -> bool {
        let Prepared {
            name: _,
            policy,
            spec,
            errors,
            warnings,
            key,
            config_text,
            backing,
            blocked,
            release_when_blocked,
            latent,
            waiting,
        } = p;
        self.policy == **policy
            && self.spec == **spec
            && self.errors == *errors
            && self.warnings == *warnings
            && self.key == *key
            && self.config_text == *config_text
            && self.backing == *backing
            && self.blocked == *blocked
            && self.release_when_blocked == *release_when_blocked
            && self.latent == *latent
            && self.waiting == *waiting
    }
}

impl PolicyVersions {
    fn version(&mut self, p: &Prepared) -> u64 {
        if let Some((copy, v)) = self.by_name.get(&p.name)
            && copy.same(p)
        {
            return *v;
        }
        self.next += 1;
        self.by_name
            .insert(p.name.clone(), (Box::new(PolicyCopy::of(p)), self.next));
        self.next
    }
}
