//! Demand planning, tested through the whole pipeline: a file on top of both, so that
//! `demand.rs` stays below the pipeline that calls it.

use crate::api::crd::{DemandStatus, GpuSharingPolicy, ProfileDemand, RecentDrain};
use crate::api::names::{
    ANNOTATION_CORDONED, ANNOTATION_MIG_DEMAND, LABEL_MIG_CONFIG, LABEL_MIG_STATE,
};

use super::demand::*;
use super::input::{NodeView, PendingPod, PlanInput};
use super::pipeline::plan as plan_all;
use super::testing::a100_node;

const NOW: i64 = 1_000_000;

/// The dynamic MIG policy `dyn` of these tests, with `extra` lines under `dynamic`.
fn policy(extra: &str) -> GpuSharingPolicy {
    super::testing::policy_spec(
        "dyn",
        &format!(
            "  nodeSelector: {{matchLabels: {{gpusharing.io/profile: dyn}}}}\n  strategy: mig\n  mig:\n    migStrategy: mixed\n    layout: all-7g.80gb\n    dynamic:\n      layouts: [all-1g.10gb, all-3g.40gb]\n{extra}"
        ),
    )
}

/// An A100 node of the policy running `layout`, confirmed, with its instances allocatable.
fn node(name: &str, layout: &str, alloc: &[(&str, &str)]) -> NodeView {
    let mut n = a100_node(&[
        ("gpusharing.io/profile", "dyn"),
        (LABEL_MIG_CONFIG, layout),
        (LABEL_MIG_STATE, "success"),
    ]);
    n.name = name.into();
    n.allocatable = alloc.iter().copied().collect();
    NodeView::idle(n)
}

/// A pending pod as admission passes it on: its namespace known, with no labels.
fn pod(id: &str, profile: &str, count: i64, since: i64) -> PendingPod {
    PendingPod {
        id: id.into(),
        since,
        profiles: [(profile.to_string(), count)].into_iter().collect(),
        namespace_labels: Some(Default::default()),
        ..Default::default()
    }
}

fn input(extra: &str, nodes: Vec<NodeView>, demand: Vec<PendingPod>) -> PlanInput {
    let mut i = PlanInput::new(vec![policy(extra)], vec![]);
    i.nodes = nodes;
    i.cluster.base_mig_configs = Some(crate::nvidia::default_mig_configs());
    i.cluster.now = NOW;
    i.cluster.demand = demand;
    i
}

/// Replaces the test policy's `dynamic.layouts`.
fn set_layouts(i: &mut PlanInput, layouts: &[&str]) {
    let mig = i.policies[0].spec.mig.as_mut().unwrap();
    mig.dynamic.as_mut().unwrap().layouts = layouts.iter().map(|l| l.to_string()).collect();
}

const SEVEN: &[(&str, &str)] = &[("nvidia.com/mig-7g.80gb", "8")];

fn profile<'a>(st: &'a DemandStatus, p: &str) -> &'a ProfileDemand {
    st.profiles.iter().find(|d| d.profile == p).unwrap()
}

/// Of two reshapes that each serve more than they displace, the one serving more compute
/// slices times wait wins: a 3g pod that waited ten minutes before five 1g pods that
/// just came (3 x 660 against 5 x 65), the five 1g pods when all came alike.
#[test]
fn the_longest_waiting_slices_are_served_first() {
    let chosen = |since_3g: i64| {
        let mut demand: Vec<PendingPod> = (0..5)
            .map(|k| pod(&format!("ml/small-{k}"), "1g.10gb", 1, NOW - 5))
            .collect();
        demand.push(pod("ml/large", "3g.40gb", 1, since_3g));
        let i = input("", vec![node("b", "all-7g.80gb", SEVEN)], demand);
        plan_all(&i).demand.annotations
    };
    assert_eq!(
        chosen(NOW - 600),
        [("b".to_string(), Some(format!("all-3g.40gb@{NOW}")))].into()
    );
    assert_eq!(
        chosen(NOW - 5),
        [("b".to_string(), Some(format!("all-1g.10gb@{NOW}")))].into()
    );
}

#[test]
fn a_pods_slices_are_its_gpu_instances() {
    let p = |profiles: &[(&str, i64)]| PendingPod {
        profiles: profiles.iter().map(|(p, c)| (p.to_string(), *c)).collect(),
        ..Default::default()
    };
    assert_eq!(slices(&p(&[("1g.10gb", 1)])), 1);
    assert_eq!(slices(&p(&[("3g.40gb", 2), ("1c.4g.40gb", 1)])), 10);
    assert_eq!(slices(&p(&[("1g.10gb+me", 1), ("odd", 3)])), 4);
    assert_eq!(slices(&p(&[("7g.80gb", i64::MAX)])), i64::MAX);
}

/// A pod asking for a profile no node offers: the first idle node gets the catalogue's
/// layout that holds it, recorded with the time; the pod gets an event; the status says
/// the instance is coming.
#[test]
fn a_profile_no_node_offers_reshapes_an_idle_node() {
    let mut busy = node("a", "all-7g.80gb", SEVEN);
    busy.gpu_pods = vec!["ml/train".into()];
    busy.last_busy = NOW;
    let i = input(
        "",
        vec![busy, node("b", "all-7g.80gb", SEVEN)],
        vec![pod("ml/p1", "1g.10gb", 1, NOW - 5)],
    );
    let plan = plan_all(&i);
    assert_eq!(
        plan.demand.annotations,
        [("b".to_string(), Some(format!("all-1g.10gb@{NOW}")))].into()
    );
    assert_eq!(
        plan.demand.events,
        [(
            "ml/p1".to_string(),
            "b".to_string(),
            "reshaping node b to NVIDIA-A100-SXM4-80GB layout all-1g.10gb for this pod".to_string()
        )]
    );
    let st = plan.statuses["dyn"].demand.clone().unwrap();
    let d = profile(&st, "1g.10gb");
    assert_eq!((d.pending, d.served, d.coming), (1, 0, 1));
    assert_eq!(st.reshaping, ["b: all-1g.10gb"]);
}

