//! The objects a plan writes besides node metadata: our two ConfigMaps, our part of the GPU
//! Operator's ClusterPolicy, and the DRA policies' ResourceClaimTemplates.

use std::collections::{BTreeMap, BTreeSet};

use serde_json::json;

use crate::api::crd::MigStrategy;
use crate::api::names::*;
use crate::nvidia::{self, DEFAULT_KEY, MIG_DISABLED_LAYOUT};

use super::facts::gpu_memory_mib;
use super::memo::Named;
use super::policies::Prepared;
use super::{facts::NodeFacts, input::PlanInput};

/// Data of the device-plugin ConfigMap: `default` (no sharing), every valid policy's key, and
/// the keys nodes still name (their label, or a label we hold), kept from the current data.
pub fn device_config(
    prepared: &[Prepared],
    input: &PlanInput,
    named: &[&Named],
    used_keys: &BTreeSet<String>,
) -> BTreeMap<String, String> {
    let mut data = BTreeMap::new();
    data.insert(
        DEFAULT_KEY.to_string(),
        nvidia::device_plugin_yaml(&nvidia::exclusive_config("none")),
    );
    for p in prepared {
        if let (Some(k), Some(t)) = (&p.key, &p.config_text) {
            data.insert(k.to_string(), t.clone());
        }
    }
    // Each key once: thousands of nodes name a handful of keys.
    let named: std::collections::HashSet<&str> = named
        .iter()
        .filter_map(|n| n.device_config.as_deref())
        .collect();
    for k in named
        .into_iter()
        .chain(used_keys.iter().map(String::as_str))
    {
        if !data.contains_key(k)
            && let Some(t) = input.cluster.current_device_config.get(k)
        {
            data.insert(k.to_string(), t.clone());
        }
    }
    data
}

/// `config.yaml` of the mig-parted ConfigMap: only when a custom layout is in use, or a node
/// still names one of ours. A layout stays until no node's label names it (an edited layout gets
/// a new name; the old one is what the MIG manager would read until the node's label changes).
pub fn mig_config(
    prepared: &[Prepared],
    input: &PlanInput,
    named: &[&Named],
    wanted: &[super::labels::SmallMap],
) -> Option<String> {
    let mut custom = BTreeMap::new();
    for p in prepared.iter().filter(|p| p.errors.is_empty()) {
        if let Some(m) = p.mig()
            && let Some((entries, _)) = &m.custom
        {
            custom.insert(m.layout.clone(), entries.clone());
        }
    }
    let base = input.cluster.base_mig_configs.as_ref();
    let current = named.iter().map(|n| n.mig_config.as_deref());
    let carried = carried(
        current,
        wanted,
        LABEL_MIG_CONFIG,
        &input.cluster.current_mig_configs,
        |l| {
            l == MIG_DISABLED_LAYOUT
                || custom.contains_key(l)
                || base.is_some_and(|b| b.contains_key(l))
        },
    );
    (!custom.is_empty() || !carried.is_empty()).then(|| {
        let mut named = base.cloned().unwrap_or_default();
        named.extend(carried);
        nvidia::to_yaml(&nvidia::mig_parted_config(&named, &custom))
    })
}

/// The configs (MIG layouts, vGPU configs) that nodes name, by their `label` now (`current`)
/// or in the plan (`wanted`), that are not `known` elsewhere and only our ConfigMap still has
/// (`ours`): carried over so no node points at a name that is gone.
fn carried<'a>(
    current: impl Iterator<Item = Option<&'a str>>,
    wanted: &'a [super::labels::SmallMap],
    label: &str,
    ours: &BTreeMap<String, serde_json::Value>,
    known: impl Fn(&str) -> bool,
) -> BTreeMap<String, serde_json::Value> {
    let mut carried = BTreeMap::new();
    for (now, w) in current.zip(wanted) {
        for name in [now, w.get(label).map(String::as_str)]
            .into_iter()
            .flatten()
        {
            if known(name) || carried.contains_key(name) {
                continue;
            }
            if let Some(v) = ours.get(name) {
                carried.insert(name.to_string(), v.clone());
            }
        }
    }
    carried
}

