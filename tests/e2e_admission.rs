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
//! refused naming what changed. With `config/owned-objects-admission-policy.yaml` it may write
//! only its own NodeOverlays (Karpenter's CRDs served), ResourceClaimTemplates and ConfigMaps,
//! only its finalizer and the status of policies, and evict no pod in system namespaces: its own
//! objects as its code renders them pass, each other shape is refused naming the rule. Other
//! users are unaffected, and the operator, run as that ServiceAccount under the three policies,
//! still converges the examples and releases the ClusterPolicy when the last policy goes.

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

/// Karpenter's CRDs, copied from its Go module (`tests/karpenter/build.sh crds`: no build).
fn karpenter_crds() -> std::path::PathBuf {
    let out = std::process::Command::new("bash")
        .arg(testkit::repo_root().join("tests/karpenter/build.sh"))
        .arg("crds")
        .output()
        .expect("tests/karpenter/build.sh runs");
    assert!(
        out.status.success(),
        "tests/karpenter/build.sh crds failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap().trim().into()
}

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
    apply_config(&admin, &[POLICY_FILE, OWNED_POLICY_FILE]).await;
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

    // Installed in another namespace, the operator's account is fenced all the same.
    fenced_in_any_namespace(&cluster, &admin).await;

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

    // The spare taint (preferBusyNodes): added and removed as the operator writes it, on GPU
    // nodes only, and only as one PreferNoSchedule taint without a value.
    spare_taint_fence(&sa, &cluster.client).await;

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
    // ...and goes on past a node write the API server refuses.
    operator_goes_on_past_a_refused_node(&admin, &sa, &log).await;
    let text = std::fs::read_to_string(&log).unwrap_or_default();
    for policy in ["gpu-sharing-operator-node-fields", OWNED_POLICY] {
        assert!(!text.contains(policy), "the operator hit {policy}:\n{text}");
    }
    op.kill().await.unwrap();
}