/// The node's layout follows its recorded one: the MIG label the plan wants is it, and
/// the instances it will bring count as coming (no second reshape for the same pod).
#[test]
fn a_recorded_layout_is_the_nodes_target_and_its_instances_are_coming() {
    let mut v = node("b", "all-7g.80gb", SEVEN);
    std::sync::Arc::make_mut(&mut v.facts).annotations.insert(
        ANNOTATION_MIG_DEMAND,
        format!("all-1g.10gb@{}", NOW - 3).as_str(),
    );
    let i = input("", vec![v], vec![pod("ml/p1", "1g.10gb", 1, NOW - 5)]);
    let plan = plan_all(&i);
    assert_eq!(
        plan.node_labels["b"]
            .get(LABEL_MIG_CONFIG)
            .map(String::as_str),
        Some("all-1g.10gb")
    );
    assert!(
        plan.demand.annotations.is_empty(),
        "{:?}",
        plan.demand.annotations
    );
    let st = plan.statuses["dyn"].demand.clone().unwrap();
    let d = profile(&st, "1g.10gb");
    assert_eq!((d.pending, d.coming), (1, 1));
}

/// A recorded time in the future (a forged or skewed annotation) counts as now: it cannot
/// pin the cooldown beyond `minLayoutLifetimeSeconds`.
#[test]
fn a_recorded_time_in_the_future_counts_as_now() {
    let mut v = node("a", "all-3g.40gb", &[("nvidia.com/mig-3g.40gb", "16")]);
    std::sync::Arc::make_mut(&mut v.facts).annotations.insert(
        ANNOTATION_MIG_DEMAND,
        format!("all-3g.40gb@{}", NOW + 1_000_000_000).as_str(),
    );
    let plan = plan_all(&input(
        "",
        vec![v],
        vec![pod("ml/p", "1g.10gb", 1, NOW - 5)],
    ));
    let st = plan.statuses["dyn"].demand.clone().unwrap();
    assert_eq!(profile(&st, "1g.10gb").reason.as_deref(), Some(COOLDOWN));
    assert_eq!(plan.demand.recheck_in, Some(600));
}

/// With a `namespaceSelector`, pods of other namespaces (or of namespaces whose labels are
/// unknown) are not the policy's demand; pods of selected namespaces are.
#[test]
fn only_selected_namespaces_are_demand() {
    let extra = "      namespaceSelector: {matchLabels: {gpu-tenant: ml}}\n";
    let with_ns = |id: &str, labels: Option<&[(&str, &str)]>| {
        let mut p = pod(id, "1g.10gb", 1, NOW - 5);
        p.namespace_labels = labels.map(|l| {
            l.iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect()
        });
        p
    };
    let plan = plan_all(&input(
        extra,
        vec![node("a", "all-7g.80gb", SEVEN)],
        vec![
            with_ns("web/p", Some(&[("gpu-tenant", "web")])),
            with_ns("unknown/p", None),
        ],
    ));
    assert!(plan.demand.annotations.is_empty(), "{:?}", plan.demand);
    assert!(
        plan.statuses["dyn"]
            .demand
            .clone()
            .unwrap()
            .profiles
            .is_empty()
    );
    let plan = plan_all(&input(
        extra,
        vec![node("a", "all-7g.80gb", SEVEN)],
        vec![with_ns("ml/p", Some(&[("gpu-tenant", "ml")]))],
    ));
    assert_eq!(
        plan.demand.annotations,
        [("a".to_string(), Some(format!("all-1g.10gb@{NOW}")))].into()
    );
}

/// Demand younger than the quiet period waits to batch, with a recheck when it is over.
#[test]
fn young_demand_is_batched() {
    let i = input(
        "",
        vec![node("a", "all-7g.80gb", SEVEN)],
        vec![pod("ml/p1", "1g.10gb", 1, NOW - 1)],
    );
    let plan = plan_all(&i);
    assert!(plan.demand.annotations.is_empty());
    assert_eq!(plan.demand.recheck_in, Some(1));
    let st = plan.statuses["dyn"].demand.clone().unwrap();
    assert_eq!(profile(&st, "1g.10gb").reason.as_deref(), Some(BATCHING));
}

