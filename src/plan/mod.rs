//! The pure planner: policies + node facts -> the desired state of everything the operator owns.
//!
//! No I/O and no clock: the same input gives the same plan, and planning the state a plan
//! produces gives the same plan again (idempotence). The controller reads its caches into a
//! [`PlanInput`], calls [`plan`], and applies the difference.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use serde_json::json;

use crate::api::crd::{
    Backend, Capacity, Condition, GpuSharingPolicy, GpuSharingPolicySpec, GpuSharingPolicyStatus,
    Mig, MigStrategy, NodeDetail, Strategy,
};
use crate::api::names::*;
use crate::nvidia::mig::{self, MigProfile};
use crate::nvidia::{self, DEFAULT_KEY, MIG_DISABLED_LAYOUT};
use crate::validate;

/// Most per-node entries kept in a policy's status.
pub const MAX_NODE_DETAILS: usize = 50;

/// A node's labels: (key, value) pairs sorted by key, as shared strings. The node cache interns
/// them, so a key or value found on thousands of nodes (`nvidia.com/gpu.product=NVIDIA-H200`)
/// is stored once; a node costs two pointers per label.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct Labels(Box<[(Arc<str>, Arc<str>)]>);

impl Labels {
    /// From pairs in any order; a repeated key keeps its last value.
    pub fn from_pairs(mut pairs: Vec<(Arc<str>, Arc<str>)>) -> Self {
        pairs.reverse();
        pairs.sort_by(|a, b| a.0.cmp(&b.0));
        pairs.dedup_by(|a, b| a.0 == b.0);
        Labels(pairs.into_boxed_slice())
    }

    fn position(&self, key: &str) -> Result<usize, usize> {
        self.0.binary_search_by(|(k, _)| (**k).cmp(key))
    }

    pub fn get(&self, key: &str) -> Option<&str> {
        self.position(key).ok().map(|i| &*self.0[i].1)
    }

    pub fn contains_key(&self, key: &str) -> bool {
        self.position(key).is_ok()
    }

    pub fn iter(&self) -> impl Iterator<Item = (&str, &str)> {
        self.0.iter().map(|(k, v)| (&**k, &**v))
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Sets a label (rebuilds the pairs: for tests and small edits, not hot paths).
    pub fn insert(&mut self, key: impl Into<Arc<str>>, value: impl Into<Arc<str>>) {
        let (key, value) = (key.into(), value.into());
        let mut v = std::mem::take(&mut self.0).into_vec();
        match v.binary_search_by(|(k, _)| k.cmp(&key)) {
            Ok(i) => v[i].1 = value,
            Err(i) => v.insert(i, (key, value)),
        }
        self.0 = v.into_boxed_slice();
    }

    /// Removes a label, returning its value.
    pub fn remove(&mut self, key: &str) -> Option<Arc<str>> {
        let i = self.position(key).ok()?;
        let mut v = std::mem::take(&mut self.0).into_vec();
        let (_, value) = v.remove(i);
        self.0 = v.into_boxed_slice();
        Some(value)
    }
}

impl std::fmt::Debug for Labels {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_map().entries(self.iter()).finish()
    }
}

impl std::ops::Index<&str> for Labels {
    type Output = str;
    fn index(&self, key: &str) -> &str {
        self.get(key).unwrap_or_else(|| panic!("no label {key:?}"))
    }
}

impl<K: Into<Arc<str>>, V: Into<Arc<str>>> FromIterator<(K, V)> for Labels {
    fn from_iter<I: IntoIterator<Item = (K, V)>>(iter: I) -> Self {
        Labels::from_pairs(
            iter.into_iter()
                .map(|(k, v)| (k.into(), v.into()))
                .collect(),
        )
    }
}

impl<K: Into<Arc<str>>, V: Into<Arc<str>>> Extend<(K, V)> for Labels {
    fn extend<I: IntoIterator<Item = (K, V)>>(&mut self, iter: I) {
        let mut v = std::mem::take(&mut self.0).into_vec();
        v.extend(iter.into_iter().map(|(k, v)| (k.into(), v.into())));
        *self = Labels::from_pairs(v);
    }
}

impl From<BTreeMap<String, String>> for Labels {
    fn from(m: BTreeMap<String, String>) -> Self {
        m.into_iter().collect()
    }
}

/// Label lookup, for selectors over node labels and plain maps alike.
pub trait LabelLookup {
    fn label(&self, key: &str) -> Option<&str>;
}

impl LabelLookup for Labels {
    fn label(&self, key: &str) -> Option<&str> {
        self.get(key)
    }
}

impl LabelLookup for BTreeMap<String, String> {
    fn label(&self, key: &str) -> Option<&str> {
        self.get(key).map(String::as_str)
    }
}

/// What the planner knows of a node.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct NodeFacts {
    pub name: String,
    pub labels: Labels,
    /// Managed labels whose value this operator's field manager owns (from managedFields).
    pub owned: BTreeSet<String>,
    /// The node's annotations under our keys ([`MANAGED_ANNOTATIONS`]) only.
    pub annotations: Labels,
    /// Which of [`MANAGED_ANNOTATIONS`] this operator's field manager owns.
    pub owned_annotations: BTreeSet<String>,
}

/// Everything the planner reads.
#[derive(Debug, Clone, Default)]
pub struct PlanInput {
    pub policies: Vec<GpuSharingPolicy>,
    /// Shared with the controller's node cache: a pass copies no labels.
    pub nodes: Vec<Arc<NodeFacts>>,
    /// Pods that use GPUs, by node (for the idle-GPU wait before MIG changes).
    pub gpu_pods: BTreeMap<String, Vec<String>>,
    /// Current data of our device-plugin ConfigMap (to keep keys nodes still point to).
    pub current_device_config: BTreeMap<String, String>,
    /// Named mig-parted layouts available to nodes (from the GPU Operator's default config).
    /// `None` when unknown: then only custom layouts and `all-disabled` are known.
    pub base_mig_configs: Option<BTreeMap<String, serde_yaml::Value>>,
    /// Layouts of our own mig-parted ConfigMap as it is now (to keep layouts nodes still name,
    /// and to recognise a node's pre-upgrade `custom-<policy>` layout by its content).
    pub current_mig_configs: BTreeMap<String, serde_yaml::Value>,
    /// Unix time in seconds, recorded on nodes whose device-plugin config label changes (the
    /// planner reads no clock; the caller passes it).
    pub now: i64,
    /// Whether the GPU Operator's ClusterPolicy exists.
    pub cluster_policy_found: bool,
    /// Set when another actor keeps reverting our ClusterPolicy settings (e.g. a GitOps tool):
    /// a description of what was reverted and how often.
    pub cluster_policy_contested: Option<String>,
    /// Nodes whose `nvidia.com/mig.config.state` has said `pending` for longer than the MIG
    /// timeout (the MIG manager can exit early and never report).
    pub mig_stuck: BTreeSet<String>,
    /// Names of the ConfigMaps we own.
    pub device_configmap_name: String,
    pub mig_configmap_name: String,
}

impl PlanInput {
    pub fn new(policies: Vec<GpuSharingPolicy>, nodes: Vec<NodeFacts>) -> Self {
        PlanInput {
            policies,
            nodes: nodes.into_iter().map(Arc::new).collect(),
            gpu_pods: BTreeMap::new(),
            current_device_config: BTreeMap::new(),
            base_mig_configs: None,
            current_mig_configs: BTreeMap::new(),
            now: 0,
            cluster_policy_found: true,
            cluster_policy_contested: None,
            mig_stuck: BTreeSet::new(),
            device_configmap_name: DEVICE_PLUGIN_CONFIGMAP.into(),
            mig_configmap_name: MIG_PARTED_CONFIGMAP.into(),
        }
    }
}

