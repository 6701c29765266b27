//! Golden tests: what we render for NVIDIA's documented sharing examples is, as NVIDIA's parser
//! reads it (unset fields take NVIDIA's defaults), field for field the documented config.

use std::collections::BTreeMap;
use std::process::Command;

use gpu_sharing_operator::api::crd::{GpuSharingPolicy, GpuSharingPolicySpec};
use gpu_sharing_operator::nvidia;
use gpu_sharing_operator::plan::{self, NodeFacts, PlanInput};
use pretty_assertions::assert_eq;
use serde::Deserialize;

/// The device-plugin config as NVIDIA's parser sees it: unset fields take their defaults.
#[derive(Deserialize, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
struct Normalized {
    version: String,
    #[serde(default)]
    flags: NormFlags,
    #[serde(default)]
    sharing: NormSharing,
}
#[derive(Deserialize, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
struct NormFlags {
    #[serde(default = "none")]
    mig_strategy: String,
}
impl Default for NormFlags {
    fn default() -> Self {
        NormFlags {
            mig_strategy: none(),
        }
    }
}
fn none() -> String {
    "none".into()
}
#[derive(Deserialize, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
struct NormSharing {
    time_slicing: Option<NormResources>,
    mps: Option<NormResources>,
}
#[derive(Deserialize, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
struct NormResources {
    #[serde(default)]
    rename_by_default: bool,
    #[serde(default)]
    fail_requests_greater_than_one: bool,
    resources: Vec<NormResource>,
}
#[derive(Deserialize, Debug, PartialEq)]
struct NormResource {
    name: String,
    replicas: i32,
    rename: Option<String>,
    devices: Option<Vec<String>>,
}

fn normalize(yaml: &str) -> Normalized {
    gpu_sharing_operator::api::yaml::from_str(yaml)
        .unwrap_or_else(|e| panic!("cannot parse {yaml}: {e}"))
}

fn policy(yaml: &str) -> GpuSharingPolicy {
    testkit::fixtures::policy_yaml(yaml)
}

fn rendered(p: &GpuSharingPolicy) -> String {
    let (errs, _) =
        gpu_sharing_operator::validate::validate(p.metadata.name.as_deref().unwrap(), &p.spec);
    assert!(errs.is_empty(), "{errs:?}");
    nvidia::to_yaml(&nvidia::device_plugin_config(&p.spec))
}

fn spec(yaml: &str) -> GpuSharingPolicySpec {
    policy(yaml).spec
}

// NVIDIA GPU Operator docs, "MPS": ConfigMap mps-config-all, key `any`.
const NVIDIA_MPS_ANY: &str = r#"
version: v1
sharing:
  mps:
    resources:
    - name: nvidia.com/gpu
      replicas: 4
"#;

// NVIDIA GPU Operator docs, "Time-Slicing GPUs": one config for all nodes, plus a
// per-node-type profile picked with the node label.
const NVIDIA_TS_ANY: &str = r#"
version: v1
flags:
  migStrategy: none
sharing:
  timeSlicing:
    renameByDefault: false
    failRequestsGreaterThanOne: true
    resources:
    - name: nvidia.com/gpu
      replicas: 4
"#;
const NVIDIA_TS_L4_HEAVY: &str = r#"
version: v1
flags:
  migStrategy: none
sharing:
  timeSlicing:
    failRequestsGreaterThanOne: true
    resources:
    - name: nvidia.com/gpu
      replicas: 8
"#;

// NVIDIA GPU Operator docs, "MIG support": a custom mig-parted config splitting 8 GPUs.
const NVIDIA_CUSTOM_MIG: &str = r#"
version: v1
mig-configs:
  custom-a100-mig-split:
  - devices: [0, 1, 2, 3]
    mig-enabled: true
    mig-devices:
      "1g.10gb": 3
      "2g.20gb": 2
  - devices: [4, 5, 6, 7]
    mig-enabled: false
"#;

// NVIDIA GPU Operator docs, time-slicing of MIG devices (mixed strategy, all-1g.10gb).
const NVIDIA_MIG_TS: &str = r#"
version: v1
flags:
  migStrategy: mixed
sharing:
  timeSlicing:
    resources:
    - name: nvidia.com/mig-1g.10gb
      replicas: 2
"#;

#[test]
fn mps_replicas_4_matches_nvidia_example() {
    let p = policy(include_str!("../examples/mps-h200.yaml"));
    assert_eq!(normalize(&rendered(&p)), normalize(NVIDIA_MPS_ANY));
}

#[test]
fn time_slicing_two_profiles_match_nvidia_example() {
    let text = include_str!("../examples/time-slicing-l4.yaml");
    let docs: Vec<GpuSharingPolicy> = gpu_sharing_operator::api::yaml::documents(text).unwrap();
    assert_eq!(docs.len(), 2);
    assert_eq!(normalize(&rendered(&docs[0])), normalize(NVIDIA_TS_ANY));
    assert_eq!(
        normalize(&rendered(&docs[1])),
        normalize(NVIDIA_TS_L4_HEAVY)
    );
}