/// Fourteen 1g pods and four 3g pods on two A100 nodes: two reshapes (one per layout),
/// highest gain first, within a budget of 2; with the default budget (25% of 2 nodes: 1)
/// the second waits with BudgetExhausted.
#[test]
fn a_mixed_burst_is_served_with_one_reshape_per_node() {
    let mut demand: Vec<PendingPod> = (0..14)
        .map(|k| pod(&format!("ml/small-{k:02}"), "1g.10gb", 1, NOW - 5))
        .collect();
    demand.extend((0..4).map(|k| pod(&format!("ml/big-{k}"), "3g.40gb", 1, NOW - 5)));
    let nodes = || {
        vec![
            node("a", "all-7g.80gb", SEVEN),
            node("b", "all-7g.80gb", SEVEN),
        ]
    };
    let plan = plan_all(&input(
        "  rollout: {maxUnavailable: 2}\n",
        nodes(),
        demand.clone(),
    ));
    assert_eq!(
        plan.demand.annotations,
        [
            ("a".to_string(), Some(format!("all-1g.10gb@{NOW}"))),
            ("b".to_string(), Some(format!("all-3g.40gb@{NOW}"))),
        ]
        .into()
    );
    let st = plan.statuses["dyn"].demand.clone().unwrap();
    assert!(
        st.profiles
            .iter()
            .all(|d| d.coming == d.pending && d.reason.is_none()),
        "{st:?}"
    );

    let plan = plan_all(&input("", nodes(), demand));
    assert_eq!(plan.demand.annotations.len(), 1);
    let st = plan.statuses["dyn"].demand.clone().unwrap();
    let big = profile(&st, "3g.40gb");
    assert_eq!(big.reason.as_deref(), Some(BUDGET_EXHAUSTED), "{st:?}");
}

/// Why demand waits: a profile no catalogue layout has; a pod no node of the policy
/// accepts; a node reshaped too recently; a node that ran GPU pods moments ago.
#[test]
fn reasons_for_unmet_demand() {
    let mut selective = pod("ml/elsewhere", "1g.10gb", 1, NOW - 5);
    selective.node_selector = [("pool".to_string(), "other".to_string())].into();
    let i = input(
        "",
        vec![node("a", "all-7g.80gb", SEVEN)],
        vec![pod("ml/two", "2g.20gb", 1, NOW - 5), selective],
    );
    let plan = plan_all(&i);
    let st = plan.statuses["dyn"].demand.clone().unwrap();
    assert_eq!(
        profile(&st, "2g.20gb").reason.as_deref(),
        Some(PROFILE_NOT_IN_CATALOGUE)
    );
    assert!(
        st.profiles.iter().all(|d| d.profile != "1g.10gb"),
        "a pod no node of the policy accepts is not its demand: {st:?}"
    );

    let mut young = node("a", "all-3g.40gb", &[("nvidia.com/mig-3g.40gb", "16")]);
    std::sync::Arc::make_mut(&mut young.facts)
        .annotations
        .insert(
            ANNOTATION_MIG_DEMAND,
            format!("all-3g.40gb@{}", NOW - 10).as_str(),
        );
    let plan = plan_all(&input(
        "",
        vec![young],
        vec![pod("ml/p", "1g.10gb", 1, NOW - 5)],
    ));
    let st = plan.statuses["dyn"].demand.clone().unwrap();
    assert_eq!(profile(&st, "1g.10gb").reason.as_deref(), Some(COOLDOWN));
    assert_eq!(plan.demand.recheck_in, Some(590));

    let mut recent = node("a", "all-7g.80gb", SEVEN);
    recent.last_busy = NOW - 20;
    let plan = plan_all(&input(
        "",
        vec![recent],
        vec![pod("ml/p", "1g.10gb", 1, NOW - 5)],
    ));
    let st = plan.statuses["dyn"].demand.clone().unwrap();
    assert_eq!(
        profile(&st, "1g.10gb").reason.as_deref(),
        Some(NO_IDLE_NODE)
    );
    assert_eq!(plan.demand.recheck_in, Some(10));
}

/// Free instances serve demand before any reshape; a node whose free instances hold
/// pending pods is not taken from them.
#[test]
fn free_instances_are_supply() {
    let mut v = node("a", "all-1g.10gb", &[("nvidia.com/mig-1g.10gb", "56")]);
    v.gpu_requests = [("nvidia.com/mig-1g.10gb".to_string(), 54)].into();
    std::sync::Arc::make_mut(&mut v.facts).annotations.insert(
        ANNOTATION_MIG_DEMAND,
        format!("all-1g.10gb@{}", NOW - 3600).as_str(),
    );
    let i = input(
        "",
        vec![v.clone()],
        vec![pod("ml/p", "1g.10gb", 2, NOW - 5)],
    );
    let plan = plan_all(&i);
    assert!(plan.demand.annotations.is_empty());
    let st = plan.statuses["dyn"].demand.clone().unwrap();
    let d = profile(&st, "1g.10gb");
    assert_eq!((d.pending, d.served, d.reason.as_deref()), (2, 2, None));
    // Three asked for, two free: the third waits (the node runs GPU pods).
    v.gpu_pods = vec!["ml/running".into()];
    let i = input("", vec![v], vec![pod("ml/p", "1g.10gb", 3, NOW - 5)]);
    let st = plan_all(&i).statuses["dyn"].demand.clone().unwrap();
    let d = profile(&st, "1g.10gb");
    assert_eq!(
        (d.pending, d.served, d.reason.as_deref()),
        (3, 0, Some(NO_IDLE_NODE))
    );
}

