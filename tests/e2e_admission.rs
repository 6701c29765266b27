//! End-to-end: field-level least privilege on nodes and on the GPU Operator's ClusterPolicy.
//! With `config/node-admission-policy.yaml` (a ValidatingAdmissionPolicy) on the local control
//! plane, the operator's ServiceAccount may change its own labels and annotations, remove its
//! readiness taint and cordon a node for a drain only as it does (`spec.unschedulable` on a GPU
//! node together with its cordon annotation, lifted only with that annotation: a CPU node, a
//! cordon without the mark or lifting an admin's cordon is refused); every other label,
//! annotation, taint, finalizer or the creation of a node is refused with the policy's message,
//! and the operator, run as that account, drains a node under the policy. With
//! `config/clusterpolicy-admission-policy.yaml` it may change only the ClusterPolicy fields it
//! manages (`allowed::CLUSTER_POLICY_FIELDS`, which is also exactly what the operator's output
//! code writes); any other spec or metadata change, creating, deleting or a status write is
//! refused naming what changed. Other users are unaffected, and the operator, run as that
//! ServiceAccount under both policies, still converges the examples and releases the
//! ClusterPolicy when the last policy goes.

mod support;

use std::collections::BTreeSet;

use gpu_sharing_operator::api::names::{ANNOTATION_CORDONED, MANAGED_LABELS, OBSERVED_ANNOTATIONS};
use gpu_sharing_operator::plan::outputs::{Owned, cluster_policy_spec};
use k8s_openapi::api::core::v1::Node;
use kube::Client;
use kube::api::{Api, DeleteParams, DynamicObject, Patch, PatchParams, PostParams};
use serde_json::{Value, json};
use support::allowed::{self, sorted};
use support::*;

const POLICY_FILE: &str = "config/node-admission-policy.yaml";
const CP_POLICY_FILE: &str = "config/clusterpolicy-admission-policy.yaml";
const CP_POLICY: &str = "gpu-sharing-operator-clusterpolicy-fields";
const NODE: &str = "h200-node-0";
const CP: &str = "cluster-policy";

fn policy_docs(file: &str) -> Vec<Value> {
    let text = std::fs::read_to_string(testkit::repo_root().join(file)).unwrap();
    testkit::parse_yaml_documents(&text).unwrap()
}

/// The expression of the policy's variable `name`.
fn variable(vap: &Value, name: &str) -> String {
    vap["spec"]["variables"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["name"] == name)
        .unwrap_or_else(|| panic!("no variable {name}"))["expression"]
        .as_str()
        .unwrap()
        .to_string()
}

/// A CEL list literal of strings, as the policy's variables write them.
fn cel_strings(expr: &str) -> Vec<String> {
    expr.split('\'')
        .skip(1)
        .step_by(2)
        .map(str::to_string)
        .collect()
}

/// Leaf paths of a JSON object (`spec.mig.strategy`); an empty object is no leaf.
fn leaf_paths(v: &Value, prefix: &str, out: &mut BTreeSet<String>) {
    match v.as_object() {
        Some(m) => {
            for (k, c) in m {
                leaf_paths(c, &format!("{prefix}.{k}"), out);
            }
        }
        None => {
            out.insert(prefix.trim_start_matches('.').to_string());
        }
    }
}

/// Every output of `cluster_policy_spec` on: a policy, our mig-parted ConfigMap, a cluster MIG
/// strategy, VM hosts and our vGPU-devices ConfigMap.
fn every_output() -> Owned {
    Owned {
        any_policy: true,
        mig_config: true,
        cluster_mig: Some(gpu_sharing_operator::api::crd::MigStrategy::Mixed),
        vm_nodes: true,
        vgpu_config: true,
    }
}

/// What the operator writes into the ClusterPolicy when every output is on.
fn operator_spec() -> Value {
    let input = gpu_sharing_operator::plan::PlanInput::new(vec![], vec![]);
    cluster_policy_spec(&input, every_output())
}