#[test]
fn custom_mig_split_matches_nvidia_example() {
    let p = policy(include_str!("../examples/mig-custom-split.yaml"));
    let mig = p.spec.mig.as_ref().unwrap();
    let entries = nvidia::custom_layout_entries(mig);
    let name = nvidia::custom_layout_name("a100-mig-split", &entries);
    // Content-addressed: custom-<policy>-<8 hex of the layout's content>.
    let hash = name.strip_prefix("custom-a100-mig-split-").unwrap();
    assert!(
        hash.len() == 8 && hash.chars().all(|c| c.is_ascii_hexdigit()),
        "{name}"
    );
    let mut custom = BTreeMap::new();
    custom.insert(name.clone(), entries);
    let ours = nvidia::mig_parted_config(&BTreeMap::new(), &custom);
    let mut want: serde_json::Value = gpu_sharing_operator::api::yaml::from_str(
        &NVIDIA_CUSTOM_MIG.replace("custom-a100-mig-split", &name),
    )
    .unwrap();
    // We always add all-disabled: nodes leave MIG through it.
    want["mig-configs"]["all-disabled"] =
        gpu_sharing_operator::api::yaml::from_str("[{devices: all, mig-enabled: false}]").unwrap();
    assert_eq!(ours, want);
    // The device plugin side: mixed strategy, no sharing.
    let dp = normalize(&rendered(&p));
    assert_eq!(dp.flags.mig_strategy, "mixed");
    assert_eq!(dp.sharing, NormSharing::default());
}

#[test]
fn mig_1g10gb_time_sliced_matches_nvidia_example() {
    let s = spec(
        r#"
apiVersion: gpusharing.io/v1alpha1
kind: GpuSharingPolicy
metadata: {name: mig-ts}
spec:
  nodeSelector: {}
  strategy: mig
  mig:
    migStrategy: mixed
    layout: all-1g.10gb
    timeSlicing:
      replicas: 2
"#,
    );
    let yaml = nvidia::to_yaml(&nvidia::device_plugin_config(&s));
    assert_eq!(normalize(&yaml), normalize(NVIDIA_MIG_TS));
}

#[test]
fn exclusive_has_no_sharing_and_never_replicas_1() {
    let p = policy(include_str!("../examples/exclusive.yaml"));
    let yaml = rendered(&p);
    assert!(!yaml.contains("sharing"), "{yaml}");
    assert!(!yaml.contains("replicas"), "{yaml}");
    assert_eq!(normalize(&yaml), normalize("version: v1"));
}

#[test]
fn never_both_time_slicing_and_mps() {
    for f in [
        include_str!("../examples/mps-h200.yaml"),
        include_str!("../examples/mig-1g10gb-time-sliced.yaml"),
        include_str!("../examples/exclusive.yaml"),
    ] {
        let n = normalize(&rendered(&policy(f)));
        assert!(!(n.sharing.mps.is_some() && n.sharing.time_slicing.is_some()));
    }
}

fn h200_node() -> NodeFacts {
    let mut labels = BTreeMap::new();
    for (k, v) in [
        ("nvidia.com/gpu.product", "NVIDIA-H200"),
        ("nvidia.com/gpu.count", "8"),
        ("nvidia.com/gpu.memory", "143771"),
        ("nvidia.com/mig.capable", "false"),
    ] {
        labels.insert(k.to_string(), v.to_string());
    }
    NodeFacts {
        name: "h200-node-0".into(),
        labels: labels.into(),
        ..Default::default()
    }
}

#[test]
fn mps_capacity_on_h200() {
    let p = policy(include_str!("../examples/mps-h200.yaml"));
    let mut node = h200_node();
    // First plan: the node gets labelled.
    let first = plan::plan(&PlanInput::new(vec![p.clone()], vec![node.clone()]));
    let labels = &first.node_labels["h200-node-0"];
    let key = labels["nvidia.com/device-plugin.config"].clone();
    assert!(key.starts_with("h200-mps-"));
    assert!(
        first.device_config.contains_key(&key),
        "the key exists before a label points to it"
    );
    // Labelled, but the device plugin still advertises whole GPUs: not applied yet.
    node.labels.extend(labels.clone());
    node.allocatable = [("nvidia.com/gpu", "8")].into_iter().collect();
    let labelled = plan::plan(&PlanInput::new(vec![p.clone()], vec![node.clone()]));
    assert_eq!(labelled.statuses["h200-mps"].applied_nodes, 0);
    // Once the device plugin advertises 8 x 4 clients, the node is applied and the capacity is
    // computed.
    node.allocatable = [("nvidia.com/gpu", "32")].into_iter().collect();
    let second = plan::plan(&PlanInput::new(vec![p], vec![node]));
    let status = &second.statuses["h200-mps"];
    let cap = status.capacity.as_ref().unwrap();
    assert_eq!(cap.physical_gpus, 8);
    assert_eq!(cap.schedulable_replicas, 32);
    assert_eq!(cap.memory_per_client_mib, Some(35942));
    assert_eq!(cap.threads_per_client_percent, Some(25));
    assert!(cap.memory_isolation);
    assert_eq!(status.applied_nodes, 1);
    assert_eq!(status.nodes.as_deref(), Some("1/1"));
}

fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_gpu-sharing-operator"))
}

#[test]
fn render_works_on_every_example() {
    let mut n = 0;
    for entry in std::fs::read_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/examples")).unwrap() {
        let path = entry.unwrap().path();
        let out = bin().arg("render").arg("-f").arg(&path).output().unwrap();
        assert!(
            out.status.success(),
            "{}: {}",
            path.display(),
            String::from_utf8_lossy(&out.stderr)
        );
        let text = String::from_utf8(out.stdout).unwrap();
        let docs: Vec<serde_json::Value> =
            gpu_sharing_operator::api::yaml::documents(&text).unwrap();
        assert_eq!(docs[0]["kind"], "ConfigMap");
        assert_eq!(docs[0]["metadata"]["namespace"], "gpu-operator");
        let policies = docs
            .iter()
            .filter(|d| d["kind"] == "GpuSharingPolicy")
            .count();
        assert!(policies >= 1, "{}", path.display());
        // Every policy's key is in the ConfigMap; every DRA policy's templates are rendered;
        // a VM policy has a vGPU config (vgpu) or nothing to render (passthrough).
        for d in docs.iter().filter(|d| d["kind"] == "GpuSharingPolicy") {
            if let Some(key) = d["status"]["deviceConfigKey"].as_str() {
                assert!(docs[0]["data"][key].is_string(), "{key} missing");
            } else if let Some(c) = d["status"]["vgpuConfig"].as_str() {
                // Custom layouts live in our vGPU-devices ConfigMap, named ones in NVIDIA's.
                let ours = docs.iter().any(|x| {
                    x["metadata"]["name"] == "gpu-sharing-vgpu-devices-config"
                        && x["data"]["config.yaml"]
                            .as_str()
                            .is_some_and(|t| t.contains(c))
                });
                assert!(ours || !c.starts_with("custom-"), "{c} missing");
            } else if d["status"]["templates"].is_null() {
                assert!(
                    path.ends_with("passthrough.yaml"),
                    "{}: a policy renders nothing",
                    path.display()
                );
            } else {
                let templates = d["status"]["templates"]
                    .as_array()
                    .expect("a DRA policy lists its templates");
                for t in templates {
                    let (ns, name) = t.as_str().unwrap().split_once('/').unwrap();
                    assert!(docs.iter().any(|x| x["kind"] == "ResourceClaimTemplate"
                        && x["metadata"]["namespace"] == ns
                        && x["metadata"]["name"] == name));
                }
            }
        }
        n += 1;
    }
    assert!(n >= 5);
}

#[test]
fn render_with_nodes_labels_them() {
    let dir = tempfile::tempdir().unwrap();
    let nodes = dir.path().join("nodes.yaml");
    std::fs::write(
        &nodes,
        r#"
apiVersion: v1
kind: Node
metadata:
  name: h200-node-0
  labels:
    nvidia.com/gpu.product: NVIDIA-H200
    nvidia.com/gpu.count: "8"
    nvidia.com/gpu.memory: "143771"
---
apiVersion: v1
kind: Node
metadata:
  name: cpu-node
  labels: {}
"#,
    )
    .unwrap();
    let out = bin()
        .args(["render", "-f", "examples/mps-h200.yaml", "--nodes"])
        .arg(&nodes)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    let docs: Vec<serde_json::Value> = gpu_sharing_operator::api::yaml::documents(&text).unwrap();
    let node = docs
        .iter()
        .find(|d| d["kind"] == "Node" && d["metadata"]["name"] == "h200-node-0")
        .unwrap();
    let key = node["metadata"]["labels"]["nvidia.com/device-plugin.config"]
        .as_str()
        .unwrap();
    assert!(key.starts_with("h200-mps-"));
    let cpu = docs
        .iter()
        .find(|d| d["kind"] == "Node" && d["metadata"]["name"] == "cpu-node")
        .unwrap();
    assert_eq!(
        cpu["metadata"]["labels"].as_object().map(|m| m.len()),
        Some(0)
    );
}

fn render_error(policy_yaml: &str) -> String {
    let dir = tempfile::tempdir().unwrap();
    let f = dir.path().join("p.yaml");
    std::fs::write(&f, policy_yaml).unwrap();
    let out = bin().arg("render").arg("-f").arg(&f).output().unwrap();
    assert_eq!(
        out.status.code(),
        Some(1),
        "expected failure, got {}",
        String::from_utf8_lossy(&out.stdout)
    );
    assert!(
        out.stdout.is_empty(),
        "nothing is rendered for invalid input"
    );
    String::from_utf8(out.stderr).unwrap()
}

