//! The converged view of `render --nodes`: plan, apply the plan, let NVIDIA's components answer
//! as if everything succeeded (the MIG manager confirms every layout, GPU Feature Discovery
//! reports the device plugin's new replicas after our write), and plan again until nothing
//! changes. The result is what the cluster looks like once the operator is done, with the
//! capacity a user previews for; the number of passes is how many rounds of writes it took.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use crate::api::names::{
    ANNOTATION_MIG_DEMAND, LABEL_DEPLOY_DEVICE_PLUGIN, LABEL_DEPLOY_DRA_DRIVER,
    LABEL_DEVICE_PLUGIN_CONFIG, LABEL_GFD_TIMESTAMP, LABEL_GPU_COUNT, LABEL_GPU_REPLICAS,
    LABEL_GPU_SHARING_STRATEGY, LABEL_MIG_CONFIG, LABEL_MIG_STATE, LABEL_VGPU_CONFIG,
    LABEL_VGPU_STATE, LABEL_WORKLOAD,
};
use crate::nvidia::state::{ConfigState, Workload, deployed};
use crate::nvidia::{self, DevicePluginConfig};
use crate::plan::facts::{apply_to_node, gfd_behind, is_vm_host};
use crate::plan::input::DeviceClassFact;
use crate::plan::{Labels, NodeFacts, Plan, PlanInput, SmallMap};

/// More passes than any valid history needs: a MIG -> MPS change takes four per node, and a
/// rollout with a budget of one node goes node by node.
pub fn max_passes(nodes: usize) -> usize {
    16 + 8 * nodes
}

#[derive(Debug)]
pub struct Converged {
    /// The plan of the converged state (planning it again writes nothing).
    pub plan: Plan,
    /// The state the plan was made from: nodes with the labels we and NVIDIA's components wrote.
    pub input: PlanInput,
    /// Plans made, the last one included (1: the input was already converged).
    pub passes: usize,
    /// The nodes our writes changed in each pass that wrote (waves of node changes).
    pub waves: Vec<BTreeSet<String>>,
}

#[derive(Debug, thiserror::Error)]
#[error("did not converge after {passes} passes; nodes still changing: {}", nodes.join(", "))]
pub struct NotConverged {
    pub passes: usize,
    pub nodes: Vec<String>,
}

/// Applies a plan to the state it was made from: our ConfigMaps and the nodes. Returns the
/// nodes that changed.
pub fn apply(input: &mut PlanInput, plan: &Plan) -> BTreeSet<String> {
    input.cluster.current_device_config = plan.device_config.clone();
    input.cluster.current_mig_configs = plan
        .mig_config
        .as_deref()
        .and_then(|t| nvidia::parse_mig_configs(t).ok())
        .unwrap_or_default();
    input.cluster.current_vgpu_configs = plan
        .vgpu_config
        .as_deref()
        .and_then(|t| nvidia::vgpu::parse_vgpu_configs(t).ok())
        .unwrap_or_default();
    let empty = SmallMap::default();
    let mut changed = BTreeSet::new();
    for n in &mut input.nodes {
        let labels = plan.node_labels.get(&n.name).unwrap_or(&empty);
        let annotations = plan.node_annotations.get(&n.name).unwrap_or(&empty);
        if apply_to_node(Arc::make_mut(&mut n.facts), labels, annotations) {
            changed.insert(n.name.clone());
        }
        // The layout demand chose (its own field manager's annotation).
        if let Some(want) = plan.demand.annotations.get(&n.name)
            && n.annotations.get(ANNOTATION_MIG_DEMAND) != want.as_deref()
        {
            let f = Arc::make_mut(&mut n.facts);
            match want {
                Some(v) => f.annotations.insert(ANNOTATION_MIG_DEMAND, v.as_str()),
                None => {
                    f.annotations.remove(ANNOTATION_MIG_DEMAND);
                }
            }
            changed.insert(n.name.clone());
        }
    }
    // The spare taint (`preferBusyNodes`).
    for (name, present) in &plan.spare {
        if let Some(n) = input.nodes.iter_mut().find(|n| n.name == *name) {
            Arc::make_mut(&mut n.facts).spare = *present;
            changed.insert(name.clone());
        }
    }
    changed
}