#[test]
fn the_policy_lists_exactly_what_the_operator_manages() {
    let docs = policy_docs(POLICY_FILE);
    let vap = &docs[0];
    let var = |name: &str| variable(vap, name);
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
    assert_eq!(
        sorted(&OBSERVED_ANNOTATIONS),
        sorted(&allowed::NODE_ANNOTATIONS)
    );
    // The cordon fence names the operator's own cordon mark.
    assert_eq!(cel_strings(&var("cordonAnnotation")), [ANNOTATION_CORDONED]);
    let taint = cel_strings(&var("readinessTaint"));
    assert_eq!(taint, ["gpusharing.io/unconfigured"]);
    assert!(taint[0].starts_with(allowed::TAINT_PREFIX));
    assert_eq!(
        gpu_sharing_operator::api::names::DEFAULT_READINESS_TAINT,
        taint[0]
    );
    assert_eq!(
        gpu_sharing_operator::api::names::MANAGER,
        allowed::FIELD_MANAGER
    );
    assert_eq!(
        gpu_sharing_operator::api::names::MANAGED_BY,
        allowed::CONFIGMAP_OWNER_LABEL
    );
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
    // (Its cordon mark only together with a cordon: see `cordon_fence`.)
    for key in allowed::NODE_ANNOTATIONS
        .into_iter()
        .filter(|k| *k != ANNOTATION_CORDONED)
    {
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
    testkit::apply_yaml(
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

    // Drains: only its own cordon, on GPU nodes.
    cordon_fence(&admin, &sa).await;

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
        .args([
            "run",
            "--namespace=gpu-operator",
            "--metrics-addr=",
            "--health-addr=",
        ])
        .env("KUBECONFIG", &kubeconfig)
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    testkit::apply_yaml(&admin, include_str!("../examples/mps-h200.yaml"))
        .await
        .unwrap();
    ready_on_or_log(&admin, "h200-mps", 1, &log).await;
    // ...and drains a node: its cordon and uncordon pass the fence.
    operator_drains_under_the_policy(&admin, &log).await;
    let text = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(
        !text.contains("gpu-sharing-operator-node-fields"),
        "the operator hit the policy:\n{text}"
    );
    op.kill().await.unwrap();
}

fn unschedulable(n: &Node) -> bool {
    n.spec.as_ref().and_then(|s| s.unschedulable) == Some(true)
}

fn marked(n: &Node) -> bool {
    n.metadata
        .annotations
        .as_ref()
        .is_some_and(|a| a.contains_key(ANNOTATION_CORDONED))
}

/// The operator's server-side apply of a node as `runtime::apply::nodes` writes it: its labels
/// and annotations, and for a drain its cordon mark with `spec.unschedulable` in the same
/// request. Applied without them, the cordon and the mark go together.
async fn operator_apply(sa: &Client, name: &str, cordon: bool) -> Result<Node, kube::Error> {
    let mut obj = json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": name,
        "labels": {"gpusharing.io/policy": "p"}, "annotations": {}}});
    if cordon {
        obj["metadata"]["annotations"][ANNOTATION_CORDONED] = json!("true");
        obj["spec"] = json!({"unschedulable": true});
    }
    Api::<Node>::all(sa.clone())
        .patch(
            name,
            &PatchParams::apply(allowed::FIELD_MANAGER).force(),
            &Patch::Apply(&obj),
        )
        .await
}

/// `r` was refused by the node policy, with a message containing `says`.
fn assert_node_refused(what: &str, r: Result<Node, kube::Error>, says: &str) {
    match r {
        Err(kube::Error::Api(e)) => assert!(
            e.message.contains("gpu-sharing-operator-node-fields") && e.message.contains(says),
            "{what}: refused, but with {:?} (wanted {says:?})",
            e.message
        ),
        other => panic!("{what} was not refused: {other:?}"),
    }
}

