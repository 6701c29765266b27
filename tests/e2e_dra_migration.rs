//! End-to-end: a time-sliced pool moves from NVIDIA's device plugin to its DRA driver with pods
//! unchanged (DRA extended resources, KEP-5004, beta in the local kube-apiserver 1.36), and
//! back, with the real kube-scheduler (and kube-controller-manager's resourceclaim controller)
//! placing the pods. The simulator plays the GPU Operator's switches, the device plugin, the
//! kubelet and the DRA driver's kubelet plugin (its ResourceSlices, with consumable shares 4).
//! One control plane per test: the second runs kube-apiserver with the feature gate off, the
//! third the driver with consumable shares off (a whole-GPU pool and a MIG pool).

mod support;

use gpu_sharing_operator::api::crd::GpuSharingPolicy;
use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::api::resource::v1::{DeviceClass, ResourceClaim, ResourceSlice};
use kube::ResourceExt;
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

/// What serves a node's `resource` now: the device plugin's allocatable for it, and the
/// devices of the DRA driver's ResourceSlice for the node (`None`: no slice).
async fn serving(
    c: &kube::Client,
    node: &str,
    resource: &str,
) -> (i64, Option<Vec<k8s_openapi::api::resource::v1::Device>>) {
    let n = Api::<Node>::all(c.clone()).get(node).await.unwrap();
    let alloc = (n.status.and_then(|s| s.allocatable))
        .and_then(|a| a.get(resource).map(|q| q.0.parse().unwrap_or(0)))
        .unwrap_or(0);
    let lp =
        ListParams::default().fields(&format!("spec.nodeName={node},spec.driver=gpu.nvidia.com"));
    let slices = Api::<ResourceSlice>::all(c.clone())
        .list(&lp)
        .await
        .unwrap();
    let devices = (slices.items.into_iter().next()).map(|s| s.spec.devices.unwrap_or_default());
    (alloc, devices)
}