/// Our DeviceClasses become the plan's (kube-apiserver keeps `extendedResourceName`: the
/// converged view assumes the `DRAExtendedResource` feature gate on). Whether they changed.
fn apply_device_classes(input: &mut PlanInput, plan: &Plan) -> bool {
    let Some(classes) = input.cluster.device_classes.as_mut() else {
        return false;
    };
    let ours = plan.device_classes.iter().map(|(name, c)| DeviceClassFact {
        name: name.clone(),
        extended_resource_name: c["spec"]["extendedResourceName"].as_str().map(String::from),
        ours: true,
    });
    let mut now: Vec<DeviceClassFact> = (classes.iter().filter(|c| !c.ours).cloned())
        .chain(ours)
        .collect();
    now.sort_by(|a, b| a.name.cmp(&b.name));
    let changed = now != *classes;
    *classes = now;
    changed
}

/// What GPU Feature Discovery reports for a device-plugin config: the replicas of its shared
/// resources (the largest, as for MIG profiles with different counts) and the strategy.
pub fn gfd_report(config: Option<&DevicePluginConfig>) -> (i32, &'static str) {
    let sharing = config.and_then(|c| c.sharing.as_ref());
    let max = |r: &nvidia::ReplicatedResources| r.resources.iter().map(|x| x.replicas).max();
    match sharing {
        Some(s) if s.mps.is_some() => (s.mps.as_ref().and_then(max).unwrap_or(1), "mps"),
        Some(s) if s.time_slicing.is_some() => (
            s.time_slicing.as_ref().and_then(max).unwrap_or(1),
            "time-slicing",
        ),
        _ => (1, "none"),
    }
}

/// The resource the converged view lets the sandbox device plugin advertise on a VM host (the
/// real name, `nvidia.com/<PCI device name>` or `nvidia.com/<mdev type>`, depends on hardware
/// the render does not know).
pub const SANDBOX_RESOURCE: &str = "nvidia.com/sandbox-gpu";

/// A resource the converged view lets the sandbox device plugin advertise.
fn is_sandbox(r: &str) -> bool {
    r == SANDBOX_RESOURCE || crate::plan::facts::is_vgpu_resource(r)
}

/// A `vm-vgpu` host (by its workload label).
fn vgpu_host(n: &NodeFacts) -> bool {
    Workload::parse(n.labels.get(LABEL_WORKLOAD)) == Some(Workload::VmVgpu)
}

/// The sandbox device plugin (on VM hosts) and the container device plugin (where it is
/// deployed) advertise what they serve: the allocatable the converged view needs. `serves` is
/// what the device plugin advertises under the node's policy, when known.
fn plugins_advertise(n: &NodeFacts, serves: Option<crate::plan::capacity::Advertised>) -> Labels {
    let vm = is_vm_host(n);
    let dp_off = vm || !deployed(n.labels.get(LABEL_DEPLOY_DEVICE_PLUGIN));
    let serves = serves.filter(|_| !dp_off);
    let mut alloc: Labels = n
        .allocatable
        .iter()
        .filter(|(k, _)| {
            !(is_sandbox(k) || dp_off && crate::plan::facts::is_device_plugin_resource(k))
        })
        .filter(|(k, _)| serves.is_none() || !crate::plan::facts::is_device_plugin_resource(k))
        .collect();
    // The largest count a range allows: the entry capacity counts with.
    for (r, (_, max)) in serves.iter().flat_map(|s| &s.resources) {
        alloc.insert(r.as_str(), max.to_string());
    }
    if vm {
        let gpus = n.labels.get(LABEL_GPU_COUNT).unwrap_or("1");
        // vGPUs go by their type's name (`NVIDIA_<type>`), passthrough GPUs by a name that
        // is not one (see `facts::is_vgpu_resource`).
        match n.labels.get(LABEL_VGPU_CONFIG).filter(|_| vgpu_host(n)) {
            Some(config) => alloc.insert(format!("nvidia.com/NVIDIA_{config}").as_str(), gpus),
            None => alloc.insert(SANDBOX_RESOURCE, gpus),
        }
    }
    alloc
}

