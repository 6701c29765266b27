//! End-to-end audit of edits: every kind of policy edit must reach the nodes. Each test converges
//! a policy, edits it, and waits until the policy reports Ready for the new generation; it then
//! checks what the node actually runs (allocatable and GPU Feature Discovery labels written by
//! the node simulator, which plays NVIDIA's device plugin, GFD and MIG manager), not only the
//! labels the operator wrote.

mod support;

use std::collections::BTreeMap;

use gpu_sharing_operator::api::crd::GpuSharingPolicy;
use gpu_sharing_operator::api::names;
use k8s_openapi::api::core::v1::{Namespace, Node};
use k8s_openapi::api::resource::v1::ResourceClaimTemplate;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams, VersionMatch};
use kube::{Client, ResourceExt};
use serde_json::{Value, json};
use support::*;

const L4_0: &str = "l4-node-0";
const L4_1: &str = "l4-node-1";
const H200: &str = "h200-node-0";
const A100: &str = "a100-node-0";

fn ts_policy(name: &str, profile: &str, replicas: i32) -> String {
    format!(
        "apiVersion: gpusharing.io/v1alpha1\nkind: GpuSharingPolicy\nmetadata: {{name: {name}}}\nspec:\n  nodeSelector: {{matchLabels: {{gpusharing.io/profile: {profile}}}}}\n  strategy: timeSlicing\n  timeSlicing: {{replicas: {replicas}}}\n"
    )
}

fn mps_policy(name: &str, profile: &str, replicas: i32) -> String {
    format!(
        "apiVersion: gpusharing.io/v1alpha1\nkind: GpuSharingPolicy\nmetadata: {{name: {name}}}\nspec:\n  nodeSelector: {{matchLabels: {{gpusharing.io/profile: {profile}}}}}\n  strategy: mps\n  mps: {{replicas: {replicas}}}\n"
    )
}

fn mig_policy(name: &str, profile: &str, layout: &str) -> String {
    format!(
        "apiVersion: gpusharing.io/v1alpha1\nkind: GpuSharingPolicy\nmetadata: {{name: {name}}}\nspec:\n  nodeSelector: {{matchLabels: {{gpusharing.io/profile: {profile}}}}}\n  strategy: mig\n  mig: {{migStrategy: single, layout: {layout}}}\n"
    )
}

/// The policy's status once it reports Ready for its current generation.
async fn converged(c: &Client, name: &str) -> Option<Value> {
    let p = Api::<GpuSharingPolicy>::all(c.clone())
        .get(name)
        .await
        .ok()?;
    converged_of(p)
}

/// The policy's status if it reports Ready for its current generation.
fn converged_of(p: GpuSharingPolicy) -> Option<Value> {
    let generation = p.metadata.generation?;
    let s = serde_json::to_value(p.status?).ok()?;
    let ready = condition(&s, "Ready")?;
    (s["observedGeneration"] == generation
        && ready["status"] == "True"
        && ready["observedGeneration"] == generation)
        .then_some(s)
}

/// What the node runs: its allocatable NVIDIA resources.
async fn allocatable(c: &Client, node: &str) -> BTreeMap<String, String> {
    let n = Api::<Node>::all(c.clone()).get(node).await.unwrap();
    n.status
        .and_then(|s| s.allocatable)
        .unwrap_or_default()
        .into_iter()
        .filter(|(k, _)| k.starts_with("nvidia.com/"))
        .map(|(k, v)| (k, v.0))
        .collect()
}

/// The node `node` as it was at `resource_version` (a list at exactly that version).
async fn node_at(c: &Client, node: &str, resource_version: &str) -> Node {
    let lp = ListParams::default()
        .fields(&format!("metadata.name={node}"))
        .at(resource_version)
        .matching(VersionMatch::Exact);
    let mut list = Api::<Node>::all(c.clone()).list(&lp).await.unwrap();
    list.items.pop().expect("the node existed then")
}

/// Whether the node runs `want` (its non-zero allocatable NVIDIA resources; resources not named
/// must be 0 or absent) with the GFD labels `gfd`; else what it runs.
fn runs(n: &Node, want: &[(&str, &str)], gfd: &[(&str, &str)]) -> Result<(), String> {
    let nonzero: BTreeMap<String, String> = n
        .status
        .as_ref()
        .and_then(|s| s.allocatable.clone())
        .unwrap_or_default()
        .into_iter()
        .filter(|(k, v)| k.starts_with("nvidia.com/") && v.0 != "0")
        .map(|(k, v)| (k, v.0))
        .collect();
    let want: BTreeMap<String, String> = want
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    let l = n.labels();
    let labels_ok = gfd
        .iter()
        .all(|(k, v)| l.get(*k).map(String::as_str) == Some(*v));
    if nonzero == want && labels_ok {
        return Ok(());
    }
    let shown: BTreeMap<&String, &String> = l
        .iter()
        .filter(|(k, _)| gfd.iter().any(|(g, _)| *k == g))
        .collect();
    Err(format!("allocatable {nonzero:?}, labels {shown:?}"))
}

