//! Planner properties over random policy sets, node label sets and histories (no cluster).
//!
//! A small model of the cluster plays the other side (`planner_model`, NVIDIA's components
//! written from NVIDIA's behaviour, not from the operator's own `plan::converge`): applying a
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
//! - once converged, nothing waits (no node `Queued` or `Pending`) and a node is `Rejected` only
//!   for what it is (the same nodes as before any write), not for what NVIDIA's components
//!   report about our own changes.

mod planner_model;

use std::collections::{BTreeMap, BTreeSet};

use gpu_sharing_operator::api::crd::{
    GpuSelection, GpuSharingPolicy, GpuSharingPolicySpec, Mig, MigDeviceGroup, MigStrategy, Mps,
    Strategy as Sharing, TimeSlicing, Vgpu,
};
use gpu_sharing_operator::api::names::{
    self, LABEL_DEVICE_PLUGIN_CONFIG, LABEL_MIG_CONFIG, LABEL_MIG_STATE,
};
use gpu_sharing_operator::api::state::NodeState;
use gpu_sharing_operator::nvidia::{DEFAULT_KEY, MIG_DISABLED_LAYOUT};
use gpu_sharing_operator::plan::input::GpuPod;
use gpu_sharing_operator::plan::{self, Labels, NodeFacts, Plan, PlanInput};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, Time};
use planner_model::{
    Cluster, Loaded, Nvidia, device_plugin_error, parse_device_plugin_config, server_side_apply,
};
use proptest::prelude::*;

const PROFILES: [&str; 4] = ["a", "b", "c", "d"];
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
}

fn policy_gen() -> impl Strategy<Value = PolicyGen> {
    (
        0u8..7,
        2i32..8,
        any::<bool>(),
        proptest::option::of(0usize..4),
        0i32..3,
        0i64..5,
    )
        .prop_map(
            |(kind, replicas, mixed, profile, priority, age)| PolicyGen {
                kind,
                replicas,
                mixed,
                profile,
                priority,
                age,
            },
        )
}

fn build(gens: &[PolicyGen]) -> Vec<GpuSharingPolicy> {
    gens.iter()
        .enumerate()
        .map(|(i, g)| {
            policy(
                &format!("p{i}"),
                g.kind,
                g.replicas,
                g.mixed,
                g.profile.map(|p| PROFILES[p]),
                g.priority,
                g.age,
            )
        })
        .collect()
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
    /// The policy set changes.
    Policies(Vec<PolicyGen>),
}

fn step_gen() -> impl Strategy<Value = Step> {
    prop_oneof![
        4 => Just(Step::Apply),
        3 => Just(Step::MigManager),
        3 => Just(Step::Gfd),
        2 => Just(Step::GfdBeforeKubelet),
        1 => (0usize..4, proptest::option::of(0usize..4)).prop_map(|(n, p)| Step::Relabel(n, p)),
        1 => proptest::collection::vec(policy_gen(), 0..4).prop_map(Step::Policies),
    ]
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
    m.insert(
        "all-1g.10gb".to_string(),
        gpu_sharing_operator::api::yaml::from_str(
            "[{devices: all, mig-enabled: true, mig-devices: {1g.10gb: 7}}]",
        )
        .unwrap(),
    );
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
    /// The facts given to the last input, by node: a node keeps them while they do not change,
    /// as the controller's node cache does (so the incremental planner sees unchanged nodes as
    /// the same shared facts).
    shared: std::cell::RefCell<BTreeMap<String, std::sync::Arc<NodeFacts>>>,
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
            shared: Default::default(),
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
            i.nodes.push(plan::NodeView {
                facts,
                ..Default::default()
            });
        }
        i.cluster.current_device_config = self.config.clone();
        i.cluster.base_mig_configs = Some(self.base.clone());
        i.cluster.current_mig_configs = self.mig_config.clone();
        i.cluster.now = self.now;
        i.cluster.sandbox.vgpu_manager_enabled = true;
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
    /// (when the device-plugin config changed) and the MIG manager is not pending.
    fn apply_within_budget(&mut self, plan: &Plan) {
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
            let dp_changed = loaded_config(old) != loaded_config(&n.labels);
            match n.labels.get(names::LABEL_POLICY) {
                Some(p) => {
                    let gfd = dp_changed || self.unconfirmed.get(&n.name).is_some_and(|(_, g)| *g);
                    self.unconfirmed
                        .insert(n.name.clone(), (p.to_string(), gfd));
                }
                None => {
                    self.unconfirmed.remove(&n.name);
                }
            }
        }
        let nodes = &self.nodes;
        self.unconfirmed.retain(|name, (_, gfd)| {
            let n = nodes.iter().find(|n| &n.name == name).unwrap();
            *gfd || n.labels.get(LABEL_MIG_STATE) == Some("pending")
                || n.labels.get(names::LABEL_VGPU_STATE) == Some("pending")
        });
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