#[test]
fn broken_policies_give_clear_errors() {
    let cases = [
        (
            "spec: {nodeSelector: {}, strategy: timeSlicing, timeSlicing: {replicas: 1}}",
            "spec.timeSlicing.replicas: must be >= 2",
        ),
        (
            "spec: {nodeSelector: {}, strategy: mps, mps: {replicas: 49}}",
            "spec.mps.replicas: must be between 2 and 48",
        ),
        (
            "spec: {nodeSelector: {}, strategy: mps, mps: {replicas: 4}, mig: {migStrategy: single, layout: all-1g.10gb}}",
            "spec.mig: must not be set when strategy is mps (MPS cannot be combined with MIG)",
        ),
        (
            "spec: {nodeSelector: {}, strategy: timeSlicing, time-slicing: {replicas: 4}}",
            "spec.timeSlicing: required when strategy is timeSlicing",
        ),
        (
            "spec: {nodeSelector: {}, strategy: timeSlicing, time-slicing: {replicas: 4}}",
            "spec.time-slicing: unknown field",
        ),
        (
            "spec: {nodeSelector: {}, strategy: timeSlicing, timeSlicing: {resources: [{name: nvidia.com/gpu, replicas: 2}, {name: gpu, replicas: 3}]}}",
            "duplicate resource",
        ),
        (
            "spec: {nodeSelector: {}, strategy: timeSlicing, timeSlicing: {resources: [{name: nvidia.com/GPU_X, replicas: 2}]}}",
            "is not lower-case RFC 1123",
        ),
        (
            "spec: {nodeSelector: {}, strategy: mig, mig: {migStrategy: mixed, customLayout: [{migEnabled: true, migDevices: {4g.40gb: 1, 3g.40gb: 1, 1g.10gb: 1}}]}}",
            "the profiles need 8 GPU slices per GPU",
        ),
        (
            "spec: {nodeSelector: {}, strategy: mig, mig: {migStrategy: mixed, customLayout: [{migEnabled: false, migDevices: {1g.10gb: 1}}]}}",
            "must be empty when migEnabled is false",
        ),
        (
            "spec: {nodeSelector: {}, strategy: mig, mig: {migStrategy: mixed, customLayout: [{migEnabled: true, migDevices: {1g.10g: 1}}]}}",
            "not a MIG profile name",
        ),
        (
            "spec: {nodeSelector: {}, strategy: sometimes}",
            "unknown variant `sometimes`",
        ),
    ];
    for (spec, want) in cases {
        let yaml = format!(
            "apiVersion: gpusharing.io/v1alpha1\nkind: GpuSharingPolicy\nmetadata: {{name: broken}}\n{spec}\n"
        );
        let err = render_error(&yaml);
        assert!(err.contains("error: policy \"broken\""), "{err}");
        assert!(err.contains(want), "for {spec}\nwant {want:?}\ngot {err}");
    }
}

#[test]
fn crd_in_repo_is_current() {
    let out = bin().arg("crd").output().unwrap();
    assert!(out.status.success());
    let generated = String::from_utf8(out.stdout).unwrap();
    let committed = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/crds/gpusharingpolicies.gpusharing.io.yaml"
    ))
    .unwrap();
    assert!(
        generated == committed,
        "crds/ is stale: run `cargo run -- crd > crds/gpusharingpolicies.gpusharing.io.yaml`"
    );
}

#[test]
fn docs_crd_reference_is_current() {
    let page = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/docs/crd-reference.md"
    ))
    .unwrap();
    let start = page
        .find("<!-- crd-reference:start -->\n")
        .expect("start marker in docs/crd-reference.md")
        + "<!-- crd-reference:start -->\n".len();
    let end = page
        .find("<!-- crd-reference:end -->")
        .expect("end marker in docs/crd-reference.md");
    assert!(
        page[start..end] == gpu_sharing_operator::offline::docs::crd_reference(),
        "docs/crd-reference.md is stale: run `make generate` (it writes `gpu-sharing-operator crd --markdown` between the markers)"
    );
}

// NVIDIA's DRA driver quickstart, gpu-test-mps: two containers share one GPU through MPS with
// 50% of the threads and 10Gi of pinned memory each (in resource.k8s.io/v1 form: `exactly`).
const NVIDIA_DRA_MPS: &str = r#"
apiVersion: resource.k8s.io/v1
kind: ResourceClaimTemplate
metadata:
  namespace: gpu-test6
  name: single-gpu
spec:
  spec:
    devices:
      requests:
      - name: gpu
        exactly:
          deviceClassName: gpu.nvidia.com
      config:
      - requests: ["gpu"]
        opaque:
          driver: gpu.nvidia.com
          parameters:
            apiVersion: resource.nvidia.com/v1beta1
            kind: GpuConfig
            sharing:
              strategy: MPS
              mpsConfig:
                defaultActiveThreadPercentage: 50
                defaultPinnedDeviceMemoryLimit: 10Gi
"#;