/// Waits until the policy is Ready for its generation and checks that the node already ran
/// `want` (allocatable NVIDIA resources, non-zero ones; resources not named must be 0 or
/// absent) with GPU Feature Discovery's labels `gfd` at the moment the policy said so: the node
/// as of the status's resourceVersion, so a Ready reported before the device plugin advertised
/// the new devices, or before GFD's report, fails here.
async fn node_runs(
    c: &Client,
    policy: &str,
    node: &str,
    want: &[(&str, &str)],
    gfd: &[(&str, &str)],
) {
    let what = format!("{policy} Ready for its generation (with {node} running {want:?} {gfd:?})");
    let rv = until(&what, LONG, || async {
        let p = Api::<GpuSharingPolicy>::all(c.clone())
            .get(policy)
            .await
            .ok()?;
        let rv = p.resource_version()?;
        converged_of(p).map(|_| rv)
    })
    .await;
    let at_ready = node_at(c, node, &rv).await;
    if let Err(ran) = runs(&at_ready, want, gfd) {
        panic!(
            "{policy} reported Ready for its generation at resourceVersion {rv} while {node} ran {ran}, not {want:?} {gfd:?}"
        );
    }
}

async fn edit(c: &Client, name: &str, patch: Value) {
    Api::<GpuSharingPolicy>::all(c.clone())
        .patch(name, &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .unwrap();
}

/// What a node runs: its non-zero allocatable NVIDIA resources, and GFD labels it carries.
struct Runs<'a> {
    allocatable: &'a [(&'a str, &'a str)],
    labels: &'a [(&'a str, &'a str)],
}

/// One edit of one policy on one node.
struct EditCase<'a> {
    node: &'a str,
    /// Value of the node's `gpusharing.io/profile` label (what the policy selects).
    profile: &'a str,
    policy_yaml: &'a str,
    policy: &'a str,
    before: Runs<'a>,
    patch: Value,
    after: Runs<'a>,
}

/// Applies the policy, waits until the node runs `before`, edits the policy, waits until the
/// node runs `after` with the policy Ready for the new generation. Returns both statuses.
async fn edit_reaches_the_node(case: EditCase<'_>) -> (Value, Value) {
    let (_g, cluster, _sim) = setup().await;
    let c = cluster.client.clone();
    let op = Operator::start(c.clone(), Some(NS));
    label_node(&c, case.node, "gpusharing.io/profile", Some(case.profile)).await;
    testkit::apply_yaml(&c, case.policy_yaml).await.unwrap();
    let (b, a) = (&case.before, &case.after);
    node_runs(&c, case.policy, case.node, b.allocatable, b.labels).await;
    let before = converged(&c, case.policy).await.unwrap();
    edit(&c, case.policy, case.patch).await;
    node_runs(&c, case.policy, case.node, a.allocatable, a.labels).await;
    let after = converged(&c, case.policy).await.unwrap();
    op.stop().await;
    (before, after)
}

#[tokio::test]
async fn time_slicing_replicas_edit_reaches_the_node() {
    let (before, after) = edit_reaches_the_node(EditCase {
        node: L4_0,
        profile: "ts",
        policy_yaml: &ts_policy("ts", "ts", 4),
        policy: "ts",
        before: Runs {
            allocatable: &[("nvidia.com/gpu", "16")],
            labels: &[("nvidia.com/gpu.replicas", "4")],
        },
        patch: json!({"spec": {"timeSlicing": {"replicas": 8}}}),
        after: Runs {
            allocatable: &[("nvidia.com/gpu", "32")],
            labels: &[("nvidia.com/gpu.replicas", "8")],
        },
    })
    .await;
    assert_ne!(
        after["deviceConfigKey"], before["deviceConfigKey"],
        "new content, new key"
    );
    assert_eq!(after["capacity"]["schedulableReplicas"], 32);
}

#[tokio::test]
async fn mps_replicas_edit_reaches_the_node() {
    let (_, after) = edit_reaches_the_node(EditCase {
        node: H200,
        profile: "mps",
        policy_yaml: &mps_policy("mps", "mps", 4),
        policy: "mps",
        before: Runs {
            allocatable: &[("nvidia.com/gpu", "32")],
            labels: &[("nvidia.com/gpu.sharing-strategy", "mps")],
        },
        patch: json!({"spec": {"mps": {"replicas": 2}}}),
        after: Runs {
            allocatable: &[("nvidia.com/gpu", "16")],
            labels: &[
                ("nvidia.com/gpu.replicas", "2"),
                ("nvidia.com/gpu.sharing-strategy", "mps"),
            ],
        },
    })
    .await;
    assert_eq!(after["capacity"]["memoryPerClientMib"], 143771 / 2);
    assert_eq!(after["capacity"]["threadsPerClientPercent"], 50);
}

