//! Planner properties over random policy sets, node label sets and histories (no cluster).
//!
//! A small model of the cluster plays the other side (`planner_model`, NVIDIA's components
//! written from NVIDIA's behaviour, not from the operator's own `converge`): applying a
//! plan is a server-side apply of its labels, ConfigMaps and ClusterPolicy part; the MIG manager
//! reconfigures the GPUs on a layout change and reports `nvidia.com/mig.config.state`; the
//! device plugin and GPU Feature Discovery load the labelled config and relabel the node; on VM
//! hosts the vGPU Device Manager and the sandbox device plugin answer. After every step we check
//! the invariants:
//! - no node ever runs MPS or time-slicing of full GPUs while MIG is (or may be) enabled;
//! - a node only leaves MIG for sharing through `all-disabled` confirmed by the MIG manager;
//! - every label value the plan writes names a key the plan's ConfigMap holds;
//! - a node is never a VM host (`nvidia.com/gpu.workload.config=vm-*`) and a container-sharing
//!   node (a sharing config, or MIG possibly on) at once;
//! - planning is deterministic (same input, any order) and idempotent once converged;
//! - the controller's incremental planner, kept across the history, plans every pass exactly
//!   as planning from scratch does;
//! - on the GPUs themselves: no MPS or full-GPU time-slicing loaded while a GPU has MIG on, no
//!   VM host with MIG on, every config the plan labels is one NVIDIA's parser accepts, and no
//!   device plugin refuses (or crash-loops on) what it was given;
//! - once converged, nothing waits (no node `Queued` or `Pending`), no cordon of ours is left,
//!   and a node is `Rejected` only for what it is (the same nodes as before any write), not for
//!   what NVIDIA's components report about our own changes.
//!
//! Demand-driven MIG (`spec.mig.dynamic`, `docs/dynamic-mig.md`): policies may be dynamic (their
//! catalogue, delays, idle time, lifetime, namespace fence, busy nodes reserved or drained);
//! pending MIG pods arrive (profiles offered or not, namespaces selected or not, priorities,
//! node selectors) and leave, kube-scheduler binds them, GPU pods start and finish, time passes.
//! After every pass (`DemandCheck`):
//! - no node's MIG layout or workload changes while GPU pods run there;
//! - demand chooses a layout of the governing policy's catalogue, that the node's GPUs can take
//!   without a MIG mode change, never on a failed node, for pods of namespaces the policy
//!   selects that the layout serves (each pod acted for once), on a node idle `idleSeconds`
//!   unless busy nodes may be reserved or drained (under the priority ceiling), not before
//!   `minLayoutLifetimeSeconds` since the node's last record, within the rollout budget;
//! - only demand drains evict: on a node we cordoned, of a policy with `drainBusyNodes` and a
//!   namespace fence, with no pod above `maxPodPriority`, while a pending pod is left for it,
//!   at most `maxDrainsPerHour` per policy in any hour;
//! - a choice a pod made busy is given up (waiting policies); a reserved or drained node is
//!   cordoned, and given up at its deadline or once its pods are gone;
//! - `status.demand` counts as served only free instances, as reshaping no refused node; a
//!   refused policy's records stay.

mod planner_model;

use std::collections::{BTreeMap, BTreeSet};

use gpu_sharing_operator::api::crd::{
    DemandDrain, DemandReserve, DynamicMig, GpuSelection, GpuSharingPolicy, GpuSharingPolicySpec,
    Mig, MigDeviceGroup, MigStrategy, Mps, Strategy as Sharing, TimeSlicing, Vgpu,
};
use gpu_sharing_operator::api::names::{
    self, ANNOTATION_CORDONED, ANNOTATION_MIG_DEMAND, LABEL_DEVICE_PLUGIN_CONFIG, LABEL_MIG_CONFIG,
    LABEL_MIG_STATE,
};
use gpu_sharing_operator::api::state::NodeState;
use gpu_sharing_operator::nvidia::{DEFAULT_KEY, MIG_DISABLED_LAYOUT};
use gpu_sharing_operator::plan::admit;
use gpu_sharing_operator::plan::input::{GpuPod, PendingPod};
use gpu_sharing_operator::plan::{self, Labels, NodeFacts, Plan, PlanInput};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, Time};
use planner_model::{
    Cluster, Loaded, Nvidia, device_plugin_error, parse_device_plugin_config, server_side_apply,
};
use proptest::prelude::*;

const PROFILES: [&str; 4] = ["a", "b", "c", "d"];
/// A policy "profile" that selects both A100 nodes by their GPU product instead.
const A100S: usize = 4;
/// Profiles are labelled under both keys; policies of profiles c and d select on the second (a
/// label outside NVIDIA's and ours, which the node cache keeps only because it is selected).
const PROFILE_KEYS: [&str; 2] = ["gpusharing.io/profile", "team.example.com/profile"];

fn profile_key(p: &str) -> &'static str {
    PROFILE_KEYS[usize::from(p == "c" || p == "d")]
}

fn node(name: &str, product: &str, mig_capable: bool, profile: Option<&str>) -> NodeFacts {
    let mem = if product.contains("A100") {
        81920
    } else {
        143771
    };
    let mut labels = testkit::fixtures::node(
        name,
        testkit::fixtures::gpu_labels(product, 8, mem, mig_capable),
    )
    .labels;
    if let Some(p) = profile {
        for k in PROFILE_KEYS {
            labels.insert(k, p);
        }
    }
    // Labels the planner does not read (the node cache drops them).
    labels.insert("kubernetes.io/hostname", name);
    labels.insert("topology.kubernetes.io/zone", "us-east-1a");
    NodeFacts {
        name: name.into(),
        labels,
        ..Default::default()
    }
}

fn selector(profile: Option<&str>) -> LabelSelector {
    let mut sel = LabelSelector::default();
    if let Some(p) = profile {
        sel.match_labels = Some([(profile_key(p).to_string(), p.to_string())].into());
    }
    sel
}

fn spec_of(kind: u8, replicas: i32, mixed: bool) -> GpuSharingPolicySpec {
    let mut s = GpuSharingPolicySpec {
        node_selector: LabelSelector::default(),
        priority: 0,
        strategy: Sharing::Exclusive,
        time_slicing: None,
        mps: None,
        mig: None,
        backend: Default::default(),
        dra: None,
        rollout: None,
        paused: false,
        disruption: None,
        vgpu: None,
    };
    match kind % 7 {
        0 => {}
        1 => {
            s.strategy = Sharing::TimeSlicing;
            s.time_slicing = Some(TimeSlicing {
                replicas: Some(replicas),
                ..Default::default()
            });
        }
        2 => {
            s.strategy = Sharing::Mps;
            s.mps = Some(Mps {
                replicas,
                rename_by_default: false,
            });
        }
        3 => {
            s.strategy = Sharing::Mig;
            s.mig = Some(Mig {
                mig_strategy: if mixed {
                    MigStrategy::Mixed
                } else {
                    MigStrategy::Single
                },
                layout: Some("all-1g.10gb".into()),
                custom_layout: None,
                time_slicing: Some(TimeSlicing {
                    replicas: Some(replicas),
                    ..Default::default()
                }),
                proceed_with_busy_gpus: false,
                dynamic: None,
            });
        }
        5 => s.strategy = Sharing::Passthrough,
        6 => {
            // Fits the A100 80GB nodes; rejected on the H200 ones (another GPU family).
            s.strategy = Sharing::Vgpu;
            s.vgpu = Some(Vgpu {
                type_: Some("A100D-1-10C".into()),
                custom_layout: None,
            });
        }
        _ => {
            s.strategy = Sharing::Mig;
            s.mig = Some(Mig {
                mig_strategy: MigStrategy::Mixed,
                layout: None,
                custom_layout: Some(vec![
                    // The layout's content follows `replicas`, so histories edit custom layouts.
                    MigDeviceGroup {
                        devices: Some(GpuSelection::Indices(vec![0, 1, 2, 3])),
                        mig_enabled: true,
                        mig_devices: [
                            ("1g.10gb".to_string(), 1 + replicas % 3),
                            ("2g.20gb".to_string(), 2),
                        ]
                        .into(),
                    },
                    MigDeviceGroup {
                        devices: Some(GpuSelection::Indices(vec![4, 5, 6, 7])),
                        mig_enabled: false,
                        mig_devices: BTreeMap::new(),
                    },
                ]),
                time_slicing: None,
                proceed_with_busy_gpus: false,
                dynamic: None,
            });
        }
    }
    s
}

fn policy(
    name: &str,
    kind: u8,
    replicas: i32,
    mixed: bool,
    profile: Option<&str>,
    priority: i32,
    age: i64,
) -> GpuSharingPolicy {
    let mut spec = spec_of(kind, replicas, mixed);
    spec.node_selector = selector(profile);
    spec.priority = priority;
    let mut p = GpuSharingPolicy::new(name, spec);
    p.metadata.generation = Some(1);
    p.metadata.creation_timestamp = Some(Time(
        k8s_openapi::jiff::Timestamp::from_second(1_700_000_000 + age).unwrap(),
    ));
    p
}

#[derive(Debug, Clone)]
struct PolicyGen {
    kind: u8,
    replicas: i32,
    mixed: bool,
    profile: Option<usize>,
    priority: i32,
    age: i64,
    /// Demand-driven MIG (`spec.mig.dynamic`): the policy is then a `mixed` MIG policy.
    dynamic: Option<DynGen>,
}

/// Named layouts of [`base_layouts`] a dynamic catalogue may hold (MIG on every GPU): the A100
/// 80GB's, then the H200's (each fails on the other model).
const CATALOGUE: [&str; 7] = [
    "all-1g.10gb",
    "all-2g.20gb",
    "all-3g.40gb",
    "all-7g.80gb",
    "all-balanced-a100",
    "all-1g.18gb",
    "all-3g.71gb",
];
/// A dynamic policy's own layout: a named one, the custom layout of kind 4 (MIG off on GPUs
/// 4-7), or `all-disabled` (the CRD refuses it in the catalogue only).
const OWN_LAYOUTS: [&str; 5] = [
    "all-7g.80gb",
    "all-1g.10gb",
    "all-1g.18gb",
    "custom",
    MIG_DISABLED_LAYOUT,
];
/// MIG profiles pending pods ask for: offered by some catalogue layout (A100, H200), real but
/// offered by none, and bogus.
const POD_PROFILES: [&str; 8] = [
    "1g.10gb", "2g.20gb", "3g.40gb", "7g.80gb", "1g.18gb", "3g.71gb", "4g.40gb", "9g.999gb",
];
/// The namespaces pods come from; `new` is one the operator has not seen (labels unknown).
const NAMESPACES: [&str; 3] = ["ml", "web", "new"];
const POD_PRIORITIES: [i32; 3] = [0, 50, 1000];

/// How a dynamic policy may take busy nodes.
#[derive(Debug, Clone)]
enum BusyGen {
    /// Neither: demand waits for an idle node.
    Wait,
    /// `reserveBusyNodes` with this `maxWaitSeconds`.
    Reserve(i64),
    /// `drainBusyNodes` with this `maxPodPriority` and `maxDrainsPerHour`.
    Drain(i32, i32),
}

#[derive(Debug, Clone)]
struct DynGen {
    own: usize,
    layouts: Vec<usize>,
    quiet: i64,
    max_delay: i64,
    idle: i64,
    lifetime: i64,
    /// `namespaceSelector`: absent, `{}`, or `tenant: ml`.
    namespaces: Option<bool>,
    busy: BusyGen,
    time_slicing: bool,
    /// `preferBusyNodes`: the spare taint on idle nodes.
    prefer_busy: bool,
}

fn dyn_gen() -> impl Strategy<Value = DynGen> {
    let busy = prop_oneof![
        1 => Just(BusyGen::Wait),
        1 => prop::sample::select(vec![60i64, 300]).prop_map(BusyGen::Reserve),
        2 => (prop::sample::select(vec![0i32, 100]), 1i32..3)
            .prop_map(|(p, h)| BusyGen::Drain(p, h)),
    ];
    // Now and then a layout that is no layout of the mig-parted config: the policy is refused.
    let layouts = (
        prop::sample::subsequence((0..CATALOGUE.len()).collect::<Vec<_>>(), 1..5),
        proptest::bool::weighted(0.05),
    )
        .prop_map(|(mut l, bogus)| {
            if bogus {
                l.push(CATALOGUE.len());
            }
            l
        });
    (
        prop::sample::select(vec![0usize, 0, 0, 1, 2, 3, 4]),
        layouts,
        (
            prop::sample::select(vec![0i64, 2]),
            prop::sample::select(vec![0i64, 10]),
        ),
        prop::sample::select(vec![0i64, 5, 30, 120]),
        prop::sample::select(vec![0i64, 30, 60, 300, 600]),
        proptest::option::of(any::<bool>()),
        busy,
        proptest::bool::weighted(0.2),
        (proptest::bool::weighted(0.1), proptest::bool::weighted(0.3)),
    )
        .prop_map(
            |(
                own,
                layouts,
                (quiet, max_delay),
                idle,
                lifetime,
                namespaces,
                busy,
                ts,
                (legacy, prefer_busy),
            )| {
                let mut d = DynGen {
                    own,
                    layouts,
                    quiet,
                    max_delay,
                    idle,
                    lifetime,
                    namespaces,
                    busy,
                    time_slicing: ts,
                    prefer_busy,
                };
                // What admission requires: a namespace fence for drains, a lifetime of at
                // least 60 s for drains and reservations. A policy stored before these rules
                // (`legacy`) may lack them: the planner drains nothing without a fence, and
                // keeps layouts 60 s all the same.
                if matches!(d.busy, BusyGen::Drain(..)) && !legacy {
                    d.namespaces.get_or_insert(false);
                }
                if !matches!(d.busy, BusyGen::Wait) && !legacy {
                    d.lifetime = d.lifetime.max(60);
                }
                d
            },
        )
}

fn policy_gen() -> impl Strategy<Value = PolicyGen> {
    (
        0u8..7,
        2i32..8,
        any::<bool>(),
        proptest::option::of(0usize..4),
        0i32..3,
        0i64..5,
        proptest::option::weighted(0.2, dyn_gen()),
    )
        .prop_map(
            |(kind, replicas, mixed, profile, priority, age, dynamic)| PolicyGen {
                kind,
                replicas,
                mixed,
                profile,
                priority,
                age,
                dynamic,
            },
        )
}

/// A policy set for a history about demand: a dynamic policy of the highest priority first (it
/// governs the nodes it selects: all, one A100, or both by their product), sometimes a second
/// one for the second A100 (younger: the first keeps what both select), then up to two other
/// policies.
fn demand_policies_gen() -> impl Strategy<Value = Vec<PolicyGen>> {
    let profile = prop::sample::select(vec![None, Some(0usize), Some(1), Some(A100S)]);
    let first = (dyn_gen(), profile);
    let second = proptest::option::weighted(0.3, dyn_gen());
    let rest = proptest::collection::vec(policy_gen(), 0..3);
    (first, second, rest).prop_map(|((d, profile), second, rest)| {
        let dynamic = |profile, age, d| PolicyGen {
            kind: 3,
            replicas: 2,
            mixed: true,
            profile,
            priority: 3,
            age,
            dynamic: Some(d),
        };
        let first = dynamic(profile, 0, d);
        let second = second.map(|d| dynamic(Some(1), 1, d));
        [first].into_iter().chain(second).chain(rest).collect()
    })
}

/// The spec of a dynamic policy (`mixed` MIG, its own layout, the catalogue).
fn dynamic_spec(d: &DynGen, replicas: i32) -> GpuSharingPolicySpec {
    let custom = OWN_LAYOUTS[d.own] == "custom";
    let mut s = spec_of(if custom { 4 } else { 3 }, replicas, true);
    let mig = s.mig.as_mut().unwrap();
    if !custom {
        mig.layout = Some(OWN_LAYOUTS[d.own].into());
    }
    if !d.time_slicing {
        mig.time_slicing = None;
    }
    let selector = d.namespaces.map(|ml| LabelSelector {
        match_labels: ml.then(|| [("tenant".to_string(), "ml".to_string())].into()),
        ..Default::default()
    });
    mig.dynamic = Some(DynamicMig {
        layouts: (d.layouts.iter())
            .map(|&i| CATALOGUE.get(i).unwrap_or(&"all-9g.999gb").to_string())
            .collect(),
        namespace_selector: selector,
        quiet_seconds: d.quiet,
        max_delay_seconds: d.max_delay,
        idle_seconds: d.idle,
        min_layout_lifetime_seconds: d.lifetime,
        drain_busy_nodes: match d.busy {
            BusyGen::Drain(max_pod_priority, max_drains_per_hour) => Some(DemandDrain {
                max_pod_priority,
                max_drains_per_hour,
            }),
            _ => None,
        },
        reserve_busy_nodes: match d.busy {
            BusyGen::Reserve(max_wait_seconds) => Some(DemandReserve { max_wait_seconds }),
            _ => None,
        },
        prefer_busy_nodes: d.prefer_busy,
    });
    s
}

fn build(gens: &[PolicyGen]) -> Vec<GpuSharingPolicy> {
    gens.iter()
        .enumerate()
        .map(|(i, g)| {
            let mut p = policy(
                &format!("p{i}"),
                g.kind,
                g.replicas,
                g.mixed,
                g.profile.and_then(|p| PROFILES.get(p).copied()),
                g.priority,
                g.age,
            );
            if g.profile == Some(A100S) {
                let product = (
                    "nvidia.com/gpu.product".into(),
                    "NVIDIA-A100-SXM4-80GB".into(),
                );
                p.spec.node_selector.match_labels = Some([product].into());
            }
            if let Some(d) = &g.dynamic {
                p.spec = GpuSharingPolicySpec {
                    node_selector: p.spec.node_selector.clone(),
                    priority: p.spec.priority,
                    ..dynamic_spec(d, g.replicas)
                };
            }
            p
        })
        .collect()
}

/// A pending MIG pod: a profile of [`POD_PROFILES`] (one or two instances), a namespace of
/// [`NAMESPACES`], a priority of [`POD_PRIORITIES`], and a node selector: none, on the GPU
/// product (A100, H200), or on a label only pods select on (`kubernetes.io/hostname`).
#[derive(Debug, Clone)]
struct PodGen {
    profile: usize,
    count: i64,
    namespace: usize,
    priority: usize,
    selector: usize,
    /// Alike pods arriving together (a Job's).
    burst: usize,
}

fn pod_gen() -> impl Strategy<Value = PodGen> {
    (
        prop::sample::select(vec![0usize, 0, 0, 1, 2, 2, 2, 3, 4, 5, 6, 7]),
        1i64..3,
        prop::sample::select(vec![0usize, 0, 0, 1, 2]),
        0usize..3,
        prop::sample::select(vec![0usize, 0, 0, 0, 0, 1, 2, 3]),
        1usize..4,
    )
        .prop_map(
            |(profile, count, namespace, priority, selector, burst)| PodGen {
                profile,
                count,
                namespace,
                priority,
                selector,
                burst,
            },
        )
}

#[derive(Debug, Clone)]
enum Step {
    /// The controller applies the plan's labels.
    Apply,
    /// The MIG manager finishes what is pending.
    MigManager,
    /// GPU Feature Discovery relabels nodes whose device-plugin config changed (and the
    /// kubelet takes what the device plugin serves).
    Gfd,
    /// GPU Feature Discovery relabels, but the kubelet has not taken the device plugin's new
    /// devices yet (the node's labels and its status are two writes).
    GfdBeforeKubelet,
    /// An admin relabels a node's profile.
    Relabel(usize, Option<usize>),
    /// The policy set changes (each policy keeps its status, as an edit does).
    Policies(Vec<PolicyGen>),
    /// A pod asking for MIG instances is marked unschedulable by kube-scheduler.
    Arrive(PodGen),
    /// A pending pod is deleted, with those that arrived with it (its Job is).
    Leave(usize),
    /// kube-scheduler binds the pending pods that fit a node's free instances.
    Schedule,
    /// A GPU pod (one device of what the node advertises, of a priority of
    /// [`POD_PRIORITIES`]) starts on a node.
    Start(usize, usize),
    /// A running GPU pod finishes.
    Finish(usize),
    /// Time passes (seconds).
    Tick(i64),
    /// NVIDIA's vGPU Device Manager config (the GPU Operator's `default-vgpu-devices-config`)
    /// gives the VM policies' type `A100D-1-10C` this many devices per GPU (`None`: NVIDIA's
    /// default, 7), or the ClusterPolicy's vGPU manager is turned on or off: cluster-wide
    /// inputs that change under nodes at rest.
    NvidiaConfig(Option<i64>, bool),
}