/// An admission policy of the admin's refuses the operator's writes to `l4-node-1`: a policy
/// on both L4 nodes converges on `l4-node-0`, names the refused node and the API's answer in
/// `status.refusedWrites`, a `Degraded` condition and a `WriteRefused` event, and the other
/// policy's status is still written. Once the admin lifts the refusal the node converges.
async fn operator_goes_on_past_a_refused_node(admin: &Client, sa: &Client, log: &std::path::Path) {
    let vap = r#"
apiVersion: admissionregistration.k8s.io/v1
kind: ValidatingAdmissionPolicy
metadata: {name: test-refuse-l4-node-1}
spec:
  failurePolicy: Fail
  matchConstraints:
    resourceRules: [{apiGroups: [""], apiVersions: [v1], operations: [UPDATE], resources: [nodes]}]
  validations:
  - expression: "!(request.userInfo.username == 'system:serviceaccount:gpu-sharing-system:gpu-sharing-operator' && object.metadata.name == 'l4-node-1')"
    message: the admin refuses l4-node-1 for now
---
apiVersion: admissionregistration.k8s.io/v1
kind: ValidatingAdmissionPolicyBinding
metadata: {name: test-refuse-l4-node-1}
spec: {policyName: test-refuse-l4-node-1, validationActions: [Deny]}
"#;
    testkit::apply_yaml(admin, vap).await.unwrap();
    until("the refusal to be active", LONG, || async {
        let label = json!({"metadata": {"labels": {"gpusharing.io/probe": "x"}}});
        patch(sa, "l4-node-1", label, true)
            .await
            .is_err()
            .then_some(())
    })
    .await;
    testkit::apply_yaml(
        admin,
        "apiVersion: gpusharing.io/v1alpha1\nkind: GpuSharingPolicy\nmetadata: {name: l4-ts}\nspec:\n  nodeSelector: {matchLabels: {nvidia.com/gpu.product: NVIDIA-L4}}\n  strategy: timeSlicing\n  timeSlicing: {replicas: 4}\n",
    )
    .await
    .unwrap();
    let status = until("l4-ts to name the refused node", LONG, || async {
        let s = policy_status(admin, "l4-ts").await?;
        (s["appliedNodes"] == 1 && s["refusedWrites"][0]["name"] == "l4-node-1").then_some(s)
    })
    .await;
    assert_eq!(status["refusedWrites"][0]["kind"], "Node", "{status}");
    let message = status["refusedWrites"][0]["message"]
        .as_str()
        .unwrap_or_default();
    assert!(message.contains("the admin refuses l4-node-1"), "{status}");
    let degraded = (status["conditions"].as_array().into_iter().flatten())
        .find(|c| c["type"] == "Degraded")
        .cloned()
        .unwrap_or_default();
    assert_eq!(degraded["status"], "True", "{status}");
    assert_eq!(degraded["reason"], "WriteRefused", "{status}");
    // The other policy's status is written all the same (its generation observed).
    ready_on_or_log(admin, "h200-mps", 1, log).await;
    let events: Api<k8s_openapi::api::events::v1::Event> = Api::all(admin.clone());
    let event = until("a WriteRefused event", LONG, || async {
        let list = events.list(&Default::default()).await.ok()?;
        list.items.into_iter().find(|e| {
            e.reason.as_deref() == Some("WriteRefused")
                && e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some("l4-ts")
        })
    })
    .await;
    assert!(event.note.unwrap_or_default().contains("l4-node-1"));
    // Lifted: the node is retried (at most a minute later) and converges.
    let bindings: Api<DynamicObject> = Api::all_with(
        admin.clone(),
        &kube::api::ApiResource::from_gvk(&kube::api::GroupVersionKind::gvk(
            "admissionregistration.k8s.io",
            "v1",
            "ValidatingAdmissionPolicyBinding",
        )),
    );
    bindings
        .delete("test-refuse-l4-node-1", &Default::default())
        .await
        .unwrap();
    let s = tokio::time::timeout(std::time::Duration::from_secs(150), async {
        loop {
            if let Some(s) = ready_on(admin, "l4-ts", 2).await {
                return s;
            }
            tokio::time::sleep(std::time::Duration::from_millis(500)).await;
        }
    })
    .await
    .unwrap_or_else(|_| {
        panic!(
            "l4-ts not Ready on 2 nodes:\n{}",
            std::fs::read_to_string(log).unwrap_or_default()
        )
    });
    assert!(s.get("refusedWrites").is_none(), "{s}");
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
fn assert_node_refused<T: std::fmt::Debug>(what: &str, r: Result<T, kube::Error>, says: &str) {
    match r {
        Err(kube::Error::Api(e)) => assert!(
            e.message.contains("gpu-sharing-operator-node-fields") && e.message.contains(says),
            "{what}: refused, but with {:?} (wanted {says:?})",
            e.message
        ),
        other => panic!("{what} was not refused: {other:?}"),
    }
}

/// The spare-taint fence: the operator's own writes (`taints::set_spare`) pass on a GPU node and
/// keep every other taint; a CPU node, another effect, a value or a second copy are refused.
async fn spare_taint_fence(sa: &Client, admin: &Client) {
    use gpu_sharing_operator::api::names::TAINT_SPARE;
    use gpu_sharing_operator::runtime::taints::set_spare;
    let keys = |n: Node| -> Vec<String> {
        (n.spec.and_then(|s| s.taints).into_iter().flatten())
            .map(|t| format!("{}:{}", t.key, t.effect))
            .collect()
    };
    let get = || async { Api::<Node>::all(admin.clone()).get(NODE).await.unwrap() };
    assert!(
        set_spare(sa, NODE, true)
            .await
            .expect("the spare taint on a GPU node")
    );
    assert!(!set_spare(sa, NODE, true).await.unwrap(), "already there");
    assert_eq!(
        keys(get().await),
        [
            "example.com/keep:NoExecute",
            "gpusharing.io/spare:PreferNoSchedule"
        ]
    );
    let only = "only once, as PreferNoSchedule without a value, and only to GPU nodes";
    let keep = json!({"key": "example.com/keep", "value": "1", "effect": "NoExecute"});
    let spare =
        |effect: &str, value: &str| json!({"key": TAINT_SPARE, "effect": effect, "value": value});
    for (what, taints) in [
        (
            "twice (a second effect; the same key and effect twice the API server refuses itself)",
            json!([keep, spare("PreferNoSchedule", ""), spare("NoExecute", "")]),
        ),
        ("NoSchedule", json!([keep, spare("NoSchedule", "")])),
        (
            "with a value",
            json!([keep, spare("PreferNoSchedule", "x")]),
        ),
    ] {
        let r = patch(sa, NODE, json!({"spec": {"taints": taints}}), false).await;
        assert_node_refused(what, r, only);
    }
    assert!(
        set_spare(sa, NODE, false)
            .await
            .expect("the spare taint removed")
    );
    assert_eq!(keys(get().await), ["example.com/keep:NoExecute"]);
    assert_node_refused(
        "the spare taint on a CPU node",
        set_spare(sa, "cpu-node-0", true).await,
        only,
    );
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
    // The third policy: the same account, bound to deny, installed by kustomize.
    let owned = policy_docs(OWNED_POLICY_FILE);
    assert_eq!(
        owned[0]["spec"]["matchConditions"],
        node["spec"]["matchConditions"]
    );
    assert_eq!(owned[0]["spec"]["failurePolicy"], "Fail");
    assert_eq!(owned[0]["metadata"]["name"], OWNED_POLICY);
    assert_eq!(owned[1]["spec"]["policyName"], OWNED_POLICY);
    assert_eq!(owned[1]["spec"]["validationActions"], json!(["Deny"]));
    assert!(kustomization.contains("- owned-objects-admission-policy.yaml"));
    // Its lists are the operator's: its ConfigMap names, its finalizer.
    let mut cms = cel_strings(&variable(&owned[0], "ownConfigMaps"));
    cms.sort();
    let config = gpu_sharing_operator::runtime::context::Config::default();
    let mut want = vec![
        config.device_configmap,
        config.mig_configmap,
        config.vgpu_configmap,
    ];
    want.sort();
    assert_eq!(cms, want);
    assert_eq!(
        cel_strings(&variable(&owned[0], "finalizer")),
        [gpu_sharing_operator::api::names::FINALIZER]
    );
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
    // Karpenter's CRDs (only copied from its module, not built): NodeOverlays are served.
    let (_g, cluster, _sim) =
        setup_with(testkit::ClusterOptions::default().manifest(karpenter_crds())).await;
    let admin = cluster.client.clone();
    // The operator's fence check: not fenced until the policies are installed (then they are).
    apply_config(&admin, &[]).await;
    fence_check_follows_the_policies(&cluster, &admin).await;
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
    // The third policy: the rest of what the operator writes.
    owned_objects_fence(&cluster, &admin, &sa).await;

    // The operator, as that ServiceAccount under the three policies, converges examples that write
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
    for policy in [CP_POLICY, "gpu-sharing-operator-node-fields", OWNED_POLICY] {
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

// ---------------------------------------------------------------------------------------------
// The third policy: the operator's own NodeOverlays, ResourceClaimTemplates and ConfigMaps, its
// finalizer and status on policies, and no eviction in system namespaces.

const OWNED_POLICY_FILE: &str = "config/owned-objects-admission-policy.yaml";
const OWNED_POLICY: &str = "gpu-sharing-operator-owned-objects";

/// Karpenter's NodePool and the instance-type table the time-slicing example's overlays are
/// rendered for (as tests/golden.rs renders them).
const KARPENTER_INPUT: &str = r#"
apiVersion: karpenter.sh/v1
kind: NodePool
metadata: {name: l4}
spec:
  template:
    spec:
      nodeClassRef: {group: karpenter.kwok.sh, kind: KWOKNodeClass, name: default}
      requirements:
      - {key: node.kubernetes.io/instance-type, operator: In, values: [g6.xlarge, g6.12xlarge]}
---
apiVersion: v1
kind: ConfigMap
metadata: {name: gpu-sharing-instance-types, namespace: gpu-operator}
data:
  instance-types.yaml: |
    g6.xlarge: {gpus: 1, product: NVIDIA-L4, memoryMiB: 23034}
    g6.12xlarge: {gpus: 4, product: NVIDIA-L4, memoryMiB: 23034}
"#;

/// What the operator's own code writes besides nodes and the ClusterPolicy: `render`'s
/// NodeOverlays (time-slicing example, with Karpenter) and ConfigMaps (with a custom MIG
/// layout too), and the ResourceClaimTemplate of the DRA example (`nvidia::dra`).
fn operator_objects() -> Vec<Value> {
    let mut policies = Vec::new();
    for e in ["time-slicing-l4.yaml", "mig-custom-split.yaml"] {
        let path = testkit::repo_root().join("examples").join(e);
        policies.extend(gpu_sharing_operator::offline::render::load_policies(&path).unwrap());
    }
    let options = gpu_sharing_operator::offline::render::RenderOptions {
        namespace: NS.into(),
        base_mig_configs: Default::default(),
        single_pass: false,
        karpenter: Some(testkit::parse_yaml_documents(KARPENTER_INPUT).unwrap()),
    };
    let rendered = gpu_sharing_operator::offline::render::render_text(policies, None, &options)
        .unwrap_or_else(|e| panic!("{e:?}"));
    let mut out: Vec<Value> = testkit::parse_yaml_documents(&rendered.text)
        .unwrap()
        .into_iter()
        .filter(|d| d["kind"] == "NodeOverlay" || d["kind"] == "ConfigMap")
        .collect();
    let path = testkit::repo_root().join("examples/dra-mps.yaml");
    let dra = gpu_sharing_operator::offline::render::load_policies(&path).unwrap();
    let ns = &dra[0].spec.dra.as_ref().unwrap().namespaces[0];
    out.push(gpu_sharing_operator::nvidia::dra::claim_template(
        &dra[0].metadata.name.clone().unwrap(),
        ns,
        &dra[0].spec,
        Some(23034),
    ));
    out
}

fn api_of(c: &Client, obj: &Value) -> Api<DynamicObject> {
    let ar = match obj["kind"].as_str() {
        Some("NodeOverlay") => gpu_sharing_operator::observe::karpenter::node_overlay_resource(),
        Some("ConfigMap") => {
            kube::api::ApiResource::erase::<k8s_openapi::api::core::v1::ConfigMap>(&())
        }
        Some("ResourceClaimTemplate") => kube::api::ApiResource::erase::<
            k8s_openapi::api::resource::v1::ResourceClaimTemplate,
        >(&()),
        other => panic!("{other:?}"),
    };
    match obj["metadata"]["namespace"].as_str() {
        Some(ns) => Api::namespaced_with(c.clone(), ns, &ar),
        None => Api::all_with(c.clone(), &ar),
    }
}

/// A server-side apply of `obj` as the operator writes (its field manager, forced).
async fn apply_as(c: &Client, obj: &Value, dry_run: bool) -> Result<DynamicObject, kube::Error> {
    apply_with(c, allowed::FIELD_MANAGER, obj, dry_run).await
}

/// A server-side apply of `obj` by someone else than the operator (the admin).
async fn admin_apply(c: &Client, obj: &Value) -> Result<DynamicObject, kube::Error> {
    apply_with(c, "test-admin", obj, false).await
}

async fn apply_with(
    c: &Client,
    manager: &str,
    obj: &Value,
    dry_run: bool,
) -> Result<DynamicObject, kube::Error> {
    let pp = PatchParams {
        dry_run,
        ..PatchParams::apply(manager).force()
    };
    let name = obj["metadata"]["name"].as_str().unwrap();
    api_of(c, obj).patch(name, &pp, &Patch::Apply(obj)).await
}

async fn delete_as(c: &Client, obj: &Value) -> Result<(), kube::Error> {
    let name = obj["metadata"]["name"].as_str().unwrap();
    api_of(c, obj)
        .delete(name, &DeleteParams::default())
        .await
        .map(|_| ())
}

/// `r` was refused by the owned-objects policy, with a message containing `says`.
fn assert_owned_refused<T: std::fmt::Debug>(what: &str, r: Result<T, kube::Error>, says: &str) {
    match r {
        Err(kube::Error::Api(e)) => assert!(
            e.message.contains(OWNED_POLICY) && e.message.contains(says),
            "{what}: refused, but with {:?} (wanted {says:?})",
            e.message
        ),
        other => panic!("{what} was not refused: {other:?}"),
    }
}

/// `obj` without the operator's managed-by label, renamed.
fn unlabelled(obj: &Value, name: &str) -> Value {
    let mut o = obj.clone();
    o["metadata"]["name"] = json!(name);
    o["metadata"]["labels"]
        .as_object_mut()
        .unwrap()
        .remove(allowed::CONFIGMAP_OWNER_LABEL.0);
    o
}

/// Everything the third policy fences, as the operator's account: its own objects as its code
/// writes them pass; others' objects, unlabelled ones, foreign names, policy changes beyond its
/// finalizer and status, and evictions in system namespaces are refused naming the rule.
async fn owned_objects_fence(cluster: &testkit::TestCluster, admin: &Client, sa: &Client) {
    let objects = operator_objects();
    let of = |kind: &str| -> Vec<&Value> { objects.iter().filter(|o| o["kind"] == kind).collect() };
    let (overlays, cms, rcts) = (
        of("NodeOverlay"),
        of("ConfigMap"),
        of("ResourceClaimTemplate"),
    );
    assert!(overlays.len() >= 2 && cms.len() >= 2 && rcts.len() == 1);
    // Active once it refuses an overlay of a foreign name without the label (RBAC lets the account
    // create any; two rules refuse it, so one put back to `true` still shows it active).
    let mut foreign = overlays[0].clone();
    foreign["metadata"]["name"] = json!("karpenter-gpu");
    let probe = unlabelled(&foreign, "karpenter-gpu");
    until("the owned-objects policy to be active", LONG, || async {
        match apply_as(sa, &probe, true).await {
            Err(kube::Error::Api(e)) if e.message.contains(OWNED_POLICY) => Some(()),
            Err(e) => panic!("{e}"),
            Ok(_) => None,
        }
    })
    .await;
    overlays_fence(admin, sa, &overlays, &foreign).await;
    claim_templates_fence(admin, sa, rcts[0]).await;
    // Writes the RBAC already refuses, made possible to show the policy refuses them too.
    testkit::apply_yaml(admin, BROADER_RBAC).await.unwrap();
    configmaps_fence(admin, sa, &cms).await;
    policies_fence(admin, sa).await;
    Api::<k8s_openapi::api::rbac::v1::ClusterRoleBinding>::all(admin.clone())
        .delete("test-owned-objects", &Default::default())
        .await
        .unwrap();
    evictions_fence(cluster, admin, sa).await;
}

const BROADER_RBAC: &str = r#"
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata: {name: test-owned-objects}
rules:
  - {apiGroups: [""], resources: [configmaps], verbs: [create, patch, delete]}
  - {apiGroups: [gpusharing.io], resources: [gpusharingpolicies], verbs: [create, delete]}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {name: test-owned-objects}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: test-owned-objects}
subjects: [{kind: ServiceAccount, name: gpu-sharing-operator, namespace: gpu-sharing-system}]
"#;

async fn overlays_fence(admin: &Client, sa: &Client, overlays: &[&Value], foreign: &Value) {
    // Its own, created, applied again and deleted.
    for o in overlays {
        assert!(
            o["metadata"]["name"]
                .as_str()
                .unwrap()
                .starts_with("gpusharing-")
        );
        apply_as(sa, o, false)
            .await
            .expect("applying its own NodeOverlay");
        apply_as(sa, o, false)
            .await
            .expect("applying its own NodeOverlay again");
    }
    let named = "may write only NodeOverlays named gpusharing-*; refused: karpenter-gpu";
    assert_owned_refused(
        "an overlay of a foreign name",
        apply_as(sa, foreign, false).await,
        named,
    );
    let labelled =
        "may write only NodeOverlays labelled app.kubernetes.io/managed-by=gpu-sharing-operator";
    let bare = unlabelled(overlays[0], "gpusharing-unlabelled");
    assert_owned_refused(
        "an unlabelled overlay",
        apply_as(sa, &bare, false).await,
        labelled,
    );
    // Someone else's, even named like ours: not taken over, changed or deleted.
    let theirs = unlabelled(overlays[0], "gpusharing-admin");
    admin_apply(admin, &theirs)
        .await
        .expect("the admin may write overlays");
    let mut takeover = overlays[0].clone();
    takeover["metadata"]["name"] = json!("gpusharing-admin");
    let takeover = apply_as(sa, &takeover, false);
    assert_owned_refused("taking an admin's overlay over", takeover.await, labelled);
    let weight = api_of(sa, &theirs)
        .patch(
            "gpusharing-admin",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"weight": 10000}})),
        )
        .await;
    assert_owned_refused("raising an admin's overlay's weight", weight, labelled);
    assert_owned_refused(
        "deleting an admin's overlay",
        delete_as(sa, &theirs).await,
        labelled,
    );
    let mut other = theirs.clone();
    other["metadata"]["name"] = json!("admin-8x");
    admin_apply(admin, &other).await.unwrap();
    assert_owned_refused(
        "deleting admin-8x",
        delete_as(sa, &other).await,
        "named gpusharing-*; refused: admin-8x",
    );
    for o in overlays {
        delete_as(sa, o)
            .await
            .expect("deleting its own NodeOverlay");
    }
    for o in [&theirs, &other] {
        delete_as(admin, o).await.unwrap();
    }
}