#[tokio::test]
async fn named_layout_edit_reaches_the_node() {
    edit_reaches_the_node(EditCase {
        node: A100,
        profile: "mig",
        policy_yaml: &mig_policy("mig", "mig", "all-1g.10gb"),
        policy: "mig",
        before: Runs {
            allocatable: &[("nvidia.com/gpu", "56")],
            labels: &[("nvidia.com/mig.config", "all-1g.10gb")],
        },
        patch: json!({"spec": {"mig": {"layout": "all-2g.20gb"}}}),
        after: Runs {
            allocatable: &[("nvidia.com/gpu", "24")],
            labels: &[
                ("nvidia.com/mig.config", "all-2g.20gb"),
                ("nvidia.com/mig.config.state", "success"),
            ],
        },
    })
    .await;
}

/// The case of the bug report: an edited custom layout kept its name, so the MIG manager never
/// saw it, while the policy said Ready.
#[tokio::test]
async fn custom_layout_edit_reaches_the_node() {
    let (_g, cluster, _sim) = setup().await;
    let c = cluster.client.clone();
    // The operator's own client (`run` builds the same), which cuts JSON nested too deep.
    let op = Operator::start(operator_client(&cluster).await, Some(NS));
    label_node(&c, A100, "gpusharing.io/profile", Some("mig-split")).await;
    testkit::apply_yaml(&c, include_str!("../examples/mig-custom-split.yaml"))
        .await
        .unwrap();
    node_runs(
        &c,
        "a100-mig-split",
        A100,
        &[
            ("nvidia.com/gpu", "4"),
            ("nvidia.com/mig-1g.10gb", "12"),
            ("nvidia.com/mig-2g.20gb", "8"),
        ],
        &[],
    )
    .await;
    let before = converged(&c, "a100-mig-split").await.unwrap()["migConfig"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(before.starts_with("custom-a100-mig-split-"), "{before}");
    assert_eq!(labels(&c, A100).await["nvidia.com/mig.config"], before);

    edit(
        &c,
        "a100-mig-split",
        json!({"spec": {"mig": {"customLayout": [
            {"devices": [0, 1, 2, 3], "migEnabled": true, "migDevices": {"1g.10gb": 7}},
            {"devices": [4, 5, 6, 7], "migEnabled": false}
        ]}}}),
    )
    .await;
    node_runs(
        &c,
        "a100-mig-split",
        A100,
        &[("nvidia.com/gpu", "4"), ("nvidia.com/mig-1g.10gb", "28")],
        &[("nvidia.com/mig.config.state", "success")],
    )
    .await;
    let after = converged(&c, "a100-mig-split").await.unwrap()["migConfig"]
        .as_str()
        .unwrap()
        .to_string();
    assert_ne!(after, before, "an edited layout gets a new name");
    assert_eq!(labels(&c, A100).await["nvidia.com/mig.config"], after);
    // The old layout leaves our mig-parted ConfigMap once no node names it.
    until("old layout removed", LONG, || async {
        let data = configmap_data(&c, "gpu-sharing-mig-parted-config").await?;
        let text = &data["config.yaml"];
        (!text.contains(&before) && text.contains(&after)).then_some(())
    })
    .await;

    // `devices: all`, as mig-parted's own configs write it, is accepted and rendered so.
    edit(
        &c,
        "a100-mig-split",
        json!({"spec": {"mig": {"customLayout": [
            {"devices": "all", "migEnabled": true, "migDevices": {"2g.20gb": 3}}
        ]}}}),
    )
    .await;
    node_runs(
        &c,
        "a100-mig-split",
        A100,
        &[("nvidia.com/mig-2g.20gb", "24")],
        &[("nvidia.com/mig.config.state", "success")],
    )
    .await;
    let all = converged(&c, "a100-mig-split").await.unwrap()["migConfig"]
        .as_str()
        .unwrap()
        .to_string();
    let data = configmap_data(&c, "gpu-sharing-mig-parted-config")
        .await
        .unwrap();
    let config: Value = testkit::parse_yaml_documents(&data["config.yaml"]).unwrap()[0].clone();
    assert_eq!(
        config["mig-configs"][&all],
        json!([{"devices": "all", "mig-enabled": true, "mig-devices": {"2g.20gb": 3}}]),
        "{config}"
    );
    // Anything else is kept by the API server (no schema can type "a word or a list"), and
    // refused by the operator naming the field; the node keeps running the last layout.
    edit(
        &c,
        "a100-mig-split",
        json!({"spec": {"mig": {"customLayout": [
            {"devices": "every", "migEnabled": true, "migDevices": {"1g.10gb": 7}}
        ]}}}),
    )
    .await;
    let s = until("devices: every refused", LONG, || async {
        let s = policy_status(&c, "a100-mig-split").await?;
        (condition(&s, "Accepted")?["reason"] == "InvalidSpec").then_some(s)
    })
    .await;
    let msg = condition(&s, "Accepted").unwrap()["message"]
        .as_str()
        .unwrap();
    assert!(
        msg.contains("spec.mig.customLayout[0].devices") && msg.contains("got \"every\""),
        "{msg}"
    );
    assert_eq!(labels(&c, A100).await["nvidia.com/mig.config"], all);

    // `devices` nested 300 deep: the API server keeps it (it allows 10,000 levels), serde_json
    // refuses more than 128 and kube parses a whole list of policies at once. The operator
    // still reads every policy: this one is refused naming the field, the other goes on.
    let deep = (0..300).fold(json!(0), |v, _| Value::Array(vec![v]));
    // A plain kube client cannot read such a policy back either: the test's own reads of it
    // go through the operator's.
    let oc = operator_client(&cluster).await;
    let yaml = json!({
        "apiVersion": "gpusharing.io/v1alpha1", "kind": "GpuSharingPolicy",
        "metadata": {"name": "deep-devices"},
        "spec": {"nodeSelector": {"matchLabels": {"gpusharing.io/profile": "nobody"}},
            "strategy": "mig", "mig": {"migStrategy": "mixed", "customLayout": [
                {"devices": deep, "migEnabled": true, "migDevices": {"1g.10gb": 7}}]}}
    });
    Api::<GpuSharingPolicy>::all(oc.clone())
        .create(
            &PostParams::default(),
            &serde_json::from_value(yaml).unwrap(),
        )
        .await
        .expect("the API server keeps deep JSON in devices");
    let s = until("deep devices refused", LONG, || async {
        let s = policy_status(&oc, "deep-devices").await?;
        (condition(&s, "Accepted")?["reason"] == "InvalidSpec").then_some(s)
    })
    .await;
    let msg = condition(&s, "Accepted").unwrap()["message"].to_string();
    assert!(
        msg.contains("spec.mig.customLayout[0].devices") && msg.contains("..."),
        "{msg}"
    );
    edit(
        &c,
        "a100-mig-split",
        json!({"spec": {"mig": {"customLayout": [
            {"devices": "all", "migEnabled": true, "migDevices": {"1g.10gb": 7}}
        ]}}}),
    )
    .await;
    node_runs(
        &c,
        "a100-mig-split",
        A100,
        &[("nvidia.com/mig-1g.10gb", "56")],
        &[("nvidia.com/mig.config.state", "success")],
    )
    .await;
    Api::<GpuSharingPolicy>::all(oc)
        .delete("deep-devices", &DeleteParams::default())
        .await
        .unwrap();
    op.stop().await;
}

/// A custom layout an A100 80GB cannot hold, although its compute slices add up to 7: the two
/// 3g.40gb take memory slices 0-3 and 4-7 and leave no slot for the 1g.10gb. The node is
/// refused (`Invalid`) before anything is written to it, the policy says which field, which
/// model, why and the nearest feasible layout; edited to a layout the GPU can hold, it
/// converges and shows where the instances went.
#[tokio::test]
async fn an_infeasible_custom_layout_is_refused_and_a_feasible_edit_converges() {
    let (_g, cluster, _sim) = setup().await;
    let c = cluster.client.clone();
    let op = Operator::start(c.clone(), Some(NS));
    label_node(&c, A100, "gpusharing.io/profile", Some("mig-geometry")).await;
    let node_before = Api::<Node>::all(c.clone()).get(A100).await.unwrap();
    testkit::apply_yaml(
        &c,
        "apiVersion: gpusharing.io/v1alpha1\nkind: GpuSharingPolicy\nmetadata: {name: geometry}\nspec:\n  nodeSelector: {matchLabels: {gpusharing.io/profile: mig-geometry}}\n  strategy: mig\n  mig:\n    migStrategy: mixed\n    customLayout:\n    - {migEnabled: true, migDevices: {3g.40gb: 2, 1g.10gb: 1}}\n",
    )
    .await
    .unwrap();
    let s = until("Degraded: MigGeometryInfeasible", LONG, || async {
        let s = policy_status(&c, "geometry").await?;
        (condition(&s, "Degraded")?["reason"] == "MigGeometryInfeasible").then_some(s)
    })
    .await;
    let msg = condition(&s, "Degraded").unwrap()["message"]
        .as_str()
        .unwrap();
    for part in [
        "spec.mig.customLayout[0].migDevices",
        "A100-SXM4-80GB cannot hold",
        "no slot is left for 1g.10gb",
        "nearest feasible layout",
        A100,
    ] {
        assert!(msg.contains(part), "{part:?} not in {msg}");
    }
    assert_eq!(
        condition(&s, "Accepted").unwrap()["reason"],
        "IncompatibleNodes"
    );
    assert_eq!(condition(&s, "Ready").unwrap()["status"], "False");
    assert_eq!(s["nodeDetails"][0]["name"], A100, "{s}");
    assert_eq!(s["nodeDetails"][0]["state"], "Invalid", "{s}");
    let u = condition(&s, "MigGeometryUnverified").unwrap();
    assert_eq!(
        (&u["status"], &u["reason"]),
        (&json!("False"), &json!("GeometryChecked"))
    );
    // Nothing was written to the node (the status is written by the pass after the one that
    // planned it, so a node write would have come first): the labels we manage are as they
    // were, and our field manager owns nothing on it.
    let node_after = Api::<Node>::all(c.clone()).get(A100).await.unwrap();
    let managed = |n: &Node| -> Vec<(String, Option<String>)> {
        names::MANAGED_LABELS
            .iter()
            .map(|k| (k.to_string(), n.labels().get(*k).cloned()))
            .collect()
    };
    assert_eq!(managed(&node_after), managed(&node_before));
    assert!(
        node_after
            .managed_fields()
            .iter()
            .all(|f| f.manager.as_deref() != Some(names::MANAGER)),
        "{:?}",
        node_after.managed_fields()
    );
    plan_agrees(&c).await;
    // The same layout in a policy whose selector pins the product: refused at once, before any
    // node matches (no node has this profile label).
    testkit::apply_yaml(
        &c,
        "apiVersion: gpusharing.io/v1alpha1\nkind: GpuSharingPolicy\nmetadata: {name: geometry-pinned}\nspec:\n  nodeSelector: {matchLabels: {gpusharing.io/profile: nowhere, nvidia.com/gpu.product: NVIDIA-A100-SXM4-80GB}}\n  strategy: mig\n  mig:\n    migStrategy: mixed\n    customLayout:\n    - {migEnabled: true, migDevices: {3g.40gb: 2, 1g.10gb: 1}}\n",
    )
    .await
    .unwrap();
    let s = until("pinned policy refused", LONG, || async {
        let s = policy_status(&c, "geometry-pinned").await?;
        (condition(&s, "Accepted")?["reason"] == "InvalidSpec").then_some(s)
    })
    .await;
    let msg = condition(&s, "Accepted").unwrap()["message"]
        .as_str()
        .unwrap();
    assert!(
        msg.contains("spec.mig.customLayout[0].migDevices")
            && msg.contains("A100-SXM4-80GB cannot hold")
            && msg.contains("pins nvidia.com/gpu.product"),
        "{msg}"
    );
    Api::<GpuSharingPolicy>::all(c.clone())
        .delete("geometry-pinned", &DeleteParams::default())
        .await
        .unwrap();

    edit(
        &c,
        "geometry",
        json!({"spec": {"mig": {"customLayout": [
            {"migEnabled": true, "migDevices": {"3g.40gb": 1, "2g.20gb": 1, "1g.10gb": 2}}
        ]}}}),
    )
    .await;
    node_runs(
        &c,
        "geometry",
        A100,
        &[
            ("nvidia.com/mig-3g.40gb", "8"),
            ("nvidia.com/mig-2g.20gb", "8"),
            ("nvidia.com/mig-1g.10gb", "16"),
        ],
        &[("nvidia.com/mig.config.state", "success")],
    )
    .await;
    let s = converged(&c, "geometry").await.unwrap();
    assert_eq!(
        s["migGeometry"],
        json!([
            "customLayout[0] on A100-SXM4-80GB: [3g.40gb@4][2g.20gb@0][1g.10gb@2][1g.10gb@3], free: none"
        ]),
        "{s}"
    );
    assert_eq!(condition(&s, "Degraded").unwrap()["status"], "False");
    plan_agrees(&c).await;
    op.stop().await;
}

/// A custom layout on a GPU model without a MIG geometry table is applied unchecked, and the
/// policy says so (`MigGeometryUnverified`, naming the product); when NVIDIA's MIG manager
/// (simulated, with a fault injected) then fails it, the rollout halts, naming the node.
#[tokio::test]
async fn a_layout_on_an_unknown_gpu_model_applies_with_a_warning_and_its_failure_halts_the_rollout()
{
    const PRODUCT: &str = "NVIDIA-Future-GPU-80GB";
    const HARDWARE: &str = "simulator.gpusharing.io/hardware";
    let (_g, cluster, _sim) = setup().await;
    let c = cluster.client.clone();
    let nodes: Api<Node> = Api::all(c.clone());
    // The A100 node becomes a GPU no table describes (its product label, and the hardware the
    // simulator recorded), whose MIG manager fails its next reconfiguration.
    let mut hw: Value = until("hardware recorded", LONG, || async {
        let n = nodes.get(A100).await.ok()?;
        serde_json::from_str(n.annotations().get(HARDWARE)?).ok()
    })
    .await;
    hw["product"] = json!(PRODUCT);
    nodes
        .patch(
            A100,
            &PatchParams::default(),
            &Patch::Merge(&json!({"metadata": {
                "labels": {"nvidia.com/gpu.product": PRODUCT, "gpusharing.io/profile": "future"},
                "annotations": {HARDWARE: hw.to_string(), "simulator.gpusharing.io/fault": "mig-apply-fail"}
            }})),
        )
        .await
        .unwrap();
    let op = Operator::start(c.clone(), Some(NS));
    testkit::apply_yaml(
        &c,
        "apiVersion: gpusharing.io/v1alpha1\nkind: GpuSharingPolicy\nmetadata: {name: future}\nspec:\n  nodeSelector: {matchLabels: {gpusharing.io/profile: future}}\n  strategy: mig\n  mig:\n    migStrategy: mixed\n    customLayout:\n    - {migEnabled: true, migDevices: {1g.10gb: 7}}\n",
    )
    .await
    .unwrap();
    let s = until("RolloutHalted", LONG, || async {
        let s = policy_status(&c, "future").await?;
        (condition(&s, "Progressing")?["reason"] == "RolloutHalted").then_some(s)
    })
    .await;
    let halted = condition(&s, "Progressing").unwrap()["message"]
        .as_str()
        .unwrap();
    assert!(halted.contains(A100), "{halted}");
    let u = condition(&s, "MigGeometryUnverified").unwrap();
    assert_eq!(
        (&u["status"], &u["reason"]),
        (&json!("True"), &json!("UnknownGpuModel")),
        "{u}"
    );
    assert!(u["message"].as_str().unwrap().contains(PRODUCT), "{u}");
    // The layout did reach the node (unchecked): the MIG manager is what failed it.
    let l = labels(&c, A100).await;
    assert!(
        l["nvidia.com/mig.config"].starts_with("custom-future-"),
        "{l:?}"
    );
    assert_eq!(l["nvidia.com/mig.config.state"], "failed");
    op.stop().await;
}

#[tokio::test]
async fn mig_time_slicing_replicas_edit_reaches_the_node() {
    // all-1g.10gb (7 instances per GPU, single strategy: advertised as nvidia.com/gpu), x2.
    let (before, after) = edit_reaches_the_node(EditCase {
        node: A100,
        profile: "mig-shared",
        policy_yaml: include_str!("../examples/mig-1g10gb-time-sliced.yaml"),
        policy: "a100-mig-shared",
        before: Runs {
            allocatable: &[("nvidia.com/gpu", "112")],
            labels: &[("nvidia.com/gpu.replicas", "2")],
        },
        patch: json!({"spec": {"mig": {"timeSlicing": {"replicas": 3}}}}),
        after: Runs {
            allocatable: &[("nvidia.com/gpu", "168")],
            labels: &[("nvidia.com/gpu.replicas", "3")],
        },
    })
    .await;
    // The status agrees with what the device plugin advertises, although GFD now labels the
    // node with its 56 MIG devices (gpu.count) rather than its 8 GPUs.
    for (s, want) in [(&before, 112), (&after, 168)] {
        assert_eq!(s["capacity"]["physicalGpus"], 8, "{s}");
        assert_eq!(s["capacity"]["schedulableReplicas"], want, "{s}");
    }
}

#[tokio::test]
async fn strategy_edit_mig_to_mps_reaches_the_node() {
    edit_reaches_the_node(EditCase {
        node: A100,
        profile: "p",
        policy_yaml: &mig_policy("p", "p", "all-1g.10gb"),
        policy: "p",
        before: Runs {
            allocatable: &[("nvidia.com/gpu", "56")],
            labels: &[],
        },
        patch: json!({"spec": {"strategy": "mps", "mig": null, "mps": {"replicas": 4}}}),
        after: Runs {
            allocatable: &[("nvidia.com/gpu", "32")],
            labels: &[
                ("nvidia.com/mig.config", "all-disabled"),
                ("nvidia.com/gpu.sharing-strategy", "mps"),
            ],
        },
    })
    .await;
}

#[tokio::test]
async fn strategy_edit_mps_to_time_slicing_reaches_the_node() {
    edit_reaches_the_node(EditCase {
        node: H200,
        profile: "p",
        policy_yaml: &mps_policy("p", "p", 4),
        policy: "p",
        before: Runs {
            allocatable: &[("nvidia.com/gpu", "32")],
            labels: &[("nvidia.com/gpu.sharing-strategy", "mps")],
        },
        patch: json!({"spec": {"strategy": "timeSlicing", "mps": null, "timeSlicing": {"replicas": 3}}}),
        after: Runs {
            allocatable: &[("nvidia.com/gpu", "24")],
            labels: &[
                ("nvidia.com/gpu.sharing-strategy", "time-slicing"),
                ("nvidia.com/gpu.replicas", "3"),
            ],
        },
    })
    .await;
}

#[tokio::test]
async fn selector_edit_moves_nodes_between_policies() {
    let (_g, cluster, _sim) = setup().await;
    let c = cluster.client.clone();
    let op = Operator::start(c.clone(), Some(NS));
    label_node(&c, L4_0, "gpusharing.io/profile", Some("a")).await;
    label_node(&c, L4_1, "gpusharing.io/profile", Some("b")).await;
    testkit::apply_yaml(&c, &ts_policy("x", "a", 4))
        .await
        .unwrap();
    testkit::apply_yaml(&c, &ts_policy("y", "b", 2))
        .await
        .unwrap();
    node_runs(&c, "x", L4_0, &[("nvidia.com/gpu", "16")], &[]).await;
    node_runs(&c, "y", L4_1, &[("nvidia.com/gpu", "8")], &[]).await;

    // Swap the selectors: each node moves to the other policy.
    edit(
        &c,
        "x",
        json!({"spec": {"nodeSelector": {"matchLabels": {"gpusharing.io/profile": "b"}}}}),
    )
    .await;
    edit(
        &c,
        "y",
        json!({"spec": {"nodeSelector": {"matchLabels": {"gpusharing.io/profile": "a"}}}}),
    )
    .await;
    node_runs(
        &c,
        "x",
        L4_1,
        &[("nvidia.com/gpu", "16")],
        &[("gpusharing.io/policy", "x")],
    )
    .await;
    node_runs(
        &c,
        "y",
        L4_0,
        &[("nvidia.com/gpu", "8")],
        &[("gpusharing.io/policy", "y")],
    )
    .await;
    for p in ["x", "y"] {
        let s = converged(&c, p).await.unwrap();
        assert_eq!(
            (s["matchedNodes"].as_i64(), s["appliedNodes"].as_i64()),
            (Some(1), Some(1))
        );
    }
    op.stop().await;
}

#[tokio::test]
async fn priority_edit_changes_the_winner_on_the_node() {
    let (_g, cluster, _sim) = setup().await;
    let c = cluster.client.clone();
    let op = Operator::start(c.clone(), Some(NS));
    label_node(&c, L4_0, "gpusharing.io/profile", Some("shared")).await;
    testkit::apply_yaml(&c, &ts_policy("first", "shared", 4))
        .await
        .unwrap();
    node_runs(&c, "first", L4_0, &[("nvidia.com/gpu", "16")], &[]).await;
    testkit::apply_yaml(&c, &ts_policy("second", "shared", 2))
        .await
        .unwrap();
    // The older policy wins at equal priority.
    until("second Conflicted", LONG, || async {
        let s = policy_status(&c, "second").await?;
        (condition(&s, "Conflicted")?["status"] == "True").then_some(())
    })
    .await;
    assert_eq!(allocatable(&c, L4_0).await["nvidia.com/gpu"], "16");

    edit(&c, "second", json!({"spec": {"priority": 10}})).await;
    node_runs(
        &c,
        "second",
        L4_0,
        &[("nvidia.com/gpu", "8")],
        &[("gpusharing.io/policy", "second")],
    )
    .await;
    // Now a higher priority decides: an override, not a conflict.
    until("first Overridden, naming the winner", LONG, || async {
        let s = policy_status(&c, "first").await?;
        let cond = condition(&s, "Overridden")?;
        (cond["status"] == "True"
            && cond["message"].as_str()?.contains("second")
            && condition(&s, "Conflicted")?["status"] == "False")
            .then_some(())
    })
    .await;
    op.stop().await;
}

#[tokio::test]
async fn dra_settings_edit_reaches_the_templates() {
    let (_g, cluster, _sim) = setup().await;
    let c = cluster.client.clone();
    let team = "gpu-test6";
    let ns: Namespace = serde_json::from_value(json!({"metadata": {"name": team}})).unwrap();
    Api::<Namespace>::all(c.clone())
        .create(&PostParams::default(), &ns)
        .await
        .unwrap();
    let op = Operator::start(c.clone(), Some(NS));
    label_node(&c, H200, "gpusharing.io/profile", Some("dra")).await;
    testkit::apply_yaml(&c, include_str!("../examples/dra-mps.yaml"))
        .await
        .unwrap();
    // On timeout, say where it stood (this wait timed out once in CI under load).
    if tokio::time::timeout(
        LONG,
        until("dra-mps Ready", LONG * 2, || converged(&c, "dra-mps")),
    )
    .await
    .is_err()
    {
        let node = Api::<Node>::all(c.clone()).get(H200).await.unwrap();
        panic!(
            "dra-mps not Ready after {LONG:?}: status {}\n{H200} labels {:?}\nallocatable {:?}",
            serde_json::to_string_pretty(&policy_status(&c, "dra-mps").await).unwrap(),
            node.metadata.labels,
            node.status.and_then(|s| s.allocatable)
        );
    }
    let templates: Api<ResourceClaimTemplate> = Api::namespaced(c.clone(), team);
    assert!(templates.get_opt("single-gpu").await.unwrap().is_some());

    // New limits under a new template name: the new template appears, the old one goes.
    edit(
        &c,
        "dra-mps",
        json!({"spec": {"dra": {"templateName": "half-gpu", "mps": {"defaultPinnedDeviceMemoryLimit": "20Gi"}}}}),
    )
    .await;
    let s = until("dra-mps Ready again", LONG, || converged(&c, "dra-mps")).await;
    assert_eq!(s["templates"], json!(["gpu-test6/half-gpu"]));
    let t = until("new template", LONG, || async {
        templates.get_opt("half-gpu").await.ok()?
    })
    .await;
    let t = serde_json::to_value(t).unwrap();
    assert_eq!(
        t["spec"]["spec"]["devices"]["config"][0]["opaque"]["parameters"]["sharing"]["mpsConfig"]["defaultPinnedDeviceMemoryLimit"],
        "20Gi"
    );
    until("old template removed", LONG, || async {
        templates
            .get_opt("single-gpu")
            .await
            .ok()?
            .is_none()
            .then_some(())
    })
    .await;
    // The node stays on the DRA policy, the device plugin off (one backend per node) and
    // sharing nothing should it run.
    let l = labels(&c, H200).await;
    assert_eq!(l["nvidia.com/device-plugin.config"], "default");
    assert_eq!(l["nvidia.com/gpu.deploy.device-plugin"], "false");
    assert_eq!(allocatable(&c, H200).await["nvidia.com/gpu"], "0");
    op.stop().await;
}

#[tokio::test]
async fn deleting_a_policy_returns_its_nodes_to_exclusive() {
    let (_g, cluster, _sim) = setup().await;
    let c = cluster.client.clone();
    let op = Operator::start(c.clone(), Some(NS));
    label_node(&c, L4_0, "gpusharing.io/profile", Some("ts")).await;
    testkit::apply_yaml(&c, &ts_policy("ts", "ts", 4))
        .await
        .unwrap();
    node_runs(&c, "ts", L4_0, &[("nvidia.com/gpu", "16")], &[]).await;
    let key = converged(&c, "ts").await.unwrap()["deviceConfigKey"]
        .as_str()
        .unwrap()
        .to_string();

    Api::<GpuSharingPolicy>::all(c.clone())
        .delete("ts", &DeleteParams::default())
        .await
        .unwrap();
    until("node back to exclusive", LONG, || async {
        let l = labels(&c, L4_0).await;
        let alloc = allocatable(&c, L4_0).await;
        (!l.contains_key("nvidia.com/device-plugin.config")
            && !l.contains_key("gpusharing.io/policy")
            && l.get("nvidia.com/gpu.replicas").map(String::as_str) == Some("1")
            && alloc.get("nvidia.com/gpu").map(String::as_str) == Some("4"))
        .then_some(())
    })
    .await;
    until("config key removed", LONG, || async {
        let data = configmap_data(&c, DP_CM).await?;
        (!data.contains_key(&key)).then_some(())
    })
    .await;
    let n = Api::<Node>::all(c.clone()).get(L4_0).await.unwrap();
    assert!(
        !n.annotations()
            .keys()
            .any(|k| k.starts_with("gpusharing.io/")),
        "our annotations go with the policy: {:?}",
        n.annotations()
    );
    op.stop().await;
}

fn default_mig_config(per_gpu: i32) -> Value {
    let text = format!(
        "version: v1\nmig-configs:\n  all-disabled:\n  - devices: all\n    mig-enabled: false\n  all-1g.10gb:\n  - devices: all\n    mig-enabled: true\n    mig-devices:\n      1g.10gb: {per_gpu}\n"
    );
    json!({"apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": "default-mig-parted-config", "namespace": NS},
        "data": {"config.yaml": text}})
}

