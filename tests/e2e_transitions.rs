//! End-to-end: safe transitions between strategies and conflicts, on the real control plane with
//! the node simulator playing the MIG manager, device plugin and GPU Feature Discovery.

mod support;

use std::collections::BTreeMap;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::ResourceExt;
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use kube::runtime::watcher;
use support::invariants::{self, MigRecord};
use support::*;

const NODE: &str = "a100-node-0";

fn mig_policy(name: &str, profile: &str) -> String {
    format!(
        "apiVersion: gpusharing.io/v1alpha1\nkind: GpuSharingPolicy\nmetadata: {{name: {name}}}\nspec:\n  nodeSelector: {{matchLabels: {{gpusharing.io/profile: {profile}}}}}\n  strategy: mig\n  mig: {{migStrategy: single, layout: all-1g.10gb}}\n"
    )
}

fn mps_policy(name: &str, profile: &str, priority: i32) -> String {
    format!(
        "apiVersion: gpusharing.io/v1alpha1\nkind: GpuSharingPolicy\nmetadata: {{name: {name}}}\nspec:\n  priority: {priority}\n  nodeSelector: {{matchLabels: {{gpusharing.io/profile: {profile}}}}}\n  strategy: mps\n  mps: {{replicas: 4}}\n"
    )
}

/// A node's labels and the simulator's own record on it (its `simulator.gpusharing.io/`
/// annotations).
type Seen = (BTreeMap<String, String>, BTreeMap<String, String>);

/// Records every state (labels and the simulator's record) the node goes through, until it has
/// recorded a state whose device-plugin config is the key `last` sends (or 50 s pass).
/// Returns once the watch has its initial list, so no later change is missed.
async fn record_node_history(
    client: kube::Client,
    node: &'static str,
    last: tokio::sync::oneshot::Receiver<String>,
) -> tokio::task::JoinHandle<Vec<Seen>> {
    let (synced_tx, synced) = tokio::sync::oneshot::channel();
    let task = tokio::spawn(async move {
        let api: Api<Node> = Api::all(client);
        let cfg = watcher::Config::default().fields(&format!("metadata.name={node}"));
        let mut history: Vec<Seen> = Vec::new();
        let stream = watcher(api, cfg).take_until(tokio::time::sleep(Duration::from_secs(50)));
        futures::pin_mut!(stream);
        let (mut synced_tx, mut last, mut key) = (Some(synced_tx), last, None::<String>);
        loop {
            let done = |h: &[Seen], key: &Option<String>| {
                key.is_some()
                    && h.last()
                        .and_then(|(l, _)| l.get("nvidia.com/device-plugin.config"))
                        == key.as_ref()
            };
            if done(&history, &key) {
                break;
            }
            let ev = tokio::select! {
                k = &mut last, if key.is_none() => {
                    key = Some(k.expect("the last key"));
                    continue;
                }
                ev = stream.next() => ev,
            };
            let Some(ev) = ev else { break };
            let n = match ev.expect("node watch") {
                watcher::Event::Apply(n) | watcher::Event::InitApply(n) => n,
                watcher::Event::InitDone => {
                    if let Some(tx) = synced_tx.take() {
                        tx.send(()).ok();
                    }
                    continue;
                }
                watcher::Event::Init | watcher::Event::Delete(_) => continue,
            };
            let seen = (
                n.labels().clone().into_iter().collect(),
                invariants::sim_annotations(&n),
            );
            if history.last() != Some(&seen) {
                history.push(seen);
            }
        }
        history
    });
    synced.await.expect("the node watch lists the node");
    task
}