async fn claim_templates_fence(admin: &Client, sa: &Client, rct: &Value) {
    let ns = rct["metadata"]["namespace"].as_str().unwrap();
    testkit::apply_yaml(
        admin,
        &format!("apiVersion: v1\nkind: Namespace\nmetadata: {{name: {ns}}}\n"),
    )
    .await
    .unwrap();
    apply_as(sa, rct, false)
        .await
        .expect("applying its own ResourceClaimTemplate");
    let labelled = "may write only ResourceClaimTemplates labelled app.kubernetes.io/managed-by=gpu-sharing-operator";
    let bare = unlabelled(rct, "unlabelled");
    assert_owned_refused(
        "an unlabelled claim template",
        apply_as(sa, &bare, false).await,
        labelled,
    );
    // A user's template of the same kind: not taken over (the operator's apply of a template
    // with the user's name) and not deleted.
    let theirs = unlabelled(rct, "users-template");
    admin_apply(admin, &theirs).await.unwrap();
    let mut takeover = rct.clone();
    takeover["metadata"]["name"] = json!("users-template");
    assert_owned_refused(
        "taking a user's template over",
        apply_as(sa, &takeover, false).await,
        labelled,
    );
    assert_owned_refused(
        "deleting a user's template",
        delete_as(sa, &theirs).await,
        labelled,
    );
    delete_as(sa, rct)
        .await
        .expect("deleting its own ResourceClaimTemplate");
    delete_as(admin, &theirs).await.unwrap();
}

