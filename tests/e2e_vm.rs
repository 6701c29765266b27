//! End-to-end: VM strategies (vGPU, passthrough) on the local control plane, with the
//! simulator playing the GPU Operator's sandbox side (vGPU Device Manager, sandbox device
//! plugin) and container side. One L4 node goes container time-slicing -> vGPU -> container;
//! every label state the API server showed is checked against the invariant that a node is
//! never a VM host and a container-sharing node at once.

mod support;

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use serde_json::json;
use support::*;

const NODE: &str = "l4-node-0";

const VDI: &str = "apiVersion: gpusharing.io/v1alpha1\nkind: GpuSharingPolicy\nmetadata: {name: vdi}\nspec:\n  priority: 10\n  nodeSelector: {matchLabels: {gpusharing.io/profile: vdi}}\n  strategy: vgpu\n  vgpu: {type: L4-6Q}\n";

/// A VM host and a container-sharing node at once: the workload label says VM while a sharing
/// device-plugin config (anything but `default`) or an enabled MIG layout is on the node.
fn violates(l: &BTreeMap<String, String>) -> bool {
    let vm = l
        .get("nvidia.com/gpu.workload.config")
        .is_some_and(|w| w.starts_with("vm-"));
    let sharing = l
        .get("nvidia.com/device-plugin.config")
        .is_some_and(|k| k != "default");
    let mig_on = l
        .get("nvidia.com/mig.config")
        .is_some_and(|m| m != "all-disabled");
    vm && (sharing || mig_on)
}

async fn allocatable(c: &kube::Client, node: &str) -> BTreeMap<String, String> {
    let n = Api::<Node>::all(c.clone()).get(node).await.unwrap();
    n.status
        .and_then(|s| s.allocatable)
        .unwrap_or_default()
        .into_iter()
        .filter(|(k, _)| k.starts_with("nvidia.com/"))
        .map(|(k, v)| (k, v.0))
        .collect()
}

async fn node_detail(c: &kube::Client, policy: &str, node: &str) -> Option<serde_json::Value> {
    let s = policy_status(c, policy).await?;
    s["nodeDetails"]
        .as_array()?
        .iter()
        .find(|d| d["name"] == node)
        .cloned()
}

