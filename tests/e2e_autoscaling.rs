//! End-to-end: Karpenter NodeOverlays from policies, on the local control plane with
//! Karpenter's own CRDs (from the `sigs.k8s.io/karpenter` Go module, `tests/karpenter`).
//!
//! One control plane for the file: the steps run in order in one test.

mod support;

use std::collections::BTreeMap;
use std::time::Duration;

use gpu_sharing_operator::api::crd::GpuSharingPolicy;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::Client;
use kube::api::{Api, ApiResource, DeleteParams, DynamicObject, Patch, PatchParams, PostParams};
use serde_json::{Value, json};
use support::*;

/// `tests/karpenter/build.sh path`: Karpenter's binary and CRDs, built when their sources
/// changed.
fn karpenter_dir() -> std::path::PathBuf {
    let out = std::process::Command::new("bash")
        .arg(testkit::repo_root().join("tests/karpenter/build.sh"))
        .arg("path")
        .output()
        .expect("tests/karpenter/build.sh runs");
    assert!(
        out.status.success(),
        "tests/karpenter/build.sh failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap().trim().into()
}

fn overlay_api(c: &Client) -> Api<DynamicObject> {
    karpenter_api(c, "v1alpha1", "NodeOverlay", "nodeoverlays")
}

/// NodeOverlays by name: their spec.
async fn overlays(c: &Client) -> BTreeMap<String, Value> {
    overlay_api(c)
        .list(&Default::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .map(|o| (o.metadata.name.clone().unwrap(), o.data["spec"].clone()))
        .collect()
}

fn node_pool(name: &str, labels: Value) -> String {
    format!(
        "apiVersion: karpenter.sh/v1\nkind: NodePool\nmetadata: {{name: {name}}}\nspec:\n  template:\n    metadata: {{labels: {labels}}}\n    spec:\n      nodeClassRef: {{group: karpenter.kwok.sh, kind: KWOKNodeClass, name: default}}\n      expireAfter: Never\n      requirements:\n      - {{key: node.kubernetes.io/instance-type, operator: In, values: [gpu-1x, gpu-8x]}}\n"
    )
}

const TS4: &str = "apiVersion: gpusharing.io/v1alpha1\nkind: GpuSharingPolicy\nmetadata: {name: ts4}\nspec:\n  nodeSelector: {matchLabels: {gpusharing.io/profile: ts4}}\n  strategy: timeSlicing\n  timeSlicing: {replicas: 4}\n";

/// The admin's table: two instance types no node of the cluster runs yet.
const TABLE: &str = "gpu-1x: {gpus: 1, product: NVIDIA-L4, memoryMiB: 23034}\ngpu-8x: {gpus: 8, product: NVIDIA-L4, memoryMiB: 23034}\n";

/// A time-slicing policy gets one overlay per GPU count of the NodePool it selects (GPUs x
/// replicas), none for a NodePool it does not select (with the reason in its status); an edit
/// reaches the overlays, another actor's overlay on the same resource makes the policy step
/// aside for that type, and deleting the policy removes its overlays before its finalizer goes.
#[tokio::test]
async fn node_overlays_follow_policies_and_node_pools() {
    let crds = karpenter_dir().join("crds");
    let (_g, cluster, _sim) = setup_with(testkit::ClusterOptions::default().manifest(&crds)).await;
    let c = cluster.client.clone();
    for pool in [
        node_pool("shared", json!({"gpusharing.io/profile": "ts4"})),
        node_pool("plain", json!({})),
    ] {
        testkit::apply_yaml(&c, &pool).await.unwrap();
    }
    let table: ConfigMap = serde_json::from_value(json!({
        "metadata": {"name": "gpu-sharing-instance-types", "namespace": NS},
        "data": {"instance-types.yaml": TABLE},
    }))
    .unwrap();
    Api::<ConfigMap>::namespaced(c.clone(), NS)
        .create(&PostParams::default(), &table)
        .await
        .unwrap();
    let op = Operator::start(c.clone(), Some(NS));
    testkit::apply_yaml(&c, TS4).await.unwrap();

    let o = until("two overlays", LONG, || async {
        let o = overlays(&c).await;
        (o.len() == 2).then_some(o)
    })
    .await;
    assert_eq!(
        o["gpusharing-ts4-8gpu"]["capacity"],
        json!({"nvidia.com/gpu": "32"})
    );
    assert_eq!(
        o["gpusharing-ts4-1gpu"]["capacity"],
        json!({"nvidia.com/gpu": "4"})
    );
    assert_eq!(
        o["gpusharing-ts4-8gpu"]["requirements"],
        json!([
            {"key": "karpenter.sh/nodepool", "operator": "In", "values": ["shared"]},
            {"key": "node.kubernetes.io/instance-type", "operator": "In", "values": ["gpu-8x"]},
        ])
    );
    assert_eq!(o["gpusharing-ts4-8gpu"]["weight"], 1);
    let s = until("status.autoscaling", LONG, || async {
        let s = policy_status(&c, "ts4").await?;
        (s["autoscaling"]["overlays"].as_array()?.len() == 2).then_some(s)
    })
    .await;
    assert_eq!(
        s["autoscaling"]["nodePools"],
        json!([
            {"name": "plain", "matched": false, "reason": "its template labels lack gpusharing.io/profile=ts4"},
            {"name": "shared", "matched": true, "reason": "instance types gpu-1x, gpu-8x"},
        ])
    );
    // At rest nothing is written again (the overlays included), as kube-apiserver counts.
    assert_nothing_written_at_rest(&c, "ts4", || async { op.passes() }).await;

    // An edit reaches the overlays.
    Api::<GpuSharingPolicy>::all(c.clone())
        .patch(
            "ts4",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"timeSlicing": {"replicas": 2}}})),
        )
        .await
        .unwrap();
    until("8 GPUs x 2", LONG, || async {
        let o = overlays(&c).await;
        (o.get("gpusharing-ts4-8gpu")?["capacity"]["nvidia.com/gpu"] == "16").then_some(())
    })
    .await;

    // An admin's overlay setting nvidia.com/gpu on gpu-8x: ours steps aside for that type.
    testkit::apply_yaml(
        &c,
        "apiVersion: karpenter.sh/v1alpha1\nkind: NodeOverlay\nmetadata: {name: admin-8x}\nspec:\n  weight: 50\n  requirements:\n  - {key: node.kubernetes.io/instance-type, operator: In, values: [gpu-8x]}\n  capacity: {nvidia.com/gpu: \"8\"}\n",
    )
    .await
    .unwrap();
    until("ours for gpu-8x gone", LONG, || async {
        let o = overlays(&c).await;
        (!o.contains_key("gpusharing-ts4-8gpu") && o.contains_key("gpusharing-ts4-1gpu"))
            .then_some(())
    })
    .await;
    let s = until("conflict reported", LONG, || async {
        let s = policy_status(&c, "ts4").await?;
        (!s["autoscaling"]["conflicts"].as_array()?.is_empty()).then_some(s)
    })
    .await;
    assert_eq!(
        s["autoscaling"]["conflicts"],
        json!([
            "NodeOverlay admin-8x (weight 50) sets nvidia.com/gpu on gpu-8x in NodePool shared: left to it"
        ])
    );

    // Deleting the policy removes its overlays; the admin's stays.
    Api::<GpuSharingPolicy>::all(c.clone())
        .delete("ts4", &DeleteParams::default())
        .await
        .unwrap();
    until("policy gone", LONG, || async {
        Api::<GpuSharingPolicy>::all(c.clone())
            .get_opt("ts4")
            .await
            .unwrap()
            .is_none()
            .then_some(())
    })
    .await;
    assert_eq!(
        overlays(&c).await.keys().collect::<Vec<_>>(),
        ["admin-8x"],
        "the policy's overlays are gone once its finalizer is"
    );
    overlay_api(&c)
        .delete("admin-8x", &DeleteParams::default())
        .await
        .unwrap();

    // VM hosts and a NodePool that pins the provider's GPU count.
    testkit::apply_yaml(
        &c,
        &pool_yaml(
            "vms",
            "vm",
            "node.kubernetes.io/instance-type",
            "p4de.24xlarge",
        ),
    )
    .await
    .unwrap();
    testkit::apply_yaml(
        &c,
        &pool_yaml(
            "by-count",
            "ts2",
            "karpenter.k8s.aws/instance-gpu-count",
            "2",
        ),
    )
    .await
    .unwrap();
    testkit::apply_yaml(&c, PASS).await.unwrap();
    testkit::apply_yaml(&c, TS2).await.unwrap();
    // Types of any name with 2 GPUs, by the provider's label.
    let o = until("the count overlay", LONG, || async {
        overlays(&c).await.remove("gpusharing-ts2-2gpu")
    })
    .await;
    assert_eq!(o["capacity"], json!({"nvidia.com/gpu": "4"}));
    assert_eq!(
        o["requirements"],
        json!([
            {"key": "karpenter.sh/nodepool", "operator": "In", "values": ["by-count"]},
            {"key": "karpenter.k8s.aws/instance-gpu-count", "operator": "In", "values": ["2"]},
        ])
    );
    // Passthrough: the sandbox device plugin's name for an A100 is not known before a
    // passthrough host of the type runs.
    let s = until("passthrough status", LONG, || async {
        policy_status(&c, "pass")
            .await
            .filter(|s| s.get("autoscaling").is_some())
    })
    .await;
    let vms = s["autoscaling"]["nodePools"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["name"] == "vms")
        .cloned()
        .unwrap();
    assert_eq!(vms["matched"], false, "{vms}");
    assert!(
        vms["reason"]
            .as_str()
            .unwrap()
            .contains("p4de.24xlarge: the sandbox device plugin's name for its GPUs is unknown"),
        "{vms}"
    );
    // One A100 host of the type goes passthrough; the simulator names its GPUs from NVIDIA's
    // pci.ids as the sandbox device plugin does, and the overlay learns that name.
    label_node(&c, "a100-node-1", "gpusharing.io/profile", Some("vm")).await;
    let o = until("the passthrough overlay", LONG, || async {
        overlays(&c).await.remove("gpusharing-pass-8gpu")
    })
    .await;
    let host = allocatable(&c, "a100-node-1").await;
    assert_eq!(
        host.get("nvidia.com/GA100_A100_SXM4_80GB")
            .map(String::as_str),
        Some("8"),
        "{host:?}"
    );
    assert_eq!(
        o["capacity"],
        json!({"nvidia.com/gpu": "0", "nvidia.com/GA100_A100_SXM4_80GB": "8"})
    );
    assert_eq!(
        o["requirements"][1],
        json!({"key": "node.kubernetes.io/instance-type", "operator": "In", "values": ["p4de.24xlarge"]})
    );
    op.stop().await;
}

