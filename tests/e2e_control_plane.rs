//! The local control plane the other e2e tests run against: kube-local starts,
//! serves the GPU Operator's ClusterPolicy CRD with a ready `cluster-policy`
//! in the configured namespace, and has the simulated GPU nodes.

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::api::core::v1::{ConfigMap, Namespace, Node};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, ListParams};
use testkit::*;

fn label<'a>(node: &'a Node, key: &str) -> Option<&'a str> {
    node.metadata.labels.as_ref()?.get(key).map(String::as_str)
}

fn quantity(node: &Node, field: &str, resource: &str) -> Option<String> {
    let status = node.status.as_ref()?;
    let map = match field {
        "capacity" => status.capacity.as_ref()?,
        _ => status.allocatable.as_ref()?,
    };
    map.get(resource).map(|q| q.0.clone())
}

async fn assert_gpu_operator(cluster: &TestCluster, namespace: &str) {
    let client = &cluster.client;

    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    let crd = crds
        .get("clusterpolicies.nvidia.com")
        .await
        .expect("ClusterPolicy CRD");
    assert_eq!(crd.spec.group, "nvidia.com");
    assert_eq!(crd.spec.scope, "Cluster");
    wait_crd_established(
        client,
        "clusterpolicies.nvidia.com",
        Duration::from_secs(10),
    )
    .await
    .unwrap();

    let policies = cluster_policy_api(client)
        .list(&ListParams::default())
        .await
        .expect("list ClusterPolicies");
    assert_eq!(policies.items.len(), 1, "exactly one ClusterPolicy");
    let cp = cluster_policy_api(client)
        .get("cluster-policy")
        .await
        .expect("cluster-policy");
    assert_eq!(
        cp.data["status"]["namespace"], namespace,
        "status.namespace: {:?}",
        cp.data["status"]
    );
    assert_eq!(cp.data["status"]["state"], "ready");
    let spec = &cp.data["spec"];
    assert_eq!(spec["devicePlugin"]["enabled"], true);
    assert_eq!(spec["migManager"]["enabled"], true);
    assert_eq!(spec["mig"]["strategy"], "single");

    let namespaces: Api<Namespace> = Api::all(client.clone());
    namespaces
        .get(namespace)
        .await
        .expect("operator namespace exists");
    let cms: Api<ConfigMap> = Api::namespaced(client.clone(), namespace);
    let mig = cms
        .get("default-mig-parted-config")
        .await
        .expect("default-mig-parted-config");
    let config = mig
        .data
        .unwrap_or_default()
        .remove("config.yaml")
        .expect("config.yaml key");
    assert!(
        config.contains("all-disabled:"),
        "mig-parted config lists all-disabled"
    );
}

async fn assert_nodes(cluster: &TestCluster) {
    let nodes: Api<Node> = Api::all(cluster.client.clone());
    let list = nodes
        .list(&ListParams::default())
        .await
        .expect("list nodes");
    let by_name: BTreeMap<String, Node> = list
        .items
        .into_iter()
        .map(|n| (n.metadata.name.clone().unwrap_or_default(), n))
        .collect();
    for name in [
        "h200-node-0",
        "l4-node-0",
        "l4-node-1",
        "a100-node-0",
        "a100-node-1",
        "cpu-node-0",
    ] {
        assert!(
            by_name.contains_key(name),
            "node {name} seeded; have {:?}",
            by_name.keys()
        );
    }

    let h200 = &by_name["h200-node-0"];
    assert_eq!(label(h200, "nvidia.com/gpu.product"), Some("NVIDIA-H200"));
    assert_eq!(label(h200, "nvidia.com/gpu.count"), Some("8"));
    assert_eq!(label(h200, "nvidia.com/gpu.memory"), Some("143771"));
    assert_eq!(label(h200, "nvidia.com/gpu.family"), Some("hopper"));
    assert_eq!(label(h200, "nvidia.com/gpu.replicas"), Some("1"));
    assert_eq!(label(h200, "nvidia.com/gpu.sharing-strategy"), Some("none"));
    assert_eq!(label(h200, "nvidia.com/mps.capable"), Some("false"));
    assert_eq!(label(h200, "nvidia.com/gpu.present"), Some("true"));
    assert_eq!(
        quantity(h200, "allocatable", "nvidia.com/gpu").as_deref(),
        Some("8")
    );
    assert_eq!(
        quantity(h200, "capacity", "nvidia.com/gpu").as_deref(),
        Some("8")
    );

    let l4 = &by_name["l4-node-1"];
    assert_eq!(label(l4, "nvidia.com/gpu.product"), Some("NVIDIA-L4"));
    assert_eq!(label(l4, "nvidia.com/gpu.memory"), Some("23034"));
    assert_eq!(label(l4, "nvidia.com/mig.capable"), Some("false"));
    assert_eq!(
        quantity(l4, "allocatable", "nvidia.com/gpu").as_deref(),
        Some("4")
    );

    let a100 = &by_name["a100-node-0"];
    assert_eq!(
        label(a100, "nvidia.com/gpu.product"),
        Some("NVIDIA-A100-SXM4-80GB")
    );
    assert_eq!(label(a100, "nvidia.com/gpu.memory"), Some("81920"));
    assert_eq!(label(a100, "nvidia.com/mig.capable"), Some("true"));
    assert_eq!(label(a100, "nvidia.com/gpu.compute.major"), Some("8"));

    let ready = |n: &Node| {
        n.status
            .as_ref()
            .and_then(|s| s.conditions.as_ref())
            .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
    };
    assert!(by_name.values().all(ready), "all nodes Ready");
    let cpu = &by_name["cpu-node-0"];
    assert_eq!(label(cpu, "nvidia.com/gpu.present"), None);
    assert_eq!(quantity(cpu, "allocatable", "nvidia.com/gpu"), None);
}