/// Taints: a pod is demand for a node only when it tolerates the node's NoSchedule and
/// NoExecute taints, as kube-scheduler would place it.
#[test]
fn untolerated_taints_keep_pods_off_a_node() {
    use crate::plan::taint::{Taint, Toleration};
    let tainted = || {
        let mut v = node("a", "all-7g.80gb", SEVEN);
        std::sync::Arc::make_mut(&mut v.facts).taints = vec![Taint {
            key: "dedicated".into(),
            value: "ml".into(),
            effect: "NoSchedule".into(),
        }];
        v
    };
    let plain = pod("ml/p", "1g.10gb", 1, NOW - 5);
    let plan = plan_all(&input("", vec![tainted()], vec![plain.clone()]));
    assert!(plan.demand.annotations.is_empty());
    let st = plan.statuses["dyn"].demand.clone().unwrap_or_default();
    assert!(st.profiles.is_empty(), "not the policy's demand: {st:?}");
    // The untainted node is chosen over the tainted one that comes first by name.
    let plan = plan_all(&input(
        "",
        vec![tainted(), node("b", "all-7g.80gb", SEVEN)],
        vec![plain.clone()],
    ));
    assert_eq!(plan.demand.annotations.keys().collect::<Vec<_>>(), ["b"]);
    // A pod that tolerates it gets the tainted node.
    let mut tolerant = plain;
    tolerant.tolerations = vec![Toleration {
        key: "dedicated".into(),
        operator: "Exists".into(),
        ..Default::default()
    }];
    let plan = plan_all(&input("", vec![tainted()], vec![tolerant]));
    assert_eq!(
        plan.demand.annotations,
        [("a".to_string(), Some(format!("all-1g.10gb@{NOW}")))].into()
    );
}

/// The readiness taint is not judged: the operator removes it once the node is configured.
#[test]
fn the_readiness_taint_keeps_no_pod_away() {
    use crate::plan::taint::{ReadinessTaint, Taint};
    let key = "gpusharing.io/not-ready";
    let mut v = node("a", "all-7g.80gb", SEVEN);
    std::sync::Arc::make_mut(&mut v.facts).taints = vec![Taint {
        key: key.into(),
        effect: "NoSchedule".into(),
        ..Default::default()
    }];
    let mut i = input(
        "",
        vec![v.clone()],
        vec![pod("ml/p", "1g.10gb", 1, NOW - 5)],
    );
    assert!(
        plan_all(&i).demand.annotations.is_empty(),
        "judged as any taint"
    );
    i.cluster.readiness_taint = Some(ReadinessTaint {
        key: key.into(),
        ..Default::default()
    });
    assert_eq!(
        plan_all(&i).demand.annotations.keys().collect::<Vec<_>>(),
        ["a"]
    );
}

const DRAIN: &str = "      drainBusyNodes: {maxPodPriority: 100}\n      namespaceSelector: {}\n      minLayoutLifetimeSeconds: 60\n";

/// Node "a" on all-7g.80gb running one GPU pod of `priority`.
fn running(priority: i32) -> NodeView {
    let mut v = node("a", "all-7g.80gb", SEVEN);
    v.gpu_pods = vec!["ml/run".into()];
    let run = crate::plan::input::GpuPod {
        priority,
        ..Default::default()
    };
    v.gpu_pod_details = [("ml/run".to_string(), run)].into();
    v.gpu_requests = [("nvidia.com/mig-7g.80gb".to_string(), 1)].into();
    v.last_busy = NOW;
    v
}

/// [`running`], with all-3g.40gb chosen for it 3 s ago.
fn chosen(priority: i32) -> NodeView {
    let mut v = running(priority);
    std::sync::Arc::make_mut(&mut v.facts).annotations.insert(
        ANNOTATION_MIG_DEMAND,
        format!("all-3g.40gb@{}", NOW - 3).as_str(),
    );
    v
}

/// `n` pending pods asking for one 3g.40gb instance each.
fn three(n: usize) -> Vec<PendingPod> {
    (0..n)
        .map(|k| pod(&format!("ml/p{k}"), "3g.40gb", 1, NOW - 5))
        .collect()
}

/// Under `drainBusyNodes`: a busy node is chosen only when its new layout serves more
/// pending pods than the drain evicts (level by level from the highest priority), never
/// with a GPU pod above the ceiling; the chosen node is drained through the rollout's
/// drain path; a pod above the ceiling bound after the choice gives it up.
#[test]
fn busy_nodes_are_drained_only_when_it_serves_more_than_it_evicts() {
    // Two pods served, one evicted: drained and reshaped, the pods are told.
    let plan = plan_all(&input(DRAIN, vec![running(0)], three(2)));
    assert_eq!(
        plan.demand.annotations,
        [("a".to_string(), Some(format!("all-3g.40gb@{NOW}")))].into()
    );
    assert!(
        plan.demand.events[0]
            .2
            .ends_with("(draining it: 1 GPU pod(s) evicted)"),
        "{:?}",
        plan.demand.events
    );
    assert_eq!(plan.demand.drains, [("a".to_string(), 1)].into());
    // Without drainBusyNodes the same node waits for idle.
    let plan = plan_all(&input("", vec![running(0)], three(2)));
    assert!(plan.demand.annotations.is_empty());
    let st = plan.statuses["dyn"].demand.clone().unwrap();
    assert_eq!(
        profile(&st, "3g.40gb").reason.as_deref(),
        Some(NO_IDLE_NODE)
    );
    // One served for one evicted at the same priority: not worth a drain.
    let plan = plan_all(&input(DRAIN, vec![running(0)], three(1)));
    assert!(plan.demand.annotations.is_empty());
    let st = plan.statuses["dyn"].demand.clone().unwrap();
    assert_eq!(profile(&st, "3g.40gb").reason.as_deref(), Some(INFEASIBLE));
    // ...but one pod of a higher priority outweighs it.
    let mut urgent = three(1);
    urgent[0].priority = 50;
    let plan = plan_all(&input(DRAIN, vec![running(0)], urgent));
    assert_eq!(plan.demand.annotations.len(), 1);
    // A running pod above the ceiling: never drained, and the status names the ceiling.
    let plan = plan_all(&input(DRAIN, vec![running(1000)], three(4)));
    assert!(plan.demand.annotations.is_empty());
    let st = plan.statuses["dyn"].demand.clone().unwrap();
    let d = profile(&st, "3g.40gb");
    assert_eq!(d.reason.as_deref(), Some(NO_IDLE_NODE));
    assert!(
        d.message.as_deref().unwrap().contains("maxPodPriority 100"),
        "{d:?}"
    );
}

