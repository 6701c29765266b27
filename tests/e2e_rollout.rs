//! End-to-end: staged rollouts on 40 simulated L4 nodes, observed by an independent watcher
//! that counts the nodes whose device-plugin config changed and GPU Feature Discovery has not
//! confirmed yet. First enablement and an edit go in waves within `maxUnavailable`, across an
//! operator restart in the middle; a node whose device plugin hangs halts the rollout (named,
//! Warning event, no new node touched) until the policy is edited; `paused` stops new changes.

mod support;

use std::time::Duration;

use gpu_sharing_operator::api::crd::GpuSharingPolicy;
use gpu_sharing_operator::runtime::controller;
use kube::api::{Api, Patch, PatchParams};
use serde_json::json;
use support::*;

const NODES: usize = 40;
const POLICY: &str = "l4-rollout";

async fn patch_policy(c: &kube::Client, spec: serde_json::Value) {
    Api::<GpuSharingPolicy>::all(c.clone())
        .patch(
            POLICY,
            &PatchParams::default(),
            &Patch::Merge(&json!({"spec": spec})),
        )
        .await
        .unwrap();
}

async fn progressing_of(
    c: &kube::Client,
    policy: &str,
) -> Option<(String, String, serde_json::Value)> {
    let s = policy_status(c, policy).await?;
    let p = condition(&s, "Progressing")?;
    Some((
        p["reason"].as_str()?.to_string(),
        p["message"].as_str()?.to_string(),
        s.clone(),
    ))
}

async fn progressing(c: &kube::Client) -> Option<(String, String, serde_json::Value)> {
    progressing_of(c, POLICY).await
}

/// Ready at `generation` with every node applied.
async fn converged(c: &kube::Client, generation: i64) -> serde_json::Value {
    until(
        &format!("{POLICY} Ready at generation {generation}"),
        Duration::from_secs(120),
        || async {
            let s = ready_on(c, POLICY, NODES as i64).await?;
            (s["observedGeneration"] == generation).then_some(s)
        },
    )
    .await
}

