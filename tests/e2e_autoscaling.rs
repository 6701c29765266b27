//! End-to-end: Karpenter NodeOverlays from policies, on the local control plane with
//! Karpenter's own CRDs (from the `sigs.k8s.io/karpenter` Go module, `tests/karpenter`).
//!
//! One control plane for the file: the steps run in order in one test.

mod support;

use std::collections::BTreeMap;

use gpu_sharing_operator::api::crd::GpuSharingPolicy;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::Client;
use kube::api::{Api, ApiResource, DeleteParams, DynamicObject, Patch, PatchParams, PostParams};
use serde_json::{Value, json};
use support::*;

/// `tests/karpenter/build.sh path`: Karpenter's binary and CRDs, built when their sources
/// changed.
fn karpenter_dir() -> std::path::PathBuf {
    let out = std::process::Command::new("bash")
        .arg(testkit::repo_root().join("tests/karpenter/build.sh"))
        .arg("path")
        .output()
        .expect("tests/karpenter/build.sh runs");
    assert!(
        out.status.success(),
        "tests/karpenter/build.sh failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap().trim().into()
}

fn overlay_api(c: &Client) -> Api<DynamicObject> {
    let ar = ApiResource {
        group: "karpenter.sh".into(),
        version: "v1alpha1".into(),
        api_version: "karpenter.sh/v1alpha1".into(),
        kind: "NodeOverlay".into(),
        plural: "nodeoverlays".into(),
    };
    Api::all_with(c.clone(), &ar)
}

/// NodeOverlays by name: their spec.
async fn overlays(c: &Client) -> BTreeMap<String, Value> {
    overlay_api(c)
        .list(&Default::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .map(|o| (o.metadata.name.clone().unwrap(), o.data["spec"].clone()))
        .collect()
}

fn node_pool(name: &str, labels: Value) -> String {
    format!(
        "apiVersion: karpenter.sh/v1\nkind: NodePool\nmetadata: {{name: {name}}}\nspec:\n  template:\n    metadata: {{labels: {labels}}}\n    spec:\n      nodeClassRef: {{group: karpenter.kwok.sh, kind: KWOKNodeClass, name: default}}\n      expireAfter: Never\n      requirements:\n      - {{key: node.kubernetes.io/instance-type, operator: In, values: [gpu-1x, gpu-8x]}}\n"
    )
}

const TS4: &str = "apiVersion: gpusharing.io/v1alpha1\nkind: GpuSharingPolicy\nmetadata: {name: ts4}\nspec:\n  nodeSelector: {matchLabels: {gpusharing.io/profile: ts4}}\n  strategy: timeSlicing\n  timeSlicing: {replicas: 4}\n";

/// The admin's table: two instance types no node of the cluster runs yet.
const TABLE: &str = "gpu-1x: {gpus: 1, product: NVIDIA-L4, memoryMiB: 23034}\ngpu-8x: {gpus: 8, product: NVIDIA-L4, memoryMiB: 23034}\n";

/// A time-slicing policy gets one overlay per GPU count of the NodePool it selects (GPUs x
/// replicas), none for a NodePool it does not select (with the reason in its status); an edit
/// reaches the overlays, another actor's overlay on the same resource makes the policy step
/// aside for that type, and deleting the policy removes its overlays before its finalizer goes.
#[tokio::test]
async fn node_overlays_follow_policies_and_node_pools() {
    let crds = karpenter_dir().join("crds");
    let (_g, cluster, _sim) = setup_with(testkit::ClusterOptions::default().manifest(&crds)).await;
    let c = cluster.client.clone();
    for pool in [
        node_pool("shared", json!({"gpusharing.io/profile": "ts4"})),
        node_pool("plain", json!({})),
    ] {
        testkit::apply_yaml(&c, &pool).await.unwrap();
    }
    let table: ConfigMap = serde_json::from_value(json!({
        "metadata": {"name": "gpu-sharing-instance-types", "namespace": NS},
        "data": {"instance-types.yaml": TABLE},
    }))
    .unwrap();
    Api::<ConfigMap>::namespaced(c.clone(), NS)
        .create(&PostParams::default(), &table)
        .await
        .unwrap();
    let op = Operator::start(c.clone(), Some(NS));
    testkit::apply_yaml(&c, TS4).await.unwrap();

    let o = until("two overlays", LONG, || async {
        let o = overlays(&c).await;
        (o.len() == 2).then_some(o)
    })
    .await;
    assert_eq!(
        o["gpusharing-ts4-8gpu"]["capacity"],
        json!({"nvidia.com/gpu": "32"})
    );
    assert_eq!(
        o["gpusharing-ts4-1gpu"]["capacity"],
        json!({"nvidia.com/gpu": "4"})
    );
    assert_eq!(
        o["gpusharing-ts4-8gpu"]["requirements"],
        json!([
            {"key": "karpenter.sh/nodepool", "operator": "In", "values": ["shared"]},
            {"key": "node.kubernetes.io/instance-type", "operator": "In", "values": ["gpu-8x"]},
        ])
    );
    assert_eq!(o["gpusharing-ts4-8gpu"]["weight"], 1);
    let s = until("status.autoscaling", LONG, || async {
        let s = policy_status(&c, "ts4").await?;
        (s["autoscaling"]["overlays"].as_array()?.len() == 2).then_some(s)
    })
    .await;
    assert_eq!(
        s["autoscaling"]["nodePools"],
        json!([
            {"name": "plain", "matched": false, "reason": "its template labels lack gpusharing.io/profile=ts4"},
            {"name": "shared", "matched": true, "reason": "instance types gpu-1x, gpu-8x"},
        ])
    );

    // An edit reaches the overlays.
    Api::<GpuSharingPolicy>::all(c.clone())
        .patch(
            "ts4",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"timeSlicing": {"replicas": 2}}})),
        )
        .await
        .unwrap();
    until("8 GPUs x 2", LONG, || async {
        let o = overlays(&c).await;
        (o.get("gpusharing-ts4-8gpu")?["capacity"]["nvidia.com/gpu"] == "16").then_some(())
    })
    .await;

    // An admin's overlay setting nvidia.com/gpu on gpu-8x: ours steps aside for that type.
    testkit::apply_yaml(
        &c,
        "apiVersion: karpenter.sh/v1alpha1\nkind: NodeOverlay\nmetadata: {name: admin-8x}\nspec:\n  weight: 50\n  requirements:\n  - {key: node.kubernetes.io/instance-type, operator: In, values: [gpu-8x]}\n  capacity: {nvidia.com/gpu: \"8\"}\n",
    )
    .await
    .unwrap();
    until("ours for gpu-8x gone", LONG, || async {
        let o = overlays(&c).await;
        (!o.contains_key("gpusharing-ts4-8gpu") && o.contains_key("gpusharing-ts4-1gpu"))
            .then_some(())
    })
    .await;
    let s = until("conflict reported", LONG, || async {
        let s = policy_status(&c, "ts4").await?;
        (!s["autoscaling"]["conflicts"].as_array()?.is_empty()).then_some(s)
    })
    .await;
    assert_eq!(
        s["autoscaling"]["conflicts"],
        json!([
            "NodeOverlay admin-8x (weight 50) sets nvidia.com/gpu on gpu-8x in NodePool shared: left to it"
        ])
    );

    // Deleting the policy removes its overlays; the admin's stays.
    Api::<GpuSharingPolicy>::all(c.clone())
        .delete("ts4", &DeleteParams::default())
        .await
        .unwrap();
    until("policy gone", LONG, || async {
        Api::<GpuSharingPolicy>::all(c.clone())
            .get_opt("ts4")
            .await
            .unwrap()
            .is_none()
            .then_some(())
    })
    .await;
    assert_eq!(
        overlays(&c).await.keys().collect::<Vec<_>>(),
        ["admin-8x"],
        "the policy's overlays are gone once its finalizer is"
    );
    op.stop().await;
}
