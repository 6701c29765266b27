//! The MIG backend's part of the per-node transition: a node reaches its layout through the MIG
//! manager with sharing off, with idle GPUs (unless the policy opts out), and a named layout
//! whose content changed since the node was configured is re-applied only when the admin asks.

use std::collections::{BTreeMap, BTreeSet};

use crate::api::crd::{GpuSharingPolicySpec, MigStrategy, Strategy};
use crate::api::names::*;
use crate::api::state::{HoldReason, NodeState};
use crate::nvidia::state::{ConfigState, GfdReport};
use crate::nvidia::{self, DEFAULT_KEY, MIG_DISABLED_LAYOUT};

use crate::plan::capacity::{
    Advertised, Gpu, NodeCapacity, advertised_name, cap, instance_resource, mig_candidates,
    mig_disabled_gpus, mig_instances, mig_resources, most_replicas, physical_gpus, ts_replicas,
};
use crate::plan::decision::{Decision, Env, busy_msg, gfd_not_reported, hold, mig_of, wait, write};
use crate::plan::facts::{NodeFacts, gpu_count, gpu_memory_mib};
use crate::plan::policies::Prepared;

/// The layout this node should run: the policy's, or the pre-upgrade `custom-<policy>` name the
/// node still carries while its content is the same (no reconfiguration for a new name).
fn target_layout(n: &NodeFacts, w: &Prepared, layout: &str, env: &Env) -> String {
    if let Some((_, hash)) = custom_of(w, layout) {
        let legacy = nvidia::legacy_custom_layout_name(&w.name);
        let same = (env.layout_hash)(&legacy).as_ref() == Some(hash);
        if n.labels.get(LABEL_MIG_CONFIG) == Some(legacy.as_str()) && same {
            return legacy;
        }
    }
    layout.to_string()
}

/// The policy's custom layout, when `layout` is it.
fn custom_of<'w>(
    w: &'w Prepared,
    layout: &str,
) -> Option<&'w (Vec<nvidia::MigConfigEntry>, String)> {
    w.mig()
        .filter(|m| m.layout == layout)
        .and_then(|m| m.custom.as_ref())
}

/// A named layout whose content changed since we labelled the node: `(then, now)` hashes.
fn stale_layout(n: &NodeFacts, w: &Prepared, env: &Env, layout: &str) -> Option<(String, String)> {
    if custom_of(w, layout).is_some() || !mig_of(n).confirmed(layout) {
        return None;
    }
    let (l, then) = n.annotations.get(ANNOTATION_MIG_LAYOUT)?.rsplit_once('@')?;
    let now = (env.layout_hash)(layout)?;
    (l == layout && now != then).then(|| (then.to_string(), now))
}

/// The transition of a node governed by a MIG policy towards its device-plugin config `key`
/// and MIG `layout`.
pub fn decide(
    n: &NodeFacts,
    w: &Prepared,
    key: &str,
    layout: &str,
    env: &Env,
    busy: bool,
) -> Decision {
    let layout = target_layout(n, w, layout, env);
    let mig = mig_of(n);
    let dp = n.labels.get(LABEL_DEVICE_PLUGIN_CONFIG);
    let sharing_on = dp.is_some_and(|k| k != DEFAULT_KEY);
    if mig.layout == Some(layout.as_str()) && mig.failed(env.mig_stuck) {
        return hold(
            NodeState::Failed,
            format!(
                "MIG manager reported failed (or stayed pending past the timeout) for layout {layout}; node left untouched"
            ),
        );
    }
    if let Some((then, now)) = stale_layout(n, w, env, &layout) {
        return if !w.reapply_requested() {
            hold(
                NodeState::Stale,
                format!(
                    "layout {layout} changed content since this node was configured ({then} -> {now}); the MIG manager does not re-read an unchanged label: annotate the policy with {ANNOTATION_REAPPLY_MIG}=true to re-apply it through {MIG_DISABLED_LAYOUT}"
                ),
            )
        } else if busy {
            wait(HoldReason::WaitingForIdleGPUs, busy_msg(env.gpu_pods))
        } else if sharing_on {
            let msg = format!("removing the sharing config before re-applying layout {layout}");
            write(NodeState::Pending, msg, DEFAULT_KEY, Some(layout))
        } else {
            let msg = format!(
                "re-applying layout {layout} (its content changed) through {MIG_DISABLED_LAYOUT}"
            );
            write(
                NodeState::Pending,
                msg,
                DEFAULT_KEY,
                Some(MIG_DISABLED_LAYOUT.into()),
            )
        };
    }
    if w.reapply_requested()
        && mig.layout == Some(MIG_DISABLED_LAYOUT)
        && mig.state == Some(ConfigState::Pending)
    {
        // A re-apply goes through a confirmed all-disabled: the MIG manager skips a layout it
        // believes applied, so flipping straight back would change nothing.
        let msg = format!(
            "waiting for {MIG_DISABLED_LAYOUT} to be confirmed before re-applying layout {layout}"
        );
        return write(
            NodeState::Pending,
            msg,
            DEFAULT_KEY,
            Some(MIG_DISABLED_LAYOUT.into()),
        );
    }
    if mig.confirmed(&layout) {
        write(NodeState::Applied, "", key, Some(layout))
    } else if mig.layout != Some(layout.as_str()) && busy {
        // Idle GPUs are needed to change the layout: hold everything.
        wait(HoldReason::WaitingForIdleGPUs, busy_msg(env.gpu_pods))
    } else if dp.is_some_and(|k| k != DEFAULT_KEY && k != key) {
        // First take the sharing config off; the layout changes on a later step.
        let held = n
            .owned
            .contains(LABEL_MIG_CONFIG)
            .then(|| mig.layout.map(str::to_string))
            .flatten();
        let msg = "removing the sharing config before changing the MIG layout";
        write(NodeState::Pending, msg, DEFAULT_KEY, held)
    } else {
        // Sharing stays off while the layout changes.
        let msg = format!("waiting for MIG layout {layout}");
        write(NodeState::Pending, msg, DEFAULT_KEY, Some(layout))
    }
}

