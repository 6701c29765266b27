//! End-to-end: the DRA backend renders ResourceClaimTemplates (resource.k8s.io/v1, served by
//! the local kube-apiserver 1.36), keeps them in step with the policy, reports invalid driver
//! settings without rendering anything, and removes them with the policy.

mod support;

use gpu_sharing_operator::api::crd::GpuSharingPolicy;
use k8s_openapi::api::core::v1::{Namespace, Node};
use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceClaimTemplate};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use serde_json::json;
use support::*;

const TEAM: &str = "gpu-test6";

async fn template(c: &kube::Client) -> Option<serde_json::Value> {
    let t = Api::<ResourceClaimTemplate>::namespaced(c.clone(), TEAM)
        .get_opt("single-gpu")
        .await
        .ok()??;
    Some(serde_json::to_value(t).unwrap())
}

fn mps_config(t: &serde_json::Value) -> serde_json::Value {
    t["spec"]["spec"]["devices"]["config"][0]["opaque"]["parameters"]["sharing"]["mpsConfig"]
        .clone()
}

#[tokio::test]
async fn dra_templates_follow_the_policy() {
    let (g, cluster, _sim) = setup().await;
    let invariants = g.invariants();
    let c = cluster.client.clone();
    let ns: Namespace = serde_json::from_value(json!({"metadata": {"name": TEAM}})).unwrap();
    Api::<Namespace>::all(c.clone())
        .create(&PostParams::default(), &ns)
        .await
        .unwrap();
    let op = Operator::start(c.clone(), Some(NS));
    label_node(&c, "h200-node-0", "gpusharing.io/profile", Some("dra")).await;
    testkit::apply_yaml(&c, include_str!("../examples/dra-mps.yaml"))
        .await
        .unwrap();

    let s = until("dra-mps Ready", LONG, || ready(&c, "dra-mps")).await;
    assert_eq!(s["templates"], json!(["gpu-test6/single-gpu"]));
    assert!(s.get("deviceConfigKey").is_none());
    let t = until("template", LONG, || template(&c)).await;
    assert_eq!(
        t["spec"]["spec"]["devices"]["requests"][0]["exactly"]["deviceClassName"],
        "gpu.nvidia.com"
    );
    assert_eq!(
        t["spec"]["spec"]["devices"]["config"][0]["opaque"]["driver"],
        "gpu.nvidia.com"
    );
    assert_eq!(
        mps_config(&t),
        json!({"defaultActiveThreadPercentage": 50, "defaultPinnedDeviceMemoryLimit": "10Gi"})
    );
    // The node is governed by the DRA policy: the device plugin, if it runs, shares nothing.
    let l = labels(&c, "h200-node-0").await;
    assert_eq!(l["gpusharing.io/policy"], "dra-mps");
    assert_eq!(l["nvidia.com/device-plugin.config"], "default");
    assert_eq!(s["capacity"]["memoryPerClientMib"], 10240);
    assert_eq!(s["capacity"]["threadsPerClientPercent"], 50);
    // One backend per node: the device plugin is switched off, and the policy is Ready only
    // once the (simulated) kubelet withdrew its allocatable; its capacity lingers.
    assert_eq!(l["nvidia.com/gpu.deploy.device-plugin"], "false");
    let (cap, alloc) = gpu_resources(&c, "h200-node-0").await;
    assert_eq!((cap.as_deref(), alloc.as_deref()), (Some("8"), Some("0")));

    // Edit: 4 clients, limits derived from the H200's memory: the template follows.
    let api: Api<GpuSharingPolicy> = Api::all(c.clone());
    let patch = json!({"spec": {"mps": {"replicas": 4}, "dra": {"mps": null}}});
    api.patch("dra-mps", &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .unwrap();
    until("template updated", LONG, || async {
        let t = template(&c).await?;
        (mps_config(&t) == json!({"defaultActiveThreadPercentage": 25, "defaultPinnedDeviceMemoryLimit": "35942Mi"}))
            .then_some(())
    })
    .await;

    // Invalid driver settings: reported, nothing rendered.
    testkit::apply_yaml(
        &c,
        "apiVersion: gpusharing.io/v1alpha1\nkind: GpuSharingPolicy\nmetadata: {name: dra-ts}\nspec:\n  nodeSelector: {matchLabels: {gpusharing.io/profile: none}}\n  strategy: timeSlicing\n  timeSlicing: {replicas: 2}\n  backend: dra\n  dra: {namespaces: [gpu-test6], templateName: ts}\n",
    )
    .await
    .unwrap();
    let s = until("dra-ts not accepted", LONG, || async {
        let s = policy_status(&c, "dra-ts").await?;
        (condition(&s, "Accepted")?["status"] == "False").then_some(s)
    })
    .await;
    let msg = condition(&s, "Accepted").unwrap()["message"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(msg.contains("TimeSlicingSettings"), "{msg}");
    assert!(
        Api::<ResourceClaimTemplate>::namespaced(c.clone(), TEAM)
            .get_opt("ts")
            .await
            .unwrap()
            .is_none()
    );

    // A pod's claim is allocated on the node: the device plugin must not come back under it.
    allocated_claim(&c, "h200-node-0").await;

    // Delete: the template goes with the policy.
    api.delete("dra-mps", &DeleteParams::default())
        .await
        .unwrap();
    until("template removed", LONG, || async {
        template(&c).await.is_none().then_some(())
    })
    .await;
    until("policy released", LONG, || async {
        api.get_opt("dra-mps")
            .await
            .unwrap()
            .is_none()
            .then_some(())
    })
    .await;
    tokio::time::sleep(std::time::Duration::from_secs(3)).await;
    let l = labels(&c, "h200-node-0").await;
    assert!(!l.contains_key("gpusharing.io/policy"), "released: {l:?}");
    assert_eq!(
        l["nvidia.com/gpu.deploy.device-plugin"], "false",
        "kept off while a gpu.nvidia.com claim is allocated on the node"
    );
    // The claim goes: our `false` goes, the GPU Operator (simulated) sets `true`, the device
    // plugin comes back with its resources.
    Api::<ResourceClaim>::namespaced(c.clone(), TEAM)
        .delete("vm-claim", &DeleteParams::default())
        .await
        .unwrap();
    until("device plugin back", LONG, || async {
        let l = labels(&c, "h200-node-0").await;
        let (_, alloc) = gpu_resources(&c, "h200-node-0").await;
        (l.get("nvidia.com/gpu.deploy.device-plugin")
            .map(String::as_str)
            == Some("true")
            && alloc.as_deref() == Some("8"))
        .then_some(())
    })
    .await;
    op.stop().await;
    invariants.check().await;
}

/// `nvidia.com/gpu` capacity and allocatable of a node.
async fn gpu_resources(c: &kube::Client, node: &str) -> (Option<String>, Option<String>) {
    let n = Api::<Node>::all(c.clone()).get(node).await.unwrap();
    let st = n.status.unwrap_or_default();
    let get = |m: Option<std::collections::BTreeMap<String, Quantity>>| {
        m.and_then(|m| m.get("nvidia.com/gpu").map(|q| q.0.clone()))
    };
    (get(st.capacity), get(st.allocatable))
}

/// A ResourceClaim with a `gpu.nvidia.com` device allocated on `node` (as the scheduler writes
/// it: results and a node selector).
async fn allocated_claim(c: &kube::Client, node: &str) {
    let api = Api::<ResourceClaim>::namespaced(c.clone(), TEAM);
    let claim: ResourceClaim = serde_json::from_value(json!({
        "metadata": {"name": "vm-claim"},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.nvidia.com"}}]}},
    }))
    .unwrap();
    api.create(&PostParams::default(), &claim).await.unwrap();
    let status = json!({"status": {"allocation": {
        "devices": {"results": [{"request": "gpu", "driver": "gpu.nvidia.com", "pool": node, "device": "gpu-0"}]},
        "nodeSelector": {"nodeSelectorTerms": [{"matchFields": [
            {"key": "metadata.name", "operator": "In", "values": [node]}]}]},
    }}});
    api.patch_status("vm-claim", &PatchParams::default(), &Patch::Merge(&status))
        .await
        .unwrap();
}

/// A policy is Ready only when everything it owns exists: a template whose namespace is missing
/// makes it `Ready=False` (`NamespaceMissing`), and the namespace's creation brings the template
/// at once (a watch event, not the resync, which is set far beyond the wait here).
#[tokio::test]
async fn a_template_waits_for_its_namespace_and_follows_it_at_once() {
    let (g, cluster, _sim) = setup().await;
    let invariants = g.invariants();
    let c = cluster.client.clone();
    let op = Operator::start_with(
        c.clone(),
        gpu_sharing_operator::runtime::controller::Config {
            namespace: Some(NS.into()),
            resync: std::time::Duration::from_secs(600),
            ..Default::default()
        },
    );
    testkit::apply_yaml(&c, include_str!("../examples/dra-mps.yaml"))
        .await
        .unwrap();
    let s = until("dra-mps NamespaceMissing", LONG, || async {
        let s = policy_status(&c, "dra-mps").await?;
        (condition(&s, "Ready")?["reason"] == "NamespaceMissing").then_some(s)
    })
    .await;
    let not_ready = condition(&s, "Ready").unwrap();
    assert_eq!(not_ready["status"], "False");
    assert!(
        not_ready["message"].as_str().unwrap().contains(TEAM),
        "{not_ready}"
    );
    assert!(template(&c).await.is_none());

    let ns: Namespace = serde_json::from_value(json!({"metadata": {"name": TEAM}})).unwrap();
    Api::<Namespace>::all(c.clone())
        .create(&PostParams::default(), &ns)
        .await
        .unwrap();
    until(
        "template and Ready after the namespace appears",
        std::time::Duration::from_secs(30),
        || async {
            template(&c).await?;
            ready(&c, "dra-mps").await
        },
    )
    .await;
    op.stop().await;
    invariants.check().await;
}

/// The GPU Operator's DRA-only mode (`GPUCluster`, no ClusterPolicy): a device-plugin policy is
/// reported `Degraded/GpuClusterPresent` and its nodes are left alone; a DRA policy is served
/// without touching the device-plugin switch (there is no device plugin).
#[tokio::test]
async fn a_gpu_cluster_is_reported_not_fought() {
    let (g, cluster, _sim) = setup().await;
    let invariants = g.invariants();
    let c = cluster.client.clone();
    testkit::apply_yaml(
        &c,
        "apiVersion: apiextensions.k8s.io/v1\nkind: CustomResourceDefinition\nmetadata: {name: gpuclusters.nvidia.com}\nspec:\n  group: nvidia.com\n  scope: Cluster\n  names: {kind: GPUCluster, plural: gpuclusters, singular: gpucluster, listKind: GPUClusterList}\n  versions:\n  - name: v1alpha1\n    served: true\n    storage: true\n    schema: {openAPIV3Schema: {type: object, x-kubernetes-preserve-unknown-fields: true}}\n",
    )
    .await
    .unwrap();
    until("GPUCluster served", LONG, || async {
        testkit::apply_yaml(
            &c,
            "apiVersion: nvidia.com/v1alpha1\nkind: GPUCluster\nmetadata: {name: dra-only}\nspec: {}\n",
        )
        .await
        .ok()
    })
    .await;
    testkit::cluster_policy_api(&c)
        .delete("cluster-policy", &DeleteParams::default())
        .await
        .unwrap();
    let ns: Namespace = serde_json::from_value(json!({"metadata": {"name": TEAM}})).unwrap();
    Api::<Namespace>::all(c.clone())
        .create(&PostParams::default(), &ns)
        .await
        .unwrap();
    let before = labels(&c, "l4-node-0").await;
    let op = Operator::start(c.clone(), Some(NS));
    label_node(&c, "h200-node-0", "gpusharing.io/profile", Some("dra")).await;
    testkit::apply_yaml(&c, include_str!("../examples/dra-mps.yaml"))
        .await
        .unwrap();
    testkit::apply_yaml(&c, include_str!("../examples/time-slicing-l4.yaml"))
        .await
        .unwrap();
    let s = until("time-slicing reports the GPUCluster", LONG, || async {
        let s = policy_status(&c, "l4-time-slicing").await?;
        (condition(&s, "Degraded")?["reason"] == "GpuClusterPresent").then_some(s)
    })
    .await;
    let msg = condition(&s, "Degraded").unwrap()["message"].to_string();
    assert!(msg.contains("dra-only"), "{msg}");
    until("dra-mps Ready", LONG, || ready(&c, "dra-mps")).await;
    let l = labels(&c, "h200-node-0").await;
    assert_eq!(l["gpusharing.io/policy"], "dra-mps");
    assert_ne!(
        l.get("nvidia.com/gpu.deploy.device-plugin")
            .map(String::as_str),
        Some("false"),
        "no device plugin to switch off in DRA-only mode"
    );
    tokio::time::sleep(std::time::Duration::from_secs(2)).await;
    assert_eq!(labels(&c, "l4-node-0").await, before, "left alone");
    // `plan` sees the GPUCluster (and the DRA claims) as the controller does.
    plan_agrees(&c).await;
    op.stop().await;
    invariants.check().await;
}
