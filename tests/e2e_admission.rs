//! End-to-end: field-level least privilege on nodes. With `config/node-admission-policy.yaml`
//! (a ValidatingAdmissionPolicy) on the local control plane, the operator's ServiceAccount may
//! change its own labels and annotations, remove its readiness taint and set
//! `spec.unschedulable`; every other label, annotation, taint, finalizer or the creation of a node
//! is refused with the policy's message. Other users are unaffected, and the operator, run as
//! that ServiceAccount, still converges an example.

mod common;
mod support;

use gpu_sharing_operator::api::names::{MANAGED_ANNOTATIONS, MANAGED_LABELS};
use k8s_openapi::api::core::v1::Node;
use kube::Client;
use kube::api::{Api, Patch, PatchParams};
use serde_json::{Value, json};
use support::allowed::{self, sorted};
use support::*;

const POLICY_FILE: &str = "config/node-admission-policy.yaml";
const NODE: &str = "h200-node-0";

fn policy_docs() -> Vec<Value> {
    let text = std::fs::read_to_string(common::repo_root().join(POLICY_FILE)).unwrap();
    common::parse_yaml_documents(&text).unwrap()
}

/// A CEL list literal of strings, as the policy's variables write them.
fn cel_strings(expr: &str) -> Vec<String> {
    expr.split('\'')
        .skip(1)
        .step_by(2)
        .map(str::to_string)
        .collect()
}

#[test]
fn the_policy_lists_exactly_what_the_operator_manages() {
    let docs = policy_docs();
    let vap = &docs[0];
    let var = |name: &str| {
        vap["spec"]["variables"]
            .as_array()
            .unwrap()
            .iter()
            .find(|v| v["name"] == name)
            .unwrap()["expression"]
            .as_str()
            .unwrap()
            .to_string()
    };
    // Both the policy and the operator's constants against the reviewed list, written once in
    // the test support (neither is compared with the other).
    let sorted_cel = |name: &str| {
        let mut v = cel_strings(&var(name));
        v.sort();
        v
    };
    assert_eq!(sorted_cel("managedLabels"), sorted(&allowed::NODE_LABELS));
    assert_eq!(
        sorted_cel("managedAnnotations"),
        sorted(&allowed::NODE_ANNOTATIONS)
    );
    assert_eq!(sorted(&MANAGED_LABELS), sorted(&allowed::NODE_LABELS));
    assert_eq!(sorted(&MANAGED_ANNOTATIONS), sorted(&allowed::NODE_ANNOTATIONS));
    let taint = cel_strings(&var("readinessTaint"));
    assert_eq!(taint, ["gpusharing.io/unconfigured"]);
    assert!(taint[0].starts_with(allowed::TAINT_PREFIX));
    assert_eq!(
        gpu_sharing_operator::api::names::DEFAULT_READINESS_TAINT,
        taint[0]
    );
    assert_eq!(gpu_sharing_operator::api::names::MANAGER, allowed::FIELD_MANAGER);
    assert_eq!(gpu_sharing_operator::api::names::MANAGED_BY, allowed::CONFIGMAP_OWNER_LABEL);
    assert_eq!(docs[1]["spec"]["policyName"], vap["metadata"]["name"]);
    assert_eq!(docs[1]["spec"]["validationActions"], json!(["Deny"]));
}

async fn patch(c: &Client, name: &str, p: Value, dry_run: bool) -> Result<Node, kube::Error> {
    let pp = PatchParams {
        dry_run,
        ..Default::default()
    };
    Api::<Node>::all(c.clone())
        .patch(name, &pp, &Patch::Merge(&p))
        .await
}

/// The change is refused by the admission policy, with a message containing `says`.
async fn refused(c: &Client, name: &str, p: Value, says: &str) {
    match patch(c, name, p.clone(), false).await {
        Err(kube::Error::Api(e)) => assert!(
            e.message.contains("gpu-sharing-operator-node-fields") && e.message.contains(says),
            "{p}: refused, but with {:?} (wanted {says:?})",
            e.message
        ),
        other => panic!("{p} was not refused: {other:?}"),
    }
}