/// Why a MIG policy's node is not confirmed yet: GPU Feature Discovery has not relabelled since
/// our config write, or its report does not match ([`gfd_unconfirmed`]); or the ClusterPolicy's
/// MIG strategy (`cluster`) is still another (it is switching back).
pub fn unconfirmed(
    n: &NodeFacts,
    w: &Prepared,
    config: (&str, Option<&str>),
    cluster: Option<&str>,
) -> Option<String> {
    gfd_not_reported(n, config)
        .or_else(|| gfd_unconfirmed(n, w, &GfdReport::read(n.labels.iter())))
        .or_else(|| strategy_switching(w, cluster))
}

/// The device plugin and GFD take their MIG strategy from the ClusterPolicy, cluster-wide:
/// while it says another strategy than a MIG policy's (it is switching back, after a policy of
/// the other strategy governed nodes), the node serves the other resources, whatever GFD last
/// reported before the switch.
fn strategy_switching(w: &Prepared, cluster: Option<&str>) -> Option<String> {
    let want = w.spec.mig.as_ref()?.mig_strategy.as_str();
    let now = cluster?;
    (now != want).then(|| {
        format!(
            "waiting for the ClusterPolicy's mig.strategy to become {want} (it is {now}; it applies cluster-wide)"
        )
    })
}

/// Why GPU Feature Discovery's report does not confirm a MIG policy's node yet: the
/// ClusterPolicy's MIG strategy (cluster-wide) the device plugin runs with, and, when MIG
/// instances are time-sliced, their replicas.
fn gfd_unconfirmed(n: &NodeFacts, w: &Prepared, gfd: &GfdReport) -> Option<String> {
    let mig = w.spec.mig.as_ref();
    let is_mig = w.spec.strategy == Strategy::Mig;
    // The device plugin takes its MIG strategy from the ClusterPolicy (cluster-wide), which
    // may still be switching back: until GFD reports the policy's, the node serves the other.
    if let (true, Some(want)) = (is_mig, mig.map(|m| m.mig_strategy.as_str()))
        && let Some(got) = n.labels.get(LABEL_GFD_MIG_STRATEGY)
        && got != want
    {
        return Some(format!(
            "waiting for GPU Feature Discovery to report {LABEL_GFD_MIG_STRATEGY}={want} (it reports {got}; the ClusterPolicy's mig.strategy applies cluster-wide)"
        ));
    }
    let expected = replicas(w.spec) as i64;
    let ts = mig.and_then(|m| m.time_slicing.as_ref());
    let mixed = mig.is_some_and(|m| m.mig_strategy == MigStrategy::Mixed);
    if is_mig && ts.is_some() && mixed {
        // Under `mixed` GFD reports each MIG profile's replicas on its own resource
        // (`nvidia.com/mig-<profile>.replicas`); the MIG-enabled GPUs themselves are labelled
        // without sharing (`nvidia.com/gpu.replicas=0`). A profile the config does not share
        // (resources that name others) has 1.
        let wanted = |k: &str| match ts {
            Some(ts) => ts_replicas(ts, k.trim_end_matches(".replicas")),
            None => expected,
        };
        let wrong: Vec<String> = gfd
            .mig_replicas
            .iter()
            .filter(|(k, v)| v.parse::<i64>().ok() != Some(wanted(k)))
            .map(|(k, v)| format!("{k}={v}, expected {}", wanted(k)))
            .collect();
        return (!wrong.is_empty())
            .then(|| format!("GPU Feature Discovery reports {}", wrong.join(", ")));
    }
    // Without time-slicing GFD reports 0 or 1 for MIG: nothing to compare.
    if is_mig && ts.is_none() {
        return None;
    }
    super::sharing::replicas_unconfirmed(w.spec.strategy, gfd, expected)
}

