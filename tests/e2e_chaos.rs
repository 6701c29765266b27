//! Chaos end to end, with the independent invariant watcher (tests/support/invariants.rs)
//! observing every node and ConfigMap state from the start: the control plane (etcd and
//! kube-apiserver) is killed and started again on the same etcd data in the middle of
//! converging 200 nodes, twice, and again during an edit; the operator and the simulator
//! reconnect on their own. Ends in full convergence and zero writes at rest. Also: hand edits
//! of what the operator owns, the leader killed mid-transition, and API errors injected by a
//! TLS proxy between the operator and the API server (tests/faultproxy).

mod support;

use std::time::{Duration, Instant};

use gpu_sharing_operator::api::crd::GpuSharingPolicy;
use gpu_sharing_operator::runtime::controller;
use k8s_openapi::api::core::v1::Node;
use kube::ResourceExt;
use kube::api::{Api, Patch, PatchParams};
use serde_json::json;
use support::invariants::{self, InvariantWatcher, MigRecord};
use support::*;

const NODES: usize = 200;
const POLICY: &str = "l4-chaos";

/// Nodes whose `nvidia.com/device-plugin.config` label satisfies `key` (what NVIDIA's device
/// plugin reads); `None` when the API server does not answer (it may be restarting).
async fn labelled(c: &kube::Client, key: impl Fn(&str) -> bool) -> Option<usize> {
    let list = Api::<Node>::all(c.clone())
        .list(&Default::default())
        .await
        .ok()?;
    Some(
        list.items
            .iter()
            .filter(|n| {
                n.metadata.labels.as_ref().is_some_and(|l| {
                    l.get("nvidia.com/device-plugin.config")
                        .is_some_and(|k| key(k))
                })
            })
            .count(),
    )
}

/// Waits until at least `n` nodes carry a key that differs from `not` (a key of the policy's
/// current generation), then restarts the control plane.
async fn restart_after(
    cluster: &mut testkit::TestCluster,
    n: usize,
    not: Option<&str>,
) -> Duration {
    let c = cluster.client.clone();
    until(
        &format!("{n} nodes relabelled"),
        Duration::from_secs(120),
        || async {
            let count = labelled(&c, |k| k.starts_with(POLICY) && Some(k) != not).await?;
            (count >= n).then_some(count)
        },
    )
    .await;
    let down = cluster.restart();
    eprintln!("control plane restarted (down {down:?}) with >= {n} nodes relabelled");
    down
}

