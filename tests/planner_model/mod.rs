//! NVIDIA's side of the cluster for the planner tests, written from what NVIDIA's components do
//! (`../shared/REFERENCE.md`, the device plugin / GPU Feature Discovery / mig-parted sources) and
//! independent of the operator's own model (`converge`): it reads only what the plan wrote
//! (node labels, the ConfigMaps' text, our part of the ClusterPolicy) and parses NVIDIA's formats
//! itself. Simpler than the real components, never borrowed from the code under test.
//!
//! - Kubernetes: server-side apply of our labels and annotations (fields we owned and no longer
//!   apply go; an update by another manager takes a field over from us).
//! - The GPUs: per GPU, MIG off or the MIG devices it has (profiles, memory, placements of the
//!   A100 80GB and H200 from NVML's tables).
//! - The MIG manager: acts on a *change* of `nvidia.com/mig.config` (or when it starts), reads the
//!   mig-parted config the ClusterPolicy names (else the GPU Operator's default), strictly; sets
//!   `nvidia.com/mig.config.state` to `success` (the GPUs follow the layout) or `failed` (unknown
//!   layout, bad entry, uncovered GPU, unknown profile, no free placement). It runs only on
//!   MIG-capable container nodes.
//! - The device plugin and GFD share a config manager: on a change of
//!   `nvidia.com/device-plugin.config` (or a restart) they load the ConfigMap key then (label,
//!   else the ClusterPolicy default, else `default`, else the only key); a missing key or a
//!   config NVIDIA rejects crash-loops them. The MIG strategy is the ClusterPolicy's when set
//!   (the GPU Operator passes it as `MIG_STRATEGY`, which overrides the file), else the file's.
//!   GFD relabels on every run (replicas, sharing strategy, product with `-SHARED`, count,
//!   memory, `mps.capable`, `mig.strategy`, timestamp; MIG-enabled GPUs are labelled without
//!   sharing, `single` relabels `nvidia.com/gpu` with the MIG devices, `mixed` adds
//!   `nvidia.com/mig-<profile>`); the device plugin advertises count x replicas, and refuses
//!   MPS with the `mixed` strategy or on MIG-enabled GPUs (GFD still labels).
//! - Sandbox workloads (only with `sandboxWorkloads.enabled`): on `vm-*` nodes none of the above
//!   runs; the vGPU Device Manager acts on a change of `nvidia.com/vgpu.config` (NVIDIA's default
//!   vGPU config, or ours when the ClusterPolicy names it); the sandbox device plugin advertises
//!   `nvidia.com/<PCI device>` (passthrough) or `nvidia.com/NVIDIA_<type>` (created vGPUs).

use std::collections::{BTreeMap, BTreeSet};

use gpu_sharing_operator::plan::{Labels, NodeFacts, SmallMap};
use serde_json::Value;

pub const DP_CONFIG: &str = "nvidia.com/device-plugin.config";
pub const MIG_CONFIG: &str = "nvidia.com/mig.config";
pub const MIG_STATE: &str = "nvidia.com/mig.config.state";
pub const VGPU_CONFIG: &str = "nvidia.com/vgpu.config";
pub const VGPU_STATE: &str = "nvidia.com/vgpu.config.state";
pub const WORKLOAD: &str = "nvidia.com/gpu.workload.config";
pub const GFD_TIMESTAMP: &str = "nvidia.com/gfd.timestamp";

/// NVIDIA's default vGPU-devices ConfigMap as the GPU Operator ships it.
const DEFAULT_VGPU_CONFIGMAP: &str =
    include_str!("../../assets/gpu-operator/default-vgpu-devices-config.yaml");

// ---------------------------------------------------------------------------------------------
// Kubernetes: server-side apply by our field manager.

/// Applies what a plan asks of one node as the API server does for an apply with our field
/// manager: fields we owned and no longer apply are removed, applied ones set and owned.
pub fn server_side_apply(n: &mut NodeFacts, labels: &SmallMap, annotations: &SmallMap) {
    for (have, owned, want) in [
        (&mut n.labels, &mut n.owned, labels),
        (&mut n.annotations, &mut n.owned_annotations, annotations),
    ] {
        let dropped: Vec<String> = owned
            .iter()
            .filter(|k| !want.contains_key(k))
            .cloned()
            .collect();
        for k in dropped {
            have.remove(&k);
            owned.remove(&k);
        }
        for (k, v) in want {
            have.insert(k, v.as_str());
            owned.insert(k);
        }
    }
}

/// Another manager's update of a label: the value changes and the field is no longer ours.
fn update_label(n: &mut NodeFacts, key: &str, value: &str) {
    if n.labels.get(key) != Some(value) {
        n.labels.insert(key, value);
        n.owned.remove(key);
    }
}

// ---------------------------------------------------------------------------------------------
// NVIDIA's formats, parsed the way NVIDIA's parsers read them (YAML -> JSON).