#[tokio::test]
async fn mig_to_mps_goes_through_confirmed_all_disabled() {
    let (g, cluster, _sim) = setup().await;
    let invariants = g.invariants();
    let c = cluster.client.clone();
    let op = Operator::start(c.clone(), Some(NS));
    label_node(&c, NODE, "gpusharing.io/profile", Some("inference")).await;
    testkit::apply_yaml(&c, &mig_policy("mig-inference", "inference"))
        .await
        .unwrap();
    let s = until("MIG Ready", LONG, || ready(&c, "mig-inference")).await;
    assert_eq!(s["migConfig"], "all-1g.10gb");
    let l = labels(&c, NODE).await;
    assert_eq!(l["nvidia.com/mig.config"], "all-1g.10gb");
    assert_eq!(l["nvidia.com/mig.config.state"], "success");

    // Switch the node to MPS: record every label state it passes through.
    let (stop, stopped) = tokio::sync::oneshot::channel();
    let history = record_node_history(c.clone(), NODE, stopped).await;
    Api::<gpu_sharing_operator::api::crd::GpuSharingPolicy>::all(c.clone())
        .delete("mig-inference", &DeleteParams::default())
        .await
        .unwrap();
    testkit::apply_yaml(&c, &mps_policy("mps-inference", "inference", 0))
        .await
        .unwrap();
    let s = until("MPS Ready", LONG, || ready_on(&c, "mps-inference", 1)).await;
    let mps_key = s["deviceConfigKey"].as_str().unwrap().to_string();
    // The history ends at the first state with the MPS key.
    stop.send(mps_key.clone()).ok();
    let history = history.await.unwrap();
    // Invariant over the whole transition: the MPS config is never selected while MIG may be
    // on. "Off" is what the MIG manager (the simulator) recorded: it applied all-disabled, did
    // not fail, and no GPU has MIG on; never the state label, which the operator writes too.
    let mut saw_disabled_confirmed = false;
    for (l, record) in &history {
        let mig = MigRecord::of(l, record);
        let mig_off = l.get("nvidia.com/mig.config").map(String::as_str) == Some("all-disabled")
            && mig.confirms(Some("all-disabled"))
            && mig.mig_on_gpus == 0;
        saw_disabled_confirmed |= mig_off;
        if l.get("nvidia.com/device-plugin.config") == Some(&mps_key) {
            assert!(
                mig_off,
                "MPS selected while MIG not confirmed off: {l:?} {mig:?}"
            );
        }
    }
    assert!(
        saw_disabled_confirmed,
        "never passed through all-disabled/success: {history:#?}"
    );
    assert_eq!(
        labels(&c, NODE).await["nvidia.com/gpu.sharing-strategy"],
        "mps"
    );
    plan_agrees(&c).await;
    op.stop().await;
    invariants.check().await;
}