fn step_gen() -> impl Strategy<Value = Step> {
    prop_oneof![
        4 => Just(Step::Apply),
        3 => Just(Step::MigManager),
        3 => Just(Step::Gfd),
        2 => Just(Step::GfdBeforeKubelet),
        1 => (0usize..4, proptest::option::of(0usize..4)).prop_map(|(n, p)| Step::Relabel(n, p)),
        1 => proptest::collection::vec(policy_gen(), 0..4).prop_map(Step::Policies),
        2 => pod_step_gen(),
        2 => tick_gen(),
        1 => (proptest::option::of(prop::sample::select(vec![4i64, 7, 8])), proptest::bool::weighted(0.8))
            .prop_map(|(n, on)| Step::NvidiaConfig(n, on)),
    ]
}

/// Steps of a history about demand: the pods come and go and time passes more often, the
/// policies change less (and a dynamic policy stays first).
fn demand_step_gen() -> impl Strategy<Value = Step> {
    prop_oneof![
        10 => Just(Step::Apply),
        3 => Just(Step::MigManager),
        3 => Just(Step::Gfd),
        1 => Just(Step::GfdBeforeKubelet),
        1 => (0usize..4, proptest::option::of(0usize..4)).prop_map(|(n, p)| Step::Relabel(n, p)),
        1 => demand_policies_gen().prop_map(Step::Policies),
        16 => pod_step_gen(),
        4 => tick_gen(),
    ]
}

/// A pod arrives, leaves, is bound, starts or finishes.
fn pod_step_gen() -> impl Strategy<Value = Step> {
    prop_oneof![
        6 => pod_gen().prop_map(Step::Arrive),
        2 => (0usize..8).prop_map(Step::Leave),
        2 => Just(Step::Schedule),
        4 => (0usize..4, prop::sample::select(vec![0usize, 0, 0, 1, 2]))
            .prop_map(|(n, p)| Step::Start(n, p)),
        3 => (0usize..8).prop_map(Step::Finish),
    ]
}

/// Time passes: past quiet periods, idle times, cooldowns, reservations' and drains' deadlines,
/// the drains' hour.
fn tick_gen() -> impl Strategy<Value = Step> {
    prop::sample::select(vec![1i64, 3, 10, 31, 61, 301, 601, 3601]).prop_map(Step::Tick)
}

/// A history: any policies and steps, or one about demand (a dynamic policy first, its nodes
/// brought to their layout, GPU pods on one or both A100s, then mostly pods and time).
fn history_gen() -> impl Strategy<Value = (Vec<PolicyGen>, Vec<Step>)> {
    let general = (
        proptest::collection::vec(policy_gen(), 0..5),
        proptest::collection::vec(step_gen(), 0..40),
    );
    let demand = (
        demand_policies_gen(),
        proptest::collection::vec(demand_step_gen(), 10..50),
        any::<bool>(),
    )
        .prop_map(|(policies, steps, both)| {
            let round = [
                Step::Apply,
                Step::MigManager,
                Step::Gfd,
                Step::Apply,
                Step::Gfd,
            ];
            let settle = round.iter().chain(&round).cloned();
            // A GPU pod runs on the first A100, or on both, from then on.
            let busy = [
                Step::Start(0, 0),
                Step::Start(usize::from(both), 0),
                Step::Apply,
            ];
            (policies, settle.chain(busy).chain(steps).collect())
        });
    prop_oneof![1 => general, 1 => demand]
}

fn initial_nodes() -> Vec<NodeFacts> {
    vec![
        node("a100-0", "NVIDIA-A100-SXM4-80GB", true, Some("a")),
        node("a100-1", "NVIDIA-A100-SXM4-80GB", true, Some("b")),
        node("h200-0", "NVIDIA-H200", false, Some("c")),
        node("h200-1", "NVIDIA-H200", true, None),
    ]
}

fn base_layouts() -> BTreeMap<String, serde_json::Value> {
    let mut m = BTreeMap::new();
    for (name, devices) in [
        ("all-1g.10gb", "{1g.10gb: 7}"),
        ("all-2g.20gb", "{2g.20gb: 3}"),
        ("all-3g.40gb", "{3g.40gb: 2}"),
        ("all-7g.80gb", "{7g.80gb: 1}"),
        ("all-balanced-a100", "{1g.10gb: 2, 2g.20gb: 1, 3g.40gb: 1}"),
        ("all-1g.18gb", "{1g.18gb: 7}"),
        ("all-3g.71gb", "{3g.71gb: 2}"),
    ] {
        m.insert(
            name.to_string(),
            gpu_sharing_operator::api::yaml::from_str(&format!(
                "[{{devices: all, mig-enabled: true, mig-devices: {devices}}}]"
            ))
            .unwrap(),
        );
    }
    m.insert(
        MIG_DISABLED_LAYOUT.to_string(),
        gpu_sharing_operator::api::yaml::from_str("[{devices: all, mig-enabled: false}]").unwrap(),
    );
    m
}

/// The config the device plugin loads: its config manager reads a node without the label as
/// the ClusterPolicy's default (`default`), so labelling such a node `default` reloads nothing.
fn loaded_config(labels: &Labels) -> &str {
    labels
        .get(LABEL_DEVICE_PLUGIN_CONFIG)
        .unwrap_or(DEFAULT_KEY)
}

/// The node is a VM host by its label (what the invariants are about).
fn vm_label(n: &NodeFacts) -> bool {
    n.labels
        .get(names::LABEL_WORKLOAD)
        .is_some_and(|w| w.starts_with("vm-"))
}

/// What NVIDIA's components read from the world (disjoint borrows of its fields).
macro_rules! cluster {
    ($w:expr) => {
        Cluster {
            cluster_policy: &$w.cluster_policy,
            configmaps: &$w.configmaps,
            default_mig: &$w.base,
        }
    };
}

struct World {
    nodes: Vec<NodeFacts>,
    policies: Vec<GpuSharingPolicy>,
    /// ConfigMap data as last applied (the controller writes it before labels).
    config: BTreeMap<String, String>,
    /// Our mig-parted ConfigMap's layouts as last applied, as the operator reads them back.
    mig_config: BTreeMap<String, serde_json::Value>,
    /// Our ConfigMaps as last applied, by name (what NVIDIA's components read).
    configmaps: BTreeMap<String, BTreeMap<String, String>>,
    /// Our part of the ClusterPolicy `spec` as last applied.
    cluster_policy: serde_json::Value,
    /// NVIDIA's components on the nodes.
    nv: Nvidia,
    /// The clock passed to the planner.
    now: i64,
    /// The GPU Operator's default mig-parted config (named layouts).
    base: BTreeMap<String, serde_json::Value>,
    /// Nodes whose labels the controller changed and that NVIDIA's components have not
    /// confirmed yet, with the policy they were changed for and whether GFD still has to
    /// relabel them (the rollout budget's "unavailable" nodes).
    unconfirmed: BTreeMap<String, (String, bool)>,
    /// The rollout mark (`gpusharing.io/rollout`) each unconfirmed node carried after its last
    /// write: the change it is in.
    unconfirmed_marks: BTreeMap<String, Option<String>>,
    /// The facts given to the last input, by node: a node keeps them while they do not change,
    /// as the controller's node cache does (so the incremental planner sees unchanged nodes as
    /// the same shared facts).
    shared: std::cell::RefCell<BTreeMap<String, std::sync::Arc<NodeFacts>>>,
    /// The pods (pending and running) and what the demand checks remember.
    pods: Pods,
    /// `A100D-1-10C` devices per GPU in NVIDIA's vGPU config (`None`: its default).
    vgpu_per_gpu: Option<i64>,
    /// The ClusterPolicy's vGPU manager is on.
    vgpu_manager: bool,
}

/// A pod bound to a node, using its GPUs.
#[derive(Debug, Clone)]
struct Running {
    id: String,
    priority: i32,
    /// Device-plugin resource -> devices.
    requests: BTreeMap<String, i64>,
}

/// The pods of the world, the controller's memory of busy nodes, and what the demand checks
/// remember of the operator's earlier writes (independently of what the planner reads).
#[derive(Debug, Default)]
struct Pods {
    /// Pods kube-scheduler marked unschedulable, asking for MIG instances.
    pending: Vec<PendingPod>,
    /// GPU pods by node.
    running: BTreeMap<String, Vec<Running>>,
    /// For pod names.
    serial: usize,
    /// The controller's memory (`note_busy`): nodes busy at the last pass, when each was last
    /// seen busy, and the first pass.
    busy_last_pass: BTreeSet<String>,
    last_busy: BTreeMap<String, i64>,
    started: Option<i64>,
    /// When each node's last GPU pod ended (the truth, not the controller's view).
    idle_since: BTreeMap<String, i64>,
    /// When demand last recorded a layout on each node.
    recorded_at: BTreeMap<String, i64>,
    /// By policy: when it chose nodes to drain for demand.
    drains: BTreeMap<String, Vec<i64>>,
}

impl World {
    fn new(nodes: Vec<NodeFacts>, policies: Vec<GpuSharingPolicy>) -> Self {
        World {
            nodes,
            policies,
            config: BTreeMap::new(),
            mig_config: BTreeMap::new(),
            configmaps: BTreeMap::new(),
            cluster_policy: serde_json::json!({}),
            nv: Nvidia::default(),
            now: 1_800_000_000,
            base: base_layouts(),
            unconfirmed: BTreeMap::new(),
            unconfirmed_marks: BTreeMap::new(),
            shared: Default::default(),
            pods: Pods::default(),
            vgpu_per_gpu: None,
            vgpu_manager: true,
        }
    }

    /// NVIDIA's components start on nodes they do not run on yet, from the nodes' state.
    fn boot(&mut self) {
        for n in &self.nodes {
            self.nv.boot(n, &cluster!(self));
        }
    }

    fn input(&self) -> PlanInput {
        let mut i = PlanInput::new(self.policies.clone(), vec![]);
        let mut shared = self.shared.borrow_mut();
        for n in &self.nodes {
            let kept = shared.get(&n.name).filter(|f| ***f == *n).cloned();
            let facts = kept.unwrap_or_else(|| std::sync::Arc::new(n.clone()));
            shared.insert(n.name.clone(), facts.clone());
            i.nodes.push(self.pods.view(facts, &n.name));
        }
        let admitted = self.admitted();
        i.cluster.demand = admitted.pods;
        i.cluster.demand_ignored = admitted.ignored;
        i.cluster.current_device_config = self.config.clone();
        i.cluster.base_mig_configs = Some(self.base.clone());
        i.cluster.current_mig_configs = self.mig_config.clone();
        i.cluster.now = self.now;
        i.cluster.sandbox.vgpu_manager_enabled = self.vgpu_manager;
        i.cluster.cluster_mig_strategy = self
            .cluster_policy
            .pointer("/mig/strategy")
            .and_then(|v| v.as_str())
            .map(str::to_string);
        if let Some(count) = self.vgpu_per_gpu {
            let mut base = (*i.cluster.base_vgpu_configs).clone();
            base.insert(
                "A100D-1-10C".into(),
                serde_json::json!([{"devices": "all", "vgpu-devices": {"A100D-1-10C": count}}]),
            );
            i.cluster.base_vgpu_configs = std::sync::Arc::new(base);
        }
        i
    }

    fn apply(&mut self, plan: &Plan) {
        self.boot();
        let cp_before =
            std::mem::replace(&mut self.cluster_policy, plan.cluster_policy_spec.clone());
        self.config = plan.device_config.clone();
        self.configmaps.insert(
            names::DEVICE_PLUGIN_CONFIGMAP.into(),
            plan.device_config.clone(),
        );
        for (name, text) in [
            (names::MIG_PARTED_CONFIGMAP, &plan.mig_config),
            (names::VGPU_DEVICES_CONFIGMAP, &plan.vgpu_config),
        ] {
            match text {
                Some(t) => self
                    .configmaps
                    .insert(name.into(), [("config.yaml".to_string(), t.clone())].into()),
                None => self.configmaps.remove(name),
            };
        }
        // What the operator's runtime reads back from its ConfigMap.
        self.mig_config = plan
            .mig_config
            .as_deref()
            .map(|t| gpu_sharing_operator::nvidia::parse_mig_configs(t).unwrap())
            .unwrap_or_default();
        let mut written = Vec::new();
        for n in &mut self.nodes {
            let before = n.labels.clone();
            let metadata = |n: &NodeFacts| {
                (
                    n.labels.clone(),
                    n.annotations.clone(),
                    n.owned,
                    n.owned_annotations,
                )
            };
            let was = metadata(n);
            server_side_apply(
                n,
                &plan.node_labels[&n.name],
                &plan.node_annotations[&n.name],
            );
            if metadata(n) != was {
                written.push(n.name.clone());
            }
            self.nv.observe(&before, &cp_before, n, &cluster!(self));
            assert!(
                n.labels.get(LABEL_MIG_CONFIG) == before.get(LABEL_MIG_CONFIG)
                    || n.labels.get(LABEL_MIG_STATE) == Some("pending"),
                "{}: MIG layout changed without marking the state pending: {:?}",
                n.name,
                n.labels
            );
        }
        written.sort();
        assert_eq!(
            plan.nodes_to_write, written,
            "the plan's node writes are not the nodes its labels and annotations change"
        );
    }

    /// Applies a plan, and checks, independently of the planner's own counting, that no policy
    /// ever has more unconfirmed nodes than its default budget (25% of its nodes, at least 1).
    /// A node is unconfirmed from a write that changes its labels until GFD has relabelled it
    /// (when the device-plugin config or the workload changed; on a VM host, the sandbox
    /// device plugin), the MIG manager is not pending, and the planner no longer holds it in
    /// flight for the policy it was written for.
    fn apply_within_budget(&mut self, plan: &Plan) {
        if std::env::var("HIST_DEBUG").is_ok() {
            for (policy, status) in &plan.statuses {
                for d in &status.node_details {
                    eprintln!("  plan {policy} {} {} {}", d.name, d.state, d.message);
                }
            }
        }
        let before: BTreeMap<String, Labels> = self
            .nodes
            .iter()
            .map(|n| (n.name.clone(), n.labels.clone()))
            .collect();
        let was_unconfirmed: BTreeSet<String> = self.unconfirmed.keys().cloned().collect();
        self.apply(plan);
        self.now += 1;
        for n in &self.nodes {
            let managed = |l: &Labels| {
                names::MANAGED_LABELS
                    .iter()
                    .filter(|k| **k != LABEL_MIG_STATE)
                    .map(|k| l.get(k).map(str::to_string))
                    .collect::<Vec<_>>()
            };
            let old = &before[&n.name];
            if managed(old) == managed(&n.labels) {
                continue;
            }
            // A node handed between VMs and containers changes its node daemons: it is
            // confirmed by what then runs there (GFD, or the sandbox device plugin), like a
            // device-plugin config change.
            let dp_changed = loaded_config(old) != loaded_config(&n.labels)
                || old.get(names::LABEL_WORKLOAD) != n.labels.get(names::LABEL_WORKLOAD);
            match n.labels.get(names::LABEL_POLICY) {
                Some(p) => {
                    let gfd = dp_changed || self.unconfirmed.get(&n.name).is_some_and(|(_, g)| *g);
                    self.unconfirmed
                        .insert(n.name.clone(), (p.to_string(), gfd));
                    let mark = n
                        .annotations
                        .get(names::ANNOTATION_ROLLOUT)
                        .map(str::to_string);
                    self.unconfirmed_marks.insert(n.name.clone(), mark);
                }
                // A node released while its MIG manager still works is not available yet:
                // a policy that takes it over does not make it unavailable.
                None if n.labels.get(LABEL_MIG_STATE) == Some("pending") => {
                    self.unconfirmed
                        .insert(n.name.clone(), (String::new(), false));
                }
                None => {
                    self.unconfirmed.remove(&n.name);
                }
            }
        }
        // A node between the steps of one change (its sharing config removed, its MIG layout
        // waiting for idle GPUs) is still in flight: the planner holds it `Pending`,
        // `Waiting` or `Draining` for the policy it was written for, in the same change (the
        // same rollout mark; a busy node waiting for a new change is not in flight).
        let in_flight: BTreeSet<(&str, &str)> = (plan.statuses.iter())
            .flat_map(|(p, s)| s.node_details.iter().map(move |d| (p, d)))
            .filter(|(_, d)| ["Pending", "Waiting", "Draining"].contains(&d.state.as_str()))
            .map(|(p, d)| (p.as_str(), d.name.as_str()))
            .collect();
        let (nodes, marks) = (&self.nodes, &self.unconfirmed_marks);
        self.unconfirmed.retain(|name, (policy, gfd)| {
            let n = nodes.iter().find(|n| &n.name == name).unwrap();
            // A mark is `generation/since/target`; an edit renews the first two of a change
            // in flight.
            let target =
                |m: Option<&str>| m.and_then(|m| m.splitn(3, '/').nth(2).map(str::to_string));
            let mark = target(n.annotations.get(names::ANNOTATION_ROLLOUT));
            let same_change =
                mark.is_some() && target(marks.get(name).and_then(|m| m.as_deref())) == mark;
            *gfd || n.labels.get(LABEL_MIG_STATE) == Some("pending")
                || n.labels.get(names::LABEL_VGPU_STATE) == Some("pending")
                || same_change && in_flight.contains(&(policy.as_str(), name.as_str()))
        });
        self.unconfirmed_marks
            .retain(|n, _| self.unconfirmed.contains_key(n));
        // Which policy governs each node now, and which policies this apply changed nodes for.
        let mut governs: BTreeMap<&str, &str> = BTreeMap::new();
        for (policy, status) in &plan.statuses {
            for d in &status.node_details {
                if !["Rejected", "Conflicted", "Overridden"].contains(&d.state.as_str()) {
                    governs.insert(d.name.as_str(), policy.as_str());
                }
            }
        }
        let started_for: BTreeSet<&str> = self
            .unconfirmed
            .keys()
            .filter(|n| !was_unconfirmed.contains(*n))
            .filter_map(|n| governs.get(n.as_str()).copied())
            .collect();
        // The operator can only be blamed where it made an available node unavailable: a node
        // another policy left unconfirmed may move into a policy without any write, and a node
        // in flight stays unavailable through its steps.
        for policy in started_for {
            let status = &plan.statuses[policy];
            let governed = governs.values().filter(|p| **p == policy).count();
            let budget = governed.div_ceil(4).max(1);
            let out: Vec<&String> = self
                .unconfirmed
                .keys()
                .filter(|n| governs.get(n.as_str()) == Some(&policy))
                .collect();
            assert!(
                out.len() <= budget,
                "policy {policy}: {} unconfirmed nodes {out:?}, budget {budget}; status {:?}",
                out.len(),
                status.rollout
            );
        }
    }

    /// GPU Feature Discovery's periodic run on every node it runs on (and the device plugin
    /// advertising what it serves).
    fn gfd(&mut self) {
        self.boot();
        for n in &mut self.nodes {
            if self.nv.gfd(n, &cluster!(self), self.now)
                && let Some((_, gfd)) = self.unconfirmed.get_mut(&n.name)
            {
                *gfd = false;
            }
        }
        self.now += 1;
    }

    /// GPU Feature Discovery's run, with the node's allocatable as it was: the kubelet has not
    /// taken the device plugin's new devices yet.
    fn gfd_before_kubelet(&mut self) {
        let before: Vec<Labels> = self.nodes.iter().map(|n| n.allocatable.clone()).collect();
        self.gfd();
        for (n, a) in self.nodes.iter_mut().zip(before) {
            n.allocatable = a;
        }
    }

    /// The device plugin alone (no GFD run) advertises what it serves on container nodes: for
    /// tests that stamp GFD's labels by hand.
    fn advertise(&mut self) {
        self.boot();
        let cluster = cluster!(self);
        for n in &mut self.nodes {
            let Some(serves) = self.nv.serves(n, &cluster) else {
                continue;
            };
            let mut alloc: Labels = n
                .allocatable
                .iter()
                .filter(|(r, _)| !plan::is_device_plugin_resource(r))
                .collect();
            for (r, c) in serves {
                alloc.insert(r, c.to_string());
            }
            n.allocatable = alloc;
        }
    }

    /// The MIG manager, and on VM hosts the vGPU Device Manager and the sandbox device plugin
    /// (which advertises the GPUs to VMs).
    fn mig_manager(&mut self) {
        self.boot();
        for n in &mut self.nodes {
            self.nv.node_daemons(n, &cluster!(self));
            // GFD does not run on a VM host: the sandbox device plugin advertising the GPUs is
            // what confirms it.
            if vm_label(n)
                && let Some((_, gfd)) = self.unconfirmed.get_mut(&n.name)
            {
                *gfd = false;
            }
        }
    }

    /// MIG may be enabled on the node: its layout label is not a confirmed all-disabled.
    fn mig_maybe_on(n: &NodeFacts) -> bool {
        match n.labels.get(LABEL_MIG_CONFIG) {
            None => false,
            Some(MIG_DISABLED_LAYOUT) => n
                .labels
                .get(LABEL_MIG_STATE)
                .is_some_and(|s| s != "success"),
            Some(_) => true,
        }
    }