#[tokio::test]
async fn rollouts_go_in_waves_halt_on_a_hung_node_and_pause() {
    let dir = tempfile::tempdir().unwrap();
    let (_g, cluster, _sim) =
        setup_with(testkit::ClusterOptions::default().nodes_file(l4_fleet(dir.path(), NODES)))
            .await;
    let c = cluster.client.clone();
    let watch = BudgetWatcher::start(&c).await;
    let op = Operator::start(c.clone(), None);
    testkit::apply_yaml(
        &c,
        &format!(
            "apiVersion: gpusharing.io/v1alpha1\nkind: GpuSharingPolicy\nmetadata: {{name: {POLICY}}}\nspec:\n  nodeSelector: {{matchLabels: {{nvidia.com/gpu.product: NVIDIA-L4}}}}\n  strategy: timeSlicing\n  timeSlicing: {{replicas: 4}}\n  rollout: {{maxUnavailable: 25%}}\n"
        ),
    )
    .await
    .unwrap();

    // First enablement: 40 nodes in waves of at most 10.
    let s = converged(&c, 1).await;
    assert_eq!(s["rollout"]["maxUnavailable"], 10);
    assert_eq!(s["unavailableNodes"], 0);
    assert_eq!(watch.changes(), NODES);
    let first = watch.max_unconfirmed();
    assert!(
        (2..=10).contains(&first),
        "at most 10 nodes unconfirmed at once, saw {first}"
    );

    // An edit, with the operator restarted in the middle: the new one counts the nodes in
    // flight from the cluster and keeps the budget.
    watch.reset();
    patch_policy(&c, json!({"timeSlicing": {"replicas": 8}})).await;
    until("the edit under way", Duration::from_secs(60), || async {
        (watch.changes() >= NODES + 5).then_some(())
    })
    .await;
    op.stop().await;
    let op = Operator::start(c.clone(), None);
    let s = converged(&c, 2).await;
    assert_eq!(watch.changes(), 2 * NODES);
    let edit = watch.max_unconfirmed();
    assert!(
        (2..=10).contains(&edit),
        "at most 10 nodes unconfirmed at once, saw {edit}"
    );
    assert!(s["rollout"]["previousDeviceConfigKeys"].is_null(), "{s}");
    let l = labels(&c, "l4-39").await;
    assert_eq!(l["nvidia.com/gpu.replicas"], "8");

    // A node whose device plugin hangs after the reload: the rollout halts once it stays
    // unconfirmed past nodeTimeoutSeconds, names it, and touches no further node.
    let nodes: Api<k8s_openapi::api::core::v1::Node> = Api::all(c.clone());
    let fault = |v: Option<&str>| json!({"metadata": {"annotations": {"simulator.gpusharing.io/fault": v}}});
    nodes
        .patch(
            "l4-00",
            &PatchParams::default(),
            &Patch::Merge(&fault(Some("device-plugin-hang"))),
        )
        .await
        .unwrap();
    watch.reset();
    patch_policy(
        &c,
        json!({"timeSlicing": {"replicas": 2}, "rollout": {"maxUnavailable": 2, "nodeTimeoutSeconds": 10}}),
    )
    .await;
    let (_, message, s) = until("RolloutHalted", Duration::from_secs(120), || async {
        let p = progressing(&c).await?;
        (p.0 == "RolloutHalted").then_some(p)
    })
    .await;
    assert!(
        message.contains("l4-00") && message.contains("nodeTimeoutSeconds 10"),
        "{message}"
    );
    assert_eq!(s["rollout"]["haltedGeneration"], 3);
    let queued = s["rollout"]["queuedNodes"].as_i64().unwrap();
    assert!(queued > 0, "{s}");
    // Every queued node is held for the halt, counted by its typed reason and listed with it.
    assert_eq!(
        s["heldNodes"]["RolloutHalted"].as_i64(),
        Some(queued),
        "{s}"
    );
    let details = s["nodeDetails"].as_array().unwrap();
    assert!(
        details
            .iter()
            .filter(|d| d["state"] == "Queued")
            .all(|d| d["reason"] == "RolloutHalted"),
        "{s}"
    );
    assert_eq!(condition(&s, "Ready").unwrap()["status"], "False");
    let halted_at = watch.changes();
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert_eq!(
        watch.changes(),
        halted_at,
        "no node is touched while halted"
    );
    assert!(
        watch.max_unconfirmed() <= 2,
        "budget 2, saw {}",
        watch.max_unconfirmed()
    );
    let events: Api<k8s_openapi::api::events::v1::Event> = Api::all(c.clone());
    let halted_event = until("a RolloutHalted event", LONG, || async {
        let list = events.list(&Default::default()).await.ok()?;
        list.items.into_iter().find(|e| {
            e.reason.as_deref() == Some("RolloutHalted")
                && e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(POLICY)
        })
    })
    .await;
    assert_eq!(halted_event.type_.as_deref(), Some("Warning"));
    assert!(halted_event.note.unwrap_or_default().contains("l4-00"));

    // Fixed node + edited policy (a new generation) resume the rollout.
    nodes
        .patch(
            "l4-00",
            &PatchParams::default(),
            &Patch::Merge(&fault(None)),
        )
        .await
        .unwrap();
    patch_policy(
        &c,
        json!({"rollout": {"maxUnavailable": "25%", "nodeTimeoutSeconds": 60}}),
    )
    .await;
    let s = converged(&c, 4).await;
    assert!(s["rollout"]["haltedGeneration"].is_null(), "{s}");
    assert_eq!(labels(&c, "l4-39").await["nvidia.com/gpu.replicas"], "2");

    // Paused: an edit starts on no node until unpaused.
    let before = watch.changes();
    patch_policy(&c, json!({"paused": true, "timeSlicing": {"replicas": 3}})).await;
    let (_, message, _) = until("Paused", LONG, || async {
        let p = progressing(&c).await?;
        (p.0 == "Paused").then_some(p)
    })
    .await;
    assert!(message.contains("40 nodes wait"), "{message}");
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(watch.changes(), before, "paused: no node changes");
    patch_policy(&c, json!({"paused": false})).await;
    converged(&c, 6).await;
    assert_eq!(watch.changes(), before + NODES);
    op.stop().await;
}

const TAINT: &str = "gpusharing.io/unconfigured";

fn taint_keys(n: &k8s_openapi::api::core::v1::Node) -> Vec<String> {
    n.spec
        .as_ref()
        .and_then(|s| s.taints.as_ref())
        .map(|t| t.iter().map(|t| t.key.clone()).collect())
        .unwrap_or_default()
}