fn yaml(text: &str) -> Result<Value, String> {
    serde_yaml::from_str(text).map_err(|e| format!("yaml: {e}"))
}

/// `sharing.timeSlicing` or `sharing.mps` of a device-plugin config.
#[derive(Debug, Clone, PartialEq)]
pub struct Shared {
    pub mps: bool,
    pub rename_by_default: bool,
    /// Resource name (qualified) -> replicas.
    pub resources: BTreeMap<String, i64>,
}

/// A device-plugin config (`api/config/v1`) as the device plugin and GFD load it.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct DpConfig {
    /// `flags.migStrategy` of the file (the GPU Operator's `MIG_STRATEGY` overrides it).
    pub file_mig_strategy: Option<String>,
    pub has_time_slicing: bool,
    pub has_mps: bool,
    /// The sharing in effect (MPS wins silently when both are present).
    pub sharing: Option<Shared>,
}

impl DpConfig {
    /// Replicas of a resource: the configured ones, else 1.
    fn replicas(&self, resource: &str) -> i64 {
        self.sharing
            .as_ref()
            .and_then(|s| s.resources.get(resource).copied())
            .filter(|r| *r > 0)
            .unwrap_or(1)
    }

    fn strategy(&self) -> &'static str {
        match &self.sharing {
            Some(s) if s.mps => "mps",
            Some(_) => "time-slicing",
            None => "none",
        }
    }

    fn renamed(&self, resource: &str) -> bool {
        self.sharing
            .as_ref()
            .is_some_and(|s| s.rename_by_default && s.resources.contains_key(resource))
    }
}

fn replicated(v: &Value, mps: bool) -> Result<Shared, String> {
    let resources = match v.get("resources") {
        Some(Value::Array(a)) if !a.is_empty() => a,
        _ => return Err("no resources specified".into()),
    };
    let mut out = BTreeMap::new();
    for r in resources {
        let name = r
            .get("name")
            .and_then(Value::as_str)
            .filter(|n| !n.is_empty())
            .ok_or("no resource name specified")?;
        let name = if name.contains('/') {
            name.to_string()
        } else {
            format!("nvidia.com/{name}")
        };
        let bare = name.strip_prefix("nvidia.com/").unwrap_or(&name);
        let rfc1123 = bare.len() <= 63
            && bare
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"-.".contains(&b));
        if !rfc1123 {
            return Err(format!("incorrect format for resource name {name:?}"));
        }
        let replicas = r
            .get("replicas")
            .and_then(Value::as_i64)
            .filter(|r| *r != 0)
            .ok_or("no replicas specified")?;
        if replicas < 2 {
            return Err("number of replicas must be >= 2".into());
        }
        if mps && name != "nvidia.com/gpu" {
            return Err(format!("MPS shares only nvidia.com/gpu, not {name}"));
        }
        if mps && replicas > 48 {
            return Err("MPS allows at most 48 replicas".into());
        }
        out.insert(name, replicas);
    }
    Ok(Shared {
        mps,
        rename_by_default: v.get("renameByDefault").and_then(Value::as_bool) == Some(true),
        resources: out,
    })
}

/// Parses a device-plugin config as the device plugin does: unknown keys are ignored, errors
/// are the ones it raises.
pub fn parse_device_plugin_config(text: &str) -> Result<DpConfig, String> {
    let v = yaml(text)?;
    match v.get("version").and_then(Value::as_str) {
        None | Some("v1") => {}
        Some(other) => return Err(format!("unknown version: {other}")),
    }
    let sharing = v.get("sharing").filter(|s| !s.is_null());
    let section = |k: &str| sharing.and_then(|s| s.get(k)).filter(|s| !s.is_null());
    let ts = section("timeSlicing")
        .map(|s| replicated(s, false))
        .transpose()?;
    let mps = section("mps").map(|s| replicated(s, true)).transpose()?;
    Ok(DpConfig {
        file_mig_strategy: v
            .pointer("/flags/migStrategy")
            .and_then(Value::as_str)
            .map(String::from),
        has_time_slicing: ts.is_some(),
        has_mps: mps.is_some(),
        sharing: mps.or(ts),
    })
}

/// `devices: all | [i, ...]` with an optional `device-filter` (PCI device IDs).
fn devices_of(e: &Value, gpus: usize, pci_id: &str) -> Result<Vec<usize>, String> {
    let listed: Vec<usize> = match e.get("devices") {
        Some(Value::String(s)) if s == "all" => (0..gpus).collect(),
        Some(Value::Array(a)) => a
            .iter()
            .map(|i| i.as_u64().map(|i| i as usize).ok_or("bad device index"))
            .collect::<Result<_, _>>()?,
        _ => return Err("missing required field 'devices'".into()),
    };
    let filter_ok = match e.get("device-filter") {
        None => true,
        Some(Value::String(s)) => s.eq_ignore_ascii_case(pci_id),
        Some(Value::Array(a)) => a
            .iter()
            .any(|s| s.as_str().is_some_and(|s| s.eq_ignore_ascii_case(pci_id))),
        Some(_) => return Err("bad device-filter".into()),
    };
    Ok(if filter_ok { listed } else { vec![] })
}

