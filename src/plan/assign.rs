//! Which policy governs which node (precedence order, first selector that matches), and the
//! one MIG strategy the whole cluster runs with.

use std::collections::{BTreeSet, HashMap};

use crate::api::crd::{MigStrategy, Strategy};

use super::facts::NodeFacts;
use super::labels::{LabelLookup, selection_labels, selector_matches};
use super::policies::Prepared;

/// Which policies select which nodes, and which one governs each node.
#[derive(Default)]
pub struct Assignment<'n> {
    /// By policy (index in precedence order): the names of the nodes it selects, in the nodes'
    /// order.
    pub matched: Vec<Vec<&'n str>>,
    /// The same nodes, by position in the nodes given.
    pub matched_at: Vec<Vec<usize>>,
    /// By node (position in the nodes given): the index of the policy that governs it.
    pub winner: Vec<Option<usize>>,
}

/// Matches every node against the policies; the first in precedence order wins a node. A node
/// is checked only against the policies that can select it: those whose first `matchLabels`
/// entry it carries (looked up by that label's value), and those without `matchLabels`. The
/// same answer as checking every policy, without the cost of nodes x policies.
///
/// `known` gives, by node, the policies that select it when already known (the planner's
/// memo); the others are matched here and returned as `(position, policies)`.
pub fn assign<'n>(
    prepared: &[Prepared],
    nodes: &[&'n NodeFacts],
    known: &[Option<&[usize]>],
) -> (Assignment<'n>, Vec<(usize, Vec<usize>)>) {
    let mut by_label: HashMap<(&str, &str), Vec<usize>> = HashMap::new();
    let mut keys: BTreeSet<&str> = BTreeSet::new();
    let mut unindexed = Vec::new();
    for (i, p) in prepared.iter().enumerate() {
        let first = p.spec.node_selector.match_labels.as_ref();
        match first.and_then(|m| m.iter().next()) {
            Some((k, v)) => {
                keys.insert(k);
                by_label.entry((k, v)).or_default().push(i);
            }
            None => unindexed.push(i),
        }
    }
    let mut a = Assignment {
        matched: vec![Vec::new(); prepared.len()],
        matched_at: vec![Vec::new(); prepared.len()],
        winner: vec![None; nodes.len()],
    };
    let mut fresh = Vec::new();
    let mut candidates = Vec::new();
    for (pos, n) in nodes.iter().enumerate() {
        let selecting = match known.get(pos).copied().flatten() {
            Some(s) => s,
            None => {
                let sel_labels = selection_labels(&n.labels);
                candidates.clear();
                candidates.extend_from_slice(&unindexed);
                for k in &keys {
                    if let Some(found) = sel_labels.label(k).and_then(|v| by_label.get(&(*k, v))) {
                        candidates.extend_from_slice(found);
                    }
                }
                candidates.sort_unstable();
                candidates
                    .retain(|&i| selector_matches(&prepared[i].spec.node_selector, &sel_labels));
                fresh.push((pos, candidates.clone()));
                &candidates[..]
            }
        };
        for &i in selecting {
            a.matched[i].push(n.name.as_str());
            a.matched_at[i].push(pos);
            a.winner[pos].get_or_insert(i);
        }
    }
    (a, fresh)
}

/// The cluster-wide MIG strategy: that of the highest-precedence valid MIG policy governing a
/// node, else of the highest-precedence valid MIG policy that would not switch a governing MPS
/// policy's nodes off MPS (a `mixed` policy selecting no node, a dynamic one say, must not).
/// Policies that disagree with it (or MPS while it is `mixed`) are marked: `blocked` if they
/// govern nodes, `latent` otherwise; so is a `mixed` policy left out for MPS.
/// Without any node (e.g. `render` without `--nodes`) every policy counts as governing, so
/// conflicts are still reported.
pub fn cluster_mig_strategy(
    prepared: &mut [Prepared],
    governing: &BTreeSet<usize>,
) -> Option<MigStrategy> {
    let all: BTreeSet<usize>;
    let governing = if governing.is_empty() {
        all = (0..prepared.len()).collect();
        &all
    } else {
        governing
    };
    let valid_mig = |p: &Prepared| p.errors.is_empty() && p.spec.mig.is_some();
    let mixed =
        |p: &Prepared| p.spec.mig.as_ref().map(|m| m.mig_strategy) == Some(MigStrategy::Mixed);
    let mps = governing
        .iter()
        .map(|&i| &prepared[i])
        .find(|p| p.errors.is_empty() && p.spec.strategy == Strategy::Mps)
        .map(|p| p.name.clone());
    let owner = (0..prepared.len())
        .find(|i| valid_mig(&prepared[*i]) && governing.contains(i))
        .or_else(|| {
            (0..prepared.len())
                .find(|i| valid_mig(&prepared[*i]) && !(mps.is_some() && mixed(&prepared[*i])))
        });
    let Some(owner) = owner else {
        for p in prepared.iter_mut().filter(|p| valid_mig(p) && mixed(p)) {
            p.latent = mps.as_ref().map(|m| {
                format!("its migStrategy mixed becomes the cluster-wide MIG strategy, and the nodes of MPS policy {m} are switched off MPS (held back while this policy governs no node)")
            });
        }
        return None;
    };
    let cm = prepared[owner].spec.mig.as_ref()?.mig_strategy;
    let owner = prepared[owner].name.clone();
    for (i, p) in prepared.iter_mut().enumerate() {
        if !p.errors.is_empty() {
            continue;
        }
        let mut conflict = None;
        if let Some(m) = &p.spec.mig
            && m.mig_strategy != cm
        {
            conflict = Some(format!(
                "migStrategy {} conflicts with {} of policy {owner}: the GPU Operator's mig.strategy is cluster-wide",
                m.mig_strategy.as_str(),
                cm.as_str()
            ));
        }
        if p.spec.strategy == Strategy::Mps && cm == MigStrategy::Mixed {
            conflict = Some(format!(
                "MPS does not work with the cluster-wide MIG strategy mixed set by policy {owner}: its nodes are switched off MPS"
            ));
            // Held as they are, its nodes' device plugins would refuse MPS once the
            // ClusterPolicy says mixed: they go back to exclusive first (see `plan`).
            p.release_when_blocked = true;
        }
        if governing.contains(&i) {
            p.blocked = conflict;
        } else {
            p.latent = conflict;
        }
    }
    Some(cm)
}