fn run_history(policies: Vec<PolicyGen>, steps: Vec<Step>) {
    let mut w = World::new(initial_nodes(), build(&policies));
    // Start from MIG enabled on one node, as an admin left it.
    w.nodes[0].labels.insert(LABEL_MIG_CONFIG, "all-1g.10gb");
    w.nodes[0].labels.insert(LABEL_MIG_STATE, "success");
    // GFD runs on every node: it has labelled each once already.
    w.gfd();
    let pristine = w.nodes.clone();
    // The controller's planner, kept across the whole history: its plan of every pass must be
    // the plan from scratch.
    let mut planner = plan::Planner::default();
    for s in steps {
        match s {
            Step::Apply => {
                let input = w.input();
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
                // The runtime's node cache keeps only the labels the planner reads: the same
                // plan from those.
                let filter = plan::LabelFilter::new(plan::selector_keys(&input.policies));
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
                w.applied_nodes_advertise(&p);
                w.apply_within_budget(&p);
            }
            Step::MigManager => w.mig_manager(),
            Step::Gfd => w.gfd(),
            Step::GfdBeforeKubelet => w.gfd_before_kubelet(),
            Step::Relabel(n, p) => match p {
                Some(p) => {
                    for k in PROFILE_KEYS {
                        w.nodes[n].labels.insert(k, PROFILES[p]);
                    }
                }
                None => {
                    for k in PROFILE_KEYS {
                        w.nodes[n].labels.remove(k);
                    }
                }
            },
            Step::Policies(g) => w.policies = build(&g),
        }
        w.check_invariants();
    }
    // Converge: alternate apply and MIG manager; then planning the planned state changes nothing.
    for _ in 0..16 {
        let p = plan::plan(&w.input());
        w.apply_within_budget(&p);
        w.check_invariants();
        w.mig_manager();
        w.gfd();
        w.check_invariants();
    }
    let p = plan::plan(&w.input());
    for n in &w.nodes {
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
    fn invariants_hold_over_random_histories(
        policies in proptest::collection::vec(policy_gen(), 0..5),
        steps in proptest::collection::vec(step_gen(), 0..30),
    ) {
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
    let g = |kind| PolicyGen {
        kind,
        replicas: 2,
        mixed: false,
        profile: None,
        priority: 0,
        age: 0,
    };
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
    plan::converge::apply(&mut done, &resumed);
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

/// Cluster-wide inputs count too: when the GPU Operator's named layout changes content, the
/// incremental planner re-plans the nodes under it (`Stale`), as planning from scratch does.
#[test]
fn incremental_planning_follows_a_named_layout_changed_under_a_node_at_rest() {
    let mut w = World::new(
        vec![node("a100-0", "NVIDIA-A100-SXM4-80GB", true, Some("a"))],
        vec![policy("mig", 3, 2, true, Some("a"), 0, 0)],
    );
    w.boot();
    let mut planner = plan::Planner::default();
    let state = |p: &Plan| p.statuses["mig"].node_details[0].state;
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