fn strict(e: &Value, allowed: &[&str]) -> Result<(), String> {
    let obj = e.as_object().ok_or("entry is not a map")?;
    match obj.keys().find(|k| !allowed.contains(&k.as_str())) {
        Some(k) => Err(format!("unexpected field {k:?}")),
        None => Ok(()),
    }
}

fn counts(v: Option<&Value>) -> Result<BTreeMap<String, i64>, String> {
    let Some(v) = v else {
        return Ok(BTreeMap::new());
    };
    let obj = v.as_object().ok_or("device counts are not a map")?;
    obj.iter()
        .map(|(k, c)| Ok((k.clone(), c.as_i64().ok_or("count is not an integer")?)))
        .collect()
}

/// The `mig-configs` (or `vgpu-configs`) of a config file, as mig-parted / the vGPU Device
/// Manager read it (`version: v1`).
fn named_configs(text: &str, key: &str) -> Result<BTreeMap<String, Value>, String> {
    let v = yaml(text)?;
    if v.get("version").and_then(Value::as_str) != Some("v1") {
        return Err("unknown version".into());
    }
    let m = v.get(key).and_then(Value::as_object).ok_or("no configs")?;
    Ok(m.iter().map(|(k, v)| (k.clone(), v.clone())).collect())
}

// ---------------------------------------------------------------------------------------------
// The GPUs.

/// A MIG profile on a GPU model: name, memory (MiB, as NVML reports it), memory slices, and the
/// slices an instance may start at.
type Profile = (&'static str, i64, u8, &'static [u8]);

const A100_80GB_PROFILES: &[Profile] = &[
    ("1g.10gb", 9856, 1, &[0, 1, 2, 3, 4, 5, 6]),
    ("1g.20gb", 19968, 2, &[0, 2, 4, 6]),
    ("2g.20gb", 19968, 2, &[0, 2, 4]),
    ("3g.40gb", 40192, 4, &[0, 4]),
    ("4g.40gb", 40192, 4, &[0]),
    ("7g.80gb", 80384, 8, &[0]),
];
const H200_PROFILES: &[Profile] = &[
    ("1g.18gb", 18432, 1, &[0, 1, 2, 3, 4, 5, 6]),
    ("1g.35gb", 35840, 2, &[0, 2, 4, 6]),
    ("2g.35gb", 35840, 2, &[0, 2, 4]),
    ("3g.71gb", 72704, 4, &[0, 4]),
    ("4g.71gb", 72704, 4, &[0]),
    ("7g.141gb", 144384, 8, &[0]),
];

/// A node's GPUs (all of one model).
#[derive(Debug, Clone)]
pub struct Hardware {
    /// GFD's product name (the device name, sanitised).
    pub model: String,
    pub memory_mib: i64,
    pub mig_capable: bool,
    pci_id: &'static str,
    /// The sandbox device plugin's name for the GPU (`nvidia.com/<this>` in passthrough).
    pci_name: &'static str,
    profiles: &'static [Profile],
    /// Per GPU: MIG disabled (`None`) or its MIG devices by profile.
    pub gpus: Vec<Option<BTreeMap<String, i64>>>,
}

impl Hardware {
    fn new(model: &str, count: usize, memory_mib: i64, mig_capable: bool) -> Self {
        let (pci_id, pci_name, profiles) = if model.contains("H200") {
            ("0x233310DE", "GH100_H200_SXM_141GB", H200_PROFILES)
        } else {
            ("0x20B210DE", "GA100_A100_SXM4_80GB", A100_80GB_PROFILES)
        };
        Hardware {
            model: model.to_string(),
            memory_mib,
            mig_capable,
            pci_id,
            pci_name,
            profiles,
            gpus: vec![None; count],
        }
    }

    fn profile(&self, name: &str) -> Option<&Profile> {
        self.profiles.iter().find(|p| p.0 == name)
    }

    fn mig_enabled(&self) -> bool {
        self.gpus.iter().any(Option::is_some)
    }

    /// Places the instances on one GPU's memory slices as NVML would (first free placement,
    /// largest first, with backtracking); `false` when they do not fit.
    fn fits(&self, devices: &BTreeMap<String, i64>) -> bool {
        let mut sizes: Vec<&Profile> = Vec::new();
        for (p, c) in devices {
            let Some(prof) = self.profile(p) else {
                return false;
            };
            sizes.extend(std::iter::repeat_n(prof, (*c).max(0) as usize));
        }
        sizes.sort_by_key(|p| std::cmp::Reverse(p.2));
        fn place(rest: &[&Profile], used: u8) -> bool {
            let Some((p, rest)) = rest.split_first() else {
                return true;
            };
            p.3.iter().any(|s| {
                let mask = (((1u16 << p.2) - 1) << s) as u8;
                used & mask == 0 && place(rest, used | mask)
            })
        }
        place(&sizes, 0)
    }