/// The desired state.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Plan {
    /// Data of the device-plugin ConfigMap.
    pub device_config: BTreeMap<String, String>,
    /// `config.yaml` of the mig-parted ConfigMap, when one is needed.
    pub mig_config: Option<String>,
    /// The part of the ClusterPolicy `spec` we own (a merge patch / apply configuration).
    pub cluster_policy_spec: serde_json::Value,
    /// For every node: the managed labels we want to own, with their values. Nodes that need
    /// none of our labels map to an empty set.
    pub node_labels: BTreeMap<String, BTreeMap<String, String>>,
    /// For every node in `node_labels`: the annotations we want to own ([`MANAGED_ANNOTATIONS`]).
    pub node_annotations: BTreeMap<String, BTreeMap<String, String>>,
    /// Status of every policy, by name.
    pub statuses: BTreeMap<String, GpuSharingPolicyStatus>,
    /// ResourceClaimTemplates of DRA policies, by `namespace/name`.
    pub claim_templates: BTreeMap<String, serde_json::Value>,
}

/// One of the ConfigMaps we own, as the object we apply.
pub fn configmap(
    name: &str,
    namespace: &str,
    kind: &str,
    data: &BTreeMap<String, String>,
) -> serde_json::Value {
    json!({
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": {MANAGED_BY.0: MANAGED_BY.1, CONFIG_LABEL: kind},
        },
        "data": data,
    })
}

/// A policy after validation, with what it renders to.
struct Prepared<'a> {
    name: String,
    policy: &'a GpuSharingPolicy,
    spec: &'a GpuSharingPolicySpec,
    errors: Vec<String>,
    warnings: Vec<String>,
    key: Option<String>,
    config_text: Option<String>,
    layout: Option<String>,
    /// A custom layout: its mig-parted entries and their content hash.
    custom: Option<(Vec<nvidia::MigConfigEntry>, String)>,
}

/// Deterministic precedence: priority (high first), then oldest, then name.
fn precedence(p: &GpuSharingPolicy) -> (i32, bool, String, String) {
    let ts = p
        .metadata
        .creation_timestamp
        .as_ref()
        .map(|t| t.0.to_string());
    (
        -p.spec.priority,
        ts.is_none(),
        ts.unwrap_or_default(),
        p.metadata.name.clone().unwrap_or_default(),
    )
}

/// The labels selectors are matched against: the product without GFD's `-SHARED` suffix (and
/// without a `-MIG-...` suffix of the mixed strategy), so a policy selecting
/// `nvidia.com/gpu.product=NVIDIA-H200` keeps its nodes once they are shared.
pub fn selection_labels(labels: &Labels) -> SelectionLabels<'_> {
    let product = labels.get(LABEL_GPU_PRODUCT).map(|p| {
        let p = p.strip_suffix(SHARED_SUFFIX).unwrap_or(p);
        p.find("-MIG-").map_or(p, |i| &p[..i])
    });
    SelectionLabels { labels, product }
}

/// A node's labels as selectors see them (see [`selection_labels`]).
pub struct SelectionLabels<'a> {
    labels: &'a Labels,
    product: Option<&'a str>,
}

impl LabelLookup for SelectionLabels<'_> {
    fn label(&self, key: &str) -> Option<&str> {
        if key == LABEL_GPU_PRODUCT {
            self.product
        } else {
            self.labels.get(key)
        }
    }
}

/// Whether a label selector matches a label set.
pub fn selector_matches(sel: &LabelSelector, labels: &impl LabelLookup) -> bool {
    for (k, v) in sel.match_labels.iter().flatten() {
        if labels.label(k) != Some(v.as_str()) {
            return false;
        }
    }
    for e in sel.match_expressions.iter().flatten() {
        let vals = e.values.as_deref().unwrap_or_default();
        let cur = labels.label(&e.key);
        let ok = match e.operator.as_str() {
            "In" => cur.is_some_and(|c| vals.iter().any(|v| v == c)),
            "NotIn" => cur.is_none_or(|c| vals.iter().all(|v| v != c)),
            "Exists" => cur.is_some(),
            "DoesNotExist" => cur.is_none(),
            _ => false,
        };
        if !ok {
            return false;
        }
    }
    true
}

fn label_i64(n: &NodeFacts, key: &str) -> Option<i64> {
    n.labels.get(key).and_then(|v| v.parse().ok())
}

/// MIG-instance counts per GPU of a node under a MIG policy, when known.
fn mig_instances(
    mig: &Mig,
    base: Option<&BTreeMap<String, serde_yaml::Value>>,
    gpus: i64,
) -> Option<Vec<(MigProfile, i64)>> {
    let mut out = Vec::new();
    if let Some(groups) = &mig.custom_layout {
        for g in groups.iter().filter(|g| g.mig_enabled) {
            let n = g.devices.as_ref().map_or(gpus, |d| d.len() as i64);
            for (p, c) in &g.mig_devices {
                out.push((mig::parse_mig_profile(p)?, n * *c as i64));
            }
        }
        return Some(out);
    }
    // Named layout: only when it is a single "devices: all" entry we can read.
    let layout = mig.layout.as_deref()?;
    if layout == MIG_DISABLED_LAYOUT {
        return Some(out);
    }
    // Entries per GPU model (device-filter): usable when they all create the same devices on all
    // GPUs, as the `all-<profile>` layouts do.
    let entries = base?.get(layout)?.as_sequence()?;
    let first = entries.first()?;
    let same = entries.iter().all(|e| {
        e.get("mig-devices") == first.get("mig-devices")
            && e.get("devices").and_then(|d| d.as_str()) == Some("all")
    });
    if !same {
        return None;
    }
    let devs = first.get("mig-devices")?.as_mapping()?;
    for (p, c) in devs {
        out.push((mig::parse_mig_profile(p.as_str()?)?, gpus * c.as_i64()?));
    }
    Some(out)
}

/// Whether a MIG profile fits a GPU with `memory_mib`: its memory must be 1/8, 1/4, 1/2 or all
/// of the GPU's (within 6%), which is how NVIDIA sizes MIG memory slices on every MIG GPU.
pub fn profile_fits_memory(p: &MigProfile, memory_mib: i64) -> bool {
    let total_gb = memory_mib as f64 / 1024.0;
    [0.125, 0.25, 0.5, 1.0].iter().any(|f| {
        let expect = total_gb * f;
        (p.memory_gb as f64 - expect).abs() <= expect * 0.06 + 0.5
    })
}