#[test]
fn dra_mps_matches_nvidia_example() {
    let p = policy(include_str!("../examples/dra-mps.yaml"));
    let (errs, _) = gpu_sharing_operator::validate::validate("dra-mps", &p.spec);
    assert!(errs.is_empty(), "{errs:?}");
    let mut ours = gpu_sharing_operator::nvidia::dra::claim_template(
        "dra-mps",
        "gpu-test6",
        &p.spec,
        Some(81920),
    );
    let want: serde_json::Value =
        gpu_sharing_operator::api::yaml::from_str(NVIDIA_DRA_MPS).unwrap();
    assert_eq!(
        ours["metadata"]["labels"]["gpusharing.io/policy"],
        "dra-mps"
    );
    ours["metadata"].as_object_mut().unwrap().remove("labels");
    assert_eq!(ours, want);
}

#[test]
fn dra_defaults_follow_replicas_and_gates_are_enforced() {
    let mut p = policy(include_str!("../examples/dra-mps.yaml"));
    p.spec.mps.as_mut().unwrap().replicas = 4;
    p.spec.dra.as_mut().unwrap().mps = None;
    // H200: 143771 MiB / 4 = 35942 MiB, 100 / 4 = 25%.
    let cfg = gpu_sharing_operator::nvidia::dra::gpu_config(&p.spec, Some(143771)).unwrap();
    assert_eq!(
        cfg["sharing"]["mpsConfig"]["defaultActiveThreadPercentage"],
        25
    );
    assert_eq!(
        cfg["sharing"]["mpsConfig"]["defaultPinnedDeviceMemoryLimit"],
        "35942Mi"
    );
    let check = |spec: &gpu_sharing_operator::api::crd::GpuSharingPolicySpec| {
        gpu_sharing_operator::validate::validate("p", spec)
            .0
            .iter()
            .map(|e| e.to_string())
            .collect::<Vec<_>>()
            .join("\n")
    };
    let mut no_gate = p.spec.clone();
    no_gate
        .dra
        .as_mut()
        .unwrap()
        .driver_feature_gates
        .mps_support = false;
    assert!(check(&no_gate).contains("unless its MPSSupport feature gate is enabled"));
    let mut dyn_mig = p.spec.clone();
    dyn_mig
        .dra
        .as_mut()
        .unwrap()
        .driver_feature_gates
        .dynamic_mig = true;
    assert!(check(&dyn_mig).contains("MPSSupport cannot be enabled together with DynamicMIG"));
    let mut shares = p.spec.clone();
    shares
        .dra
        .as_mut()
        .unwrap()
        .driver_feature_gates
        .consumable_shares = true;
    assert!(check(&shares).contains("ConsumableShares"));
    // Time-slicing always carries its interval (an empty config crashes older drivers).
    let ts: GpuSharingPolicySpec = gpu_sharing_operator::api::yaml::from_str(
        "nodeSelector: {}\nstrategy: timeSlicing\ntimeSlicing: {replicas: 2}\nbackend: dra\ndra: {namespaces: [a], driverFeatureGates: {TimeSlicingSettings: true}}",
    )
    .unwrap();
    assert_eq!(check(&ts), "");
    let cfg = gpu_sharing_operator::nvidia::dra::gpu_config(&ts, None).unwrap();
    assert_eq!(
        cfg["sharing"],
        serde_json::json!({"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Default"}})
    );
}

/// Upgrades must not relabel nodes: the content-addressed names of every example are pinned.
/// A change here means every node of that policy gets a new label (device plugin restart, or a
/// MIG reconfiguration) when users upgrade the operator.
#[test]
fn example_keys_and_layout_names_are_stable() {
    let pinned: BTreeMap<&str, (Option<&str>, Option<&str>)> = [
        ("exclusive", (Some("exclusive-5fce4e99"), None)),
        (
            "a100-mig-shared",
            (Some("a100-mig-shared-d34d8b84"), Some("all-1g.10gb")),
        ),
        (
            "a100-mig-split",
            (
                Some("a100-mig-split-f2bcc930"),
                Some("custom-a100-mig-split-5a63f5d5"),
            ),
        ),
        ("h200-mps", (Some("h200-mps-fbf9fc0a"), None)),
        ("l4-time-slicing", (Some("l4-time-slicing-680dc74b"), None)),
        ("l4-heavy", (Some("l4-heavy-91b3d250"), None)),
        ("dra-mps", (None, None)),
        // VM strategies: no device-plugin key (their nodes run no container device plugin).
        ("vdi-l4", (None, None)),
        ("vgpu-a100-split", (None, None)),
        ("vm-passthrough", (None, None)),
    ]
    .into();
    let mut seen = BTreeMap::new();
    for entry in std::fs::read_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/examples")).unwrap() {
        let path = entry.unwrap().path();
        let policies = gpu_sharing_operator::offline::render::load_policies(&path).unwrap();
        let p = plan::plan(&PlanInput::new(policies, vec![]));
        for (name, s) in p.statuses {
            seen.insert(name, (s.device_config_key, s.mig_config));
        }
    }
    let seen: BTreeMap<&str, (Option<&str>, Option<&str>)> = seen
        .iter()
        .map(|(k, (a, b))| (k.as_str(), (a.as_deref(), b.as_deref())))
        .collect();
    assert_eq!(seen, pinned);
}

