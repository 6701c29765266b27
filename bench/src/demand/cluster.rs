//! The pool as a scheduler sees it, and the scheduler models: both the static replays and the
//! dynamic one bind pods through this, so they differ only in what the nodes offer.

use std::cmp::Reverse;
use std::collections::{BTreeSet, BinaryHeap, VecDeque};

use super::Outcome;
use super::trace::{Arrival, PROFILES, PerProfile, Rng};

/// How pods are placed among the nodes that fit them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum Scheduler {
    /// The first node by name: packs pods and leaves the last nodes idle.
    FirstFit,
    /// kube-scheduler's default profile, scored as v1.35 scores it (see [`kube_default_score`]):
    /// the trace's pods request no CPU or memory, so only `NodeResourcesFit`'s
    /// `LeastAllocated` score tells nodes apart, counting each pod as 100m and 200Mi, in
    /// whole points. On the 96-CPU nodes of the test fixtures that moves one point per
    /// about ten pods: nodes a few pods apart tie, and ties go at random.
    KubeDefault,
    /// A `MostAllocated` profile that scores the `nvidia.com/mig-*` resources: the node with
    /// the most compute slices allocated.
    Pack,
}

impl Scheduler {
    /// The flag's spelling.
    pub fn name(self) -> &'static str {
        match self {
            Scheduler::FirstFit => "first-fit",
            Scheduler::KubeDefault => "kube-default",
            Scheduler::Pack => "pack",
        }
    }

    /// The node a pod of `profile` is bound to: of the nodes with a free instance, the one
    /// scoring highest, ties at random as kube-scheduler's `selectHost` breaks them.
    fn pick(self, nodes: &[Node], profile: usize, rng: &mut Rng) -> Option<usize> {
        let mut feasible = nodes
            .iter()
            .enumerate()
            .filter(|(_, n)| n.free(profile) > 0);
        match self {
            // The first by name, of the untainted nodes if any fits.
            Scheduler::FirstFit => {
                let first = feasible.clone().find(|(_, n)| !n.spare);
                first.or_else(|| feasible.next()).map(|(i, _)| i)
            }
            Scheduler::KubeDefault => highest(
                feasible,
                |n| kube_default_score(n.pods.len()) + taint_toleration_score(n),
                rng,
            ),
            Scheduler::Pack => highest(
                feasible,
                |n| n.slices_used() + taint_toleration_score(n),
                rng,
            ),
        }
    }
}

/// Allocatable CPU (millicores) and memory (MiB) of the fixture A100 nodes the live runs use
/// (`tests/cluster/fixtures/nodes.yaml`).
const NODE_MILLI_CPU: i64 = 96_000;
const NODE_MEMORY_MIB: i64 = 1_179_648;
/// What kube-scheduler counts for a container that requests no CPU or memory
/// (`DefaultMilliCPURequest`, `DefaultMemoryRequest`).
const DEFAULT_MILLI_CPU: i64 = 100;
const DEFAULT_MEMORY_MIB: i64 = 200;

/// kube-scheduler's default-profile score of a node running `pods` pods without requests, for
/// one more such pod: `NodeResourcesFit` with `LeastAllocated` over cpu and memory (weight 1
/// each), on the non-zero requests of the node's pods and the pod's own, in integer points as
/// `leastRequestedScore` computes them. `NodeResourcesBalancedAllocation` gives a best-effort
/// pod 0 everywhere; the other scoring plugins (taints, affinity, topology spread, image
/// locality) score these nodes and pods alike.
pub(crate) fn kube_default_score(pods: usize) -> i64 {
    let n = pods as i64 + 1;
    let least = |requested: i64, allocatable: i64| (allocatable - requested) * 100 / allocatable;
    let cpu = least(n * DEFAULT_MILLI_CPU, NODE_MILLI_CPU);
    let memory = least(n * DEFAULT_MEMORY_MIB, NODE_MEMORY_MIB);
    (cpu + memory) / 2
}

/// `TaintToleration`'s weighted score (weight 3 in the default profile, and in a profile that
/// only changes `NodeResourcesFit`'s strategy): it counts a node's `PreferNoSchedule` taints the
/// pod does not tolerate and normalizes in reverse over the nodes scored, so with the spare
/// taint on some of them an untainted node scores 100 and a tainted one 0. Added as 300 to the
/// untainted: the same order, and more than `NodeResourcesFit` can make up (at most 100).
fn taint_toleration_score(n: &Node) -> i64 {
    if n.spare { 0 } else { 3 * 100 }
}

/// The index of the highest-scoring node, a tie going to each of the tied nodes with equal
/// chance (reservoir sampling, as `selectHost` does).
fn highest<'a>(
    nodes: impl Iterator<Item = (usize, &'a Node)>,
    score: impl Fn(&Node) -> i64,
    rng: &mut Rng,
) -> Option<usize> {
    let mut best: Option<(i64, usize)> = None;
    let mut ties = 0;
    for (i, n) in nodes {
        let s = score(n);
        match best {
            Some((top, _)) if s < top => {}
            Some((top, _)) if s == top => {
                ties += 1;
                if rng.next().is_multiple_of(ties) {
                    best = Some((s, i));
                }
            }
            _ => {
                best = Some((s, i));
                ties = 1;
            }
        }
    }
    best.map(|(_, i)| i)
}