#[tokio::test]
async fn a_node_goes_from_time_slicing_to_vgpu_and_back_never_both() {
    let (g, cluster, _sim) = setup().await;
    let invariants = g.invariants();
    let c = cluster.client.clone();
    // The user's part: the vGPU Manager (their own image) is enabled.
    testkit::cluster_policy_api(&c)
        .patch(
            "cluster-policy",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"vgpuManager": {"enabled": true}}})),
        )
        .await
        .unwrap();
    let op = Operator::start(c.clone(), Some(NS));
    testkit::apply_yaml(&c, include_str!("../examples/time-slicing-l4.yaml"))
        .await
        .unwrap();
    until("time-slicing on the node", LONG, || async {
        ready(&c, "l4-time-slicing").await?;
        (allocatable(&c, NODE)
            .await
            .get("nvidia.com/gpu")
            .map(String::as_str)
            == Some("16"))
        .then_some(())
    })
    .await;
    let history = LabelHistory::start(&c, NODE).await;

    // To vGPU: the node is picked by its profile label.
    testkit::apply_yaml(&c, VDI).await.unwrap();
    label_node(&c, NODE, "gpusharing.io/profile", Some("vdi")).await;
    let s = until("vdi Ready", LONG, || async {
        let s = ready(&c, "vdi").await?;
        (s["appliedNodes"] == 1).then_some(s)
    })
    .await;
    let l = labels(&c, NODE).await;
    assert_eq!(l["nvidia.com/gpu.workload.config"], "vm-vgpu");
    assert_eq!(l["nvidia.com/vgpu.config"], "L4-6Q");
    assert_eq!(l["nvidia.com/vgpu.config.state"], "success");
    assert_eq!(l["nvidia.com/device-plugin.config"], "default");
    let a = allocatable(&c, NODE).await;
    assert_eq!(
        a["nvidia.com/NVIDIA_L4-6Q"], "16",
        "4 L4-6Q per GPU, 4 GPUs: {a:?}"
    );
    assert_eq!(
        a["nvidia.com/gpu"], "0",
        "the container device plugin is gone"
    );
    assert_eq!(s["vgpuConfig"], "L4-6Q");
    assert_eq!(s["capacity"]["schedulableReplicas"], 16);
    assert_eq!(s["capacity"]["memoryPerClientMib"], 6144);
    assert!(s.get("deviceConfigKey").is_none());
    let cp = cluster_policy(&c).await;
    assert_eq!(cp["spec"]["sandboxWorkloads"]["enabled"], true);
    assert!(
        cp["spec"]["sandboxWorkloads"]
            .get("defaultWorkload")
            .is_none_or(|d| d == "container"),
        "other nodes stay containers: {cp}"
    );

    // A VM runs on it (KubeVirt's virt-launcher asks for the vGPU resource).
    let pods: Api<Pod> = Api::namespaced(c.clone(), "default");
    let vm: Pod = serde_json::from_value(json!({
        "metadata": {"name": "virt-launcher-desktop-1"},
        "spec": {"nodeName": NODE, "containers": [{"name": "compute", "image": "virt-launcher",
            "resources": {"limits": {"nvidia.com/NVIDIA_L4-6Q": "1"}}}]},
    }))
    .unwrap();
    pods.create(&PostParams::default(), &vm).await.unwrap();

    // Back to containers (the profile label goes: time-slicing selects the node again), but
    // not while the VM runs.
    label_node(&c, NODE, "gpusharing.io/profile", None).await;
    let d = until("waiting for the VM", LONG, || async {
        let d = node_detail(&c, "l4-time-slicing", NODE).await?;
        (d["state"] == "Waiting").then_some(d)
    })
    .await;
    assert!(
        d["message"]
            .as_str()
            .unwrap()
            .contains("virt-launcher-desktop-1"),
        "{d}"
    );
    tokio::time::sleep(std::time::Duration::from_secs(2)).await;
    assert_eq!(
        labels(&c, NODE).await["nvidia.com/gpu.workload.config"],
        "vm-vgpu",
        "still a VM host while the VM runs"
    );
    pods.delete("virt-launcher-desktop-1", &DeleteParams::default())
        .await
        .unwrap();
    until("time-slicing again", LONG, || async {
        let a = allocatable(&c, NODE).await;
        let s = ready(&c, "l4-time-slicing").await?;
        (s["appliedNodes"] == 2
            && a.get("nvidia.com/gpu").map(String::as_str) == Some("16")
            && a.get("nvidia.com/NVIDIA_L4-6Q").map(String::as_str) == Some("0"))
        .then_some(())
    })
    .await;
    let l = labels(&c, NODE).await;
    assert_eq!(l["nvidia.com/gpu.workload.config"], "container");
    assert!(!l.contains_key("nvidia.com/vgpu.config"), "{l:?}");

    // Every state the node went through.
    let states = history.states();
    for (i, l) in states.iter().enumerate() {
        assert!(
            !violates(l),
            "state {i} of {NODE} is a VM host and a container-sharing node at once: {l:?}"
        );
    }
    let first_vm = states
        .iter()
        .position(|l| {
            l.get("nvidia.com/gpu.workload.config").map(String::as_str) == Some("vm-vgpu")
        })
        .expect("the node became a VM host");
    assert_eq!(
        states[first_vm - 1]
            .get("nvidia.com/device-plugin.config")
            .map(String::as_str),
        Some("default"),
        "sharing went off before the node became a VM host"
    );
    let back = states[first_vm..]
        .iter()
        .position(|l| {
            l.get("nvidia.com/gpu.workload.config").map(String::as_str) == Some("container")
        })
        .expect("the node went back to containers")
        + first_vm;
    assert_eq!(
        states[back]
            .get("nvidia.com/device-plugin.config")
            .map(String::as_str),
        Some("default"),
        "sharing comes back only after the node is a container node again"
    );
    eprintln!("{NODE} went through {} label states", states.len());

    // No VM host left: sandbox workloads are no longer ours to enable.
    api_delete(&c, "vdi").await;
    until("sandbox workloads released", LONG, || async {
        let cp = cluster_policy(&c).await;
        cp["spec"]["sandboxWorkloads"]
            .get("enabled")
            .is_none_or(|e| e == false)
            .then_some(())
    })
    .await;
    plan_agrees(&c).await;
    op.stop().await;
    invariants.check().await;
}