/// The cordon fence: the operator's account sets `spec.unschedulable` only on a GPU node and
/// only with its cordon mark, lifts only a cordon it marked (removing the mark in the same
/// request), and never marks a node someone else cordoned; its own cordon and uncordon pass.
async fn cordon_fence(admin: &Client, sa: &Client) {
    const CPU: &str = "cpu-node-0";
    let get = |name: &'static str| {
        let admin = admin.clone();
        async move { Api::<Node>::all(admin).get(name).await.unwrap() }
    };
    // A node without a GPU, even cordoned as the operator writes a cordon.
    let gpu_only = "may cordon only GPU nodes (labelled nvidia.com/gpu.present=true)";
    assert_node_refused(
        "cordoning a CPU node",
        operator_apply(sa, CPU, true).await,
        gpu_only,
    );
    refused(sa, CPU, json!({"spec": {"unschedulable": true}}), gpu_only).await;
    assert!(!unschedulable(&get(CPU).await));
    // A GPU node without the operator's mark; the mark without the cordon.
    let with_mark = "may cordon a node only together with its annotation gpusharing.io/cordoned";
    refused(
        sa,
        NODE,
        json!({"spec": {"unschedulable": true}}),
        with_mark,
    )
    .await;
    let mark_with_cordon =
        "may add its annotation gpusharing.io/cordoned only in the request that cordons the node";
    let mark = json!({"metadata": {"annotations": {ANNOTATION_CORDONED: "true"}}});
    refused(sa, NODE, mark.clone(), mark_with_cordon).await;

    // An admin's cordon: not lifted, not marked (and so lifted later), not claimed by an apply
    // of the operator's cordon (a drain whose read of the node came before the admin's cordon).
    patch(admin, NODE, json!({"spec": {"unschedulable": true}}), false)
        .await
        .unwrap();
    let own_only = "may lift only its own cordon, together with removing its annotation gpusharing.io/cordoned";
    refused(sa, NODE, json!({"spec": {"unschedulable": null}}), own_only).await;
    refused(
        sa,
        NODE,
        json!({"spec": {"unschedulable": false}}),
        own_only,
    )
    .await;
    refused(sa, NODE, mark.clone(), mark_with_cordon).await;
    let mark_and_lift = json!({"metadata": {"annotations": {ANNOTATION_CORDONED: "true"}},
        "spec": {"unschedulable": null}});
    refused(sa, NODE, mark_and_lift, own_only).await;
    let claim = operator_apply(sa, NODE, true).await;
    assert_node_refused("claiming an admin's cordon", claim, mark_with_cordon);
    let n = get(NODE).await;
    assert!(
        unschedulable(&n) && !marked(&n),
        "the admin's cordon stays as it was"
    );
    patch(admin, NODE, json!({"spec": {"unschedulable": null}}), false)
        .await
        .unwrap();

    // The operator's own cordon, applied again on every pass of its drain.
    for _ in 0..2 {
        let n = operator_apply(sa, NODE, true)
            .await
            .expect("the operator's cordon");
        assert!(unschedulable(&n) && marked(&n));
    }
    // Lifted by someone during the drain: the operator cordons again (its mark is there).
    patch(admin, NODE, json!({"spec": {"unschedulable": null}}), false)
        .await
        .unwrap();
    let n = operator_apply(sa, NODE, true)
        .await
        .expect("cordoning again");
    assert!(unschedulable(&n) && marked(&n));
    // Its uncordon: the mark and the cordon go in one apply.
    let n = operator_apply(sa, NODE, false)
        .await
        .expect("the operator's uncordon");
    assert!(!unschedulable(&n) && !marked(&n), "{:?}", n.spec);
}

/// The operator, run as its ServiceAccount under the node policy, drains a100-node-0 for a MIG
/// change: it cordons the node (with its mark), waits while a PodDisruptionBudget refuses the
/// eviction, then evicts, changes the layout and lifts its cordon.
async fn operator_drains_under_the_policy(admin: &Client, log: &std::path::Path) {
    use k8s_openapi::api::core::v1::Pod;
    use k8s_openapi::api::policy::v1::PodDisruptionBudget;
    let (nodes, pods) = (
        Api::<Node>::all(admin.clone()),
        Api::<Pod>::namespaced(admin.clone(), "default"),
    );
    let pdbs = Api::<PodDisruptionBudget>::namespaced(admin.clone(), "default");
    let pod = json!({"apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "train-0", "namespace": "default", "labels": {"app": "train"}},
        "spec": {"nodeName": "a100-node-0", "containers": [{"name": "c", "image": "cuda",
            "resources": {"limits": {"nvidia.com/gpu": "1"}}}]}});
    pods.create(
        &PostParams::default(),
        &serde_json::from_value(pod).unwrap(),
    )
    .await
    .unwrap();
    let pdb = json!({"metadata": {"name": "train"},
        "spec": {"minAvailable": 1, "selector": {"matchLabels": {"app": "train"}}}});
    pdbs.create(
        &PostParams::default(),
        &serde_json::from_value(pdb).unwrap(),
    )
    .await
    .unwrap();
    until("train-0 runs", LONG, || async {
        let p = pods.get("train-0").await.ok()?;
        (p.status?.phase.as_deref() == Some("Running")).then_some(())
    })
    .await;
    testkit::apply_yaml(
        admin,
        "apiVersion: gpusharing.io/v1alpha1\nkind: GpuSharingPolicy\nmetadata: {name: a100-mig}\nspec:\n  nodeSelector: {matchLabels: {kubernetes.io/hostname: a100-node-0}}\n  strategy: mig\n  mig: {migStrategy: single, layout: all-1g.10gb}\n  disruption: {mode: drain}\n",
    )
    .await
    .unwrap();
    // Cordoned with its mark while the budget refuses the eviction.
    let cordoned = tokio::time::timeout(LONG, async {
        loop {
            let n = nodes.get("a100-node-0").await.unwrap();
            if unschedulable(&n) && marked(&n) {
                return;
            }
            tokio::time::sleep(std::time::Duration::from_millis(250)).await;
        }
    })
    .await;
    cordoned.unwrap_or_else(|_| {
        panic!(
            "a100-node-0 not cordoned by the operator:\n{}",
            std::fs::read_to_string(log).unwrap_or_default()
        )
    });
    pdbs.delete("train", &Default::default()).await.unwrap();
    let s = ready_on_or_log(admin, "a100-mig", 1, log).await;
    assert_eq!(s["migConfig"], "all-1g.10gb");
    let n = until("the operator's cordon lifted", LONG, || async {
        let n = nodes.get("a100-node-0").await.ok()?;
        (!unschedulable(&n)).then_some(n)
    })
    .await;
    assert!(!marked(&n));
}