/// Node-specific reasons a policy cannot be applied to a node.
fn node_rejection(spec: &GpuSharingPolicySpec, node: &NodeFacts) -> Option<String> {
    let product = node
        .labels
        .get(LABEL_GPU_PRODUCT)
        .map(|p| p.trim_end_matches(SHARED_SUFFIX).to_string())
        .unwrap_or_else(|| "unknown GPU".into());
    let multi_user = spec
        .dra
        .as_ref()
        .and_then(|d| d.mps.as_ref())
        .is_some_and(|m| m.multi_user);
    if multi_user && label_i64(node, LABEL_CC_MAJOR).is_some_and(|m| m < 7) {
        return Some(format!(
            "{product}: MPS multiUser needs a Volta or newer GPU (compute capability 7.0+)"
        ));
    }
    match spec.strategy {
        Strategy::Mps => {
            let replicas = spec.mps.as_ref()?.replicas;
            let major = label_i64(node, LABEL_CC_MAJOR);
            let minor = label_i64(node, LABEL_CC_MINOR).unwrap_or(0);
            if let Some(major) = major
                && (major, minor) < (7, 5)
                && replicas > mig::MPS_MAX_REPLICAS_OLD_GPUS
            {
                return Some(format!(
                    "{product} has compute capability {major}.{minor}: MPS allows at most {} clients below 7.5, policy asks {replicas}",
                    mig::MPS_MAX_REPLICAS_OLD_GPUS
                ));
            }
            None
        }
        Strategy::Mig => {
            let mig = spec.mig.as_ref()?;
            if node.labels.get(LABEL_MIG_CAPABLE) != Some("true") {
                return Some(format!(
                    "{product} does not support MIG (nvidia.com/mig.capable is not true)"
                ));
            }
            let gpus = label_i64(node, LABEL_GPU_COUNT);
            if let (Some(groups), Some(gpus)) = (&mig.custom_layout, gpus) {
                let mut covered = BTreeSet::new();
                for g in groups {
                    match &g.devices {
                        None => covered.extend(0..gpus as i32),
                        Some(d) => {
                            for i in d {
                                if *i as i64 >= gpus {
                                    return Some(format!(
                                        "GPU index {i} does not exist: the node has {gpus} GPUs"
                                    ));
                                }
                                covered.insert(*i);
                            }
                        }
                    }
                }
                let missing: Vec<String> = (0..gpus as i32)
                    .filter(|i| !covered.contains(i))
                    .map(|i| i.to_string())
                    .collect();
                if !missing.is_empty() {
                    return Some(format!(
                        "GPUs {} are in no device group of customLayout (mig-parted requires every GPU to be covered)",
                        missing.join(",")
                    ));
                }
            }
            if let Some(mem) = label_i64(node, LABEL_GPU_MEMORY) {
                for p in nvidia::layout_profiles(mig).unwrap_or_default() {
                    if let Some(prof) = mig::parse_mig_profile(&p)
                        && !profile_fits_memory(&prof, mem)
                    {
                        return Some(format!(
                            "MIG profile {p} does not exist on {product} ({mem} MiB per GPU): its memory must be 1/8, 1/4, 1/2 or all of the GPU's"
                        ));
                    }
                }
            }
            None
        }
        _ => None,
    }
}

fn condition(
    type_: &str,
    status: bool,
    reason: &str,
    message: String,
    generation: Option<i64>,
) -> Condition {
    Condition {
        type_: type_.into(),
        status: if status { "True" } else { "False" }.into(),
        reason: reason.into(),
        message,
        last_transition_time: None,
        observed_generation: generation,
    }
}

fn replicas_of(spec: &GpuSharingPolicySpec) -> i32 {
    let ts_replicas = |ts: &crate::api::crd::TimeSlicing| {
        ts.replicas
            .unwrap_or_else(|| ts.resources.iter().map(|r| r.replicas).max().unwrap_or(1))
    };
    match spec.strategy {
        Strategy::Exclusive => 1,
        Strategy::TimeSlicing => spec.time_slicing.as_ref().map_or(1, ts_replicas),
        Strategy::Mps => spec.mps.as_ref().map_or(1, |m| m.replicas),
        Strategy::Mig => spec
            .mig
            .as_ref()
            .and_then(|m| m.time_slicing.as_ref())
            .map_or(1, ts_replicas),
    }
}

/// Per-node capacity contribution: (physical, schedulable, memory per client, threads, isolated).
fn node_capacity(
    spec: &GpuSharingPolicySpec,
    node: &NodeFacts,
    base: Option<&BTreeMap<String, serde_yaml::Value>>,
) -> (i64, Option<i64>, Option<i64>, Option<i64>, bool) {
    let gpus = label_i64(node, LABEL_GPU_COUNT).unwrap_or(0);
    let mem = label_i64(node, LABEL_GPU_MEMORY);
    match spec.strategy {
        Strategy::Exclusive => (gpus, Some(gpus), mem, Some(100), true),
        Strategy::TimeSlicing => {
            let ts = spec.time_slicing.as_ref();
            let r = ts
                .and_then(|t| {
                    t.replicas.or_else(|| {
                        t.resources
                            .iter()
                            .find(|r| nvidia::qualify_resource(&r.name) == nvidia::GPU_RESOURCE)
                            .map(|r| r.replicas)
                    })
                })
                .unwrap_or(1) as i64;
            (gpus, Some(gpus * r), mem, None, false)
        }
        Strategy::Mps => {
            let r = spec.mps.as_ref().map_or(1, |m| m.replicas) as i64;
            let (threads, memory) = crate::nvidia::dra::mps_limits(spec, mem);
            (gpus, Some(gpus * r), memory, Some(threads), true)
        }
        Strategy::Mig => {
            let Some(mig) = spec.mig.as_ref() else {
                return (gpus, None, None, None, true);
            };
            let Some(instances) = mig_instances(mig, base, gpus) else {
                return (gpus, None, None, None, true);
            };
            let ts = mig.time_slicing.as_ref();
            let mut total = 0;
            let mut min_mem: Option<i64> = None;
            let mut min_threads: Option<i64> = None;
            for (p, n) in &instances {
                let res = match mig.mig_strategy {
                    MigStrategy::Single => nvidia::GPU_RESOURCE.to_string(),
                    MigStrategy::Mixed => nvidia::mig_resource(&profile_name(p)),
                };
                let r = ts
                    .map(|t| {
                        if t.resources.is_empty() {
                            t.replicas.unwrap_or(1)
                        } else {
                            t.resources
                                .iter()
                                .find(|x| nvidia::qualify_resource(&x.name) == res)
                                .map_or(1, |x| x.replicas)
                        }
                    })
                    .unwrap_or(1) as i64;
                total += n * r;
                let m = p.memory_gb as i64 * 1024;
                min_mem = Some(min_mem.map_or(m, |x| x.min(m)));
                let t =
                    (p.compute.unwrap_or(p.slices) as i64 * 100) / mig::MAX_COMPUTE_SLICES as i64;
                min_threads = Some(min_threads.map_or(t, |x| x.min(t)));
            }
            let isolated = ts.is_none();
            (gpus, Some(total), min_mem, min_threads, isolated)
        }
    }
}

fn profile_name(p: &MigProfile) -> String {
    match p.compute {
        Some(c) => format!("{c}c.{}g.{}gb", p.slices, p.memory_gb),
        None => format!("{}g.{}gb", p.slices, p.memory_gb),
    }
}

