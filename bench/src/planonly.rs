//! The planner alone, in memory (`--plan-only`): the input a pass plans from at N nodes x P
//! policies (the benchmark's nodes and policies, labels as the node cache keeps them), converged;
//! then the CPU time of a pass at rest and of the pass after one policy edit, with the planner
//! as the controller calls it (a [`plan::Planner`] kept between passes). No API server: this
//! separates the planner's share of a pass from the rest (caches, diffs, writes).

use std::time::Instant;

use gpu_sharing_operator::converge;
use gpu_sharing_operator::plan::{LabelFilter, Planner, selector_keys};

use super::*;

/// The benchmark's policy edit (see `edit_patch`) as the API server would return it: a new
/// generation.
fn edited(p: &GpuSharingPolicy) -> GpuSharingPolicy {
    let mut e = policy_object(0, 4);
    e.spec
        .time_slicing
        .as_mut()
        .expect("group 0 time-slices")
        .fail_requests_greater_than_one = true;
    e.metadata = p.metadata.clone();
    e.metadata.generation = Some(p.metadata.generation.unwrap_or(1) + 1);
    e
}

/// The converged input at `n` x `p`, as the controller's caches would hold it.
fn converged_input(n: usize, p: usize) -> PlanInput {
    let policies: Vec<GpuSharingPolicy> = (0..p)
        .map(|g| {
            let mut pol = policy_object(g, 4);
            pol.metadata.generation = Some(1);
            pol.metadata.creation_timestamp = None;
            pol
        })
        .collect();
    let filter = LabelFilter::new(selector_keys(&policies));
    let nodes = (0..n)
        .map(|i| NodeFacts {
            name: node_name(i),
            labels: filter.apply(&node_labels(i, p).into_iter().collect()),
            allocatable: [("nvidia.com/gpu", "16")].into_iter().collect(),
            ..Default::default()
        })
        .collect();
    let mut input = PlanInput::new(policies, nodes);
    input.cluster.now = 1_800_000_000;
    for _ in 0..4 {
        let plan = plan::plan(&input);
        if converge::apply(&mut input, &plan).is_empty() {
            break;
        }
    }
    input
}

/// Milliseconds of `f`, the median of `runs`.
pub(crate) fn median_ms(runs: usize, mut f: impl FnMut()) -> f64 {
    let mut t: Vec<f64> = (0..runs)
        .map(|_| {
            let s = Instant::now();
            f();
            s.elapsed().as_secs_f64() * 1000.0
        })
        .collect();
    t.sort_by(f64::total_cmp);
    t[t.len() / 2]
}

/// Runs the planner-only measurement for every configuration; returns a markdown table.
pub(crate) fn run(configs: &[(usize, usize)]) -> String {
    let mut md = String::from(
        "| N x P | full plan ms | pass at rest ms | pass after one edit ms | nodes re-planned after the edit |\n|---|---:|---:|---:|---:|\n",
    );
    for &(n, p) in configs {
        let input = converged_input(n, p);
        let full = median_ms(5, || drop(plan::plan(&input)));
        let mut planner = Planner::default();
        assert!(
            planner.plan(&input) == plan::plan(&input),
            "incremental = full"
        );
        let rest = median_ms(5, || drop(planner.plan(&input)));
        let mut edit = input.clone();
        edit.policies[0] = edited(&edit.policies[0]);
        let mut runs: Vec<(f64, usize)> = (0..5)
            .map(|_| {
                let mut p = planner.clone();
                let s = Instant::now();
                drop(p.plan(&edit));
                (s.elapsed().as_secs_f64() * 1000.0, p.last_replanned())
            })
            .collect();
        runs.sort_by(|a, b| a.0.total_cmp(&b.0));
        let (after, replanned) = runs[runs.len() / 2];
        md.push_str(&format!(
            "| {n} x {p} | {full:.1} | {rest:.1} | {after:.1} | {replanned} |\n"
        ));
        eprintln!(
            "scale-bench: plan-only {n}x{p}: full {full:.1} ms, rest {rest:.1} ms, edit {after:.1} ms"
        );
    }
    md
}