/// What decides our part of the ClusterPolicy.
pub struct Owned {
    pub any_policy: bool,
    /// Our mig-parted ConfigMap exists.
    pub mig_config: bool,
    pub cluster_mig: Option<MigStrategy>,
    /// Some node is to be (or stay) a VM host of ours.
    pub vm_nodes: bool,
    /// Our vGPU-devices ConfigMap exists.
    pub vgpu_config: bool,
}

/// Our part of the ClusterPolicy `spec`: the device plugin reads our ConfigMap (once any policy
/// exists), the MIG manager reads ours while it exists, the cluster-wide MIG strategy; sandbox
/// workloads on while VM hosts of ours exist (the cluster default workload is left alone, so
/// other nodes stay containers), and the vGPU Device Manager reads ours while it exists.
pub fn cluster_policy_spec(input: &PlanInput, o: Owned) -> serde_json::Value {
    let mut spec = serde_json::Map::new();
    if o.any_policy {
        spec.insert(
            "devicePlugin".into(),
            json!({"config": {"name": input.settings.device_configmap, "default": DEFAULT_KEY}}),
        );
    }
    if o.mig_config {
        spec.insert(
            "migManager".into(),
            json!({"config": {"name": input.settings.mig_configmap}}),
        );
    }
    if let Some(cm) = o.cluster_mig {
        spec.insert("mig".into(), json!({"strategy": cm.as_str()}));
    }
    if o.vm_nodes {
        spec.insert("sandboxWorkloads".into(), json!({"enabled": true}));
    }
    if o.vgpu_config {
        spec.insert(
            "vgpuDeviceManager".into(),
            json!({"config": {"name": input.settings.vgpu_configmap, "default": DEFAULT_KEY}}),
        );
    }
    serde_json::Value::Object(spec)
}

/// `config.yaml` of our vGPU-devices ConfigMap: only when a custom vGPU layout is in use, or a
/// node still names one of ours; NVIDIA's named configs are carried over beside them (the vGPU
/// Device Manager then reads only ours).
pub fn vgpu_config(
    prepared: &[Prepared],
    input: &PlanInput,
    named: &[&Named],
    wanted: &[super::labels::SmallMap],
) -> Option<String> {
    let mut custom = BTreeMap::new();
    for p in prepared.iter().filter(|p| p.errors.is_empty()) {
        if let Some(v) = p.vm()
            && let (Some(name), Some((entries, _))) = (&v.vgpu_config, &v.vgpu_custom)
        {
            custom.insert(name.clone(), entries.clone());
        }
    }
    let base = &input.cluster.base_vgpu_configs;
    let current = named.iter().map(|n| n.vgpu_config.as_deref());
    let carried = carried(
        current,
        wanted,
        LABEL_VGPU_CONFIG,
        &input.cluster.current_vgpu_configs,
        |c| custom.contains_key(c) || base.contains_key(c),
    );
    (!custom.is_empty() || !carried.is_empty()).then(|| {
        let mut named = (**base).clone();
        named.extend(carried);
        nvidia::to_yaml(&nvidia::vgpu::vgpu_config(&named, &custom))
    })
}

/// ResourceClaimTemplates of an accepted DRA policy, as `namespace/name` and object, in the
/// order of its namespaces; and the namespaces it lists that do not exist (when `existing` is
/// known), whose templates wait for them. Memory defaults come
/// from the smallest GPU among the nodes it governs and accepts (a rejected node must not shape
/// the limits).
pub fn claim_templates(
    p: &Prepared,
    accepted_nodes: &[&NodeFacts],
    existing: Option<&BTreeSet<String>>,
) -> (Vec<(String, serde_json::Value)>, Vec<String>) {
    let (mut out, mut missing) = (Vec::new(), Vec::new());
    let Some(dra) = p.spec.dra.as_ref().filter(|_| p.accepted()) else {
        return (out, missing);
    };
    let min_mem = accepted_nodes
        .iter()
        .filter_map(|n| gpu_memory_mib(n))
        .min();
    let name = nvidia::dra::template_name(&p.name, p.spec);
    for ns in &dra.namespaces {
        if existing.is_some_and(|e| !e.contains(ns)) {
            missing.push(ns.clone());
            continue;
        }
        let t = nvidia::dra::claim_template(&p.name, ns, p.spec, min_mem);
        out.push((format!("{ns}/{name}"), t));
    }
    (out, missing)
}
