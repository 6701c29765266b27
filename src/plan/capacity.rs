//! Capacity's vocabulary: what one node offers ([`NodeCapacity`]: GPUs, schedulable replicas,
//! memory and threads per client, memory isolation), what the device plugin advertises
//! ([`Advertised`]), how a policy's total adds up; and the arithmetic of MIG layouts (which
//! instances a named or custom layout gives a node's GPUs) that the MIG backend and demand
//! planning share. Each backend answers its own nodes' capacity in `backend/`.

use std::collections::BTreeMap;

use crate::api::crd::{Capacity, Mig, MigDeviceGroup, MigStrategy, TimeSlicing};
use crate::api::names::LABEL_GPU_PRODUCT;
use crate::nvidia::mig::{self, MigProfile};
use crate::nvidia::vgpu::VgpuConfigEntry;
use crate::nvidia::{self, MIG_DISABLED_LAYOUT};

use super::facts::NodeFacts;
use super::facts::{gpu_count, gpu_memory_mib};

/// GPUs a custom layout's groups list by index (a group without indices covers the rest).
fn listed_gpus(groups: &[MigDeviceGroup]) -> i64 {
    groups
        .iter()
        .filter_map(|g| g.indices())
        .map(|d| d.len() as i64)
        .sum()
}

/// MIG devices a custom layout's group creates on each of its GPUs.
fn group_instances(g: &MigDeviceGroup) -> i64 {
    g.mig_devices.values().map(|c| *c as i64).sum()
}

/// The entries of a named layout (one per GPU model, by `device-filter`).
fn layout_entries<'a>(
    mig: &Mig,
    base: Option<&'a BTreeMap<String, serde_json::Value>>,
) -> Option<&'a Vec<serde_json::Value>> {
    base?.get(mig.layout.as_deref()?)?.as_array()
}

/// The MIG devices one entry of a named layout creates on each GPU.
fn entry_devices(e: &serde_json::Value) -> Option<Vec<(MigProfile, i64)>> {
    let devs = e.get("mig-devices")?.as_object()?;
    devs.iter()
        .map(|(p, c)| Some((mig::parse_mig_profile(p)?, c.as_i64()?)))
        .collect()
}

fn total(devices: &[(MigProfile, i64)]) -> i64 {
    devices.iter().map(|(_, c)| c).sum()
}

/// MIG-instance counts of a node under a MIG policy, when known.
pub(crate) fn mig_instances(
    mig: &Mig,
    base: Option<&BTreeMap<String, serde_json::Value>>,
    gpus: i64,
    gpu: Gpu,
) -> Option<Vec<(MigProfile, i64)>> {
    mig_instances_known(mig, base, gpus, gpu).map(|(i, _)| i)
}

/// What GPU Feature Discovery says of a node's GPUs that picks a named layout's entry: the
/// product (through its PCI device IDs, which the entries' `device-filter` names) and memory.
#[derive(Clone, Copy, Default)]
pub(crate) struct Gpu<'a> {
    product: Option<&'a str>,
    memory_mib: Option<i64>,
}

impl<'a> Gpu<'a> {
    pub(crate) fn of(node: &'a NodeFacts) -> Self {
        Gpu {
            product: node.labels.get(LABEL_GPU_PRODUCT),
            memory_mib: gpu_memory_mib(node),
        }
    }

    /// PCI device IDs of the GPU model, when the product names a model we know.
    fn pci_ids(&self) -> Option<&'static [u32]> {
        let m = nvidia::geometry::model_for(self.product?, self.memory_mib.map(|m| m as u64))?;
        Some(m.pci_device_ids)
    }
}

/// Whether a layout entry applies to a GPU with one of `ids`: it has no `device-filter`, or
/// its filter names one of them.
fn entry_applies(e: &serde_json::Value, ids: &[u32]) -> bool {
    let parse = |v: &serde_json::Value| {
        v.as_str().and_then(|s| {
            u32::from_str_radix(s.trim_start_matches("0x").trim_start_matches("0X"), 16).ok()
        })
    };
    match e.get("device-filter") {
        None => true,
        Some(serde_json::Value::Array(a)) => a.iter().filter_map(parse).any(|id| ids.contains(&id)),
        Some(v) => parse(v).is_some_and(|id| ids.contains(&id)),
    }
}