const PASS: &str = "apiVersion: gpusharing.io/v1alpha1\nkind: GpuSharingPolicy\nmetadata: {name: pass}\nspec:\n  nodeSelector: {matchLabels: {gpusharing.io/profile: vm}}\n  strategy: passthrough\n";
const TS2: &str = "apiVersion: gpusharing.io/v1alpha1\nkind: GpuSharingPolicy\nmetadata: {name: ts2}\nspec:\n  nodeSelector: {matchLabels: {gpusharing.io/profile: ts2}}\n  strategy: timeSlicing\n  timeSlicing: {replicas: 2}\n";

/// A NodePool whose template carries `gpusharing.io/profile: <profile>` and which requires
/// `key In [value]`.
fn pool_yaml(name: &str, profile: &str, key: &str, value: &str) -> String {
    format!(
        "apiVersion: karpenter.sh/v1\nkind: NodePool\nmetadata: {{name: {name}}}\nspec:\n  template:\n    metadata: {{labels: {{gpusharing.io/profile: {profile}}}}}\n    spec:\n      nodeClassRef: {{group: karpenter.kwok.sh, kind: KWOKNodeClass, name: default}}\n      expireAfter: Never\n      requirements:\n      - {{key: {key}, operator: In, values: [\"{value}\"]}}\n"
    )
}