#[test]
fn render_previews_the_examples_with_no_extra_flags() {
    let out = bin()
        .args(["render", "-f", "examples/"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    // It says which mig-parted config it checked named layouts against.
    assert!(
        stderr.contains("embedded from GPU Operator")
            && stderr.contains("v0.0.0-20250917190837-d73a0086a6ba"),
        "{stderr}"
    );
    let text = String::from_utf8(out.stdout).unwrap();
    let docs: Vec<serde_json::Value> = gpu_sharing_operator::api::yaml::documents(&text).unwrap();
    let mig = docs
        .iter()
        .find(|d| {
            d["kind"] == "ConfigMap" && d["metadata"]["name"] == "gpu-sharing-mig-parted-config"
        })
        .expect("the custom layout example needs our mig-parted ConfigMap");
    let layouts = nvidia::parse_mig_configs(mig["data"]["config.yaml"].as_str().unwrap()).unwrap();
    // NVIDIA's named layouts are kept next to the custom one.
    let defaults = nvidia::default_mig_configs();
    for name in ["all-disabled", "all-1g.10gb", "all-balanced"] {
        assert_eq!(layouts.get(name), defaults.get(name), "{name}");
    }
    assert!(
        layouts
            .keys()
            .any(|k| k.starts_with("custom-a100-mig-split-")),
        "{layouts:?}"
    );
    assert_eq!(
        docs.iter()
            .filter(|d| d["kind"] == "GpuSharingPolicy")
            .count(),
        gpu_sharing_operator::offline::render::load_policies(std::path::Path::new(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/examples"
        )))
        .unwrap()
        .len()
    );
}

const PREVIEW_NODES: &str = r#"
apiVersion: v1
kind: NodeList
items:
- apiVersion: v1
  kind: Node
  metadata:
    name: h200-0
    labels:
      nvidia.com/gpu.product: NVIDIA-H200
      nvidia.com/gpu.count: "8"
      nvidia.com/gpu.memory: "143771"
      nvidia.com/mig.capable: "false"
      nvidia.com/gfd.timestamp: "1764750000"
- apiVersion: v1
  kind: Node
  metadata:
    name: a100-0
    labels:
      nvidia.com/gpu.product: NVIDIA-A100-SXM4-80GB
      nvidia.com/gpu.count: "8"
      nvidia.com/gpu.memory: "81920"
      nvidia.com/mig.capable: "true"
      nvidia.com/mig.config: all-disabled
      nvidia.com/mig.config.state: success
      gpusharing.io/profile: mig-shared
"#;

/// `render` of two examples on [`PREVIEW_NODES`]: (stdout documents, stderr).
fn preview(extra: &[&str]) -> (Vec<serde_json::Value>, String, String) {
    let dir = tempfile::tempdir().unwrap();
    let root = env!("CARGO_MANIFEST_DIR");
    for f in ["mps-h200.yaml", "mig-1g10gb-time-sliced.yaml"] {
        std::fs::copy(format!("{root}/examples/{f}"), dir.path().join(f)).unwrap();
    }
    let nodes = dir.path().join("nodes.yaml.txt");
    std::fs::write(&nodes, PREVIEW_NODES).unwrap();
    let out = bin()
        .arg("render")
        .arg("-f")
        .arg(dir.path())
        .arg("--nodes")
        .arg(&nodes)
        .args(extra)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(out.status.success(), "{stderr}");
    let text = String::from_utf8(out.stdout).unwrap();
    let docs = gpu_sharing_operator::api::yaml::documents(&text).unwrap();
    (docs, text, stderr)
}

fn status_of<'a>(docs: &'a [serde_json::Value], policy: &str) -> &'a serde_json::Value {
    &docs
        .iter()
        .find(|d| d["kind"] == "GpuSharingPolicy" && d["metadata"]["name"] == policy)
        .unwrap()["status"]
}

fn ready(status: &serde_json::Value) -> &str {
    status["conditions"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["type"] == "Ready")
        .unwrap()["status"]
        .as_str()
        .unwrap()
}