fn prepare<'a>(
    p: &'a GpuSharingPolicy,
    base: Option<&BTreeMap<String, serde_yaml::Value>>,
) -> Prepared<'a> {
    let name = p.metadata.name.clone().unwrap_or_default();
    let (errs, warnings) = validate::validate(&name, &p.spec);
    let mut errors: Vec<String> = errs.iter().map(|e| e.to_string()).collect();
    let mut layout = None;
    let mut custom = None;
    if errors.is_empty()
        && let Some(mig) = &p.spec.mig
    {
        if mig.custom_layout.is_some() {
            let entries = nvidia::custom_layout_entries(mig);
            let hash = nvidia::content_hash(&serde_json::to_value(&entries).expect("serializable"));
            layout = Some(nvidia::custom_layout_name(&name, &entries));
            custom = Some((entries, hash));
        } else if let Some(l) = &mig.layout {
            let known = l == MIG_DISABLED_LAYOUT || base.is_some_and(|b| b.contains_key(l));
            if base.is_some() && !known {
                errors.push(format!(
                    "spec.mig.layout: {l:?} is not a layout of the mig-parted configuration (the MIG manager would fail with: selected mig-config not present)"
                ));
            }
            layout = Some(l.clone());
        }
    }
    let (key, config_text) = if errors.is_empty() && p.spec.backend == Backend::Dra {
        // The DRA driver shares the GPUs; the device plugin, if it runs, must not.
        (Some(DEFAULT_KEY.to_string()), None)
    } else if errors.is_empty() {
        let text = nvidia::to_yaml(&nvidia::device_plugin_config(&p.spec));
        (Some(nvidia::content_key(&name, &text)), Some(text))
    } else {
        (None, None)
    };
    Prepared {
        name,
        policy: p,
        spec: &p.spec,
        errors,
        warnings,
        key,
        config_text,
        layout,
        custom,
    }
}

/// Why a MIG change waits on this node.
fn busy_msg(pods: &[String]) -> String {
    format!("WaitingForIdleGPUs: pods using GPUs: {}", pods.join(", "))
}

/// What a node should carry of ours: labels and annotations.
type NodeWrites = BTreeMap<String, (BTreeMap<String, String>, BTreeMap<String, String>)>;

/// Leaves a node exactly as it is (the labels and annotations we own keep their values, and the
/// keys they name stay in the ConfigMap), and records why.
fn hold_node(
    n: &NodeFacts,
    state: &str,
    message: String,
    node_labels: &mut NodeWrites,
    used_keys: &mut BTreeSet<String>,
    details: &mut Vec<NodeDetail>,
) {
    let held: BTreeMap<String, String> = n
        .owned
        .iter()
        .filter_map(|k| n.labels.get(k).map(|v| (k.clone(), v.to_string())))
        .collect();
    let held_annotations: BTreeMap<String, String> = n
        .owned_annotations
        .iter()
        .filter_map(|k| n.annotations.get(k).map(|v| (k.clone(), v.to_string())))
        .collect();
    used_keys.extend(held.values().cloned());
    node_labels.insert(n.name.clone(), (held, held_annotations));
    details.push(NodeDetail {
        name: n.name.clone(),
        state: state.into(),
        message,
    });
}

