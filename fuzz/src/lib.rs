//! The fuzz checks (issue 16, part 3), shared by the cargo-fuzz targets in `fuzz/fuzz_targets/`
//! and by their replay on stable Rust in `make test` (`tests/fuzz_corpus.rs` includes this file).
//!
//! Three targets, each of which must never panic or hang:
//! - [`policy_yaml`]: arbitrary bytes as a policy file, read, validated and rendered as
//!   `gpu-sharing-operator render -f` does;
//! - [`render_mutated`]: the examples (and the conformance nodes) with arbitrary edits at
//!   arbitrary places of their documents, rendered with and without nodes: near-valid input,
//!   where the interesting refusals are;
//! - [`plan_labels`]: the planner over arbitrary label sets (NVIDIA's, ours, the selectors') on
//!   nodes, with every example policy applied at once, planned and converged.
//!
//! Every input is either rendered or refused. A refusal must name the policy and the field (or
//! be a YAML syntax error, which names the line); a rendering must parse, every node label we
//! write must name a config key or MIG layout the rendering holds, and no node may get MPS or
//! whole-GPU sharing together with an enabled MIG layout. Whether NVIDIA's own parsers accept
//! what was rendered is checked by the conformance suite on the cases written by
//! [`write_cases`] (Go cannot run inside the fuzz loop).

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use arbitrary::Arbitrary;
use gpu_sharing_operator::api::names::{
    DEVICE_PLUGIN_CONFIGMAP, LABEL_DEVICE_PLUGIN_CONFIG, LABEL_MIG_CONFIG,
};
use gpu_sharing_operator::nvidia::{self, DEFAULT_KEY, MIG_DISABLED_LAYOUT};
use gpu_sharing_operator::offline::render::{self, RenderError, RenderOptions};
use gpu_sharing_operator::plan::{self, NodeFacts, Plan, PlanInput};

/// The examples, by file name.
pub const EXAMPLES: &[(&str, &str)] = &[
    ("dra-mps.yaml", include_str!("../../examples/dra-mps.yaml")),
    (
        "exclusive.yaml",
        include_str!("../../examples/exclusive.yaml"),
    ),
    (
        "mig-1g10gb-time-sliced.yaml",
        include_str!("../../examples/mig-1g10gb-time-sliced.yaml"),
    ),
    (
        "mig-custom-split.yaml",
        include_str!("../../examples/mig-custom-split.yaml"),
    ),
    (
        "mps-h200.yaml",
        include_str!("../../examples/mps-h200.yaml"),
    ),
    (
        "passthrough.yaml",
        include_str!("../../examples/passthrough.yaml"),
    ),
    (
        "time-slicing-l4.yaml",
        include_str!("../../examples/time-slicing-l4.yaml"),
    ),
    (
        "vgpu-vdi.yaml",
        include_str!("../../examples/vgpu-vdi.yaml"),
    ),
];

/// Nodes every example selects some of (the conformance suite's).
pub const NODES: &str = include_str!("../../tests/nvidia/testdata/nodes.yaml");

/// Inputs longer than this are skipped (they only slow the fuzzer down).
const MAX_INPUT: usize = 16 << 10;

/// What happened to one input.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Rendered, and the rendering passed the checks.
    Rendered,
    /// Refused with errors naming the policy and field (or the YAML line).
    Refused,
    /// Not an input of this target (not UTF-8, too long, no policy in it).
    Skipped,
}

/// NVIDIA's default mig-parted layouts, parsed once (parsing them is most of an input's time).
fn default_layouts() -> &'static BTreeMap<String, serde_json::Value> {
    static D: std::sync::OnceLock<BTreeMap<String, serde_json::Value>> = std::sync::OnceLock::new();
    D.get_or_init(nvidia::default_mig_configs)
}

fn options() -> RenderOptions {
    RenderOptions {
        namespace: "gpu-operator".into(),
        base_mig_configs: default_layouts().clone(),
        single_pass: false,
        karpenter: None,
    }
}