async fn configmaps_fence(admin: &Client, sa: &Client, cms: &[&Value]) {
    // Its own, as render writes them (dry-run: the operator owns their content later).
    for cm in cms {
        apply_as(sa, cm, true)
            .await
            .expect("applying its own ConfigMap");
    }
    let bare = unlabelled(cms[0], cms[0]["metadata"]["name"].as_str().unwrap());
    assert_owned_refused(
        "its ConfigMap without its label",
        apply_as(sa, &bare, true).await,
        "may write ConfigMaps only labelled app.kubernetes.io/managed-by=gpu-sharing-operator",
    );
    // The licence-holding ConfigMap of NVIDIA's vGPU: neither created nor deleted.
    let licensing = unlabelled(cms[0], "licensing-config");
    admin_apply(admin, &licensing).await.unwrap();
    let own = "may write only its own ConfigMaps (gpu-sharing-device-plugin-config, gpu-sharing-mig-parted-config, gpu-sharing-vgpu-devices-config); refused:";
    let denial = until("the broader RBAC to apply", LONG, || async {
        let mut o = cms[0].clone();
        o["metadata"]["name"] = json!("licensing-config-2");
        match apply_as(sa, &o, true).await {
            Err(kube::Error::Api(e)) if e.message.contains(OWNED_POLICY) => Some(e),
            Err(kube::Error::Api(e)) if e.message.contains("cannot") => None,
            other => panic!("creating a foreign ConfigMap was not refused: {other:?}"),
        }
    })
    .await;
    assert!(
        denial
            .message
            .contains(&format!("{own} licensing-config-2")),
        "{denial:?}"
    );
    assert_owned_refused(
        "deleting licensing-config",
        delete_as(sa, &licensing).await,
        &format!("{own} licensing-config"),
    );
    delete_as(admin, &licensing).await.unwrap();
}