    /// The GPUs after applying a mig-parted layout (its entries), or mig-parted's error.
    fn apply_layout(&self, layout: &Value) -> Result<Vec<Option<BTreeMap<String, i64>>>, String> {
        let entries = layout.as_array().ok_or("layout is not a list")?;
        let mut out: Vec<Option<Option<BTreeMap<String, i64>>>> = vec![None; self.gpus.len()];
        for e in entries {
            strict(
                e,
                &["devices", "device-filter", "mig-enabled", "mig-devices"],
            )?;
            let enabled = e
                .get("mig-enabled")
                .and_then(Value::as_bool)
                .ok_or("missing required field 'mig-enabled'")?;
            let devices = counts(e.get("mig-devices"))?;
            if enabled && e.get("mig-devices").is_none() {
                return Err(
                    "missing required field 'mig-devices' when 'mig-enabled' is true".into(),
                );
            }
            if !enabled && devices.values().any(|c| *c > 0) {
                return Err("MIG devices included when 'mig-enabled' is false".into());
            }
            let gpus = devices_of(e, self.gpus.len(), self.pci_id)?;
            if enabled && !gpus.is_empty() && !self.mig_capable {
                return Err("MIG mode not supported on this GPU".into());
            }
            if enabled && !gpus.is_empty() && !self.fits(&devices) {
                return Err(format!("Insufficient Resources for {devices:?}"));
            }
            for i in gpus {
                let slot = out.get_mut(i).ok_or("device index out of range")?;
                *slot = Some(enabled.then(|| devices.clone()));
            }
        }
        out.into_iter()
            .map(|g| g.ok_or_else(|| "a GPU is covered by no entry".to_string()))
            .collect()
    }
}

// ---------------------------------------------------------------------------------------------
// What the components read from the API server.

/// The cluster objects NVIDIA's components read.
pub struct Cluster<'a> {
    /// Our part of the ClusterPolicy `spec` (nothing else is set in these tests).
    pub cluster_policy: &'a Value,
    /// Data of the ConfigMaps in the GPU Operator's namespace, by name (the operator's own).
    pub configmaps: &'a BTreeMap<String, BTreeMap<String, String>>,
    /// The GPU Operator's `default-mig-parted-config` layouts.
    pub default_mig: &'a BTreeMap<String, Value>,
}