/// MIG-instance counts of a node under a MIG policy, when known, and whether they are exact:
/// `false` when a named layout's entry for the node's GPU model was inferred from memory (the
/// largest of the entries that fit).
fn mig_instances_known(
    mig: &Mig,
    base: Option<&BTreeMap<String, serde_json::Value>>,
    gpus: i64,
    gpu: Gpu,
) -> Option<(Vec<(MigProfile, i64)>, bool)> {
    let candidates = mig_candidates(mig, base, gpus, gpu)?;
    let exact = candidates.len() == 1;
    let chosen = candidates.into_iter().max_by_key(|c| total(c))?;
    Some((chosen, exact))
}

/// The MIG-instance counts a node may get under a MIG policy, over all its GPUs: one set for a
/// custom layout and for a named layout whose entries all agree; for a named layout with one
/// entry per GPU model (by PCI device ID, which node labels do not carry), each different entry
/// that fits this node's GPUs (see `entry_fits`). `None` when unknown.
pub(crate) fn mig_candidates(
    mig: &Mig,
    base: Option<&BTreeMap<String, serde_json::Value>>,
    gpus: i64,
    gpu: Gpu,
) -> Option<Vec<Vec<(MigProfile, i64)>>> {
    let memory_mib = gpu.memory_mib;
    let mut out = Vec::new();
    if let Some(groups) = &mig.custom_layout {
        let listed = listed_gpus(groups);
        for g in groups.iter().filter(|g| g.mig_enabled) {
            let n = g
                .indices()
                .map_or((gpus - listed).max(0), |d| d.len() as i64);
            for (p, c) in &g.mig_devices {
                out.push((mig::parse_mig_profile(p)?, n * *c as i64));
            }
        }
        return Some(vec![out]);
    }
    if mig.layout.as_deref()? == MIG_DISABLED_LAYOUT {
        return Some(vec![out]);
    }
    let entries = layout_entries(mig, base)?;
    // The entries for this GPU model, when the product names a model whose PCI IDs we know and
    // an entry's filter names one; otherwise every entry may be the one.
    let for_model: Vec<&serde_json::Value> = gpu
        .pci_ids()
        .map(|ids| entries.iter().filter(|e| entry_applies(e, ids)).collect())
        .unwrap_or_default();
    let chosen: Vec<&serde_json::Value> = if for_model.is_empty() {
        entries.iter().collect()
    } else {
        for_model
    };
    let candidates: Vec<Vec<(MigProfile, i64)>> = chosen
        .into_iter()
        .map(|e| {
            (e.get("devices").and_then(|d| d.as_str()) == Some("all"))
                .then(|| entry_devices(e))
                .flatten()
        })
        .collect::<Option<_>>()?;
    let mut fitting: Vec<Vec<(MigProfile, i64)>> = if candidates.windows(2).all(|w| w[0] == w[1]) {
        candidates.into_iter().take(1).collect()
    } else {
        let mem = memory_mib?;
        candidates
            .into_iter()
            .filter(|c| entry_fits(c, mem))
            .collect()
    };
    fitting.dedup();
    if fitting.is_empty() {
        return None;
    }
    Some(
        fitting
            .into_iter()
            .map(|c| c.into_iter().map(|(p, n)| (p, gpus * n)).collect())
            .collect(),
    )
}