/// A refusal must say what is wrong and where.
fn assert_names_field(e: &RenderError, input: &str) {
    let text = e.to_string();
    let ok = match e {
        RenderError::Yaml { .. } => text.contains("invalid YAML"),
        RenderError::Policy { name, error } => {
            !name.is_empty()
                && !error.path.trim_matches('.').is_empty()
                && !error.message.trim().is_empty()
        }
        RenderError::Cel { message, .. } => message.contains("spec"),
        RenderError::Input { message, .. } => !message.trim().is_empty(),
        RenderError::Io { .. } => false,
    };
    assert!(
        ok,
        "a refusal that names no field: {text:?} ({e:?})\ninput:\n{input}"
    );
}

/// Target `policy_yaml`: bytes as a policy file.
pub fn policy_yaml(data: &[u8]) -> Verdict {
    match std::str::from_utf8(data) {
        Ok(text) if text.len() <= MAX_INPUT => check_render(text, None),
        _ => Verdict::Skipped,
    }
}

/// Reads, validates and renders `policies` (with `nodes`, converged), and checks the result.
pub fn check_render(policies: &str, nodes: Option<&str>) -> Verdict {
    let policies_text = policies;
    let policies = match render::policies_from_text(policies, Path::new("policies.yaml")) {
        Ok(p) => p,
        Err(errs) => {
            assert!(!errs.is_empty());
            for e in &errs {
                assert_names_field(e, policies_text);
            }
            return Verdict::Refused;
        }
    };
    if policies.is_empty() {
        return Verdict::Skipped;
    }
    let nodes = match nodes.map(|n| render::nodes_from_text(n, Path::new("nodes.yaml"))) {
        None => None,
        Some(Ok(n)) => Some(n),
        Some(Err(e)) => {
            assert_names_field(&e, policies_text);
            return Verdict::Refused;
        }
    };
    let with_nodes = nodes.is_some();
    match render::render_text(policies, nodes, &options()) {
        Ok(r) => {
            check_output(&r.text, with_nodes, policies_text);
            Verdict::Rendered
        }
        Err(errs) => {
            for e in &errs {
                assert_names_field(e, policies_text);
            }
            Verdict::Refused
        }
    }
}

/// What the device plugin does with one config (read with our typed model of NVIDIA's format;
/// NVIDIA's own parser reads the same text in the conformance suite).
fn sharing(config: &str) -> (bool, bool) {
    let c: nvidia::DevicePluginConfig = gpu_sharing_operator::api::yaml::from_str(config)
        .unwrap_or_else(|e| {
            panic!("a rendered device-plugin config does not parse: {e}\n{config}")
        });
    let v = serde_json::to_value(&c).expect("serializable");
    let mps = v["sharing"]["mps"].is_object();
    let whole_gpu = v["flags"]["migStrategy"].as_str().unwrap_or("none") == "none"
        && (mps || v["sharing"]["timeSlicing"].is_object());
    (mps, whole_gpu)
}

/// The checks of one rendering.
fn check_output(text: &str, with_nodes: bool, input: &str) {
    let docs: Vec<serde_json::Value> = gpu_sharing_operator::api::yaml::documents(text)
        .unwrap_or_else(|e| panic!("render's output does not parse: {e}\n{text}"));
    let device: BTreeMap<String, String> = docs
        .iter()
        .find(|d| d["kind"] == "ConfigMap" && d["metadata"]["name"] == DEVICE_PLUGIN_CONFIGMAP)
        .map(|d| serde_json::from_value(d["data"].clone()).expect("string data"))
        .unwrap_or_default();
    let configs: BTreeMap<&str, (bool, bool)> = device
        .iter()
        .map(|(k, v)| (k.as_str(), sharing(v)))
        .collect();
    let mut layouts: BTreeSet<String> = default_layouts().keys().cloned().collect();
    if let Some(m) = docs
        .iter()
        .find(|d| d["kind"] == "ConfigMap" && d["data"][nvidia::MIG_PARTED_KEY].is_string())
    {
        let text = m["data"][nvidia::MIG_PARTED_KEY]
            .as_str()
            .unwrap_or_default();
        layouts.extend(
            nvidia::parse_mig_configs(text)
                .unwrap_or_else(|e| panic!("the rendered mig-parted config does not parse: {e}"))
                .into_keys(),
        );
    }
    if !with_nodes {
        return;
    }
    for n in docs.iter().filter(|d| d["kind"] == "Node") {
        let name = &n["metadata"]["name"];
        let labels = &n["metadata"]["labels"];
        let config = labels[LABEL_DEVICE_PLUGIN_CONFIG].as_str();
        let layout = labels[LABEL_MIG_CONFIG].as_str();
        let (mps, whole_gpu) = match config {
            None | Some(DEFAULT_KEY) => (false, false),
            Some(k) => *configs.get(k).unwrap_or_else(|| {
                panic!("node {name} labelled with config key {k:?}, which the rendering lacks\ninput:\n{input}")
            }),
        };
        if let Some(l) = layout {
            assert!(
                layouts.contains(l),
                "node {name} labelled with MIG layout {l:?}, which exists nowhere\ninput:\n{input}"
            );
            assert!(
                l == MIG_DISABLED_LAYOUT || !(mps || whole_gpu),
                "node {name}: MIG layout {l:?} with MPS or whole-GPU sharing\ninput:\n{input}"
            );
        }
    }
}