    /// A node the plan reports `Applied` already has in its allocatable what the device plugin
    /// serves from the GPUs as the MIG manager left them and the config it runs: Ready is not
    /// claimed while the kubelet still holds the old devices.
    fn applied_nodes_advertise(&self, plan: &Plan) {
        let cluster = cluster!(self);
        for (policy, status) in &plan.statuses {
            for d in status.node_details.iter().filter(|d| d.state == "Applied") {
                let n = self.nodes.iter().find(|n| n.name == d.name).unwrap();
                let Some(serves) = self.nv.serves(n, &cluster) else {
                    continue;
                };
                let advertised: BTreeMap<String, i64> = n
                    .device_plugin_resources()
                    .into_iter()
                    .map(|(r, c)| (r.to_string(), c))
                    .collect();
                assert_eq!(
                    advertised, serves,
                    "policy {policy}: {} Applied while its allocatable {advertised:?} is not what the device plugin serves now {serves:?}; labels {:?}",
                    d.name, n.labels
                );
            }
        }
    }

    fn check_invariants(&self) {
        let cluster = cluster!(self);
        let parsed = |key: &str| {
            let text = self.config.get(key)?;
            Some(parse_device_plugin_config(text).unwrap_or_else(|e| {
                panic!("config {key} is rejected by the device plugin: {e}\n{text}")
            }))
        };
        for n in &self.nodes {
            let sharing = n
                .labels
                .get(LABEL_DEVICE_PLUGIN_CONFIG)
                .and_then(parsed)
                .is_some_and(|c| c.sharing.is_some());
            assert!(
                !(vm_label(n) && (sharing || Self::mig_maybe_on(n))),
                "{}: a VM host and a container-sharing node at once: {:?}",
                n.name,
                n.labels
            );
        }
        let layouts = cluster
            .mig_layouts()
            .unwrap_or_else(|e| panic!("MIG config: {e}"));
        for n in &self.nodes {
            if let Some(l) = n.labels.get(LABEL_MIG_CONFIG) {
                assert!(
                    layouts.contains_key(l),
                    "{}: label names MIG layout {l}, which no config the MIG manager reads has",
                    n.name
                );
            }
        }
        for n in &self.nodes {
            let Some(key) = n.labels.get(LABEL_DEVICE_PLUGIN_CONFIG) else {
                continue;
            };
            let cfg =
                parsed(key).unwrap_or_else(|| panic!("{}: label names missing key {key}", n.name));
            let mps = cfg.has_mps;
            let full_gpu_ts =
                cfg.has_time_slicing && cfg.file_mig_strategy.as_deref() == Some("none");
            assert!(
                !(mps && cfg.has_time_slicing),
                "both MPS and time-slicing in {key}"
            );
            if Self::mig_maybe_on(n) {
                assert!(
                    !mps,
                    "{}: MPS config {key} while MIG may be on: {:?}",
                    n.name, n.labels
                );
                assert!(
                    !full_gpu_ts,
                    "{}: full-GPU time-slicing {key} while MIG may be on: {:?}",
                    n.name, n.labels
                );
            }
        }
        // The same on the GPUs: what the device plugin runs and the MIG mode the MIG manager set.
        for n in &self.nodes {
            let Some(side) = self.nv.nodes.get(&n.name) else {
                continue;
            };
            let mig_on = side.hw.gpus.iter().any(Option::is_some);
            if cluster.workload(n) != "container" {
                assert!(
                    !mig_on,
                    "{}: a VM host with MIG enabled on its GPUs: {:?}",
                    n.name, n.labels
                );
                continue;
            }
            let c = match &side.loaded {
                Loaded::Config(c) => c,
                Loaded::Crash(why) => panic!(
                    "{}: the device plugin and GFD crash-loop: {why}: {:?}",
                    n.name, n.labels
                ),
            };
            let strategy = cluster.mig_strategy(c);
            if let Some(e) = device_plugin_error(c, &side.hw, &strategy) {
                panic!(
                    "{}: the device plugin refuses its config ({e}; MIG strategy {strategy}): {:?}",
                    n.name, n.labels
                );
            }
            let full_gpus = c.sharing.as_ref().is_some_and(|s| {
                s.mps || s.resources.contains_key("nvidia.com/gpu") && strategy == "none"
            });
            assert!(
                !(mig_on && full_gpus),
                "{}: the device plugin shares full GPUs ({c:?}) while MIG is on: {:?}",
                n.name,
                n.labels
            );
        }
    }
}

/// The namespaces the operator has seen, with their labels (`new` is not among them).
fn namespace_labels() -> BTreeMap<String, BTreeMap<String, String>> {
    [("ml", "ml"), ("web", "web")]
        .map(|(ns, t)| (ns.into(), [("tenant".into(), t.into())].into()))
        .into()
}

impl Pods {
    /// The node as the controller sees it: its facts and the GPU pods running there.
    fn view(&self, facts: std::sync::Arc<NodeFacts>, name: &str) -> plan::NodeView {
        let running = self
            .running
            .get(name)
            .map(Vec::as_slice)
            .unwrap_or_default();
        let mut gpu_pods: Vec<String> = running.iter().map(|r| r.id.clone()).collect();
        gpu_pods.sort();
        let mut gpu_requests = BTreeMap::new();
        for (r, c) in running.iter().flat_map(|r| &r.requests) {
            *gpu_requests.entry(r.clone()).or_default() += c;
        }
        let details = running.iter().map(|r| {
            let pod = GpuPod {
                labels: Labels::default(),
                priority: r.priority,
                started: 0,
            };
            (r.id.clone(), pod)
        });
        plan::NodeView {
            facts,
            gpu_pods,
            gpu_pod_details: details.collect(),
            gpu_requests,
            last_busy: (self.last_busy.get(name).copied()).unwrap_or(self.started.unwrap_or(0)),
            ..Default::default()
        }
    }
}

impl World {
    /// The pending pods admitted as demand, as the controller admits them.
    fn admitted(&self) -> admit::Admitted {
        let keys = plan::selector_keys(&self.policies);
        let filter = plan::LabelFilter::new(keys.clone());
        let sources = admit::Sources {
            mig_configs: || self.base.clone(),
            namespaces: || Some(namespace_labels()),
        };
        let budget = admit::KeyBudget {
            policy: &keys,
            filter: &filter,
        };
        admit::admit(&self.policies, sources, &budget, self.pods.pending.clone())
    }

    /// A pass of the controller: it notes the busy nodes, then reads its input.
    fn pass_input(&mut self) -> PlanInput {
        self.note_busy();
        self.input()
    }

    /// The controller notes the nodes that run GPU pods (a node busy when it last looked was
    /// busy until now, as far as it knows): at every pass, and at every pod event (its pod
    /// watch starts a pass).
    fn note_busy(&mut self) {
        let (now, p) = (self.now, &mut self.pods);
        p.started.get_or_insert(now);
        let busy: BTreeSet<String> = p.running.keys().cloned().collect();
        for n in busy.union(&p.busy_last_pass) {
            p.last_busy.insert(n.clone(), now);
        }
        p.busy_last_pass = busy;
    }

    /// Devices of `resource` on `n` no running pod holds.
    fn free(&self, n: &NodeFacts, resource: &str) -> i64 {
        n.allocatable(resource) - self.held(&n.name, resource)
    }

    /// Devices of `resource` the pods running on `node` hold.
    fn held(&self, node: &str, resource: &str) -> i64 {
        let running = self.pods.running.get(node).into_iter().flatten();
        running.filter_map(|r| r.requests.get(resource)).sum()
    }

    /// Whether a container pod may start on `n`: not cordoned, not a VM host (its GPUs are
    /// bound to VFIO, even while the kubelet still lists the device plugin's resources), its
    /// MIG manager not reconfiguring it.
    fn takes_pods(n: &NodeFacts) -> bool {
        n.annotations.get(ANNOTATION_CORDONED).is_none()
            && !vm_label(n)
            && n.labels.get(LABEL_MIG_STATE) != Some("pending")
    }

    fn arrive(&mut self, g: &PodGen) {
        let selector = match g.selector {
            1 => Some(("nvidia.com/gpu.product", "NVIDIA-A100-SXM4-80GB")),
            2 => Some(("nvidia.com/gpu.product", "NVIDIA-H200")),
            3 => Some(("kubernetes.io/hostname", "a100-1")),
            _ => None,
        };
        for _ in 0..g.burst {
            self.pods.serial += 1;
            self.pods.pending.push(PendingPod {
                id: format!("{}/pod-{}", NAMESPACES[g.namespace], self.pods.serial),
                priority: POD_PRIORITIES[g.priority],
                since: self.now,
                profiles: [(POD_PROFILES[g.profile].to_string(), g.count)].into(),
                node_selector: (selector.iter())
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect(),
                ..Default::default()
            });
        }
    }

    /// kube-scheduler: each pending pod, highest priority then oldest first, goes to the first
    /// node (by name) that takes pods, whose labels its node selector accepts and whose free
    /// devices hold all it asks for.
    fn schedule(&mut self) {
        let mut pending = std::mem::take(&mut self.pods.pending);
        pending.sort_by_key(|p| (std::cmp::Reverse(p.priority), p.since, p.id.clone()));
        for pod in pending {
            let requests: BTreeMap<String, i64> = (pod.profiles.iter())
                .map(|(p, c)| (format!("nvidia.com/mig-{p}"), *c))
                .collect();
            let node = self.nodes.iter().find(|n| {
                Self::takes_pods(n)
                    && (pod.node_selector.iter()).all(|(k, v)| n.labels.get(k) == Some(v))
                    && requests.iter().all(|(r, c)| self.free(n, r) >= *c)
            });
            match node.map(|n| n.name.clone()) {
                Some(n) => self.pods.running.entry(n).or_default().push(Running {
                    id: pod.id,
                    priority: pod.priority,
                    requests,
                }),
                None => self.pods.pending.push(pod),
            }
        }
        self.pods.pending.sort_by(|a, b| a.id.cmp(&b.id));
    }

    /// A GPU pod starts on node `i`, taking one free device of what the node advertises.
    fn start(&mut self, i: usize, priority: usize) {
        let n = &self.nodes[i];
        let resources = n.device_plugin_resources().into_iter().map(|(r, _)| r);
        let Some(r) = resources
            .filter(|r| self.free(n, r) > 0)
            .map(String::from)
            .next()
        else {
            return;
        };
        if !Self::takes_pods(n) {
            return;
        }
        let name = n.name.clone();
        self.pods.serial += 1;
        self.pods.running.entry(name).or_default().push(Running {
            id: format!("web/run-{}", self.pods.serial),
            priority: POD_PRIORITIES[priority],
            requests: [(r, 1)].into(),
        });
    }

    /// The `k`-th running pod (by node, then start) finishes.
    fn finish(&mut self, k: usize) {
        let all: Vec<(String, String)> = (self.pods.running.iter())
            .flat_map(|(n, r)| r.iter().map(move |p| (n.clone(), p.id.clone())))
            .collect();
        if let Some((node, id)) = all.get(k % all.len().max(1)).cloned() {
            self.end_pods(&node, &[id], self.now);
        }
    }

    /// Pods of `node` end (finished, or evicted) at `now`.
    fn end_pods(&mut self, node: &str, ids: &[String], now: i64) {
        let Some(running) = self.pods.running.get_mut(node) else {
            return;
        };
        running.retain(|p| !ids.contains(&p.id));
        if running.is_empty() {
            self.pods.running.remove(node);
            self.pods.idle_since.insert(node.to_string(), now);
        }
    }

    /// What the controller does with the demand's part of a plan made from `input`: records
    /// the layouts (under the demand's field manager), evicts what the drains evict, and writes
    /// each policy's `status.demand` (which keeps the recent drains).
    fn apply_demand(&mut self, input: &PlanInput, p: &Plan) {
        let now = input.cluster.now;
        for (node, want) in &p.demand.annotations {
            let n = self.nodes.iter_mut().find(|n| &n.name == node).unwrap();
            match want {
                Some(value) => {
                    n.annotations.insert(ANNOTATION_MIG_DEMAND, value.as_str());
                    self.pods.recorded_at.insert(node.clone(), now);
                }
                None => {
                    n.annotations.remove(ANNOTATION_MIG_DEMAND);
                    self.pods.recorded_at.remove(node);
                }
            }
        }
        for (node, d) in &p.drains {
            self.end_pods(node, &d.evict, now);
        }
        let governs = governing(p);
        for policy in p.demand.drains.keys().filter_map(|n| governs.get(n)) {
            self.pods
                .drains
                .entry(policy.clone())
                .or_default()
                .push(now);
        }
        for policy in &mut self.policies {
            let name = policy.metadata.name.clone().unwrap_or_default();
            let demand = p.statuses.get(&name).and_then(|s| s.demand.clone());
            if demand.is_none() {
                self.pods.drains.remove(&name);
            }
            let rollout = p.statuses.get(&name).and_then(|s| s.rollout.clone());
            let status = policy.status.get_or_insert_default();
            status.demand = demand;
            // A halt stays recorded until an edit (a new generation) resumes the rollout.
            status.rollout = rollout;
        }
    }
}

/// The policy governing each node, by the plan's statuses (the one not reporting it
/// conflicted or overridden).
fn governing(p: &Plan) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    for (policy, s) in &p.statuses {
        for d in &s.node_details {
            if !["Conflicted", "Overridden"].contains(&d.state.as_str()) {
                out.insert(d.name.clone(), policy.clone());
            }
        }
    }
    out
}

/// MIG profiles of the test world's GPU models (NVML's tables).
const A100_PROFILES: [&str; 6] = [
    "1g.10gb", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb",
];
const H200_PROFILES: [&str; 6] = [
    "1g.18gb", "1g.35gb", "2g.35gb", "3g.71gb", "4g.71gb", "7g.141gb",
];

/// The profiles the GPUs of node `n` have (by its GFD product label).
fn model_profiles(n: &NodeFacts) -> [&'static str; 6] {
    match n.labels.get("nvidia.com/gpu.product") {
        Some(p) if p.contains("H200") => H200_PROFILES,
        _ => A100_PROFILES,
    }
}

/// What a mig-parted layout sets on a node of 8 GPUs: the GPUs with MIG on, and the profiles
/// it creates.
fn layout_shape(entries: &serde_json::Value) -> (BTreeSet<usize>, BTreeSet<String>) {
    let (mut on, mut profiles) = (BTreeSet::new(), BTreeSet::new());
    for e in entries.as_array().into_iter().flatten() {
        let gpus: Vec<usize> = match e.get("devices").and_then(|d| d.as_array()) {
            Some(list) => list
                .iter()
                .filter_map(|v| Some(v.as_u64()? as usize))
                .collect(),
            None => (0..8).collect(),
        };
        if e.get("mig-enabled") == Some(&serde_json::Value::Bool(true)) {
            on.extend(gpus);
            let devices = e.get("mig-devices").and_then(|d| d.as_object());
            profiles.extend(devices.into_iter().flat_map(|d| d.keys().cloned()));
        } else {
            on.retain(|g| !gpus.contains(g));
        }
    }
    (on, profiles)
}

/// The layout demand recorded on a node, and when (read by the test, not the planner).
fn recorded_layout(n: &NodeFacts) -> Option<(&str, i64)> {
    let (l, t) = n.annotations.get(ANNOTATION_MIG_DEMAND)?.rsplit_once('@')?;
    Some((l, t.parse().ok()?))
}

/// Whether dynamic policy `d` takes pod `id`'s namespace as demand (labels unknown: only
/// without a selector).
fn selects(d: &DynamicMig, id: &str) -> bool {
    let ns = id.split_once('/').map_or("", |(ns, _)| ns);
    let Some(sel) = &d.namespace_selector else {
        return true;
    };
    namespace_labels().get(ns).is_some_and(|labels| {
        let want = sel.match_labels.iter().flatten();
        want.into_iter().all(|(k, v)| labels.get(k) == Some(v))
    })
}

/// What the operator promises about demand (`docs/dynamic-mig.md`), checked on one plan
/// against the input it was made from and what the world remembers of earlier passes.
struct DemandCheck<'a> {
    w: &'a World,
    input: &'a PlanInput,
    p: &'a Plan,
    now: i64,
    governs: BTreeMap<String, String>,
    /// Layouts by name: NVIDIA's and our ConfigMap's (custom ones).
    layouts: BTreeMap<String, serde_json::Value>,
    /// Nodes demand chooses a new layout for in this plan (one the node does not run).
    choices: BTreeMap<String, String>,
}

impl<'a> DemandCheck<'a> {
    fn new(w: &'a World, input: &'a PlanInput, p: &'a Plan) -> Self {
        let now = input.cluster.now;
        let mut layouts = w.base.clone();
        if let Some(t) = &p.mig_config {
            layouts.extend(gpu_sharing_operator::nvidia::parse_mig_configs(t).unwrap());
        }
        let mut choices = BTreeMap::new();
        for (node, want) in &p.demand.annotations {
            let Some(value) = want else {
                continue;
            };
            let (layout, at) = value.rsplit_once('@').unwrap();
            assert_eq!(at, now.to_string(), "{node}: {value} recorded at {now}");
            let v = input.nodes.iter().find(|v| v.name() == node).unwrap();
            if v.labels.get(LABEL_MIG_CONFIG) != Some(layout) {
                choices.insert(node.clone(), layout.to_string());
            }
        }
        DemandCheck {
            w,
            input,
            p,
            now,
            governs: governing(p),
            layouts,
            choices,
        }
    }

    fn view(&self, node: &str) -> &'a plan::NodeView {
        self.input.nodes.iter().find(|v| v.name() == node).unwrap()
    }

    /// The node as the plan leaves it (our labels and annotations applied).
    fn after(&self, node: &str) -> NodeFacts {
        let mut n = (*self.view(node).facts).clone();
        server_side_apply(
            &mut n,
            &self.p.node_labels[node],
            &self.p.node_annotations[node],
        );
        n
    }

    /// The dynamic policy `name`, unless refused.
    fn dynamic_policy(&self, name: &str) -> Option<(&'a GpuSharingPolicy, &'a DynamicMig)> {
        let policy =
            (self.input.policies.iter()).find(|p| p.metadata.name.as_deref() == Some(name))?;
        let status = self.p.statuses.get(name)?;
        // Refused (an invalid spec, a cluster-wide conflict): its demand is not planned. Nodes
        // it cannot run on refuse it too, but it goes on with the others.
        let accepted = !(status.conditions.iter()).any(|c| {
            c.type_ == "Accepted"
                && ["InvalidSpec", "ClusterWideConflict"].contains(&c.reason.as_str())
        });
        let d = policy.spec.mig.as_ref()?.dynamic.as_ref()?;
        accepted.then_some((policy, d))
    }

    /// The dynamic policy governing `node`, unless refused.
    fn dynamic(&self, node: &str) -> Option<(&'a GpuSharingPolicy, &'a DynamicMig)> {
        self.dynamic_policy(self.governs.get(node)?)
    }

    /// The layouts demand may give a node of `policy`: its own, then the catalogue's.
    fn catalogue(&self, policy: &GpuSharingPolicy) -> Vec<String> {
        let name = policy.metadata.name.as_deref().unwrap_or_default();
        let own = self.p.statuses.get(name).and_then(|s| s.mig_config.clone());
        let d = policy.spec.mig.as_ref().and_then(|m| m.dynamic.as_ref());
        own.into_iter()
            .chain(d.into_iter().flat_map(|d| d.layouts.iter().cloned()))
            .collect()
    }

    /// Whether `layout` on `node` would serve pod `p`: the GPUs have its profiles, the layout
    /// creates them, and its node selector accepts the node.
    fn serves(&self, p: &PendingPod, node: &str, layout: &str) -> bool {
        let v = self.view(node);
        let (_, profiles) = layout_shape(&self.layouts[layout]);
        let model = model_profiles(v);
        (p.profiles.keys()).all(|k| profiles.contains(k) && model.contains(&k.as_str()))
            && (p.node_selector.iter()).all(|(k, val)| v.labels.get(k) == Some(val))
    }

    fn check(&self) {
        self.busy_gpus_stay();
        for (node, layout) in &self.choices {
            self.choice(node, layout);
        }
        self.events();
        self.drains();
        self.drains_per_hour();
        self.waiting();
        self.budget();
        self.reshaping_listed();
        self.served_is_free();
        self.refused_keeps_records();
    }
}