impl Cluster<'_> {
    fn cp(&self, path: &str) -> Option<&str> {
        self.cluster_policy
            .pointer(path)
            .and_then(Value::as_str)
            .filter(|s| !s.is_empty())
    }

    /// The MIG strategy the device plugin and GFD run with: the ClusterPolicy's (the GPU
    /// Operator sets it as `MIG_STRATEGY`, which overrides the file), else the config file's.
    pub fn mig_strategy(&self, cfg: &DpConfig) -> String {
        let file = cfg.file_mig_strategy.as_deref();
        self.cp("/mig/strategy")
            .or(file)
            .unwrap_or("none")
            .to_string()
    }

    fn sandbox_enabled(&self) -> bool {
        self.cluster_policy.pointer("/sandboxWorkloads/enabled") == Some(&Value::Bool(true))
    }

    /// What a node runs: `container`, `vm-passthrough` or `vm-vgpu`.
    pub fn workload(&self, n: &NodeFacts) -> &'static str {
        match n.labels.get(WORKLOAD) {
            Some("vm-passthrough") if self.sandbox_enabled() => "vm-passthrough",
            Some("vm-vgpu") if self.sandbox_enabled() => "vm-vgpu",
            _ => "container",
        }
    }

    /// The layouts the MIG manager can apply: the mig-parted ConfigMap the ClusterPolicy names,
    /// else the GPU Operator's default.
    pub fn mig_layouts(&self) -> Result<BTreeMap<String, Value>, String> {
        match self.cp("/migManager/config/name") {
            None => Ok(self.default_mig.clone()),
            Some(name) => {
                let text = self
                    .configmaps
                    .get(name)
                    .and_then(|d| d.get("config.yaml"))
                    .ok_or_else(|| format!("ConfigMap {name} has no config.yaml"))?;
                named_configs(text, "mig-configs")
            }
        }
    }

    fn vgpu_configs(&self) -> Result<BTreeMap<String, Value>, String> {
        let text = match self.cp("/vgpuDeviceManager/config/name") {
            None => {
                let cm = yaml(DEFAULT_VGPU_CONFIGMAP)?;
                let t = cm.pointer("/data/config.yaml").and_then(Value::as_str);
                t.ok_or("default vGPU ConfigMap without config.yaml")?
                    .to_string()
            }
            Some(name) => self
                .configmaps
                .get(name)
                .and_then(|d| d.get("config.yaml"))
                .cloned()
                .ok_or_else(|| format!("ConfigMap {name} has no config.yaml"))?,
        };
        named_configs(&text, "vgpu-configs")
    }

    /// What the config manager loads for a node with this label, as it starts or reloads.
    fn load(&self, label: Option<&str>) -> Loaded {
        let Some(name) = self.cp("/devicePlugin/config/name") else {
            return Loaded::Config(DpConfig::default());
        };
        let Some(data) = self.configmaps.get(name) else {
            return Loaded::Crash(format!("ConfigMap {name} not found"));
        };
        let only = (data.len() == 1).then(|| data.keys().next().unwrap().as_str());
        let key = label
            .or(self.cp("/devicePlugin/config/default"))
            .or(data.contains_key("default").then_some("default"))
            .or(only);
        match key.map(|k| (k, data.get(k))) {
            Some((_, Some(text))) => match parse_device_plugin_config(text) {
                Ok(c) => Loaded::Config(c),
                Err(e) => Loaded::Crash(e),
            },
            Some((k, None)) => Loaded::Crash(format!("config key {k} not found")),
            None => Loaded::Crash("no config key".into()),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Per node.

/// What the device plugin and GFD run with.
#[derive(Debug, Clone)]
pub enum Loaded {
    Config(DpConfig),
    /// The config manager exits (missing key, rejected config): pods in CrashLoopBackOff.
    Crash(String),
}

/// NVIDIA's components on one node.
#[derive(Debug, Clone)]
pub struct NodeSide {
    pub hw: Hardware,
    pub loaded: Loaded,
    /// The MIG manager has a label change (or its start) to act on.
    mig_event: bool,
    /// The vGPU Device Manager has a label change (or its start) to act on.
    vgpu_event: bool,
    /// vGPU devices created, by type.
    vgpus: BTreeMap<String, i64>,
    /// Label keys GFD wrote last time (it removes those it no longer produces).
    gfd_keys: BTreeSet<String>,
}

/// NVIDIA's components on every node.
#[derive(Debug, Default)]
pub struct Nvidia {
    pub nodes: BTreeMap<String, NodeSide>,
}

fn is_device_plugin_resource(r: &str) -> bool {
    r.starts_with("nvidia.com/gpu") || r.starts_with("nvidia.com/mig-")
}

/// Sets the node's allocatable for one plugin's resources: `is_mine` says which are its;
/// those it no longer advertises drop to 0 (the kubelet keeps the resource).
fn advertise(n: &mut NodeFacts, is_mine: impl Fn(&str) -> bool, now: &BTreeMap<String, i64>) {
    let mut alloc: Labels = n.allocatable.iter().filter(|(k, _)| !is_mine(k)).collect();
    for (k, _) in n.allocatable.iter().filter(|(k, _)| is_mine(k)) {
        alloc.insert(k, "0");
    }
    for (k, v) in now {
        alloc.insert(k.as_str(), v.to_string());
    }
    n.allocatable = alloc;
}

impl Nvidia {
    /// The node's components as an admin left them: GPUs from GFD's first labels, a confirmed
    /// MIG layout applied, the config loaded.
    pub fn boot(&mut self, n: &NodeFacts, c: &Cluster) {
        if self.nodes.contains_key(&n.name) {
            return;
        }
        let l = &n.labels;
        let model = l.get("nvidia.com/gpu.product").unwrap_or("unknown");
        let count = l.get("nvidia.com/gpu.count").and_then(|v| v.parse().ok());
        let memory = l.get("nvidia.com/gpu.memory").and_then(|v| v.parse().ok());
        let capable = l.get("nvidia.com/mig.capable") == Some("true");
        let mut hw = Hardware::new(model, count.unwrap_or(1), memory.unwrap_or(0), capable);
        // The MIG manager has acted on a layout whose state it reported.
        let mig_event =
            l.get(MIG_CONFIG).is_some() && !matches!(l.get(MIG_STATE), Some("success" | "failed"));
        if l.get(MIG_STATE) == Some("success")
            && let Some(layout) = l.get(MIG_CONFIG)
            && let Some(gpus) = c
                .mig_layouts()
                .ok()
                .and_then(|m| m.get(layout).cloned())
                .and_then(|v| hw.apply_layout(&v).ok())
        {
            hw.gpus = gpus;
        }
        let side = NodeSide {
            hw,
            loaded: c.load(l.get(DP_CONFIG)),
            mig_event,
            vgpu_event: l.get(VGPU_CONFIG).is_some(),
            vgpus: BTreeMap::new(),
            gfd_keys: BTreeSet::new(),
        };
        self.nodes.insert(n.name.clone(), side);
    }

    /// What follows a write of ours: `before` are the node's labels and the ClusterPolicy
    /// before it. Config managers reload on a label change; the GPU Operator rolls its
    /// DaemonSets out again when their ClusterPolicy settings change; operands come and go with
    /// the node's workload.
    pub fn observe(&mut self, before: &Labels, cp_before: &Value, n: &mut NodeFacts, c: &Cluster) {
        let old = Cluster {
            cluster_policy: cp_before,
            ..*c
        };
        let side = self.nodes.get_mut(&n.name).expect("booted");
        let changed = |k: &str| before.get(k) != n.labels.get(k);
        let (dp_changed, mig_changed, vgpu_changed) = (
            changed(DP_CONFIG),
            changed(MIG_CONFIG),
            changed(VGPU_CONFIG),
        );
        let cp_changed = |p: &str| cp_before.pointer(p) != c.cluster_policy.pointer(p);
        let (was, now) = (old.workload_of(before), c.workload(n));
        if now == "container" {
            let restarted = was != "container" || cp_changed("/devicePlugin") || cp_changed("/mig");
            if dp_changed || restarted {
                side.loaded = c.load(n.labels.get(DP_CONFIG));
            }
            if mig_changed || was != "container" || cp_changed("/migManager") {
                side.mig_event = n.labels.get(MIG_CONFIG).is_some();
            }
            if was != "container" {
                // The sandbox device plugin is undeployed and the kubelet withdraws what it
                // advertised (in seconds, here at once: a node made a VM host again within
                // that window could be confirmed by the stale allocatable); the vGPU manager
                // goes with its vGPUs.
                advertise(n, |k| !is_device_plugin_resource(k), &BTreeMap::new());
                side.vgpus.clear();
            }
        }
        if now == "vm-vgpu" && (vgpu_changed || was != now || cp_changed("/vgpuDeviceManager")) {
            side.vgpu_event = n.labels.get(VGPU_CONFIG).is_some();
        }
    }

    /// The MIG manager, and on VM hosts the vGPU Device Manager and the sandbox device plugin.
    pub fn node_daemons(&mut self, n: &mut NodeFacts, c: &Cluster) {
        let side = self.nodes.get_mut(&n.name).expect("booted");
        match c.workload(n) {
            "container" => {
                if side.mig_event && side.hw.mig_capable {
                    side.mig_event = false;
                    let Some(layout) = n.labels.get(MIG_CONFIG).map(str::to_string) else {
                        return;
                    };
                    update_label(n, MIG_STATE, "pending");
                    let result = c.mig_layouts().and_then(|m| {
                        let v = m
                            .get(&layout)
                            .ok_or(format!("selected mig-config not present: {layout}"))?;
                        side.hw.apply_layout(v)
                    });
                    match result {
                        Ok(gpus) => {
                            if gpus != side.hw.gpus {
                                side.hw.gpus = gpus;
                                // Operands paused for the change start again: reload.
                                side.loaded = c.load(n.labels.get(DP_CONFIG));
                            }
                            update_label(n, MIG_STATE, "success");
                        }
                        Err(_) => update_label(n, MIG_STATE, "failed"),
                    }
                }
            }
            vm => {
                if vm == "vm-vgpu" && side.vgpu_event {
                    side.vgpu_event = false;
                    if let Some(name) = n.labels.get(VGPU_CONFIG).map(str::to_string) {
                        update_label(n, VGPU_STATE, "pending");
                        match vgpu_devices(&side.hw, &name, c) {
                            Ok(v) => {
                                side.vgpus = v;
                                update_label(n, VGPU_STATE, "success");
                            }
                            Err(_) => {
                                side.vgpus.clear();
                                update_label(n, VGPU_STATE, "failed");
                            }
                        }
                    }
                }
                // No container device plugin on a VM host.
                advertise(n, is_device_plugin_resource, &BTreeMap::new());
                let mut sandbox = BTreeMap::new();
                if n.labels.get("nvidia.com/gpu.deploy.sandbox-device-plugin") != Some("false") {
                    if vm == "vm-passthrough" {
                        let gpus = side.hw.gpus.len() as i64;
                        sandbox.insert(format!("nvidia.com/{}", side.hw.pci_name), gpus);
                    } else {
                        for (t, k) in &side.vgpus {
                            sandbox.insert(format!("nvidia.com/NVIDIA_{t}"), *k);
                        }
                    }
                }
                advertise(n, |k| !is_device_plugin_resource(k), &sandbox);
            }
        }
    }

    /// What the device plugin serves on a container node from the GPUs as they are now and the
    /// config it runs (nothing when it is off, crash-looping or refuses the config); `None` on
    /// VM hosts.
    pub fn serves(&self, n: &NodeFacts, c: &Cluster) -> Option<BTreeMap<String, i64>> {
        let side = self.nodes.get(&n.name)?;
        if c.workload(n) != "container" {
            return None;
        }
        let Loaded::Config(cfg) = &side.loaded else {
            return Some(BTreeMap::new());
        };
        let strategy = c.mig_strategy(cfg);
        let dp_on = n.labels.get("nvidia.com/gpu.deploy.device-plugin") != Some("false");
        Some(
            if dp_on && device_plugin_error(cfg, &side.hw, &strategy).is_none() {
                device_plugin_resources(&side.hw, cfg, &strategy)
            } else {
                BTreeMap::new()
            },
        )
    }

    /// GPU Feature Discovery's periodic run (and the device plugin advertising what it serves)
    /// on container nodes. Returns whether GFD labelled the node (it is not running, or crash-
    /// looping, otherwise).
    pub fn gfd(&mut self, n: &mut NodeFacts, c: &Cluster, now: i64) -> bool {
        let side = self.nodes.get_mut(&n.name).expect("booted");
        if c.workload(n) != "container" {
            return false;
        }
        let Loaded::Config(cfg) = side.loaded.clone() else {
            advertise(n, is_device_plugin_resource, &BTreeMap::new());
            return false;
        };
        let strategy = c.mig_strategy(&cfg);
        let dp_on = n.labels.get("nvidia.com/gpu.deploy.device-plugin") != Some("false");
        // The device plugin refuses what GFD still labels.
        let served = if dp_on && device_plugin_error(&cfg, &side.hw, &strategy).is_none() {
            device_plugin_resources(&side.hw, &cfg, &strategy)
        } else {
            BTreeMap::new()
        };
        advertise(n, is_device_plugin_resource, &served);
        if n.labels.get("nvidia.com/gpu.deploy.gpu-feature-discovery") == Some("false") {
            return false;
        }
        let mut labels = gfd_labels(&side.hw, &cfg, &strategy);
        labels.insert(GFD_TIMESTAMP.into(), now.to_string());
        for k in side.gfd_keys.iter().filter(|k| !labels.contains_key(*k)) {
            n.labels.remove(k);
        }
        for (k, v) in &labels {
            n.labels.insert(k.as_str(), v.as_str());
        }
        side.gfd_keys = labels.into_keys().collect();
        true
    }
}

impl Cluster<'_> {
    fn workload_of(&self, labels: &Labels) -> &'static str {
        let n = NodeFacts {
            labels: labels.clone(),
            ..Default::default()
        };
        self.workload(&n)
    }
}