/// Replicas per MIG instance: the time-slicing replicas (the most any resource gets), else 1.
pub fn replicas(spec: &GpuSharingPolicySpec) -> i32 {
    spec.mig
        .as_ref()
        .and_then(|m| m.time_slicing.as_ref())
        .map_or(1, most_replicas)
}

/// What the device plugin advertises on `node` under the MIG settings of `spec` (see
/// [`Advertised`]): per profile under `mixed`, as `nvidia.com/gpu` under `single`, GPUs with MIG
/// off served whole; a range over the entries a named layout may apply. `None` without GPU
/// Feature Discovery's GPU count, or for a layout we cannot read.
pub fn advertises(
    spec: &GpuSharingPolicySpec,
    node: &NodeFacts,
    base: Option<&BTreeMap<String, serde_json::Value>>,
) -> Option<Advertised> {
    let count = gpu_count(node)?;
    let mig = spec.mig.as_ref()?;
    let gpu = nvidia::GPU_RESOURCE;
    let mem = gpu_memory_mib(node);
    let gpus = physical_gpus(mig, base, node, count, mem);
    let candidates = mig_candidates(mig, base, gpus, Gpu::of(node))?;
    // GPUs with MIG off are served whole, as `nvidia.com/gpu`, under either strategy.
    let whole = mig_disabled_gpus(mig, gpus);
    let per: Vec<BTreeMap<String, i64>> = candidates
        .iter()
        .map(|c| {
            let mut r = mig_resources(mig, c);
            if whole > 0 {
                let ts = mig.time_slicing.as_ref();
                let listed = ts
                    .and_then(|t| {
                        t.resources
                            .iter()
                            .find(|x| nvidia::qualify_resource(&x.name) == gpu)
                    })
                    .map_or(1, |x| x.replicas as i64);
                let name = advertised_name(gpu, listed, ts.is_some_and(|t| t.rename_by_default));
                *r.entry(name).or_insert(0) += whole * listed;
            }
            r
        })
        .collect();
    let names: BTreeSet<&String> = per.iter().flat_map(|m| m.keys()).collect();
    let resources: BTreeMap<String, (i64, i64)> = names
        .into_iter()
        .map(|r| {
            let counts = per.iter().map(|m| m.get(r).copied().unwrap_or(0));
            let min = counts.clone().min().unwrap_or(0);
            let max = counts.max().unwrap_or(0);
            (r.clone(), (min, max))
        })
        .collect();
    (!resources.is_empty()).then_some(Advertised { resources })
}

/// One node's capacity under the MIG settings of `spec`: its instances (times the
/// time-slicing replicas), the smallest instance's memory and compute share; isolated unless
/// time-sliced. Unknown replicas when the layout's instances are.
pub fn capacity(
    spec: &GpuSharingPolicySpec,
    node: &NodeFacts,
    base: Option<&BTreeMap<String, serde_json::Value>>,
) -> NodeCapacity {
    let gpus = gpu_count(node).unwrap_or(0);
    let mem = gpu_memory_mib(node);
    let Some(mig) = spec.mig.as_ref() else {
        return cap(gpus, None, None, None, true);
    };
    let gpus = physical_gpus(mig, base, node, gpus, mem);
    let Some(instances) = mig_instances(mig, base, gpus, Gpu::of(node)) else {
        return cap(gpus, None, None, None, true);
    };
    let ts = mig.time_slicing.as_ref();
    let mut total = 0;
    let mut min_mem: Option<i64> = None;
    let mut min_threads: Option<i64> = None;
    for (p, n) in &instances {
        let r = ts.map_or(1, |t| ts_replicas(t, &instance_resource(mig, p)));
        total += n * r;
        let m = p.memory_gb as i64 * 1024;
        min_mem = Some(min_mem.map_or(m, |x| x.min(m)));
        let t =
            (p.compute.unwrap_or(p.slices) as i64 * 100) / nvidia::mig::MAX_COMPUTE_SLICES as i64;
        min_threads = Some(min_threads.map_or(t, |x| x.min(t)));
    }
    cap(gpus, Some(total), min_mem, min_threads, ts.is_none())
}