impl DemandCheck<'_> {
    /// No node's GPUs change while GPU pods run there: its MIG layout and workload labels stay
    /// (demand drains and reservations included: they wait for idle GPUs). No workload label is
    /// the GPU Operator's default, `container`.
    fn busy_gpus_stay(&self) {
        fn workload(n: &NodeFacts) -> &str {
            n.labels.get(names::LABEL_WORKLOAD).unwrap_or("container")
        }
        for v in self.input.nodes.iter().filter(|v| !v.gpu_pods.is_empty()) {
            let after = self.after(v.name());
            let (mig, was) = (
                after.labels.get(LABEL_MIG_CONFIG),
                v.labels.get(LABEL_MIG_CONFIG),
            );
            for (k, now, before) in [
                (LABEL_MIG_CONFIG, mig, was),
                (
                    names::LABEL_WORKLOAD,
                    Some(workload(&after)),
                    Some(workload(v)),
                ),
            ] {
                assert_eq!(
                    now,
                    before,
                    "{}: {k} changed while GPU pods run there: {:?}",
                    v.name(),
                    v.gpu_pods
                );
            }
        }
    }

    /// A layout demand chooses for `node`: of the governing dynamic policy's catalogue, one its
    /// GPUs can take without a MIG mode change, not on a failed node, for some pod, on an idle
    /// node (idle `idleSeconds`) unless the policy reserves or drains busy nodes (under the
    /// priority ceiling), and not before `minLayoutLifetimeSeconds` since the last record.
    fn choice(&self, node: &str, layout: &str) {
        let v = self.view(node);
        let ctx = format!("{node} at {}: demand chose {layout}", self.now);
        let (policy, d) = self
            .dynamic(node)
            .unwrap_or_else(|| panic!("{ctx}, though no dynamic policy governs it"));
        let catalogue = self.catalogue(policy);
        assert!(
            catalogue.iter().any(|l| l == layout),
            "{ctx}, not in {catalogue:?}"
        );
        let state = v.labels.get(LABEL_MIG_STATE);
        assert_ne!(
            state,
            Some("failed"),
            "{ctx}, though its MIG manager failed"
        );
        let (on, profiles) = layout_shape(&self.layouts[layout]);
        let model = model_profiles(v);
        assert!(
            v.labels.get("nvidia.com/mig.capable") == Some("true")
                && profiles.iter().all(|p| model.contains(&p.as_str())),
            "{ctx}, which its GPUs cannot take ({profiles:?} on {:?})",
            v.labels.get("nvidia.com/gpu.product")
        );
        let gpus = &self.w.nv.nodes[node].hw.gpus;
        let mig_on: BTreeSet<usize> = (0..gpus.len()).filter(|&i| gpus[i].is_some()).collect();
        assert_eq!(
            on, mig_on,
            "{ctx}: it switches MIG mode (on GPUs {mig_on:?} now, {on:?} in {layout})"
        );
        let takes_busy = d.reserve_busy_nodes.is_some()
            || d.drain_busy_nodes.is_some() && d.namespace_selector.is_some();
        if !v.gpu_pods.is_empty() {
            let ceiling = |dr: &DemandDrain| {
                (v.gpu_pods.iter()).all(|p| v.gpu_pod_details[p].priority <= dr.max_pod_priority)
            };
            let drains =
                d.namespace_selector.is_some() && d.drain_busy_nodes.as_ref().is_some_and(ceiling);
            assert!(
                d.reserve_busy_nodes.is_some() || drains,
                "{ctx} while GPU pods run there: {:?} ({:?})",
                v.gpu_pods,
                v.gpu_pod_details
            );
        } else if !takes_busy {
            let since = self.w.pods.idle_since.get(node).copied();
            let idle = since.map_or(i64::MAX, |t| self.now - t);
            assert!(
                idle >= d.idle_seconds,
                "{ctx} {idle} s after its last GPU pod ended (idleSeconds {})",
                d.idle_seconds
            );
        }
        let lifetime = match takes_busy {
            true => d.min_layout_lifetime_seconds.max(60),
            false => d.min_layout_lifetime_seconds,
        };
        if let Some((l, _)) = recorded_layout(v).filter(|(l, _)| catalogue.iter().any(|c| c == l)) {
            let at = self.w.pods.recorded_at[node];
            assert!(
                self.now - at >= lifetime,
                "{ctx} {} s after it recorded {l} (minLayoutLifetimeSeconds {lifetime})",
                self.now - at
            );
        }
        let events = &self.p.demand.events;
        assert!(
            events.iter().any(|(_, n, _)| n == node),
            "{ctx} for no pod: {events:?}"
        );
    }

    /// Every pod acted for is acted for once, on a node chosen now, and is demand of that
    /// node's policy: pending, from a namespace it selects, asking for profiles the chosen
    /// layout creates on the node's GPUs, selecting the node.
    fn events(&self) {
        let mut seen = BTreeSet::new();
        for (id, node, msg) in &self.p.demand.events {
            assert!(
                seen.insert(id),
                "{id} acted for twice: {:?}",
                self.p.demand.events
            );
            let layout = (self.choices.get(node)).unwrap_or_else(|| {
                panic!("{id}: event on {node}, which demand did not choose: {msg}")
            });
            let (_, d) = self.dynamic(node).unwrap();
            let pod = (self.w.pods.pending.iter().find(|p| &p.id == id))
                .unwrap_or_else(|| panic!("{node} reshaped for {id}, which is not pending"));
            assert!(
                selects(d, id),
                "{node} reshaped for {id}, whose namespace its policy does not select ({:?})",
                d.namespace_selector
            );
            assert!(
                self.serves(pod, node, layout),
                "{node} reshaped to {layout} for {id}, which it does not serve: {pod:?}"
            );
        }
    }
}

impl DemandCheck<'_> {
    /// Evictions happen only in demand drains (no policy here asks for `disruption.mode:
    /// drain`): on a node cordoned by us, under `drainBusyNodes` with its namespace fence, where
    /// no pod runs above `maxPodPriority`; and a drain begins only while a pending pod of a
    /// selected namespace is left for the layout it waits for.
    fn drains(&self) {
        for (node, drain) in &self.p.drains {
            let v = self.view(node);
            assert!(
                self.after(node)
                    .annotations
                    .get(ANNOTATION_CORDONED)
                    .is_some(),
                "{node} drained without our cordon: {drain:?}"
            );
            let dr = (self.dynamic(node))
                .filter(|(_, d)| d.namespace_selector.is_some())
                .and_then(|(_, d)| d.drain_busy_nodes.as_ref().map(|dr| (d, dr)));
            let Some((d, dr)) = dr else {
                panic!("{node} drained, though its policy does not drain busy nodes: {drain:?}")
            };
            // Nothing above the ceiling runs there (a drain evicts none, and is not made).
            for pod in &v.gpu_pods {
                let priority = v.gpu_pod_details[pod].priority;
                assert!(
                    priority <= dr.max_pod_priority,
                    "{node} drained while {pod} of priority {priority} runs, above maxPodPriority {}: {drain:?}",
                    dr.max_pod_priority
                );
            }
            if v.annotations.get(ANNOTATION_CORDONED).is_some() || drain.evict.is_empty() {
                continue;
            }
            let (layout, _) = recorded_layout(v).expect("a demand drain has a recorded layout");
            let wanted = (self.input.cluster.demand.iter())
                .any(|p| selects(d, &p.id) && self.serves(p, node, layout));
            assert!(
                wanted,
                "{node}: a drain for {layout} begins, though no pending pod it would serve is left"
            );
        }
    }

    /// At most `maxDrainsPerHour` drains chosen per policy in any hour.
    fn drains_per_hour(&self) {
        let mut chosen: BTreeMap<&str, usize> = BTreeMap::new();
        for node in self.p.demand.drains.keys() {
            *chosen.entry(self.governs[node].as_str()).or_default() += 1;
        }
        for (policy, k) in chosen {
            let dr = self
                .dynamic_policy(policy)
                .and_then(|(_, d)| d.drain_busy_nodes.as_ref());
            let Some(dr) = dr else {
                panic!("{policy}: {k} drain(s) chosen, though it does not drain busy nodes")
            };
            let max = dr.max_drains_per_hour as usize;
            let drains = self.w.pods.drains.get(policy).into_iter().flatten();
            let before = drains.filter(|t| self.now - **t < 3600).count();
            assert!(
                before + k <= max,
                "{policy}: {k} drain(s) chosen at {} after {before} in the hour: maxDrainsPerHour {max}",
                self.now
            );
        }
    }

    /// A node chosen for a layout and busy (a pod bound meanwhile, or a reservation or drain
    /// waiting): a policy that waits for idle nodes gives the choice up; one that reserves or
    /// drains cordons it, gives it up by `maxWaitSeconds` (reservations) or
    /// `drainTimeoutSeconds` (drains, 600 s by default), and as soon as no pending pod is left
    /// for it (reservations, and drains before their first eviction).
    fn waiting(&self) {
        for v in &self.input.nodes {
            let node = v.name();
            let (Some((policy, d)), Some((layout, _))) = (self.dynamic(node), recorded_layout(v))
            else {
                continue;
            };
            let label = v.labels.get(LABEL_MIG_CONFIG);
            let chosen = self.catalogue(policy).iter().any(|l| l == layout);
            if v.gpu_pods.is_empty() || label == Some(layout) || !chosen {
                continue;
            }
            let next = self.p.demand.annotations.get(node);
            let given_up = next.is_some_and(|w| {
                let l = w
                    .as_deref()
                    .and_then(|w| w.rsplit_once('@'))
                    .map(|(l, _)| l);
                l != Some(layout)
            });
            let ctx = format!(
                "{node} at {}: chosen for {layout}, busy {:?}",
                self.now, v.gpu_pods
            );
            let deadline = match (&d.reserve_busy_nodes, &d.drain_busy_nodes) {
                (Some(r), _) => r.max_wait_seconds,
                (None, Some(_)) if d.namespace_selector.is_some() => 600,
                _ => {
                    assert!(given_up, "{ctx}: not given up");
                    continue;
                }
            };
            let waited = self.now - self.w.pods.recorded_at[node];
            if waited >= deadline {
                assert!(
                    given_up,
                    "{ctx}: still waiting after {waited} s (deadline {deadline} s)"
                );
            } else if !given_up {
                let cordoned = self
                    .after(node)
                    .annotations
                    .get(ANNOTATION_CORDONED)
                    .is_some();
                assert!(cordoned, "{ctx}: not cordoned; labels {:?}", v.labels);
                // Held only for pods: a reservation (or a drain not begun) whose pods are gone
                // is given back.
                let begun = v.annotations.get(ANNOTATION_CORDONED).is_some();
                let wanted = (self.input.cluster.demand.iter())
                    .any(|p| selects(d, &p.id) && self.serves(p, node, layout));
                assert!(
                    wanted || begun && d.reserve_busy_nodes.is_none(),
                    "{ctx}: still held, though no pending pod it would serve is left"
                );
            }
        }
    }

    /// An edit that makes a dynamic policy invalid keeps the layouts recorded on its nodes
    /// until it is fixed: demand writes nothing there.
    fn refused_keeps_records(&self) {
        for (node, policy) in &self.governs {
            let refused = self.p.invalid.contains_key(policy);
            let dynamic = (self.input.policies.iter())
                .find(|p| p.metadata.name.as_deref() == Some(policy))
                .is_some_and(|p| p.spec.mig.as_ref().is_some_and(|m| m.dynamic.is_some()));
            let written = self.p.demand.annotations.get(node);
            assert!(
                !(refused && dynamic && written.is_some()),
                "{node}: demand wrote {written:?} under {policy}, which is refused: {:?}",
                self.p.invalid[policy]
            );
        }
    }

    /// What `status.demand` counts as served, the policy's nodes have free: instances the
    /// device plugin advertises and no running pod holds.
    fn served_is_free(&self) {
        for (name, s) in &self.p.statuses {
            for d in s.demand.iter().flat_map(|d| &d.profiles) {
                let resource = format!("nvidia.com/mig-{}", d.profile);
                let free: i64 = (self.input.nodes.iter())
                    .filter(|v| self.governs.get(v.name()) == Some(name))
                    .map(|v| (v.allocatable(&resource) - self.w.held(v.name(), &resource)).max(0))
                    .sum();
                assert!(
                    d.served <= free,
                    "{name}: {} {} instance(s) counted as served, {free} free: {d:?}",
                    d.served,
                    d.profile
                );
            }
        }
    }

    /// `status.demand.reshaping` names only nodes that can get there: none the policy refuses
    /// (its rollout budget counts them).
    fn reshaping_listed(&self) {
        for (name, s) in &self.p.statuses {
            for r in s.demand.iter().flat_map(|d| &d.reshaping) {
                let node = r.split_once(':').map_or(r.as_str(), |(n, _)| n);
                let detail = s.node_details.iter().find(|d| d.name == node);
                assert!(
                    detail.is_some_and(|d| !d.state.refused()),
                    "{name}: demand counts {r} as reshaping, a node the policy refuses: {detail:?}"
                );
            }
        }
    }

    /// Demand chooses no more nodes of a policy than its rollout budget has room for (25% of
    /// its nodes, at least one), counting those whose chosen layout is not confirmed yet.
    fn budget(&self) {
        let mut chosen: BTreeMap<&str, usize> = BTreeMap::new();
        for node in self.choices.keys() {
            *chosen.entry(self.governs[node].as_str()).or_default() += 1;
        }
        for (name, k) in chosen {
            let (policy, _) = self.dynamic_policy(name).unwrap();
            let catalogue = self.catalogue(policy);
            let nodes: Vec<&plan::NodeView> = (self.input.nodes.iter())
                .filter(|v| self.governs.get(v.name()).map(String::as_str) == Some(name))
                .collect();
            let in_flight = nodes.iter().filter(|v| {
                let state = v.labels.get(LABEL_MIG_STATE);
                recorded_layout(v).is_some_and(|(l, _)| {
                    catalogue.iter().any(|c| c == l)
                        && state != Some("failed")
                        && (v.labels.get(LABEL_MIG_CONFIG) != Some(l) || state == Some("pending"))
                })
            });
            let in_flight = in_flight.count();
            let budget = nodes.len().div_ceil(4).max(1);
            assert!(
                in_flight + k <= budget,
                "{name} at {}: {k} node(s) chosen while {in_flight} reshape, budget {budget}",
                self.now
            );
        }
    }
}

impl World {
    /// One step of a history.
    fn step(&mut self, s: Step, planner: &mut plan::Planner) {
        match s {
            Step::Apply => self.apply_step(planner),
            Step::MigManager => self.mig_manager(),
            Step::Gfd => self.gfd(),
            Step::GfdBeforeKubelet => self.gfd_before_kubelet(),
            Step::Relabel(n, p) => match p {
                Some(p) => {
                    for k in PROFILE_KEYS {
                        self.nodes[n].labels.insert(k, PROFILES[p]);
                    }
                }
                None => {
                    for k in PROFILE_KEYS {
                        self.nodes[n].labels.remove(k);
                    }
                }
            },
            Step::Policies(g) => {
                let old = std::mem::replace(&mut self.policies, build(&g));
                for p in &mut self.policies {
                    let before = old.iter().find(|o| o.metadata.name == p.metadata.name);
                    p.status = before.and_then(|o| o.status.clone());
                    // The API server counts spec changes.
                    p.metadata.generation = before.map(|o| {
                        let g = o.metadata.generation.unwrap_or(1);
                        if o.spec == p.spec { g } else { g + 1 }
                    });
                }
            }
            Step::Arrive(g) => self.arrive(&g),
            Step::Leave(k) => {
                let pending = &mut self.pods.pending;
                if let Some(gone) = pending.get(k % pending.len().max(1)).cloned() {
                    pending.retain(|p| (p.since, &p.profiles) != (gone.since, &gone.profiles));
                }
            }
            Step::Schedule => {
                self.schedule();
                self.note_busy();
            }
            Step::Start(n, p) => {
                self.start(n, p);
                self.note_busy();
            }
            Step::Finish(k) => {
                self.finish(k);
                self.note_busy();
            }
            Step::Tick(s) => self.now += s,
            Step::NvidiaConfig(count, on) => {
                self.vgpu_per_gpu = count;
                self.vgpu_manager = on;
            }
        }
    }

    /// A pass of the controller, checked: the plan is the incremental planner's, does not
    /// depend on the input's order or on labels the node cache drops, names keys it holds, and
    /// keeps the demand's promises; then it is applied.
    fn apply_step(&mut self, planner: &mut plan::Planner) {
        let input = self.pass_input();
        let p = plan::plan(&input);
        assert_eq!(
            planner.plan(&input),
            p,
            "the incremental plan differs from the plan from scratch"
        );
        // Determinism: same input (in another order) -> same plan.
        let mut shuffled = input.clone();
        shuffled.policies.reverse();
        shuffled.nodes.reverse();
        assert_eq!(plan::plan(&shuffled), p, "plan depends on input order");
        // The runtime's node cache keeps only the labels the planner reads (the policies'
        // selector keys, and those admitted pending pods select on): the same plan from those.
        let mut keys = plan::selector_keys(&input.policies);
        keys.extend(self.admitted().keys);
        let filter = plan::LabelFilter::new(keys);
        let mut filtered = input.clone();
        for n in &mut filtered.nodes {
            let mut f = (*n.facts).clone();
            f.labels = filter.apply(&f.labels);
            n.facts = std::sync::Arc::new(f);
        }
        assert_eq!(
            plan::plan(&filtered),
            p,
            "plan reads a label the cache drops"
        );
        for (n, labels) in &p.node_labels {
            for k in labels
                .iter()
                .filter(|(k, _)| *k == LABEL_DEVICE_PLUGIN_CONFIG)
                .map(|(_, v)| v)
            {
                assert!(
                    p.device_config.contains_key(k),
                    "{n}: label {k} names no key of the plan"
                );
            }
        }
        DemandCheck::new(self, &input, &p).check();
        self.applied_nodes_advertise(&p);
        self.apply_within_budget(&p);
        self.apply_demand(&input, &p);
    }
}

fn run_history(policies: Vec<PolicyGen>, steps: Vec<Step>) {
    let mut w = World::new(initial_nodes(), build(&policies));
    // Start from MIG enabled on one node, as an admin left it.
    w.nodes[0].labels.insert(LABEL_MIG_CONFIG, "all-1g.10gb");
    w.nodes[0].labels.insert(LABEL_MIG_STATE, "success");
    // GFD runs on every node: it has labelled each once already.
    w.gfd();
    let pristine = w.nodes.clone();
    // The controller has run for an hour, and seen no GPU pod.
    w.pods.started = Some(w.now - 3600);
    // The controller's planner, kept across the whole history: its plan of every pass must be
    // the plan from scratch.
    let mut planner = plan::Planner::default();
    for s in steps {
        if std::env::var("HIST_DEBUG").is_ok() {
            eprintln!("STEP {s:?}");
        }
        w.step(s, &mut planner);
        if std::env::var("HIST_DEBUG").is_ok() {
            eprintln!(
                "  cp mig {:?} cfg {:?}",
                w.cluster_policy.pointer("/mig"),
                w.config.keys().collect::<Vec<_>>()
            );
            for n in &w.nodes {
                let l = |k| n.labels.get(k).unwrap_or("-").to_string();
                eprintln!(
                    "  {} policy {} mig {} {} dp {} vgpu {} {} wl {} cordon {} alloc {:?} owned {:?}",
                    n.name,
                    l(names::LABEL_POLICY),
                    l(LABEL_MIG_CONFIG),
                    l(LABEL_MIG_STATE),
                    l(LABEL_DEVICE_PLUGIN_CONFIG),
                    l(names::LABEL_VGPU_CONFIG),
                    l(names::LABEL_VGPU_STATE),
                    l(names::LABEL_WORKLOAD),
                    n.annotations.get(ANNOTATION_CORDONED).is_some(),
                    n.allocatable,
                    n.owned
                );
            }
            eprintln!("  unconfirmed {:?}", w.unconfirmed);
        }
        w.check_invariants();
    }
    converge_and_check(w, pristine);
}

/// Every pod ends (pending pods are deleted); then plans are applied and NVIDIA's components
/// answer until nothing changes, and the converged state is checked.
fn converge_and_check(mut w: World, pristine: Vec<NodeFacts>) {
    w.pods.pending.clear();
    let running: Vec<(String, Vec<String>)> = (w.pods.running.iter())
        .map(|(n, pods)| (n.clone(), pods.iter().map(|p| p.id.clone()).collect()))
        .collect();
    for (node, ids) in running {
        w.end_pods(&node, &ids, w.now);
    }
    // Converge: alternate apply and MIG manager; then planning the planned state changes nothing.
    // A round whose plan is the last round's, after NVIDIA's components answered, is a fixed
    // point: the rounds left would change nothing.
    let mut last: Option<Plan> = None;
    for _ in 0..16 {
        w.resume_halted();
        let input = w.pass_input();
        let p = plan::plan(&input);
        if last.as_ref() == Some(&p) {
            break;
        }
        DemandCheck::new(&w, &input, &p).check();
        w.apply_within_budget(&p);
        w.apply_demand(&input, &p);
        w.check_invariants();
        w.mig_manager();
        w.gfd();
        w.check_invariants();
        last = Some(p);
    }
    check_converged(&w, &pristine);
}