/// What the device plugin advertises on `n` under the policy it is labelled for, when known.
fn serves(input: &PlanInput, n: &NodeFacts) -> Option<crate::plan::capacity::Advertised> {
    let name = n.labels.get(crate::api::names::LABEL_POLICY)?;
    let p = input
        .policies
        .iter()
        .find(|p| kube::ResourceExt::name_any(*p) == name)?;
    // The device plugin advertises the MIG layout the MIG manager applied (the node's label),
    // which a demand-driven node may not have reached yet.
    let mut spec = std::borrow::Cow::Borrowed(&p.spec);
    if let (Some(l), Some(d)) = (
        n.labels.get(LABEL_MIG_CONFIG),
        p.spec.mig.as_ref().and_then(|m| m.dynamic.as_ref()),
    ) && d.layouts.iter().any(|x| x == l)
    {
        spec = std::borrow::Cow::Owned(p.spec.with_mig_layout(l));
    }
    let base = input.cluster.base_mig_configs.as_ref();
    crate::plan::backend::advertises_unmoved(&spec, n, base)
}

/// NVIDIA's components answer, all successfully: the MIG manager confirms a pending layout, the
/// vGPU Device Manager a pending vGPU config; GFD, after the device plugin restarted with a new
/// config, reports its replicas and stamps the node later than our write (not on VM hosts,
/// where GFD does not run). `now` is the time of that answer. Returns the nodes that changed.
pub fn nvidia_succeeds(input: &mut PlanInput, now: i64) -> BTreeSet<String> {
    let serving: Vec<_> = input.nodes.iter().map(|n| serves(input, n)).collect();
    let shares = driver_shares(&input.policies);
    let base = input.cluster.base_mig_configs.as_ref();
    let configs = &input.cluster.current_device_config;
    let mut changed = BTreeSet::new();
    for (n, serves) in input.nodes.iter_mut().zip(serving) {
        // NVIDIA's DRA kubelet plugin publishes the node's GPUs where it is switched on.
        let slice = (n.labels.get(LABEL_DEPLOY_DRA_DRIVER) == Some("true")).then(|| {
            let mig = mig_devices(&input.policies, base, n);
            crate::plan::input::DraSlice {
                gpus: match mig.is_empty() {
                    true => crate::plan::facts::gpu_count(n).unwrap_or(0),
                    false => 0,
                },
                mig,
                shares,
                ..Default::default()
            }
        });
        if slice != n.dra_slice {
            n.dra_slice = slice;
            changed.insert(n.name.clone());
        }
        let mut labels = n.labels.clone();
        for state in [LABEL_MIG_STATE, LABEL_VGPU_STATE] {
            if ConfigState::parse(labels.get(state)) == Some(ConfigState::Pending) {
                labels.insert(state, ConfigState::Success.label_value());
                // The MIG manager's (vGPU Device Manager's) update takes the field over from us.
                Arc::make_mut(&mut n.facts).owned.remove(state);
            }
        }
        let alloc = plugins_advertise(n, serves);
        if alloc != n.allocatable {
            Arc::make_mut(&mut n.facts).allocatable = alloc;
            changed.insert(n.name.clone());
        }
        if is_vm_host(n) {
            if labels != n.labels {
                Arc::make_mut(&mut n.facts).labels = labels;
                changed.insert(n.name.clone());
            }
            continue;
        }
        let config = labels
            .get(LABEL_DEVICE_PLUGIN_CONFIG)
            .and_then(|k| configs.get(k))
            .and_then(|text| crate::api::yaml::from_str::<DevicePluginConfig>(text).ok());
        let (replicas, strategy) = gfd_report(config.as_ref());
        let written = n
            .annotations
            .get(crate::api::names::ANNOTATION_CONFIG_WRITTEN);
        let replicas = replicas.to_string();
        let stale = labels.get(LABEL_GPU_REPLICAS) != Some(replicas.as_str())
            || labels.get(LABEL_GPU_SHARING_STRATEGY) != Some(strategy)
            || gfd_behind(n, written).is_some()
            || labels.get(LABEL_GFD_TIMESTAMP).is_none();
        if stale {
            labels.insert(LABEL_GPU_REPLICAS, replicas);
            labels.insert(LABEL_GPU_SHARING_STRATEGY, strategy);
            labels.insert(LABEL_GFD_TIMESTAMP, now.to_string());
        }
        if labels != n.labels {
            Arc::make_mut(&mut n.facts).labels = labels;
            changed.insert(n.name.clone());
        }
    }
    changed
}