/// Whether clients are isolated in memory: MIG instances are, unless time-sliced.
pub fn memory_isolation(spec: &GpuSharingPolicySpec) -> bool {
    spec.mig.as_ref().is_none_or(|m| m.time_slicing.is_none())
}

#[cfg(test)]
mod capacity_tests {
    use super::*;
    use crate::api::crd::{Mig, Strategy};
    use crate::api::names::{LABEL_GPU_COUNT, LABEL_GPU_MEMORY, LABEL_GPU_PRODUCT};
    use crate::plan::capacity::tests::named;
    use crate::plan::labels::Labels;

    /// With GPU Feature Discovery's product the entry is the one whose `device-filter` names
    /// the model's PCI device ID, as mig-parted picks it: 7 x 1g.10gb on an A100 80GB, where
    /// memory alone leaves 4 (the 40 GB models' entry) to 7.
    #[test]
    fn the_product_picks_a_named_layouts_entry_by_pci_device_id() {
        let base = crate::nvidia::default_mig_configs();
        let mig = Mig {
            mig_strategy: MigStrategy::Mixed,
            ..named("all-1g.10gb")
        };
        let node = |product: &str, memory: &str| NodeFacts {
            labels: [
                (LABEL_GPU_PRODUCT, product),
                (LABEL_GPU_MEMORY, memory),
                (LABEL_GPU_COUNT, "8"),
            ]
            .into_iter()
            .collect(),
            ..Default::default()
        };
        let spec = GpuSharingPolicySpec {
            node_selector: Default::default(),
            strategy: Strategy::Mig,
            mig: Some(mig),
            ..crate::api::yaml::from_str("{nodeSelector: {}, strategy: exclusive}").unwrap()
        };
        let advertised = |n: &NodeFacts| advertises(&spec, n, Some(&base)).unwrap().resources;
        assert_eq!(
            advertised(&node("NVIDIA-A100-SXM4-80GB", "81920"))["nvidia.com/mig-1g.10gb"],
            (56, 56)
        );
        assert_eq!(
            advertised(&node("NVIDIA-A100-SXM4-40GB", "40960"))["nvidia.com/mig-1g.10gb"],
            (32, 32)
        );
        // A product we have no model for: the entries that fit its memory, as before.
        assert_eq!(
            advertised(&node("NVIDIA-Future-GPU", "81920"))["nvidia.com/mig-1g.10gb"],
            (32, 56)
        );
    }

    fn node(product: &str, count: &str) -> NodeFacts {
        let mut labels = Labels::default();
        labels.insert(LABEL_GPU_PRODUCT, product);
        labels.insert(LABEL_GPU_COUNT, count);
        labels.insert(LABEL_GPU_MEMORY, "81920");
        NodeFacts {
            labels,
            ..Default::default()
        }
    }

    #[test]
    fn single_strategy_labels_count_mig_devices_not_gpus() {
        let spec: GpuSharingPolicySpec = crate::api::yaml::from_str(
            "nodeSelector: {}\nstrategy: mig\nmig: {migStrategy: single, layout: all-1g.10gb, timeSlicing: {replicas: 2}}\n",
        )
        .unwrap();
        let base = crate::nvidia::default_mig_configs();
        // Before the MIG manager: 8 GPUs. After, GFD says 56 devices of NVIDIA-...-MIG-1g.10gb.
        for n in [
            node("NVIDIA-A100-SXM4-80GB", "8"),
            node("NVIDIA-A100-SXM4-80GB-MIG-1g.10gb-SHARED", "56"),
        ] {
            let c = capacity(&spec, &n, Some(&base));
            assert_eq!(c.physical_gpus, 8, "{:?}", n.labels);
            assert_eq!(c.schedulable, Some(112), "{:?}", n.labels);
        }
        // A custom layout: 2 GPUs of 1g.10gb x 7, the other 6 (all) of 3g.40gb x 2.
        let spec: GpuSharingPolicySpec = crate::api::yaml::from_str(
            "nodeSelector: {}\nstrategy: mig\nmig:\n  migStrategy: mixed\n  customLayout:\n  - {devices: [0, 1], migEnabled: true, migDevices: {1g.10gb: 7}}\n  - {migEnabled: true, migDevices: {3g.40gb: 2}}\n",
        )
        .unwrap();
        let n = node("NVIDIA-A100-SXM4-80GB-MIG-1g.10gb", "26");
        let c = capacity(&spec, &n, Some(&base));
        assert_eq!(c.physical_gpus, 8);
        assert_eq!(c.schedulable, Some(2 * 7 + 6 * 2));
    }
}