#[test]
fn the_clusterpolicy_policy_allows_exactly_what_the_operator_writes() {
    let cp_docs = policy_docs(CP_POLICY_FILE);
    let vap = &cp_docs[0];
    // The policy's list against the reviewed list, written once in the test support.
    let mut owned = cel_strings(&variable(vap, "ownedFields"));
    owned.sort();
    assert_eq!(owned, sorted(&allowed::CLUSTER_POLICY_FIELDS));
    // The policy compares three levels under `spec`: every field it lets through is within.
    for f in allowed::CLUSTER_POLICY_FIELDS {
        let depth = f.split('.').count() - 1;
        assert!(
            (1..=3).contains(&depth),
            "{f}: the policy's CEL compares 3 levels"
        );
    }
    // The operator's output code, every output on, writes exactly the reviewed list.
    let mut written = BTreeSet::new();
    leaf_paths(&json!({"spec": operator_spec()}), "", &mut written);
    assert_eq!(
        written.into_iter().collect::<Vec<_>>(),
        sorted(&allowed::CLUSTER_POLICY_FIELDS),
        "src/plan/outputs.rs writes other ClusterPolicy fields than tests/support/allowed.rs lists"
    );
    // And so does the whole planner for examples that need every output: a device-plugin
    // config (MPS), a custom MIG layout with the mixed strategy, and a custom vGPU layout on a
    // VM host.
    let mut policies = Vec::new();
    for e in ["mps-h200.yaml", "mig-custom-split.yaml", "vgpu-vdi.yaml"] {
        let path = testkit::repo_root().join("examples").join(e);
        policies.extend(gpu_sharing_operator::offline::render::load_policies(&path).unwrap());
    }
    let fixtures =
        std::fs::read_to_string(testkit::repo_root().join("tests/cluster/fixtures/nodes.yaml"))
            .unwrap();
    let mut nodes = testkit::parse_yaml_documents(&fixtures).unwrap();
    for n in &mut nodes {
        let profile = match n["metadata"]["name"].as_str() {
            Some("a100-node-0") => "mig-split",
            Some("a100-node-1") => "vgpu-split",
            _ => continue,
        };
        n["metadata"]["labels"]["gpusharing.io/profile"] = json!(profile);
    }
    let text: String = nodes
        .iter()
        .map(|n| format!("---\n{}", serde_saphyr::to_string(n).unwrap()))
        .collect();
    let nodes = gpu_sharing_operator::offline::render::nodes_from_text(
        &text,
        std::path::Path::new("nodes.yaml"),
    )
    .unwrap();
    let options = gpu_sharing_operator::offline::render::RenderOptions {
        namespace: NS.into(),
        base_mig_configs: Default::default(),
        single_pass: false,
        karpenter: None,
    };
    let rendered =
        gpu_sharing_operator::offline::render::render_text(policies, Some(nodes), &options)
            .unwrap_or_else(|e| panic!("{e:?}"));
    let docs = testkit::parse_yaml_documents(&rendered.text).unwrap();
    let cp = docs.iter().find(|d| d["kind"] == "ClusterPolicy").unwrap();
    let mut written = BTreeSet::new();
    leaf_paths(&json!({"spec": cp["spec"]}), "", &mut written);
    assert_eq!(
        written.into_iter().collect::<Vec<_>>(),
        sorted(&allowed::CLUSTER_POLICY_FIELDS),
        "{}",
        cp["spec"]
    );
    assert_eq!(cp["spec"], operator_spec());

    // The same ServiceAccount as the node policy's, refused the same way, bound to deny.
    let node = &policy_docs(POLICY_FILE)[0];
    assert_eq!(
        vap["spec"]["matchConditions"],
        node["spec"]["matchConditions"]
    );
    assert_eq!(vap["spec"]["failurePolicy"], "Fail");
    assert_eq!(vap["metadata"]["name"], CP_POLICY);
    assert_eq!(cp_docs[1]["spec"]["policyName"], CP_POLICY);
    assert_eq!(cp_docs[1]["spec"]["validationActions"], json!(["Deny"]));
    let kustomization =
        std::fs::read_to_string(testkit::repo_root().join("config/kustomization.yaml")).unwrap();
    assert!(kustomization.contains("- clusterpolicy-admission-policy.yaml"));
}