impl World {
    /// The admin edits every policy whose rollout is halted (a new generation resumes it).
    fn resume_halted(&mut self) {
        for p in &mut self.policies {
            let halted = p
                .status
                .as_ref()
                .and_then(|s| s.rollout.as_ref()?.halted_generation);
            if halted.is_some() && halted == p.metadata.generation {
                p.metadata.generation = halted.map(|g| g + 1);
            }
        }
    }
}

/// Once converged: the nodes carry the labels planned, planning again changes nothing, nothing
/// waits, no cordon of ours is left, and nodes are rejected for what they are.
fn check_converged(w: &World, pristine: &[NodeFacts]) {
    let p = plan::plan(&w.input());
    for n in &w.nodes {
        assert!(
            n.annotations.get(ANNOTATION_CORDONED).is_none(),
            "{}: still cordoned after convergence: {:?}",
            n.name,
            n.annotations
        );
        let want = &p.node_labels[&n.name];
        for (k, v) in want {
            assert_eq!(
                n.labels.get(k),
                Some(v.as_str()),
                "{}: not converged on {k}",
                n.name
            );
        }
    }
    let again = plan::plan(&w.input());
    assert_eq!(p, again, "planning the converged state changed the plan");
    // Liveness: once NVIDIA's components answered, no node still waits for its turn or for a
    // confirmation (nothing here fails, times out, or keeps GPUs busy).
    for (policy, s) in &p.statuses {
        for d in &s.node_details {
            assert!(
                !["Queued", "Pending"].contains(&d.state.as_str()),
                "policy {policy}: {} still {} after convergence: {}; labels {:?}",
                d.name,
                d.state,
                d.message,
                w.nodes.iter().find(|n| n.name == d.name).map(|n| &n.labels)
            );
        }
    }
    // A node is rejected for what it is, not for what NVIDIA's components report about our
    // own changes: the same policies reject the same nodes as on the nodes before any write
    // (their first GFD labels, with the profile labels they have now).
    let mut before = w.input();
    before.nodes = pristine
        .iter()
        .zip(&w.nodes)
        .map(|(p, n)| {
            let mut f = p.clone();
            for k in PROFILE_KEYS {
                match n.labels.get(k) {
                    Some(v) => f.labels.insert(k, v),
                    None => drop(f.labels.remove(k)),
                }
            }
            plan::NodeView::idle(f)
        })
        .collect();
    let rejected = |p: &Plan| -> BTreeMap<String, String> {
        p.statuses
            .iter()
            .flat_map(|(policy, s)| {
                s.node_details
                    .iter()
                    .filter(|d| d.state.as_str() == "Rejected")
                    .map(move |d| (format!("{policy}/{}", d.name), d.message.clone()))
            })
            .collect()
    };
    assert_eq!(
        rejected(&p),
        rejected(&plan::plan(&before)),
        "rejections after convergence differ from the nodes' own"
    );
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn invariants_hold_over_random_histories((policies, steps) in history_gen()) {
        run_history(policies, steps);
    }
}

#[test]
fn mig_to_mps_goes_through_confirmed_all_disabled() {
    let mut w = World::new(
        vec![node("a100-0", "NVIDIA-A100-SXM4-80GB", true, Some("a"))],
        vec![policy("mig", 3, 2, false, Some("a"), 0, 0)],
    );
    // Converge on MIG.
    for _ in 0..3 {
        let p = plan::plan(&w.input());
        w.apply(&p);
        w.mig_manager();
    }
    assert_eq!(&w.nodes[0].labels[LABEL_MIG_CONFIG], "all-1g.10gb");
    assert!(w.nodes[0].labels[LABEL_DEVICE_PLUGIN_CONFIG].starts_with("mig-"));
    // Switch to MPS.
    w.policies = vec![policy("mps", 2, 4, false, Some("a"), 0, 0)];
    let p = plan::plan(&w.input());
    let labels = &p.node_labels["a100-0"];
    assert_eq!(
        labels[LABEL_MIG_CONFIG], MIG_DISABLED_LAYOUT,
        "first MIG off"
    );
    assert_eq!(
        labels[LABEL_DEVICE_PLUGIN_CONFIG], DEFAULT_KEY,
        "no sharing until MIG is off"
    );
    w.apply(&p);
    // Still pending: the plan does not move on.
    let p = plan::plan(&w.input());
    assert_eq!(
        p.node_labels["a100-0"][LABEL_DEVICE_PLUGIN_CONFIG],
        DEFAULT_KEY
    );
    assert_eq!(
        p.statuses["mps"]
            .conditions
            .iter()
            .find(|c| c.type_ == "Progressing")
            .unwrap()
            .status,
        "True"
    );
    // Confirmed: now MPS.
    w.mig_manager();
    let p = plan::plan(&w.input());
    assert!(p.node_labels["a100-0"][LABEL_DEVICE_PLUGIN_CONFIG].starts_with("mps-"));
    w.apply(&p);
    let p = plan::plan(&w.input());
    assert_eq!(
        p.statuses["mps"].applied_nodes, 0,
        "the device plugin still advertises the MIG devices"
    );
    w.now += 1;
    w.gfd();
    let p = plan::plan(&w.input());
    assert_eq!(
        p.statuses["mps"].applied_nodes, 1,
        "{:?}",
        p.statuses["mps"].node_details
    );
}

#[test]
fn overlapping_policies_priority_then_age_then_name() {
    let nodes = vec![node("h200-0", "NVIDIA-H200", false, Some("a"))];
    let low_old = policy("old", 1, 2, false, Some("a"), 0, 0);
    let low_new = policy("new", 1, 3, false, Some("a"), 0, 1);
    let high = policy("high", 2, 4, false, None, 5, 2);
    let p = plan::plan(&PlanInput::new(
        vec![low_new.clone(), low_old.clone()],
        nodes.clone(),
    ));
    assert_eq!(p.node_labels["h200-0"]["gpusharing.io/policy"], "old");
    let c = p.statuses["new"]
        .conditions
        .iter()
        .find(|c| c.type_ == "Conflicted")
        .unwrap();
    assert_eq!(c.status, "True");
    assert!(c.message.contains("h200-0 (won by old)"), "{}", c.message);
    assert_eq!(p.statuses["new"].conflicting_nodes, 1);
    let p = plan::plan(&PlanInput::new(vec![low_new, low_old, high], nodes));
    assert_eq!(p.node_labels["h200-0"]["gpusharing.io/policy"], "high");
    // A higher priority is an intended override, not a conflict.
    let cond = |name: &str, t: &str| {
        let c = p.statuses[name]
            .conditions
            .iter()
            .find(|c| c.type_ == t)
            .unwrap();
        (c.status.as_str(), c.reason.as_str(), c.message.clone())
    };
    let (status, reason, message) = cond("old", "Overridden");
    assert_eq!((status, reason), ("True", "HigherPriorityPolicy"));
    assert!(message.contains("h200-0 (overridden by high)"), "{message}");
    assert_eq!(cond("old", "Conflicted").0, "False");
    assert_eq!(p.statuses["old"].overridden_nodes, 1);
    assert_eq!(p.statuses["old"].conflicting_nodes, 0);
    assert_eq!(cond("high", "Overridden").0, "False");
}

#[test]
fn failed_mig_node_is_left_alone_and_degraded() {
    let mut n = node("a100-0", "NVIDIA-A100-SXM4-80GB", true, Some("a"));
    n.labels.insert(LABEL_MIG_CONFIG, "all-1g.10gb");
    n.labels.insert(LABEL_MIG_STATE, "failed");
    n.labels.insert(LABEL_DEVICE_PLUGIN_CONFIG, DEFAULT_KEY);
    n.owned = [
        LABEL_MIG_CONFIG.to_string(),
        LABEL_DEVICE_PLUGIN_CONFIG.to_string(),
    ]
    .into();
    let p = plan::plan(&PlanInput::new(
        vec![policy("mig", 3, 2, false, Some("a"), 0, 0)],
        vec![n.clone()],
    ));
    let want: BTreeMap<String, String> = n
        .owned
        .iter()
        .map(|k| (k.clone(), n.labels[k].to_string()))
        .collect();
    assert_eq!(
        p.node_labels["a100-0"], want,
        "nothing changes on a failed node"
    );
    let d = p.statuses["mig"]
        .conditions
        .iter()
        .find(|c| c.type_ == "Degraded")
        .unwrap();
    assert_eq!(
        (d.status.as_str(), d.reason.as_str()),
        ("True", "MigConfigFailed")
    );
}

#[test]
fn busy_gpus_block_mig_changes() {
    let n = node("a100-0", "NVIDIA-A100-SXM4-80GB", true, Some("a"));
    let busy = |i: &mut PlanInput| i.nodes[0].gpu_pods = vec!["default/train-0".to_string()];
    let mut input = PlanInput::new(vec![policy("mig", 3, 2, false, Some("a"), 0, 0)], vec![n]);
    busy(&mut input);
    let p = plan::plan(&input);
    assert!(p.node_labels["a100-0"].is_empty(), "{:?}", p.node_labels);
    let c = p.statuses["mig"]
        .conditions
        .iter()
        .find(|c| c.type_ == "Progressing")
        .unwrap();
    assert_eq!(c.reason, "WaitingForIdleGPUs");
    assert!(c.message.contains("default/train-0"));
    let s = &p.statuses["mig"];
    assert_eq!(
        s.node_details[0].reason,
        Some(gpu_sharing_operator::api::state::HoldReason::WaitingForIdleGPUs)
    );
    assert_eq!(
        s.held_nodes,
        [(
            gpu_sharing_operator::api::state::HoldReason::WaitingForIdleGPUs,
            1
        )]
        .into()
    );
    // Opting in proceeds.
    let n = node("a100-0", "NVIDIA-A100-SXM4-80GB", true, Some("a"));
    let mut p = policy("mig", 3, 2, false, Some("a"), 0, 0);
    p.spec.mig.as_mut().unwrap().proceed_with_busy_gpus = true;
    let mut input = PlanInput::new(vec![p], vec![n]);
    busy(&mut input);
    let plan = plan::plan(&input);
    assert_eq!(plan.node_labels["a100-0"][LABEL_MIG_CONFIG], "all-1g.10gb");
}

#[test]
fn invalid_policy_changes_nothing_on_its_nodes() {
    let mut n = node("h200-0", "NVIDIA-H200", false, Some("a"));
    n.labels.insert(LABEL_DEVICE_PLUGIN_CONFIG, "old-12345678");
    n.owned = [LABEL_DEVICE_PLUGIN_CONFIG.to_string()].into();
    let mut bad = policy("bad", 2, 4, false, Some("a"), 0, 0);
    bad.spec.mps.as_mut().unwrap().replicas = 1;
    let mut input = PlanInput::new(vec![bad], vec![n]);
    input
        .cluster
        .current_device_config
        .insert("old-12345678".into(), "version: v1\n".into());
    let p = plan::plan(&input);
    assert_eq!(
        p.node_labels["h200-0"][LABEL_DEVICE_PLUGIN_CONFIG],
        "old-12345678"
    );
    assert!(
        p.device_config.contains_key("old-12345678"),
        "a key in use is kept"
    );
    let a = p.statuses["bad"]
        .conditions
        .iter()
        .find(|c| c.type_ == "Accepted")
        .unwrap();
    assert_eq!(
        (a.status.as_str(), a.reason.as_str()),
        ("False", "InvalidSpec")
    );
    assert!(a.message.contains("spec.mps.replicas"), "{}", a.message);
}

#[test]
fn mixed_mig_blocks_mps_cluster_wide() {
    let nodes = vec![
        node("a100-0", "NVIDIA-A100-SXM4-80GB", true, Some("a")),
        node("h200-0", "NVIDIA-H200", false, Some("b")),
    ];
    let p = plan::plan(&PlanInput::new(
        vec![
            policy("mig", 4, 2, true, Some("a"), 1, 0),
            policy("mps", 2, 4, false, Some("b"), 0, 0),
        ],
        nodes,
    ));
    let a = p.statuses["mps"]
        .conditions
        .iter()
        .find(|c| c.type_ == "Accepted")
        .unwrap();
    assert_eq!(a.reason, "ClusterWideConflict");
    assert!(p.node_labels["h200-0"].is_empty());
    assert_eq!(p.cluster_policy_spec["mig"]["strategy"], "mixed");
}

#[test]
fn shared_product_suffix_keeps_nodes_selected() {
    // GFD appends -SHARED (and -MIG-<profile> with MIG single) to the product once shared.
    let sel = LabelSelector {
        match_labels: Some(
            [(
                "nvidia.com/gpu.product".to_string(),
                "NVIDIA-H200".to_string(),
            )]
            .into(),
        ),
        ..Default::default()
    };
    for product in [
        "NVIDIA-H200",
        "NVIDIA-H200-SHARED",
        "NVIDIA-H200-MIG-1g.18gb",
        "NVIDIA-H200-MIG-1g.18gb-SHARED",
    ] {
        let mut n = node("h", "NVIDIA-H200", false, None);
        n.labels.insert("nvidia.com/gpu.product", product);
        assert!(
            plan::selector_matches(&sel, &plan::selection_labels(&n.labels)),
            "{product}"
        );
    }
    let mut n = node("h", "NVIDIA-H200", false, None);
    n.labels.insert("nvidia.com/gpu.product", "NVIDIA-H200-NVL");
    assert!(!plan::selector_matches(
        &sel,
        &plan::selection_labels(&n.labels)
    ));
}

#[test]
fn selectors_on_labels_sharing_changes_are_refused() {
    let mut p = policy("flappy", 1, 4, false, None, 0, 0);
    p.spec.node_selector.match_labels =
        Some([("nvidia.com/gpu.replicas".to_string(), "1".to_string())].into());
    let (errs, _) = gpu_sharing_operator::validate::validate("flappy", &p.spec);
    assert!(
        errs.iter()
            .any(|e| e.path == "spec.nodeSelector.matchLabels"
                && e.message.contains("nvidia.com/gpu.replicas")),
        "{errs:?}"
    );
}

#[test]
fn mig_pending_past_the_timeout_is_degraded_and_left_alone() {
    let mut n = node("a100-0", "NVIDIA-A100-SXM4-80GB", true, Some("a"));
    n.labels.insert(LABEL_MIG_CONFIG, "all-1g.10gb");
    n.labels.insert(LABEL_MIG_STATE, "pending");
    n.owned = [LABEL_MIG_CONFIG.to_string(), LABEL_MIG_STATE.to_string()].into();
    let mut input = PlanInput::new(
        vec![policy("mig", 3, 2, false, Some("a"), 0, 0)],
        vec![n.clone()],
    );
    input.cluster.base_mig_configs = Some(base_layouts());
    let before = plan::plan(&input);
    assert_eq!(
        before.statuses["mig"]
            .conditions
            .iter()
            .find(|c| c.type_ == "Degraded")
            .unwrap()
            .status,
        "False"
    );
    input.node_mut("a100-0").unwrap().mig_stuck = true;
    let after = plan::plan(&input);
    let d = after.statuses["mig"]
        .conditions
        .iter()
        .find(|c| c.type_ == "Degraded")
        .unwrap();
    assert_eq!(
        (d.status.as_str(), d.reason.as_str()),
        ("True", "MigConfigFailed")
    );
    let held: BTreeMap<String, String> = n
        .owned
        .iter()
        .map(|k| (k.clone(), n.labels[k].to_string()))
        .collect();
    assert_eq!(after.node_labels["a100-0"], held);
}

#[test]
fn node_labels_behave_like_a_sorted_map() {
    let mut l: Labels = [("b", "1"), ("a", "2"), ("b", "3")].into_iter().collect();
    // A repeated key keeps its last value; iteration is in key order.
    assert_eq!(l.iter().collect::<Vec<_>>(), [("a", "2"), ("b", "3")]);
    l.insert("c", "4");
    l.insert("a", "5");
    assert_eq!(l.get("a"), Some("5"));
    assert_eq!(l.remove("b").as_deref(), Some("3"));
    assert_eq!(l.remove("zz"), None);
    l.extend([("d", "6")]);
    assert_eq!(format!("{l:?}"), r#"{"a": "5", "c": "4", "d": "6"}"#);
    let from_map: Labels = BTreeMap::from([("c".to_string(), "4".to_string())]).into();
    assert!(from_map.contains_key("c") && !from_map.contains_key("a"));
}

fn condition<'a>(p: &'a Plan, policy: &str, type_: &str) -> (&'a str, &'a str, &'a str) {
    let c = p.statuses[policy]
        .conditions
        .iter()
        .find(|c| c.type_ == type_)
        .unwrap();
    (c.status.as_str(), c.reason.as_str(), c.message.as_str())
}

impl World {
    /// Applies plans and lets the MIG manager and GFD answer, a few rounds.
    fn converge(&mut self) -> Plan {
        for _ in 0..12 {
            let p = plan::plan(&self.input());
            self.apply(&p);
            self.now += 1;
            self.check_invariants();
            self.mig_manager();
            self.gfd();
            self.check_invariants();
        }
        plan::plan(&self.input())
    }
}

#[test]
fn edited_custom_layout_gets_a_new_name_and_reaches_the_node() {
    let mut w = World::new(
        vec![node("a100-0", "NVIDIA-A100-SXM4-80GB", true, Some("a"))],
        vec![policy("split", 4, 2, false, Some("a"), 0, 0)],
    );
    let p = w.converge();
    let old = p.statuses["split"].mig_config.clone().unwrap();
    assert!(old.starts_with("custom-split-") && old.len() == "custom-split-".len() + 8);
    assert_eq!(&w.nodes[0].labels[LABEL_MIG_CONFIG], old.as_str());
    assert_eq!(condition(&p, "split", "Ready").0, "True");

    // Edit the layout (1g.10gb: 3 -> 1 per GPU of the first group).
    w.policies = vec![policy("split", 4, 3, false, Some("a"), 0, 0)];
    let p = plan::plan(&w.input());
    let new = p.statuses["split"].mig_config.clone().unwrap();
    assert_ne!(new, old, "new content, new name");
    assert_eq!(p.node_labels["a100-0"][LABEL_MIG_CONFIG], new);
    assert_eq!(p.node_labels["a100-0"][LABEL_MIG_STATE], "pending");
    // Both layouts are in the config while the node's label still names the old one.
    let layouts =
        gpu_sharing_operator::nvidia::parse_mig_configs(p.mig_config.as_ref().unwrap()).unwrap();
    assert!(layouts.contains_key(&old) && layouts.contains_key(&new));
    w.apply(&p);
    // Not Ready until the MIG manager confirms the new name.
    let p = plan::plan(&w.input());
    assert_eq!(condition(&p, "split", "Ready").0, "False");
    assert_eq!(p.statuses["split"].applied_nodes, 0);
    w.mig_manager();
    let p = w.converge();
    assert_eq!(
        condition(&p, "split", "Ready").0,
        "True",
        "{:?} {:?}",
        p.statuses["split"].node_details,
        w.nodes[0].labels
    );
    let layouts =
        gpu_sharing_operator::nvidia::parse_mig_configs(p.mig_config.as_ref().unwrap()).unwrap();
    assert!(
        !layouts.contains_key(&old),
        "the old layout goes once no node names it"
    );
}

