//! The pool: simulated A100 80GB nodes under one MIG policy, configured by the operator's own
//! planner and NVIDIA's simulated answers (`converge`).

use gpu_sharing_operator::api::crd::GpuSharingPolicy;
use gpu_sharing_operator::converge;
use gpu_sharing_operator::plan::{self, NodeFacts, PlanInput};

use super::trace::{PROFILES, PerProfile};

/// The catalogue: every single-profile layout of an A100 80GB, and NVIDIA's mixed one.
pub(crate) const LAYOUTS: [&str; 6] = [
    "all-1g.10gb",
    "all-2g.20gb",
    "all-3g.40gb",
    "all-4g.40gb",
    "all-7g.80gb",
    "all-balanced",
];

/// The layout dynamic starts from.
pub(crate) const DYNAMIC_START: &str = "all-balanced";

/// The replays' clock at the trace's start (unix seconds).
pub(crate) const START: i64 = 1_800_000_000;

/// GPUs of a node (the fixture's `nvidia.com/gpu.count`).
pub(crate) fn gpus_per_node() -> i64 {
    a100(0)
        .labels
        .get("nvidia.com/gpu.count")
        .and_then(|v| v.parse().ok())
        .expect("the A100 fixture counts its GPUs")
}

/// How a dynamic policy may take busy nodes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Busy {
    /// Demand waits for nodes to go idle by themselves (the default).
    Wait,
    /// `reserveBusyNodes`: demand cordons a busy node and reshapes it once its pods finish.
    Reserve,
    /// `preferBusyNodes`: idle nodes carry the spare taint (`PreferNoSchedule`), so the
    /// scheduler fills busy nodes first; demand waits for idle nodes.
    Prefer,
    /// `preferBusyNodes` and `reserveBusyNodes`.
    PreferReserve,
}

impl Busy {
    /// The fields of `spec.mig.dynamic` it sets, as flow-style YAML after a comma.
    fn fields(self) -> &'static str {
        match self {
            Busy::Wait => "",
            Busy::Reserve => ", reserveBusyNodes: {}",
            Busy::Prefer => ", preferBusyNodes: true",
            Busy::PreferReserve => ", preferBusyNodes: true, reserveBusyNodes: {}",
        }
    }

    /// How the tables name it.
    pub fn name(self) -> &'static str {
        match self {
            Busy::Wait => "dynamic",
            Busy::Reserve => "dynamic, reserveBusyNodes",
            Busy::Prefer => "dynamic, preferBusyNodes",
            Busy::PreferReserve => "dynamic, preferBusyNodes + reserveBusyNodes",
        }
    }

    /// Every way, in the tables' order.
    pub const ALL: [Busy; 4] = [Busy::Wait, Busy::Reserve, Busy::Prefer, Busy::PreferReserve];
}

/// The node label the pool's dynamic policy selects on, and its value.
pub(crate) const POOL_LABEL: (&str, &str) = ("bench.gpusharing.io/pool", "a100");

/// The node label a static per-layout policy selects on (its value: the layout).
pub(crate) const LAYOUT_LABEL: &str = "bench.gpusharing.io/layout";

/// The timers of `spec.mig.dynamic`, in seconds.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Timers {
    pub quiet: i64,
    pub max_delay: i64,
    pub idle: i64,
    pub min_lifetime: i64,
}

/// The policy with `layout`; with `dynamic`, the rest of the catalogue too, at the default
/// timings of `spec.mig.dynamic`.
pub(crate) fn policy(layout: &str, dynamic: Option<Busy>) -> GpuSharingPolicy {
    build("a100", POOL_LABEL, layout, dynamic.map(|b| (b, None)))
}

/// The dynamic policy starting from `layout` with the rest of the catalogue, at `timers`.
pub(crate) fn timed_policy(layout: &str, busy: Busy, timers: Timers) -> GpuSharingPolicy {
    build("a100", POOL_LABEL, layout, Some((busy, Some(timers))))
}

/// A static policy of `layout` alone, named after it (a policy name has no dots), selecting
/// the nodes labelled [`LAYOUT_LABEL`]`=<layout>`: one per layout of a per-node assignment.
pub(crate) fn static_policy(layout: &str) -> GpuSharingPolicy {
    let name = format!("static-{}", layout.replace('.', "-"));
    build(&name, (LAYOUT_LABEL, layout), layout, None)
}

/// The policy `name` of the nodes labelled `selector`, with `layout`; with `dynamic`, the rest
/// of the catalogue too, at the timers given (else the defaults of `spec.mig.dynamic`).
fn build(
    name: &str,
    selector: (&str, &str),
    layout: &str,
    dynamic: Option<(Busy, Option<Timers>)>,
) -> GpuSharingPolicy {
    let dynamic = match dynamic {
        Some((busy, timers)) => {
            let others: Vec<&str> = LAYOUTS.iter().copied().filter(|l| *l != layout).collect();
            let reserve = busy.fields();
            let timers = timers.map_or(String::new(), |t| {
                format!(
                    ", quietSeconds: {}, maxDelaySeconds: {}, idleSeconds: {}, minLayoutLifetimeSeconds: {}",
                    t.quiet, t.max_delay, t.idle, t.min_lifetime
                )
            });
            format!(
                "    dynamic: {{layouts: [{}]{reserve}{timers}}}\n",
                others.join(", ")
            )
        }
        None => String::new(),
    };
    let (key, value) = selector;
    let yaml = format!(
        "apiVersion: gpusharing.io/v1alpha1\nkind: GpuSharingPolicy\nmetadata: {{name: {name}, generation: 1}}\nspec:\n  nodeSelector: {{matchLabels: {{{key}: {value}}}}}\n  strategy: mig\n  mig:\n    migStrategy: mixed\n    layout: {layout}\n{dynamic}  rollout: {{maxUnavailable: 25%}}\n"
    );
    gpu_sharing_operator::api::yaml::from_str(&yaml).expect("the benchmark's policy parses")
}

/// Node `i` of the pool: the shared A100 80GB fixture, with its compute capability.
fn a100(i: usize) -> NodeFacts {
    let mut n = testkit::fixtures::a100_node(&format!("a100-{i:04}"));
    n.labels.insert(POOL_LABEL.0, POOL_LABEL.1);
    n.labels.insert("nvidia.com/gpu.compute.major", "8");
    n
}

/// `n` nodes configured with the policy's own layout (plan, apply, NVIDIA answers, until
/// nothing changes).
pub(crate) fn configured(p: &GpuSharingPolicy, n: usize) -> PlanInput {
    let mut input = PlanInput::new(vec![p.clone()], (0..n).map(a100).collect());
    input.cluster.base_mig_configs = Some(gpu_sharing_operator::nvidia::default_mig_configs());
    input.cluster.now = START;
    for _ in 0..20 {
        let plan = plan::plan(&input);
        let mut changed = converge::apply(&mut input, &plan);
        let answer = input.cluster.now + 1;
        changed.extend(converge::nvidia_succeeds(&mut input, answer));
        input.cluster.now += 2;
        if changed.is_empty() {
            break;
        }
    }
    input
}

/// The instances per profile each layout of the catalogue gives a node: what the device
/// plugin advertises once the operator configured it from NVIDIA's default mig-parted configs.
pub(crate) fn capacities() -> [PerProfile; LAYOUTS.len()] {
    LAYOUTS.map(|l| {
        let input = configured(&policy(l, None), 1);
        let caps = PROFILES
            .each_ref()
            .map(|p| input.nodes[0].allocatable(p.resource));
        assert!(
            caps.iter().any(|c| *c > 0),
            "{l} advertises no MIG instance"
        );
        caps
    })
}