/// A GPU Operator upgrade changes what a named layout means: the node keeps the old geometry
/// (the MIG manager only acts on a label change), so the policy must say so, and re-apply when
/// the admin asks.
#[tokio::test]
async fn a_named_layout_changed_by_the_gpu_operator_is_reported_and_reapplied_on_request() {
    let (_g, cluster, _sim) = setup().await;
    let c = cluster.client.clone();
    let cms: Api<k8s_openapi::api::core::v1::ConfigMap> = Api::namespaced(c.clone(), NS);
    let pp = PatchParams::apply("gpu-operator").force();
    cms.patch(
        "default-mig-parted-config",
        &pp,
        &Patch::Apply(default_mig_config(7)),
    )
    .await
    .unwrap();
    let op = Operator::start(c.clone(), Some(NS));
    label_node(&c, A100, "gpusharing.io/profile", Some("mig")).await;
    testkit::apply_yaml(&c, &mig_policy("mig", "mig", "all-1g.10gb"))
        .await
        .unwrap();
    node_runs(&c, "mig", A100, &[("nvidia.com/gpu", "56")], &[]).await;

    // The upgrade: all-1g.10gb now means 6 instances per GPU.
    cms.patch(
        "default-mig-parted-config",
        &pp,
        &Patch::Apply(default_mig_config(6)),
    )
    .await
    .unwrap();
    let s = until("Degraded MigLayoutChanged", LONG, || async {
        let s = policy_status(&c, "mig").await?;
        (condition(&s, "Degraded")?["reason"] == "MigLayoutChanged").then_some(s)
    })
    .await;
    let msg = condition(&s, "Degraded").unwrap()["message"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(msg.contains(A100) && msg.contains("all-1g.10gb"), "{msg}");
    assert_eq!(condition(&s, "Ready").unwrap()["status"], "False");
    // Nothing moves on its own.
    tokio::time::sleep(std::time::Duration::from_secs(2)).await;
    assert_eq!(allocatable(&c, A100).await["nvidia.com/gpu"], "56");

    // The documented re-apply: through all-disabled, then the layout's new content.
    let api = Api::<GpuSharingPolicy>::all(c.clone());
    api.patch(
        "mig",
        &PatchParams::default(),
        &Patch::Merge(
            json!({"metadata": {"annotations": {"gpusharing.io/reapply-mig-layout": "true"}}}),
        ),
    )
    .await
    .unwrap();
    node_runs(
        &c,
        "mig",
        A100,
        &[("nvidia.com/gpu", "48")],
        &[("nvidia.com/mig.config", "all-1g.10gb")],
    )
    .await;
    let s = converged(&c, "mig").await.unwrap();
    assert_eq!(condition(&s, "Degraded").unwrap()["status"], "False");
    op.stop().await;
}