async fn cp_patch(c: &Client, p: &Value, dry_run: bool) -> Result<DynamicObject, kube::Error> {
    let pp = PatchParams {
        dry_run,
        ..Default::default()
    };
    testkit::cluster_policy_api(c)
        .patch(CP, &pp, &Patch::Merge(p))
        .await
}

/// `r` was refused by the ClusterPolicy admission policy, with a message containing `says`.
fn assert_refused<T: std::fmt::Debug>(what: &str, r: Result<T, kube::Error>, says: &str) {
    match r {
        Err(kube::Error::Api(e)) => assert!(
            e.message.contains(CP_POLICY) && e.message.contains(says),
            "{what}: refused, but with {:?} (wanted {says:?})",
            e.message
        ),
        other => panic!("{what} was not refused: {other:?}"),
    }
}

async fn cp_refused(c: &Client, p: Value, says: &str) {
    assert_refused(&p.to_string(), cp_patch(c, &p, false).await, says);
}

async fn cp_allowed(c: &Client, p: Value) -> Value {
    cp_patch(c, &p, false)
        .await
        .unwrap_or_else(|e| panic!("{p} was refused: {e}"))
        .data
}

/// `{"spec": {"mig": {"strategy": v}}}` for `spec.mig.strategy`.
fn at(path: &str, v: Value) -> Value {
    path.rsplit('.').fold(v, |acc, k| json!({ k: acc }))
}

fn lookup<'a>(v: &'a Value, path: &str) -> Option<&'a Value> {
    path.split('.').try_fold(v, |acc, k| acc.get(k))
}

/// `spec` without the fields the operator manages (and without the maps left empty).
fn foreign_spec(data: &Value) -> Value {
    fn strip(v: &mut Value, prefix: &str) {
        let Some(m) = v.as_object_mut() else { return };
        m.retain(|k, c| {
            let p = format!("{prefix}.{k}");
            if allowed::CLUSTER_POLICY_FIELDS.contains(&p.as_str()) {
                return false;
            }
            strip(c, &p);
            !c.as_object().is_some_and(|o| o.is_empty())
        });
    }
    let mut spec = data["spec"].clone();
    strip(&mut spec, "spec");
    spec
}

/// The `spec` leaves our field manager holds, from the ClusterPolicy's managedFields.
fn held_by_us(cp: &DynamicObject) -> BTreeSet<String> {
    fn walk(v: &Value, prefix: &str, out: &mut BTreeSet<String>) {
        let children: Vec<(&str, &Value)> = v
            .as_object()
            .into_iter()
            .flatten()
            .filter_map(|(k, c)| Some((k.strip_prefix("f:")?, c)))
            .collect();
        if children.is_empty() {
            out.insert(prefix.trim_start_matches('.').to_string());
        }
        for (k, c) in children {
            walk(c, &format!("{prefix}.{k}"), out);
        }
    }
    let mut out = BTreeSet::new();
    for e in cp.metadata.managed_fields.iter().flatten() {
        if e.manager.as_deref() == Some(allowed::FIELD_MANAGER)
            && let Some(f) = &e.fields_v1
        {
            walk(&f.0, "", &mut out);
        }
    }
    out.retain(|p| p.starts_with("spec."));
    out
}

fn as_cluster_policy(spec: Value) -> Value {
    json!({"apiVersion": "nvidia.com/v1", "kind": "ClusterPolicy", "metadata": {"name": CP},
        "spec": spec})
}

