//! End-to-end: the controller against a real kube-apiserver + etcd (tests/cluster), with the
//! NVIDIA node-component simulator (tests/nvidia) playing the device plugin, GFD and MIG manager.
//!
//! Each test gets its own control plane; they run one at a time (a 2-core machine).

mod support;

use std::time::Duration;

use gpu_sharing_operator::api::crd::GpuSharingPolicy;
use gpu_sharing_operator::api::names::FINALIZER;
use gpu_sharing_operator::runtime::controller;
use k8s_openapi::api::core::v1::{ConfigMap, Node};
use kube::ResourceExt;
use kube::api::{Api, DeleteParams, DynamicObject, Patch, PatchParams, PostParams};
use serde_json::json;
use support::*;

#[tokio::test]
async fn mps_on_h200_end_to_end() {
    let (_g, cluster, _sim) = setup().await;
    let c = cluster.client.clone();
    let op = Operator::start(c.clone(), None);
    testkit::apply_yaml(&c, include_str!("../examples/mps-h200.yaml"))
        .await
        .unwrap();

    let status = until("h200-mps Ready", LONG, || ready(&c, "h200-mps")).await;
    // The ConfigMap key holds NVIDIA's MPS config.
    let key = status["deviceConfigKey"].as_str().unwrap().to_string();
    let data = configmap_data(&c, DP_CM).await.unwrap();
    let cfg: serde_json::Value = gpu_sharing_operator::api::yaml::from_str(&data[&key]).unwrap();
    assert_eq!(
        cfg["sharing"]["mps"]["resources"][0]["name"],
        "nvidia.com/gpu"
    );
    assert_eq!(cfg["sharing"]["mps"]["resources"][0]["replicas"], 4);
    assert!(data.contains_key("default"));
    // ClusterPolicy points at it.
    let cp = cluster_policy(&c).await;
    assert_eq!(cp["spec"]["devicePlugin"]["config"]["name"], DP_CM);
    assert_eq!(cp["spec"]["devicePlugin"]["config"]["default"], "default");
    // The node is labelled; the simulated device plugin advertises 8 x 4.
    assert_eq!(
        labels(&c, "h200-node-0").await["nvidia.com/device-plugin.config"],
        key
    );
    let alloc = until("allocatable 32", LONG, || async {
        let n = Api::<Node>::all(c.clone()).get("h200-node-0").await.ok()?;
        let q = n.status?.allocatable?.get("nvidia.com/gpu")?.0.clone();
        (q == "32").then_some(q)
    })
    .await;
    assert_eq!(alloc, "32");
    let status = until("GFD agrees", LONG, || ready_on(&c, "h200-mps", 1)).await;
    assert_eq!(status["capacity"]["physicalGpus"], 8);
    assert_eq!(status["capacity"]["schedulableReplicas"], 32);
    assert_eq!(status["capacity"]["memoryPerClientMib"], 35942);
    assert_eq!(status["capacity"]["threadsPerClientPercent"], 25);
    assert_eq!(status["nodes"], "1/1");
    assert_eq!(
        condition(&status, "Ready").unwrap()["observedGeneration"],
        1
    );
    let l = labels(&c, "h200-node-0").await;
    assert_eq!(l["nvidia.com/gpu.sharing-strategy"], "mps");
    assert_eq!(l["nvidia.com/gpu.replicas"], "4");
    // `kubectl get gsp -o wide`: the API server's Table, whose priority-1 columns kubectl shows
    // only with -o wide.
    let wide = get_wide(&c, "h200-mps").await;
    assert_eq!(wide["Strategy"], (json!("mps"), 0));
    assert_eq!(wide["Nodes"], (json!("1/1"), 0));
    assert_eq!(wide["Ready"], (json!("True"), 0));
    assert_eq!(wide["Schedulable"], (json!(32), 1));
    assert_eq!(wide["MiB/Client"], (json!(35942), 1));
    assert_eq!(wide["Progress"], (json!("Idle"), 1));
    assert_eq!(wide["Config"], (json!(key), 1));
    plan_agrees(&c).await;
    op.stop().await;
}