/// Why the device plugin (not GFD) refuses to run this config on these GPUs: its flag check
/// (`--mig-strategy=mixed is not supported with MPS`), or MPS on MIG-enabled GPUs.
pub fn device_plugin_error(cfg: &DpConfig, hw: &Hardware, strategy: &str) -> Option<&'static str> {
    match cfg.strategy() {
        "mps" if strategy == "mixed" => {
            Some("using --mig-strategy=mixed is not supported with MPS")
        }
        "mps" if hw.mig_enabled() => Some("MPS is not supported on MIG-enabled GPUs"),
        _ => None,
    }
}

/// The vGPU devices a named vGPU config creates on these GPUs.
fn vgpu_devices(hw: &Hardware, name: &str, c: &Cluster) -> Result<BTreeMap<String, i64>, String> {
    let configs = c.vgpu_configs()?;
    let entries = configs
        .get(name)
        .ok_or(format!("config {name} not found"))?;
    let mut out = BTreeMap::new();
    for e in entries.as_array().ok_or("not a list")? {
        strict(e, &["devices", "device-filter", "vgpu-devices"])?;
        let types = counts(e.get("vgpu-devices"))?;
        if e.get("vgpu-devices").is_none() {
            return Err("missing required field 'vgpu-devices'".into());
        }
        for t in types.keys() {
            // The type's GPU family must be the board's (`A100D`: the 80 GB A100).
            let family = t.split('-').next().unwrap_or_default();
            let base = family.trim_end_matches(|ch: char| "DXLMS".contains(ch));
            let large = family.ends_with('D');
            if !hw.model.contains(base) || large != hw.model.contains("80GB") {
                return Err(format!("vGPU type {t} not supported on {}", hw.model));
            }
        }
        for _ in devices_of(e, hw.gpus.len(), hw.pci_id)? {
            for (t, k) in &types {
                *out.entry(t.clone()).or_default() += k;
            }
        }
    }
    Ok(out)
}