#[tokio::test]
async fn default_cluster_has_gpu_operator_and_gpu_nodes() {
    let cluster = TestCluster::start().await;
    assert_gpu_operator(&cluster, "gpu-operator").await;
    assert_nodes(&cluster).await;

    // The helpers work on what tests will do: label a node, apply YAML with
    // a CRD followed by one of its objects.
    set_node_labels(
        &cluster.client,
        "l4-node-0",
        &[("gpusharing.io/profile", Some("ts-4"))],
    )
    .await
    .unwrap();
    let nodes: Api<Node> = Api::all(cluster.client.clone());
    let n = nodes.get("l4-node-0").await.unwrap();
    assert_eq!(label(&n, "gpusharing.io/profile"), Some("ts-4"));
    set_node_labels(
        &cluster.client,
        "l4-node-0",
        &[("gpusharing.io/profile", None)],
    )
    .await
    .unwrap();
    let n = nodes.get("l4-node-0").await.unwrap();
    assert_eq!(label(&n, "gpusharing.io/profile"), None);

    let applied = apply_yaml(
        &cluster.client,
        r#"
apiVersion: apiextensions.k8s.io/v1
kind: CustomResourceDefinition
metadata:
  name: widgets.example.test
spec:
  group: example.test
  names: {kind: Widget, plural: widgets, singular: widget, listKind: WidgetList}
  scope: Namespaced
  versions:
  - name: v1
    served: true
    storage: true
    subresources: {status: {}}
    schema:
      openAPIV3Schema:
        type: object
        properties:
          spec: {type: object, properties: {size: {type: integer, minimum: 1}}}
          status: {type: object, properties: {phase: {type: string}}}
---
apiVersion: example.test/v1
kind: Widget
metadata: {name: w1, namespace: gpu-operator}
spec: {size: 3}
status: {phase: Done}
"#,
    )
    .await
    .expect("apply CRD and object");
    assert_eq!(applied.len(), 2);
    assert_eq!(applied[1].data["spec"]["size"], 3);
    assert_eq!(applied[1].data["status"]["phase"], "Done");
    // The CRD schema is enforced.
    let err = apply_yaml(
        &cluster.client,
        "apiVersion: example.test/v1\nkind: Widget\nmetadata: {name: w2}\nspec: {size: 0}\n",
    )
    .await
    .expect_err("size 0 is invalid");
    assert!(format!("{err:#}").contains("size"), "{err:#}");
}

#[tokio::test]
async fn gpu_operator_namespace_is_selectable() {
    let cluster =
        TestCluster::start_with(ClusterOptions::default().namespace("nvidia-gpu-operator")).await;
    assert_gpu_operator(&cluster, "nvidia-gpu-operator").await;
    assert_nodes(&cluster).await;
    let namespaces: Api<Namespace> = Api::all(cluster.client.clone());
    assert!(
        namespaces.get_opt("gpu-operator").await.unwrap().is_none(),
        "only the chosen namespace is created"
    );
}

#[tokio::test]
async fn bare_cluster_without_seeding() {
    let cluster = TestCluster::start_with(
        ClusterOptions::default()
            .without_nodes()
            .without_gpu_operator(),
    )
    .await;
    let nodes: Api<Node> = Api::all(cluster.client.clone());
    assert!(
        nodes
            .list(&ListParams::default())
            .await
            .unwrap()
            .items
            .is_empty()
    );
    let crds: Api<CustomResourceDefinition> = Api::all(cluster.client.clone());
    assert!(
        crds.get_opt("clusterpolicies.nvidia.com")
            .await
            .unwrap()
            .is_none()
    );
}

// Two tests on the process-wide shared cluster, each with its own runtime:
// clients must be made per test (`SharedCluster::client`).
#[tokio::test]
async fn shared_cluster_first_user() {
    let shared = TestCluster::shared();
    let nodes: Api<Node> = Api::all(shared.client().await);
    assert!(
        nodes.get("h200-node-0").await.is_ok(),
        "{}",
        shared.log_tail()
    );
}

#[tokio::test]
async fn shared_cluster_second_user() {
    let shared = TestCluster::shared();
    let client = shared.client().await;
    let cp = cluster_policy_api(&client)
        .get("cluster-policy")
        .await
        .unwrap();
    assert_eq!(
        cp.data["status"]["namespace"],
        shared.gpu_operator_namespace.as_str()
    );
}