/// A node demand chose under `drainBusyNodes` takes the rollout's drain path; a pod above
/// the ceiling bound meanwhile, or a drain past its time, gives the choice up; ties go to
/// the choice that evicts fewer.
#[test]
fn demand_drains_take_the_drain_path_and_are_given_up_when_they_must() {
    // The chosen node, recorded: cordoned and its GPU pod evicted, in the rollout's drain.
    let plan = plan_all(&input(DRAIN, vec![chosen(0)], three(2)));
    assert_eq!(plan.drains["a"].evict, ["ml/run"]);
    assert!(plan.demand.annotations.is_empty(), "{:?}", plan.demand);
    // A pod above the ceiling bound meanwhile: the node is neither cordoned nor drained,
    // and the choice is given up.
    let plan = plan_all(&input(DRAIN, vec![chosen(1000)], three(2)));
    assert!(plan.drains.is_empty(), "{:?}", plan.drains);
    assert_eq!(
        plan.demand.annotations,
        [("a".to_string(), Some(format!("all-7g.80gb@{NOW}")))].into()
    );
    // A drain that overran drainTimeoutSeconds (600 s by default): given up, no halt.
    let mut late = chosen(0);
    std::sync::Arc::make_mut(&mut late.facts)
        .annotations
        .insert(
            ANNOTATION_MIG_DEMAND,
            format!("all-3g.40gb@{}", NOW - 601).as_str(),
        );
    let plan = plan_all(&input(DRAIN, vec![late], three(2)));
    assert_eq!(
        plan.demand.annotations,
        [("a".to_string(), Some(format!("all-7g.80gb@{NOW}")))].into()
    );
    assert_eq!(
        plan.statuses["dyn"]
            .rollout
            .clone()
            .unwrap()
            .halted_generation,
        None
    );
    let plan = plan_all(&input(DRAIN, vec![chosen(0)], three(2)));
    assert_eq!(plan.demand.recheck_in, Some(597), "at the drain's deadline");

    // Ties go to the choice that evicts fewer: idle "b" serves two pods, busy "a" three
    // (one only it accepts) for one eviction.
    let zone = |mut v: NodeView, z: &str| {
        std::sync::Arc::make_mut(&mut v.facts)
            .labels
            .insert("zone", z);
        v
    };
    let mut pods = three(3);
    pods[2].node_selector = [("zone".to_string(), "a".to_string())].into();
    let nodes = vec![
        zone(running(0), "a"),
        zone(node("b", "all-7g.80gb", SEVEN), "b"),
    ];
    let plan = plan_all(&input(DRAIN, nodes, pods));
    assert_eq!(
        plan.demand.annotations.keys().collect::<Vec<_>>(),
        ["b"],
        "{:?}",
        plan.demand
    );
}

/// A layout demand chose on a node that runs a GPU pod again is never put onto the busy
/// GPUs, even under `proceedWithBusyGpus`, nor drained under `disruption.mode: drain`: only
/// `drainBusyNodes` drains for demand. The choice is given back.
#[test]
fn a_demand_layout_waits_for_idle_gpus_whatever_the_disruption_settings() {
    let extra = "    proceedWithBusyGpus: true\n  disruption: {mode: drain}\n";
    let plan = plan_all(&input(extra, vec![chosen(0)], three(2)));
    assert_eq!(
        plan.node_labels["a"]
            .get(LABEL_MIG_CONFIG)
            .map(String::as_str),
        Some("all-7g.80gb"),
        "not onto busy GPUs"
    );
    assert!(plan.drains.is_empty(), "{:?}", plan.drains);
    assert!(!plan.node_annotations["a"].contains_key(ANNOTATION_CORDONED));
    assert_eq!(
        plan.demand.annotations,
        [("a".to_string(), Some(format!("all-7g.80gb@{NOW}")))].into()
    );
}