#[tokio::test]
async fn the_operator_account_may_change_only_its_clusterpolicy_fields() {
    let (_g, cluster, _sim) = setup().await;
    let admin = cluster.client.clone();
    apply_config(&admin, &[POLICY_FILE, CP_POLICY_FILE]).await;
    let sa = service_account_client(&cluster, "gpu-sharing-system", "gpu-sharing-operator").await;
    let sa_cps = testkit::cluster_policy_api(&sa);
    let original = testkit::cluster_policy_api(&admin)
        .get(CP)
        .await
        .unwrap()
        .data;
    // What the operator writes, every output on, as leaf paths.
    let spec = operator_spec();
    let mut want = BTreeSet::new();
    leaf_paths(&json!({ "spec": spec }), "", &mut want);

    // The policy takes effect once the API server has loaded it: dry-run until it refuses.
    until(
        "the ClusterPolicy admission policy to be active",
        LONG,
        || {
            let sa = sa.clone();
            async move {
                let p = json!({"metadata": {"labels": {"team": "a"}}});
                match cp_patch(&sa, &p, true).await {
                    Err(kube::Error::Api(e)) if e.message.contains(CP_POLICY) => Some(()),
                    Err(e) => panic!("{e}"),
                    Ok(_) => None,
                }
            }
        },
    )
    .await;

    // The operator, as that ServiceAccount under both policies, converges examples that write
    // every field it manages (time-slicing: the device-plugin config; a custom MIG layout: the
    // MIG manager's config and the mixed strategy; a custom vGPU layout on a VM host: sandbox
    // workloads and the vGPU Device Manager's config; not MPS, which the mixed strategy
    // excludes: the node policy's test converges it)...
    for (n, profile) in [("a100-node-0", "mig-split"), ("a100-node-1", "vgpu-split")] {
        label_node(&admin, n, "gpusharing.io/profile", Some(profile)).await;
    }
    // (the user's part for vGPU: their vGPU Manager is on)
    cp_patch(
        &admin,
        &json!({"spec": {"vgpuManager": {"enabled": true}}}),
        false,
    )
    .await
    .unwrap();
    let kubeconfig =
        service_account_kubeconfig_file(&cluster, "gpu-sharing-system", "gpu-sharing-operator")
            .await;
    let log = cluster.dir.path().join("operator.log");
    let mut op = tokio::process::Command::new(env!("CARGO_BIN_EXE_gpu-sharing-operator"))
        .args([
            "run",
            "--namespace=gpu-operator",
            "--metrics-addr=",
            "--health-addr=",
        ])
        .env("KUBECONFIG", &kubeconfig)
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    for example in [
        include_str!("../examples/time-slicing-l4.yaml"),
        include_str!("../examples/mig-custom-split.yaml"),
        include_str!("../examples/vgpu-vdi.yaml"),
    ] {
        testkit::apply_yaml(&admin, example).await.unwrap();
    }
    for (policy, nodes) in [
        ("l4-time-slicing", 2),
        ("a100-mig-split", 1),
        ("vgpu-a100-split", 1),
    ] {
        ready_on_or_log(&admin, policy, nodes, &log).await;
    }
    let cp = testkit::cluster_policy_api(&admin).get(CP).await.unwrap();
    assert_eq!(held_by_us(&cp), want);
    for f in &want {
        assert_eq!(
            lookup(&cp.data, f),
            lookup(&json!({ "spec": spec }), f),
            "{f}"
        );
    }
    // ...and releases the ClusterPolicy when the last policy goes.
    Api::<gpu_sharing_operator::api::crd::GpuSharingPolicy>::all(admin.clone())
        .delete_collection(&DeleteParams::default(), &Default::default())
        .await
        .unwrap();
    let released = tokio::time::timeout(LONG, async {
        loop {
            let cp = testkit::cluster_policy_api(&admin).get(CP).await.unwrap();
            if held_by_us(&cp).is_empty() {
                return cp;
            }
            tokio::time::sleep(std::time::Duration::from_millis(250)).await;
        }
    })
    .await;
    let cp = released.unwrap_or_else(|_| {
        panic!(
            "the ClusterPolicy was not released:\n{}",
            std::fs::read_to_string(&log).unwrap_or_default()
        )
    });
    assert_ne!(
        lookup(&cp.data, "spec.devicePlugin.config.name"),
        Some(&json!(DP_CM))
    );
    assert_eq!(foreign_spec(&cp.data)["driver"], original["spec"]["driver"]);
    let text = std::fs::read_to_string(&log).unwrap_or_default();
    for policy in [CP_POLICY, "gpu-sharing-operator-node-fields"] {
        assert!(!text.contains(policy), "the operator hit {policy}:\n{text}");
    }
    op.kill().await.unwrap();

    // By hand, as that ServiceAccount: a server-side apply as the operator writes (its own
    // output, every field on), and the release, an apply of an empty spec.
    let before = testkit::cluster_policy_api(&admin)
        .get(CP)
        .await
        .unwrap()
        .data;
    let ssa = PatchParams::apply(allowed::FIELD_MANAGER).force();
    let cp = sa_cps
        .patch(CP, &ssa, &Patch::Apply(as_cluster_policy(spec.clone())))
        .await
        .expect("applying its own fields");
    assert_eq!(held_by_us(&cp), want);
    for f in &want {
        assert_eq!(
            lookup(&cp.data, f),
            lookup(&json!({ "spec": spec }), f),
            "{f}"
        );
    }
    let cp = sa_cps
        .patch(CP, &ssa, &Patch::Apply(as_cluster_policy(json!({}))))
        .await
        .expect("releasing its own fields");
    assert_eq!(held_by_us(&cp), BTreeSet::new());
    for f in [
        "spec.devicePlugin.config.name",
        "spec.sandboxWorkloads.enabled",
    ] {
        assert_eq!(lookup(&cp.data, f), None, "{f} released");
    }

    // Each field by merge patch: set, removed and put back as it was. (After the applies: on
    // Kubernetes 1.35 an apply that removes the last child of a map an Update manager holds
    // leaves the map `null`, which the CRD's schema refuses, kubernetes/kubernetes#117447.)
    for f in allowed::CLUSTER_POLICY_FIELDS {
        let v = match f.rsplit('.').next() {
            Some("strategy") => json!("mixed"),
            Some("enabled") => json!(true),
            _ => json!("gso-test"),
        };
        let was = lookup(&before, f).cloned().unwrap_or(Value::Null);
        let cp = cp_allowed(&sa, at(f, v.clone())).await;
        assert_eq!(lookup(&cp, f), Some(&v), "{f} set");
        let cp = cp_allowed(&sa, at(f, Value::Null)).await;
        assert_ne!(lookup(&cp, f), Some(&v), "{f} removed");
        cp_allowed(&sa, at(f, was)).await;
    }

    // Anything else is refused, naming the field.
    let toolkit_env =
        json!([{"name": "ACCEPT_NVIDIA_VISIBLE_DEVICES_AS_VOLUME_MOUNTS", "value": "false"}]);
    for (p, says) in [
        (
            json!({"spec": {"driver": {"image": "example.com/driver"}}}),
            "may change only its own ClusterPolicy fields; refused: spec.driver.image",
        ),
        (
            json!({"spec": {"devicePlugin": {"image": "example.com/device-plugin"}}}),
            "refused: spec.devicePlugin.image",
        ),
        (
            json!({"spec": {"toolkit": {"env": toolkit_env}}}),
            "refused: spec.toolkit.env",
        ),
        // A top-level field the ClusterPolicy did not have.
        (
            json!({"spec": {"hostPaths": {"driverInstallDir": "/opt/driver"}}}),
            "refused: spec.hostPaths",
        ),
        // Siblings of the managed fields.
        (
            json!({"spec": {"sandboxWorkloads": {"defaultWorkload": "vm-passthrough"}}}),
            "refused: spec.sandboxWorkloads.defaultWorkload",
        ),
        (
            json!({"spec": {"migManager": {"config": {"default": ""}}}}),
            "refused: spec.migManager.config.default",
        ),
        (
            json!({"metadata": {"labels": {"team": "a"}}}),
            "may not change ClusterPolicy metadata; refused: metadata.labels.team",
        ),
        (
            json!({"metadata": {"labels": {"app.kubernetes.io/managed-by": null}}}),
            "refused: metadata.labels.app.kubernetes.io/managed-by",
        ),
        (
            json!({"metadata": {"annotations": {"example.com/note": "x"}}}),
            "refused: metadata.annotations.example.com/note",
        ),
        (
            json!({"metadata": {"finalizers": ["example.com/hold"]}}),
            "refused: metadata.finalizers",
        ),
    ] {
        cp_refused(&sa, p, says).await;
    }
    // A managed field does not carry another along, and only the other is named.
    let p = json!({"spec": {"devicePlugin": {"config": {"name": "x"}}, "driver": {"image": "x"}}});
    match cp_patch(&sa, &p, false).await {
        Err(kube::Error::Api(e)) => assert!(
            e.message.ends_with("refused: spec.driver.image"),
            "{}",
            e.message
        ),
        other => panic!("{p} was not refused: {other:?}"),
    }
    // An apply as the operator writes, with one field more.
    let mut more = operator_spec();
    more["driver"] = json!({"image": "example.com/driver"});
    assert_refused(
        "an apply with spec.driver.image",
        sa_cps
            .patch(CP, &ssa, &Patch::Apply(as_cluster_policy(more)))
            .await,
        "refused: spec.driver.image",
    );
    let now = testkit::cluster_policy_api(&admin).get(CP).await.unwrap();
    assert_eq!(
        foreign_spec(&now.data),
        foreign_spec(&before),
        "nothing else changed"
    );
    assert_eq!(
        now.metadata.labels.unwrap_or_default()["app.kubernetes.io/managed-by"],
        "Helm"
    );

    // Deleting, creating and status writes: RBAC refuses them, and the policy too where RBAC
    // is broader.
    let dry = DeleteParams {
        dry_run: true,
        ..Default::default()
    };
    match sa_cps.delete(CP, &dry).await {
        Err(kube::Error::Api(e)) => assert!(e.message.contains("cannot delete"), "{e:?}"),
        other => panic!("deleting the ClusterPolicy was not refused: {other:?}"),
    }
    testkit::apply_yaml(
        &admin,
        r#"
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata: {name: test-clusterpolicy-admin}
rules:
  - {apiGroups: [nvidia.com], resources: [clusterpolicies], verbs: [create, delete]}
  - {apiGroups: [nvidia.com], resources: [clusterpolicies/status], verbs: [patch]}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {name: test-clusterpolicy-admin}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: test-clusterpolicy-admin}
subjects: [{kind: ServiceAccount, name: gpu-sharing-operator, namespace: gpu-sharing-system}]
"#,
    )
    .await
    .unwrap();
    let denial = until(
        "the admission policy to refuse deleting the ClusterPolicy",
        LONG,
        || async {
            match sa_cps.delete(CP, &dry).await {
                Err(kube::Error::Api(e)) if e.message.contains(CP_POLICY) => Some(e),
                Err(kube::Error::Api(e)) if e.message.contains("cannot delete") => None,
                other => panic!("deleting the ClusterPolicy was not refused: {other:?}"),
            }
        },
    )
    .await;
    assert!(
        denial
            .message
            .contains("may not create or delete ClusterPolicies"),
        "{denial:?}"
    );
    let another: DynamicObject = serde_json::from_value(json!({"apiVersion": "nvidia.com/v1",
        "kind": "ClusterPolicy", "metadata": {"name": "another"}, "spec": before["spec"]}))
    .unwrap();
    let post = PostParams {
        dry_run: true,
        ..Default::default()
    };
    assert_refused(
        "creating a ClusterPolicy",
        sa_cps.create(&post, &another).await,
        "may not create or delete ClusterPolicies",
    );
    assert_refused(
        "creating a ClusterPolicy by server-side apply",
        sa_cps
            .patch(
                "another",
                &PatchParams {
                    dry_run: true,
                    ..ssa.clone()
                },
                &Patch::Apply(
                    json!({"apiVersion": "nvidia.com/v1", "kind": "ClusterPolicy",
                    "metadata": {"name": "another"}, "spec": before["spec"]}),
                ),
            )
            .await,
        "may not create or delete ClusterPolicies",
    );
    let status = json!({"status": {"state": "notReady"}});
    assert_refused(
        "writing the ClusterPolicy's status",
        sa_cps
            .patch_status(
                CP,
                &PatchParams {
                    dry_run: true,
                    ..Default::default()
                },
                &Patch::Merge(&status),
            )
            .await,
        "never writes a ClusterPolicy's status",
    );
    Api::<k8s_openapi::api::rbac::v1::ClusterRoleBinding>::all(admin.clone())
        .delete("test-clusterpolicy-admin", &Default::default())
        .await
        .unwrap();

    // Other users are not affected.
    cp_patch(
        &admin,
        &json!({"metadata": {"labels": {"team": "a"}}, "spec": {"driver": {"image": "x"}}}),
        true,
    )
    .await
    .expect("the admin may change the ClusterPolicy");
    testkit::cluster_policy_api(&admin)
        .delete(CP, &dry)
        .await
        .expect("the admin may delete the ClusterPolicy");
}