/// A policy that selects no node.
const PROBE_POLICY: &str = "apiVersion: gpusharing.io/v1alpha1\nkind: GpuSharingPolicy\nmetadata: {name: fence-test}\nspec:\n  nodeSelector: {matchLabels: {gpusharing.io/profile: none}}\n  strategy: timeSlicing\n  timeSlicing: {replicas: 2}\n";

async fn policies_fence(admin: &Client, sa: &Client) {
    use gpu_sharing_operator::api::crd::GpuSharingPolicy;
    testkit::apply_yaml(admin, PROBE_POLICY).await.unwrap();
    let api = Api::<GpuSharingPolicy>::all(sa.clone());
    let only = "may change only its finalizer and the status of a GpuSharingPolicy; refused:";
    // Its finalizer, added and removed as kube's finalizer helper does (JSON patches).
    let fin = gpu_sharing_operator::api::names::FINALIZER;
    let add: json_patch::Patch = serde_json::from_value(json!([
        {"op": "test", "path": "/metadata/finalizers", "value": null},
        {"op": "add", "path": "/metadata/finalizers", "value": [fin]}]))
    .unwrap();
    api.patch(
        "fence-test",
        &PatchParams::default(),
        &Patch::Json::<()>(add),
    )
    .await
    .expect("adding its finalizer");
    // Its status, as finalize.rs writes it.
    let status = json!({"apiVersion": "gpusharing.io/v1alpha1", "kind": "GpuSharingPolicy",
        "status": {"matchedNodes": 0}});
    api.patch_status(
        "fence-test",
        &PatchParams::apply(allowed::FIELD_MANAGER).force(),
        &Patch::Apply(&status),
    )
    .await
    .expect("writing its status");
    for (p, says) in [
        (
            json!({"spec": {"timeSlicing": {"replicas": 8}}}),
            format!("{only} spec"),
        ),
        (
            json!({"metadata": {"labels": {"team": "a"}}}),
            format!("{only} metadata.labels"),
        ),
        (
            json!({"metadata": {"annotations": {"example.com/x": "1"}}}),
            format!("{only} metadata.annotations"),
        ),
        (
            json!({"metadata": {"finalizers": [fin, "example.com/hold"]}}),
            format!("{only} metadata.finalizers (other than {fin})"),
        ),
    ] {
        let r = api
            .patch("fence-test", &PatchParams::default(), &Patch::Merge(&p))
            .await;
        assert_owned_refused(&p.to_string(), r, &says);
    }
    let dry = DeleteParams {
        dry_run: true,
        ..Default::default()
    };
    let denial = until("the broader RBAC to apply", LONG, || async {
        match api.delete("fence-test", &dry).await {
            Err(kube::Error::Api(e)) if e.message.contains(OWNED_POLICY) => Some(e),
            Err(kube::Error::Api(e)) if e.message.contains("cannot") => None,
            other => panic!("deleting a policy was not refused: {other:?}"),
        }
    })
    .await;
    assert!(
        denial
            .message
            .contains("may not create or delete GpuSharingPolicies"),
        "{denial:?}"
    );
    let remove: json_patch::Patch = serde_json::from_value(json!([
        {"op": "test", "path": "/metadata/finalizers/0", "value": fin},
        {"op": "remove", "path": "/metadata/finalizers/0"}]))
    .unwrap();
    api.patch(
        "fence-test",
        &PatchParams::default(),
        &Patch::Json::<()>(remove),
    )
    .await
    .expect("removing its finalizer");
    Api::<GpuSharingPolicy>::all(admin.clone())
        .delete("fence-test", &DeleteParams::default())
        .await
        .unwrap();
}