/// One node as the scheduler sees it.
#[derive(Clone, Debug, Default)]
pub(crate) struct Node {
    /// The MIG instances the device plugin advertises, per profile.
    pub allocatable: PerProfile,
    /// Whether the trace's pods may be bound here at all: not while the MIG manager works (it
    /// stops the device plugin: the whole node offers nothing), nor past a taint they do not
    /// tolerate.
    pub open: bool,
    /// It carries the spare taint (`PreferNoSchedule`, `preferBusyNodes`): scored lower, never
    /// refused.
    pub spare: bool,
    /// Instances bound, per profile.
    used: PerProfile,
    /// The pods bound here, by index in the trace (which sorts as their names).
    pub pods: BTreeSet<usize>,
    /// The pods bound here changed since the flag was last taken.
    pub changed: bool,
    /// When each pod bound here was bound (trace seconds).
    pub started: std::collections::BTreeMap<usize, i64>,
}

impl Node {
    pub fn new(allocatable: PerProfile) -> Self {
        Node {
            allocatable,
            open: true,
            ..Default::default()
        }
    }

    fn free(&self, profile: usize) -> i64 {
        if self.open {
            self.allocatable[profile] - self.used[profile]
        } else {
            0
        }
    }

    fn slices_used(&self) -> i64 {
        self.used
            .iter()
            .zip(&PROFILES)
            .map(|(n, p)| n * p.slices)
            .sum()
    }

    /// Instances bound, per profile.
    pub fn used(&self) -> &PerProfile {
        &self.used
    }
}

/// The pool and its pods: what is pending, what runs where and until when, and what the
/// replay measured so far.
pub(crate) struct Cluster<'a> {
    arrivals: &'a [Arrival],
    pub nodes: Vec<Node>,
    scheduler: Scheduler,
    rng: Rng,
    /// The next pod of the trace to arrive.
    next: usize,
    /// Pending pods per profile, oldest first.
    queue: [VecDeque<usize>; PROFILES.len()],
    /// Running pods: (end, node, pod), the earliest end first.
    running: BinaryHeap<Reverse<(i64, usize, usize)>>,
    pub out: Outcome,
}

impl<'a> Cluster<'a> {
    /// `seed` seeds the scheduler's tie-breaks.
    pub fn new(arrivals: &'a [Arrival], nodes: Vec<Node>, scheduler: Scheduler, seed: u64) -> Self {
        Cluster {
            arrivals,
            nodes,
            scheduler,
            rng: Rng::new(seed ^ 0x9E37_79B9_7F4A_7C15),
            next: 0,
            queue: Default::default(),
            running: BinaryHeap::new(),
            out: Outcome::default(),
        }
    }

    /// Pods whose run is over at `now` free their instances.
    pub fn finish(&mut self, now: i64) {
        while let Some(&Reverse((end, node, pod))) = self.running.peek()
            && end <= now
        {
            self.running.pop();
            let n = &mut self.nodes[node];
            n.used[self.arrivals[pod].profile] -= 1;
            n.pods.remove(&pod);
            n.started.remove(&pod);
            n.changed = true;
        }
    }

    /// The pods arriving by `now` join the queue; returns them.
    pub fn admit(&mut self, now: i64) -> std::ops::Range<usize> {
        let first = self.next;
        while self.next < self.arrivals.len() && self.arrivals[self.next].at <= now {
            self.queue[self.arrivals[self.next].profile].push_back(self.next);
            self.next += 1;
        }
        first..self.next
    }

    /// Binds pending pods, oldest first, each to the node the scheduler picks; a pod no node
    /// fits stays pending, and so do the younger pods of its profile (nothing frees up during
    /// the pass). Returns the pods bound.
    pub fn bind(&mut self, now: i64) -> Vec<usize> {
        let mut bound = Vec::new();
        let mut full = [false; PROFILES.len()];
        loop {
            let oldest = (0..PROFILES.len())
                .filter(|&p| !full[p])
                .filter_map(|p| Some((*self.queue[p].front()?, p)))
                .min();
            let Some((pod, profile)) = oldest else {
                return bound;
            };
            let Some(node) = self.scheduler.pick(&self.nodes, profile, &mut self.rng) else {
                full[profile] = true;
                continue;
            };
            self.queue[profile].pop_front();
            let a = &self.arrivals[pod];
            let n = &mut self.nodes[node];
            n.used[profile] += 1;
            n.pods.insert(pod);
            n.started.insert(pod, now);
            n.changed = true;
            self.running.push(Reverse((now + a.run, node, pod)));
            self.out.waits.push(now - a.at);
            self.out.served.push(pod);
            self.out.slice_hours += a.slice_seconds() as f64 / 3600.0;
            bound.push(pod);
        }
    }

    /// When something next happens on its own: a pod arrives or one ends.
    pub fn next_event(&self) -> Option<i64> {
        let arrival = self.arrivals.get(self.next).map(|a| a.at);
        let end = self.running.peek().map(|Reverse((end, _, _))| *end);
        arrival.into_iter().chain(end).min()
    }

    /// Every pod has arrived and none runs.
    pub fn at_rest(&self) -> bool {
        self.next == self.arrivals.len() && self.running.is_empty()
    }

    pub fn pending(&self) -> usize {
        self.queue.iter().map(VecDeque::len).sum()
    }

    /// The measurements, with the pods still pending counted as never served.
    pub fn into_outcome(self) -> Outcome {
        let mut out = self.out;
        out.never_served = self.queue.iter().map(VecDeque::len).sum();
        out
    }
}

#[cfg(test)]
mod tests {
    use super::kube_default_score;

    #[test]
    fn kube_default_scores_tie_for_nodes_a_few_pods_apart() {
        // 1 to 9 pods with the new one: cpu 99, memory 99.
        assert_eq!(kube_default_score(0), 99);
        assert_eq!(kube_default_score(8), 99);
        // The tenth: cpu (96,000 - 1,000) * 100 / 96,000 = 98.
        assert_eq!(kube_default_score(9), 98);
        assert_eq!(kube_default_score(27), 98);
        assert!(kube_default_score(56) < kube_default_score(27));
    }
}
