//! Static MIG layouts: a replay with no operator at all (nothing ever reshapes, so the planner
//! has nothing to decide), cheap enough to try every per-node assignment of the catalogue.

use std::time::{Duration, Instant};

use super::Outcome;
use super::cluster::{Cluster, Node, Scheduler};
use super::pool::LAYOUTS;
use super::trace::{Arrival, PROFILES, PerProfile};

/// How many nodes get each layout of the catalogue; node names follow the catalogue's order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Split([usize; LAYOUTS.len()]);

impl Split {
    /// Every node with `LAYOUTS[layout]`.
    pub fn uniform(layout: usize, nodes: usize) -> Self {
        let mut s = [0; LAYOUTS.len()];
        s[layout] = nodes;
        Split(s)
    }

    /// Every multiset of the catalogue's layouts on `nodes` nodes: C(nodes + 5, 5) of them.
    pub fn all(nodes: usize) -> Vec<Split> {
        fn fill(i: usize, left: usize, cur: &mut [usize; LAYOUTS.len()], out: &mut Vec<Split>) {
            if i == LAYOUTS.len() - 1 {
                cur[i] = left;
                out.push(Split(*cur));
                return;
            }
            for c in (0..=left).rev() {
                cur[i] = c;
                fill(i + 1, left - c, cur, out);
            }
        }
        let mut out = Vec::new();
        fill(0, nodes, &mut [0; LAYOUTS.len()], &mut out);
        out
    }

    /// The layout of each node, by index into [`LAYOUTS`].
    pub fn layouts(&self) -> impl Iterator<Item = usize> + '_ {
        self.0
            .iter()
            .enumerate()
            .flat_map(|(l, &n)| std::iter::repeat_n(l, n))
    }

    /// Compute slices per profile the nodes offer, given each layout's instances.
    fn slices(&self, caps: &[PerProfile; LAYOUTS.len()]) -> PerProfile {
        let mut out = [0; PROFILES.len()];
        for l in self.layouts() {
            for (p, o) in out.iter_mut().enumerate() {
                *o += caps[l][p] * PROFILES[p].slices;
            }
        }
        out
    }

    /// "3 x all-balanced, 5 x all-7g.80gb".
    pub fn describe(&self) -> String {
        let parts: Vec<String> = self
            .0
            .iter()
            .zip(LAYOUTS)
            .filter(|(n, _)| **n > 0)
            .map(|(n, l)| format!("{n} x {l}"))
            .collect();
        parts.join(", ")
    }
}

/// Replays the trace on nodes that keep the layouts of `split` throughout: from event to event
/// (an arrival, an end), binding what fits. It ends once every pod has arrived and none runs:
/// the pods still pending then ask for a profile no node has, and never will.
pub(crate) fn replay(
    arrivals: &[Arrival],
    split: Split,
    caps: &[PerProfile; LAYOUTS.len()],
    scheduler: Scheduler,
    seed: u64,
) -> Outcome {
    let nodes = split.layouts().map(|l| Node::new(caps[l])).collect();
    let mut c = Cluster::new(arrivals, nodes, scheduler, seed);
    let mut now = 0;
    loop {
        c.finish(now);
        c.admit(now);
        c.bind(now);
        match c.next_event() {
            Some(next) => now = next,
            None => return c.into_outcome(),
        }
    }
}

/// The best static assignment in hindsight, with its outcome, how many were replayed (and how
/// many ranked as well) and how long that took.
pub(crate) struct Oracle {
    pub split: Split,
    pub outcome: Outcome,
    pub tried: usize,
    pub as_good: usize,
    /// The lowest mean wait of any assignment that serves as many pods: the oracle ranks by
    /// p95 first, so another assignment may have a better mean.
    pub best_mean: f64,
    pub took: Duration,
}

/// Replays every per-node assignment of the catalogue and keeps the best by
/// [`Outcome::rank`]; a tie goes to the one tried first.
pub(crate) fn oracle(
    arrivals: &[Arrival],
    caps: &[PerProfile; LAYOUTS.len()],
    nodes: usize,
    scheduler: Scheduler,
    seed: u64,
) -> Oracle {
    let started = Instant::now();
    let splits = Split::all(nodes);
    let mut best: Option<(Split, Outcome, (usize, i64, f64))> = None;
    let mut as_good = 0;
    let mut means = Vec::with_capacity(splits.len());
    for split in &splits {
        let outcome = replay(arrivals, *split, caps, scheduler, seed);
        let rank = outcome.rank();
        means.push((rank.0, rank.2));
        match &best {
            Some((_, _, top)) if rank == *top => as_good += 1,
            Some((_, _, top)) if rank > *top => {}
            _ => {
                best = Some((*split, outcome, rank));
                as_good = 1;
            }
        }
    }
    let (split, outcome, (never_served, _, _)) = best.expect("at least one assignment");
    let best_mean = means
        .iter()
        .filter(|(never, _)| *never == never_served)
        .map(|(_, mean)| *mean)
        .fold(f64::INFINITY, f64::min);
    Oracle {
        split,
        outcome,
        tried: splits.len(),
        as_good,
        best_mean,
        took: started.elapsed(),
    }
}

/// The fraction of the trace's first arrivals an admin sizes the pool from.
pub(crate) const ADMIN_SAMPLE: f64 = 0.2;

/// The assignment an admin would choose from the first [`ADMIN_SAMPLE`] of the arrivals, without
/// replaying anything: each profile gets compute slices as close as possible to its share of
/// the slice-seconds observed times `pool`, the pool's slices (least total absolute difference;
/// a tie goes to the first in [`Split::all`]'s order).
pub(crate) fn admin(
    arrivals: &[Arrival],
    caps: &[PerProfile; LAYOUTS.len()],
    nodes: usize,
    pool: i64,
) -> Split {
    let sample = &arrivals[..(arrivals.len() as f64 * ADMIN_SAMPLE) as usize];
    let mut demand = [0f64; PROFILES.len()];
    for a in sample {
        demand[a.profile] += a.slice_seconds() as f64;
    }
    let total: f64 = demand.iter().sum::<f64>().max(1.0);
    let distance = |s: &Split| -> f64 {
        s.slices(caps)
            .iter()
            .zip(&demand)
            .map(|(have, want)| (*have as f64 - want / total * pool as f64).abs())
            .sum()
    };
    Split::all(nodes)
        .into_iter()
        .min_by(|a, b| distance(a).total_cmp(&distance(b)))
        .expect("at least one assignment")
}