async fn evictions_fence(cluster: &testkit::TestCluster, admin: &Client, sa: &Client) {
    use k8s_openapi::api::core::v1::Pod;
    let gpu_operator = cluster.gpu_operator_namespace.clone();
    let dry = kube::api::EvictParams {
        post_options: PostParams {
            dry_run: true,
            ..Default::default()
        },
        ..Default::default()
    };
    for ns in ["kube-system", gpu_operator.as_str(), "default"] {
        let pod = json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "evictee"},
            "spec": {"containers": [{"name": "c", "image": "pause"}]}});
        let pods = Api::<Pod>::namespaced(admin.clone(), ns);
        pods.create(
            &PostParams::default(),
            &serde_json::from_value(pod).unwrap(),
        )
        .await
        .unwrap();
        let r = Api::<Pod>::namespaced(sa.clone(), ns)
            .evict("evictee", &dry)
            .await;
        if ns == "default" {
            r.expect("evicting a user's pod");
        } else {
            let says = format!(
                "may not evict pods in system namespaces (kube-system, kube-public, kube-node-lease, {gpu_operator}); refused: {ns}"
            );
            assert_owned_refused(&format!("evicting in {ns}"), r, &says);
        }
        pods.delete(
            "evictee",
            &DeleteParams {
                grace_period_seconds: Some(0),
                ..Default::default()
            },
        )
        .await
        .unwrap();
    }
}

