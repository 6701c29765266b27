//! End-to-end: a time-sliced pool moves from NVIDIA's device plugin to its DRA driver with pods
//! unchanged (DRA extended resources, KEP-5004, beta in the local kube-apiserver 1.36), and
//! back. The simulator plays the GPU Operator's switches, the device plugin and the DRA
//! driver's kubelet plugin (its ResourceSlices, with consumable shares 4). One control plane for
//! the whole file.

mod support;

use gpu_sharing_operator::api::crd::GpuSharingPolicy;
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::resource::v1::{DeviceClass, ResourceSlice};
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use serde_json::json;
use support::*;

const NODES: [&str; 2] = ["l4-node-0", "l4-node-1"];
const OURS: &str = "gpusharing-nvidia.com-gpu";

const DEVICE_PLUGIN_POLICY: &str = "apiVersion: gpusharing.io/v1alpha1
kind: GpuSharingPolicy
metadata: {name: l4-shared}
spec:
  nodeSelector: {matchLabels: {gpusharing.io/profile: l4-shared}}
  strategy: timeSlicing
  timeSlicing: {replicas: 4}
  rollout: {maxUnavailable: 1}
";

/// What serves a node's GPUs now: the device plugin's allocatable `nvidia.com/gpu`, and the
/// `shares` of the GPUs in the DRA driver's ResourceSlice (`None`: no slice).
async fn served(c: &kube::Client, node: &str) -> (i64, Option<Vec<String>>) {
    let n = Api::<Node>::all(c.clone()).get(node).await.unwrap();
    let alloc = n
        .status
        .and_then(|s| s.allocatable)
        .and_then(|a| a.get("nvidia.com/gpu").map(|q| q.0.parse().unwrap_or(0)))
        .unwrap_or(0);
    let lp =
        ListParams::default().fields(&format!("spec.nodeName={node},spec.driver=gpu.nvidia.com"));
    let slices = Api::<ResourceSlice>::all(c.clone())
        .list(&lp)
        .await
        .unwrap();
    let shares = slices.items.first().map(|s| {
        s.spec
            .devices
            .iter()
            .flatten()
            .filter_map(|d| Some(d.capacity.as_ref()?.get("shares")?.value.0.clone()))
            .collect()
    });
    (alloc, shares)
}

/// Every node is served by one backend at most (the device plugin's allocatable and the DRA
/// driver's slice never both): checked at every poll of a transition.
async fn one_backend_each(c: &kube::Client) {
    for node in NODES {
        let (alloc, slice) = served(c, node).await;
        assert!(
            alloc == 0 || slice.is_none(),
            "{node}: the device plugin advertises {alloc} GPUs while the DRA driver publishes {slice:?}"
        );
    }
}

async fn class(c: &kube::Client, name: &str) -> Option<DeviceClass> {
    Api::<DeviceClass>::all(c.clone())
        .get_opt(name)
        .await
        .unwrap()
}