async fn allowed(c: &Client, name: &str, p: Value) -> Node {
    patch(c, name, p.clone(), false)
        .await
        .unwrap_or_else(|e| panic!("{p} was refused: {e}"))
}

#[tokio::test]
async fn the_operator_account_may_change_only_what_it_manages_on_nodes() {
    let (mut g, cluster, _sim) = setup().await;
    g.unwatched("no operator runs: the test writes the operator's labels by hand, as its account");
    let admin = cluster.client.clone();
    apply_config(&admin, &[POLICY_FILE]).await;
    let sa = service_account_client(&cluster, "gpu-sharing-system", "gpu-sharing-operator").await;

    // The policy takes effect once the API server has loaded it: dry-run until it refuses.
    until("the admission policy to be active", LONG, || {
        let sa = sa.clone();
        async move {
            patch(
                &sa,
                NODE,
                json!({"metadata": {"labels": {"team": "a"}}}),
                true,
            )
            .await
            .is_err()
            .then_some(())
        }
    })
    .await;

    // Its own labels and annotations: set, changed, removed.
    for key in allowed::NODE_LABELS {
        allowed(&sa, NODE, json!({"metadata": {"labels": {key: "x"}}})).await;
        allowed(&sa, NODE, json!({"metadata": {"labels": {key: null}}})).await;
    }
    for key in allowed::NODE_ANNOTATIONS {
        allowed(&sa, NODE, json!({"metadata": {"annotations": {key: "x"}}})).await;
        allowed(&sa, NODE, json!({"metadata": {"annotations": {key: null}}})).await;
    }
    // Through server-side apply too, as the operator writes.
    let apply = json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE,
        "labels": {"gpusharing.io/policy": "p"}, "annotations": {"gpusharing.io/rollout": "1/0/x"}}});
    Api::<Node>::all(sa.clone())
        .patch(
            NODE,
            &PatchParams::apply("gpu-sharing-operator"),
            &Patch::Apply(&apply),
        )
        .await
        .expect("applying its own labels");

    // Anything else on the node is refused, naming what changed.
    refused(
        &sa,
        NODE,
        json!({"metadata": {"labels": {"team": "a"}}}),
        "refused: team",
    )
    .await;
    refused(
        &sa,
        NODE,
        json!({"metadata": {"labels": {"nvidia.com/gpu.product": null}}}),
        "refused: nvidia.com/gpu.product",
    )
    .await;
    refused(
        &sa,
        NODE,
        json!({"metadata": {"labels": {"nvidia.com/gpu.count": "64"}}}),
        "refused: nvidia.com/gpu.count",
    )
    .await;
    refused(
        &sa,
        NODE,
        json!({"metadata": {"annotations": {"example.com/owner": "x"}}}),
        "node annotations; refused: example.com/owner",
    )
    .await;
    refused(
        &sa,
        NODE,
        json!({"metadata": {"finalizers": ["example.com/hold"]}}),
        "finalizers",
    )
    .await;
    refused(
        &sa,
        NODE,
        json!({"spec": {"taints": [{"key": "example.com/x", "effect": "NoSchedule"}]}}),
        "only remove its readiness taint",
    )
    .await;
    refused(
        &sa,
        NODE,
        json!({"spec": {"providerID": "fake://h200"}}),
        "spec.unschedulable",
    )
    .await;
    // A server-side apply to a node that does not exist would create it: RBAC refuses (no
    // `create`), and the policy refuses too even where RBAC is broader.
    let ghost = json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "ghost-node",
        "labels": {"gpusharing.io/policy": "p"}}});
    let create_ghost = || async {
        Api::<Node>::all(sa.clone())
            .patch(
                "ghost-node",
                &PatchParams::apply("gpu-sharing-operator"),
                &Patch::Apply(&ghost),
            )
            .await
    };
    match create_ghost().await {
        Err(kube::Error::Api(e)) => assert!(e.message.contains("cannot create"), "{e:?}"),
        other => panic!("creating a node was not refused: {other:?}"),
    }
    common::apply_yaml(
        &admin,
        r#"
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata: {name: test-node-creator}
rules: [{apiGroups: [""], resources: ["nodes"], verbs: ["create"]}]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {name: test-node-creator}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: test-node-creator}
subjects: [{kind: ServiceAccount, name: gpu-sharing-operator, namespace: gpu-sharing-system}]
"#,
    )
    .await
    .unwrap();
    let denial = until(
        "the admission policy to refuse creating a node",
        LONG,
        || async {
            match create_ghost().await {
                Err(kube::Error::Api(e)) if e.message.contains("may not create nodes") => Some(e),
                Err(kube::Error::Api(e)) if e.message.contains("cannot create") => None,
                other => panic!("creating a node was not refused: {other:?}"),
            }
        },
    )
    .await;
    assert!(
        denial.message.contains("gpu-sharing-operator-node-fields"),
        "{denial:?}"
    );
    Api::<k8s_openapi::api::rbac::v1::ClusterRoleBinding>::all(admin.clone())
        .delete("test-node-creator", &Default::default())
        .await
        .unwrap();

    // Drains: cordon and uncordon.
    let n = allowed(&sa, NODE, json!({"spec": {"unschedulable": true}})).await;
    assert_eq!(n.spec.unwrap().unschedulable, Some(true));
    allowed(&sa, NODE, json!({"spec": {"unschedulable": null}})).await;

    // Taints are one list: the readiness taint may go, other taints stay as they are.
    let taints = json!([
        {"key": "gpusharing.io/unconfigured", "effect": "NoSchedule"},
        {"key": "example.com/keep", "value": "1", "effect": "NoExecute"}
    ]);
    patch(&admin, NODE, json!({"spec": {"taints": taints}}), false)
        .await
        .unwrap();
    refused(
        &sa,
        NODE,
        json!({"spec": {"taints": [{"key": "gpusharing.io/unconfigured", "effect": "NoSchedule"}]}}),
        "only remove its readiness taint",
    )
    .await;
    let n = allowed(
        &sa,
        NODE,
        json!({"spec": {"taints": [{"key": "example.com/keep", "value": "1", "effect": "NoExecute"}]}}),
    )
    .await;
    let keys: Vec<String> = n
        .spec
        .unwrap()
        .taints
        .unwrap()
        .into_iter()
        .map(|t| t.key)
        .collect();
    assert_eq!(keys, ["example.com/keep"]);

    // Other users are not affected.
    patch(
        &admin,
        NODE,
        json!({"metadata": {"labels": {"team": "a"}}}),
        false,
    )
    .await
    .expect("the admin may label nodes");
    patch(&admin, NODE, json!({"spec": {"taints": null}}), false)
        .await
        .unwrap();

    // The operator itself, as that ServiceAccount, converges an example under the policy.
    let kubeconfig =
        service_account_kubeconfig_file(&cluster, "gpu-sharing-system", "gpu-sharing-operator")
            .await;
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("operator.log");
    let mut op = tokio::process::Command::new(env!("CARGO_BIN_EXE_gpu-sharing-operator"))
        .args(["run", "--namespace=gpu-operator", "--metrics-addr="])
        .env("KUBECONFIG", &kubeconfig)
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    common::apply_yaml(&admin, include_str!("../examples/mps-h200.yaml"))
        .await
        .unwrap();
    ready_on_or_log(&admin, "h200-mps", 1, &log).await;
    let text = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(
        !text.contains("gpu-sharing-operator-node-fields"),
        "the operator hit the policy:\n{text}"
    );
    op.kill().await.unwrap();
}
