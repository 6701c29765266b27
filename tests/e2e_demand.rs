//! End-to-end: demand-driven MIG (`spec.mig.dynamic`) with the real kube-scheduler in the
//! loop. The local control plane runs kube-scheduler in-process (`kube-local --scheduler`); the
//! node simulator plays the MIG manager (NVIDIA's mig-parted and go-nvml tables), the device
//! plugin and the kubelet, which runs a bound pod for its `simulator.gpusharing.io/run-seconds`
//! and then lets it Succeed. Two A100 nodes start with one 7g instance per GPU; an H100 node
//! joins at the end.
//!
//! One control plane for the file: the steps run in order in one test. The invariant watcher
//! checks throughout that no node is relabelled (MIG layout, workload) while GPU pods run on it:
//! a node demand drains is relabelled only once its pods are evicted.

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use gpu_sharing_operator::api::crd::GpuSharingPolicy;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::Client;
use kube::api::{Api, PostParams};
use serde_json::{Value, json};
use support::*;

const NODES: [&str; 2] = ["a100-node-0", "a100-node-1"];
const DEMAND: &str = "gpusharing.io/mig-demand-layout";

const POLICY: &str = "apiVersion: gpusharing.io/v1alpha1\nkind: GpuSharingPolicy\nmetadata: {name: dyn}\nspec:\n  nodeSelector: {matchLabels: {gpusharing.io/profile: dyn}}\n  strategy: mig\n  mig:\n    migStrategy: mixed\n    layout: all-7g.80gb\n    dynamic: {layouts: [all-1g.10gb, all-3g.40gb], quietSeconds: 1, idleSeconds: 2, minLayoutLifetimeSeconds: 5}\n  rollout: {maxUnavailable: 2}\n";

/// A pod asking for `count` instances of MIG `profile` on the policy's nodes, running for
/// `secs` once started.
fn mig_pod(name: &str, profile: &str, count: u32, secs: u32) -> Pod {
    serde_json::from_value(json!({
        "metadata": {"name": name, "namespace": "default",
            "annotations": {"simulator.gpusharing.io/run-seconds": secs.to_string()}},
        "spec": {
            "nodeSelector": {"gpusharing.io/profile": "dyn"},
            "containers": [{"name": "c", "image": "registry.k8s.io/pause:3.10",
                "resources": {"limits": {format!("nvidia.com/mig-{profile}"): count.to_string()}}}],
        },
    }))
    .unwrap()
}

fn pods(c: &Client) -> Api<Pod> {
    Api::namespaced(c.clone(), "default")
}

async fn create(c: &Client, p: Pod) {
    pods(c).create(&PostParams::default(), &p).await.unwrap();
}