/// Drains are bounded: `maxDrainsPerHour` (1 by default) counts the drains of the last
/// hour the status keeps; a policy stored without a `namespaceSelector` (before admission
/// refused it) drains nothing; its cooldown is at least 60 s whatever it says.
#[test]
fn drains_are_bounded_per_hour_fenced_by_namespace_and_cooled_down() {
    let plan = plan_all(&input(DRAIN, vec![running(0)], three(2)));
    let st = plan.statuses["dyn"].demand.clone().unwrap();
    assert_eq!(
        st.recent_drains,
        [RecentDrain {
            node: "a".into(),
            at: NOW
        }]
    );
    // One drain 100 s ago: the hour's drain is spent, the status says so.
    let mut i = input(DRAIN, vec![running(0)], three(2));
    i.policies[0].status = Some(crate::api::crd::GpuSharingPolicyStatus {
        demand: Some(DemandStatus {
            recent_drains: vec![RecentDrain {
                node: "b".into(),
                at: NOW - 100,
            }],
            ..Default::default()
        }),
        ..Default::default()
    });
    let plan = plan_all(&i);
    assert!(plan.demand.annotations.is_empty(), "{:?}", plan.demand);
    let st = plan.statuses["dyn"].demand.clone().unwrap();
    let d = profile(&st, "3g.40gb");
    assert_eq!(d.reason.as_deref(), Some(NO_IDLE_NODE));
    assert!(
        d.message.as_deref().unwrap().contains("maxDrainsPerHour 1"),
        "{d:?}"
    );
    assert_eq!(plan.demand.recheck_in, Some(3500));
    assert_eq!(st.recent_drains.len(), 1, "kept until it is an hour old");
    // Stored without a namespaceSelector: no drain.
    let unfenced = "      drainBusyNodes: {maxPodPriority: 100}\n";
    let plan = plan_all(&input(unfenced, vec![running(0)], three(2)));
    assert!(plan.demand.annotations.is_empty(), "{:?}", plan.demand);
    // Stored with a 5 s cooldown: 60 s all the same.
    let mut young = running(0);
    std::sync::Arc::make_mut(&mut young.facts)
        .annotations
        .insert(
            ANNOTATION_MIG_DEMAND,
            format!("all-7g.80gb@{}", NOW - 30).as_str(),
        );
    let short = "      drainBusyNodes: {maxPodPriority: 100}\n      namespaceSelector: {}\n      minLayoutLifetimeSeconds: 5\n";
    let plan = plan_all(&input(short, vec![young], three(2)));
    assert!(plan.demand.annotations.is_empty(), "{:?}", plan.demand);
    let st = plan.statuses["dyn"].demand.clone().unwrap();
    assert_eq!(profile(&st, "3g.40gb").reason.as_deref(), Some(COOLDOWN));
}

/// Right before its first eviction, a drain is checked again: when the pods it was chosen
/// for are gone it is given up and nothing is evicted; once begun (cordoned) it goes on.
#[test]
fn a_drain_whose_pods_are_gone_is_given_up_before_its_first_eviction() {
    let plan = plan_all(&input(DRAIN, vec![chosen(0)], vec![]));
    assert!(plan.drains.is_empty(), "{:?}", plan.drains);
    assert_eq!(
        plan.demand.annotations,
        [("a".to_string(), Some(format!("all-7g.80gb@{NOW}")))].into()
    );
    let mut begun = chosen(0);
    let f = std::sync::Arc::make_mut(&mut begun.facts);
    f.annotations.insert(ANNOTATION_CORDONED, "true");
    f.owned_annotations.insert(ANNOTATION_CORDONED);
    let plan = plan_all(&input(DRAIN, vec![begun], vec![]));
    assert!(plan.demand.annotations.is_empty(), "{:?}", plan.demand);
}

const RESERVE: &str = "      reserveBusyNodes: {maxWaitSeconds: 300}\n";

/// Under `reserveBusyNodes` a busy node may be chosen whatever its pods' priority: it is
/// cordoned, nothing is evicted, and its MIG label waits for the pods to finish. It is given
/// back when the pods it waits for are gone or after `maxWaitSeconds`; between busy nodes,
/// the one whose youngest pod started earliest is reserved, then the one with fewer pods.
/// (Node "z", offering 7g.80gb and cooling down, keeps the running 7g pod's profile stocked.)
#[test]
fn busy_nodes_are_reserved_by_cordon_and_given_back_when_not_needed() {
    let plan = plan_all(&input(RESERVE, vec![running(1000), cooling()], three(1)));
    assert_eq!(
        plan.demand.annotations,
        [("a".to_string(), Some(format!("all-3g.40gb@{NOW}")))].into()
    );
    assert!(plan.demand.drains.is_empty());
    assert!(
        plan.demand.events[0]
            .2
            .ends_with("(cordoned until its 1 running GPU pod(s) finish)"),
        "{:?}",
        plan.demand.events
    );
    // Chosen: cordoned, nothing evicted, the MIG label unchanged while the pod runs.
    let plan = plan_all(&input(RESERVE, vec![chosen(1000), cooling()], three(2)));
    assert!(plan.drains.is_empty(), "{:?}", plan.drains);
    assert_eq!(plan.node_annotations["a"][ANNOTATION_CORDONED], "true");
    assert_eq!(
        plan.node_labels["a"]
            .get(LABEL_MIG_CONFIG)
            .map(String::as_str),
        Some("all-7g.80gb")
    );
    assert!(plan.demand.annotations.is_empty(), "{:?}", plan.demand);
    assert_eq!(plan.demand.recheck_in, Some(297), "at maxWaitSeconds");
    // The pods it waited for are gone: given back, keeping its layout.
    let back = [("a".to_string(), Some(format!("all-7g.80gb@{NOW}")))].into();
    let plan = plan_all(&input(RESERVE, vec![chosen(0), cooling()], vec![]));
    assert_eq!(plan.demand.annotations, back);
    let st = plan.statuses["dyn"].demand.clone().unwrap();
    assert!(
        st.reshaping.is_empty(),
        "a node given back is not reshaping: {st:?}"
    );
    // It waited maxWaitSeconds: given back too.
    let mut late = chosen(0);
    std::sync::Arc::make_mut(&mut late.facts)
        .annotations
        .insert(
            ANNOTATION_MIG_DEMAND,
            format!("all-3g.40gb@{}", NOW - 301).as_str(),
        );
    let plan = plan_all(&input(RESERVE, vec![late, cooling()], three(2)));
    assert_eq!(plan.demand.annotations, back);
    // Of two busy nodes whose pods started alike, the one with fewer running pods.
    let reserved = |nodes: Vec<NodeView>| {
        let plan = plan_all(&input(RESERVE, nodes, three(1)));
        plan.demand.annotations.into_keys().collect::<Vec<_>>()
    };
    let mut a = running(0);
    a.gpu_pods.push("ml/run-2".into());
    let mut b = running(0);
    std::sync::Arc::make_mut(&mut b.facts).name = "b".into();
    assert_eq!(reserved(vec![a.clone(), b.clone(), cooling()]), ["b"]);
    // The one whose youngest pod started earliest, though it runs more: its pods are
    // likelier to end first. A pod with no start time yet counts as starting now.
    let started = |v: &mut NodeView, at: i64| {
        for d in v.gpu_pod_details.values_mut() {
            d.started = at;
        }
    };
    a.gpu_pod_details
        .insert("ml/run-2".into(), crate::plan::input::GpuPod::default());
    started(&mut a, NOW - 400);
    started(&mut b, NOW - 20);
    assert_eq!(reserved(vec![a.clone(), b.clone(), cooling()]), ["a"]);
    a.gpu_pods.push("ml/run-3".into());
    assert_eq!(
        reserved(vec![a, b, cooling()]),
        ["b"],
        "a pod not yet started is the youngest"
    );
}