/// What serves a node's GPUs now: the device plugin's allocatable `nvidia.com/gpu`, and the
/// `shares` of the GPUs in the DRA driver's ResourceSlice (`None`: no slice).
async fn served(c: &kube::Client, node: &str) -> (i64, Option<Vec<String>>) {
    let (alloc, devices) = serving(c, node, "nvidia.com/gpu").await;
    let shares = devices.map(|ds| {
        (ds.iter())
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

/// The operator started, both L4 nodes labelled for the pool, `policy` applied and applied on
/// both through the device plugin.
async fn start_on_the_device_plugin(c: &kube::Client, policy: &str) -> Operator {
    let op = Operator::start(c.clone(), Some(NS));
    for node in NODES {
        label_node(c, node, "gpusharing.io/profile", Some("l4-shared")).await;
    }
    testkit::apply_yaml(c, policy).await.unwrap();
    until("served by the device plugin", LONG, || {
        ready_on(c, "l4-shared", 2)
    })
    .await;
    op
}

async fn class(c: &kube::Client, name: &str) -> Option<DeviceClass> {
    Api::<DeviceClass>::all(c.clone())
        .get_opt(name)
        .await
        .unwrap()
}

/// An unchanged pod asking for one `nvidia.com/gpu` of the pool, bound to `node` when given
/// (a workload already running there), else placed by kube-scheduler.
fn gpu_pod(name: &str, node: Option<&str>) -> Pod {
    pool_pod(name, node, "l4-shared", "nvidia.com/gpu")
}

/// An unchanged pod asking for one `resource` on the nodes of profile `pool`.
fn pool_pod(name: &str, node: Option<&str>, pool: &str, resource: &str) -> Pod {
    serde_json::from_value(json!({
        "metadata": {"name": name, "namespace": "default"},
        "spec": {
            "nodeName": node,
            "nodeSelector": {"gpusharing.io/profile": pool},
            "containers": [{"name": "c", "image": "registry.k8s.io/pause:3.10",
                "resources": {"limits": {resource: "1"}}}],
        },
    }))
    .unwrap()
}

const A100: [&str; 2] = ["a100-node-0", "a100-node-1"];
const MIG_CLASS: &str = "gpusharing-nvidia.com-mig-3g.40gb";

/// 8 A100 80GB per node, two 3g.40gb instances each, through the device plugin first.
fn mig_policy() -> String {
    DEVICE_PLUGIN_POLICY
        .replace("l4-shared", "a100-mig")
        .replace(
            "  strategy: timeSlicing\n  timeSlicing: {replicas: 4}\n",
            "  strategy: mig\n  mig: {migStrategy: mixed, layout: all-3g.40gb}\n",
        )
}

/// What serves an A100 node's MIG instances of `profile` now: the device plugin's allocatable
/// `nvidia.com/mig-<profile>`, and the DRA driver's MIG devices of the profile (`None`: no
/// slice).
async fn mig_served(c: &kube::Client, node: &str, profile: &str) -> (i64, Option<usize>) {
    let (alloc, devices) = serving(c, node, &format!("nvidia.com/mig-{profile}")).await;
    let attr = |d: &k8s_openapi::api::resource::v1::Device, k: &str| {
        d.attributes.as_ref()?.get(k)?.string.clone()
    };
    let mig = devices.map(|ds| {
        (ds.iter())
            .filter(|d| {
                attr(d, "type").as_deref() == Some("mig")
                    && attr(d, "profile").as_deref() == Some(profile)
            })
            .count()
    });
    (alloc, mig)
}

fn pods(c: &kube::Client) -> Api<Pod> {
    Api::namespaced(c.clone(), "default")
}

/// The pool's pods by node (`""`: not bound).
async fn placed(c: &kube::Client) -> BTreeMap<String, Vec<Pod>> {
    let mut out: BTreeMap<String, Vec<Pod>> = BTreeMap::new();
    for p in pods(c).list(&ListParams::default()).await.unwrap().items {
        let node = p.spec.as_ref().and_then(|s| s.node_name.clone());
        out.entry(node.unwrap_or_default()).or_default().push(p);
    }
    out
}

/// What kube-scheduler made of a pod served through DRA on `node`: its generated claim exists,
/// carries the scheduler's annotation, is controlled by the pod, and is allocated one GPU of
/// the node's pool (returned).
async fn generated_claim_device(c: &kube::Client, pod: &Pod, node: &str) -> String {
    let name = pod.metadata.name.as_deref().unwrap();
    let claim_name = (pod.status.as_ref())
        .and_then(|s| s.extended_resource_claim_status.as_ref())
        .map(|x| x.resource_claim_name.clone())
        .unwrap_or_else(|| panic!("{name}: not served through DRA"));
    let claim = Api::<ResourceClaim>::namespaced(c.clone(), "default")
        .get(&claim_name)
        .await
        .unwrap_or_else(|e| panic!("{name}: claim {claim_name}: {e}"));
    assert_eq!(
        claim
            .annotations()
            .get("resource.kubernetes.io/extended-resource-claim"),
        Some(&"true".to_string()),
        "{claim_name}"
    );
    let owner = (claim.owner_references().iter())
        .find(|o| o.controller == Some(true))
        .unwrap_or_else(|| panic!("{claim_name}: no controller"));
    assert_eq!((owner.kind.as_str(), owner.name.as_str()), ("Pod", name));
    assert_eq!(Some(&owner.uid), pod.metadata.uid.as_ref());
    let results = (claim.status.and_then(|s| s.allocation))
        .and_then(|a| a.devices)
        .and_then(|d| d.results)
        .unwrap_or_default();
    assert_eq!(results.len(), 1, "{claim_name}: one device");
    let r = &results[0];
    assert_eq!(
        (r.driver.as_str(), r.pool.as_str()),
        ("gpu.nvidia.com", node)
    );
    r.device.clone()
}

/// The MIG pool is applied on both A100 nodes, served by the device plugin (`on_dra` false:
/// `count` instances of `profile` each, no DRA slice) or by the DRA driver (its slice shows
/// `count` MIG devices of `profile`, the device plugin advertises none); never by both.
async fn mig_pool_served(
    c: &kube::Client,
    on_dra: bool,
    profile: &str,
    count: usize,
) -> Option<()> {
    let s = ready_on(c, "a100-mig", 2).await?;
    for node in A100 {
        let (alloc, slice) = mig_served(c, node, profile).await;
        assert!(
            alloc == 0 || slice.is_none(),
            "{node}: both serve: {alloc} and {slice:?}"
        );
        let want = match on_dra {
            true => (0, Some(count)),
            false => (count as i64, None),
        };
        if (alloc, slice) != want {
            return None;
        }
    }
    // A device-plugin policy's status shows no `servedBy` once no node has a DRA switch.
    let by = if on_dra {
        json!({"draDriver": 2})
    } else {
        json!(null)
    };
    (s["servedBy"] == by).then_some(())
}

/// A time-sliced pool (2 L4 nodes, 4 GPUs x replicas 4 each) moves to the DRA driver with the
/// real kube-scheduler placing unchanged pods: the idle node moves, the busy one waits (its
/// device-plugin pods run), an operator restart changes nothing, new pods land on both kinds
/// of node (16 per node: through the device plugin on one, 4 per GPU through generated claims
/// on the other), and the way back drains the DRA-served pods first; then a MIG device takes
/// one pod under those shares. The invariant watcher checks at every event that no GPU is
/// allocated through DRA beside a device-plugin pod.
#[tokio::test]
async fn a_time_sliced_pool_moves_to_dra_extended_resources_under_the_scheduler_and_back() {
    let (g, cluster, _sim) = setup_with_simulator(
        testkit::ClusterOptions::default().arg("--scheduler"),
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
    let op = start_on_the_device_plugin(&c, DEVICE_PLUGIN_POLICY).await;
    for node in NODES {
        assert_eq!(
            served(&c, node).await,
            (16, None),
            "{node}: 4 L4s x 4 replicas"
        );
    }
    // Two workloads already run on the second node, through the device plugin.
    for name in ["running-0", "running-1"] {
        pods(&c)
            .create(&PostParams::default(), &gpu_pod(name, Some(NODES[1])))
            .await
            .unwrap();
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

    // The admin removes the chart's mapping, as the message says: the idle node moves; the
    // busy one waits for its device-plugin pods. Never both on one node.
    let remove = json!([{"op": "remove", "path": "/spec/extendedResourceName"}]);
    Api::<DeviceClass>::all(c.clone())
        .patch(
            "gpu.nvidia.com",
            &PatchParams::default(),
            &Patch::Json::<()>(serde_json::from_value(remove).unwrap()),
        )
        .await
        .unwrap();
    let s = until(
        "the idle node moved, the busy one waiting",
        LONG,
        || async {
            one_backend_each(&c).await;
            let s = policy_status(&c, "l4-shared").await?;
            (s["servedBy"] == json!({"draDriver": 1, "devicePlugin": 1})
                && served(&c, NODES[0]).await.1.is_some())
            .then_some(s)
        },
    )
    .await;
    let waiting = (s["nodeDetails"].as_array().unwrap().iter())
        .find(|d| d["name"] == NODES[1])
        .unwrap();
    assert_eq!(waiting["reason"], "WaitingForIdleGPUs", "{waiting}");
    assert!(
        waiting["message"]
            .as_str()
            .unwrap()
            .contains("default/running-0"),
        "{waiting}"
    );
    assert_eq!(
        served(&c, NODES[0]).await,
        (0, Some(vec!["4".to_string(); 4])),
        "4 GPUs, 4 shares each"
    );
    assert_eq!(served(&c, NODES[1]).await, (16, None));
    let ours = class(&c, OURS).await.expect("our DeviceClass");
    assert_eq!(
        ours.spec.extended_resource_name.as_deref(),
        Some("nvidia.com/gpu")
    );

    // The operator restarts mid-migration: nothing on the moved node changes.
    let history = LabelHistory::start(&c, NODES[0]).await;
    op.stop().await;
    let op = Operator::start(c.clone(), Some(NS));
    until("two passes of the new operator", LONG, || async {
        (op.passes() >= 2).then_some(())
    })
    .await;
    let states = history.states();
    assert_eq!(
        states.len(),
        1,
        "labels of the moved node changed: {states:?}"
    );
    assert_eq!(
        policy_status(&c, "l4-shared").await.unwrap()["servedBy"],
        json!({"draDriver": 1, "devicePlugin": 1})
    );

    // Unchanged pods land on both kinds of node: 14 more through the device plugin, 16 through
    // DRA (4 per GPU); one more fits nowhere.
    for i in 0..30 {
        pods(&c)
            .create(&PostParams::default(), &gpu_pod(&format!("work-{i}"), None))
            .await
            .unwrap();
    }
    let by_node = until("30 pods bound", LONG, || async {
        let p = placed(&c).await;
        (!p.contains_key("")).then_some(p)
    })
    .await;
    assert_eq!(
        by_node[NODES[1]].len(),
        16,
        "2 running + 14 through the device plugin"
    );
    assert_eq!(by_node[NODES[0]].len(), 16, "through the DRA driver");
    for p in &by_node[NODES[1]] {
        let served_by_dra =
            (p.status.as_ref()).and_then(|s| s.extended_resource_claim_status.as_ref());
        assert!(served_by_dra.is_none(), "{:?}", p.metadata.name);
    }
    let mut per_gpu: BTreeMap<String, usize> = BTreeMap::new();
    for p in &by_node[NODES[0]] {
        *per_gpu
            .entry(generated_claim_device(&c, p, NODES[0]).await)
            .or_default() += 1;
    }
    assert_eq!(
        per_gpu,
        (0..4).map(|i| (format!("gpu-{i}"), 4)).collect(),
        "exactly 4 pods per GPU"
    );
    // The simulated kubelet starts them once NVIDIA's DRA kubelet plugin prepared their claims
    // (allocated on this node, reserved for the pod, devices it published).
    until(
        "the DRA-served pods running, their claims prepared",
        LONG,
        || async {
            let p = placed(&c).await;
            let ok = p.get(NODES[0])?.iter().all(|p| {
                let running = p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running");
                let claim = (p.status.as_ref())
                    .and_then(|s| s.extended_resource_claim_status.as_ref())
                    .map(|x| x.resource_claim_name.clone());
                let prepared = p.annotations().get("simulator.gpusharing.io/dra-prepared");
                running
                    && claim
                        .zip(prepared)
                        .is_some_and(|(c, v)| v.starts_with(&format!("{c}=gpu-")))
            });
            ok.then_some(())
        },
    )
    .await;
    pods(&c)
        .create(&PostParams::default(), &gpu_pod("one-too-many", None))
        .await
        .unwrap();
    until("one pod too many is unschedulable", LONG, || async {
        let p = pods(&c).get("one-too-many").await.ok()?;
        let cond = (p.status?.conditions?.into_iter()).find(|c| c.type_ == "PodScheduled")?;
        (cond.reason.as_deref() == Some("Unschedulable")).then_some(())
    })
    .await;

    // Back, draining: the DRA-served pods are evicted, their claims go, the DRA kubelet plugin
    // goes off, and the device plugin returns once the slice is gone.
    let back = json!({"spec": {"backend": null, "dra": null, "disruption": {"mode": "drain"}}});
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
    let left = placed(&c).await;
    assert_eq!(
        left[NODES[1]].len(),
        16,
        "the device-plugin pods were not touched"
    );
    for p in left.get(NODES[0]).into_iter().flatten() {
        let dra = (p.status.as_ref()).and_then(|s| s.extended_resource_claim_status.as_ref());
        assert!(
            dra.is_none(),
            "a DRA-served pod left: {:?}",
            p.metadata.name
        );
    }
    let claims = Api::<ResourceClaim>::namespaced(c.clone(), "default")
        .list(&ListParams::default())
        .await
        .unwrap();
    assert!(
        claims.items.is_empty(),
        "{} claims left",
        claims.items.len()
    );
    for node in NODES {
        let l = labels(&c, node).await;
        assert_eq!(l["nvidia.com/gpu.deploy.device-plugin"], "true");
        assert!(!l.contains_key("nvidia.com/gpu.deploy.dra-driver"), "{l:?}");
    }
    until("our DeviceClass deleted", LONG, || async {
        class(&c, OURS).await.is_none().then_some(())
    })
    .await;
    pods(&c)
        .delete_collection(
            &DeleteParams::default().grace_period(0),
            &ListParams::default(),
        )
        .await
        .unwrap();
    api.delete("l4-shared", &DeleteParams::default())
        .await
        .unwrap();

    // A MIG pool on one A100 (8 x 7g.80gb), straight to the DRA driver, whose consumable
    // shares are 4: a MIG device still takes one pod (the driver publishes its multiprocessors,
    // engines and memory slices without a request policy, so each claim takes all of them),
    // which is why MIG devices are not time-sliced through extended resources.
    label_node(&c, A100[0], "gpusharing.io/profile", Some("a100-mig")).await;
    let mig_dra = mig_policy().replace("all-3g.40gb", "all-7g.80gb")
        + "  backend: dra\n  dra: {extendedResources: true}\n";
    testkit::apply_yaml(&c, &mig_dra).await.unwrap();
    until("the MIG node moved", LONG, || async {
        let s = ready_on(&c, "a100-mig", 1).await?;
        (s["servedBy"] == json!({"draDriver": 1})).then_some(())
    })
    .await;
    for i in 0..9 {
        let pod = pool_pod(
            &format!("mig-{i}"),
            None,
            "a100-mig",
            "nvidia.com/mig-7g.80gb",
        );
        pods(&c).create(&PostParams::default(), &pod).await.unwrap();
    }
    let on_node = until("8 pods on 8 MIG devices, 1 left", LONG, || async {
        let p = placed(&c).await;
        let pending = (p.get("").into_iter().flatten())
            .filter(|p| p.name_any().starts_with("mig-"))
            .count();
        let bound = p.get(A100[0]).cloned().unwrap_or_default();
        (bound.len() == 8 && pending == 1).then_some(bound)
    })
    .await;
    let mut devices = Vec::new();
    for p in &on_node {
        devices.push(generated_claim_device(&c, p, A100[0]).await);
    }
    devices.sort();
    devices.dedup();
    assert_eq!(devices.len(), 8, "one pod per MIG device: {devices:?}");
    assert!(
        devices.iter().all(|d| d.contains("-mig-7g80gb-")),
        "{devices:?}"
    );
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
    let op = start_on_the_device_plugin(&c, DEVICE_PLUGIN_POLICY).await;
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

/// A whole-GPU pool (exclusive, the DRA driver's consumable shares off) moves, and each GPU
/// then takes exactly one unchanged pod through its generated claim; a MIG pool (A100s, two
/// 3g.40gb instances per GPU) moves beside it, and each MIG device takes exactly one pod asking
/// for `nvidia.com/mig-3g.40gb`; the moved MIG pool changes layout; moving back without a drain
/// waits for the pods' claims. Its
/// own control plane: the driver runs one `consumableShares` value for the whole cluster.
#[tokio::test]
async fn a_whole_gpu_pool_and_a_mig_pool_move_and_take_one_pod_per_device() {
    let (g, cluster, _sim) = setup_with_simulator(
        testkit::ClusterOptions::default().arg("--scheduler"),
        &["--dra-consumable-shares=disabled".to_string()],
    )
    .await;
    let invariants = g.invariants();
    let c = cluster.client.clone();
    let exclusive = DEVICE_PLUGIN_POLICY.replace(
        "  strategy: timeSlicing\n  timeSlicing: {replicas: 4}\n",
        "  strategy: exclusive\n",
    );
    let op = start_on_the_device_plugin(&c, &exclusive).await;
    let api: Api<GpuSharingPolicy> = Api::all(c.clone());
    let to_dra = json!({"spec": {"backend": "dra", "dra": {"extendedResources": true}}});
    api.patch("l4-shared", &PatchParams::default(), &Patch::Merge(&to_dra))
        .await
        .unwrap();
    until("moved to the DRA driver", LONG, || async {
        one_backend_each(&c).await;
        let s = ready_on(&c, "l4-shared", 2).await?;
        (s["servedBy"] == json!({"draDriver": 2})).then_some(())
    })
    .await;
    for node in NODES {
        assert_eq!(
            served(&c, node).await,
            (0, Some(vec![])),
            "{node}: no shares"
        );
    }

    // A namespace whose quota limits requests.nvidia.com/gpu and not our class's device count
    // is reported; limiting both clears it.
    testkit::apply_yaml(
        &c,
        "apiVersion: v1\nkind: Namespace\nmetadata: {name: team-a}\n",
    )
    .await
    .unwrap();
    testkit::apply_yaml(
        &c,
        "apiVersion: v1\nkind: ResourceQuota\nmetadata: {name: gpu, namespace: team-a}\nspec:\n  hard: {requests.nvidia.com/gpu: \"8\"}\n",
    )
    .await
    .unwrap();
    let gaps = until("the quota gap reported", LONG, || async {
        let s = policy_status(&c, "l4-shared").await?;
        s["quotaGaps"].as_array().cloned()
    })
    .await;
    assert_eq!(
        gaps,
        [json!(
            "team-a: ResourceQuota gpu limits requests.nvidia.com/gpu but not gpusharing-nvidia.com-gpu.deviceclass.resource.k8s.io/devices (ResourceClaims written against the class are not limited by it)"
        )]
    );
    testkit::apply_yaml(
        &c,
        "apiVersion: v1\nkind: ResourceQuota\nmetadata: {name: gpu, namespace: team-a}\nspec:\n  hard: {requests.nvidia.com/gpu: \"8\", gpusharing-nvidia.com-gpu.deviceclass.resource.k8s.io/devices: \"8\"}\n",
    )
    .await
    .unwrap();
    until("no quota gap", LONG, || async {
        let s = policy_status(&c, "l4-shared").await?;
        s.get("quotaGaps").is_none().then_some(())
    })
    .await;
    for i in 0..9 {
        pods(&c)
            .create(
                &PostParams::default(),
                &gpu_pod(&format!("whole-{i}"), None),
            )
            .await
            .unwrap();
    }
    let by_node = until("8 pods bound, 1 left", LONG, || async {
        let p = placed(&c).await;
        (p.get("").map(Vec::len) == Some(1) && p.values().map(Vec::len).sum::<usize>() == 9)
            .then_some(p)
    })
    .await;
    for node in NODES {
        let mut devices = Vec::new();
        for p in &by_node[node] {
            devices.push(generated_claim_device(&c, p, node).await);
        }
        devices.sort();
        assert_eq!(
            devices,
            ["gpu-0", "gpu-1", "gpu-2", "gpu-3"],
            "{node}: one pod per GPU"
        );
    }

    // A MIG pool moves beside it (exclusive MIG devices take the same disabled shares), its
    // layout applied through the device plugin first, one class per profile.
    for node in A100 {
        label_node(&c, node, "gpusharing.io/profile", Some("a100-mig")).await;
    }
    testkit::apply_yaml(&c, &mig_policy()).await.unwrap();
    until("the MIG layout through the device plugin", LONG, || {
        mig_pool_served(&c, false, "3g.40gb", 16)
    })
    .await;
    // Admission refuses what the DRA driver cannot serve a MIG pool as, naming why.
    for (patch, why) in [
        (
            json!({"spec": {"backend": "dra", "dra": {"namespaces": ["team"]}}}),
            "backend dra serves MIG only with dra.extendedResources",
        ),
        (
            json!({"spec": {"backend": "dra", "dra": {"extendedResources": true},
                "mig": {"migStrategy": "single"}}}),
            "MIG through dra.extendedResources needs migStrategy: mixed",
        ),
    ] {
        let err = api
            .patch("a100-mig", &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .unwrap_err()
            .to_string();
        assert!(err.contains(why), "{err}");
    }
    api.patch("a100-mig", &PatchParams::default(), &Patch::Merge(&to_dra))
        .await
        .unwrap();
    until("the MIG pool moved", LONG, || {
        mig_pool_served(&c, true, "3g.40gb", 16)
    })
    .await;
    let mig_class = class(&c, MIG_CLASS).await.expect("our MIG class");
    assert_eq!(
        mig_class.spec.extended_resource_name.as_deref(),
        Some("nvidia.com/mig-3g.40gb")
    );
    for i in 0..33 {
        let pod = pool_pod(
            &format!("mig-{i}"),
            None,
            "a100-mig",
            "nvidia.com/mig-3g.40gb",
        );
        pods(&c).create(&PostParams::default(), &pod).await.unwrap();
    }
    let mig_pods = until("32 MIG pods bound, 1 left", LONG, || async {
        let mut by_node: BTreeMap<String, Vec<Pod>> = BTreeMap::new();
        for (node, ps) in placed(&c).await {
            let mig = ps.into_iter().filter(|p| p.name_any().starts_with("mig-"));
            by_node.entry(node).or_default().extend(mig);
        }
        let bound: usize = A100
            .iter()
            .map(|n| by_node.get(*n).map_or(0, Vec::len))
            .sum();
        (bound == 32 && by_node.get("").map(Vec::len) == Some(1)).then_some(by_node)
    })
    .await;
    for node in A100 {
        let mut devices = Vec::new();
        for p in &mig_pods[node] {
            devices.push(generated_claim_device(&c, p, node).await);
        }
        devices.sort();
        devices.dedup();
        assert_eq!(
            devices.len(),
            16,
            "{node}: one pod per MIG device: {devices:?}"
        );
        assert!(
            devices.iter().all(|d| d.contains("-mig-3g40gb-")),
            "{devices:?}"
        );
    }

    // Back without a drain: each node waits for its pods' claims.
    let back = json!({"spec": {"backend": null, "dra": null}});
    api.patch("l4-shared", &PatchParams::default(), &Patch::Merge(&back))
        .await
        .unwrap();
    let s = until("waiting for the claims", LONG, || async {
        let s = policy_status(&c, "l4-shared").await?;
        let details = s["nodeDetails"].as_array()?;
        (details.len() == 2 && details.iter().all(|d| d["reason"] == "WaitingForDraClaims"))
            .then_some(s)
    })
    .await;
    assert_eq!(s["servedBy"], json!({"draDriver": 2}), "{s}");
    pods(&c)
        .delete_collection(
            &DeleteParams::default().grace_period(0),
            &ListParams::default(),
        )
        .await
        .unwrap();
    until("back on the device plugin", LONG, || async {
        one_backend_each(&c).await;
        ready_on(&c, "l4-shared", 2).await?;
        for node in NODES {
            if served(&c, node).await != (4, None) {
                return None;
            }
        }
        Some(())
    })
    .await;
    // Its pods gone with the others, the MIG pool changes layout where it is: the DRA
    // kubelet plugin stops (the driver reads MIG devices when it starts), the MIG manager
    // reshapes, the plugin starts again and publishes the new devices; the device plugin stays
    // off throughout.
    let seven = json!({"spec": {"mig": {"layout": "all-7g.80gb"}}});
    api.patch("a100-mig", &PatchParams::default(), &Patch::Merge(&seven))
        .await
        .unwrap();
    until("the new layout through the DRA driver", LONG, || {
        mig_pool_served(&c, true, "7g.80gb", 8)
    })
    .await;
    for node in A100 {
        assert_eq!(
            labels(&c, node).await["nvidia.com/gpu.deploy.device-plugin"],
            "false"
        );
    }
    // Back: the device plugin serves the layout again; with every node back, our classes go.
    let back = json!({"spec": {"backend": null, "dra": null}});
    api.patch("a100-mig", &PatchParams::default(), &Patch::Merge(&back))
        .await
        .unwrap();
    until("the MIG pool back on the device plugin", LONG, || {
        mig_pool_served(&c, false, "7g.80gb", 8)
    })
    .await;
    for name in ["l4-shared", "a100-mig"] {
        api.delete(name, &DeleteParams::default()).await.unwrap();
    }
    until("our classes deleted", LONG, || async {
        for name in [OURS, MIG_CLASS, "gpusharing-nvidia.com-mig-7g.80gb"] {
            class(&c, name).await.is_none().then_some(())?;
        }
        Some(())
    })
    .await;
    op.stop().await;
    invariants.check().await;
}