/// A value an edit writes.
#[derive(Arbitrary, Debug, Clone)]
pub enum Value {
    Int(u8),
    Str(u8),
    Bool(bool),
    Null,
    EmptyList,
    EmptyMap,
    /// A copy of another place of the same document (a path, as in [`Edit`]).
    Copy(Vec<u8>),
}

/// One edit: walk `path` from the root of document `doc` (each byte picks a key of an object,
/// an element of a list, or at the last step of a write may name a new key), then write or
/// remove.
#[derive(Arbitrary, Debug, Clone)]
pub struct Edit {
    pub doc: u8,
    pub path: Vec<u8>,
    pub value: Option<Value>,
}

/// Target `render_mutated`: examples with edits, optionally with the conformance nodes (also
/// edited).
#[derive(Arbitrary, Debug, Clone)]
pub struct Mutated {
    pub examples: Vec<u8>,
    pub edits: Vec<Edit>,
    pub nodes: Option<Vec<NodeEdit>>,
}

/// One label of one node set (or removed, without a value).
#[derive(Arbitrary, Debug, Clone)]
pub struct NodeEdit {
    pub node: u8,
    pub key: u8,
    pub value: Option<u8>,
}

const INTS: &[i64] = &[
    -1,
    0,
    1,
    2,
    3,
    4,
    7,
    8,
    10,
    16,
    48,
    49,
    100,
    1024,
    81920,
    143771,
    i32::MAX as i64,
    i32::MAX as i64 + 1,
    i64::MIN,
];

const STRINGS: &[&str] = &[
    "",
    "1",
    "0",
    "-1",
    "10%",
    "0%",
    "150%",
    "exclusive",
    "timeSlicing",
    "mps",
    "mig",
    "vgpu",
    "passthrough",
    "devicePlugin",
    "dra",
    "single",
    "mixed",
    "none",
    "1g.10gb",
    "2g.20gb",
    "3g.40gb",
    "7g.80gb",
    "1g.18gb",
    "1g.5gb",
    "all-1g.10gb",
    "all-disabled",
    "all-balanced",
    "nvidia.com/gpu",
    "nvidia.com/gpu.shared",
    "gpu.nvidia.com",
    "NVIDIA-H200",
    "NVIDIA-A100-SXM4-80GB",
    "A100DX-40C",
    "L4-4Q",
    "Short",
    "Long",
    "gpusharing.io/profile",
    "In",
    "NotIn",
    "Exists",
    "-bad-name",
    "UPPER",
    "a.b/c",
    "replicas",
    "renameByDefault",
    "failRequestsGreaterThanOne",
    "name",
    "count",
    "devices",
    "all",
    "0,1",
    "default",
    "mig-shared",
    "mps-h200",
    "ts-l4",
    "l4-timeslicing",
    "vdi",
    "xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx",
];