/// One policy's row of the Table `kubectl get gsp` asks the API server for: column name ->
/// (cell, column priority).
async fn get_wide(
    c: &kube::Client,
    name: &str,
) -> std::collections::BTreeMap<String, (serde_json::Value, i64)> {
    let req = http::Request::get(format!(
        "/apis/gpusharing.io/v1alpha1/gpusharingpolicies/{name}"
    ))
    .header("Accept", "application/json;as=Table;v=v1;g=meta.k8s.io")
    .body(Vec::new())
    .unwrap();
    let table: serde_json::Value = c.request(req).await.unwrap();
    let columns = table["columnDefinitions"].as_array().unwrap();
    let cells = table["rows"][0]["cells"].as_array().unwrap();
    columns
        .iter()
        .zip(cells)
        .map(|(col, cell)| {
            (
                col["name"].as_str().unwrap().to_string(),
                (cell.clone(), col["priority"].as_i64().unwrap_or(0)),
            )
        })
        .collect()
}

#[tokio::test]
async fn time_slicing_profiles_by_node_label_and_relabel_moves_nodes() {
    let (_g, cluster, _sim) = setup().await;
    let c = cluster.client.clone();
    let op = Operator::start(c.clone(), Some(NS));
    testkit::apply_yaml(&c, include_str!("../examples/time-slicing-l4.yaml"))
        .await
        .unwrap();
    label_node(&c, "l4-node-1", "gpusharing.io/profile", Some("l4-heavy")).await;

    let ts = until("l4-time-slicing Ready", LONG, || {
        ready(&c, "l4-time-slicing")
    })
    .await;
    let heavy = until("l4-heavy Ready", LONG, || ready(&c, "l4-heavy")).await;
    let ts_key = ts["deviceConfigKey"].as_str().unwrap().to_string();
    let heavy_key = heavy["deviceConfigKey"].as_str().unwrap().to_string();
    assert_eq!(
        labels(&c, "l4-node-0").await["nvidia.com/device-plugin.config"],
        ts_key
    );
    assert_eq!(
        labels(&c, "l4-node-1").await["nvidia.com/device-plugin.config"],
        heavy_key
    );
    // l4-time-slicing also selects l4-node-1 but loses it to the higher priority: the
    // documented per-node profile pattern, an override rather than a conflict.
    assert_eq!(ts["nodes"], "1/2");
    assert_eq!(condition(&ts, "Conflicted").unwrap()["status"], "False");
    assert_eq!(condition(&ts, "Overridden").unwrap()["status"], "True");
    assert_eq!(
        condition(&ts, "Overridden").unwrap()["reason"],
        "HigherPriorityPolicy"
    );
    assert!(
        condition(&ts, "Overridden").unwrap()["message"]
            .as_str()
            .unwrap()
            .contains("l4-node-1 (overridden by l4-heavy)")
    );
    assert_eq!(ts["overriddenNodes"], 1);
    let data = configmap_data(&c, DP_CM).await.unwrap();
    assert!(data[&heavy_key].contains("replicas: 8"));
    assert!(data[&ts_key].contains("replicas: 4"));
    assert!(data[&ts_key].contains("failRequestsGreaterThanOne: true"));

    // Relabel: l4-node-0 moves to l4-heavy, l4-node-1 back to the default profile.
    label_node(&c, "l4-node-0", "gpusharing.io/profile", Some("l4-heavy")).await;
    label_node(&c, "l4-node-1", "gpusharing.io/profile", None).await;
    until("nodes moved", LONG, || async {
        let a = labels(&c, "l4-node-0").await;
        let b = labels(&c, "l4-node-1").await;
        (a.get("nvidia.com/device-plugin.config") == Some(&heavy_key)
            && b.get("nvidia.com/device-plugin.config") == Some(&ts_key))
        .then_some(())
    })
    .await;
    plan_agrees(&c).await;
    op.stop().await;
}