/// The MIG devices, by profile, the DRA driver publishes on `n` under the MIG layout of the
/// policy it is labelled for: what the device plugin advertises for the layout, one device per
/// replica group. Empty for whole GPUs.
fn mig_devices(
    policies: &[crate::api::crd::GpuSharingPolicy],
    base: Option<&BTreeMap<String, serde_json::Value>>,
    n: &NodeFacts,
) -> BTreeMap<String, i64> {
    let name = n.labels.get(crate::api::names::LABEL_POLICY);
    let Some(p) = policies
        .iter()
        .find(|p| Some(kube::ResourceExt::name_any(*p).as_str()) == name)
        .filter(|p| p.spec.mig.is_some())
    else {
        return BTreeMap::new();
    };
    let replicas = crate::plan::backend::mig::replicas(&p.spec).max(1) as i64;
    let adv = crate::plan::backend::mig::advertises(&p.spec, n, base);
    (adv.iter().flat_map(|a| &a.resources))
        .filter_map(|(r, (_, max))| Some((crate::nvidia::mig_profile_of(r)?, max / replicas)))
        .collect()
}

/// The consumable shares the DRA driver runs with, as an admin who followed the operator would
/// have set them: those of the first policy served through extended resources.
fn driver_shares(policies: &[crate::api::crd::GpuSharingPolicy]) -> Option<i64> {
    policies
        .iter()
        .map(|p| crate::plan::backing::DraBacking::of(&p.spec, None, &Default::default()))
        .find_map(|d| d.extended)
        .and_then(|x| x.shares)
}

/// Plans, applies and lets NVIDIA's components succeed until a plan changes nothing. Each pass
/// takes two seconds of the input's clock: our write at `now`, NVIDIA's answer a second later.
pub fn converge(mut input: PlanInput) -> Result<Converged, NotConverged> {
    // Start after every time the nodes already carry, so our writes are newer than GFD's
    // earlier reports (and the result does not depend on the wall clock).
    let latest = input
        .nodes
        .iter()
        .flat_map(|n| {
            let written = n
                .annotations
                .get(crate::api::names::ANNOTATION_CONFIG_WRITTEN);
            [n.labels.get(LABEL_GFD_TIMESTAMP), written]
        })
        .flatten()
        .filter_map(|v| v.parse::<i64>().ok())
        .max()
        .unwrap_or(0);
    input.cluster.now = input.cluster.now.max(latest + 1);
    let mut last = BTreeSet::new();
    let mut waves = Vec::new();
    let max = max_passes(input.nodes.len());
    for passes in 1..=max {
        let plan = crate::plan::plan(&input);
        let classes = apply_device_classes(&mut input, &plan);
        let mut changed = apply(&mut input, &plan);
        if !changed.is_empty() {
            waves.push(changed.clone());
        }
        let answer = input.cluster.now + 1;
        changed.extend(nvidia_succeeds(&mut input, answer));
        if changed.is_empty() && !classes {
            return Ok(Converged {
                plan,
                input,
                passes,
                waves,
            });
        }
        input.cluster.now += 2;
        last = changed;
    }
    Err(NotConverged {
        passes: max,
        nodes: last.into_iter().collect(),
    })
}