#[test]
fn render_with_nodes_shows_the_converged_capacity() {
    let (docs, text, stderr) = preview(&[]);
    // H200, MPS x4: 8 GPUs, 32 replicas, 143771/4 MiB and 25% of the threads per client.
    let mps = status_of(&docs, "h200-mps");
    assert_eq!(ready(mps), "True", "{mps}");
    assert_eq!(mps["capacity"]["physicalGpus"], 8);
    assert_eq!(mps["capacity"]["schedulableReplicas"], 32);
    assert_eq!(mps["capacity"]["memoryPerClientMib"], 35942);
    assert_eq!(mps["capacity"]["threadsPerClientPercent"], 25);
    // A100 80GB, all-1g.10gb time-sliced x2: 8 GPUs x 7 instances x 2.
    let mig = status_of(&docs, "a100-mig-shared");
    assert_eq!(ready(mig), "True", "{mig}");
    assert_eq!(mig["capacity"]["physicalGpus"], 8);
    assert_eq!(mig["capacity"]["schedulableReplicas"], 112);
    assert_eq!(mig["capacity"]["memoryIsolation"], false);
    // The node ends on the layout, its MIG state is NVIDIA's to report (no longer ours).
    let a100 = docs
        .iter()
        .find(|d| d["kind"] == "Node" && d["metadata"]["name"] == "a100-0")
        .unwrap();
    assert_eq!(
        a100["metadata"]["labels"]["nvidia.com/mig.config"],
        "all-1g.10gb"
    );
    assert!(
        a100["metadata"]["labels"]
            .get("nvidia.com/mig.config.state")
            .is_none()
    );
    // MIG takes longer than MPS: sharing off, layout confirmed, then the time-sliced config.
    let passes: usize = text
        .strip_prefix("# Converged after ")
        .and_then(|t| t.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no pass count: {text}"));
    assert!(passes >= 3, "{passes}");
    assert!(
        stderr.contains(&format!("converged after {passes} planning passes")),
        "{stderr}"
    );
}

#[test]
fn render_single_pass_shows_the_first_writes() {
    let (docs, text, _) = preview(&["--single-pass"]);
    assert!(!text.starts_with("# Converged"));
    let mps = status_of(&docs, "h200-mps");
    assert_eq!(ready(mps), "False", "{mps}");
    assert_eq!(mps["appliedNodes"], 0);
    // Before any node is applied the capacity still says what the strategy isolates: MIG
    // instances time-sliced x2 share their memory.
    let mig = status_of(&docs, "a100-mig-shared");
    assert_eq!(mig["appliedNodes"], 0, "{mig}");
    assert_eq!(mig["capacity"]["memoryIsolation"], false, "{mig}");
    assert_eq!(mps["capacity"]["memoryIsolation"], true, "{mps}");
    let a100 = docs
        .iter()
        .find(|d| d["kind"] == "Node" && d["metadata"]["name"] == "a100-0")
        .unwrap();
    // The first write: the layout and its pending state together.
    assert_eq!(
        a100["metadata"]["labels"]["nvidia.com/mig.config.state"],
        "pending"
    );
}

#[test]
fn every_condition_reason_is_in_the_crd_schema_and_documented() {
    let crd = serde_json::to_value(<GpuSharingPolicy as kube::CustomResourceExt>::crd()).unwrap();
    let conditions = &crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]
        ["properties"]["conditions"]["items"]["properties"];
    let reasons: Vec<&str> = conditions["reason"]["enum"]
        .as_array()
        .expect("reasons are an enum in the schema")
        .iter()
        .map(|r| r.as_str().unwrap())
        .filter(|r| *r != "Unknown")
        .collect();
    assert!(
        reasons.contains(&"HigherPriorityPolicy") && reasons.len() >= 20,
        "{reasons:?}"
    );
    let status = include_str!("../docs/status.md");
    for r in reasons {
        assert!(
            status.contains(&format!("`{r}`")),
            "reason {r} is not documented in docs/status.md"
        );
    }
}