#[tokio::test]
async fn an_overridden_policy_reports_the_winner_and_emits_an_event() {
    let (g, cluster, _sim) = setup().await;
    let invariants = g.invariants();
    let c = cluster.client.clone();
    let op = Operator::start(c.clone(), Some(NS));
    label_node(&c, "h200-node-0", "gpusharing.io/profile", Some("shared")).await;
    testkit::apply_yaml(&c, &mps_policy("mps-low", "shared", 0))
        .await
        .unwrap();
    testkit::apply_yaml(
        &c,
        "apiVersion: gpusharing.io/v1alpha1\nkind: GpuSharingPolicy\nmetadata: {name: ts-high}\nspec:\n  priority: 10\n  nodeSelector: {matchLabels: {nvidia.com/gpu.product: NVIDIA-H200}}\n  strategy: timeSlicing\n  timeSlicing: {replicas: 3}\n",
    )
    .await
    .unwrap();
    // ts-high has the higher priority: an override of mps-low, not a conflict.
    let s = until("mps-low Overridden", LONG, || async {
        let s = policy_status(&c, "mps-low").await?;
        (condition(&s, "Overridden")?["status"] == "True").then_some(s)
    })
    .await;
    let msg = condition(&s, "Overridden").unwrap()["message"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(msg.contains("h200-node-0 (overridden by ts-high)"), "{msg}");
    assert_eq!(s["overriddenNodes"], 1);
    assert_eq!(s["conflictingNodes"], 0);
    assert_eq!(condition(&s, "Conflicted").unwrap()["status"], "False");
    until("ts-high Ready", LONG, || ready(&c, "ts-high")).await;
    let l = labels(&c, "h200-node-0").await;
    assert_eq!(l["gpusharing.io/policy"], "ts-high");
    assert_eq!(l["nvidia.com/gpu.sharing-strategy"], "time-slicing");
    // An event on the losing policy says so.
    let events: Api<k8s_openapi::api::events::v1::Event> = Api::namespaced(c.clone(), "default");
    until("Overridden event", LONG, || async {
        let list = events.list(&ListParams::default()).await.ok()?;
        list.items
            .iter()
            .find(|e| {
                e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some("mps-low")
                    && e.reason.as_deref() == Some("HigherPriorityPolicy")
            })
            .map(|_| ())
    })
    .await;
    op.stop().await;
    invariants.check().await;
}

#[tokio::test]
async fn mig_change_waits_for_idle_gpus() {
    let (g, cluster, _sim) = setup().await;
    let invariants = g.invariants();
    let c = cluster.client.clone();
    // A pod bound to the node, using a GPU (no kubelet: it stays Pending, but it is there).
    let pod: Pod = serde_json::from_value(serde_json::json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "train-0", "namespace": "default"},
        "spec": {"nodeName": NODE, "containers": [{"name": "c", "image": "cuda",
            "resources": {"limits": {"nvidia.com/gpu": "1"}}}]}
    }))
    .unwrap();
    let pods: Api<Pod> = Api::namespaced(c.clone(), "default");
    pods.create(&PostParams::default(), &pod).await.unwrap();
    let op = Operator::start(c.clone(), Some(NS));
    label_node(&c, NODE, "gpusharing.io/profile", Some("inference")).await;
    testkit::apply_yaml(&c, &mig_policy("mig-inference", "inference"))
        .await
        .unwrap();
    let s = until("WaitingForIdleGPUs", LONG, || async {
        let s = policy_status(&c, "mig-inference").await?;
        (condition(&s, "Progressing")?["reason"] == "WaitingForIdleGPUs").then_some(s)
    })
    .await;
    assert!(
        condition(&s, "Progressing").unwrap()["message"]
            .as_str()
            .unwrap()
            .contains("default/train-0")
    );
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(
        labels(&c, NODE).await["nvidia.com/mig.config"],
        "all-disabled",
        "layout untouched while busy"
    );
    // The pod goes: the layout changes.
    pods.delete(
        "train-0",
        &DeleteParams {
            grace_period_seconds: Some(0),
            ..Default::default()
        },
    )
    .await
    .unwrap();
    let s = until("MIG Ready after the pod left", LONG, || {
        ready(&c, "mig-inference")
    })
    .await;
    assert_eq!(s["migConfig"], "all-1g.10gb");
    assert_eq!(
        labels(&c, NODE).await["nvidia.com/mig.config"],
        "all-1g.10gb"
    );
    plan_agrees(&c).await;
    op.stop().await;
    invariants.check().await;
}

#[tokio::test]
async fn mig_manager_that_never_reports_is_degraded_after_the_timeout() {
    let (g, cluster, sim) = setup().await;
    let invariants = g.invariants();
    // No MIG manager at all: the state we set to pending is never resolved.
    drop(sim);
    let c = cluster.client.clone();
    let config = gpu_sharing_operator::runtime::controller::Config {
        namespace: Some(NS.into()),
        mig_timeout: Duration::from_secs(3),
        ..Default::default()
    };
    let op = Operator::start_with(c.clone(), config);
    label_node(&c, NODE, "gpusharing.io/profile", Some("inference")).await;
    testkit::apply_yaml(&c, &mig_policy("mig-inference", "inference"))
        .await
        .unwrap();
    until("pending", LONG, || async {
        (labels(&c, NODE)
            .await
            .get("nvidia.com/mig.config.state")
            .map(String::as_str)
            == Some("pending"))
        .then_some(())
    })
    .await;
    let s = until("Degraded after the MIG timeout", LONG, || async {
        let s = policy_status(&c, "mig-inference").await?;
        (condition(&s, "Degraded")?["status"] == "True").then_some(s)
    })
    .await;
    let d = condition(&s, "Degraded").unwrap();
    assert_eq!(d["reason"], "MigConfigFailed");
    assert!(d["message"].as_str().unwrap().contains(NODE), "{d}");
    assert_eq!(condition(&s, "Ready").unwrap()["status"], "False");
    op.stop().await;
    invariants.check().await;
}