#[test]
fn a_node_on_the_pre_upgrade_custom_name_keeps_it_only_while_the_content_is_the_same() {
    let pol = policy("split", 4, 2, false, Some("a"), 0, 0);
    let entries =
        gpu_sharing_operator::nvidia::custom_layout_entries(pol.spec.mig.as_ref().unwrap());
    let same = serde_json::to_value(&entries).unwrap();
    let mut n = node("a100-0", "NVIDIA-A100-SXM4-80GB", true, Some("a"));
    // What the previous version left: custom-<policy>, confirmed, and its device-plugin key.
    let key = plan::plan(&PlanInput::new(vec![pol.clone()], vec![])).statuses["split"]
        .device_config_key
        .clone()
        .unwrap();
    n.labels.insert(LABEL_MIG_CONFIG, "custom-split");
    n.labels.insert(LABEL_MIG_STATE, "success");
    n.labels.insert(LABEL_DEVICE_PLUGIN_CONFIG, key.as_str());
    n.labels.insert("gpusharing.io/policy", "split");
    n.owned = [
        LABEL_MIG_CONFIG,
        LABEL_DEVICE_PLUGIN_CONFIG,
        "gpusharing.io/policy",
    ]
    .map(String::from)
    .into();
    // The device plugin advertises what the applied layout holds: GPUs 0-3 with
    // {1g.10gb: 3, 2g.20gb: 2} each, GPUs 4-7 whole.
    n.allocatable.insert("nvidia.com/gpu", "4");
    n.allocatable.insert("nvidia.com/mig-1g.10gb", "12");
    n.allocatable.insert("nvidia.com/mig-2g.20gb", "8");
    let mut w = World::new(vec![n], vec![pol]);
    w.mig_config.insert("custom-split".into(), same);
    let p = plan::plan(&w.input());
    assert_eq!(
        p.node_labels["a100-0"][LABEL_MIG_CONFIG], "custom-split",
        "same content: no MIG reconfiguration for a new name"
    );
    assert!(!p.node_labels["a100-0"].contains_key(LABEL_MIG_STATE));
    assert_eq!(
        p.statuses["split"].applied_nodes, 1,
        "{:?} {:?}",
        p.statuses["split"].node_details, w.nodes[0].allocatable
    );
    let layouts =
        gpu_sharing_operator::nvidia::parse_mig_configs(p.mig_config.as_ref().unwrap()).unwrap();
    assert!(
        layouts.contains_key("custom-split"),
        "kept while a node names it"
    );

    // Different content under the old name: a normal, visible layout change to the new name.
    w.mig_config.insert(
        "custom-split".into(),
        gpu_sharing_operator::api::yaml::from_str(
            "[{devices: all, mig-enabled: true, mig-devices: {1g.10gb: 7}}]",
        )
        .unwrap(),
    );
    let p = plan::plan(&w.input());
    let new = p.statuses["split"].mig_config.clone().unwrap();
    assert_eq!(p.node_labels["a100-0"][LABEL_MIG_CONFIG], new);
    assert_eq!(p.node_labels["a100-0"][LABEL_MIG_STATE], "pending");
    assert_eq!(p.statuses["split"].applied_nodes, 0);
}

#[test]
fn a_named_layout_whose_content_changed_is_reported_and_reapplied_on_request() {
    let mut w = World::new(
        vec![node("a100-0", "NVIDIA-A100-SXM4-80GB", true, Some("a"))],
        vec![policy("mig", 3, 2, false, Some("a"), 0, 0)],
    );
    let p = w.converge();
    assert_eq!(condition(&p, "mig", "Ready").0, "True");
    let recorded = w.nodes[0].annotations[names::ANNOTATION_MIG_LAYOUT].to_string();
    assert!(recorded.starts_with("all-1g.10gb@"), "{recorded}");

    // A GPU Operator upgrade changes what all-1g.10gb means.
    w.base.insert(
        "all-1g.10gb".into(),
        gpu_sharing_operator::api::yaml::from_str(
            "[{devices: all, mig-enabled: true, mig-devices: {1g.10gb: 6}}]",
        )
        .unwrap(),
    );
    let p = plan::plan(&w.input());
    let (status, reason, message) = condition(&p, "mig", "Degraded");
    assert_eq!((status, reason), ("True", "MigLayoutChanged"));
    assert!(
        message.contains("a100-0") && message.contains("all-1g.10gb"),
        "{message}"
    );
    assert!(message.contains(names::ANNOTATION_REAPPLY_MIG), "{message}");
    assert_eq!(condition(&p, "mig", "Ready").0, "False");
    let held = p.node_labels["a100-0"].clone();
    w.apply(&p);
    assert_eq!(
        plan::plan(&w.input()).node_labels["a100-0"],
        held,
        "nothing moves unasked"
    );

    // The admin asks for a re-apply: sharing off, all-disabled confirmed, then the layout again.
    w.policies[0]
        .metadata
        .annotations
        .get_or_insert_default()
        .insert(names::ANNOTATION_REAPPLY_MIG.into(), "true".into());
    let mut seen_disabled = false;
    for _ in 0..16 {
        let p = plan::plan(&w.input());
        w.apply_within_budget(&p);
        w.check_invariants();
        if w.nodes[0].labels.get(LABEL_MIG_CONFIG) == Some(MIG_DISABLED_LAYOUT) {
            seen_disabled = true;
            // Not back to the layout before all-disabled is confirmed.
            assert_eq!(
                plan::plan(&w.input()).node_labels["a100-0"][LABEL_MIG_CONFIG],
                MIG_DISABLED_LAYOUT
            );
        }
        w.mig_manager();
        w.gfd();
    }
    assert!(seen_disabled, "re-applied through all-disabled");
    let p = plan::plan(&w.input());
    assert_eq!(condition(&p, "mig", "Ready").0, "True");
    assert_eq!(condition(&p, "mig", "Degraded").0, "False");
    assert_ne!(
        w.nodes[0].annotations[names::ANNOTATION_MIG_LAYOUT],
        *recorded
    );
}

#[test]
fn a_device_plugin_config_counts_only_once_gfd_reported_after_our_write() {
    let mut n = node("h200-0", "NVIDIA-H200", false, Some("a"));
    n.labels.insert(names::LABEL_GFD_TIMESTAMP, "1799999000");
    let mut w = World::new(vec![n], vec![policy("mps", 2, 4, false, Some("a"), 0, 0)]);
    let p = plan::plan(&w.input());
    assert_eq!(
        p.node_annotations["h200-0"][names::ANNOTATION_CONFIG_WRITTEN],
        w.now.to_string()
    );
    w.apply(&p);
    w.advertise();
    let p = plan::plan(&w.input());
    assert_eq!(
        p.statuses["mps"].applied_nodes, 0,
        "GFD has not relabelled yet"
    );
    assert!(
        p.statuses["mps"].node_details[0]
            .message
            .contains("gfd.timestamp")
    );
    // GFD relabels in the same second as our write: not proof it saw the new config.
    w.nodes[0]
        .labels
        .insert(names::LABEL_GFD_TIMESTAMP, w.now.to_string());
    assert_eq!(plan::plan(&w.input()).statuses["mps"].applied_nodes, 0);
    w.nodes[0]
        .labels
        .insert(names::LABEL_GFD_TIMESTAMP, (w.now + 1).to_string());
    w.now += 60;
    let p = plan::plan(&w.input());
    assert_eq!(p.statuses["mps"].applied_nodes, 1);
    assert_eq!(condition(&p, "mps", "Ready").0, "True");
    // The write time stays as long as the label does (no write at rest).
    assert_eq!(p.node_annotations, plan::plan(&w.input()).node_annotations);
    assert_eq!(
        p.node_annotations["h200-0"][names::ANNOTATION_CONFIG_WRITTEN],
        (w.now - 60).to_string()
    );
}

/// A node without a device-plugin config label already runs the default (whole GPUs): a DRA
/// policy labelling it `default` (the device plugin shares nothing there) changes nothing GPU
/// Feature Discovery would report, so it is not a change to wait for (GFD relabels only on its
/// next period, 60 s by default). A node that ran a sharing config does wait for GFD.
#[test]
fn default_on_a_node_without_a_config_label_needs_no_gfd_report() {
    let dra: GpuSharingPolicy =
        gpu_sharing_operator::api::yaml::from_str(include_str!("../examples/dra-mps.yaml"))
            .unwrap();
    let name = dra.metadata.name.clone().unwrap();
    let mut nodes = Vec::new();
    for (n, label) in [("h200-0", None), ("h200-1", Some("someone-else-4x"))] {
        let mut f = node(n, "NVIDIA-H200", false, None);
        f.labels.insert("gpusharing.io/profile", "dra");
        f.labels.insert(names::LABEL_GFD_TIMESTAMP, "1799999000");
        f.labels.insert(names::LABEL_GPU_REPLICAS, "1");
        if let Some(l) = label {
            f.labels.insert(LABEL_DEVICE_PLUGIN_CONFIG, l);
        }
        nodes.push(f);
    }
    let mut w = World::new(nodes, vec![dra]);
    w.now = 1_800_000_000;
    let mut p = plan::plan(&w.input());
    for _ in 0..4 {
        w.apply(&p);
        p = plan::plan(&w.input());
    }
    for n in ["h200-0", "h200-1"] {
        assert_eq!(p.node_labels[n][LABEL_DEVICE_PLUGIN_CONFIG], DEFAULT_KEY);
    }
    assert!(
        !p.node_annotations["h200-0"].contains_key(names::ANNOTATION_CONFIG_WRITTEN),
        "{:?}",
        p.node_annotations["h200-0"]
    );
    assert_eq!(
        p.node_annotations["h200-1"][names::ANNOTATION_CONFIG_WRITTEN],
        w.now.to_string()
    );
    let details: BTreeMap<_, _> = p.statuses[&name]
        .node_details
        .iter()
        .map(|d| (d.name.clone(), d.message.clone()))
        .collect();
    assert_eq!(p.statuses[&name].applied_nodes, 1, "{details:?}");
    assert!(details["h200-1"].contains("gfd.timestamp"), "{details:?}");
}

#[test]
fn nodes_labelled_before_the_write_time_existed_need_no_write() {
    let pol = policy("mps", 2, 4, false, Some("a"), 0, 0);
    let key = plan::plan(&PlanInput::new(vec![pol.clone()], vec![])).statuses["mps"]
        .device_config_key
        .clone()
        .unwrap();
    let mut n = node("h200-0", "NVIDIA-H200", false, Some("a"));
    n.labels.insert(names::LABEL_GFD_TIMESTAMP, "1700000000");
    n.labels.insert(LABEL_DEVICE_PLUGIN_CONFIG, key.as_str());
    n.labels.insert("gpusharing.io/policy", "mps");
    n.owned = [LABEL_DEVICE_PLUGIN_CONFIG, "gpusharing.io/policy"]
        .map(String::from)
        .into();
    // The device plugin advertises 8 GPUs x 4 MPS clients.
    n.allocatable.insert("nvidia.com/gpu", "32");
    let w = World::new(vec![n], vec![pol]);
    let p = plan::plan(&w.input());
    assert!(p.node_annotations["h200-0"].is_empty());
    assert_eq!(p.statuses["mps"].applied_nodes, 1);
}

#[test]
fn drain_mode_cordons_evicts_but_never_protected_pods_and_lifts_only_its_cordon() {
    use gpu_sharing_operator::api::crd::{Disruption, DisruptionMode};
    let mut p = policy("mig", 3, 2, false, Some("a"), 0, 0);
    let never = LabelSelector {
        match_labels: Some([("keep".to_string(), "yes".to_string())].into()),
        ..Default::default()
    };
    p.spec.disruption = Some(Disruption {
        mode: DisruptionMode::Drain,
        drain_timeout_seconds: None,
        never_evict: Some(never),
    });
    let mut w = World::new(
        vec![node("a100-0", "NVIDIA-A100-SXM4-80GB", true, Some("a"))],
        vec![p],
    );
    w.gfd();
    let pods = vec!["default/train-0".to_string(), "default/keep-0".to_string()];
    let input = |w: &World, pods: &[String]| {
        let mut i = w.input();
        let v = i.node_mut("a100-0").unwrap();
        v.gpu_pods = pods.to_vec();
        let keep = GpuPod {
            labels: [("keep", "yes")].into_iter().collect::<Labels>(),
            priority: 0,
            started: 0,
        };
        v.gpu_pod_details = [("default/keep-0".to_string(), keep)].into();
        i
    };
    // Busy: cordoned and drained instead of waiting; the protected pod is not evicted.
    let p1 = plan::plan(&input(&w, &pods));
    let d = &p1.drains["a100-0"];
    assert_eq!(d.evict, ["default/train-0"]);
    assert_eq!(d.protected, ["default/keep-0"]);
    assert_eq!(
        p1.node_annotations["a100-0"][names::ANNOTATION_CORDONED],
        "true"
    );
    assert!(
        !p1.node_labels["a100-0"].contains_key(LABEL_MIG_CONFIG),
        "no change while busy"
    );
    let (_, reason, msg) = condition(&p1, "mig", "Progressing");
    assert_eq!(reason, "Draining");
    assert!(
        msg.contains("neverEvict") && msg.contains("default/keep-0"),
        "{msg}"
    );
    w.apply(&p1);
    // Idle: the layout changes; the cordon stays until the MIG manager confirms.
    let p2 = plan::plan(&input(&w, &[]));
    assert!(p2.drains.is_empty());
    assert_eq!(
        p2.node_annotations["a100-0"][names::ANNOTATION_CORDONED],
        "true"
    );
    w.apply(&p2);
    w.mig_manager();
    w.gfd();
    let done = w.converge();
    assert_eq!(done.node_labels["a100-0"][LABEL_MIG_CONFIG], "all-1g.10gb");
    assert!(
        !done.node_annotations["a100-0"].contains_key(names::ANNOTATION_CORDONED),
        "our cordon is lifted once confirmed"
    );
}

/// Found by the random histories in CI: every node on a time-sliced MIG layout, then every node
/// exclusive. The A100 that waited for its turn was labelled `default` (no sharing while MIG
/// was pending) and so reloaded nothing when it got the label: once the MIG manager confirmed
/// it, it counts as available and the other A100 may go. The model had counted the `default`
/// label on an unlabelled node as a reload waiting for GFD.
#[test]
fn mig_to_exclusive_keeps_the_budget() {
    let g = |kind| plain(kind, 0);
    run_history(
        vec![g(3)],
        vec![
            Step::Apply,
            Step::Gfd,
            Step::Apply,
            Step::MigManager,
            Step::Policies(vec![g(0)]),
            Step::Apply,
        ],
    );
}

// Disagreements between the operator and NVIDIA's components found by the model (issue 26,
// item 5). Each is a minimal case; they fail until the operator is fixed.

/// MIG with time-slicing and the `mixed` strategy: the device plugin config time-slices
/// `nvidia.com/mig-1g.10gb`, so GPU Feature Discovery reports the replicas under
/// `nvidia.com/mig-1g.10gb.replicas`; `nvidia.com/gpu.replicas` is 0 on MIG-enabled GPUs (GFD
/// labels them without sharing). The operator waits for `nvidia.com/gpu.replicas=2` forever.
#[test]
fn time_sliced_mixed_mig_is_confirmed_by_gfd() {
    let mut w = World::new(
        vec![node("a100-0", "NVIDIA-A100-SXM4-80GB", true, Some("a"))],
        vec![policy("mig", 3, 2, true, Some("a"), 0, 0)],
    );
    let p = w.converge();
    let labels = &w.nodes[0].labels;
    assert_eq!(labels.get("nvidia.com/mig-1g.10gb.replicas"), Some("2"));
    assert_eq!(labels.get("nvidia.com/gpu.replicas"), Some("0"));
    assert_eq!(
        condition(&p, "mig", "Ready").0,
        "True",
        "{:?}",
        p.statuses["mig"].node_details
    );
}

/// The cluster-wide MIG strategy reaches every node's device plugin (the GPU Operator sets
/// `MIG_STRATEGY` from `ClusterPolicy.spec.mig.strategy`, and it overrides the config file's
/// `flags.migStrategy`): a MIG policy with `mixed` on one node makes the device plugin of a node
/// still running an MPS config exit (`using --mig-strategy=mixed is not supported with MPS`).
/// The operator marks the MPS policy not accepted and leaves its node as it was.
#[test]
fn a_mixed_mig_policy_does_not_break_a_running_mps_node() {
    let mut w = World::new(
        vec![
            node("a100-0", "NVIDIA-A100-SXM4-80GB", true, Some("a")),
            node("h200-0", "NVIDIA-H200", false, Some("b")),
        ],
        vec![policy("mps", 2, 4, false, Some("b"), 0, 0)],
    );
    let p = w.converge();
    assert_eq!(condition(&p, "mps", "Ready").0, "True");
    w.policies.push(policy("mig", 3, 2, true, Some("a"), 0, 5));
    // Panics in the invariants: h200-0's device plugin refuses its config.
    w.converge();
}

/// A `mixed` MIG policy that selects no node (say a dynamic one whose nodes are not there yet)
/// does not set the cluster-wide MIG strategy while an MPS policy governs nodes: the MPS node
/// stays on MPS, and the MIG policy says why it waits. Once it governs a node, it wins.
#[test]
fn a_mixed_mig_policy_without_nodes_leaves_running_mps_alone() {
    let mut w = World::new(
        vec![
            node("a100-0", "NVIDIA-A100-SXM4-80GB", true, None),
            node("h200-0", "NVIDIA-H200", false, Some("b")),
        ],
        vec![
            policy("mps", 2, 4, false, Some("b"), 0, 0),
            policy("mig", 3, 2, true, Some("a"), 0, 5),
        ],
    );
    let p = w.converge();
    assert_eq!(condition(&p, "mps", "Ready").0, "True");
    assert_ne!(
        p.cluster_policy_spec.pointer("/mig/strategy"),
        Some(&serde_json::json!("mixed")),
        "{}",
        p.cluster_policy_spec
    );
    let why = &p.statuses["mig"].warnings;
    assert!(
        format!("{why:?}").contains("the nodes of MPS policy mps are switched off MPS"),
        "{why:?}"
    );
}

/// From a custom (mixed) layout to a named layout under the `single` strategy: the ClusterPolicy
/// switches to `single` at once, and GFD labels a node whose GPUs are not all split alike
/// `<product>-MIG-INVALID` with `count`, `replicas` and `memory` 0. The operator reads that
/// memory as the GPU's and rejects the node ("MIG profile 1g.10gb does not exist ... (0 MiB per
/// GPU)"), so it never leaves the custom layout.
#[test]
fn a_node_leaves_a_custom_layout_for_a_single_strategy_layout() {
    let mut w = World::new(
        vec![node("a100-0", "NVIDIA-A100-SXM4-80GB", true, Some("a"))],
        vec![policy("split", 4, 2, true, Some("a"), 0, 0)],
    );
    let p = w.converge();
    assert_eq!(condition(&p, "split", "Ready").0, "True");
    w.policies = vec![policy("single", 3, 2, false, Some("a"), 0, 0)];
    let p = w.converge();
    assert_eq!(
        condition(&p, "single", "Ready").0,
        "True",
        "{:?} {:?}",
        p.statuses["single"].node_details,
        w.nodes[0].labels
    );
}

/// A node whose plan stamps the time of its config change is planned again in the next pass,
/// even when nothing about it changed: queued while `--pause-rollouts` was on, it is stamped
/// with the time of the pass that starts it, as planning from scratch does.
#[test]
fn incremental_planning_stamps_a_node_queued_while_time_passed_with_the_new_time() {
    let n = node("h200-0", "NVIDIA-H200", false, Some("a"));
    let mut input = PlanInput::new(vec![policy("ts", 1, 4, false, Some("a"), 0, 0)], vec![n]);
    input.cluster.now = 1_800_000_000;
    input.settings.pause_rollouts = true;
    let mut planner = plan::Planner::default();
    let paused = planner.plan(&input);
    assert_eq!(paused, plan::plan(&input));
    assert!(paused.node_labels["h200-0"].is_empty(), "{paused:?}");
    // Ten seconds later the rollout resumes; the node itself did not change.
    input.cluster.now += 10;
    input.settings.pause_rollouts = false;
    let resumed = planner.plan(&input);
    assert_eq!(resumed, plan::plan(&input));
    assert_eq!(
        resumed.node_annotations["h200-0"][names::ANNOTATION_CONFIG_WRITTEN],
        "1800000010"
    );
    assert_eq!(planner.last_replanned(), 1);
    // At rest (the write applied, GFD relabelled), nothing is planned again.
    let mut done = input.clone();
    gpu_sharing_operator::converge::apply(&mut done, &resumed);
    let first = planner.plan(&done);
    assert_eq!(first, plan::plan(&done));
    done.cluster.now += 10;
    let again = planner.plan(&done);
    assert_eq!(again, plan::plan(&done));
    assert_eq!(
        planner.last_replanned(),
        0,
        "a node at rest is not planned again"
    );
}

/// Boots NVIDIA's components and runs passes of the incremental planner (each checked against
/// planning from scratch), applying them and letting NVIDIA's components answer, until the
/// first node of `policy` is `Applied`; then one more pass, which plans no node again.
fn at_rest(w: &mut World, planner: &mut plan::Planner, policy: &str) -> Plan {
    w.boot();
    let state = |p: &Plan| p.statuses[policy].node_details[0].state;
    for _ in 0..10 {
        let p = planner.plan(&w.input());
        assert_eq!(p, plan::plan(&w.input()));
        if state(&p) == NodeState::Applied {
            break;
        }
        w.apply_within_budget(&p);
        w.mig_manager();
        w.gfd();
    }
    let rest = planner.plan(&w.input());
    assert_eq!(state(&rest), NodeState::Applied);
    assert_eq!(planner.last_replanned(), 0);
    rest
}