#[tokio::test]
async fn the_readiness_taint_goes_once_the_config_is_confirmed() {
    use futures::StreamExt;
    use kube::ResourceExt;
    use kube::runtime::{WatchStreamExt, watcher};
    let (_g, cluster, _sim) = setup().await;
    let c = cluster.client.clone();
    let op = Operator::start_with(
        c.clone(),
        gpu_sharing_operator::runtime::controller::Config {
            readiness_taint: Some(TAINT.into()),
            resync: Duration::from_secs(30),
            ..Default::default()
        },
    );
    testkit::apply_path(
        &c,
        &testkit::repo_root().join("examples/time-slicing-l4.yaml"),
    )
    .await
    .unwrap();
    // A new L4 node registers with the taint (and a soft taint of someone else's); so does a
    // GPU node no policy selects.
    let taints = format!(
        "spec:\n  taints:\n  - {{key: {TAINT}, effect: NoSchedule}}\n  - {{key: example.com/other, effect: PreferNoSchedule}}"
    );
    let joining = l4_node("l4-new").replace("spec: {}", &taints);
    let unselected = l4_node("t4-new")
        .replace("NVIDIA-L4", "Tesla-T4")
        .replace("spec: {}", &taints);
    // Watch the joining node from before it exists: the first state without the taint.
    let nodes: Api<k8s_openapi::api::core::v1::Node> = Api::all(c.clone());
    let untainted = tokio::spawn({
        let nodes = nodes.clone();
        async move {
            let cfg = watcher::Config::default().fields("metadata.name=l4-new");
            let mut s = watcher(nodes, cfg).applied_objects().boxed();
            while let Some(Ok(n)) = s.next().await {
                if !taint_keys(&n).contains(&TAINT.to_string()) {
                    return n;
                }
            }
            panic!("watch ended")
        }
    });
    testkit::apply_yaml(&c, &format!("{joining}\n---\n{unselected}"))
        .await
        .unwrap();

    // The GPU Operator's DaemonSets (in the test cluster: the simulator) do not tolerate the
    // taint yet: nothing can configure the node, and the operator says why and removes nothing.
    let s = until("ReadinessTaintNotTolerated", LONG, || async {
        let s = policy_status(&c, "l4-time-slicing").await?;
        (condition(&s, "Degraded")?["reason"] == "ReadinessTaintNotTolerated").then_some(s)
    })
    .await;
    let msg = condition(&s, "Degraded").unwrap()["message"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(
        msg.contains("spec.daemonsets.tolerations") && msg.contains(TAINT),
        "{msg}"
    );
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(taint_keys(&nodes.get("l4-new").await.unwrap()).contains(&TAINT.to_string()));

    // Tolerated: the node gets configured, confirmed, then untainted.
    let tolerations = json!({"spec": {"daemonsets": {"tolerations": [
        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
        {"key": TAINT, "operator": "Exists", "effect": "NoSchedule"},
    ]}}});
    testkit::cluster_policy_api(&c)
        .patch(
            "cluster-policy",
            &PatchParams::default(),
            &Patch::Merge(&tolerations),
        )
        .await
        .unwrap();
    let n = tokio::time::timeout(Duration::from_secs(60), untainted)
        .await
        .expect("the taint is removed")
        .unwrap();
    // At the moment it went: the policy's config on the node, and GFD's report after our write.
    let l = n.labels();
    let key = policy_status(&c, "l4-time-slicing").await.unwrap()["deviceConfigKey"]
        .as_str()
        .unwrap()
        .to_string();
    assert_eq!(l["nvidia.com/device-plugin.config"], key);
    assert_eq!(l["nvidia.com/gpu.replicas"], "4");
    let written: i64 = n.annotations()["gpusharing.io/device-plugin-config-written"]
        .parse()
        .unwrap();
    let stamped: i64 = l["nvidia.com/gfd.timestamp"].parse().unwrap();
    assert!(stamped > written, "GFD {stamped} after our write {written}");
    // Only our taint went.
    assert_eq!(taint_keys(&n), ["example.com/other"]);
    // The node no policy selects loses it once GFD labelled it.
    let t4 = until("t4-new untainted", LONG, || async {
        let n = nodes.get("t4-new").await.ok()?;
        (!taint_keys(&n).contains(&TAINT.to_string())).then_some(n)
    })
    .await;
    assert!(t4.labels().contains_key("nvidia.com/gfd.timestamp"));
    assert!(!t4.labels().contains_key("nvidia.com/device-plugin.config"));
    let s = until("all 3 L4 nodes applied", LONG, || {
        ready_on(&c, "l4-time-slicing", 3)
    })
    .await;
    assert_eq!(condition(&s, "Degraded").unwrap()["status"], "False");
    op.stop().await;
}

fn gpu_pod(name: &str, node: &str, app: &str) -> k8s_openapi::api::core::v1::Pod {
    serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": "default", "labels": {"app": app}},
        "spec": {"nodeName": node, "containers": [{"name": "c", "image": "cuda",
            "resources": {"limits": {"nvidia.com/gpu": "1"}}}]}
    }))
    .unwrap()
}