/// A `mixed` MIG policy that wins the cluster-wide MIG strategy over a running MPS policy: the
/// MPS policy is reported conflicting and its node goes back to exclusive *before* the
/// ClusterPolicy says mixed (NVIDIA's device plugin refuses MPS under mixed: the simulator's
/// device plugin does too). Judged from one ordered history of the node and the ClusterPolicy.
#[tokio::test]
async fn mixed_waits_until_no_node_runs_mps() {
    let (g, cluster, _sim) = setup().await;
    let invariants = g.invariants();
    let c = cluster.client.clone();
    let op = Operator::start(c.clone(), Some(NS));
    label_node(&c, "h200-node-0", "gpusharing.io/profile", Some("shared")).await;
    testkit::apply_yaml(&c, &mps_policy("mps-h200", "shared", 0))
        .await
        .unwrap();
    let s = until("MPS Ready", LONG, || ready_on(&c, "mps-h200", 1)).await;
    let mps_key = s["deviceConfigKey"].as_str().unwrap().to_string();

    // From here on: every state of the node and of the ClusterPolicy, with resourceVersions.
    let history = std::sync::Arc::new(std::sync::Mutex::new(Vec::<(u64, String, String)>::new()));
    let listed = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let watch = |api: Api<kube::api::DynamicObject>, what: &'static str| {
        let (history, listed) = (history.clone(), listed.clone());
        tokio::spawn(async move {
            let mut s = watcher(api, watcher::Config::default()).boxed();
            while let Some(Ok(ev)) = s.next().await {
                if let watcher::Event::InitDone = ev {
                    listed.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                }
                if let watcher::Event::Apply(o) | watcher::Event::InitApply(o) = ev {
                    let rv = o
                        .resource_version()
                        .unwrap_or_default()
                        .parse()
                        .unwrap_or(0);
                    let value = match what {
                        "node" => o.labels().get("nvidia.com/device-plugin.config").cloned(),
                        _ => o.data["spec"]["mig"]["strategy"].as_str().map(String::from),
                    };
                    let name = format!("{what}/{}", o.name_any());
                    history
                        .lock()
                        .unwrap()
                        .push((rv, name, value.unwrap_or_default()));
                }
            }
        })
    };
    let node_res = kube::api::ApiResource::erase::<Node>(&());
    let nodes = watch(Api::all_with(c.clone(), &node_res), "node");
    let cps = watch(testkit::cluster_policy_api(&c), "cp");
    until("both watches listed", LONG, || async {
        (listed.load(std::sync::atomic::Ordering::SeqCst) >= 2).then_some(())
    })
    .await;
    testkit::apply_yaml(
        &c,
        "apiVersion: gpusharing.io/v1alpha1\nkind: GpuSharingPolicy\nmetadata: {name: a100-mixed}\nspec:\n  priority: 10\n  nodeSelector: {matchLabels: {nvidia.com/gpu.product: NVIDIA-A100-SXM4-80GB}}\n  strategy: mig\n  mig: {migStrategy: mixed, layout: all-1g.10gb}\n",
    )
    .await
    .unwrap();
    until("a100-mixed Ready", LONG, || ready(&c, "a100-mixed")).await;
    let s = policy_status(&c, "mps-h200").await.unwrap();
    let accepted = condition(&s, "Accepted").unwrap();
    assert_eq!(accepted["reason"], "ClusterWideConflict", "{accepted}");
    assert_eq!(cluster_policy(&c).await["spec"]["mig"]["strategy"], "mixed");
    assert_ne!(
        labels(&c, "h200-node-0")
            .await
            .get("nvidia.com/device-plugin.config"),
        Some(&mps_key)
    );
    nodes.abort();
    cps.abort();
    let mut h = history.lock().unwrap().clone();
    h.sort();
    // Replay in etcd order: the node's config when the ClusterPolicy first said mixed.
    let mut node_key = String::new();
    let mut mixed_at = None;
    for (rv, name, value) in &h {
        if name == "node/h200-node-0" {
            node_key = value.clone();
        } else if name.starts_with("cp/") && value == "mixed" {
            mixed_at = Some((*rv, node_key.clone()));
            break;
        }
    }
    let (rv, key) = mixed_at.expect("the ClusterPolicy says mixed");
    assert_ne!(
        key, mps_key,
        "mig.strategy mixed at resourceVersion {rv} while h200-node-0 still ran MPS"
    );
    op.stop().await;
    invariants.check().await;
}