/// Node "z" on all-7g.80gb, idle, its layout recorded by demand 3 s ago: cooling down, so
/// never chosen, but its 7g.80gb instances count in the pool's stock.
fn cooling() -> NodeView {
    let mut z = node("z", "all-7g.80gb", SEVEN);
    std::sync::Arc::make_mut(&mut z.facts).annotations.insert(
        ANNOTATION_MIG_DEMAND,
        format!("all-7g.80gb@{}", NOW - 3).as_str(),
    );
    z
}

/// A reshape that evicts nothing never takes instances of a profile away while the pool would
/// then hold fewer than its running and pending pods ask for: the pods wait with
/// `ProfileInUse`, naming the profile and the counts. With more of it elsewhere, it goes on.
#[test]
fn a_reshape_never_takes_away_instances_a_profile_in_use_needs() {
    // The only 7g.80gb node runs a 7g pod: reserving it for 3g pods would leave none.
    let plan = plan_all(&input(RESERVE, vec![running(0)], three(2)));
    assert!(plan.demand.annotations.is_empty(), "{:?}", plan.demand);
    let st = plan.statuses["dyn"].demand.clone().unwrap();
    let waits = profile(&st, "3g.40gb");
    assert_eq!(waits.reason.as_deref(), Some(PROFILE_IN_USE));
    assert_eq!(
        waits.message.as_deref(),
        Some(
            "the reshapes that would serve it take away 7g.80gb instances, of which the pool has 8 and its running and pending pods ask for 1"
        )
    );
    // An idle 7g.80gb node too, while a 7g pod waits for it: it stays for that pod.
    let seven = pod("ml/seven", "7g.80gb", 1, NOW - 5);
    let mut pods = three(2);
    pods.push(seven);
    let idle = || {
        let mut v = node("a", "all-7g.80gb", SEVEN);
        v.last_busy = NOW - 3600;
        v
    };
    let plan = plan_all(&input("", vec![idle()], pods));
    assert!(plan.demand.annotations.is_empty(), "{:?}", plan.demand);
    // With 7g.80gb instances to spare elsewhere, the busy node is reserved.
    let plan = plan_all(&input(RESERVE, vec![running(0), cooling()], three(2)));
    assert_eq!(
        plan.demand.annotations.keys().collect::<Vec<_>>(),
        ["a"],
        "{:?}",
        plan.demand
    );
    // A drain weighs its evictions pod for pod instead.
    let plan = plan_all(&input(DRAIN, vec![running(0)], three(2)));
    assert_eq!(plan.demand.drains, [("a".to_string(), 1)].into());
}

/// A node whose MIG manager failed on the layout demand chose brings nothing and is not
/// chosen again: the demand goes to the next idle node.
#[test]
fn a_failed_reshape_is_quarantined_and_demand_moves_on() {
    let mut bad = node("a", "all-7g.80gb", SEVEN);
    let f = std::sync::Arc::make_mut(&mut bad.facts);
    f.annotations.insert(
        ANNOTATION_MIG_DEMAND,
        format!("all-1g.10gb@{}", NOW - 60).as_str(),
    );
    f.labels.insert(LABEL_MIG_CONFIG, "all-1g.10gb");
    f.labels.insert(LABEL_MIG_STATE, "failed");
    let i = input(
        "",
        vec![bad, node("b", "all-7g.80gb", SEVEN)],
        vec![pod("ml/p1", "1g.10gb", 1, NOW - 5)],
    );
    let plan = plan_all(&i);
    assert_eq!(
        plan.demand.annotations,
        [("b".to_string(), Some(format!("all-1g.10gb@{NOW}")))].into()
    );
    let st = plan.statuses["dyn"].demand.clone().unwrap();
    assert_eq!(st.reshaping, ["b: all-1g.10gb"]);
    let rollout = plan.statuses["dyn"].rollout.clone().unwrap();
    assert_eq!(
        rollout.halted_generation, None,
        "a failed reshape halts nothing"
    );
}