/// Label keys node edits set: what selectors, the planner and NVIDIA's components read.
pub const LABEL_KEYS: &[&str] = &[
    "nvidia.com/gpu.product",
    "nvidia.com/gpu.count",
    "nvidia.com/gpu.memory",
    "nvidia.com/gpu.present",
    "nvidia.com/mig.capable",
    "nvidia.com/mig.config",
    "nvidia.com/mig.config.state",
    "nvidia.com/device-plugin.config",
    "nvidia.com/gpu.replicas",
    "nvidia.com/gpu.sharing-strategy",
    "nvidia.com/gfd.timestamp",
    "nvidia.com/gpu.workload.config",
    "nvidia.com/vgpu.config",
    "nvidia.com/vgpu.config.state",
    "nvidia.com/gpu.deploy.device-plugin",
    "nvidia.com/gpu.deploy.dra-driver",
    "nvidia.com/gpu.deploy.sandbox-device-plugin",
    "nvidia.com/gpu.compute.major",
    "gpusharing.io/profile",
    "gpusharing.io/policy",
    "kubernetes.io/hostname",
];

/// Values of those labels.
pub const LABEL_VALUES: &[&str] = &[
    "",
    "true",
    "false",
    "0",
    "1",
    "2",
    "8",
    "-3",
    "99999999999999999999",
    "success",
    "pending",
    "failed",
    "rebooting",
    "all-disabled",
    "all-1g.10gb",
    "all-balanced",
    "custom-mig-split-0123456789",
    "default",
    "mps-h200-0123456789",
    "NVIDIA-A100-SXM4-80GB",
    "NVIDIA-A100-SXM4-40GB",
    "NVIDIA-H200",
    "NVIDIA-L4",
    "NVIDIA-A10",
    "81920",
    "143771",
    "23034",
    "container",
    "vm-vgpu",
    "vm-passthrough",
    "A100DX-40C",
    "mig-shared",
    "mig-split",
    "mps-h200",
    "vdi",
    "passthrough",
    "time-sliced",
    "mps",
    "exclusive",
    "1764000000",
];

/// The documents of a YAML text (the examples and nodes parse; the test of this file says so).
fn docs_of(text: &str) -> Vec<serde_json::Value> {
    gpu_sharing_operator::api::yaml::documents::<serde_json::Value>(text)
        .expect("examples parse")
        .into_iter()
        .filter(|d| !d.is_null())
        .collect()
}

fn keys(m: &serde_json::Map<String, serde_json::Value>) -> Vec<String> {
    m.keys().cloned().collect()
}

/// The place `path` leads to from `root`; with `create`, the last step may add a key.
fn walk<'a>(
    root: &'a mut serde_json::Value,
    path: &[u8],
    create: bool,
) -> Option<(&'a mut serde_json::Value, String)> {
    let mut cur = root;
    let mut last = String::new();
    for (i, b) in path.iter().enumerate() {
        let final_step = i + 1 == path.len();
        let descend = cur.is_object() || cur.as_array().is_some_and(|a| !a.is_empty());
        if !descend {
            break;
        }
        cur = match cur {
            serde_json::Value::Object(m) => {
                let ks = keys(m);
                let key = if (create && final_step && *b >= 192) || ks.is_empty() {
                    STRINGS[*b as usize % STRINGS.len()].to_string()
                } else {
                    ks[*b as usize % ks.len()].clone()
                };
                last = key.clone();
                m.entry(key).or_insert(serde_json::Value::Null)
            }
            serde_json::Value::Array(a) => {
                let n = a.len();
                last = (*b as usize % n).to_string();
                &mut a[*b as usize % n]
            }
            _ => unreachable!("checked above"),
        };
    }
    Some((cur, last))
}

fn value(v: &Value, doc: &serde_json::Value) -> serde_json::Value {
    match v {
        Value::Int(i) => serde_json::json!(INTS[*i as usize % INTS.len()]),
        Value::Str(s) => serde_json::json!(STRINGS[*s as usize % STRINGS.len()]),
        Value::Bool(b) => serde_json::json!(b),
        Value::Null => serde_json::Value::Null,
        Value::EmptyList => serde_json::json!([]),
        Value::EmptyMap => serde_json::json!({}),
        Value::Copy(path) => {
            let mut d = doc.clone();
            walk(&mut d, path, false)
                .map(|(v, _)| v.clone())
                .unwrap_or_default()
        }
    }
}