#[tokio::test]
async fn delete_cleans_up_and_drift_is_repaired() {
    let (g, cluster, _sim) = setup().await;
    let c = cluster.client.clone();
    let op = Operator::start(c.clone(), Some(NS));
    testkit::apply_yaml(&c, include_str!("../examples/mps-h200.yaml"))
        .await
        .unwrap();
    let s = until("Ready", LONG, || ready(&c, "h200-mps")).await;
    let key = s["deviceConfigKey"].as_str().unwrap().to_string();
    let p = Api::<GpuSharingPolicy>::all(c.clone())
        .get("h200-mps")
        .await
        .unwrap();
    assert!(p.finalizers().contains(&FINALIZER.to_string()));

    // Drift: a hand edit of the label, the key and the ClusterPolicy reference is put back.
    g.invariants()
        .hand_edit("label, config key and ClusterPolicy reference edited")
        .await;
    label_node(
        &c,
        "h200-node-0",
        "nvidia.com/device-plugin.config",
        Some("hand-edited"),
    )
    .await;
    let cms: Api<ConfigMap> = Api::namespaced(c.clone(), NS);
    let patch = json!({"data": {key.clone(): "version: v1\n"}});
    cms.patch(DP_CM, &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .unwrap();
    let cp_api: Api<DynamicObject> =
        Api::all_with(c.clone(), &controller::cluster_policy_resource());
    let patch = json!({"spec": {"devicePlugin": {"config": {"name": "someone-else"}}}});
    cp_api
        .patch(
            "cluster-policy",
            &PatchParams::default(),
            &Patch::Merge(&patch),
        )
        .await
        .unwrap();
    until("drift repaired", LONG, || async {
        let l = labels(&c, "h200-node-0").await;
        let data = configmap_data(&c, DP_CM).await?;
        let cp = cluster_policy(&c).await;
        (l.get("nvidia.com/device-plugin.config") == Some(&key)
            && data.get(&key).is_some_and(|t| t.contains("mps"))
            && cp["spec"]["devicePlugin"]["config"]["name"] == DP_CM)
            .then_some(())
    })
    .await;
    g.invariants().repaired(LONG).await;
    // A label we do not own stays.
    label_node(&c, "h200-node-0", "team", Some("research")).await;

    // Delete: labels, key and the ClusterPolicy reference go; the policy is released.
    Api::<GpuSharingPolicy>::all(c.clone())
        .delete("h200-mps", &DeleteParams::default())
        .await
        .unwrap();
    until("policy gone", LONG, || async {
        Api::<GpuSharingPolicy>::all(c.clone())
            .get_opt("h200-mps")
            .await
            .unwrap()
            .is_none()
            .then_some(())
    })
    .await;
    let l = labels(&c, "h200-node-0").await;
    assert!(!l.contains_key("nvidia.com/device-plugin.config"), "{l:?}");
    assert!(!l.contains_key("gpusharing.io/policy"));
    assert_eq!(l["team"], "research");
    until("key and reference removed", LONG, || async {
        let data = configmap_data(&c, DP_CM).await?;
        let cp = cluster_policy(&c).await;
        (!data.contains_key(&key)
            && cp["spec"]["devicePlugin"]
                .get("config")
                .is_none_or(|c| c.get("name").is_none()))
        .then_some(())
    })
    .await;
    op.stop().await;
}

#[tokio::test]
async fn invalid_policies_rejected_or_reported_without_touching_nodes() {
    let (_g, cluster, _sim) = setup().await;
    let c = cluster.client.clone();
    let api: Api<GpuSharingPolicy> = Api::all(c.clone());
    // Admission (schema + CEL) rejects what it can, with the field and message.
    let bad: GpuSharingPolicy = gpu_sharing_operator::api::yaml::from_str(
        "apiVersion: gpusharing.io/v1alpha1\nkind: GpuSharingPolicy\nmetadata: {name: bad}\nspec: {nodeSelector: {}, strategy: mps, mps: {replicas: 4}, mig: {migStrategy: single, layout: all-1g.10gb}}",
    )
    .unwrap();
    let err = api
        .create(&PostParams::default(), &bad)
        .await
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("spec.mig must be set when, and only when, strategy is mig"),
        "{err}"
    );
    let bad: GpuSharingPolicy = gpu_sharing_operator::api::yaml::from_str(
        "apiVersion: gpusharing.io/v1alpha1\nkind: GpuSharingPolicy\nmetadata: {name: bad}\nspec: {nodeSelector: {}, strategy: timeSlicing, timeSlicing: {replicas: 1}}",
    )
    .unwrap();
    let err = api
        .create(&PostParams::default(), &bad)
        .await
        .unwrap_err()
        .to_string();
    assert!(err.contains("spec.timeSlicing.replicas"), "{err}");

    // What admission cannot know (the node's GPU) is reported, and the node is left alone.
    let op = Operator::start(c.clone(), Some(NS));
    label_node(&c, "l4-node-0", "gpusharing.io/profile", Some("mig")).await;
    testkit::apply_yaml(
        &c,
        "apiVersion: gpusharing.io/v1alpha1\nkind: GpuSharingPolicy\nmetadata: {name: mig-on-l4}\nspec: {nodeSelector: {matchLabels: {gpusharing.io/profile: mig}}, strategy: mig, mig: {migStrategy: single, layout: all-1g.10gb}}",
    )
    .await
    .unwrap();
    let before = labels(&c, "l4-node-0").await;
    let s = until("Accepted=False", LONG, || async {
        let s = policy_status(&c, "mig-on-l4").await?;
        (condition(&s, "Accepted")?["status"] == "False").then_some(s)
    })
    .await;
    let a = condition(&s, "Accepted").unwrap();
    assert_eq!(a["reason"], "IncompatibleNodes");
    assert!(
        a["message"]
            .as_str()
            .unwrap()
            .contains("does not support MIG"),
        "{a}"
    );
    tokio::time::sleep(Duration::from_secs(2)).await;
    let after = labels(&c, "l4-node-0").await;
    assert_eq!(
        before.get("nvidia.com/mig.config"),
        after.get("nvidia.com/mig.config")
    );
    assert_eq!(
        before.get("nvidia.com/device-plugin.config"),
        after.get("nvidia.com/device-plugin.config")
    );
    op.stop().await;
}