async fn api_delete(c: &kube::Client, name: &str) {
    Api::<gpu_sharing_operator::api::crd::GpuSharingPolicy>::all(c.clone())
        .delete(name, &DeleteParams::default())
        .await
        .unwrap();
}

/// Bad vGPU input: refused at admission where the schema can (a malformed type name), else
/// reported on the policy naming the field (a type NVIDIA's config does not have, the vGPU
/// Manager not enabled), and nothing changes on the nodes it selects.
#[tokio::test]
async fn bad_vgpu_input_is_refused_and_changes_nothing() {
    let (g, cluster, _sim) = setup().await;
    let invariants = g.invariants();
    let c = cluster.client.clone();
    let op = Operator::start(c.clone(), Some(NS));
    label_node(&c, NODE, "gpusharing.io/profile", Some("vdi")).await;
    let before = labels(&c, NODE).await;

    let e = testkit::apply_yaml(
        &c,
        "apiVersion: gpusharing.io/v1alpha1\nkind: GpuSharingPolicy\nmetadata: {name: bad-name}\nspec:\n  nodeSelector: {matchLabels: {gpusharing.io/profile: vdi}}\n  strategy: vgpu\n  vgpu:\n    customLayout: [{vgpuDevices: {l4-6q: 4}}]\n",
    )
    .await
    .unwrap_err();
    assert!(
        format!("{e:#}").contains("vGPU type names look like"),
        "{e:#}"
    );

    testkit::apply_yaml(
        &c,
        &VDI.replace("name: vdi", "name: unknown-type")
            .replace("L4-6Q", "L4-7Q"),
    )
    .await
    .unwrap();
    let s = until("unknown type reported", LONG, || async {
        let s = policy_status(&c, "unknown-type").await?;
        (condition(&s, "Accepted")?["status"] == "False").then_some(s)
    })
    .await;
    let msg = condition(&s, "Accepted").unwrap()["message"].to_string();
    assert!(
        msg.contains("spec.vgpu.type") && msg.contains("L4-7Q"),
        "{msg}"
    );
    api_delete(&c, "unknown-type").await;

    // A valid policy, but the ClusterPolicy has no vGPU Manager: the field is named.
    testkit::apply_yaml(&c, VDI).await.unwrap();
    let s = until("vGPU Manager missing reported", LONG, || async {
        let s = policy_status(&c, "vdi").await?;
        (condition(&s, "Accepted")?["reason"] == "IncompatibleNodes").then_some(s)
    })
    .await;
    let msg = condition(&s, "Accepted").unwrap()["message"].to_string();
    assert!(msg.contains("spec.vgpuManager.enabled"), "{msg}");
    tokio::time::sleep(std::time::Duration::from_secs(2)).await;
    let after = labels(&c, NODE).await;
    let ours = |l: &BTreeMap<String, String>| {
        l.iter()
            .filter(|(k, _)| {
                k.starts_with("nvidia.com/gpu.workload")
                    || k.starts_with("nvidia.com/vgpu")
                    || *k == "nvidia.com/device-plugin.config"
            })
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect::<BTreeMap<_, _>>()
    };
    assert_eq!(ours(&after), ours(&before), "nothing changed on the node");
    assert!(
        cluster_policy(&c).await["spec"]["sandboxWorkloads"]
            .get("enabled")
            .is_none_or(|e| e == false),
        "sandbox workloads not enabled for a policy that cannot run"
    );
    op.stop().await;
    invariants.check().await;
}
