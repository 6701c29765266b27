//! End-to-end: the DRA backend renders ResourceClaimTemplates (resource.k8s.io/v1, served by
//! the local kube-apiserver 1.35), keeps them in step with the policy, reports invalid driver
//! settings without rendering anything, and removes them with the policy.

mod common;
mod support;

use gpu_sharing_operator::api::crd::GpuSharingPolicy;
use k8s_openapi::api::core::v1::Namespace;
use k8s_openapi::api::resource::v1::ResourceClaimTemplate;
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
    let (_g, cluster, _sim) = setup().await;
    let c = cluster.client.clone();
    let ns: Namespace = serde_json::from_value(json!({"metadata": {"name": TEAM}})).unwrap();
    Api::<Namespace>::all(c.clone())
        .create(&PostParams::default(), &ns)
        .await
        .unwrap();
    let op = Operator::start(c.clone(), Some(NS));
    label_node(&c, "h200-node-0", "gpusharing.io/profile", Some("dra")).await;
    common::apply_yaml(&c, include_str!("../examples/dra-mps.yaml"))
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
    common::apply_yaml(
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
    op.stop().await;
}

/// A policy is Ready only when everything it owns exists: a template whose namespace is missing
/// makes it `Ready=False` (`NamespaceMissing`), and the namespace's creation brings the template
/// at once (a watch event, not the resync, which is set far beyond the wait here).
#[tokio::test]
async fn a_template_waits_for_its_namespace_and_follows_it_at_once() {
    let (_g, cluster, _sim) = setup().await;
    let c = cluster.client.clone();
    let op = Operator::start_with(
        c.clone(),
        gpu_sharing_operator::runtime::controller::Config {
            namespace: Some(NS.into()),
            resync: std::time::Duration::from_secs(600),
            ..Default::default()
        },
    );
    common::apply_yaml(&c, include_str!("../examples/dra-mps.yaml"))
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
}