#[tokio::test]
async fn a_time_sliced_pool_moves_to_dra_extended_resources_and_back() {
    let (g, cluster, _sim) = setup_with_simulator(
        testkit::ClusterOptions::default(),
        &["--dra-consumable-shares=4".to_string()],
    )
    .await;
    let invariants = g.invariants();
    let c = cluster.client.clone();
    // The DRA driver chart's own class maps nvidia.com/gpu, as it does whenever GPUs are on.
    let chart: DeviceClass = serde_json::from_value(json!({
        "metadata": {"name": "gpu.nvidia.com"},
        "spec": {"selectors": [{"cel": {"expression": "device.driver == 'gpu.nvidia.com' && device.attributes['gpu.nvidia.com'].type == 'gpu'"}}],
            "extendedResourceName": "nvidia.com/gpu"}
    }))
    .unwrap();
    Api::<DeviceClass>::all(c.clone())
        .create(&PostParams::default(), &chart)
        .await
        .unwrap();
    let op = Operator::start(c.clone(), Some(NS));
    for node in NODES {
        label_node(&c, node, "gpusharing.io/profile", Some("l4-shared")).await;
    }
    testkit::apply_yaml(&c, DEVICE_PLUGIN_POLICY).await.unwrap();
    until("served by the device plugin", LONG, || {
        ready_on(&c, "l4-shared", 2)
    })
    .await;
    for node in NODES {
        assert_eq!(
            served(&c, node).await,
            (16, None),
            "{node}: 4 L4s x 4 replicas"
        );
    }

    // What extended resources cannot serve is refused at admission, naming why.
    let api: Api<GpuSharingPolicy> = Api::all(c.clone());
    for (bad, why) in [
        (
            json!({"backend": "dra", "strategy": "mps", "timeSlicing": null, "mps": {"replicas": 2},
            "dra": {"extendedResources": true}}),
            "MPS cannot be served through DRA extended resources",
        ),
        (
            json!({"backend": "dra", "dra": {"extendedResources": true, "namespaces": ["team"]}}),
            "namespaces, templateName and mps do not apply",
        ),
        (
            json!({"backend": "dra", "dra": {}}),
            "namespaces must name at least one namespace",
        ),
    ] {
        let e = api
            .patch(
                "l4-shared",
                &PatchParams::default(),
                &Patch::Merge(&json!({"spec": bad})),
            )
            .await
            .expect_err("refused at admission");
        assert!(e.to_string().contains(why), "{e}");
    }

    // Move: refused while the chart's class maps the name, naming it; nothing changes.
    let to_dra = json!({"spec": {"backend": "dra", "dra": {"extendedResources": true,
        "driverFeatureGates": {"ConsumableShares": true}}}});
    api.patch("l4-shared", &PatchParams::default(), &Patch::Merge(&to_dra))
        .await
        .unwrap();
    let s = until("refused for the chart's class", LONG, || async {
        let s = policy_status(&c, "l4-shared").await?;
        let a = condition(&s, "Accepted")?;
        (a["status"] == "False").then(|| a["message"].as_str().unwrap().to_string())
    })
    .await;
    assert!(s.contains("DeviceClass gpu.nvidia.com"), "{s}");
    assert!(
        s.contains("kubectl patch deviceclass gpu.nvidia.com"),
        "{s}"
    );
    assert!(class(&c, OURS).await.is_none());
    for node in NODES {
        assert_eq!(served(&c, node).await, (16, None), "{node} left as it was");
    }

    // The admin removes the chart's mapping, as the message says: the pool moves, one node at a
    // time, never served by both.
    let remove = json!([{"op": "remove", "path": "/spec/extendedResourceName"}]);
    Api::<DeviceClass>::all(c.clone())
        .patch(
            "gpu.nvidia.com",
            &PatchParams::default(),
            &Patch::Json::<()>(serde_json::from_value(remove).unwrap()),
        )
        .await
        .unwrap();
    let s = until("moved to the DRA driver", LONG, || async {
        one_backend_each(&c).await;
        let s = ready_on(&c, "l4-shared", 2).await?;
        (s["servedBy"] == json!({"draDriver": 2})).then_some(s)
    })
    .await;
    assert!(s.get("deviceConfigKey").is_none());
    for d in s["nodeDetails"].as_array().unwrap() {
        assert_eq!(d["servedBy"], "draDriver", "{d}");
    }
    for node in NODES {
        let l = labels(&c, node).await;
        assert_eq!(l["nvidia.com/gpu.deploy.device-plugin"], "false");
        assert_eq!(l["nvidia.com/gpu.deploy.dra-driver"], "true");
        let (alloc, shares) = served(&c, node).await;
        assert_eq!(alloc, 0);
        assert_eq!(
            shares,
            Some(vec!["4".to_string(); 4]),
            "{node}: 4 GPUs, 4 shares each"
        );
    }
    let ours = class(&c, OURS).await.expect("our DeviceClass");
    assert_eq!(
        ours.spec.extended_resource_name.as_deref(),
        Some("nvidia.com/gpu")
    );

    // Back: the DRA kubelet plugin goes off, the device plugin returns once the slice is gone.
    let back = json!({"spec": {"backend": null, "dra": null}});
    api.patch("l4-shared", &PatchParams::default(), &Patch::Merge(&back))
        .await
        .unwrap();
    until("back on the device plugin", LONG, || async {
        one_backend_each(&c).await;
        let s = ready_on(&c, "l4-shared", 2).await?;
        for node in NODES {
            if served(&c, node).await != (16, None) {
                return None;
            }
        }
        s.get("servedBy").is_none().then_some(())
    })
    .await;
    for node in NODES {
        let l = labels(&c, node).await;
        assert_eq!(l["nvidia.com/gpu.deploy.device-plugin"], "true");
        assert!(!l.contains_key("nvidia.com/gpu.deploy.dra-driver"), "{l:?}");
    }
    until("our DeviceClass deleted", LONG, || async {
        class(&c, OURS).await.is_none().then_some(())
    })
    .await;
    api.delete("l4-shared", &DeleteParams::default())
        .await
        .unwrap();
    op.stop().await;
    invariants.check().await;
}