/// Review findings: a refused dynamic policy keeps its nodes' layouts; a node that got a
/// GPU pod before its change started keeps the layout it has; a pod one dynamic policy
/// serves is not another's demand.
#[test]
fn layouts_survive_a_refused_edit_busy_choices_are_given_up_pods_counted_once() {
    let mut v = node("a", "all-7g.80gb", SEVEN);
    std::sync::Arc::make_mut(&mut v.facts).annotations.insert(
        ANNOTATION_MIG_DEMAND,
        format!("all-1g.10gb@{}", NOW - 60).as_str(),
    );
    let mut i = input("", vec![v.clone()], vec![]);
    set_layouts(&mut i, &["no-such"]);
    let plan = plan_all(&i);
    assert!(plan.invalid.contains_key("dyn"));
    assert!(
        plan.demand.annotations.is_empty(),
        "{:?}",
        plan.demand.annotations
    );

    v.gpu_pods = vec!["ml/early".into()];
    let plan = plan_all(&input("", vec![v], vec![]));
    assert_eq!(
        plan.demand.annotations,
        [("a".to_string(), Some(format!("all-7g.80gb@{NOW}")))].into()
    );

    let mut i = input(
        "",
        vec![node("a", "all-7g.80gb", SEVEN)],
        vec![pod("ml/p", "1g.10gb", 1, NOW - 5)],
    );
    let mut other = policy("");
    other.metadata.name = Some("dyn2".into());
    other.spec.node_selector =
        serde_json::from_value(serde_json::json!({"matchLabels": {"pool": "b"}})).unwrap();
    i.policies.push(other);
    let mut b = node("b", "all-7g.80gb", SEVEN);
    let f = std::sync::Arc::make_mut(&mut b.facts);
    f.labels.insert("pool", "b");
    f.labels.remove("gpusharing.io/profile");
    i.nodes.push(b);
    let plan = plan_all(&i);
    assert_eq!(plan.statuses["dyn2"].matched_nodes, 1);
    assert_eq!(
        plan.demand.annotations.len(),
        1,
        "{:?}",
        plan.demand.annotations
    );
    assert_eq!(plan.demand.events.len(), 1);
}

/// The catalogue holds MIG-enabled layouts of the mig-parted config only.
#[test]
fn catalogue_layouts_are_checked() {
    let base = crate::nvidia::default_mig_configs();
    assert!(crate::plan::policies::check_layout("all-1g.10gb", Some(&base)).is_ok());
    assert!(crate::plan::policies::check_layout("all-disabled", Some(&base)).is_err());
    assert!(
        crate::plan::policies::check_layout("no-such", Some(&base))
            .unwrap_err()
            .contains("not a layout")
    );
    let mut i = input("", vec![], vec![]);
    set_layouts(&mut i, &["no-such"]);
    let plan = plan_all(&i);
    assert_eq!(plan.invalid["dyn"][0].path, "spec.mig.dynamic.layouts[0]");
}

/// `preferBusyNodes`: the spare taint goes on the policy's nodes that run no GPU pod and comes
/// off a node once one runs there, off every node of a policy without it, and off nodes the
/// policy refuses or no policy governs; a node that already has what it should is left alone.
#[test]
fn the_spare_taint_follows_idle_nodes_of_policies_that_prefer_busy_nodes() {
    let busy = |mut v: NodeView| {
        v.gpu_pods = vec!["ml/runs".into()];
        v
    };
    let spare = |mut v: NodeView| {
        std::sync::Arc::make_mut(&mut v.facts).spare = true;
        v
    };
    let nodes = || {
        vec![
            node("a-idle", "all-7g.80gb", SEVEN),
            busy(node("b-busy", "all-7g.80gb", SEVEN)),
            spare(node("c-idle-tainted", "all-7g.80gb", SEVEN)),
            spare(busy(node("d-busy-tainted", "all-7g.80gb", SEVEN))),
        ]
    };
    let prefer = "      preferBusyNodes: true\n";
    let p = plan_all(&input(prefer, nodes(), vec![]));
    assert_eq!(
        p.spare,
        [
            ("a-idle".to_string(), true),
            ("d-busy-tainted".to_string(), false)
        ]
    );
    // Without preferBusyNodes every spare taint goes.
    let p = plan_all(&input("", nodes(), vec![]));
    assert_eq!(
        p.spare,
        [
            ("c-idle-tainted".to_string(), false),
            ("d-busy-tainted".to_string(), false)
        ]
    );
    // A node no policy selects any more loses it too; nothing is added there.
    let mut ns = nodes();
    for v in &mut ns {
        std::sync::Arc::make_mut(&mut v.facts).labels = Default::default();
    }
    let p = plan_all(&input(prefer, ns, vec![]));
    assert_eq!(
        p.spare,
        [
            ("c-idle-tainted".to_string(), false),
            ("d-busy-tainted".to_string(), false)
        ]
    );
    // A policy refused (a catalogue layout mig-parted does not have) adds none and removes all.
    let mut i = input(prefer, nodes(), vec![]);
    set_layouts(&mut i, &["all-9g.999gb"]);
    let p = plan_all(&i);
    assert_eq!(
        p.spare,
        [
            ("c-idle-tainted".to_string(), false),
            ("d-busy-tainted".to_string(), false)
        ]
    );
}