/// Karpenter v1.8.0 itself (its kwok provider, `tests/karpenter`) as a child process: dies with
/// the test (its stdin is our pipe).
struct Karpenter {
    child: std::process::Child,
    log: std::path::PathBuf,
}

impl Karpenter {
    /// The last lines of Karpenter's log, for a failure message.
    fn log_tail(&self) -> String {
        let log = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = log.lines().collect();
        lines[lines.len().saturating_sub(40)..].join("\n")
    }
}

impl Drop for Karpenter {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The kwok provider's instance types: a 1-GPU and an 8-GPU L4 type, and an 8-GPU A100 type,
/// about the same price per GPU (price alone never explains a choice).
fn kwok_instance_types() -> Value {
    let offering = |price: f64| {
        json!([{"Price": price, "Available": true, "Requirements": [
            {"key": "topology.kubernetes.io/zone", "operator": "In", "values": ["zone-a"]},
            {"key": "karpenter.sh/capacity-type", "operator": "In", "values": ["on-demand"]},
        ]}])
    };
    let t = |name: &str, cpu: &str, memory: &str, gpus: &str, price: f64| {
        json!({"name": name, "architecture": "amd64", "operatingSystems": ["linux"],
            "resources": {"cpu": cpu, "memory": memory, "ephemeral-storage": "500Gi", "pods": "110", "nvidia.com/gpu": gpus},
            "offerings": offering(price)})
    };
    json!([
        t("gpu-1x", "8", "64Gi", "1", 1.2),
        t("gpu-8x", "96", "1024Gi", "8", 9.6),
        t("a100-8x", "96", "1152Gi", "8", 32.0),
    ])
}

/// The same types as the GPUs GPU Feature Discovery will find on them: the operator's table
/// and the node simulator's hardware for the nodes Karpenter creates.
const GPU_TABLE: &str = "gpu-1x: {gpus: 1, product: NVIDIA-L4, memoryMiB: 23034}\ngpu-8x: {gpus: 8, product: NVIDIA-L4, memoryMiB: 23034}\na100-8x: {gpus: 8, product: NVIDIA-A100-SXM4-80GB, memoryMiB: 81920, migCapable: true}\n";

/// Starts Karpenter and waits (up to [`LONG`]) until its readiness probe answers 200, so a
/// slow start on a busy machine is not mistaken for Karpenter ignoring a pod.
async fn start_karpenter(dir: &std::path::Path, cluster: &testkit::TestCluster) -> Karpenter {
    let types = cluster.dir.path().join("kwok-instance-types.json");
    std::fs::write(&types, kwok_instance_types().to_string()).unwrap();
    let log_path = cluster.dir.path().join("karpenter.log");
    let log = std::fs::File::create(&log_path).unwrap();
    let health = free_port();
    let child = std::process::Command::new(dir.join("karpenter-kwok"))
        .env_clear()
        .env("KUBECONFIG", &cluster.kubeconfig)
        .env("INSTANCE_TYPES_FILE_PATH", &types)
        .env("FEATURE_GATES", "NodeOverlay=true")
        .env("DISABLE_LEADER_ELECTION", "true")
        .env("METRICS_PORT", free_port().to_string())
        .env("HEALTH_PROBE_PORT", health.to_string())
        .env("EXIT_ON_STDIN_EOF", "true")
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .stdin(std::process::Stdio::piped())
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .spawn()
        .expect("karpenter-kwok starts");
    let karpenter = Karpenter {
        child,
        log: log_path,
    };
    let ready = testkit::wait_for(LONG, || async { probe_ok(health, "/readyz") }).await;
    assert!(
        ready,
        "Karpenter never became ready:\n{}",
        karpenter.log_tail()
    );
    karpenter
}

/// Whether `GET path` on 127.0.0.1:`port` answers 200 (a bare HTTP/1.0 request: the probe
/// is plain HTTP and the test needs nothing more).
fn probe_ok(port: u16, path: &str) -> bool {
    use std::io::{Read, Write};
    let Ok(mut s) = std::net::TcpStream::connect(("127.0.0.1", port)) else {
        return false;
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
    if s.write_all(format!("GET {path} HTTP/1.0\r\n\r\n").as_bytes())
        .is_err()
    {
        return false;
    }
    let mut head = [0u8; 12];
    s.read_exact(&mut head).is_ok() && head.ends_with(b"200")
}

fn karpenter_api(c: &Client, version: &str, kind: &str, plural: &str) -> Api<DynamicObject> {
    let ar = ApiResource {
        group: "karpenter.sh".into(),
        version: version.into(),
        api_version: format!("karpenter.sh/{version}"),
        kind: kind.into(),
        plural: plural.into(),
    };
    Api::all_with(c.clone(), &ar)
}

/// NodeClaims: (name, instance type (or the compatible types while in flight), node name once
/// registered).
async fn node_claims(c: &Client) -> Vec<(String, String, String)> {
    karpenter_api(c, "v1", "NodeClaim", "nodeclaims")
        .list(&Default::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .map(|n| {
            // A launched claim carries its type as a label; one still in flight only the types
            // Karpenter found compatible, in its requirements.
            let t = n
                .metadata
                .labels
                .as_ref()
                .and_then(|l| l.get("node.kubernetes.io/instance-type"))
                .cloned()
                .or_else(|| requirement_values(&n.data, "node.kubernetes.io/instance-type"));
            let node = n.data["status"]["nodeName"]
                .as_str()
                .unwrap_or_default()
                .to_string();
            (
                n.metadata.name.unwrap_or_default(),
                t.unwrap_or_default(),
                node,
            )
        })
        .collect()
}

/// The values a NodeClaim's `In` requirement on `key` allows, sorted and joined by commas.
fn requirement_values(claim: &serde_json::Value, key: &str) -> Option<String> {
    let mut values: Vec<&str> = claim["spec"]["requirements"]
        .as_array()?
        .iter()
        .find(|r| r["key"] == key && r["operator"] == "In")?["values"]
        .as_array()?
        .iter()
        .filter_map(|v| v.as_str())
        .collect();
    values.sort_unstable();
    Some(values.join(","))
}

fn node_pool_for(name: &str, profile: &str, types: &[&str]) -> String {
    format!(
        "apiVersion: karpenter.sh/v1\nkind: NodePool\nmetadata: {{name: {name}}}\nspec:\n  template:\n    metadata: {{labels: {{gpusharing.io/profile: {profile}}}}}\n    spec:\n      nodeClassRef: {{group: karpenter.kwok.sh, kind: KWOKNodeClass, name: default}}\n      expireAfter: Never\n      requirements:\n      - {{key: node.kubernetes.io/instance-type, operator: In, values: {types:?}}}\n      - {{key: karpenter.sh/capacity-type, operator: In, values: [on-demand]}}\n  disruption: {{consolidationPolicy: WhenEmptyOrUnderutilized, consolidateAfter: 5s}}\n"
    )
}

fn gpu_pod(
    name: &str,
    profile: &str,
    resource: &str,
    count: u32,
) -> k8s_openapi::api::core::v1::Pod {
    serde_json::from_value(json!({
        "metadata": {"name": name, "namespace": "default"},
        "spec": {
            "nodeSelector": {"gpusharing.io/profile": profile},
            "containers": [{"name": "c", "image": "registry.k8s.io/pause:3.10",
                "resources": {"limits": {resource: count.to_string()}}}],
        },
    }))
    .unwrap()
}

/// A node's allocatable.
async fn allocatable(c: &Client, node: &str) -> BTreeMap<String, String> {
    let n = Api::<k8s_openapi::api::core::v1::Node>::all(c.clone())
        .get(node)
        .await
        .unwrap();
    n.status
        .and_then(|s| s.allocatable)
        .unwrap_or_default()
        .into_iter()
        .map(|(k, v)| (k, v.0))
        .collect()
}

/// Karpenter's own messages about a pod (its `FailedScheduling` / `Nominated` events).
async fn karpenter_events(c: &Client, pod: &str) -> Vec<String> {
    pod_events(c, pod, |e| {
        e.source.as_ref().and_then(|s| s.component.as_deref()) == Some("karpenter")
    })
    .await
}

async fn bound_node(c: &Client, pod: &str) -> Option<String> {
    let p = Api::<k8s_openapi::api::core::v1::Pod>::namespaced(c.clone(), "default")
        .get(pod)
        .await
        .ok()?;
    p.spec?.node_name
}

/// The loop of karpenter#729 closed with Karpenter itself: a pod asking for 16 time-sliced
/// `nvidia.com/gpu` fits no instance type until the operator's NodeOverlay says a time-sliced
/// 8-GPU type has 32; then Karpenter launches one 8-GPU node (not eight 1-GPU ones), the node
/// simulator plays its GPU Feature Discovery, kubelet and device plugin, the operator
/// configures it, and kube-scheduler binds the pod. The same for a MIG policy and a pod asking
/// for `nvidia.com/mig-1g.10gb`. Deleting the policies removes the overlays.
#[tokio::test]
async fn karpenter_launches_the_shared_instance_type_for_a_pod_it_could_not_place() {
    let dir = karpenter_dir();
    let table = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(table.path(), GPU_TABLE).unwrap();
    let (_g, cluster, _sim) = setup_with_simulator(
        testkit::ClusterOptions::default()
            .manifest(dir.join("crds"))
            .arg("--scheduler"),
        &[
            "--instance-types".into(),
            table.path().display().to_string(),
            "--dra-consumable-shares=4".into(),
        ],
    )
    .await;
    let c = cluster.client.clone();
    let karpenter = start_karpenter(&dir, &cluster).await;
    testkit::apply_yaml(
        &c,
        "apiVersion: karpenter.kwok.sh/v1alpha1\nkind: KWOKNodeClass\nmetadata: {name: default}\n",
    )
    .await
    .unwrap();
    testkit::apply_yaml(&c, &node_pool_for("ts4", "ts4", &["gpu-1x", "gpu-8x"]))
        .await
        .unwrap();
    testkit::apply_yaml(&c, &node_pool_for("mig", "mig", &["a100-8x"]))
        .await
        .unwrap();
    let pods = Api::<k8s_openapi::api::core::v1::Pod>::namespaced(c.clone(), "default");
    pods.create(
        &PostParams::default(),
        &gpu_pod("gpu16", "ts4", "nvidia.com/gpu", 16),
    )
    .await
    .unwrap();

    // Without the operator: Karpenter's own reason, and no NodeClaim.
    let events = testkit::poll(LONG, || async {
        let e = karpenter_events(&c, "gpu16").await;
        e.iter()
            .any(|m| m.starts_with("FailedScheduling"))
            .then_some(e)
    })
    .await
    .unwrap_or_else(|| {
        panic!(
            "no FailedScheduling from Karpenter in {LONG:?}; its log:\n{}",
            karpenter.log_tail()
        )
    });
    assert!(
        events
            .iter()
            .any(|m| m.contains("no instance type has enough resources")),
        "{events:?}"
    );
    assert!(node_claims(&c).await.is_empty());

    // The operator, its table and two policies: the overlays tell Karpenter.
    let cm: ConfigMap = serde_json::from_value(json!({
        "metadata": {"name": "gpu-sharing-instance-types", "namespace": NS},
        "data": {"instance-types.yaml": GPU_TABLE},
    }))
    .unwrap();
    Api::<ConfigMap>::namespaced(c.clone(), NS)
        .create(&PostParams::default(), &cm)
        .await
        .unwrap();
    let op = Operator::start(c.clone(), Some(NS));
    testkit::apply_yaml(&c, TS4).await.unwrap();
    testkit::apply_yaml(
        &c,
        "apiVersion: gpusharing.io/v1alpha1\nkind: GpuSharingPolicy\nmetadata: {name: mig}\nspec:\n  nodeSelector: {matchLabels: {gpusharing.io/profile: mig}}\n  strategy: mig\n  mig: {migStrategy: mixed, layout: all-1g.10gb}\n",
    )
    .await
    .unwrap();
    let o = until("overlays", LONG, || async {
        let o = overlays(&c).await;
        (o.contains_key("gpusharing-ts4-8gpu") && o.contains_key("gpusharing-mig-8gpu"))
            .then_some(o)
    })
    .await;
    assert_eq!(
        o["gpusharing-ts4-8gpu"]["capacity"],
        json!({"nvidia.com/gpu": "32"})
    );
    assert_eq!(
        o["gpusharing-mig-8gpu"]["capacity"],
        json!({"nvidia.com/gpu": "0", "nvidia.com/mig-1g.10gb": "56"})
    );

    // Only 8-GPU NodeClaims, never 1-GPU ones. Karpenter v1.8 counts a NodeClaim in flight by
    // its instance type without the overlay (8 GPUs) until the node advertises what the device
    // plugin says, so it may launch a few more 8-GPU nodes meanwhile; its consolidation removes
    // the empty ones. The pod is bound by kube-scheduler on a configured node, which stays.
    let node = until("gpu16 bound", Duration::from_secs(90), || {
        bound_node(&c, "gpu16")
    })
    .await;
    let launched = node_claims(&c).await;
    assert!(
        launched.iter().all(|(_, t, _)| t == "gpu-8x"),
        "{launched:?}"
    );
    assert_eq!(labels(&c, &node).await["gpusharing.io/profile"], "ts4");
    assert_eq!(
        allocatable(&c, &node)
            .await
            .get("nvidia.com/gpu")
            .map(String::as_str),
        Some("32")
    );
    let claims = until(
        "the empty ones consolidated",
        Duration::from_secs(90),
        || async {
            let n = node_claims(&c).await;
            (n.len() == 1).then_some(n)
        },
    )
    .await;
    assert_eq!(claims[0].2, node, "{claims:?}");
    eprintln!(
        "Karpenter launched {} gpu-8x NodeClaims for gpu16; one stayed, {} consolidated",
        launched.len(),
        launched.len() - 1
    );

    // MIG: a pod asking for a 1g.10gb instance gets an A100 node with the layout, bound there;
    // the time-sliced node with its pod is not consolidated away meanwhile.
    pods.create(
        &PostParams::default(),
        &gpu_pod("mig1g", "mig", "nvidia.com/mig-1g.10gb", 1),
    )
    .await
    .unwrap();
    let mig_node = until("mig1g bound", Duration::from_secs(120), || {
        bound_node(&c, "mig1g")
    })
    .await;
    assert_eq!(
        labels(&c, &mig_node).await["nvidia.com/mig.config"],
        "all-1g.10gb"
    );
    assert_eq!(
        allocatable(&c, &mig_node)
            .await
            .get("nvidia.com/mig-1g.10gb")
            .map(String::as_str),
        Some("56")
    );
    let claims = until(
        "the empty A100s consolidated",
        Duration::from_secs(90),
        || async {
            let n = node_claims(&c).await;
            (n.len() == 2).then_some(n)
        },
    )
    .await;
    assert!(
        claims
            .iter()
            .any(|(_, t, n)| t == "a100-8x" && *n == mig_node),
        "{claims:?}"
    );
    assert!(
        claims.iter().any(|(_, t, n)| t == "gpu-8x" && *n == node),
        "{claims:?}"
    );
    assert_eq!(
        bound_node(&c, "gpu16").await.as_deref(),
        Some(node.as_str())
    );

    // A pool served by the DRA driver through extended resources (karpenter#3228): its
    // overlay says 8 GPUs x 4 shares; the node Karpenter launches comes up on the device
    // plugin, so Karpenter initializes its NodeClaim; its first pod runs there through the
    // device plugin; once that pod is done the operator moves the node to the DRA driver, and
    // the next pod is served through a generated claim.
    testkit::apply_yaml(
        &c,
        &node_pool_for("dra", "dra4", &["gpu-8x"]).replace(
            "WhenEmptyOrUnderutilized, consolidateAfter: 5s",
            "WhenEmpty, consolidateAfter: Never",
        ),
    )
    .await
    .unwrap();
    testkit::apply_yaml(
        &c,
        "apiVersion: gpusharing.io/v1alpha1\nkind: GpuSharingPolicy\nmetadata: {name: dra4}\nspec:\n  nodeSelector: {matchLabels: {gpusharing.io/profile: dra4}}\n  strategy: timeSlicing\n  timeSlicing: {replicas: 4}\n  backend: dra\n  dra: {extendedResources: true, driverFeatureGates: {ConsumableShares: true}}\n",
    )
    .await
    .unwrap();
    let o = until("the DRA pool's overlay", LONG, || async {
        let o = overlays(&c).await;
        o.get("gpusharing-dra4-8gpu").cloned()
    })
    .await;
    assert_eq!(o["capacity"], json!({"nvidia.com/gpu": "32"}));
    let mut first = gpu_pod("dra-first", "dra4", "nvidia.com/gpu", 1);
    first.metadata.annotations = Some(
        [(
            "simulator.gpusharing.io/run-seconds".to_string(),
            "2".to_string(),
        )]
        .into(),
    );
    pods.create(&PostParams::default(), &first).await.unwrap();
    let dra_node = until("dra-first bound", Duration::from_secs(120), || {
        bound_node(&c, "dra-first")
    })
    .await;
    let first_bound = pods.get("dra-first").await.unwrap();
    assert!(
        first_bound
            .status
            .as_ref()
            .and_then(|s| s.extended_resource_claim_status.as_ref())
            .is_none(),
        "the first pod runs through the device plugin of the fresh node"
    );
    until(
        "moved to the DRA driver once initialized and idle",
        Duration::from_secs(90),
        || async {
            let l = labels(&c, &dra_node).await;
            let moved = l
                .get("nvidia.com/gpu.deploy.dra-driver")
                .map(String::as_str)
                == Some("true")
                && l.get("nvidia.com/gpu.deploy.device-plugin")
                    .map(String::as_str)
                    == Some("false");
            (moved && l.get("karpenter.sh/initialized").map(String::as_str) == Some("true"))
                .then_some(())
        },
    )
    .await;
    let st = policy_status(&c, "dra4").await.unwrap();
    assert!(
        st["autoscaling"]["launchedNodes"]
            .as_str()
            .unwrap()
            .contains("karpenter.sh/initialized=true"),
        "{st}"
    );
    pods.create(
        &PostParams::default(),
        &gpu_pod("dra-next", "dra4", "nvidia.com/gpu", 1),
    )
    .await
    .unwrap();
    let next = until(
        "dra-next bound through DRA",
        Duration::from_secs(90),
        || async {
            let p = pods.get("dra-next").await.ok()?;
            let on = p.spec.as_ref()?.node_name.clone()?;
            p.status?.extended_resource_claim_status?;
            Some(on)
        },
    )
    .await;
    assert_eq!(next, dra_node);
    let claim = (karpenter_api(&c, "v1", "NodeClaim", "nodeclaims").list(&Default::default()))
        .await
        .unwrap()
        .items
        .into_iter()
        .find(|n| n.data["status"]["nodeName"] == dra_node.as_str())
        .expect("the NodeClaim of the moved node stays");
    let initialized = (claim.data["status"]["conditions"]
        .as_array()
        .unwrap()
        .iter())
    .find(|c| c["type"] == "Initialized")
    .cloned();
    assert_eq!(
        initialized.as_ref().map(|c| &c["status"]),
        Some(&json!("True")),
        "{initialized:?}"
    );
    pods.delete("dra-next", &DeleteParams::default().grace_period(0))
        .await
        .unwrap();

    // Deleting the policies removes their overlays.
    for name in ["ts4", "mig", "dra4"] {
        Api::<GpuSharingPolicy>::all(c.clone())
            .delete(name, &DeleteParams::default())
            .await
            .unwrap();
    }
    until("overlays removed", LONG, || async {
        overlays(&c).await.is_empty().then_some(())
    })
    .await;
    op.stop().await;
}