/// The node's physical GPUs under a MIG policy. With the `single` strategy GPU Feature Discovery
/// relabels the node with its MIG devices (`nvidia.com/gpu.product` gets `-MIG-<profile>`,
/// `nvidia.com/gpu.count` counts the instances), so the physical count is the instances divided
/// by those per GPU: the named layout's entry that divides them (the largest, as the memory of
/// a relabelled node no longer tells the GPU model), or a custom layout's groups.
pub(crate) fn physical_gpus(
    mig: &Mig,
    base: Option<&BTreeMap<String, serde_json::Value>>,
    n: &NodeFacts,
    count: i64,
    memory_mib: Option<i64>,
) -> i64 {
    let relabelled = n
        .labels
        .get(LABEL_GPU_PRODUCT)
        .is_some_and(|p| p.contains("-MIG-"));
    if !relabelled || count == 0 {
        return count;
    }
    if let Some(groups) = &mig.custom_layout {
        // Every GPU is in one group: explicit indices, or `all` for the rest.
        let enabled = || groups.iter().filter(|g| g.mig_enabled);
        let instances_listed: i64 = enabled()
            .filter_map(|g| Some(g.indices()?.len() as i64 * group_instances(g)))
            .sum();
        let all: i64 = enabled()
            .filter(|g| g.indices().is_none())
            .map(group_instances)
            .sum();
        let listed = listed_gpus(groups);
        return if all > 0 {
            listed + (count - instances_listed) / all
        } else {
            listed
        };
    }
    let Some(entries) = layout_entries(mig, base) else {
        return count;
    };
    let divides = |k: &i64| *k > 0 && count % k == 0;
    let fitting = memory_mib.and_then(|m| {
        let gpu = Gpu {
            product: None,
            memory_mib: Some(m),
        };
        mig_instances(mig, base, 1, gpu)
            .map(|e| total(&e))
            .filter(divides)
    });
    let largest = || {
        entries
            .iter()
            .filter_map(entry_devices)
            .map(|e| total(&e))
            .filter(divides)
            .max()
    };
    fitting.or_else(largest).map_or(count, |k| count / k)
}

/// Whether one GPU's MIG devices fit a GPU with `memory_mib`: MIG cuts memory in 8 slices and
/// compute in 7, and a profile takes as many memory slices as its memory needs.
fn entry_fits(devices: &[(MigProfile, i64)], memory_mib: i64) -> bool {
    let slice_gb = memory_mib as f64 / 1024.0 / 8.0;
    let (mut memory, mut compute) = (0.0, 0i64);
    for (p, n) in devices {
        memory += (p.memory_gb as f64 / slice_gb).round().max(1.0) * *n as f64;
        compute += p.slices as i64 * n;
    }
    memory <= 8.0 && compute <= mig::MAX_COMPUTE_SLICES as i64
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

/// The vGPU devices a layout creates on a node of `gpus` GPUs, by vGPU type (`None`: the layout
/// is unknown). An entry applies to every GPU (`devices: all`, without a device filter, whose
/// GPUs are not known here) or to the GPU indices it lists. The one count for a node's
/// capacity and an instance type's (the Karpenter overlays).
pub fn vgpu_devices(entries: &[VgpuConfigEntry], gpus: i64) -> Option<BTreeMap<&str, i64>> {
    if entries.is_empty() {
        return None;
    }
    let mut out = BTreeMap::new();
    for g in 0..gpus {
        for e in entries {
            let on = match &e.devices {
                nvidia::MigDevices::All(_) => e.device_filter.is_none(),
                nvidia::MigDevices::Indices(d) => d.contains(&(g as i32)),
            };
            for (t, c) in e.vgpu_devices.iter().filter(|_| on) {
                *out.entry(t.as_str()).or_default() += i64::from(*c);
            }
        }
    }
    Some(out)
}

/// What one applied node contributes to its policy's capacity.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NodeCapacity {
    pub physical_gpus: i64,
    /// Replicas the node advertises; `None` when the MIG layout's instance count is unknown.
    pub schedulable: Option<i64>,
    pub memory_per_client_mib: Option<i64>,
    pub threads_per_client_percent: Option<i64>,
    pub memory_isolation: bool,
}

/// Shorthand for the table below.
pub(crate) fn cap(
    physical_gpus: i64,
    schedulable: Option<i64>,
    memory_per_client_mib: Option<i64>,
    threads_per_client_percent: Option<i64>,
    memory_isolation: bool,
) -> NodeCapacity {
    NodeCapacity {
        physical_gpus,
        schedulable,
        memory_per_client_mib,
        threads_per_client_percent,
        memory_isolation,
    }
}