/// Computes the desired state.
pub fn plan(input: &PlanInput) -> Plan {
    let base = input.base_mig_configs.as_ref();
    let mut policies: Vec<&GpuSharingPolicy> = input
        .policies
        .iter()
        .filter(|p| p.metadata.deletion_timestamp.is_none())
        .collect();
    policies.sort_by_key(|p| precedence(p));
    let mut prepared: Vec<Prepared> = policies.iter().map(|p| prepare(p, base)).collect();
    // Two DRA policies cannot render the same ResourceClaimTemplate.
    let mut template_owner: BTreeMap<String, String> = BTreeMap::new();
    for p in prepared.iter_mut().filter(|p| p.errors.is_empty()) {
        let Some(dra) = &p.spec.dra else { continue };
        let name = crate::nvidia::dra::template_name(&p.name, p.spec);
        for ns in &dra.namespaces {
            let id = format!("{ns}/{name}");
            if let Some(first) = template_owner.get(&id) {
                p.errors.push(format!(
                    "spec.dra: ResourceClaimTemplate {id} is already rendered by policy {first}"
                ));
            } else {
                template_owner.insert(id, p.name.clone());
            }
        }
        if !p.errors.is_empty() {
            p.key = None;
        }
    }
    // A custom layout points the MIG manager at our ConfigMap; named layouts must then be in it,
    // which needs the GPU Operator's default config.
    let any_custom = prepared.iter().any(|p| {
        p.errors.is_empty()
            && p.spec
                .mig
                .as_ref()
                .is_some_and(|m| m.custom_layout.is_some())
    });
    if any_custom && base.is_none() {
        for p in prepared.iter_mut().filter(|p| p.errors.is_empty()) {
            if let Some(l) = p.spec.mig.as_ref().and_then(|m| m.layout.as_ref())
                && l != MIG_DISABLED_LAYOUT
            {
                p.errors.push(format!(
                    "spec.mig.layout: {l:?} cannot be served: a custom layout replaces the MIG manager's config with ours, and the GPU Operator's default-mig-parted-config (whose named layouts we would carry over) was not found"
                ));
                p.key = None;
                p.config_text = None;
            }
        }
    }
    // Nodes in name order, whatever order the caches gave them in.
    let mut sorted_nodes: Vec<&NodeFacts> = input.nodes.iter().map(|n| &**n).collect();
    sorted_nodes.sort_by(|a, b| a.name.cmp(&b.name));

    // Which policy governs each node.
    let mut matched: BTreeMap<&str, Vec<&str>> = BTreeMap::new(); // policy -> nodes
    let mut winner: BTreeMap<&str, usize> = BTreeMap::new(); // node -> prepared index
    for n in &sorted_nodes {
        let sel_labels = selection_labels(&n.labels);
        for (i, p) in prepared.iter().enumerate() {
            if selector_matches(&p.spec.node_selector, &sel_labels) {
                matched
                    .entry(p.name.as_str())
                    .or_default()
                    .push(n.name.as_str());
                winner.entry(n.name.as_str()).or_insert(i);
            }
        }
    }

    // Cluster-wide MIG strategy: that of the highest-precedence valid MIG policy governing a
    // node, else of the highest-precedence valid MIG policy.
    // Without any node (e.g. `render` without --nodes) every policy counts as governing, so
    // conflicts are still reported.
    let mut governing: BTreeSet<usize> = winner.values().copied().collect();
    if governing.is_empty() {
        governing = (0..prepared.len()).collect();
    }
    let valid_mig = |i: &usize| prepared[*i].errors.is_empty() && prepared[*i].spec.mig.is_some();
    let mig_owner = (0..prepared.len())
        .find(|i| valid_mig(i) && governing.contains(i))
        .or_else(|| (0..prepared.len()).find(|i| valid_mig(i)));
    let cluster_mig = mig_owner.and_then(|i| prepared[i].spec.mig.as_ref().map(|m| m.mig_strategy));
    // Policies whose settings conflict with the cluster-wide MIG strategy.
    let mut policy_blocked: BTreeMap<usize, String> = BTreeMap::new();
    let mut latent: BTreeMap<usize, String> = BTreeMap::new();
    if let Some(cm) = cluster_mig {
        let owner = mig_owner
            .map(|i| prepared[i].name.clone())
            .unwrap_or_default();
        for (i, p) in prepared.iter().enumerate() {
            if !p.errors.is_empty() {
                continue;
            }
            // Only a policy that governs nodes is blocked; one without nodes gets a warning.
            let policy_blocked = if governing.contains(&i) {
                &mut policy_blocked
            } else {
                &mut latent
            };
            if let Some(m) = &p.spec.mig
                && m.mig_strategy != cm
            {
                policy_blocked.insert(
                    i,
                    format!(
                        "migStrategy {} conflicts with {} of policy {owner}: the GPU Operator's mig.strategy is cluster-wide",
                        m.mig_strategy.as_str(),
                        cm.as_str()
                    ),
                );
            }
            if p.spec.strategy == Strategy::Mps && cm == MigStrategy::Mixed {
                policy_blocked.insert(
                    i,
                    format!("MPS does not work with the cluster-wide MIG strategy mixed set by policy {owner}"),
                );
            }
        }
    }

    // What each layout name means now, as a content hash: custom layouts from the policies, named
    // ones from the GPU Operator's config, and what is left in our ConfigMap.
    let custom_hashes: BTreeMap<String, String> = prepared
        .iter()
        .filter_map(|p| Some((p.layout.clone()?, p.custom.as_ref()?.1.clone())))
        .collect();
    let layout_hash = |name: &str| -> Option<String> {
        if name == MIG_DISABLED_LAYOUT {
            return None;
        }
        if let Some(h) = custom_hashes.get(name) {
            return Some(h.clone());
        }
        base.and_then(|b| b.get(name))
            .or_else(|| input.current_mig_configs.get(name))
            .and_then(nvidia::layout_hash)
    };
    let mut stale_nodes: BTreeMap<usize, Vec<String>> = BTreeMap::new();

    let mut node_labels: NodeWrites = BTreeMap::new();
    let mut per_policy_nodes: BTreeMap<usize, Vec<NodeDetail>> = BTreeMap::new();
    let mut applied_count: BTreeMap<usize, i32> = BTreeMap::new();
    let mut cap: BTreeMap<usize, Capacity> = BTreeMap::new();
    let mut cap_unknown: BTreeSet<usize> = BTreeSet::new();
    let mut failed_nodes: BTreeMap<usize, Vec<String>> = BTreeMap::new();
    let mut used_keys: BTreeSet<String> = BTreeSet::new();

    for n in &sorted_nodes {
        let cur = |k: &str| n.labels.get(k).map(str::to_string);
        let mig_capable = n.labels.get(LABEL_MIG_CAPABLE) == Some("true");
        let mig_state = cur(LABEL_MIG_STATE);
        let cur_mig = cur(LABEL_MIG_CONFIG);
        let mig_done = |layout: &str| {
            cur_mig.as_deref() == Some(layout) && mig_state.as_deref() == Some("success")
        };

        let Some(&wi) = winner.get(n.name.as_str()) else {
            // No policy: give back what we own; a MIG layout we set is returned to all-disabled
            // (the GPU Operator's default) rather than left half-owned.
            let mut l = BTreeMap::new();
            if n.owned.contains(LABEL_MIG_CONFIG) {
                l.insert(
                    LABEL_MIG_CONFIG.to_string(),
                    MIG_DISABLED_LAYOUT.to_string(),
                );
            }
            node_labels.insert(n.name.clone(), (l, BTreeMap::new()));
            continue;
        };
        let w = &prepared[wi];
        let details = per_policy_nodes.entry(wi).or_default();
        if !w.errors.is_empty() || policy_blocked.contains_key(&wi) {
            hold_node(
                n,
                "Rejected",
                "policy not accepted; node left as it was".to_string(),
                &mut node_labels,
                &mut used_keys,
                details,
            );
            continue;
        }
        if let Some(reason) = node_rejection(w.spec, n) {
            hold_node(
                n,
                "Rejected",
                reason,
                &mut node_labels,
                &mut used_keys,
                details,
            );
            continue;
        }
        let key = w.key.clone().expect("valid policies have a key");
        // Pods using GPUs block MIG changes unless the policy opts in.
        let pods = input
            .gpu_pods
            .get(&n.name)
            .map(Vec::as_slice)
            .unwrap_or_default();
        let busy = !pods.is_empty()
            && !w
                .spec
                .mig
                .as_ref()
                .is_some_and(|m| m.proceed_with_busy_gpus);
        let mut l = BTreeMap::new();
        l.insert(LABEL_POLICY.to_string(), w.name.clone());
        let (state, message, dp_key, mig_label): (&str, String, String, Option<String>) = match w
            .spec
            .strategy
        {
            Strategy::Mig => {
                let mut layout = w.layout.clone().expect("mig policies have a layout");
                // A node still on the pre-upgrade name of this custom layout keeps it while its
                // content is the same: no MIG reconfiguration just for a new name.
                if let Some((_, hash)) = &w.custom {
                    let legacy = nvidia::legacy_custom_layout_name(&w.name);
                    if cur_mig.as_deref() == Some(legacy.as_str())
                        && input
                            .current_mig_configs
                            .get(&legacy)
                            .and_then(nvidia::layout_hash)
                            .as_ref()
                            == Some(hash)
                    {
                        layout = legacy;
                    }
                }
                // A named layout whose content changed since we labelled the node: the MIG
                // manager never re-reads an unchanged label, so the node runs the old geometry.
                let recorded = n
                    .annotations
                    .get(ANNOTATION_MIG_LAYOUT)
                    .and_then(|v| v.rsplit_once('@'));
                let now_hash = layout_hash(&layout);
                let stale = w.custom.is_none()
                    && mig_done(&layout)
                    && recorded.is_some_and(|(l, h)| {
                        l == layout && now_hash.as_deref().is_some_and(|now| now != h)
                    });
                let reapply = w
                    .policy
                    .metadata
                    .annotations
                    .as_ref()
                    .is_some_and(|a| a.contains_key(ANNOTATION_REAPPLY_MIG));
                let stuck =
                    input.mig_stuck.contains(&n.name) && mig_state.as_deref() == Some("pending");
                let failed = cur_mig.as_deref() == Some(layout.as_str())
                    && (mig_state.as_deref() == Some("failed") || stuck);
                if failed {
                    failed_nodes.entry(wi).or_default().push(n.name.clone());
                    hold_node(
                        n,
                        "Failed",
                        format!(
                            "MIG manager reported failed (or stayed pending past the timeout) for layout {layout}; node left untouched"
                        )
                        .to_string(),
                        &mut node_labels,
                        &mut used_keys,
                        details,
                    );
                    continue;
                }
                if stale && !reapply {
                    stale_nodes.entry(wi).or_default().push(n.name.clone());
                    hold_node(
                        n,
                        "Stale",
                        format!(
                            "layout {layout} changed content since this node was configured ({} -> {}); the MIG manager does not re-read an unchanged label: annotate the policy with {ANNOTATION_REAPPLY_MIG}=true to re-apply it through {MIG_DISABLED_LAYOUT}",
                            recorded.map(|r| r.1).unwrap_or_default(),
                            now_hash.unwrap_or_default()
                        ),
                        &mut node_labels,
                        &mut used_keys,
                        details,
                    );
                    continue;
                } else if stale && busy {
                    hold_node(
                        n,
                        "Waiting",
                        busy_msg(pods),
                        &mut node_labels,
                        &mut used_keys,
                        details,
                    );
                    continue;
                } else if stale && cur(LABEL_DEVICE_PLUGIN_CONFIG).is_some_and(|k| k != DEFAULT_KEY)
                {
                    (
                        "Pending",
                        format!("removing the sharing config before re-applying layout {layout}"),
                        DEFAULT_KEY.to_string(),
                        Some(layout),
                    )
                } else if stale {
                    (
                        "Pending",
                        format!(
                            "re-applying layout {layout} (its content changed) through {MIG_DISABLED_LAYOUT}"
                        ),
                        DEFAULT_KEY.to_string(),
                        Some(MIG_DISABLED_LAYOUT.to_string()),
                    )
                } else if reapply
                    && cur_mig.as_deref() == Some(MIG_DISABLED_LAYOUT)
                    && mig_state.as_deref() == Some("pending")
                {
                    // A re-apply goes through a confirmed all-disabled: the MIG manager skips a
                    // layout it believes applied, so flipping straight back would change nothing.
                    (
                        "Pending",
                        format!(
                            "waiting for {MIG_DISABLED_LAYOUT} to be confirmed before re-applying layout {layout}"
                        ),
                        DEFAULT_KEY.to_string(),
                        Some(MIG_DISABLED_LAYOUT.to_string()),
                    )
                } else if mig_done(&layout) {
                    ("Applied", String::new(), key.clone(), Some(layout))
                } else if cur_mig.as_deref() != Some(layout.as_str()) && busy {
                    // Idle GPUs are needed to change the layout: hold everything.
                    hold_node(
                        n,
                        "Waiting",
                        busy_msg(pods),
                        &mut node_labels,
                        &mut used_keys,
                        details,
                    );
                    continue;
                } else if cur(LABEL_DEVICE_PLUGIN_CONFIG)
                    .is_some_and(|k| k != DEFAULT_KEY && k != key)
                {
                    // First take the sharing config off; the layout changes on a later step.
                    let held_mig = n
                        .owned
                        .contains(LABEL_MIG_CONFIG)
                        .then(|| cur_mig.clone())
                        .flatten();
                    (
                        "Pending",
                        "removing the sharing config before changing the MIG layout".to_string(),
                        DEFAULT_KEY.to_string(),
                        held_mig,
                    )
                } else {
                    // Sharing stays off while the layout changes.
                    (
                        "Pending",
                        format!("waiting for MIG layout {layout}"),
                        DEFAULT_KEY.to_string(),
                        Some(layout),
                    )
                }
            }
            _ => {
                // Sharing (or exclusive) on a MIG-capable node: MIG must be off, and confirmed,
                // before the new device-plugin config is applied.
                let confirmed_off = match cur_mig.as_deref() {
                    None => true,
                    Some(MIG_DISABLED_LAYOUT) => {
                        matches!(mig_state.as_deref(), None | Some("success"))
                    }
                    Some(_) => false,
                };
                let keep_mig_label = n
                    .owned
                    .contains(LABEL_MIG_CONFIG)
                    .then(|| MIG_DISABLED_LAYOUT.to_string());
                if !mig_capable && cur_mig.is_none() || confirmed_off {
                    ("Applied", String::new(), key.clone(), keep_mig_label)
                } else if cur_mig.as_deref() == Some(MIG_DISABLED_LAYOUT)
                    && (mig_state.as_deref() == Some("failed")
                        || input.mig_stuck.contains(&n.name)
                            && mig_state.as_deref() == Some("pending"))
                {
                    failed_nodes.entry(wi).or_default().push(n.name.clone());
                    hold_node(
                            n,
                            "Failed",
                            "MIG manager failed to disable MIG (or stayed pending past the timeout); node left untouched".to_string(),
                            &mut node_labels,
                            &mut used_keys,
                            details,
                        );
                    continue;
                } else if cur_mig.as_deref() != Some(MIG_DISABLED_LAYOUT) && busy {
                    hold_node(
                        n,
                        "Waiting",
                        busy_msg(pods),
                        &mut node_labels,
                        &mut used_keys,
                        details,
                    );
                    continue;
                } else {
                    (
                        "Pending",
                        "waiting for MIG to be disabled and confirmed before sharing is enabled"
                            .into(),
                        DEFAULT_KEY.to_string(),
                        Some(MIG_DISABLED_LAYOUT.to_string()),
                    )
                }
            }
        };
        // "Applied" also needs the labels to be in place already, and GFD to agree when it reports.
        let labels_in_place = cur(LABEL_DEVICE_PLUGIN_CONFIG).as_deref() == Some(dp_key.as_str());
        let expected_replicas = if w.spec.backend == Backend::Dra {
            1
        } else {
            replicas_of(w.spec) as i64
        };
        let mig_time_sliced = w
            .spec
            .mig
            .as_ref()
            .is_some_and(|m| m.time_slicing.is_some());
        let gfd_replicas_ok = match (w.spec.strategy, label_i64(n, LABEL_GPU_REPLICAS)) {
            // Without time-slicing GFD reports 0 or 1 for MIG: nothing to compare.
            (Strategy::Mig, _) if !mig_time_sliced => true,
            (_, None) => true,
            (_, Some(r)) => {
                r == expected_replicas || w.spec.strategy == Strategy::Exclusive && r == 1
            }
        };
        // Our annotations: when the device-plugin config label last changed (kept while it stays),
        // and which MIG layout content the node was labelled with.
        let mut annotations = BTreeMap::new();
        if !labels_in_place {
            annotations.insert(ANNOTATION_CONFIG_WRITTEN.to_string(), input.now.to_string());
        } else if let Some(v) = n.annotations.get(ANNOTATION_CONFIG_WRITTEN) {
            annotations.insert(ANNOTATION_CONFIG_WRITTEN.to_string(), v.to_string());
        }
        if let Some(m) = mig_label.as_deref().filter(|m| *m != MIG_DISABLED_LAYOUT) {
            let kept = n
                .annotations
                .get(ANNOTATION_MIG_LAYOUT)
                .filter(|v| v.rsplit_once('@').is_some_and(|(l, _)| l == m));
            match kept {
                Some(v) if cur_mig.as_deref() == Some(m) => {
                    annotations.insert(ANNOTATION_MIG_LAYOUT.to_string(), v.to_string());
                }
                _ => {
                    if let Some(h) = layout_hash(m) {
                        annotations.insert(ANNOTATION_MIG_LAYOUT.to_string(), format!("{m}@{h}"));
                    }
                }
            }
        }
        // GFD relabels after the device plugin loads a new config: a timestamp not newer than
        // our label write means it has not reported the new config yet.
        let written = annotations
            .get(ANNOTATION_CONFIG_WRITTEN)
            .and_then(|v| v.parse::<i64>().ok());
        let gfd_fresh = match (written, label_i64(n, LABEL_GFD_TIMESTAMP)) {
            (Some(w), Some(t)) => t > w,
            _ => true,
        };
        let (state, message) = if state == "Applied" && !labels_in_place {
            ("Pending", format!("labelling node with config {dp_key}"))
        } else if state == "Applied" && !gfd_fresh {
            (
                "Pending",
                format!(
                    "waiting for GPU Feature Discovery to report config {dp_key} (nvidia.com/gfd.timestamp not newer than our label write at {})",
                    written.unwrap_or_default()
                ),
            )
        } else if state == "Applied" && !gfd_replicas_ok {
            (
                "Pending",
                format!(
                    "GPU Feature Discovery reports nvidia.com/gpu.replicas={}, expected {}",
                    n.labels
                        .get(LABEL_GPU_REPLICAS)
                        .map(str::to_string)
                        .unwrap_or_default(),
                    expected_replicas
                ),
            )
        } else {
            (state, message)
        };
        if state == "Applied" {
            *applied_count.entry(wi).or_default() += 1;
            let (phys, sched, mem, threads, iso) = node_capacity(w.spec, n, base);
            let c = cap.entry(wi).or_insert_with(|| Capacity {
                memory_isolation: true,
                ..Default::default()
            });
            c.physical_gpus += phys;
            match sched {
                Some(s) => c.schedulable_replicas += s,
                None => {
                    cap_unknown.insert(wi);
                }
            }
            if let Some(m) = mem {
                c.memory_per_client_mib = Some(c.memory_per_client_mib.map_or(m, |x| x.min(m)));
            }
            if let Some(t) = threads {
                c.threads_per_client_percent =
                    Some(c.threads_per_client_percent.map_or(t, |x| x.min(t)));
            }
            c.memory_isolation &= iso;
        }
        used_keys.insert(dp_key.clone());
        l.insert(LABEL_DEVICE_PLUGIN_CONFIG.to_string(), dp_key);
        if let Some(m) = mig_label {
            l.insert(LABEL_MIG_CONFIG.to_string(), m);
        }
        node_labels.insert(n.name.clone(), (l, annotations));
        details.push(NodeDetail {
            name: n.name.clone(),
            state: state.into(),
            message,
        });
    }

    // A MIG layout change also sets nvidia.com/mig.config.state=pending in the same write: until
    // the MIG manager reports, the old "success" must not be read as confirming the new layout.
    // We keep owning "pending" only until the MIG manager overwrites it (its update takes the
    // field over), so we never remove or overwrite its report.
    for n in &sorted_nodes {
        let Some((l, _)) = node_labels.get_mut(&n.name) else {
            continue;
        };
        let Some(want) = l.get(LABEL_MIG_CONFIG).cloned() else {
            continue;
        };
        let cur_state = n.labels.get(LABEL_MIG_STATE);
        if n.labels.get(LABEL_MIG_CONFIG) != Some(&want)
            || (n.owned.contains(LABEL_MIG_STATE) && cur_state == Some("pending"))
        {
            l.insert(LABEL_MIG_STATE.to_string(), "pending".to_string());
        }
    }

    // Device-plugin ConfigMap: default, every valid policy's key, and keys nodes still use.
    let mut device_config = BTreeMap::new();
    device_config.insert(
        DEFAULT_KEY.to_string(),
        nvidia::to_yaml(&nvidia::exclusive_config("none")),
    );
    for p in &prepared {
        if let (Some(k), Some(t)) = (&p.key, &p.config_text) {
            device_config.insert(k.to_string(), t.clone());
        }
    }
    for n in &input.nodes {
        if let Some(k) = n.labels.get(LABEL_DEVICE_PLUGIN_CONFIG)
            && !device_config.contains_key(k)
            && let Some(t) = input.current_device_config.get(k)
        {
            device_config.insert(k.to_string(), t.clone());
        }
    }
    for k in &used_keys {
        if !device_config.contains_key(k)
            && let Some(t) = input.current_device_config.get(k)
        {
            device_config.insert(k.to_string(), t.clone());
        }
    }

    // mig-parted ConfigMap: only when a custom layout is in use, or a node still names one of
    // ours. A layout stays until no node's label names it (an edited layout gets a new name;
    // the old one is what the MIG manager would read until the node's label changes).
    let mut custom = BTreeMap::new();
    for p in prepared.iter().filter(|p| p.errors.is_empty()) {
        if let (Some(layout), Some((entries, _))) = (&p.layout, &p.custom) {
            custom.insert(layout.clone(), entries.clone());
        }
    }
    let mut named = base.cloned().unwrap_or_default();
    let mut carried = false;
    for n in &sorted_nodes {
        let wanted = node_labels
            .get(&n.name)
            .and_then(|(l, _)| l.get(LABEL_MIG_CONFIG).cloned());
        for layout in [n.labels.get(LABEL_MIG_CONFIG).map(str::to_string), wanted]
            .into_iter()
            .flatten()
        {
            if layout == MIG_DISABLED_LAYOUT
                || custom.contains_key(&layout)
                || named.contains_key(&layout)
            {
                continue;
            }
            if let Some(v) = input.current_mig_configs.get(&layout) {
                named.insert(layout, v.clone());
                carried = true;
            }
        }
    }
    let mig_config = (!custom.is_empty() || carried)
        .then(|| nvidia::to_yaml(&nvidia::mig_parted_config(&named, &custom)));

    // ClusterPolicy: point the device plugin at our ConfigMap; MIG settings when MIG is used.
    let any_policy = !prepared.is_empty();
    let mut spec = serde_json::Map::new();
    if any_policy {
        spec.insert(
            "devicePlugin".into(),
            json!({"config": {"name": input.device_configmap_name, "default": DEFAULT_KEY}}),
        );
    }
    if mig_config.is_some() {
        spec.insert(
            "migManager".into(),
            json!({"config": {"name": input.mig_configmap_name}}),
        );
    }
    if let Some(cm) = cluster_mig {
        spec.insert("mig".into(), json!({"strategy": cm.as_str()}));
    }
    let cluster_policy_spec = serde_json::Value::Object(spec);

    // ResourceClaimTemplates of valid, accepted DRA policies. Memory defaults come from the
    // smallest GPU among the nodes the policy governs.
    let mut claim_templates = BTreeMap::new();
    let mut templates_of: BTreeMap<usize, Vec<String>> = BTreeMap::new();
    for (i, p) in prepared.iter().enumerate() {
        let Some(dra) = &p.spec.dra else { continue };
        if !p.errors.is_empty() || policy_blocked.contains_key(&i) {
            continue;
        }
        // Only nodes the policy governs and accepts (a rejected node must not shape the limits).
        let accepted: BTreeSet<&str> = per_policy_nodes
            .get(&i)
            .map(|d| {
                d.iter()
                    .filter(|d| d.state != "Rejected")
                    .map(|d| d.name.as_str())
                    .collect()
            })
            .unwrap_or_default();
        let min_mem = sorted_nodes
            .iter()
            .filter(|n| accepted.contains(n.name.as_str()))
            .filter_map(|n| label_i64(n, LABEL_GPU_MEMORY))
            .min();
        for ns in &dra.namespaces {
            let t = crate::nvidia::dra::claim_template(&p.name, ns, p.spec, min_mem);
            let id = format!(
                "{ns}/{}",
                crate::nvidia::dra::template_name(&p.name, p.spec)
            );
            templates_of.entry(i).or_default().push(id.clone());
            claim_templates.insert(id, t);
        }
    }

    // Statuses.
    let mut statuses = BTreeMap::new();
    for (i, p) in prepared.iter().enumerate() {
        let generation = p.policy.metadata.generation;
        let matched_nodes = matched.get(p.name.as_str()).cloned().unwrap_or_default();
        let mut conflicting = Vec::new();
        for n in &matched_nodes {
            let wi = winner[n];
            if wi != i {
                conflicting.push(format!("{n} (won by {})", prepared[wi].name));
            }
        }
        let mut details = per_policy_nodes.remove(&i).unwrap_or_default();
        let won = details.len() as i32;
        let applied = applied_count.get(&i).copied().unwrap_or(0);
        let rejected: Vec<&NodeDetail> = details.iter().filter(|d| d.state == "Rejected").collect();
        let waiting: Vec<&NodeDetail> = details.iter().filter(|d| d.state == "Waiting").collect();
        let mut conditions = Vec::new();
        let accepted_msg;
        if !p.errors.is_empty() {
            accepted_msg = p.errors.join("; ");
            conditions.push(condition(
                "Accepted",
                false,
                "InvalidSpec",
                accepted_msg.clone(),
                generation,
            ));
        } else if let Some(reason) = policy_blocked.get(&i) {
            conditions.push(condition(
                "Accepted",
                false,
                "ClusterWideConflict",
                reason.clone(),
                generation,
            ));
        } else if !rejected.is_empty() {
            let msgs: Vec<String> = rejected
                .iter()
                .take(5)
                .map(|d| format!("{}: {}", d.name, d.message))
                .collect();
            conditions.push(condition(
                "Accepted",
                false,
                "IncompatibleNodes",
                format!(
                    "{} of {} nodes cannot run this policy and were left untouched: {}",
                    rejected.len(),
                    won,
                    msgs.join("; ")
                ),
                generation,
            ));
        } else {
            conditions.push(condition(
                "Accepted",
                true,
                "Valid",
                "spec is valid for every matched node".into(),
                generation,
            ));
        }
        let ready = p.errors.is_empty()
            && !policy_blocked.contains_key(&i)
            && applied == won
            && rejected.is_empty();
        let (rr, rm) = if !p.errors.is_empty() || policy_blocked.contains_key(&i) {
            ("NotAccepted", "the policy is not accepted".to_string())
        } else if won == 0 {
            ("NoNodes", "no node is governed by this policy".to_string())
        } else if ready {
            ("Converged", format!("all {won} nodes are configured"))
        } else if let Some(stale) = stale_nodes.get(&i) {
            (
                "MigLayoutChanged",
                format!(
                    "{applied} of {won} nodes are configured; {} run an older version of their MIG layout",
                    stale.len()
                ),
            )
        } else {
            (
                "Progressing",
                format!("{applied} of {won} nodes are configured"),
            )
        };
        let ready = ready && won > 0 || (rr == "NoNodes");
        conditions.push(condition("Ready", ready, rr, rm, generation));
        let pending = details.iter().filter(|d| d.state == "Pending").count();
        if !waiting.is_empty() {
            let msgs: Vec<String> = waiting
                .iter()
                .take(5)
                .map(|d| format!("{}: {}", d.name, d.message))
                .collect();
            conditions.push(condition(
                "Progressing",
                true,
                "WaitingForIdleGPUs",
                msgs.join("; "),
                generation,
            ));
        } else if pending > 0 {
            conditions.push(condition(
                "Progressing",
                true,
                "Reconfiguring",
                format!("{pending} nodes are being reconfigured"),
                generation,
            ));
        } else {
            conditions.push(condition(
                "Progressing",
                false,
                "Idle",
                "nothing in progress".into(),
                generation,
            ));
        }
        if conflicting.is_empty() {
            conditions.push(condition(
                "Conflicted",
                false,
                "NoOverlap",
                "no other policy selects these nodes".into(),
                generation,
            ));
        } else {
            let shown: Vec<String> = conflicting.iter().take(10).cloned().collect();
            conditions.push(condition(
                "Conflicted",
                true,
                "OverlappingPolicy",
                format!(
                    "{} matched nodes are governed by another policy: {}",
                    conflicting.len(),
                    shown.join(", ")
                ),
                generation,
            ));
        }
        let failed = failed_nodes.get(&i).cloned().unwrap_or_default();
        if !input.cluster_policy_found {
            conditions.push(condition(
                "Degraded",
                true,
                "ClusterPolicyMissing",
                "the GPU Operator ClusterPolicy was not found: nodes are labelled but no device plugin reads the config".into(),
                generation,
            ));
        } else if let Some(what) = input
            .cluster_policy_contested
            .as_ref()
            .filter(|_| p.spec.backend != Backend::Dra)
        {
            conditions.push(condition(
                "Degraded",
                true,
                "ClusterPolicyContested",
                format!("another controller keeps reverting the ClusterPolicy settings this policy needs ({what}); make it leave them alone, e.g. ignore those fields in your GitOps tool"),
                generation,
            ));
        } else if let Some(stale) = stale_nodes.get(&i) {
            let layout = p
                .spec
                .mig
                .as_ref()
                .and_then(|m| m.layout.as_deref())
                .unwrap_or_default();
            conditions.push(condition(
                "Degraded",
                true,
                "MigLayoutChanged",
                format!(
                    "the content of MIG layout {layout} changed (e.g. a GPU Operator upgrade) since these nodes were configured, and the MIG manager only acts on a label change: {}; annotate this policy with {ANNOTATION_REAPPLY_MIG}=true to re-apply it through {MIG_DISABLED_LAYOUT}",
                    stale.iter().take(10).cloned().collect::<Vec<_>>().join(", ")
                ),
                generation,
            ));
        } else if !failed.is_empty() {
            conditions.push(condition(
                "Degraded",
                true,
                "MigConfigFailed",
                format!(
                    "nvidia.com/mig.config.state failed, or pending past the MIG timeout, on: {}",
                    failed.join(", ")
                ),
                generation,
            ));
        } else {
            conditions.push(condition(
                "Degraded",
                false,
                "Healthy",
                "no failures".into(),
                generation,
            ));
        }
        for c in &conflicting {
            let node = c.split(' ').next().unwrap_or_default();
            details.push(NodeDetail {
                name: node.into(),
                state: "Conflicted".into(),
                message: c.clone(),
            });
        }
        // Non-ready first, then by name; bounded.
        details.sort_by(|a, b| {
            ((a.state == "Applied"), &a.name).cmp(&((b.state == "Applied"), &b.name))
        });
        details.truncate(MAX_NODE_DETAILS);
        let mut warnings = p.warnings.clone();
        if let Some(l) = latent.get(&i) {
            warnings.push(format!(
                "this policy governs no node yet; once it does: {l}"
            ));
        }
        if cap_unknown.contains(&i) {
            warnings.push(
                "schedulable replicas exclude nodes whose MIG layout's instance count is unknown"
                    .into(),
            );
        }
        if p.spec.strategy == Strategy::TimeSlicing
            || p.spec
                .mig
                .as_ref()
                .is_some_and(|m| m.time_slicing.is_some())
        {
            warnings
                .push("time-slicing gives no memory or fault isolation between replicas".into());
        }
        let capacity = if p.errors.is_empty() {
            Some(cap.remove(&i).unwrap_or(Capacity {
                memory_isolation: p.spec.strategy != Strategy::TimeSlicing,
                ..Default::default()
            }))
        } else {
            None
        };
        statuses.insert(
            p.name.clone(),
            GpuSharingPolicyStatus {
                observed_generation: generation,
                conditions,
                replicas: Some(replicas_of(p.spec)),
                nodes: Some(format!("{applied}/{}", matched_nodes.len())),
                matched_nodes: matched_nodes.len() as i32,
                applied_nodes: applied,
                conflicting_nodes: conflicting.len() as i32,
                device_config_key: if p.spec.backend == Backend::Dra {
                    None
                } else {
                    p.key.clone()
                },
                templates: templates_of.remove(&i).unwrap_or_default(),
                mig_config: if p.errors.is_empty() {
                    p.layout.clone()
                } else {
                    None
                },
                capacity,
                node_details: details,
                warnings,
            },
        );
    }

    let mut node_annotations = BTreeMap::new();
    let node_labels = node_labels
        .into_iter()
        .map(|(name, (labels, annotations))| {
            node_annotations.insert(name.clone(), annotations);
            (name, labels)
        })
        .collect();
    Plan {
        device_config,
        mig_config,
        cluster_policy_spec,
        node_labels,
        node_annotations,
        statuses,
        claim_templates,
    }
}