/// Applies one edit to a document.
fn edit(doc: &mut serde_json::Value, e: &Edit) {
    if e.path.is_empty() {
        return;
    }
    match &e.value {
        Some(v) => {
            let new = value(v, doc);
            if let Some((place, _)) = walk(doc, &e.path[..e.path.len().min(8)], true) {
                *place = new;
            }
        }
        None => {
            // Remove: walk to the parent, drop the chosen key or element.
            let (parent, last) = e.path.split_at(e.path.len().min(8) - 1);
            if let Some((p, _)) = walk(doc, parent, false) {
                match p {
                    serde_json::Value::Object(m) if !m.is_empty() => {
                        let k = keys(m)[last[0] as usize % m.len()].clone();
                        m.remove(&k);
                    }
                    serde_json::Value::Array(a) if !a.is_empty() => {
                        let n = a.len();
                        a.remove(last[0] as usize % n);
                    }
                    _ => {}
                }
            }
        }
    }
}

/// The policy file and (optional) nodes file of a [`Mutated`] case.
pub fn mutated_files(case: &Mutated) -> (String, Option<String>) {
    let mut docs = Vec::new();
    let picks = if case.examples.is_empty() {
        vec![0]
    } else {
        case.examples.iter().take(3).copied().collect()
    };
    for p in picks {
        docs.extend(docs_of(EXAMPLES[p as usize % EXAMPLES.len()].1));
    }
    for e in case.edits.iter().take(12) {
        let n = docs.len();
        edit(&mut docs[e.doc as usize % n], e);
    }
    let policies = join(&docs);
    let nodes = case.nodes.as_ref().map(|edits| {
        let mut nodes = docs_of(NODES);
        for e in edits.iter().take(24) {
            let n = nodes.len();
            let labels = &mut nodes[e.node as usize % n]["metadata"]["labels"];
            let key = LABEL_KEYS[e.key as usize % LABEL_KEYS.len()];
            match (labels.as_object_mut(), e.value) {
                (Some(m), Some(v)) => {
                    m.insert(
                        key.into(),
                        LABEL_VALUES[v as usize % LABEL_VALUES.len()].into(),
                    );
                }
                (Some(m), None) => {
                    m.remove(key);
                }
                (None, _) => {}
            }
        }
        join(&nodes)
    });
    (policies, nodes)
}

/// Documents as one YAML file (JSON documents are YAML).
fn join(docs: &[serde_json::Value]) -> String {
    docs.iter()
        .map(|d| format!("---\n{}\n", serde_json::to_string_pretty(d).expect("json")))
        .collect()
}

/// Target `render_mutated`.
pub fn render_mutated(case: &Mutated) -> Verdict {
    let (policies, nodes) = mutated_files(case);
    check_render(&policies, nodes.as_deref())
}

/// One node of [`Labelled`]: label keys and values picked from the vocabularies, or raw.
#[derive(Arbitrary, Debug, Clone)]
pub struct ArbNode {
    pub labels: Vec<(u8, ArbLabel)>,
    /// `nvidia.com/gpu` allocatable, if any.
    pub allocatable: Option<u8>,
}

#[derive(Arbitrary, Debug, Clone)]
pub enum ArbLabel {
    Known(u8),
    Raw(String),
}

/// Target `plan_labels`: nodes with arbitrary labels under every example policy at once.
#[derive(Arbitrary, Debug, Clone)]
pub struct Labelled {
    pub nodes: Vec<ArbNode>,
}

fn example_policies() -> Vec<gpu_sharing_operator::api::crd::GpuSharingPolicy> {
    static P: std::sync::OnceLock<Vec<gpu_sharing_operator::api::crd::GpuSharingPolicy>> =
        std::sync::OnceLock::new();
    P.get_or_init(|| {
        let all: String = EXAMPLES
            .iter()
            .map(|(_, t)| format!("---\n{t}\n"))
            .collect();
        render::policies_from_text(&all, Path::new("examples"))
            .unwrap_or_else(|e| panic!("the examples are valid together: {e:?}"))
    })
    .clone()
}