/// The most replicas time-slicing settings give any resource (`replicas`, or the largest of
/// the per-resource entries).
pub fn most_replicas(ts: &TimeSlicing) -> i32 {
    ts.replicas
        .unwrap_or_else(|| ts.resources.iter().map(|r| r.replicas).max().unwrap_or(1))
}

/// Replicas of each device of `res` under time-slicing settings (1: not replicated). Without
/// per-resource entries `replicas` covers every resource; with them, only those they name.
pub fn ts_replicas(ts: &TimeSlicing, res: &str) -> i64 {
    let listed = || {
        ts.resources
            .iter()
            .find(|x| nvidia::qualify_resource(&x.name) == res)
            .map(|x| x.replicas)
    };
    let r = if ts.resources.is_empty() {
        ts.replicas
    } else {
        listed()
    };
    r.unwrap_or(1) as i64
}

/// The name the device plugin advertises `res` under: `<res>.shared` when replicated and renamed
/// by default (a per-resource `rename` is ignored at runtime by the device plugin).
pub(crate) fn advertised_name(res: &str, replicas: i64, rename_by_default: bool) -> String {
    if replicas > 1 && rename_by_default {
        format!("{res}.shared")
    } else {
        res.to_string()
    }
}

/// What NVIDIA's device plugin advertises (the node's allocatable) once it runs a policy's
/// config on this node: units per resource, devices x replicas, as the smallest and largest
/// count it can be (equal when they follow from the spec and GPU Feature Discovery's GPU count;
/// a range for a named MIG layout whose entry for this GPU model is inferred from the GPUs'
/// memory, over the entries that fit).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Advertised {
    pub resources: BTreeMap<String, (i64, i64)>,
}

/// The GPUs a MIG layout leaves with MIG off: every GPU under `all-disabled`, those of a custom
/// layout's disabled groups.
pub(crate) fn mig_disabled_gpus(mig: &Mig, gpus: i64) -> i64 {
    if let Some(groups) = &mig.custom_layout {
        let listed = listed_gpus(groups);
        return groups
            .iter()
            .filter(|g| !g.mig_enabled)
            .map(|g| {
                g.indices()
                    .map_or((gpus - listed).max(0), |d| d.len() as i64)
            })
            .sum();
    }
    if mig.layout.as_deref() == Some(MIG_DISABLED_LAYOUT) {
        gpus
    } else {
        0
    }
}

/// The device plugin's resources for these MIG instances: per profile under `mixed`, all as
/// `nvidia.com/gpu` under `single`; times the time-slicing replicas, renamed when asked.
pub(crate) fn mig_resources(mig: &Mig, instances: &[(MigProfile, i64)]) -> BTreeMap<String, i64> {
    let ts = mig.time_slicing.as_ref();
    let mut resources = BTreeMap::new();
    for (p, n) in instances.iter().filter(|(_, n)| *n > 0) {
        let res = instance_resource(mig, p);
        let r = ts.map_or(1, |t| ts_replicas(t, &res));
        let name = advertised_name(&res, r, ts.is_some_and(|t| t.rename_by_default));
        *resources.entry(name).or_insert(0) += n * r;
    }
    resources
}

/// The device plugin's resource for one MIG profile: its own under `mixed`, `nvidia.com/gpu`
/// under `single`.
pub(crate) fn instance_resource(mig: &Mig, p: &MigProfile) -> String {
    match mig.mig_strategy {
        MigStrategy::Single => nvidia::GPU_RESOURCE.to_string(),
        MigStrategy::Mixed => nvidia::mig_resource(&profile_name(p)),
    }
}