/// The VM examples on an L4 node and an A100 80GB node that runs MIG: NVIDIA's vGPU-devices
/// format with the custom layout under its pinned content-addressed name beside NVIDIA's own
/// entries, sandbox workloads enabled, the nodes VM hosts with MIG disabled and no sharing, and
/// capacity in vGPUs.
#[test]
fn vm_examples_render_the_vgpu_device_managers_format() {
    let dir = tempfile::tempdir().unwrap();
    let nodes = dir.path().join("nodes.yaml");
    std::fs::write(
        &nodes,
        r#"
apiVersion: v1
kind: Node
metadata:
  name: l4-0
  labels: {nvidia.com/gpu.product: NVIDIA-L4, nvidia.com/gpu.count: "4", nvidia.com/gpu.memory: "23034", gpusharing.io/profile: vdi}
---
apiVersion: v1
kind: Node
metadata:
  name: a100-0
  labels:
    nvidia.com/gpu.product: NVIDIA-A100-SXM4-80GB
    nvidia.com/gpu.count: "8"
    nvidia.com/gpu.memory: "81920"
    nvidia.com/mig.capable: "true"
    nvidia.com/mig.config: all-1g.10gb
    nvidia.com/mig.config.state: success
    gpusharing.io/profile: vgpu-split
"#,
    )
    .unwrap();
    let out = bin()
        .args(["render", "-f", "examples/vgpu-vdi.yaml", "--nodes"])
        .arg(&nodes)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let docs: Vec<serde_json::Value> =
        gpu_sharing_operator::api::yaml::documents(&String::from_utf8(out.stdout).unwrap())
            .unwrap();
    let find = |kind: &str, name: &str| {
        docs.iter()
            .find(|d| d["kind"] == kind && d["metadata"]["name"] == name)
            .unwrap_or_else(|| panic!("no {kind} {name}"))
    };
    let cm = find("ConfigMap", "gpu-sharing-vgpu-devices-config");
    let cfg: serde_json::Value =
        gpu_sharing_operator::api::yaml::from_str(cm["data"]["config.yaml"].as_str().unwrap())
            .unwrap();
    assert_eq!(cfg["version"], "v1");
    let custom = &cfg["vgpu-configs"]["custom-vgpu-a100-split-5d75df2f"];
    assert_eq!(
        custom,
        &serde_json::json!([
            {"devices": [0, 1, 2, 3], "vgpu-devices": {"A100D-1-10C": 7}},
            {"devices": [4, 5, 6, 7], "vgpu-devices": {"A100D-3-40C": 2}},
        ])
    );
    assert_eq!(
        cfg["vgpu-configs"]["L4-6Q"],
        serde_json::json!([{"devices": "all", "vgpu-devices": {"L4-6Q": 4}}]),
        "NVIDIA's named entries are carried over unchanged"
    );
    let cp = find("ClusterPolicy", "cluster-policy");
    assert_eq!(
        cp["spec"]["sandboxWorkloads"],
        serde_json::json!({"enabled": true})
    );
    assert_eq!(
        cp["spec"]["vgpuDeviceManager"]["config"]["name"],
        "gpu-sharing-vgpu-devices-config"
    );
    let l4 = &find("Node", "l4-0")["metadata"]["labels"];
    assert_eq!(l4["nvidia.com/gpu.workload.config"], "vm-vgpu");
    assert_eq!(l4["nvidia.com/vgpu.config"], "L4-6Q");
    assert_eq!(l4["nvidia.com/device-plugin.config"], "default");
    let a100 = &find("Node", "a100-0")["metadata"]["labels"];
    assert_eq!(a100["nvidia.com/gpu.workload.config"], "vm-vgpu");
    assert_eq!(
        a100["nvidia.com/vgpu.config"],
        "custom-vgpu-a100-split-5d75df2f"
    );
    assert_eq!(
        a100["nvidia.com/mig.config"], "all-disabled",
        "MIG off before VMs"
    );
    let vdi = status_of(&docs, "vdi-l4");
    assert_eq!(ready(vdi), "True", "{vdi}");
    assert_eq!(
        vdi["capacity"]["schedulableReplicas"], 16,
        "4 GPUs x 4 L4-6Q"
    );
    assert_eq!(vdi["capacity"]["memoryPerClientMib"], 6144);
    let split = status_of(&docs, "vgpu-a100-split");
    assert_eq!(ready(split), "True", "{split}");
    assert_eq!(split["capacity"]["schedulableReplicas"], 4 * 7 + 4 * 2);
    assert_eq!(split["capacity"]["memoryPerClientMib"], 10240);
    assert_eq!(split["vgpuConfig"], "custom-vgpu-a100-split-5d75df2f");
}

/// `render --karpenter`: with a NodePool of L4 instance types (from the instance-type table) the
/// time-slicing example renders a NodeOverlay per GPU count, with GPUs x replicas, and the
/// policy's status says which NodePool matched.
#[test]
fn render_with_karpenter_shows_the_node_overlays() {
    let dir = tempfile::tempdir().unwrap();
    let karpenter = dir.path().join("karpenter.yaml");
    std::fs::write(
        &karpenter,
        r#"
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
    p5.48xlarge: {gpus: 8, product: NVIDIA-H100-80GB-HBM3, memoryMiB: 81559}
"#,
    )
    .unwrap();
    let out = bin()
        .args([
            "render",
            "-f",
            "examples/time-slicing-l4.yaml",
            "--karpenter",
        ])
        .arg(&karpenter)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    let docs: Vec<serde_json::Value> = gpu_sharing_operator::api::yaml::documents(&text).unwrap();
    let overlays: Vec<(&str, &serde_json::Value)> = docs
        .iter()
        .filter(|d| d["kind"] == "NodeOverlay")
        .map(|d| {
            (
                d["metadata"]["name"].as_str().unwrap(),
                &d["spec"]["capacity"],
            )
        })
        .collect();
    assert_eq!(
        overlays,
        [
            (
                "gpusharing-l4-time-slicing-1gpu",
                &serde_json::json!({"nvidia.com/gpu": "4"})
            ),
            (
                "gpusharing-l4-time-slicing-4gpu",
                &serde_json::json!({"nvidia.com/gpu": "16"})
            ),
        ]
    );
    let status = docs
        .iter()
        .find(|d| d["kind"] == "GpuSharingPolicy" && d["metadata"]["name"] == "l4-time-slicing")
        .unwrap();
    assert_eq!(
        status["status"]["autoscaling"]["nodePools"],
        serde_json::json!([{"name": "l4", "matched": true, "reason": "instance types g6.12xlarge, g6.xlarge"}])
    );
}