// ---------------------------------------------------------------------------------------------
// No silent fail-open (issue 39 item 2): the policies match the operator's account by name in
// any namespace, and the operator checks that it is fenced.

/// Installed in another namespace (what a kustomize `namespace:` overlay does to the
/// ServiceAccount and its bindings, not to the policies' CEL): the operator's account there is
/// fenced all the same; an account of another name (the chart's cleanup hook's) is not matched.
async fn fenced_in_any_namespace(cluster: &testkit::TestCluster, admin: &Client) {
    testkit::apply_yaml(
        admin,
        r#"
apiVersion: v1
kind: Namespace
metadata: {name: ops}
---
apiVersion: v1
kind: ServiceAccount
metadata: {name: gpu-sharing-operator, namespace: ops}
---
apiVersion: v1
kind: ServiceAccount
metadata: {name: gpu-sharing-operator-cleanup, namespace: ops}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {name: test-ops-operator}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: gpu-sharing-operator}
subjects:
  - {kind: ServiceAccount, name: gpu-sharing-operator, namespace: ops}
  - {kind: ServiceAccount, name: gpu-sharing-operator-cleanup, namespace: ops}
"#,
    )
    .await
    .unwrap();
    let ops = service_account_client(cluster, "ops", "gpu-sharing-operator").await;
    let team = json!({"metadata": {"labels": {"team": "a"}}});
    let denial = until("ops/gpu-sharing-operator to be bound", LONG, || async {
        match patch(&ops, NODE, team.clone(), true).await {
            Err(kube::Error::Api(e)) if e.message.contains("cannot patch") => None,
            r => Some(r),
        }
    })
    .await;
    assert_node_refused(
        "ops/gpu-sharing-operator labelling team",
        denial,
        "refused: team",
    );
    let own = json!({"metadata": {"labels": {"gpusharing.io/policy": "p"}}});
    patch(&ops, NODE, own, true)
        .await
        .expect("its own label, from another namespace");
    let other = service_account_client(cluster, "ops", "gpu-sharing-operator-cleanup").await;
    until("another account's dry-run label to pass", LONG, || async {
        patch(&other, NODE, team.clone(), true).await.ok()
    })
    .await;
    Api::<k8s_openapi::api::rbac::v1::ClusterRoleBinding>::all(admin.clone())
        .delete("test-ops-operator", &Default::default())
        .await
        .unwrap();
}

/// The operator binary as its ServiceAccount with `--require-fenced`, checking every second,
/// its health and plain-HTTP metrics on free ports.
struct FencedOperator {
    _child: tokio::process::Child,
    health: std::net::SocketAddr,
    metrics: std::net::SocketAddr,
    log: std::path::PathBuf,
}