/// Adds a node's capacity to its policy's total: GPUs and replicas add up; memory and threads per
/// client are the smallest of any node (what a client can count on); isolation holds only if it
/// holds on every node. Returns false when the node's replicas are unknown.
pub fn add_capacity(total: &mut Capacity, n: &NodeCapacity) -> bool {
    total.physical_gpus = total.physical_gpus.saturating_add(n.physical_gpus);
    if let Some(m) = n.memory_per_client_mib {
        total.memory_per_client_mib = Some(total.memory_per_client_mib.map_or(m, |x| x.min(m)));
    }
    if let Some(t) = n.threads_per_client_percent {
        total.threads_per_client_percent =
            Some(total.threads_per_client_percent.map_or(t, |x| x.min(t)));
    }
    total.memory_isolation &= n.memory_isolation;
    match n.schedulable {
        Some(s) => {
            total.schedulable_replicas = total.schedulable_replicas.saturating_add(s);
            true
        }
        None => false,
    }
}

/// The device plugin's resources on `node` under the MIG policy `mig` with its layout replaced by
/// the named `layout` (`None`: its own), when exactly known: the layout's entry for the node's
/// GPU model is the only one that may apply.
pub fn layout_resources(
    mig: &Mig,
    layout: Option<&str>,
    node: &NodeFacts,
    base: Option<&BTreeMap<String, serde_json::Value>>,
) -> Option<BTreeMap<String, i64>> {
    let count = gpu_count(node)?;
    let owned;
    let mig = match layout {
        Some(l) => {
            owned = mig.with_layout(l);
            &owned
        }
        None => mig,
    };
    let gpus = physical_gpus(mig, base, node, count, gpu_memory_mib(node));
    let c = mig_candidates(mig, base, gpus, Gpu::of(node))?;
    (c.len() == 1).then(|| mig_resources(mig, &c[0]))
}

/// Whether `layout` (`None`: the policy's own) turns MIG on on every GPU: a custom layout whose
/// groups all enable it, or a named layout whose entries all do. `false` when unknown.
pub fn mig_on_every_gpu(
    mig: &Mig,
    layout: Option<&str>,
    base: Option<&BTreeMap<String, serde_json::Value>>,
) -> bool {
    let owned;
    let mig = match layout {
        Some(l) => {
            owned = mig.with_layout(l);
            &owned
        }
        None => mig,
    };
    if let Some(groups) = &mig.custom_layout {
        return groups.iter().all(|g| g.mig_enabled);
    }
    if mig.layout.as_deref() == Some(MIG_DISABLED_LAYOUT) {
        return false;
    }
    layout_entries(mig, base).is_some_and(|entries| {
        entries
            .iter()
            .all(|e| e.get("mig-enabled").and_then(serde_json::Value::as_bool) == Some(true))
    })
}

pub(crate) fn profile_name(p: &MigProfile) -> String {
    match p.compute {
        Some(c) => format!("{c}c.{}g.{}gb", p.slices, p.memory_gb),
        None => format!("{}g.{}gb", p.slices, p.memory_gb),
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A MIG setting of the named layout, `single`, nothing else set.
    pub(crate) fn named(layout: &str) -> Mig {
        Mig {
            mig_strategy: MigStrategy::Single,
            layout: Some(layout.into()),
            custom_layout: None,
            time_slicing: None,
            proceed_with_busy_gpus: false,
            dynamic: None,
        }
    }

    #[test]
    fn a_named_layout_per_gpu_model_counts_what_fits_the_nodes_gpus() {
        // NVIDIA's all-1g.10gb: 7 per GPU on 80 GB models, 4 on 40 GB ones (by PCI device ID).
        let base = crate::nvidia::default_mig_configs();
        let count = |product, memory_mib| {
            let gpu = Gpu {
                product,
                memory_mib,
            };
            mig_instances(&named("all-1g.10gb"), Some(&base), 8, gpu)
                .map(|v| v.iter().map(|(_, n)| n).sum::<i64>())
        };
        assert_eq!(count(None, Some(81920)), Some(56));
        assert_eq!(count(None, Some(40960)), Some(32));
        // Without the GPU's memory the models cannot be told apart.
        assert_eq!(count(None, None), None);
        // One entry for every model: no memory needed.
        assert_eq!(
            mig_instances(&named("all-disabled"), Some(&base), 8, Gpu::default()),
            Some(vec![])
        );
    }
}