fn unschedulable(n: &k8s_openapi::api::core::v1::Node) -> bool {
    n.spec.as_ref().and_then(|s| s.unschedulable) == Some(true)
}

#[tokio::test]
async fn drains_respect_pod_disruption_budgets_and_lift_only_their_own_cordon() {
    use k8s_openapi::api::core::v1::{Node, Pod};
    use k8s_openapi::api::policy::v1::PodDisruptionBudget;
    use kube::ResourceExt;
    use kube::api::PostParams;
    let (_g, cluster, _sim) = setup().await;
    let c = cluster.client.clone();
    let pods: Api<Pod> = Api::namespaced(c.clone(), "default");
    let nodes: Api<Node> = Api::all(c.clone());
    // a100-node-0: two training pods under a budget that allows no disruption.
    // a100-node-1: one pod, and a cordon of someone else's (say, a driver upgrade).
    for (name, node) in [
        ("train-0", "a100-node-0"),
        ("train-1", "a100-node-0"),
        ("batch-0", "a100-node-1"),
    ] {
        let app = if node == "a100-node-0" {
            "train"
        } else {
            "batch"
        };
        pods.create(&PostParams::default(), &gpu_pod(name, node, app))
            .await
            .unwrap();
    }
    let pdbs: Api<PodDisruptionBudget> = Api::namespaced(c.clone(), "default");
    let pdb: PodDisruptionBudget = serde_json::from_value(json!({
        "metadata": {"name": "train"},
        "spec": {"minAvailable": 2, "selector": {"matchLabels": {"app": "train"}}}
    }))
    .unwrap();
    pdbs.create(&PostParams::default(), &pdb).await.unwrap();
    // A second budget over the same pods: the Eviction API answers 500 for those.
    let second: PodDisruptionBudget = serde_json::from_value(json!({
        "metadata": {"name": "train-too"},
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": {"app": "train"}}}
    }))
    .unwrap();
    pdbs.create(&PostParams::default(), &second).await.unwrap();
    let cordon = json!({"spec": {"unschedulable": true}});
    nodes
        .patch(
            "a100-node-1",
            &PatchParams::default(),
            &Patch::Merge(&cordon),
        )
        .await
        .unwrap();
    until("the pods run", LONG, || async {
        let l = pods.list(&Default::default()).await.ok()?;
        l.items
            .iter()
            .all(|p| p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running"))
            .then_some(())
    })
    .await;

    let no_retries = testkit::client_without_retries(&cluster.kubeconfig)
        .await
        .unwrap();
    let op = Operator::start_with(
        c.clone(),
        gpu_sharing_operator::runtime::controller::Config {
            resync: Duration::from_secs(30),
            eviction_client: Some(controller::EvictionClient(no_retries)),
            ..Default::default()
        },
    );
    testkit::apply_yaml(
        &c,
        "apiVersion: gpusharing.io/v1alpha1\nkind: GpuSharingPolicy\nmetadata: {name: a100-mig}\nspec:\n  nodeSelector: {matchLabels: {nvidia.com/gpu.product: NVIDIA-A100-SXM4-80GB}}\n  strategy: mig\n  mig: {migStrategy: single, layout: all-1g.10gb}\n  rollout: {maxUnavailable: 100%}\n  disruption: {mode: drain}\n",
    )
    .await
    .unwrap();

    // Two budgets select the training pods: refused with 500, and said so.
    let (_, message, _) = until("a drain blocked by two budgets", LONG, || async {
        let p = progressing_of(&c, "a100-mig").await?;
        (p.0 == "Draining" && p.1.contains("more than one PodDisruptionBudget")).then_some(p)
    })
    .await;
    assert!(message.contains("500"), "{message}");
    pdbs.delete("train-too", &Default::default()).await.unwrap();
    // One budget that allows no disruption (in this control plane its status is never
    // computed: no disruption controller runs): a100-node-0 stays cordoned by us and its
    // evictions are refused with 429, which the status reports as the API server said it.
    let (_, message, _) = until("a blocked drain", LONG, || async {
        let p = progressing_of(&c, "a100-mig").await?;
        (p.0 == "Draining" && p.1.contains("eviction refused (429 TooManyRequests)")).then_some(p)
    })
    .await;
    assert!(
        message.contains("default/train-0") && message.contains("a100-node-0"),
        "{message}"
    );
    // The API server's own words, its message and the budget it names.
    assert!(
        message.contains("Cannot evict pod as it would violate the pod's disruption budget")
            && message.contains("The disruption budget train"),
        "{message}"
    );
    let n0 = nodes.get("a100-node-0").await.unwrap();
    assert!(unschedulable(&n0));
    assert_eq!(n0.annotations()["gpusharing.io/cordoned"], "true");
    assert_eq!(
        n0.labels()["nvidia.com/mig.config"],
        "all-disabled",
        "no change while busy"
    );
    assert_eq!(
        pods.list(&Default::default()).await.unwrap().items.len(),
        2,
        "batch-0 went"
    );
    // a100-node-1 was drained without claiming the cordon someone else set.
    let n1 = nodes.get("a100-node-1").await.unwrap();
    assert!(!n1.annotations().contains_key("gpusharing.io/cordoned"));

    // The budget allows it: both go, the layout changes, and our cordon is lifted once the MIG
    // manager confirmed it; the other cordon stays.
    let relax = json!({"spec": {"minAvailable": 0}});
    pdbs.patch("train", &PatchParams::default(), &Patch::Merge(&relax))
        .await
        .unwrap();
    let s = until("a100-mig Ready", Duration::from_secs(90), || {
        ready_on(&c, "a100-mig", 2)
    })
    .await;
    assert_eq!(s["migConfig"], "all-1g.10gb");
    assert!(
        pods.list(&Default::default())
            .await
            .unwrap()
            .items
            .is_empty()
    );
    let n0 = until("our cordon lifted", LONG, || async {
        let n = nodes.get("a100-node-0").await.ok()?;
        (!unschedulable(&n)).then_some(n)
    })
    .await;
    assert!(!n0.annotations().contains_key("gpusharing.io/cordoned"));
    assert_eq!(n0.labels()["nvidia.com/mig.config.state"], "success");
    assert!(
        unschedulable(&nodes.get("a100-node-1").await.unwrap()),
        "not our cordon"
    );
    op.stop().await;

    // A slow answer is not a refusal: every eviction through a proxy that delays it by 3 s
    // (longer than the old inference from a timeout allowed) goes through and nothing reports
    // it as refused.
    let proxy = FaultProxy::start(&cluster, 0.0, 1, "0s").await;
    proxy.set_delay("/eviction", Duration::from_secs(3)).await;
    pods.create(
        &PostParams::default(),
        &gpu_pod("slow-0", "a100-node-0", "slow"),
    )
    .await
    .unwrap();
    until("slow-0 runs", LONG, || async {
        let p = pods.get("slow-0").await.ok()?;
        (p.status?.phase.as_deref() == Some("Running")).then_some(())
    })
    .await;
    let op = Operator::start_with(
        proxy.client.clone(),
        gpu_sharing_operator::runtime::controller::Config {
            resync: Duration::from_secs(30),
            eviction_client: Some(controller::EvictionClient(
                proxy.client_without_retries().await,
            )),
            ..Default::default()
        },
    );
    let layout = json!({"spec": {"mig": {"layout": "all-2g.20gb"}}});
    Api::<gpu_sharing_operator::api::crd::GpuSharingPolicy>::all(c.clone())
        .patch("a100-mig", &PatchParams::default(), &Patch::Merge(&layout))
        .await
        .unwrap();
    let s = until(
        "a100-mig Ready on all-2g.20gb",
        Duration::from_secs(90),
        || async {
            let s = ready_on(&c, "a100-mig", 2).await?;
            (s["migConfig"] == "all-2g.20gb").then_some(s)
        },
    )
    .await;
    assert_eq!(s["migConfig"], "all-2g.20gb");
    assert!(pods.get_opt("slow-0").await.unwrap().is_none(), "evicted");
    let delayed = proxy.stats().await["delayed"].as_u64().unwrap();
    assert!(
        delayed >= 1,
        "the eviction went through the delay: {delayed}"
    );
    let events = Api::<k8s_openapi::api::events::v1::Event>::all(c.clone())
        .list(&Default::default())
        .await
        .unwrap();
    let refused: Vec<_> = events
        .items
        .iter()
        .filter(|e| e.reason.as_deref() == Some("EvictionBlocked"))
        .filter_map(|e| e.note.clone())
        .filter(|m| m.contains("slow-0"))
        .collect();
    assert!(
        refused.is_empty(),
        "a slow eviction reported as refused: {refused:?}"
    );
    op.stop().await;
}