/// Cluster-wide inputs count too: when the GPU Operator's named layout changes content, the
/// incremental planner re-plans the nodes under it (`Stale`), as planning from scratch does.
#[test]
fn incremental_planning_follows_a_named_layout_changed_under_a_node_at_rest() {
    let mut w = World::new(
        vec![node("a100-0", "NVIDIA-A100-SXM4-80GB", true, Some("a"))],
        vec![policy("mig", 3, 2, true, Some("a"), 0, 0)],
    );
    let mut planner = plan::Planner::default();
    let state = |p: &Plan| p.statuses["mig"].node_details[0].state;
    at_rest(&mut w, &mut planner, "mig");
    // The GPU Operator's default config now says 6 instances per GPU for the same name.
    w.base.insert(
        "all-1g.10gb".into(),
        gpu_sharing_operator::api::yaml::from_str(
            "[{devices: all, mig-enabled: true, mig-devices: {1g.10gb: 6}}]",
        )
        .unwrap(),
    );
    let changed = planner.plan(&w.input());
    assert_eq!(changed, plan::plan(&w.input()));
    assert_eq!(state(&changed), NodeState::Stale);
}

/// NVIDIA's vGPU Device Manager config is a cluster-wide input too: a VM node at rest is planned
/// again when the named vGPU type's entry changes (fewer devices per GPU: its capacity; more
/// than the GPU holds: refused), as planning from scratch does. The node's own facts do not
/// change, so only the memo key can tell.
#[test]
fn incremental_planning_follows_the_vgpu_device_managers_config() {
    let mut w = World::new(
        vec![node("a100-0", "NVIDIA-A100-SXM4-80GB", true, Some("a"))],
        vec![policy("vdi", 6, 2, false, Some("a"), 0, 0)],
    );
    let mut planner = plan::Planner::default();
    let detail = |p: &Plan| p.statuses["vdi"].node_details[0].clone();
    let rest = at_rest(&mut w, &mut planner, "vdi");
    let with_entry = |count: i64| {
        let mut i = w.input();
        let mut base = (*i.cluster.base_vgpu_configs).clone();
        base.insert(
            "A100D-1-10C".into(),
            serde_json::json!([{"devices": "all", "vgpu-devices": {"A100D-1-10C": count}}]),
        );
        i.cluster.base_vgpu_configs = std::sync::Arc::new(base);
        i
    };
    // Four devices per GPU instead of seven: what the node offers changes.
    let fewer = with_entry(4);
    let changed = planner.plan(&fewer);
    assert_eq!(changed, plan::plan(&fewer));
    let replicas = |p: &Plan| {
        p.statuses["vdi"]
            .capacity
            .as_ref()
            .unwrap()
            .schedulable_replicas
    };
    assert_eq!((replicas(&rest), replicas(&changed)), (56, 32));
    // Eight: more than an A100 80GB holds of the type.
    let over = with_entry(8);
    let refused = planner.plan(&over);
    assert_eq!(refused, plan::plan(&over));
    assert_eq!(detail(&refused).state, NodeState::Rejected);
    assert!(
        detail(&refused)
            .message
            .contains("8 MIG compute slices per GPU"),
        "{:?}",
        detail(&refused)
    );
}

// Found by the histories about demand (issue 40, item 4): each is the shrunk input of a failure
// of `invariants_hold_over_random_histories`, kept as a regression test of its fix.

/// A dynamic policy of the highest priority, as histories about demand start with.
fn dynamic_first(profile: Option<usize>, d: DynGen) -> PolicyGen {
    PolicyGen {
        kind: 3,
        replicas: 2,
        mixed: true,
        profile,
        priority: 3,
        age: 0,
        dynamic: Some(d),
    }
}

/// A policy of kind `kind` (see [`spec_of`]) on every node, `single` where it is MIG, of
/// priority `priority`, not dynamic.
fn plain(kind: u8, priority: i32) -> PolicyGen {
    PolicyGen {
        kind,
        replicas: 2,
        mixed: false,
        profile: None,
        priority,
        age: 0,
        dynamic: None,
    }
}

/// Own layout `own` of [`OWN_LAYOUTS`], catalogue `layouts` of [`CATALOGUE`]; no delays, idle
/// time, lifetime, fence or busy nodes.
fn catalogue_of(own: usize, layouts: &[usize]) -> DynGen {
    DynGen {
        prefer_busy: false,
        own,
        layouts: layouts.to_vec(),
        quiet: 0,
        max_delay: 0,
        idle: 0,
        lifetime: 0,
        namespaces: None,
        busy: BusyGen::Wait,
        time_slicing: false,
    }
}

/// One pending pod of namespace `ml` asking for one instance of profile `profile` of
/// [`POD_PROFILES`].
fn pod_of(profile: usize) -> Step {
    Step::Arrive(PodGen {
        profile,
        count: 1,
        namespace: 0,
        priority: 0,
        selector: 0,
        burst: 1,
    })
}

/// Two rounds of writes and NVIDIA's answers, as histories about demand start with.
fn settled(then: Vec<Step>) -> Vec<Step> {
    let round = [
        Step::Apply,
        Step::MigManager,
        Step::Gfd,
        Step::Apply,
        Step::Gfd,
    ];
    round.iter().chain(&round).cloned().chain(then).collect()
}

/// [`settled`], then two GPU pods start on the first A100 and the controller sees them.
fn settled_busy(then: Vec<Step>) -> Vec<Step> {
    let busy = [Step::Start(0, 0), Step::Start(0, 0), Step::Apply];
    settled(busy.into_iter().chain(then).collect())
}

/// A node reserved for demand (cordoned, waiting for its pod) whose policy is then edited to
/// a layout its GPUs cannot take (an H200 layout on an A100) is refused by it: nothing of the
/// policy goes on there, so the reservation's cordon goes. It stayed for good.
#[test]
fn a_reservation_on_a_node_its_policy_now_refuses_is_uncordoned() {
    let reserve = |own, layouts: &[usize], busy| DynGen {
        prefer_busy: false,
        busy,
        lifetime: 60,
        ..catalogue_of(own, layouts)
    };
    let policies = vec![
        dynamic_first(Some(0), catalogue_of(4, &[3])),
        PolicyGen {
            age: 1,
            ..dynamic_first(Some(1), reserve(0, &[0], BusyGen::Reserve(60)))
        },
    ];
    let h200_layout = dynamic_first(Some(1), catalogue_of(2, &[5]));
    run_history(
        policies,
        settled(vec![
            Step::Start(0, 0),
            Step::Start(1, 0),
            Step::Apply,
            pod_of(0),
            Step::Apply,
            Step::Apply,
            Step::Policies(vec![h200_layout]),
            Step::Apply,
        ]),
    );
}

/// Demand never switches MIG mode ("the catalogue takes MIG-enabled layouts only"): but a
/// policy's own layout is in its catalogue, and a custom one may leave MIG off on some GPUs
/// (GPUs 4-7 here). Demand reshapes the node to `all-3g.40gb`, MIG on everywhere.
#[test]
fn demand_never_switches_mig_mode_from_the_policys_own_layout() {
    let policy = dynamic_first(Some(0), catalogue_of(3, &[2]));
    run_history(vec![policy], settled(vec![pod_of(2), Step::Apply]));
}

/// A dynamic policy that selects nodes it refuses (the H200s, for an A100 layout) counts them
/// as reshaping, for good: `status.demand.reshaping` lists them and they use up the rollout
/// budget, so a pod no A100 offers waits with `BudgetExhausted` and no node is reshaped.
#[test]
fn nodes_a_dynamic_policy_refuses_are_not_reshaping() {
    let policy = dynamic_first(None, catalogue_of(0, &[0]));
    run_history(vec![policy], settled(vec![pod_of(0), Step::Apply]));
}

/// A catalogue layout with one entry and no `device-filter` (NVIDIA's own `all-3g.71gb` is one)
/// is taken as holding its profiles on any GPU: demand reshapes an A100 to H200 profiles, the
/// MIG manager fails, and the node is held `Failed` for the admin. A tenant's pod did that.
#[test]
fn demand_never_picks_a_layout_the_gpus_cannot_take() {
    let policy = dynamic_first(Some(0), catalogue_of(0, &[6]));
    let steps = vec![
        pod_of(5),
        Step::Apply,
        Step::MigManager,
        Step::Gfd,
        Step::Apply,
    ];
    run_history(vec![policy], steps);
}

/// `mig.timeSlicing` with `replicas` time-slices the profiles of the policy's own layout only:
/// the device-plugin config is the policy's, whatever layout demand gave the node. A node
/// reshaped to `all-balanced-a100` never gets its instances shared, and stays `Pending`
/// ("GPU Feature Discovery reports ... replicas=1, expected 2").
#[test]
fn time_sliced_instances_of_a_demand_layout_are_shared() {
    let mut d = catalogue_of(0, &[4]);
    d.time_slicing = true;
    let policy = dynamic_first(Some(0), d);
    let steps = vec![
        Step::Apply,
        pod_of(0),
        Step::MigManager,
        Step::Gfd,
        Step::Apply,
    ];
    run_history(vec![policy], steps);
}

/// A MIG policy whose layout is `all-disabled`, under `mixed`: the node is reported `Applied`
/// while the kubelet still lists the MIG devices and not the whole GPUs (the same without
/// `dynamic`).
#[test]
fn a_mig_policy_on_all_disabled_is_applied_once_the_whole_gpus_are_advertised() {
    let policy = dynamic_first(Some(0), catalogue_of(4, &[1]));
    let steps = vec![
        Step::Apply,
        Step::Gfd,
        Step::MigManager,
        Step::Apply,
        Step::GfdBeforeKubelet,
        Step::Apply,
    ];
    run_history(vec![policy], steps);
}

/// "The node is cordoned at once" (`reserveBusyNodes`): a node chosen while GPU Feature
/// Discovery has not yet reported its last device-plugin config (demand counts it configured,
/// the rollout not) is queued, uncordoned, until GFD runs; pods keep landing there meanwhile.
#[test]
fn a_reserved_node_is_cordoned_at_once() {
    let mut d = catalogue_of(0, &[0]);
    d.busy = BusyGen::Reserve(60);
    d.lifetime = 60;
    let steps = vec![
        Step::Apply,
        Step::MigManager,
        Step::Start(1, 0),
        Step::Gfd,
        pod_of(0),
        Step::Apply,
        Step::Apply,
    ];
    run_history(vec![dynamic_first(Some(1), d)], steps);
}

/// A node reserved for demand, then governed by a policy refused cluster-wide (`single`
/// against `mixed`), is "left as it was": cordoned, for as long as the conflict lasts.
#[test]
fn a_reservation_cordon_does_not_outlive_the_reservation() {
    let mut reserve = catalogue_of(0, &[4]);
    (
        reserve.busy,
        reserve.quiet,
        reserve.max_delay,
        reserve.lifetime,
    ) = (BusyGen::Reserve(60), 2, 10, 60);
    let single = plain(3, 0);
    let steps = settled(vec![
        Step::Start(0, 0),
        Step::Start(1, 0),
        Step::Apply,
        pod_of(0),
        Step::Apply,
        Step::Gfd,
        Step::Apply,
        Step::Apply,
        Step::Policies(vec![dynamic_first(Some(A100S), catalogue_of(0, &[4]))]),
        Step::Apply,
        Step::MigManager,
        Step::MigManager,
        Step::Policies(vec![dynamic_first(Some(0), catalogue_of(0, &[4])), single]),
    ]);
    run_history(vec![dynamic_first(Some(1), reserve)], steps);
}

/// Not about demand: two A100s leave a MIG policy (one of them busy), then come back to it.
/// Both still carry its rollout mark for the same target, so both count as started: their
/// changes are written in one pass, two unconfirmed nodes for a budget of one.
#[test]
fn nodes_back_in_a_policy_wait_for_the_rollout_budget() {
    let g = |kind, profile, priority| PolicyGen {
        kind,
        replicas: 2,
        mixed: true,
        profile,
        priority,
        age: 0,
        dynamic: None,
    };
    let steps = settled(vec![
        Step::Relabel(0, None),
        Step::Policies(vec![g(3, Some(0), 3), g(2, None, 0)]),
        Step::Start(0, 0),
        Step::Apply,
        Step::Policies(vec![g(3, Some(A100S), 3)]),
        Step::Apply,
    ]);
    run_history(vec![g(3, Some(A100S), 3)], steps);
}

/// Not about demand: an H200 on an H200 layout under `single` (GPU Feature Discovery then
/// labels the node with its MIG devices: `NVIDIA-H200-MIG-1g.18gb`, 18432 MiB), then a policy
/// with an A100 layout. The planner no longer sees that `1g.10gb` does not exist on the H200:
/// the node is not rejected, and the MIG manager fails.
#[test]
fn a_node_on_a_single_strategy_layout_is_rejected_for_a_layout_its_gpus_cannot_take() {
    let h200 = PolicyGen {
        kind: 0,
        mixed: false,
        priority: 0,
        ..dynamic_first(Some(3), catalogue_of(2, &[6]))
    };
    let single = PolicyGen {
        kind: 3,
        dynamic: None,
        ..h200.clone()
    };
    let steps = vec![
        Step::Relabel(3, Some(3)),
        Step::Policies(vec![h200]),
        Step::Apply,
        Step::Policies(vec![single]),
    ];
    run_history(vec![], steps);
}

/// Not about demand: a mixed MIG policy takes back an A100 whose last word from the device
/// plugin and GPU Feature Discovery was under `single` (another policy had the node, and the
/// ClusterPolicy's `mig.strategy`). The plan switches the ClusterPolicy back to `mixed` and, in
/// the same pass, reports the node `Applied`: the device plugin still serves `nvidia.com/gpu`
/// and the kubelet lists the old `nvidia.com/mig-1g.10gb`.
#[test]
fn a_node_is_not_applied_before_the_cluster_wide_mig_strategy_it_needs() {
    let mixed = |profile| PolicyGen {
        kind: 3,
        replicas: 2,
        mixed: true,
        profile,
        priority: 3,
        age: 0,
        dynamic: None,
    };
    let other = plain;
    let steps = settled(vec![
        Step::Relabel(1, None),
        Step::Apply,
        Step::Apply,
        Step::GfdBeforeKubelet,
        Step::Policies(vec![mixed(Some(A100S))]),
        Step::Apply,
    ]);
    run_history(vec![mixed(Some(1)), other(0, 0), other(3, 1)], steps);
}

/// Found with 2,000 histories: a `mixed` policy on busy nodes; after an edit (the mixed policy
/// time-sliced with another catalogue, beside a `single` policy of lower priority) the
/// ClusterPolicy's mig.strategy turns `single` (the busy nodes wait, their labels unchanged);
/// the edit is undone. The nodes' labels are the mixed
/// policy's all along and GFD last reported `mixed`, but the device plugin serves what the
/// ClusterPolicy says: they were reported `Applied` while it still said `single`.
#[test]
fn a_node_is_not_applied_while_the_cluster_policy_says_another_mig_strategy() {
    let first = dynamic_first(None, catalogue_of(0, &[1]));
    let sliced = dynamic_first(
        None,
        DynGen {
            prefer_busy: false,
            time_slicing: true,
            ..catalogue_of(4, &[5])
        },
    );
    let single = plain(3, 0);
    let back = dynamic_first(None, catalogue_of(0, &[6]));
    let mut steps = settled_busy(vec![
        Step::Policies(vec![sliced, single]),
        Step::Apply,
        Step::Policies(vec![back]),
    ]);
    steps.extend(std::iter::repeat_n(Step::Apply, 7));
    run_history(vec![first], steps);
}

/// Found with 3,000 histories: a dynamic policy on the first A100, a passthrough policy on the
/// second; the dynamic policy is edited to take the second (it starts handing its GPUs back to
/// containers, then its layout) and then both, the first arriving still releasing. Two nodes of
/// a budget of one are out, neither started beyond it: the checker forgot a node between the
/// two steps of a VM-to-container move (its workload label changed, GFD had not run yet).
#[test]
fn edits_of_a_dynamic_policy_never_move_more_nodes_than_its_budget() {
    let passthrough = PolicyGen {
        kind: 5,
        profile: None,
        priority: 0,
        dynamic: None,
        ..dynamic_first(None, catalogue_of(0, &[3]))
    };
    let steps = settled(vec![
        Step::Start(0, 0),
        Step::Start(1, 0),
        Step::Apply,
        Step::Finish(0),
        Step::Policies(vec![dynamic_first(Some(1), catalogue_of(0, &[6]))]),
        Step::Apply,
        Step::Policies(vec![dynamic_first(Some(4), catalogue_of(0, &[5]))]),
        Step::Gfd,
    ]);
    let steps = steps.into_iter().chain(std::iter::repeat_n(Step::Apply, 5));
    run_history(
        vec![dynamic_first(Some(0), catalogue_of(0, &[3])), passthrough],
        steps.collect(),
    );
}

/// Found with 3,000 histories: a time-sliced dynamic policy on both A100s is edited to one
/// that reserves busy nodes; the first A100's change times out (GFD never reports), halting
/// the rollout, while demand chooses the busy second A100. A halted rollout cordons nothing,
/// so the choice sat there uncordoned. Demand now chooses nothing while its policy's rollout
/// is paused or halted (`RolloutStopped`), and gives up choices not yet begun.
#[test]
fn a_halted_rollout_gives_up_demands_choice_of_a_busy_node() {
    let sliced = DynGen {
        prefer_busy: false,
        time_slicing: true,
        ..catalogue_of(0, &[6])
    };
    let reserve = DynGen {
        prefer_busy: false,
        lifetime: 60,
        busy: BusyGen::Reserve(60),
        ..catalogue_of(0, &[4])
    };
    let steps = settled_busy(vec![
        Step::Policies(vec![dynamic_first(None, reserve)]),
        Step::Apply,
        pod_of(0),
        Step::Tick(601),
        Step::Start(1, 0),
        pod_of(0),
    ]);
    let steps = steps.into_iter().chain(std::iter::repeat_n(Step::Apply, 4));
    run_history(vec![dynamic_first(Some(A100S), sliced)], steps.collect());
}

/// Found with 3,000 histories once halts were recorded: a node in the middle of a change
/// (sharing config removed, MIG layout applied, its device-plugin label not yet) is queued when
/// its policy is edited to another target, and the edit is then undone. Its rollout mark of
/// the first change counted it as started, so it went on past the budget while another node
/// was still in flight. A queued node's mark of another target is dropped.
#[test]
fn a_node_queued_for_another_target_is_not_started_when_its_policy_comes_back() {
    let steps = settled_busy(vec![
        Step::Policies(vec![dynamic_first(Some(1), catalogue_of(0, &[6]))]),
        Step::Apply,
        Step::Finish(0),
        Step::Gfd,
        Step::Apply,
        Step::Policies(vec![dynamic_first(Some(A100S), catalogue_of(1, &[6]))]),
        Step::Finish(0),
        Step::MigManager,
        Step::Apply,
        Step::Policies(vec![dynamic_first(None, catalogue_of(0, &[3]))]),
    ]);
    run_history(
        vec![dynamic_first(Some(0), catalogue_of(0, &[1])), plain(0, 0)],
        steps,
    );
}

/// Found with 3,000 histories: a VM host moved from vGPU to passthrough counted as confirmed
/// while the sandbox device plugin still advertised the vGPU type, so the next node started
/// at once, past the budget. Confirmation now needs this mode's devices.
#[test]
fn a_vm_host_moving_from_vgpu_to_passthrough_waits_for_passthrough_devices() {
    let steps = vec![
        Step::Apply,
        Step::Policies(vec![plain(6, 0)]),
        Step::MigManager,
        Step::Apply,
        Step::MigManager,
        Step::MigManager,
        Step::Policies(vec![plain(5, 0)]),
        Step::Apply,
    ];
    run_history(vec![plain(0, 0)], steps);
}

/// Found with 3,000 histories: a node drained for demand, whose policy is then edited to a
/// layout its GPUs cannot take, stayed cordoned for good: the drain's in-flight check kept the
/// cordon of a node the policy refuses.
#[test]
fn a_drained_node_its_policy_now_refuses_is_uncordoned() {
    let drain = DynGen {
        prefer_busy: false,
        lifetime: 60,
        namespaces: Some(false),
        busy: BusyGen::Drain(0, 1),
        ..catalogue_of(0, &[0])
    };
    let mut steps = settled_busy(vec![
        Step::Start(1, 0),
        Step::Arrive(PodGen {
            profile: 0,
            count: 1,
            namespace: 0,
            priority: 0,
            selector: 0,
            burst: 2,
        }),
    ]);
    steps.extend(std::iter::repeat_n(Step::Apply, 7));
    steps.push(Step::Policies(vec![dynamic_first(
        None,
        catalogue_of(2, &[0]),
    )]));
    run_history(vec![dynamic_first(None, drain)], steps);
}