/// By pod name: (node it is bound to, phase).
async fn pod_states(c: &Client) -> BTreeMap<String, (String, String)> {
    pods(c)
        .list(&Default::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .map(|p| {
            let node = p.spec.and_then(|s| s.node_name).unwrap_or_default();
            let phase = p.status.and_then(|s| s.phase).unwrap_or_default();
            (p.metadata.name.unwrap_or_default(), (node, phase))
        })
        .collect()
}

async fn node_meta(c: &Client, node: &str) -> (BTreeMap<String, String>, BTreeMap<String, String>) {
    let n = Api::<Node>::all(c.clone()).get(node).await.unwrap();
    let alloc = n
        .status
        .and_then(|s| s.allocatable)
        .unwrap_or_default()
        .into_iter()
        .filter(|(k, _)| k.starts_with("nvidia.com/mig-"))
        .map(|(k, v)| (k, v.0))
        .collect();
    (n.metadata.annotations.unwrap_or_default(), alloc)
}

/// The operator's `ReshapingNode` events on a pod: `reason: message`.
async fn reshaping_events(c: &Client, pod: &str) -> Vec<String> {
    reshaping_events_in(c, "default", pod).await
}

async fn reshaping_events_in(c: &Client, ns: &str, pod: &str) -> Vec<String> {
    pod_events_in(c, ns, pod, |e| e.reason.as_deref() == Some("ReshapingNode")).await
}

/// The operator as `run` starts it: evictions through a client that does not retry 429 (a
/// PodDisruptionBudget's refusal).
async fn start_operator(cluster: &testkit::TestCluster) -> Operator {
    let no_retries = testkit::client_without_retries(&cluster.kubeconfig)
        .await
        .unwrap();
    Operator::start_with(
        cluster.client.clone(),
        gpu_sharing_operator::runtime::controller::Config {
            namespace: Some(NS.into()),
            resync: Duration::from_secs(30),
            eviction_client: Some(gpu_sharing_operator::runtime::controller::EvictionClient(
                no_retries,
            )),
            ..Default::default()
        },
    )
}

/// A node's (cordoned, `nvidia.com/mig.config`) state.
type NodeState = (bool, Option<String>);

/// A node's states in the order the API server made them.
struct NodeHistory {
    states: std::sync::Arc<std::sync::Mutex<Vec<NodeState>>>,
    task: tokio::task::JoinHandle<()>,
}

impl NodeHistory {
    async fn start(c: &Client, node: &str) -> NodeHistory {
        use futures::StreamExt;
        use kube::runtime::watcher;
        let states = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let s = states.clone();
        let cfg = watcher::Config::default().fields(&format!("metadata.name={node}"));
        let mut stream = watcher(Api::<Node>::all(c.clone()), cfg).boxed();
        let task = tokio::spawn(async move {
            while let Some(ev) = stream.next().await {
                if let Ok(watcher::Event::Apply(n) | watcher::Event::InitApply(n)) = ev {
                    let cordoned = n.spec.and_then(|s| s.unschedulable) == Some(true);
                    let layout = n.metadata.labels.unwrap_or_default();
                    let state = (cordoned, layout.get("nvidia.com/mig.config").cloned());
                    let mut v = s.lock().unwrap();
                    if v.last() != Some(&state) {
                        v.push(state);
                    }
                }
            }
        });
        let h = NodeHistory { states, task };
        until("the node history's first state", LONG, || async {
            (!h.states().is_empty()).then_some(())
        })
        .await;
        h
    }

    fn states(&self) -> Vec<(bool, Option<String>)> {
        self.states.lock().unwrap().clone()
    }

    fn stop(self) {
        self.task.abort();
    }
}

/// The policy's `status.demand.profiles`, by profile.
async fn demand(c: &Client) -> BTreeMap<String, Value> {
    policy_status(c, "dyn")
        .await
        .and_then(|s| s["demand"]["profiles"].as_array().cloned())
        .unwrap_or_default()
        .into_iter()
        .map(|p| (p["profile"].as_str().unwrap_or_default().to_string(), p))
        .collect()
}

/// Pending pods get nodes reshaped and kube-scheduler binds them; a burst is served with one
/// reshape per layout needed; busy nodes are left alone and the status says why; an operator
/// restart in the middle of a reshape loses nothing.
#[tokio::test]
async fn pending_pods_get_idle_nodes_reshaped_and_the_scheduler_places_them() {
    let (_g, cluster, _sim) =
        setup_with(testkit::ClusterOptions::default().arg("--scheduler")).await;
    let c = cluster.client.clone();
    for n in NODES {
        label_node(&c, n, "gpusharing.io/profile", Some("dyn")).await;
    }
    let op = start_operator(&cluster).await;
    testkit::apply_yaml(&c, POLICY).await.unwrap();
    until("both nodes on all-7g.80gb", LONG, || async {
        ready_on(&c, "dyn", 2).await?;
        for n in NODES {
            let (_, alloc) = node_meta(&c, n).await;
            (alloc.get("nvidia.com/mig-7g.80gb").map(String::as_str) == Some("8")).then_some(())?;
        }
        Some(())
    })
    .await;
    let history: Vec<LabelHistory> =
        futures::future::join_all(NODES.map(|n| LabelHistory::start(&c, n))).await;

    // 1. One pod asks for a profile no node offers: kube-scheduler cannot place it; the
    // operator reshapes the first idle node, and the scheduler binds the pod there.
    create(&c, mig_pod("first", "1g.10gb", 1, 3)).await;
    let node = until("first bound", LONG, || async {
        let (node, _) = pod_states(&c).await.remove("first")?;
        (!node.is_empty()).then_some(node)
    })
    .await;
    assert_eq!(node, "a100-node-0", "the first idle node by name");
    let (ann, alloc) = node_meta(&c, &node).await;
    assert!(ann[DEMAND].starts_with("all-1g.10gb@"), "{ann:?}");
    assert_eq!(
        alloc["nvidia.com/mig-1g.10gb"], "56",
        "7 per A100 80GB x 8: {alloc:?}"
    );
    assert_eq!(
        reshaping_events(&c, "first").await,
        [
            "ReshapingNode: reshaping node a100-node-0 to NVIDIA-A100-SXM4-80GB layout all-1g.10gb for this pod"
        ]
    );
    until("first succeeded", LONG, || async {
        (pod_states(&c).await.get("first")?.1 == "Succeeded").then_some(())
    })
    .await;

    // 2. A burst: fourteen 1g pods fit the reshaped node as it is; four 3g pods need the other
    // node reshaped, once. The operator restarts right after it chose that layout.
    for k in 0..14 {
        create(&c, mig_pod(&format!("small-{k:02}"), "1g.10gb", 1, 30)).await;
    }
    for k in 0..4 {
        create(&c, mig_pod(&format!("big-{k}"), "3g.40gb", 1, 30)).await;
    }
    // (Restarted once each 3g pod was told: events are posted after the record, and a
    // restart does not tell the pods again.)
    let recorded = until("the 3g layout chosen for a100-node-1", LONG, || async {
        let (ann, _) = node_meta(&c, "a100-node-1").await;
        let v = ann.get(DEMAND)?;
        for k in 0..4 {
            reshaping_events(&c, &format!("big-{k}")).await.first()?;
        }
        v.starts_with("all-3g.40gb@").then(|| v.clone())
    })
    .await;
    op.stop().await;
    let op = start_operator(&cluster).await;
    let placed = until("all 18 pods running", LONG, || async {
        let s = pod_states(&c).await;
        let running: Vec<_> = s
            .iter()
            .filter(|(n, (_, phase))| n.as_str() != "first" && phase == "Running")
            .collect();
        (running.len() == 18).then_some(s)
    })
    .await;
    for (name, (node, _)) in &placed {
        let want = if name.starts_with("big") {
            "a100-node-1"
        } else {
            "a100-node-0"
        };
        assert_eq!(node, want, "{name}");
    }
    // The restarted operator took the recorded choice as it was (same time: not chosen again)
    // and told each 3g pod once.
    let (ann, _) = node_meta(&c, "a100-node-1").await;
    assert_eq!(
        ann.get(DEMAND),
        Some(&recorded),
        "the record survives the restart"
    );
    for k in 0..4 {
        let events = reshaping_events(&c, &format!("big-{k}")).await;
        assert_eq!(events.len(), 1, "big-{k}: {events:?}");
    }
    let layouts = |h: &LabelHistory| {
        h.states()
            .iter()
            .filter_map(|l| l.get("nvidia.com/mig.config").cloned())
            .fold(Vec::new(), |mut v: Vec<String>, l| {
                if v.last() != Some(&l) {
                    v.push(l);
                }
                v
            })
    };
    assert_eq!(layouts(&history[0]), ["all-7g.80gb", "all-1g.10gb"]);
    assert_eq!(layouts(&history[1]), ["all-7g.80gb", "all-3g.40gb"]);

    // 3. While both nodes run GPU pods, a pod asking for 7g waits: NoIdleNode; one asking for
    // a profile no dynamic policy's catalogue has is nobody's demand: not counted at all.
    // Nothing is relabelled.
    create(&c, mig_pod("whole", "7g.80gb", 1, 1)).await;
    create(&c, mig_pod("odd", "2g.20gb", 1, 1)).await;
    let d = until("reasons", LONG, || async {
        let d = demand(&c).await;
        let settled = |p: &str| {
            d.get(p)
                .is_some_and(|v| v["reason"].is_string() && v["reason"] != "Batching")
        };
        settled("7g.80gb").then_some(d)
    })
    .await;
    assert_eq!(d["7g.80gb"]["reason"], "NoIdleNode", "{d:?}");
    assert_eq!(d["7g.80gb"]["pending"], 1);
    assert!(!d.contains_key("2g.20gb"), "{d:?}");

    // 4. When the burst's pods are done and the nodes idle, the 7g pod gets a node back.
    let node = until("whole bound", LONG, || async {
        let (node, _) = pod_states(&c).await.remove("whole")?;
        (!node.is_empty()).then_some(node)
    })
    .await;
    let (ann, _) = node_meta(&c, &node).await;
    assert!(ann[DEMAND].starts_with("all-7g.80gb@"), "{ann:?}");
    let unbound: BTreeSet<String> = pod_states(&c)
        .await
        .into_iter()
        .filter(|(_, (n, _))| n.is_empty())
        .map(|(p, _)| p)
        .collect();
    assert_eq!(unbound, BTreeSet::from(["odd".to_string()]));

    // 5. The MIG manager of the node demand picks first fails: that node is held (Failed) and
    // the demand moves to the other node. Both nodes idle and past their cooldown first.
    until("both nodes idle", LONG, || async {
        let s = pod_states(&c).await;
        s.values()
            .all(|(n, phase)| n.is_empty() || phase == "Succeeded")
            .then_some(())
    })
    .await;
    tokio::time::sleep(std::time::Duration::from_secs(6)).await;
    let fault =
        json!({"metadata": {"annotations": {"simulator.gpusharing.io/fault": "mig-apply-fail"}}});
    Api::<Node>::all(c.clone())
        .patch(
            "a100-node-0",
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(&fault),
        )
        .await
        .unwrap();
    // `plan` shows what demand would do for the pending pod, before the operator does it.
    op.stop().await;
    create(&c, mig_pod("moved", "1g.10gb", 1, 1)).await;
    until("moved unschedulable", LONG, || async {
        let p = pods(&c).get("moved").await.ok()?;
        p.status?
            .conditions?
            .iter()
            .any(|c| c.reason.as_deref() == Some("Unschedulable"))
            .then_some(())
    })
    .await;
    tokio::time::sleep(std::time::Duration::from_secs(2)).await;
    let file = cluster.dir.path().join("dyn.yaml");
    std::fs::write(&file, POLICY).unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_gpu-sharing-operator"))
        .arg("plan")
        .arg("-f")
        .arg(&file)
        .env("KUBECONFIG", &cluster.kubeconfig)
        .env_remove("KUBERNETES_SERVICE_HOST")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains(
            "MIG layouts for pending pods (spec.mig.dynamic):\n  + a100-node-0: all-1g.10gb (for default/moved)"
        ),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let op = start_operator(&cluster).await;
    let node = until("moved bound", LONG, || async {
        let (node, _) = pod_states(&c).await.remove("moved")?;
        (!node.is_empty()).then_some(node)
    })
    .await;
    assert_eq!(node, "a100-node-1");
    assert_eq!(
        reshaping_events(&c, "moved").await.len(),
        2,
        "reshaping a100-node-0, then a100-node-1: {:?}",
        reshaping_events(&c, "moved").await
    );
    let s = policy_status(&c, "dyn").await.unwrap();
    let failed = s["nodeDetails"]
        .as_array()
        .unwrap()
        .iter()
        .find(|d| d["name"] == "a100-node-0")
        .cloned()
        .unwrap();
    assert_eq!(failed["state"], "Failed", "{failed}");

    // 6. drainBusyNodes: a100-node-1 runs a 1g pod of priority 0 and one of priority 1000,
    // above the ceiling: two 3g pods wait (NoIdleNode, naming the ceiling). Once the
    // high-priority pod is gone, the node is drained: cordoned, its other pod evicted through
    // the Eviction API. A PodDisruptionBudget first refuses the eviction: after
    // drainTimeoutSeconds the drain is given up and the node uncordoned, layout unchanged, the
    // rollout not halted. Once the budget allows it, the pod is evicted; it takes 5 s to stop
    // (within its grace period), and the node is relabelled only after it is gone; the
    // scheduler binds the 3g pods there.
    let vip: k8s_openapi::api::scheduling::v1::PriorityClass =
        serde_json::from_value(json!({"metadata": {"name": "vip"}, "value": 1000})).unwrap();
    Api::all(c.clone())
        .create(&PostParams::default(), &vip)
        .await
        .unwrap();
    // Drains without a namespace fence are refused at admission.
    let refused = Api::<GpuSharingPolicy>::all(c.clone())
        .patch(
            "dyn",
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(
                json!({"spec": {"mig": {"dynamic": {"drainBusyNodes": {"maxPodPriority": 0}}}}}),
            ),
        )
        .await
        .unwrap_err()
        .to_string();
    assert!(
        refused.contains("drainBusyNodes needs a namespaceSelector"),
        "{refused}"
    );
    // A catalogue entry is written to a node label: it must be a label value.
    let refused = Api::<GpuSharingPolicy>::all(c.clone())
        .patch(
            "dyn",
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(
                json!({"spec": {"mig": {"dynamic": {"layouts": ["all-1g.10gb", "all 3g; rm -rf"]}}}}),
            ),
        )
        .await
        .unwrap_err()
        .to_string();
    assert!(
        refused.contains("each layout must be a valid label value"),
        "{refused}"
    );
    Api::<GpuSharingPolicy>::all(c.clone())
        .patch(
            "dyn",
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(json!({"spec": {"mig": {"dynamic": {
                "drainBusyNodes": {"maxPodPriority": 0, "maxDrainsPerHour": 2},
                "minLayoutLifetimeSeconds": 60,
                "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "default"}},
            }}, "disruption": {"drainTimeoutSeconds": 15}}})),
        )
        .await
        .unwrap();
    // A pod of a namespace the selector leaves out is nobody's demand: it may not make the
    // operator drain (or reshape) anything.
    let outsider_ns: k8s_openapi::api::core::v1::Namespace =
        serde_json::from_value(json!({"metadata": {"name": "outsider"}})).unwrap();
    Api::all(c.clone())
        .create(&PostParams::default(), &outsider_ns)
        .await
        .unwrap();
    let mut outsider = mig_pod("outsider", "3g.40gb", 1, 1);
    outsider.metadata.namespace = Some("outsider".into());
    let outsiders: Api<Pod> = Api::namespaced(c.clone(), "outsider");
    outsiders
        .create(&PostParams::default(), &outsider)
        .await
        .unwrap();
    let mut high = mig_pod("vip", "1g.10gb", 1, 600);
    high.spec.as_mut().unwrap().priority_class_name = Some("vip".into());
    create(&c, high).await;
    let mut low = mig_pod("low", "1g.10gb", 1, 600);
    low.metadata.labels = Some([("app".to_string(), "low".to_string())].into());
    low.metadata
        .annotations
        .as_mut()
        .unwrap()
        .insert("simulator.gpusharing.io/stop-seconds".into(), "5".into());
    create(&c, low).await;
    let pdbs: Api<k8s_openapi::api::policy::v1::PodDisruptionBudget> =
        Api::namespaced(c.clone(), "default");
    // (minAvailable: a bare pod has no controller to compute maxUnavailable from.)
    let pdb: k8s_openapi::api::policy::v1::PodDisruptionBudget =
        serde_json::from_value(json!({"metadata": {"name": "low"},
            "spec": {"minAvailable": 1, "selector": {"matchLabels": {"app": "low"}}}}))
        .unwrap();
    pdbs.create(&PostParams::default(), &pdb).await.unwrap();
    let node1 = NodeHistory::start(&c, "a100-node-1").await;
    until("vip and low running on a100-node-1", LONG, || async {
        let s = pod_states(&c).await;
        ["vip", "low"]
            .iter()
            .all(|p| s.get(*p) == Some(&("a100-node-1".into(), "Running".into())))
            .then_some(())
    })
    .await;
    for k in 0..2 {
        create(&c, mig_pod(&format!("drained-for-{k}"), "3g.40gb", 1, 1)).await;
    }
    let d = until("the ceiling named", LONG, || async {
        let d = demand(&c).await;
        let p = d.get("3g.40gb")?;
        (p["reason"] == "NoIdleNode").then(|| p.clone())
    })
    .await;
    assert_eq!(d["pending"], 2, "the outsider's pod is not counted: {d}");
    assert!(
        d["message"]
            .as_str()
            .unwrap()
            .contains("drainBusyNodes.maxPodPriority 0"),
        "{d}"
    );
    pods(&c).delete("vip", &Default::default()).await.unwrap();
    // The node's layout may first have to reach its 60 s lifetime (the least drains allow).
    let cooldown = Duration::from_secs(60);
    until(
        "the eviction refused by the budget",
        LONG + cooldown,
        || async {
            let events = Api::<k8s_openapi::api::events::v1::Event>::all(c.clone())
                .list(&Default::default())
                .await
                .ok()?;
            events
                .items
                .iter()
                .any(|e| {
                    e.reason.as_deref() == Some("EvictionBlocked")
                        && e.note
                            .as_deref()
                            .is_some_and(|n| n.contains("a100-node-1") && n.contains("low"))
                })
                .then_some(())
        },
    )
    .await;
    until(
        "the drain given up: a100-node-1 uncordoned",
        LONG,
        || async {
            let h = node1.states();
            let cordoned = h.iter().any(|(u, _)| *u);
            (cordoned && !h.last()?.0).then_some(())
        },
    )
    .await;
    let given_up = node1.states();
    assert!(
        given_up.iter().all(|(_, l)| *l == given_up[0].1),
        "the layout stays while the budget refuses: {given_up:?}"
    );
    assert_eq!(pod_states(&c).await["low"].1, "Running");
    let s = policy_status(&c, "dyn").await.unwrap();
    assert_ne!(
        condition(&s, "Progressing").map(|c| c["reason"].clone()),
        Some(json!("RolloutHalted")),
        "a demand drain given up halts no rollout: {s}"
    );
    pdbs.patch(
        "low",
        &kube::api::PatchParams::default(),
        &kube::api::Patch::Merge(json!({"spec": {"minAvailable": 0}})),
    )
    .await
    .unwrap();
    until(
        "the 3g pods bound on a100-node-1",
        // (A drain given up keeps the node's layout for another lifetime before the next.)
        LONG + 2 * cooldown,
        || async {
            let s = pod_states(&c).await;
            (0..2)
                .all(|k| {
                    s.get(&format!("drained-for-{k}"))
                        .is_some_and(|(n, _)| n == "a100-node-1")
                })
                .then_some(())
        },
    )
    .await;
    assert!(
        pods(&c).get_opt("low").await.unwrap().is_none(),
        "low evicted"
    );
    assert!(
        reshaping_events(&c, "drained-for-0").await[0]
            .ends_with("layout all-3g.40gb for this pod (draining it: 1 GPU pod(s) evicted)"),
        "{:?}",
        reshaping_events(&c, "drained-for-0").await
    );
    assert_eq!(
        layouts(&history[1]).last().map(String::as_str),
        Some("all-3g.40gb")
    );
    // Cordoned again before the relabel (the invariant watcher saw no relabel while the
    // evicted pod was still stopping).
    let h = node1.states();
    let relabel = h
        .iter()
        .position(|(_, l)| l.as_deref() == Some("all-3g.40gb"))
        .unwrap();
    assert!(
        h[..relabel].iter().skip(given_up.len()).any(|(u, _)| *u) && h[relabel].0,
        "cordoned before and while relabelled: {h:?}"
    );
    node1.stop();
    pdbs.delete("low", &Default::default()).await.unwrap();
    until("a100-node-1 uncordoned", LONG, || async {
        let n = Api::<Node>::all(c.clone()).get("a100-node-1").await.ok()?;
        (n.spec?.unschedulable != Some(true)).then_some(())
    })
    .await;
    // (kube-scheduler may bind it to a free 3g instance the others' reshape brought.)
    assert!(
        reshaping_events_in(&c, "outsider", "outsider")
            .await
            .is_empty(),
        "no node was reshaped for the outsider"
    );
    outsiders
        .delete("outsider", &Default::default())
        .await
        .unwrap();
    // Back to no drains and a short cooldown for the steps that follow.
    Api::<GpuSharingPolicy>::all(c.clone())
        .patch(
            "dyn",
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(json!({"spec": {"mig": {"dynamic": {
                "drainBusyNodes": null,
                "minLayoutLifetimeSeconds": 5,
                "namespaceSelector": null,
            }}, "disruption": null}})),
        )
        .await
        .unwrap();

    // 7. Taints: a100-node-1 gets `nvidia.com/gpu=present:NoSchedule` (which the GPU Operator's
    // DaemonSets tolerate, as its chart sets). Of two 1g pods, only the one that tolerates it
    // is demand for the node: the node is reshaped for it, kube-scheduler binds it there, and
    // the other pod gets no event and stays pending.
    let tolerate_gpu =
        json!({"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"});
    testkit::cluster_policy_api(&c)
        .patch(
            "cluster-policy",
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(
                json!({"spec": {"daemonsets": {"tolerations": [tolerate_gpu]}}}),
            ),
        )
        .await
        .unwrap();
    let taint = json!({"spec": {"taints": [{"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}]}});
    Api::<Node>::all(c.clone())
        .patch(
            "a100-node-1",
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(&taint),
        )
        .await
        .unwrap();
    let mut tolerant = mig_pod("tolerant", "1g.10gb", 1, 1);
    tolerant.spec.as_mut().unwrap().tolerations =
        Some(vec![serde_json::from_value(tolerate_gpu.clone()).unwrap()]);
    create(&c, tolerant).await;
    create(&c, mig_pod("intolerant", "1g.10gb", 1, 1)).await;
    until("tolerant bound on a100-node-1", LONG, || async {
        let (node, _) = pod_states(&c).await.remove("tolerant")?;
        (node == "a100-node-1").then_some(())
    })
    .await;
    assert_eq!(reshaping_events(&c, "tolerant").await.len(), 1);
    assert_eq!(
        reshaping_events(&c, "intolerant").await,
        Vec::<String>::new()
    );
    assert_eq!(pod_states(&c).await["intolerant"].0, "", "not bound");

    // 8. An H100 node joins the policy: it gets the policy's layout, then a 1g pod that asks for
    // an H100 gets it reshaped to all-1g.10gb (7 per GPU, as on the A100 80GB), and
    // kube-scheduler binds the pod there.
    // The intolerant pod goes first: the new node would be reshaped for it.
    pods(&c)
        .delete("intolerant", &Default::default())
        .await
        .unwrap();
    let h100 = fixture_node("a100-node-1", "h100-node-0")
        .replace("NVIDIA-A100-SXM4-80GB", "NVIDIA-H100-80GB-HBM3")
        .replace("gpu.family: ampere", "gpu.family: hopper")
        .replace("gpu.compute.major: '8'", "gpu.compute.major: '9'")
        .replace("gpu.memory: '81920'", "gpu.memory: '81559'")
        .replace("p4de.24xlarge", "p5.48xlarge")
        .replace(
            "kubernetes.io/hostname: h100-node-0\n",
            "kubernetes.io/hostname: h100-node-0\n    gpusharing.io/profile: dyn\n",
        );
    testkit::apply_yaml(&c, &h100).await.unwrap();
    until("h100-node-0 on all-7g.80gb", LONG, || async {
        let (_, alloc) = node_meta(&c, "h100-node-0").await;
        (alloc.get("nvidia.com/mig-7g.80gb").map(String::as_str) == Some("8")).then_some(())
    })
    .await;
    let mut on_h100 = mig_pod("on-h100", "1g.10gb", 1, 1);
    on_h100.spec.as_mut().unwrap().node_selector = Some(
        [
            ("gpusharing.io/profile".to_string(), "dyn".to_string()),
            (
                "nvidia.com/gpu.product".to_string(),
                "NVIDIA-H100-80GB-HBM3".to_string(),
            ),
        ]
        .into(),
    );
    create(&c, on_h100).await;
    until("on-h100 bound on h100-node-0", LONG, || async {
        let (node, _) = pod_states(&c).await.remove("on-h100")?;
        (node == "h100-node-0").then_some(())
    })
    .await;
    let (_, alloc) = node_meta(&c, "h100-node-0").await;
    assert_eq!(alloc["nvidia.com/mig-1g.10gb"], "56", "{alloc:?}");
    assert_eq!(
        reshaping_events(&c, "on-h100").await,
        [
            "ReshapingNode: reshaping node h100-node-0 to NVIDIA-H100-80GB-HBM3 layout all-1g.10gb for this pod"
        ]
    );

    // 9. reserveBusyNodes: h100-node-0 runs a 1g pod for 80 s; a 7g pod for an H100 gets the
    // node reserved: cordoned at once, nothing evicted, reshaped once the 1g pod finished, then
    // uncordoned, and kube-scheduler binds the 7g pod there.
    Api::<GpuSharingPolicy>::all(c.clone())
        .patch(
            "dyn",
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(json!({"spec": {"mig": {"dynamic": {
                "reserveBusyNodes": {"maxWaitSeconds": 120},
                "minLayoutLifetimeSeconds": 60,
            }}}})),
        )
        .await
        .unwrap();
    let on_h100 = |name: &str, profile: &str, secs: u32| {
        let mut p = mig_pod(name, profile, 1, secs);
        let sel = p.spec.as_mut().unwrap().node_selector.as_mut().unwrap();
        sel.insert(
            "nvidia.com/gpu.product".into(),
            "NVIDIA-H100-80GB-HBM3".into(),
        );
        p
    };
    // The node's layout (chosen in step 8) first reaches its 60 s lifetime: the pod outlasts it.
    create(&c, on_h100("long", "1g.10gb", 80)).await;
    until("long running on h100-node-0", LONG, || async {
        let s = pod_states(&c).await;
        (s.get("long")? == &("h100-node-0".into(), "Running".into())).then_some(())
    })
    .await;
    create(&c, on_h100("whole-h100", "7g.80gb", 1)).await;
    until(
        "h100-node-0 cordoned while long runs",
        LONG + cooldown,
        || async {
            let n = Api::<Node>::all(c.clone()).get("h100-node-0").await.ok()?;
            (n.spec?.unschedulable == Some(true)).then_some(())
        },
    )
    .await;
    assert_eq!(
        pod_states(&c).await["long"],
        ("h100-node-0".to_string(), "Running".to_string()),
        "nothing evicted"
    );
    assert!(
        reshaping_events(&c, "whole-h100").await[0].ends_with(
            "layout all-7g.80gb for this pod (cordoned until its 1 running GPU pod(s) finish)"
        ),
        "{:?}",
        reshaping_events(&c, "whole-h100").await
    );
    // The node's layout may first have to reach its 60 s lifetime (from step 8).
    until(
        "whole-h100 bound on h100-node-0",
        LONG + cooldown,
        || async {
            let (node, _) = pod_states(&c).await.remove("whole-h100")?;
            (node == "h100-node-0").then_some(())
        },
    )
    .await;
    assert_eq!(
        pod_states(&c).await["long"].1,
        "Succeeded",
        "long ran to its end"
    );
    until("h100-node-0 uncordoned", LONG, || async {
        let n = Api::<Node>::all(c.clone()).get("h100-node-0").await.ok()?;
        (n.spec?.unschedulable != Some(true)).then_some(())
    })
    .await;

    // 10. preferBusyNodes: the idle A100 nodes (both on all-1g.10gb by now) get the spare taint
    // (PreferNoSchedule). The first 1g pod lands on one of them, which loses the taint; kube-
    // scheduler then binds the next pods to that busy node, though the other offers as much,
    // and the idle one keeps its taint: it stays free for a reshape.
    Api::<GpuSharingPolicy>::all(c.clone())
        .patch(
            "dyn",
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(json!({"spec": {"mig": {"dynamic": {
                "reserveBusyNodes": null,
                "preferBusyNodes": true,
            }}}})),
        )
        .await
        .unwrap();
    let spare = |n: &'static str| {
        let c = c.clone();
        async move {
            let n = Api::<Node>::all(c).get(n).await.ok()?;
            let taints = n.spec?.taints.unwrap_or_default();
            Some(taints.iter().any(|t| {
                t.key == gpu_sharing_operator::api::names::TAINT_SPARE
                    && t.effect == "PreferNoSchedule"
            }))
        }
    };
    until(
        "both idle A100 nodes carry the spare taint",
        LONG,
        || async { (spare(NODES[0]).await? && spare(NODES[1]).await?).then_some(()) },
    )
    .await;
    let busy_1g = |name: &str| {
        let mut p = mig_pod(name, "1g.10gb", 1, 120);
        let spec = p.spec.as_mut().unwrap();
        spec.tolerations = Some(vec![serde_json::from_value(tolerate_gpu.clone()).unwrap()]);
        (spec.node_selector.as_mut().unwrap()).insert(
            "nvidia.com/gpu.product".into(),
            "NVIDIA-A100-SXM4-80GB".into(),
        );
        p
    };
    create(&c, busy_1g("packed-0")).await;
    let first = until("packed-0 running", LONG, || async {
        let (node, phase) = pod_states(&c).await.remove("packed-0")?;
        (phase == "Running").then_some(node)
    })
    .await;
    let (busy, idle) = if first == NODES[0] {
        (NODES[0], NODES[1])
    } else {
        (NODES[1], NODES[0])
    };
    until("the busy node loses the spare taint", LONG, || async {
        (!spare(busy).await?).then_some(())
    })
    .await;
    // Without the taint kube-scheduler's default profile ties the two nodes (a few pods
    // without requests move its LeastAllocated score by no point) and picks at random: five
    // pods on the busy node would then happen one time in 32.
    for k in 1..=5 {
        let name = format!("packed-{k}");
        create(&c, busy_1g(&name)).await;
        let node = until(&format!("{name} bound"), LONG, || async {
            let (node, _) = pod_states(&c).await.remove(&name)?;
            (!node.is_empty()).then_some(node)
        })
        .await;
        assert_eq!(node, busy, "{name} packed onto the busy node");
    }
    assert_eq!(
        spare(idle).await,
        Some(true),
        "the idle node keeps its taint"
    );

    // 11. Deleting the policy (its pods gone first) takes the spare taint off before the
    // policy's finalizer goes.
    let now = kube::api::DeleteParams {
        grace_period_seconds: Some(0),
        ..Default::default()
    };
    for k in 0..=5 {
        pods(&c).delete(&format!("packed-{k}"), &now).await.unwrap();
    }
    Api::<GpuSharingPolicy>::all(c.clone())
        .delete("dyn", &Default::default())
        .await
        .unwrap();
    until("the policy gone", LONG, || async {
        let gone = Api::<GpuSharingPolicy>::all(c.clone())
            .get_opt("dyn")
            .await
            .ok()?
            .is_none();
        gone.then_some(())
    })
    .await;
    for n in NODES {
        assert_eq!(spare(n).await, Some(false), "{n} keeps no spare taint");
    }
    op.stop().await;
}