/// MIG devices by profile, over all GPUs.
fn mig_devices(hw: &Hardware) -> BTreeMap<String, i64> {
    let mut m = BTreeMap::new();
    for (p, k) in hw.gpus.iter().flatten().flatten() {
        if *k > 0 {
            *m.entry(p.clone()).or_default() += k;
        }
    }
    m
}

/// `mig-strategy=single` on these GPUs: the one profile all of them are split into, if valid.
fn single_profile(hw: &Hardware) -> Option<(String, i64)> {
    let all_mig = hw
        .gpus
        .iter()
        .all(|g| g.as_ref().is_some_and(|d| d.values().sum::<i64>() > 0));
    let m = mig_devices(hw);
    (all_mig && m.len() == 1).then(|| m.into_iter().next().unwrap())
}

/// What the device plugin advertises: count x replicas per resource.
fn device_plugin_resources(hw: &Hardware, cfg: &DpConfig, strategy: &str) -> BTreeMap<String, i64> {
    let mut out = BTreeMap::new();
    let mut add = |res: String, count: i64| {
        if count > 0 {
            let name = if cfg.renamed(&res) {
                format!("{res}.shared")
            } else {
                res.clone()
            };
            *out.entry(name).or_default() += count * cfg.replicas(&res);
        }
    };
    let full = hw.gpus.iter().filter(|g| g.is_none()).count() as i64;
    match strategy {
        "single" if hw.mig_enabled() => {
            if let Some((_, count)) = single_profile(hw) {
                add("nvidia.com/gpu".into(), count);
            }
        }
        "mixed" => {
            add("nvidia.com/gpu".into(), full);
            for (p, count) in mig_devices(hw) {
                add(format!("nvidia.com/mig-{p}"), count);
            }
        }
        // `none` (and `single` without MIG): every GPU as a full GPU.
        _ => add("nvidia.com/gpu".into(), hw.gpus.len() as i64),
    }
    out
}