#[tokio::test]
async fn restart_midway_converges_and_steady_state_writes_nothing() {
    let (_g, cluster, _sim) = setup().await;
    let c = cluster.client.clone();
    testkit::apply_yaml(&c, include_str!("../examples/time-slicing-l4.yaml"))
        .await
        .unwrap();
    testkit::apply_yaml(&c, include_str!("../examples/mps-h200.yaml"))
        .await
        .unwrap();
    let op = Operator::start(c.clone(), None);
    // Stop as soon as something was written, then start a fresh operator.
    until("first writes", LONG, || async {
        configmap_data(&c, DP_CM).await
    })
    .await;
    op.stop().await;
    let op = Operator::start(c.clone(), None);
    for name in ["l4-time-slicing", "h200-mps"] {
        until(name, LONG, || ready(&c, name)).await;
    }
    // Steady state: whole passes write nothing, as kube-apiserver counts writes.
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_nothing_written_at_rest(&c, "l4-time-slicing", || async { op.passes() }).await;
    op.stop().await;
}

#[tokio::test]
async fn namespace_is_detected_from_the_cluster_policy() {
    // OpenShift installs the GPU Operator in nvidia-gpu-operator; a ConfigMap in gpu-operator
    // would be silently ignored there. No --namespace: the operator reads status.namespace.
    let (_g, cluster, _sim) =
        setup_with(testkit::ClusterOptions::default().namespace("nvidia-gpu-operator")).await;
    let c = cluster.client.clone();
    let op = Operator::start(c.clone(), None);
    testkit::apply_yaml(&c, include_str!("../examples/mps-h200.yaml"))
        .await
        .unwrap();
    let s = until("Ready", LONG, || ready_on(&c, "h200-mps", 1)).await;
    let key = s["deviceConfigKey"].as_str().unwrap();
    let data = configmap_data_in(&c, "nvidia-gpu-operator", DP_CM)
        .await
        .expect("ConfigMap in nvidia-gpu-operator");
    assert!(data.contains_key(key));
    assert!(
        configmap_data_in(&c, "gpu-operator", DP_CM).await.is_none(),
        "nothing in the wrong namespace"
    );
    op.stop().await;
}

#[tokio::test]
async fn policy_crd_round_trip() {
    let (_g, cluster, _sim) = setup().await;
    let c = cluster.client.clone();
    let api: Api<GpuSharingPolicy> = Api::all(c.clone());
    for f in [
        include_str!("../examples/mps-h200.yaml"),
        include_str!("../examples/mig-custom-split.yaml"),
        include_str!("../examples/mig-1g10gb-time-sliced.yaml"),
    ] {
        let sent: GpuSharingPolicy = gpu_sharing_operator::api::yaml::from_str(f).unwrap();
        api.create(&PostParams::default(), &sent).await.unwrap();
        let back = api.get(&sent.name_any()).await.unwrap();
        assert_eq!(
            back.spec, sent.spec,
            "spec survives the API server unchanged"
        );
    }
    // `kubectl get gsp` columns come from the CRD.
    let crds: Api<k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition> =
        Api::all(c.clone());
    let crd = crds.get("gpusharingpolicies.gpusharing.io").await.unwrap();
    let cols = |wide: bool| -> Vec<String> {
        crd.spec.versions[0]
            .additional_printer_columns
            .iter()
            .flatten()
            .filter(|c| (c.priority.unwrap_or(0) > 0) == wide)
            .map(|c| c.name.clone())
            .collect()
    };
    assert_eq!(
        cols(false),
        ["Strategy", "Replicas", "Nodes", "Ready", "Age"]
    );
    // `-o wide` adds these.
    assert_eq!(
        cols(true),
        [
            "Schedulable",
            "MiB/Client",
            "Progress",
            "Config",
            "MIG",
            "vGPU"
        ]
    );
    assert_eq!(crd.spec.names.short_names, Some(vec!["gsp".to_string()]));
}