/// Found with 3,000 histories: a node in flight is refused by an edit (an A100 layout on an
/// H200) and accepted again by the next; its old rollout mark counted it as started, past the
/// budget. A refused node keeps no mark.
#[test]
fn a_node_refused_between_two_edits_is_not_started_past_the_budget() {
    let steps = settled_busy(vec![
        Step::Policies(vec![dynamic_first(None, catalogue_of(0, &[5]))]),
        pod_of(0),
        pod_of(0),
        pod_of(0),
        Step::MigManager,
        Step::Apply,
        Step::Policies(vec![dynamic_first(None, catalogue_of(4, &[3]))]),
        Step::Apply,
        Step::Apply,
        Step::Apply,
    ]);
    run_history(vec![dynamic_first(None, catalogue_of(4, &[4]))], steps);
}

/// Found with 3,000 histories: a VM host handed back to containers counted as available as
/// soon as its label was written (the device-plugin config did not change, so nothing waited
/// for GPU Feature Discovery); an edit then started a second node. The hand-back is stamped
/// like a config write and waits for GFD's next report.
#[test]
fn a_node_handed_back_to_containers_counts_until_gfd_reports() {
    let steps = vec![
        Step::Apply,
        Step::MigManager,
        Step::Policies(vec![plain(0, 0)]),
        Step::Apply,
        Step::Gfd,
        Step::Apply,
        Step::Policies(vec![plain(1, 0)]),
    ];
    let p1 = PolicyGen {
        profile: Some(0),
        ..plain(5, 1)
    };
    run_history(vec![plain(5, 0), p1], steps);
}

/// Found with 3,000 histories: a reservation policy chose the busy second A100; the policy is
/// then edited to wait for idle nodes and to a layout the A100 cannot take. Demand skipped the
/// refused node and kept its recorded choice for good.
#[test]
fn a_layout_chosen_for_a_node_its_policy_now_refuses_is_given_up() {
    let reserve = DynGen {
        prefer_busy: false,
        lifetime: 60,
        busy: BusyGen::Reserve(60),
        ..catalogue_of(0, &[4])
    };
    let mut steps = settled_busy(vec![
        pod_of(0),
        Step::Start(1, 0),
        pod_of(0),
        Step::Apply,
        Step::Policies(vec![dynamic_first(Some(1), catalogue_of(2, &[4]))]),
    ]);
    steps.extend(std::iter::repeat_n(Step::Apply, 5));
    run_history(vec![dynamic_first(None, reserve)], steps);
}

/// Found with 3,000 histories: a node in the middle of a two-step change (its sharing config
/// removed, its MIG layout waiting for idle GPUs) takes its second step while its policy took
/// over a node still releasing. The planner counted both (the change was started within the
/// budget); the checker had forgotten the first between the steps.
#[test]
fn a_node_between_the_steps_of_its_change_stays_in_flight() {
    let drain = DynGen {
        prefer_busy: false,
        lifetime: 60,
        namespaces: Some(false),
        busy: BusyGen::Drain(0, 1),
        ..catalogue_of(0, &[0])
    };
    let second = PolicyGen {
        age: 1,
        ..dynamic_first(Some(1), catalogue_of(0, &[3]))
    };
    let steps = settled_busy(vec![
        Step::Arrive(PodGen {
            profile: 0,
            count: 1,
            namespace: 0,
            priority: 0,
            selector: 0,
            burst: 3,
        }),
        Step::Apply,
        Step::Apply,
        Step::Policies(vec![dynamic_first(Some(1), catalogue_of(1, &[5]))]),
        Step::Apply,
        Step::Start(1, 0),
        Step::Policies(vec![dynamic_first(None, catalogue_of(1, &[6]))]),
        Step::Gfd,
        Step::Apply,
        pod_of(0),
    ]);
    run_history(vec![dynamic_first(Some(0), drain), second], steps);
}

/// A busy node whose policy is edited waits for idle GPUs without any write: it serves the
/// last change, takes no rollout budget, and the other node starts.
#[test]
fn a_busy_node_waiting_for_a_new_change_takes_no_budget() {
    let mut steps = settled_busy(vec![
        Step::Policies(vec![dynamic_first(Some(A100S), catalogue_of(1, &[2]))]),
        Step::Apply,
        Step::Policies(vec![dynamic_first(Some(A100S), catalogue_of(0, &[3]))]),
        Step::Gfd,
    ]);
    steps.extend(std::iter::repeat_n(Step::Apply, 6));
    run_history(vec![dynamic_first(None, catalogue_of(0, &[4, 7]))], steps);
}

/// A change of one planning input that the histories above do not make: between them, every
/// field of `NodeView`, `ClusterFacts`, `Settings` and `Memory` (`every_input_has_a_change`
/// names each field's change and stops compiling when a field is added).
#[derive(Debug, Clone)]
enum Change {
    // NodeView, on the node of this index.
    Label(usize, usize),
    GpuPods(usize, u8),
    VmPods(usize),
    DraClaims(usize),
    DraPods(usize),
    DraSlice(usize, Option<i64>),
    MigStuck(usize),
    VgpuStuck(usize),
    ForeignCordon(usize),
    GpuRequests(usize, usize, i64),
    LastBusy(usize, i64),
    // ClusterFacts.
    Now(i64),
    CurrentDeviceConfig,
    BaseMigConfigs(Option<usize>),
    CurrentMigConfigs,
    BaseVgpuConfigs(i64),
    CurrentVgpuConfigs,
    Namespaces(bool),
    ClusterPolicyFound,
    SandboxMode(Option<&'static str>),
    VgpuManager,
    ClusterMigStrategy(Option<&'static str>),
    ReadinessTaint(usize),
    GpuCluster,
    Autoscaling,
    Demand(usize),
    DemandIgnored,
    DeviceClasses(u8),
    SlicesUnreadable,
    Quotas,
    // Settings and Memory.
    PauseRollouts,
    ConfigMapNames,
    EvictionBlocked(usize),
    ClusterPolicyContested,
    NamespaceMissing,
    Fence(bool),
    RefusedWrite(usize),
}

/// Labels a change may set on a node: (key, value).
const CHANGED_LABELS: [(&str, &str); 7] = [
    (LABEL_MIG_STATE, "failed"),
    (LABEL_MIG_STATE, "pending"),
    ("nvidia.com/gpu.count", "4"),
    ("gpusharing.io/profile", "b"),
    ("nvidia.com/gfd.timestamp", "1800000500"),
    (names::LABEL_VGPU_STATE, "pending"),
    (names::LABEL_WORKLOAD, "vm-passthrough"),
];

fn change_gen() -> impl Strategy<Value = Change> {
    let n = 0usize..4;
    prop_oneof![
        (n.clone(), 0..CHANGED_LABELS.len()).prop_map(|(i, l)| Change::Label(i, l)),
        (n.clone(), 0u8..3).prop_map(|(i, k)| Change::GpuPods(i, k)),
        n.clone().prop_map(Change::VmPods),
        n.clone().prop_map(Change::DraClaims),
        n.clone().prop_map(Change::DraPods),
        (n.clone(), prop::option::of(1i64..5)).prop_map(|(i, s)| Change::DraSlice(i, s)),
        n.clone().prop_map(Change::MigStuck),
        n.clone().prop_map(Change::VgpuStuck),
        n.clone().prop_map(Change::ForeignCordon),
        (n.clone(), 0usize..3, 0i64..9).prop_map(|(i, r, c)| Change::GpuRequests(i, r, c)),
        (n.clone(), -4000i64..100).prop_map(|(i, d)| Change::LastBusy(i, d)),
        (1i64..4000).prop_map(Change::Now),
        Just(Change::CurrentDeviceConfig),
        prop::option::of(0usize..8).prop_map(Change::BaseMigConfigs),
        Just(Change::CurrentMigConfigs),
        (1i64..9).prop_map(Change::BaseVgpuConfigs),
        Just(Change::CurrentVgpuConfigs),
        any::<bool>().prop_map(Change::Namespaces),
        Just(Change::ClusterPolicyFound),
        prop::option::of(prop::sample::select(vec!["kubevirt", "kata"]))
            .prop_map(Change::SandboxMode),
        Just(Change::VgpuManager),
        prop::option::of(prop::sample::select(vec!["single", "mixed"]))
            .prop_map(Change::ClusterMigStrategy),
        n.clone().prop_map(Change::ReadinessTaint),
        Just(Change::GpuCluster),
        Just(Change::Autoscaling),
        (0usize..4).prop_map(Change::Demand),
        Just(Change::DemandIgnored),
        (0u8..4).prop_map(Change::DeviceClasses),
        Just(Change::SlicesUnreadable),
        Just(Change::Quotas),
        Just(Change::PauseRollouts),
        Just(Change::ConfigMapNames),
        n.clone().prop_map(Change::EvictionBlocked),
        Just(Change::ClusterPolicyContested),
        Just(Change::NamespaceMissing),
        any::<bool>().prop_map(Change::Fence),
        n.prop_map(Change::RefusedWrite),
    ]
}

/// Applies `c` to the input (indices are taken modulo what there is).
fn change(i: &mut PlanInput, c: &Change) {
    use gpu_sharing_operator::plan::input::{AutoscalingFacts, Fence, NodePool};
    use gpu_sharing_operator::plan::taint::{ReadinessTaint, Taint};
    let len = i.nodes.len();
    let name = |i: &PlanInput, k: usize| i.nodes[k % len].facts.name.clone();
    let now = i.cluster.now;
    match *c {
        Change::Label(k, l) => {
            let v = &mut i.nodes[k % len];
            let mut f = (*v.facts).clone();
            let (key, value) = CHANGED_LABELS[l];
            f.labels.insert(key, value);
            v.facts = std::sync::Arc::new(f);
        }
        Change::GpuPods(k, count) => {
            let v = &mut i.nodes[k % len];
            v.gpu_pods = (0..count).map(|p| format!("t/gpu-{p}")).collect();
            v.gpu_pod_details = v
                .gpu_pods
                .iter()
                .map(|p| {
                    let details = GpuPod {
                        labels: Labels::default(),
                        priority: i32::from(count) * 100,
                        started: 0,
                    };
                    (p.clone(), details)
                })
                .collect();
        }
        Change::VmPods(k) => i.nodes[k % len].vm_pods = vec!["t/virt-launcher".into()],
        Change::DraClaims(k) => i.nodes[k % len].dra_claims = vec!["t/claim".into()],
        Change::DraPods(k) => i.nodes[k % len].dra_pods = vec!["t/served".into()],
        Change::DraSlice(k, shares) => {
            let v = &mut i.nodes[k % len];
            v.dra_slice = match v.dra_slice {
                Some(_) => None,
                None => Some(gpu_sharing_operator::plan::input::DraSlice {
                    gpus: 8,
                    shares,
                    ..Default::default()
                }),
            }
        }
        Change::MigStuck(k) => i.nodes[k % len].mig_stuck ^= true,
        Change::VgpuStuck(k) => i.nodes[k % len].vgpu_stuck ^= true,
        Change::ForeignCordon(k) => i.nodes[k % len].foreign_cordon ^= true,
        Change::GpuRequests(k, r, count) => {
            let r = [
                "nvidia.com/gpu",
                "nvidia.com/mig-1g.10gb",
                "nvidia.com/mig-3g.40gb",
            ][r];
            i.nodes[k % len].gpu_requests.insert(r.into(), count);
        }
        Change::LastBusy(k, d) => i.nodes[k % len].last_busy = now + d,
        Change::Now(d) => i.cluster.now += d,
        Change::CurrentDeviceConfig => {
            let first = i.cluster.current_device_config.keys().next().cloned();
            match first {
                Some(k) => i.cluster.current_device_config.remove(&k),
                None => i
                    .cluster
                    .current_device_config
                    .insert("other".into(), "version: v1\n".into()),
            };
        }
        Change::BaseMigConfigs(None) => i.cluster.base_mig_configs = None,
        Change::BaseMigConfigs(Some(l)) => {
            if let Some(base) = &mut i.cluster.base_mig_configs
                && let Some(k) = base.keys().nth(l % base.len().max(1)).cloned()
            {
                base.remove(&k);
            }
        }
        Change::CurrentMigConfigs => i.cluster.current_mig_configs.clear(),
        Change::BaseVgpuConfigs(count) => {
            let mut base = (*i.cluster.base_vgpu_configs).clone();
            base.insert(
                "A100D-1-10C".into(),
                serde_json::json!([{"devices": "all", "vgpu-devices": {"A100D-1-10C": count}}]),
            );
            i.cluster.base_vgpu_configs = std::sync::Arc::new(base);
        }
        Change::CurrentVgpuConfigs => {
            i.cluster.current_vgpu_configs.insert(
                "A100D-1-10C".into(),
                serde_json::json!([{"devices": "all", "vgpu-devices": {"A100D-1-10C": 2}}]),
            );
        }
        Change::Namespaces(known) => {
            i.cluster.namespaces = known.then(|| ["t".to_string()].into_iter().collect());
        }
        Change::ClusterPolicyFound => i.cluster.cluster_policy_found ^= true,
        Change::SandboxMode(m) => i.cluster.sandbox.mode = m.map(str::to_string),
        Change::VgpuManager => i.cluster.sandbox.vgpu_manager_enabled ^= true,
        Change::ClusterMigStrategy(s) => i.cluster.cluster_mig_strategy = s.map(str::to_string),
        Change::ReadinessTaint(k) => {
            let key = "gpusharing.io/unconfigured".to_string();
            let taint = Taint {
                key: key.clone(),
                value: String::new(),
                effect: "NoSchedule".into(),
            };
            let node = name(i, k);
            let v = &mut i.nodes[k % len];
            let mut f = (*v.facts).clone();
            f.taints.push(taint.clone());
            v.facts = std::sync::Arc::new(f);
            i.cluster.readiness_taint = Some(ReadinessTaint {
                key,
                tolerations: vec![],
                tainted: [(node, taint)].into(),
            });
        }
        Change::DeviceClasses(k) => {
            use gpu_sharing_operator::plan::input::DeviceClassFact;
            let class = |name: &str, ours| DeviceClassFact {
                name: name.into(),
                extended_resource_name: Some("nvidia.com/gpu".into()),
                ours,
            };
            i.cluster.device_classes = match k {
                0 => None,
                1 => Some(vec![class("gpu.nvidia.com", false)]),
                // The API server dropped the name (DRAExtendedResource off).
                2 => Some(vec![DeviceClassFact {
                    extended_resource_name: None,
                    ..class("gpusharing-nvidia.com-gpu", true)
                }]),
                _ => Some(vec![class("gpusharing-nvidia.com-gpu", true)]),
            }
        }
        Change::SlicesUnreadable => i.cluster.slices_unreadable ^= true,
        Change::Quotas => {
            i.cluster.quotas = Some(vec![gpu_sharing_operator::plan::input::QuotaFact {
                namespace: "t".into(),
                name: "gpu".into(),
                hard: ["requests.nvidia.com/gpu".to_string()].into(),
            }])
        }
        Change::GpuCluster => {
            i.cluster.gpu_cluster = match i.cluster.gpu_cluster {
                Some(_) => None,
                None => Some("gpu-cluster".into()),
            }
        }
        Change::Autoscaling => {
            i.cluster.autoscaling = Some(AutoscalingFacts {
                node_pools: vec![NodePool {
                    name: "pool".into(),
                    labels: [("gpusharing.io/profile".to_string(), "a".to_string())].into(),
                    requirements: vec![],
                }],
                foreign_overlays: vec![],
                table: Some("{gpu-8x: {gpus: 8, product: NVIDIA-A100-SXM4-80GB}}".into()),
                weight: 10,
            })
        }
        Change::Demand(p) => i.cluster.demand.push(PendingPod {
            id: format!("t/pending-{p}"),
            priority: 0,
            since: now - 600,
            profiles: [(
                ["1g.10gb", "3g.40gb", "7g.80gb", "2g.20gb"][p].to_string(),
                1,
            )]
            .into(),
            namespace_labels: Some(Default::default()),
            ..Default::default()
        }),
        Change::DemandIgnored => {
            i.cluster
                .demand_ignored
                .push(gpu_sharing_operator::api::crd::IgnoredDemand {
                    reason: "TooManyPendingPods".into(),
                    pods: 3,
                    message: "3 pods left out".into(),
                })
        }
        Change::PauseRollouts => i.settings.pause_rollouts ^= true,
        Change::ConfigMapNames => i.settings.device_configmap = "renamed-device-config".into(),
        Change::EvictionBlocked(k) => {
            let node = name(i, k);
            i.memory
                .eviction_blocked
                .insert(node, "t/pod: PodDisruptionBudget".into());
        }
        Change::ClusterPolicyContested => {
            i.memory.cluster_policy_contested = Some("another-manager".into())
        }
        Change::NamespaceMissing => {
            i.memory.gpu_operator_namespace_missing = Some("gpu-operator".into())
        }
        Change::Fence(fenced) => {
            i.memory.fence = Some(Fence {
                fenced,
                message: "probes".into(),
            })
        }
        Change::RefusedWrite(k) => {
            let node = name(i, k);
            i.memory
                .refused_writes
                .push(gpu_sharing_operator::api::crd::RefusedWrite {
                    kind: "Node".into(),
                    name: node,
                    message: "denied".into(),
                })
        }
    }
}

/// Names, for each field of the planner's input, the [`Change`] that varies it: adding a
/// field stops this compiling until it is named here and given a change.
#[allow(dead_code)]
fn every_input_has_a_change(i: &PlanInput) {
    use gpu_sharing_operator::plan::input::{ClusterFacts, Memory, NodeView, Settings};
    let PlanInput {
        policies: _, // the histories' `Policies` step
        nodes,
        cluster,
        settings,
        memory,
    } = i;
    for v in nodes {
        let NodeView {
            facts: _,           // Label, ReadinessTaint (and every history step)
            gpu_pods: _,        // GpuPods
            gpu_pod_details: _, // GpuPods
            vm_pods: _,         // VmPods
            dra_claims: _,      // DraClaims
            dra_pods: _,        // DraPods
            dra_slice: _,       // DraSlice
            mig_stuck: _,       // MigStuck
            vgpu_stuck: _,      // VgpuStuck
            foreign_cordon: _,  // ForeignCordon
            gpu_requests: _,    // GpuRequests
            last_busy: _,       // LastBusy
        } = v;
    }
    let ClusterFacts {
        now: _,                   // Now
        current_device_config: _, // CurrentDeviceConfig
        base_mig_configs: _,      // BaseMigConfigs
        current_mig_configs: _,   // CurrentMigConfigs
        base_vgpu_configs: _,     // BaseVgpuConfigs
        current_vgpu_configs: _,  // CurrentVgpuConfigs
        namespaces: _,            // Namespaces
        cluster_policy_found: _,  // ClusterPolicyFound
        sandbox: _,               // SandboxMode, VgpuManager
        cluster_mig_strategy: _,  // ClusterMigStrategy
        readiness_taint: _,       // ReadinessTaint
        gpu_cluster: _,           // GpuCluster
        autoscaling: _,           // Autoscaling
        demand: _,                // Demand
        demand_ignored: _,        // DemandIgnored
        device_classes: _,        // DeviceClasses
        slices_unreadable: _,     // SlicesUnreadable
        quotas: _,                // Quotas
    } = cluster;
    let Settings {
        device_configmap: _, // ConfigMapNames
        mig_configmap: _,    // ConfigMapNames (the same reading)
        vgpu_configmap: _,   // ConfigMapNames (the same reading)
        pause_rollouts: _,   // PauseRollouts
    } = settings;
    let Memory {
        eviction_blocked: _,               // EvictionBlocked
        cluster_policy_contested: _,       // ClusterPolicyContested
        gpu_operator_namespace_missing: _, // NamespaceMissing
        fence: _,                          // Fence
        refused_writes: _,                 // RefusedWrite
    } = memory;
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// The memo key is complete: after a history (each pass already checked against planning
    /// from scratch), changes of any input the history does not vary, one after another and
    /// then undone, plan incrementally exactly as from scratch.
    #[test]
    fn the_memo_follows_every_input(
        (policies, steps) in history_gen(),
        changes in prop::collection::vec(change_gen(), 1..10),
    ) {
        let mut w = World::new(initial_nodes(), build(&policies));
        w.nodes[0].labels.insert(LABEL_MIG_CONFIG, "all-1g.10gb");
        w.nodes[0].labels.insert(LABEL_MIG_STATE, "success");
        w.gfd();
        w.pods.started = Some(w.now - 3600);
        let mut planner = plan::Planner::default();
        for s in steps.into_iter().take(24) {
            w.step(s, &mut planner);
        }
        let base = w.pass_input();
        prop_assert_eq!(planner.plan(&base), plan::plan(&base));
        let mut input = base.clone();
        for c in &changes {
            change(&mut input, c);
            prop_assert_eq!(planner.plan(&input), plan::plan(&input), "after {:?}", c);
        }
        prop_assert_eq!(planner.plan(&base), plan::plan(&base), "with every change undone");
    }
}