/// GFD's labels for the GPUs under a config and MIG strategy (see the module documentation).
pub fn gfd_labels(hw: &Hardware, cfg: &DpConfig, strategy: &str) -> BTreeMap<String, String> {
    let mut l = BTreeMap::new();
    let model = hw.model.as_str();
    let gpus = hw.gpus.len() as i64;
    let any_full = hw.gpus.iter().any(Option::is_none);
    // Full GPUs (the same model: one set of labels, counting every GPU); MIG-enabled ones
    // without sharing unless some GPU has MIG off.
    resource_labels(
        &mut l,
        "nvidia.com/gpu",
        any_full.then_some(cfg),
        &[model],
        gpus,
    );
    let mut memory = hw.memory_mib;
    match strategy {
        "single" if hw.mig_enabled() => match single_profile(hw) {
            Some((p, count)) => {
                resource_labels(
                    &mut l,
                    "nvidia.com/gpu",
                    Some(cfg),
                    &[model, "MIG", &p],
                    count,
                );
                memory = hw.profile(&p).map_or(0, |p| p.1);
            }
            None => {
                l.insert(
                    "nvidia.com/gpu.product".into(),
                    format!("{model}-MIG-INVALID"),
                );
                l.insert("nvidia.com/gpu.count".into(), "0".into());
                l.insert("nvidia.com/gpu.replicas".into(), "0".into());
                memory = 0;
            }
        },
        "mixed" => {
            for (p, count) in mig_devices(hw) {
                let res = format!("nvidia.com/mig-{p}");
                resource_labels(&mut l, &res, Some(cfg), &[model, "MIG", &p], count);
                let mem = hw.profile(&p).map_or(0, |p| p.1);
                l.insert(format!("{res}.memory"), mem.to_string());
            }
        }
        _ => {}
    }
    l.insert("nvidia.com/gpu.memory".into(), memory.to_string());
    l.insert("nvidia.com/mig.capable".into(), hw.mig_capable.to_string());
    if strategy != "none" {
        l.insert("nvidia.com/mig.strategy".into(), strategy.to_string());
    }
    let mps = cfg.strategy() == "mps" && !hw.mig_enabled();
    l.insert("nvidia.com/mps.capable".into(), mps.to_string());
    l
}

/// GFD's `<resource>.{product,count,replicas,sharing-strategy}`; `sharing: None` labels without
/// sharing (replicas 0), as GFD does for MIG-enabled full GPUs.
fn resource_labels(
    l: &mut BTreeMap<String, String>,
    res: &str,
    sharing: Option<&DpConfig>,
    parts: &[&str],
    count: i64,
) {
    let replicas = sharing.map_or(0, |c| c.replicas(res));
    let mut product = parts.join("-");
    if replicas > 1 && !sharing.is_some_and(|c| c.renamed(res)) {
        product.push_str("-SHARED");
    }
    let strategy = match sharing {
        Some(c) if replicas > 1 => c.strategy(),
        _ => "none",
    };
    for (k, v) in [
        ("product", product),
        ("count", count.to_string()),
        ("replicas", replicas.to_string()),
        ("sharing-strategy", strategy.to_string()),
    ] {
        l.insert(format!("{res}.{k}"), v);
    }
}