#[tokio::test]
async fn a_controller_reverting_the_cluster_policy_is_reported() {
    let (_g, cluster, _sim) = setup().await;
    let c = cluster.client.clone();
    let op = Operator::start(c.clone(), Some(NS));
    testkit::apply_yaml(&c, include_str!("../examples/mps-h200.yaml"))
        .await
        .unwrap();
    until("Ready", LONG, || ready(&c, "h200-mps")).await;
    // A GitOps tool puts its own value back, again and again.
    let cp_api: Api<DynamicObject> =
        Api::all_with(c.clone(), &controller::cluster_policy_resource());
    for i in 0..3 {
        let patch = json!({"spec": {"devicePlugin": {"config": {"name": format!("gitops-{i}")}}}});
        let pp = PatchParams {
            field_manager: Some("argocd".into()),
            ..Default::default()
        };
        cp_api
            .patch("cluster-policy", &pp, &Patch::Merge(&patch))
            .await
            .unwrap();
        until("repaired", LONG, || async {
            (cluster_policy(&c).await["spec"]["devicePlugin"]["config"]["name"] == DP_CM)
                .then_some(())
        })
        .await;
    }
    let s = until("Degraded ClusterPolicyContested", LONG, || async {
        let s = policy_status(&c, "h200-mps").await?;
        (condition(&s, "Degraded")?["reason"] == "ClusterPolicyContested").then_some(s)
    })
    .await;
    let msg = condition(&s, "Degraded").unwrap()["message"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(msg.contains("spec.devicePlugin.config.name"), "{msg}");
    op.stop().await;
}

/// The node cache keeps only the labels the planner reads (NVIDIA's, ours, and the keys the
/// policies select on). A policy that selects on a label no policy selected on before makes the
/// operator list the nodes again, and plan only once it has: the new policy gets its node, and
/// no other node's config changes on the way (a node missing the label would look unselected).
#[tokio::test]
async fn a_policy_selecting_on_a_new_label_key_gets_its_nodes_and_disturbs_none() {
    let (_g, cluster, _sim) = setup().await;
    let c = cluster.client.clone();
    // An admin's label the operator has never needed.
    label_node(&c, "l4-node-1", "team.example.com/pool", Some("inference")).await;
    let op = Operator::start(c.clone(), Some(NS));
    testkit::apply_yaml(
        &c,
        "apiVersion: gpusharing.io/v1alpha1\nkind: GpuSharingPolicy\nmetadata: {name: l4-all}\nspec: {nodeSelector: {matchLabels: {nvidia.com/gpu.product: NVIDIA-L4}}, strategy: timeSlicing, timeSlicing: {replicas: 4}}",
    )
    .await
    .unwrap();
    let all_key = ready_on_or_log(&c, "l4-all", 2, &cluster.log).await["deviceConfigKey"]
        .as_str()
        .unwrap()
        .to_string();
    let kept = LabelHistory::start(&c, "l4-node-0").await;

    testkit::apply_yaml(
        &c,
        "apiVersion: gpusharing.io/v1alpha1\nkind: GpuSharingPolicy\nmetadata: {name: inference-pool}\nspec: {priority: 10, nodeSelector: {matchLabels: {team.example.com/pool: inference}}, strategy: timeSlicing, timeSlicing: {replicas: 2}}",
    )
    .await
    .unwrap();
    let pool = ready_on_or_log(&c, "inference-pool", 1, &cluster.log).await;
    let pool_key = pool["deviceConfigKey"].as_str().unwrap().to_string();
    assert_ne!(pool_key, all_key);
    until_labelled(
        &c,
        "l4-node-1",
        "nvidia.com/device-plugin.config",
        &pool_key,
    )
    .await;
    ready_on_or_log(&c, "l4-all", 1, &cluster.log).await;
    let states = kept.states();
    assert!(
        states.iter().all(
            |l| l.get("nvidia.com/device-plugin.config") == Some(&all_key)
                && l.get("gpusharing.io/policy").map(String::as_str) == Some("l4-all")
        ),
        "l4-node-0 left its policy on the way: {states:?}"
    );
    op.stop().await;
}