/// Kubernetes 1.34 and 1.35 ship `DRAExtendedResource` off: kube-apiserver then drops
/// `extendedResourceName` from our DeviceClass. No node may move (it would lose its GPUs: no
/// class maps the name), and the status says which gate to turn on. Its own control plane,
/// with the gate off.
#[tokio::test]
async fn without_the_extended_resource_gate_no_node_moves_and_the_status_names_it() {
    let gate_off = testkit::ClusterOptions {
        extra_args: vec!["--apiserver-arg=--feature-gates=DRAExtendedResource=false".into()],
        ..Default::default()
    };
    let (g, cluster, _sim) =
        setup_with_simulator(gate_off, &["--dra-consumable-shares=4".to_string()]).await;
    let invariants = g.invariants();
    let c = cluster.client.clone();
    let op = Operator::start(c.clone(), Some(NS));
    for node in NODES {
        label_node(&c, node, "gpusharing.io/profile", Some("l4-shared")).await;
    }
    testkit::apply_yaml(&c, DEVICE_PLUGIN_POLICY).await.unwrap();
    until("served by the device plugin", LONG, || {
        ready_on(&c, "l4-shared", 2)
    })
    .await;
    let to_dra = json!({"spec": {"backend": "dra", "dra": {"extendedResources": true,
        "driverFeatureGates": {"ConsumableShares": true}}}});
    Api::<GpuSharingPolicy>::all(c.clone())
        .patch("l4-shared", &PatchParams::default(), &Patch::Merge(&to_dra))
        .await
        .unwrap();
    let s = until("nodes held for the class, the gate named", LONG, || async {
        let s = policy_status(&c, "l4-shared").await?;
        let held = s["nodeDetails"].as_array()?.iter().all(|d| {
            d["reason"] == "WaitingForDeviceClass"
                && d["message"]
                    .as_str()
                    .unwrap_or("")
                    .contains("DRAExtendedResource")
        });
        let refused = s["refusedWrites"].as_array()?.iter().any(|w| {
            w["kind"] == "DeviceClass"
                && w["message"]
                    .as_str()
                    .unwrap_or("")
                    .contains("DRAExtendedResource")
        });
        (held && refused).then_some(s)
    })
    .await;
    assert_eq!(condition(&s, "Accepted").unwrap()["status"], "True", "{s}");
    assert_eq!(condition(&s, "Degraded").unwrap()["status"], "True", "{s}");
    let ours = class(&c, OURS)
        .await
        .expect("our DeviceClass, as the API server kept it");
    assert_eq!(ours.spec.extended_resource_name, None);
    for node in NODES {
        assert_eq!(served(&c, node).await, (16, None), "{node} left as it was");
        let l = labels(&c, node).await;
        assert!(!l.contains_key("nvidia.com/gpu.deploy.dra-driver"), "{l:?}");
        assert_ne!(
            l.get("nvidia.com/gpu.deploy.device-plugin")
                .map(String::as_str),
            Some("false")
        );
    }
    Api::<GpuSharingPolicy>::all(c.clone())
        .delete("l4-shared", &DeleteParams::default())
        .await
        .unwrap();
    until("our DeviceClass deleted", LONG, || async {
        class(&c, OURS).await.is_none().then_some(())
    })
    .await;
    op.stop().await;
    invariants.check().await;
}