/// Waits until the policy is Ready on `nodes` nodes at `generation`.
async fn converged(c: &kube::Client, nodes: usize, generation: i64) -> serde_json::Value {
    let deadline = Instant::now() + Duration::from_secs(240);
    loop {
        if let Some(s) = ready_on(c, POLICY, nodes as i64).await
            && s["observedGeneration"] == generation
        {
            return s;
        }
        if Instant::now() > deadline {
            let status = policy_status(c, POLICY).await;
            let sample = labels(c, "l4-00").await;
            panic!(
                "{POLICY} not Ready on {nodes} nodes at generation {generation}: status {}\nl4-00: {sample:?}",
                serde_json::to_string_pretty(&status).unwrap()
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// The chaos tests' policy: time-slicing on every L4 node, in one wave.
async fn apply_l4_policy(c: &kube::Client) {
    testkit::apply_yaml(
        c,
        &format!(
            "apiVersion: gpusharing.io/v1alpha1\nkind: GpuSharingPolicy\nmetadata: {{name: {POLICY}}}\nspec:\n  nodeSelector: {{matchLabels: {{nvidia.com/gpu.product: NVIDIA-L4}}}}\n  strategy: timeSlicing\n  timeSlicing: {{replicas: 4}}\n  rollout: {{maxUnavailable: 100%}}\n"
        ),
    )
    .await
    .unwrap();
}

#[tokio::test]
async fn control_plane_restarts_mid_convergence_lose_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let (g, mut cluster, _sim) =
        setup_with(testkit::ClusterOptions::default().nodes_file(l4_fleet(dir.path(), NODES)))
            .await;
    let c = cluster.client.clone();
    let watcher = g.invariants();
    let op = Operator::start(c.clone(), None);
    let start = Instant::now();
    apply_l4_policy(&c).await;
    // Twice while the 200 nodes converge.
    restart_after(&mut cluster, 20, None).await;
    restart_after(&mut cluster, 120, None).await;
    let s = converged(&c, NODES, 1).await;
    let key = s["deviceConfigKey"].as_str().unwrap().to_string();
    assert_eq!(labelled(&c, |k| k == key).await, Some(NODES));
    eprintln!("converged after two restarts in {:?}", start.elapsed());

    // And once in the middle of an edit.
    Api::<GpuSharingPolicy>::all(c.clone())
        .patch(
            POLICY,
            &PatchParams::default(),
            &Patch::Merge(&json!({"spec": {"timeSlicing": {"replicas": 8}}})),
        )
        .await
        .unwrap();
    restart_after(&mut cluster, 50, Some(&key)).await;
    let s = converged(&c, NODES, 2).await;
    let new_key = s["deviceConfigKey"].as_str().unwrap().to_string();
    assert_ne!(new_key, key);
    assert_eq!(labelled(&c, |k| k == new_key).await, Some(NODES));
    let gpus = s["capacity"]["physicalGpus"].as_i64().unwrap();
    assert!(gpus >= NODES as i64, "{s}");
    assert_eq!(s["capacity"]["schedulableReplicas"], gpus * 8);
    // The old key is gone once no node names it.
    until("the old config key removed", LONG, || async {
        let cm = configmap_data(&c, "gpu-sharing-device-plugin-config").await?;
        (!cm.contains_key(&key)).then_some(())
    })
    .await;

    // At rest: whole passes write nothing, as kube-apiserver counts writes.
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_nothing_written_at_rest(&c, POLICY, || async { op.passes() }).await;
    let checked = watcher.check().await;
    eprintln!("invariant watcher: {checked} node states checked, no violation");
    assert!(
        checked >= NODES * 2,
        "the watcher saw the changes: {checked}"
    );
    op.stop().await;
}

/// The watcher is not blind: hand-made violations (no operator running) are caught, with the
/// node's history, and so are writes under our field manager to what we do not own.
#[tokio::test]
async fn the_invariant_watcher_catches_violations() {
    use futures::FutureExt;
    let (mut g, cluster, sim) = setup().await;
    g.unwatched("this test makes violations on purpose, each caught by a watcher of its own");
    let c = cluster.client.clone();
    let caught = |w: InvariantWatcher| async move {
        let r = std::panic::AssertUnwindSafe(w.check()).catch_unwind().await;
        match r {
            Ok(n) => panic!("no violation caught ({n} states checked)"),
            Err(e) => e.downcast_ref::<String>().cloned().unwrap_or_default(),
        }
    };
    let node = "a100-node-0";

    // A label naming a key our ConfigMap does not have.
    let w = InvariantWatcher::start(&cluster.kubeconfig, NS).await;
    label_node(
        &c,
        node,
        "nvidia.com/device-plugin.config",
        Some("nope-12345678"),
    )
    .await;
    let msg = caught(w).await;
    assert!(msg.contains("names no key") && msg.contains(node), "{msg}");
    assert!(msg.contains("history of a100-node-0"), "{msg}");
    label_node(&c, node, "nvidia.com/device-plugin.config", None).await;

    // MPS on a node whose MIG layout is enabled.
    testkit::apply_yaml(
        &c,
        &format!(
            "apiVersion: v1\nkind: ConfigMap\nmetadata: {{name: gpu-sharing-device-plugin-config, namespace: {NS}}}\ndata:\n  mps-x: |\n    version: v1\n    flags: {{migStrategy: none}}\n    sharing: {{mps: {{resources: [{{name: nvidia.com/gpu, replicas: 2}}]}}}}\n  ts-mixed: |\n    version: v1\n    flags: {{migStrategy: mixed}}\n    sharing: {{timeSlicing: {{resources: [{{name: nvidia.com/mig-1g.10gb, replicas: 2}}]}}}}\n"
        ),
    )
    .await
    .unwrap();
    let w = InvariantWatcher::start(&cluster.kubeconfig, NS).await;
    label_node(&c, node, "nvidia.com/mig.config", Some("all-1g.10gb")).await;
    label_node(&c, node, "nvidia.com/device-plugin.config", Some("mps-x")).await;
    let msg = caught(w).await;
    assert!(msg.contains("MPS on a node with MIG layout"), "{msg}");

    label_node(&c, node, "nvidia.com/device-plugin.config", None).await;
    label_node(&c, node, "nvidia.com/mig.config", Some("all-disabled")).await;
    until("the MIG manager to apply all-disabled", LONG, || async {
        let n = Api::<Node>::all(c.clone()).get(node).await.ok()?;
        let l = n.labels().clone().into_iter().collect();
        let record = MigRecord::of(&l, &invariants::sim_annotations(&n));
        record.confirms(Some("all-disabled")).then_some(())
    })
    .await;

    // A stale `success` (the state label is ours to write): a new MIG layout with time-slicing
    // of MIG devices at once, before the MIG manager applied it. Only the MIG manager's own
    // record can tell that the layout is not confirmed (the simulated MIG manager is stopped
    // first, so no later `pending` of its own gives it away).
    drop(sim);
    let w = InvariantWatcher::start(&cluster.kubeconfig, NS).await;
    let stale = json!({"metadata": {"labels": {
        "nvidia.com/mig.config": "all-1g.10gb",
        "nvidia.com/mig.config.state": "success",
        "nvidia.com/device-plugin.config": "ts-mixed",
    }}});
    Api::<Node>::all(c.clone())
        .patch(node, &PatchParams::default(), &Patch::Merge(&stale))
        .await
        .unwrap();
    let msg = caught(w).await;
    assert!(
        msg.contains("is not confirmed by the MIG manager") && msg.contains("all-1g.10gb"),
        "{msg}"
    );
    label_node(&c, node, "nvidia.com/device-plugin.config", None).await;
    label_node(&c, node, "nvidia.com/mig.config", Some("all-disabled")).await;

    // Nothing we do not own: writes under our field manager, by hand.
    use gpu_sharing_operator::api::names::MANAGER;
    let nodes: Api<Node> = Api::all(c.clone());
    let node = "l4-node-0";
    // A label of someone else's, applied as ours.
    let w = InvariantWatcher::start(&cluster.kubeconfig, NS).await;
    nodes
        .patch(
            node,
            &PatchParams::apply(MANAGER).force(),
            &Patch::Apply(json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": node, "labels": {"team": "ours-now"}}})),
        )
        .await
        .unwrap();
    let msg = caught(w).await;
    assert!(
        msg.contains("something we do not own changed: Node l4-node-0")
            && msg.contains("holds metadata.labels.team"),
        "{msg}"
    );
    // (Applying nothing as ours gives it up again.)
    nodes
        .patch(
            node,
            &PatchParams::apply(MANAGER).force(),
            &Patch::Apply(json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": node}})),
        )
        .await
        .unwrap();
    // A label of someone else's removed by a merge patch of ours (we never held it).
    label_node(&c, node, "owner", Some("research")).await;
    let w = InvariantWatcher::start(&cluster.kubeconfig, NS).await;
    let patch = json!({"metadata": {"labels": {"owner": null, "gpusharing.io/policy": "x"}}});
    nodes
        .patch(
            node,
            &PatchParams {
                field_manager: Some(MANAGER.into()),
                ..Default::default()
            },
            &Patch::Merge(&patch),
        )
        .await
        .unwrap();
    let msg = caught(w).await;
    assert!(
        msg.contains("changed metadata.labels.owner: \"research\" -> (none)"),
        "{msg}"
    );
    // A taint of someone else's removed under our field manager (as the readiness taint's
    // removal is written: a JSON patch of the atomic taint list). Another taint stays: a write
    // that leaves our manager owning nothing has no managedFields entry to be seen by.
    let taint = json!({"spec": {"taints": [
        {"key": "example.com/maintenance", "effect": "NoSchedule"},
        {"key": "example.com/other", "effect": "PreferNoSchedule"},
    ]}});
    nodes
        .patch(node, &PatchParams::default(), &Patch::Merge(&taint))
        .await
        .unwrap();
    let w = InvariantWatcher::start(&cluster.kubeconfig, NS).await;
    let remove: json_patch::Patch =
        serde_json::from_value(json!([{"op": "remove", "path": "/spec/taints/0"}])).unwrap();
    nodes
        .patch(
            node,
            &PatchParams {
                field_manager: Some(MANAGER.into()),
                ..Default::default()
            },
            &Patch::Json::<()>(remove),
        )
        .await
        .unwrap();
    let msg = caught(w).await;
    assert!(
        msg.contains("changed taints it does not own") && msg.contains("example.com/maintenance"),
        "{msg}"
    );
    // A ClusterPolicy setting that is not ours.
    let w = InvariantWatcher::start(&cluster.kubeconfig, NS).await;
    let cps: Api<kube::api::DynamicObject> =
        Api::all_with(c.clone(), &controller::cluster_policy_resource());
    cps.patch(
        "cluster-policy",
        &PatchParams::apply(MANAGER).force(),
        &Patch::Apply(json!({"apiVersion": "nvidia.com/v1", "kind": "ClusterPolicy", "metadata": {"name": "cluster-policy"}, "spec": {"driver": {"enabled": false}}})),
    )
    .await
    .unwrap();
    let msg = caught(w).await;
    assert!(msg.contains("holds spec.driver.enabled"), "{msg}");
}

/// Waits until both policies are Ready on their nodes, and returns the time-slicing policy's
/// config key.
async fn both_ready(c: &kube::Client) -> String {
    let mut key = String::new();
    for (policy, nodes) in [("l4-time-slicing", 2), ("a100-mig-split", 1)] {
        let found = tokio::time::timeout(LONG, async {
            loop {
                if let Some(s) = ready_on(c, policy, nodes).await {
                    return s;
                }
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
        })
        .await;
        let Ok(s) = found else {
            let status = policy_status(c, policy).await.unwrap_or_default();
            let a100 = labels(c, "a100-node-0").await;
            panic!("{policy} not Ready on {nodes} nodes: {status}\na100-node-0: {a100:?}");
        };
        if key.is_empty() {
            key = s["deviceConfigKey"].as_str().unwrap().to_string();
        }
    }
    key
}

/// Hand edits of what the operator owns, while it runs, under the invariant watcher: each is
/// repaired (the watcher excuses only the states the edit itself broke, until every node is
/// valid again), and the cluster ends converged with nothing written at rest.
#[tokio::test]
async fn hand_edits_while_running_are_repaired() {
    use k8s_openapi::api::core::v1::{ConfigMap, Namespace};
    use kube::api::{DeleteParams, DynamicObject, PostParams};
    let (g, cluster, _sim) = setup().await;
    let c = cluster.client.clone();
    let cms: Api<ConfigMap> = Api::namespaced(c.clone(), NS);
    let mig_cm = gpu_sharing_operator::api::names::MIG_PARTED_CONFIGMAP;
    label_node(
        &c,
        "a100-node-0",
        "gpusharing.io/profile",
        Some("mig-split"),
    )
    .await;

    // The GPU Operator's namespace is missing when the operator starts (installed first). Its
    // default mig-parted config goes with it, so the fixture's `all-disabled` labels name no
    // layout until the GPU Operator is back: a hand edit for the watcher.
    let w = g.invariants();
    w.hand_edit("GPU Operator namespace deleted").await;
    let mut default_mig = cms.get("default-mig-parted-config").await.unwrap();
    let ns_api: Api<Namespace> = Api::all(c.clone());
    ns_api.delete(NS, &DeleteParams::default()).await.unwrap();
    until("namespace gone", LONG, || async {
        ns_api.get_opt(NS).await.unwrap().is_none().then_some(())
    })
    .await;
    let op = Operator::start(c.clone(), Some(NS));
    for example in [
        include_str!("../examples/time-slicing-l4.yaml"),
        include_str!("../examples/mig-custom-split.yaml"),
    ] {
        testkit::apply_yaml(&c, example).await.unwrap();
    }
    let s = until("l4-time-slicing says what is missing", LONG, || async {
        let s = policy_status(&c, "l4-time-slicing").await?;
        let r = condition(&s, "Ready")?;
        (r["status"] == "False" && r["message"].as_str()?.contains(NS)).then_some(s)
    })
    .await;
    eprintln!("namespace missing: {}", condition(&s, "Ready").unwrap());
    tokio::time::sleep(Duration::from_secs(2)).await;
    for n in ["l4-node-0", "a100-node-0"] {
        let l = labels(&c, n).await;
        assert!(
            !l.contains_key("nvidia.com/device-plugin.config"),
            "{n} labelled before its config could exist: {l:?}"
        );
    }
    ns_api
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({"metadata": {"name": NS}})).unwrap(),
        )
        .await
        .unwrap();
    default_mig.metadata = kube::api::ObjectMeta {
        name: default_mig.metadata.name.take(),
        namespace: default_mig.metadata.namespace.take(),
        ..Default::default()
    };
    cms.create(&PostParams::default(), &default_mig)
        .await
        .unwrap();
    w.repaired(LONG).await;
    let key = both_ready(&c).await;
    eprintln!("converged once the namespace was created");

    // Our device-plugin ConfigMap deleted.
    w.hand_edit("device-plugin ConfigMap deleted").await;
    cms.delete(DP_CM, &DeleteParams::default()).await.unwrap();
    w.repaired(LONG).await;
    assert_eq!(both_ready(&c).await, key, "the same key comes back");

    // Its content edited.
    w.hand_edit("config content edited").await;
    let original = configmap_data(&c, DP_CM).await.unwrap()[&key].clone();
    cms.patch(
        DP_CM,
        &PatchParams::default(),
        &Patch::Merge(&json!({"data": {key.clone(): "version: v1\n"}})),
    )
    .await
    .unwrap();
    until("content restored", LONG, || async {
        (configmap_data(&c, DP_CM).await?.get(&key)? == &original).then_some(())
    })
    .await;
    w.repaired(LONG).await;

    // A key removed.
    w.hand_edit("config key removed").await;
    cms.patch(
        DP_CM,
        &PatchParams::default(),
        &Patch::Json::<()>(
            serde_json::from_value(json!([{"op": "remove", "path": format!("/data/{key}")}]))
                .unwrap(),
        ),
    )
    .await
    .unwrap();
    w.repaired(LONG).await;
    both_ready(&c).await;

    // Our mig-parted ConfigMap deleted (the custom layout the A100 runs).
    w.hand_edit("mig-parted ConfigMap deleted").await;
    cms.delete(mig_cm, &DeleteParams::default()).await.unwrap();
    w.repaired(LONG).await;
    until("mig-parted ConfigMap back", LONG, || async {
        configmap_data(&c, mig_cm).await
    })
    .await;
    both_ready(&c).await;

    // The ClusterPolicy deleted and created again (a GPU Operator reinstall).
    w.hand_edit("ClusterPolicy recreated").await;
    let cp_api: Api<DynamicObject> =
        Api::all_with(c.clone(), &controller::cluster_policy_resource());
    let mut cp = cp_api.get("cluster-policy").await.unwrap();
    cp_api
        .delete("cluster-policy", &DeleteParams::default())
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_secs(1)).await;
    let status = cp.data["status"].take();
    cp.metadata = kube::api::ObjectMeta {
        name: Some("cluster-policy".into()),
        ..Default::default()
    };
    // As the GPU Operator's chart creates it: without our settings.
    cp.data["spec"]["devicePlugin"]
        .as_object_mut()
        .unwrap()
        .remove("config");
    cp_api.create(&PostParams::default(), &cp).await.unwrap();
    cp_api
        .patch_status(
            "cluster-policy",
            &PatchParams::default(),
            &Patch::Merge(&json!({"status": status})),
        )
        .await
        .unwrap();
    until(
        "ClusterPolicy points at our ConfigMaps again",
        LONG,
        || async {
            let cp = cluster_policy(&c).await;
            (cp["spec"]["devicePlugin"]["config"]["name"] == DP_CM
                && cp["spec"]["migManager"]["config"]["name"] == mig_cm)
                .then_some(())
        },
    )
    .await;
    w.repaired(LONG).await;

    // Our node labels removed, and changed.
    w.hand_edit("device-plugin label removed").await;
    label_node(&c, "l4-node-0", "nvidia.com/device-plugin.config", None).await;
    w.repaired(LONG).await;
    until_labelled(&c, "l4-node-0", "nvidia.com/device-plugin.config", &key).await;
    // The label came back before NVIDIA's config manager acted on its removal, so the device
    // plugin did not restart and GPU Feature Discovery reports nothing new; the operator, which
    // stamped a new write time, waits for GFD's next periodic relabel (every 60 s by default),
    // which the simulator does not play: the test plays it.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    label_node(
        &c,
        "l4-node-0",
        "nvidia.com/gfd.timestamp",
        Some(&(now + 1).to_string()),
    )
    .await;
    w.hand_edit("MIG layout label changed").await;
    label_node(
        &c,
        "a100-node-0",
        "nvidia.com/mig.config",
        Some("all-1g.10gb"),
    )
    .await;
    w.repaired(LONG).await;
    assert_eq!(both_ready(&c).await, key);
    let split = labels(&c, "a100-node-0").await;
    assert!(
        split["nvidia.com/mig.config"].starts_with("custom-a100-mig-split"),
        "{split:?}"
    );

    // At rest: whole passes write nothing, as kube-apiserver counts writes.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_nothing_written_at_rest(&c, "l4-time-slicing", || async { op.passes() }).await;
    let checked = w.check().await;
    eprintln!("invariant watcher: {checked} node states checked, no violation outside the edits");
    op.stop().await;
}

/// `(nodes, kills)` of the kill test: `CHAOS_FULL=1` (make chaos) runs the 50 x 20.
fn kill_scale() -> (usize, usize) {
    if std::env::var_os("CHAOS_FULL").is_some() {
        (50, 20)
    } else {
        (16, 6)
    }
}

/// The operator binary under `--leader-elect` (lease 3 s), two replicas, the leader killed with
/// SIGKILL at random points of MIG -> MPS and MPS -> MIG transitions, a new standby started
/// after each kill; under the invariant watcher; ends converged with nothing written at rest.
#[tokio::test]
async fn leader_killed_mid_transition_standby_takes_over() {
    let (nodes, kills) = kill_scale();
    let dir = tempfile::tempdir().unwrap();
    let fleet = fleet(dir.path(), "a100-node-0", "a100", nodes);
    let (g, cluster, _sim) = setup_with(testkit::ClusterOptions::default().nodes_file(fleet)).await;
    let c = cluster.client.clone();
    let watcher = g.invariants();
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64;
    let seed = std::env::var("CHAOS_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(seed);
    eprintln!("kill test: {nodes} nodes, {kills} kills, CHAOS_SEED={seed}");
    let mut rng = seed;
    let mut next = move || {
        rng = rng.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = rng;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    };
    let args = [
        "--leader-elect",
        "--lease-duration-seconds",
        "3",
        "--lease-renew-seconds",
        "1",
        "--namespace",
        NS,
    ];
    // Each replica serves its metrics and health endpoints on ports of its own (the default
    // ports would be taken); metrics over plain HTTP, read for the passes at rest.
    let metrics_ports = std::cell::RefCell::new(std::collections::BTreeMap::<String, u16>::new());
    let spawn = |name: &str| {
        let port = free_port();
        metrics_ports.borrow_mut().insert(name.to_string(), port);
        let addr = format!("127.0.0.1:{port}");
        let health = format!("127.0.0.1:{}", free_port());
        let mut a = args.to_vec();
        a.extend([
            "--metrics-addr",
            addr.as_str(),
            "--metrics-insecure",
            "--health-addr",
            health.as_str(),
        ]);
        (name.to_string(), spawn_operator(&cluster, name, &a))
    };
    let mut procs: Vec<(String, Proc)> = (0..2).map(|i| spawn(&format!("replica-{i}"))).collect();
    let policy = "a100-flip";
    testkit::apply_yaml(
        &c,
        &format!(
            "apiVersion: gpusharing.io/v1alpha1\nkind: GpuSharingPolicy\nmetadata: {{name: {policy}}}\nspec:\n  nodeSelector: {{matchLabels: {{nvidia.com/gpu.product: NVIDIA-A100-SXM4-80GB}}}}\n  strategy: mps\n  mps: {{replicas: 4}}\n  rollout: {{maxUnavailable: 100%}}\n"
        ),
    )
    .await
    .unwrap();
    let api: Api<GpuSharingPolicy> = Api::all(c.clone());
    let mut mig = false;
    let mut taken_over = Vec::new();
    for k in 0..kills {
        // Flip the strategy, then kill the leader somewhere inside the transition.
        mig = !mig;
        let spec = if mig {
            json!({"strategy": "mig", "mig": {"migStrategy": "single", "layout": "all-1g.10gb"}, "mps": null})
        } else {
            json!({"strategy": "mps", "mps": {"replicas": 4}, "mig": null})
        };
        api.patch(
            policy,
            &PatchParams::default(),
            &Patch::Merge(&json!({ "spec": spec })),
        )
        .await
        .unwrap();
        let delay = Duration::from_millis(300 + next() % 3000);
        tokio::time::sleep(delay).await;
        for (n, p) in procs.iter_mut() {
            assert!(
                p.0.try_wait().unwrap().is_none(),
                "{n} exited:\n{}",
                p.log()
            );
        }
        let holder = until("a leader", LONG, || lease_holder(&c)).await;
        let Some(i) = procs
            .iter()
            .position(|(n, _)| holder.starts_with(n.as_str()))
        else {
            panic!(
                "lease held by {holder}, not one of {:?}",
                procs.iter().map(|p| &p.0).collect::<Vec<_>>()
            );
        };
        let (name, mut p) = procs.remove(i);
        p.0.kill().unwrap(); // SIGKILL
        let _ = p.0.wait();
        let started = Instant::now();
        let standby = format!("replica-{}", k + 2);
        procs.push(spawn(&standby));
        let new = until("another leader", LONG, || async {
            lease_holder(&c)
                .await
                .filter(|h| !h.starts_with(name.as_str()))
        })
        .await;
        taken_over.push(started.elapsed());
        eprintln!(
            "kill {k}: {name} killed {delay:?} into the {} transition; {new} leads after {:?}",
            if mig { "MPS -> MIG" } else { "MIG -> MPS" },
            started.elapsed()
        );
    }
    let generation = api.get(policy).await.unwrap().metadata.generation.unwrap();
    let deadline = Instant::now() + Duration::from_secs(180);
    let s = loop {
        if let Some(s) = ready_on(&c, policy, nodes as i64).await
            && s["observedGeneration"] == generation
        {
            break s;
        }
        assert!(
            Instant::now() < deadline,
            "{policy} not converged: {}\nleader log:\n{}",
            policy_status(&c, policy).await.unwrap_or_default(),
            procs
                .iter()
                .map(|p| p.1.log())
                .collect::<Vec<_>>()
                .join("\n---\n")
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    };
    for i in 0..nodes {
        let l = labels(&c, &format!("a100-{i:02}")).await;
        let layout = l.get("nvidia.com/mig.config").map(String::as_str);
        if mig {
            assert_eq!(layout, Some("all-1g.10gb"), "{l:?}");
        } else {
            assert_eq!(layout, Some("all-disabled"), "{l:?}");
            assert_eq!(
                l.get("nvidia.com/device-plugin.config"),
                s["deviceConfigKey"].as_str().map(String::from).as_ref()
            );
        }
    }
    // At rest: whole passes of the leader write nothing, as kube-apiserver counts writes (the
    // replicas' lease renewals aside). Its passes: the sum over the live replicas (a standby
    // makes none).
    tokio::time::sleep(Duration::from_secs(3)).await;
    let live: Vec<u16> = procs
        .iter()
        .map(|(n, _)| metrics_ports.borrow()[n.as_str()])
        .collect();
    assert_nothing_written_at_rest(&c, policy, || {
        let live = live.clone();
        async move {
            tokio::task::spawn_blocking(move || {
                live.iter()
                    .filter_map(|p| passes_in(&http_get_raw(*p, "/metrics")))
                    .sum::<u64>()
            })
            .await
            .unwrap()
        }
    })
    .await;
    let checked = watcher.check().await;
    let worst = taken_over.iter().max().unwrap();
    eprintln!(
        "kill test: converged; takeovers within {worst:?}; {checked} node states checked, no violation"
    );
}

/// `(nodes, transitions under faults)` of the API-error test: `CHAOS_FULL=1` runs 200 nodes.
fn fault_scale() -> usize {
    if std::env::var_os("CHAOS_FULL").is_some() {
        200
    } else {
        30
    }
}

/// The states of our part of every node written since `since` (see
/// `InvariantWatcher::our_changes`), per node, with our annotations' values (times, the
/// policy's generation) masked: a write that only stamps a new time still counts as a state.
fn node_writes_since(
    now: &std::collections::BTreeMap<String, Vec<String>>,
    since: &std::collections::BTreeMap<String, Vec<String>>,
) -> std::collections::BTreeMap<String, Vec<String>> {
    now.iter()
        .filter(|(k, _)| k.starts_with("Node/"))
        .map(|(k, v)| {
            let from = since.get(k).map_or(0, Vec::len);
            let masked = v[from..]
                .iter()
                .map(|state| {
                    state
                        .split(' ')
                        .map(|f| match f.split_once('=') {
                            Some((k, _)) if k.starts_with("metadata.annotations.") => {
                                format!("{k}=*")
                            }
                            _ => f.to_string(),
                        })
                        .collect::<Vec<_>>()
                        .join(" ")
                })
                .collect();
            (k.clone(), masked)
        })
        .collect()
}

/// API errors injected between the operator and the API server: the operator talks TLS to our
/// test proxy (tests/faultproxy, its own certificate, trusted by the operator's kubeconfig
/// only), which answers 20% of requests with 429, 500 or 409, drops the connection, or applies
/// the request and loses the answer, and cuts watches after a few seconds. The same two
/// transitions (time-slicing <-> MPS) run first without faults, then with them: every node
/// goes through exactly the same states of what is ours (nothing lost, nothing written twice in
/// a way that shows), and the operator, started afresh under faults, converges an edit too.
/// Ends with nothing written at rest and few requests while faults continue.
#[tokio::test]
async fn api_errors_injected_operator_backs_off_and_converges() {
    let nodes = fault_scale();
    let dir = tempfile::tempdir().unwrap();
    let (g, cluster, _sim) =
        setup_with(testkit::ClusterOptions::default().nodes_file(l4_fleet(dir.path(), nodes)))
            .await;
    let c = cluster.client.clone();
    let watcher = g.invariants();
    let seed = std::env::var("CHAOS_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(16);
    eprintln!("API error test: {nodes} nodes, CHAOS_SEED={seed}");
    let proxy = FaultProxy::start(&cluster, 0.0, seed, "6s").await;
    let mut op = Operator::start(proxy.client.clone(), None);
    let policies: Api<GpuSharingPolicy> = Api::all(c.clone());
    apply_l4_policy(&c).await;
    let mut generation = 1;
    let to_mps = json!({"spec": {"strategy": "mps", "mps": {"replicas": 4}, "timeSlicing": null}});
    let to_ts =
        json!({"spec": {"strategy": "timeSlicing", "timeSlicing": {"replicas": 4}, "mps": null}});
    let flip = |patch: serde_json::Value| {
        let policies = policies.clone();
        async move {
            policies
                .patch(POLICY, &PatchParams::default(), &Patch::Merge(&patch))
                .await
                .unwrap();
        }
    };
    converged(&c, nodes, generation).await;

    // The two transitions without faults, then with them.
    let mut runs = Vec::new();
    for rate in [0.0, 0.2] {
        proxy.set_rate(rate).await;
        let t = Instant::now();
        let before = watcher.our_changes().await;
        for patch in [&to_mps, &to_ts] {
            flip(patch.clone()).await;
            generation += 1;
            converged(&c, nodes, generation).await;
        }
        let writes = node_writes_since(&watcher.our_changes().await, &before);
        eprintln!(
            "rate {rate}: both transitions converged in {:?}; proxy {}",
            t.elapsed(),
            proxy.stats().await
        );
        runs.push(writes);
    }
    let (clean, faulty) = (&runs[0], &runs[1]);
    assert_eq!(clean.len(), nodes, "{clean:?}");
    let per_node = clean.values().map(Vec::len).sum::<usize>() as f64 / nodes as f64;
    eprintln!("states of our part per node and transition pair: {per_node}");
    assert!(
        per_node >= 2.0,
        "the transitions changed the nodes: {clean:?}"
    );
    for (node, states) in clean {
        assert_eq!(
            faulty.get(node),
            Some(states),
            "{node} went through other states under faults"
        );
    }

    // A fresh operator under faults (its first lists and watches fail too), and an edit.
    op.stop().await;
    flip(json!({"spec": {"timeSlicing": {"replicas": 8}}})).await;
    generation += 1;
    op = Operator::start(proxy.client.clone(), None);
    let s = converged(&c, nodes, generation).await;
    assert_eq!(
        s["capacity"]["schedulableReplicas"],
        s["capacity"]["physicalGpus"].as_i64().unwrap() * 8
    );
    let stats = proxy.stats().await;
    eprintln!("after a restart under faults: proxy {stats}");
    for kind in ["429", "500", "409", "dropped", "lost", "watchesCut"] {
        assert!(
            stats[kind].as_u64().unwrap() > 0,
            "no {kind} injected: {stats}"
        );
    }

    // At rest, faults still on: the operator does not spin on errors, and whole passes write
    // nothing (kube-apiserver's counters; the pokes go around the proxy).
    tokio::time::sleep(Duration::from_secs(2)).await;
    let requests = proxy.stats().await["requests"].as_u64().unwrap();
    tokio::time::sleep(Duration::from_secs(10)).await;
    let at_rest = proxy.stats().await["requests"].as_u64().unwrap() - requests;
    assert_nothing_written_at_rest(&c, POLICY, || async { op.passes() }).await;
    eprintln!(
        "at rest under faults: {at_rest} requests in 10 s (watches re-established after cuts)"
    );
    assert!(at_rest < 60, "{at_rest} requests in 10 s at rest");
    let checked = watcher.check().await;
    eprintln!("invariant watcher: {checked} node states checked, no violation");
    op.stop().await;
}