impl FencedOperator {
    async fn start(cluster: &testkit::TestCluster) -> FencedOperator {
        let kubeconfig =
            service_account_kubeconfig_file(cluster, "gpu-sharing-system", "gpu-sharing-operator")
                .await;
        let local = |p: u16| std::net::SocketAddr::from(([127, 0, 0, 1], p));
        let (health, metrics) = (local(free_port()), local(free_port()));
        let log = cluster.dir.path().join("fence-operator.log");
        let child = tokio::process::Command::new(env!("CARGO_BIN_EXE_gpu-sharing-operator"))
            .args(["run", "--namespace=gpu-operator", "--metrics-insecure"])
            .arg(format!("--metrics-addr={metrics}"))
            .arg(format!("--health-addr={health}"))
            .args(["--require-fenced", "--fence-check-seconds=1"])
            .env("KUBECONFIG", &kubeconfig)
            .stdout(std::process::Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        FencedOperator {
            _child: child,
            health,
            metrics,
            log,
        }
    }

    /// Waits until `gpu_sharing_fenced` is `value` and `/readyz` answers `code`.
    /// The operator's log once `ready` holds for it (or as it is after `LONG`).
    async fn log_until(&self, ready: impl Fn(&str) -> bool) -> String {
        let read = || std::fs::read_to_string(&self.log).unwrap_or_default();
        let _ = tokio::time::timeout(LONG, async {
            while !ready(&read()) {
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            }
        })
        .await;
        read()
    }

    async fn until(&self, value: u8, code: u16) -> String {
        let found = tokio::time::timeout(LONG, async {
            loop {
                let m = support::https::get_plain(self.metrics, "/metrics").await;
                let r = support::https::get_plain(self.health, "/readyz").await;
                if let (Ok(m), Ok(r)) = (m, r)
                    && m.body.contains(&format!("\ngpu_sharing_fenced {value}\n"))
                    && r.status == code
                {
                    return r.body;
                }
                tokio::time::sleep(std::time::Duration::from_millis(250)).await;
            }
        })
        .await;
        found.unwrap_or_else(|_| {
            panic!(
                "never gpu_sharing_fenced {value} with /readyz {code}:\n{}",
                std::fs::read_to_string(&self.log).unwrap_or_default()
            )
        })
    }
}

/// Without the admission policies the operator reports itself not fenced (metric 0, a warning
/// naming the writes that went through) and, with `--require-fenced`, is not ready; once they
/// are installed it reports fenced (1) and becomes ready. Returns to the caller with the
/// policies installed.
async fn fence_check_follows_the_policies(cluster: &testkit::TestCluster, admin: &Client) {
    // A policy governing no node carries the verdict as its `Fenced` condition.
    testkit::apply_yaml(admin, FENCED_POLICY).await.unwrap();
    let op = FencedOperator::start(cluster).await;
    let body = op.until(0, 503).await;
    assert!(body.contains("not fenced"), "{body}");
    // The gauge starts at 0 and /readyz says "not fenced" before the first check has run, so
    // the check's warning may come after them: wait for it.
    let log = op
        .log_until(|l| {
            l.contains("NOT fenced")
                && l.contains(gpu_sharing_operator::runtime::fence::PROBE_LABEL)
        })
        .await;
    assert!(
        log.contains("NOT fenced")
            && log.contains(gpu_sharing_operator::runtime::fence::PROBE_LABEL),
        "{log}"
    );
    let message = fenced_condition(admin, "False", "NotFenced").await;
    assert!(
        message.contains(gpu_sharing_operator::runtime::fence::PROBE_LABEL),
        "{message}"
    );
    apply_config(admin, &[POLICY_FILE, CP_POLICY_FILE, OWNED_POLICY_FILE]).await;
    op.until(1, 200).await;
    fenced_condition(admin, "True", "AdmissionPoliciesEnforced").await;
    // Deleted while the operator runs: it takes its finalizer off (the owned-objects policy
    // lets it), so the policy is gone, not left terminating.
    let policies = Api::<gpu_sharing_operator::api::crd::GpuSharingPolicy>::all(admin.clone());
    policies
        .delete("fenced-condition", &DeleteParams::default())
        .await
        .unwrap();
    until("the policy fenced-condition to be gone", LONG, || async {
        policies
            .get_opt("fenced-condition")
            .await
            .unwrap()
            .is_none()
            .then_some(())
    })
    .await;
    drop(op);
}

const FENCED_POLICY: &str = "apiVersion: gpusharing.io/v1alpha1\nkind: GpuSharingPolicy\nmetadata: {name: fenced-condition}\nspec:\n  nodeSelector: {matchLabels: {gpusharing.io/profile: none}}\n  strategy: timeSlicing\n  timeSlicing: {replicas: 2}\n";

/// Waits until the policy `fenced-condition` has its `Fenced` condition at `status` with
/// `reason`; returns the message.
async fn fenced_condition(admin: &Client, status: &str, reason: &str) -> String {
    until(
        &format!("condition Fenced {status} {reason}"),
        LONG,
        || async {
            let s = policy_status(admin, "fenced-condition").await?;
            let c = condition(&s, "Fenced")?;
            (c["status"] == status && c["reason"] == reason)
                .then(|| c["message"].as_str().unwrap_or_default().to_string())
        },
    )
    .await
}
