//! Chaos end to end, with the independent invariant watcher (tests/support/invariants.rs)
//! observing every node and ConfigMap state from the start: the control plane (etcd and
//! kube-apiserver) is killed and started again on the same etcd data in the middle of
//! converging 200 nodes, twice, and again during an edit; the operator and the simulator
//! reconnect on their own. Ends in full convergence and zero writes at rest.

mod common;
mod support;

use std::time::{Duration, Instant};

use gpu_sharing_operator::api::crd::GpuSharingPolicy;
use k8s_openapi::api::core::v1::Node;
use kube::api::{Api, Patch, PatchParams};
use serde_json::json;
use support::invariants::InvariantWatcher;
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
async fn restart_after(cluster: &mut common::TestCluster, n: usize, not: Option<&str>) -> Duration {
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

async fn converged(c: &kube::Client, generation: i64) -> serde_json::Value {
    let deadline = Instant::now() + Duration::from_secs(240);
    loop {
        if let Some(s) = ready_on(c, POLICY, NODES as i64).await
            && s["observedGeneration"] == generation
        {
            return s;
        }
        if Instant::now() > deadline {
            let status = policy_status(c, POLICY).await;
            let sample = labels(c, "l4-00").await;
            panic!(
                "{POLICY} not Ready on {NODES} nodes at generation {generation}: status {}\nl4-00: {sample:?}",
                serde_json::to_string_pretty(&status).unwrap()
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test]
async fn control_plane_restarts_mid_convergence_lose_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let (_g, mut cluster, _sim) =
        setup_with(common::ClusterOptions::default().nodes_file(l4_fleet(dir.path(), NODES))).await;
    let c = cluster.client.clone();
    let watcher = InvariantWatcher::start(&c, NS).await;
    let op = Operator::start(c.clone(), None);
    let start = Instant::now();
    common::apply_yaml(
        &c,
        &format!(
            "apiVersion: gpusharing.io/v1alpha1\nkind: GpuSharingPolicy\nmetadata: {{name: {POLICY}}}\nspec:\n  nodeSelector: {{matchLabels: {{nvidia.com/gpu.product: NVIDIA-L4}}}}\n  strategy: timeSlicing\n  timeSlicing: {{replicas: 4}}\n  rollout: {{maxUnavailable: 100%}}\n"
        ),
    )
    .await
    .unwrap();
    // Twice while the 200 nodes converge.
    restart_after(&mut cluster, 20, None).await;
    restart_after(&mut cluster, 120, None).await;
    let s = converged(&c, 1).await;
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
    let s = converged(&c, 2).await;
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

    // At rest: nothing is written.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let before = resource_versions(&c).await;
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert_eq!(resource_versions(&c).await, before, "writes at rest");
    let checked = watcher.check().await;
    eprintln!("invariant watcher: {checked} node states checked, no violation");
    assert!(
        checked >= NODES * 2,
        "the watcher saw the changes: {checked}"
    );
    op.stop().await;
}

/// The watcher is not blind: hand-made violations (no operator running) are caught, with the
/// node's history.
#[tokio::test]
async fn the_invariant_watcher_catches_violations() {
    use futures::FutureExt;
    let (_g, cluster, _sim) = setup().await;
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
    let w = InvariantWatcher::start(&c, NS).await;
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
    common::apply_yaml(
        &c,
        &format!(
            "apiVersion: v1\nkind: ConfigMap\nmetadata: {{name: gpu-sharing-device-plugin-config, namespace: {NS}}}\ndata:\n  mps-x: |\n    version: v1\n    flags: {{migStrategy: none}}\n    sharing: {{mps: {{resources: [{{name: nvidia.com/gpu, replicas: 2}}]}}}}\n"
        ),
    )
    .await
    .unwrap();
    let w = InvariantWatcher::start(&c, NS).await;
    label_node(&c, node, "nvidia.com/mig.config", Some("all-1g.10gb")).await;
    label_node(&c, node, "nvidia.com/device-plugin.config", Some("mps-x")).await;
    let msg = caught(w).await;
    assert!(msg.contains("MPS on a node with MIG layout"), "{msg}");
}