/// The nodes of a [`Labelled`] case.
pub fn labelled_nodes(case: &Labelled) -> Vec<NodeFacts> {
    case.nodes
        .iter()
        .take(8)
        .enumerate()
        .map(|(i, n)| {
            let mut labels = BTreeMap::new();
            for (k, v) in n.labels.iter().take(24) {
                let key = LABEL_KEYS[*k as usize % LABEL_KEYS.len()];
                let value = match v {
                    ArbLabel::Known(v) => {
                        LABEL_VALUES[*v as usize % LABEL_VALUES.len()].to_string()
                    }
                    ArbLabel::Raw(s) => s.chars().take(70).collect(),
                };
                labels.insert(key.to_string(), value);
            }
            let mut allocatable = BTreeMap::new();
            if let Some(a) = n.allocatable {
                allocatable.insert("nvidia.com/gpu".to_string(), a.to_string());
            }
            NodeFacts {
                name: format!("node-{i}"),
                labels: labels.into(),
                allocatable: allocatable.into(),
                ..Default::default()
            }
        })
        .collect()
}

/// Every label value a plan writes names what exists.
fn check_plan(plan: &Plan, input: &PlanInput) {
    let mut layouts: BTreeSet<String> = default_layouts().keys().cloned().collect();
    if let Some(m) = &plan.mig_config {
        layouts.extend(
            nvidia::parse_mig_configs(m)
                .expect("the planned mig-parted config parses")
                .into_keys(),
        );
    }
    for (node, labels) in &plan.node_labels {
        if let Some(k) = labels.get(LABEL_DEVICE_PLUGIN_CONFIG) {
            assert!(
                k == DEFAULT_KEY || plan.device_config.contains_key(k),
                "node {node} gets config key {k:?}, which the plan's ConfigMap lacks\nnodes: {:#?}",
                input.nodes
            );
        }
        if let Some(l) = labels.get(LABEL_MIG_CONFIG) {
            assert!(
                layouts.contains(l),
                "node {node} gets MIG layout {l:?}, which exists nowhere\nnodes: {:#?}",
                input.nodes
            );
        }
    }
}

/// Target `plan_labels`: plan once, check; then converge (bounded), check.
pub fn plan_labels(case: &Labelled) -> Verdict {
    let nodes = labelled_nodes(case);
    if nodes.is_empty() {
        return Verdict::Skipped;
    }
    let mut input = PlanInput::new(example_policies(), nodes);
    input.cluster.base_mig_configs = Some(default_layouts().clone());
    input.cluster.sandbox.vgpu_manager_enabled = true;
    let first = plan::plan(&input);
    check_plan(&first, &input);
    let again = plan::plan(&input);
    assert_eq!(first, again, "planning is not deterministic");
    match gpu_sharing_operator::converge::converge(input) {
        Ok(c) => {
            check_plan(&c.plan, &c.input);
            Verdict::Rendered
        }
        // Nodes whose NVIDIA components never settle (a layout the MIG manager fails, a node
        // that is not a GPU node at all) may keep a plan waiting; that is bounded and named.
        Err(e) => {
            assert!(
                !e.nodes.is_empty(),
                "not converged without naming nodes: {e}"
            );
            Verdict::Refused
        }
    }
}

/// Writes the rendering cases of the corpora as files for the conformance suite
/// (`conformance --fuzz-cases DIR`): `<name>.yaml` policies and, with nodes,
/// `<name>.nodes.yaml`. Returns how many were written.
pub fn write_cases(
    dir: &Path,
    name: &str,
    policies: &str,
    nodes: Option<&str>,
) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    std::fs::write(dir.join(format!("{name}.yaml")), policies)?;
    if let Some(n) = nodes {
        std::fs::write(dir.join(format!("{name}.nodes.yaml")), n)?;
    }
    Ok(())
}
