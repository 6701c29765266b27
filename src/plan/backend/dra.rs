//! The DRA backend: NVIDIA's DRA driver serves the node's GPUs, never together with the device
//! plugin.
//!
//! - ResourceClaimTemplates (`dra.namespaces`): a node gets NVIDIA's device plugin switched off
//!   once its sharing is settled and no pod holds a device-plugin GPU.
//! - Extended resources (`dra.extendedResources`, KEP-5004): pods keep asking for
//!   `nvidia.com/gpu`, kube-scheduler serves the request through a DeviceClass of ours on nodes
//!   whose allocatable for the name is 0. A node moves in three steps: the device plugin off
//!   (only while no device-plugin GPU pod runs on it), then, once it has withdrawn its
//!   resources, the DRA kubelet plugin on (`nvidia.com/gpu.deploy.dra-driver=true`), then
//!   confirmed by the driver's ResourceSlice (its GPUs, with the policy's shares).
//!
//! Moving back (a device-plugin policy, or none): the node keeps the DRA driver until no
//! allocated `gpu.nvidia.com` claim remains on it; then the DRA kubelet plugin goes off, and the
//! device plugin comes back once the driver's slice is gone. Two backends never serve one GPU.

use std::collections::BTreeMap;

use crate::api::crd::Backend;
use crate::api::names::*;
use crate::api::state::{HoldReason, NodeState};
use crate::nvidia::mig_profile_of;
use crate::nvidia::state::{ConfigState, GfdReport, NOT_DEPLOYED, deployed};

use crate::plan::backing::ExtendedResource;
use crate::plan::decision::{Decision, Env, busy_msg, gfd_not_reported, some_of, wait};
use crate::plan::facts::NodeFacts;
use crate::plan::input::{DeviceClassFact, QuotaFact};
use crate::plan::policies::Prepared;

/// We switched the node's device plugin off (and it still is).
pub fn device_plugin_off_by_us(n: &NodeFacts) -> bool {
    n.owned.contains(LABEL_DEPLOY_DEVICE_PLUGIN)
        && !deployed(n.labels.get(LABEL_DEPLOY_DEVICE_PLUGIN))
}

/// We switched the node's DRA kubelet plugin on (and it still is).
pub fn dra_plugin_on_by_us(n: &NodeFacts) -> bool {
    owned_dra_switch(n) == Some(true)
}

/// The value of the DRA kubelet plugin's switch that runs it.
pub const DRA_DEPLOYED: &str = "true";

/// The GPU Operator's value of a switch it paused (`paused-for-driver-upgrade`,
/// `paused-for-mig-change`): it puts the value back itself, nobody else writes over it.
fn paused(value: Option<&str>) -> bool {
    value.is_some_and(|v| v.starts_with("paused-"))
}

/// The DRA kubelet plugin's switch as we own it now (`None`: not ours, or paused).
fn owned_dra_switch(n: &NodeFacts) -> Option<bool> {
    let value = n.labels.get(LABEL_DEPLOY_DRA_DRIVER);
    (n.owned.contains(LABEL_DEPLOY_DRA_DRIVER) && !paused(value))
        .then(|| value == Some(DRA_DEPLOYED))
}

/// The DRA driver may serve the node: it publishes a slice for it, or its switch says anything
/// but `false` (on, paused, or someone else's).
fn dra_may_serve(n: &NodeFacts, env: &Env) -> bool {
    env.dra_slice.is_some()
        || n.labels
            .get(LABEL_DEPLOY_DRA_DRIVER)
            .is_some_and(|v| v != NOT_DEPLOYED)
}

/// The DRA driver may hold the node's GPUs: claims are allocated there, or it may serve the
/// node. Its MIG layout must not change meanwhile: the MIG manager reshapes only once the
/// kubelet plugin is gone.
pub fn holds_gpus(n: &NodeFacts, env: &Env) -> bool {
    !env.dra_claims.is_empty() || dra_may_serve(n, env)
}

/// We switched the node's device plugin off and nothing else serves it: no DRA switch on (or
/// paused), no slice of the driver, no allocated claim.
fn stranded(n: &NodeFacts, env: &Env) -> bool {
    device_plugin_off_by_us(n) && !holds_gpus(n, env)
}

/// Whether a node an extended-resource policy `w` holds as it is (`state`) gets its device
/// plugin back because nothing else would serve it ([`stranded`]): the policy was refused
/// between the two steps of a move, or the MIG manager failed (said so: one pending past the
/// timeout may still be reshaping) while the DRA kubelet plugin was stopped for it. The move
/// starts again once the policy is accepted and the node settled.
pub fn device_plugin_back(
    n: &NodeFacts,
    w: Option<&Prepared>,
    env: &Env,
    state: NodeState,
) -> bool {
    let mig_failed = ConfigState::parse(n.labels.get(LABEL_MIG_STATE)) == Some(ConfigState::Failed);
    let stopped = state.refused() || state == NodeState::Failed && mig_failed;
    stopped && w.is_some_and(|w| w.extended().is_some()) && stranded(n, env)
}

/// Why the node's device plugin cannot come back yet: allocated DRA claims on it.
fn claims_msg(claims: &[String]) -> String {
    format!(
        "WaitingForDraClaims: {} allocated gpu.nvidia.com ResourceClaims on this node ({}); the device plugin comes back when they are gone",
        claims.len(),
        some_of(claims)
    )
}

/// Why switches of a DRA policy's node wait: the GPU Operator paused one (the device plugin's,
/// or with extended resources the DRA kubelet plugin's).
fn paused_switch(n: &NodeFacts, extended: bool) -> Option<String> {
    let mut labels = vec![LABEL_DEPLOY_DEVICE_PLUGIN];
    if extended {
        labels.push(LABEL_DEPLOY_DRA_DRIVER);
    }
    let (label, value) = labels
        .into_iter()
        .find_map(|l| Some((l, n.labels.get(l).filter(|v| paused(Some(*v)))?)))?;
    Some(format!(
        "the GPU Operator paused {label}={value}: the switches wait until it resumes the operand"
    ))
}

/// Why a node Karpenter launched keeps its device plugin for now: Karpenter initializes its
/// NodeClaim only once every resource the pods it launched the node for asked for is
/// registered (kubernetes-sigs/karpenter#3228); a node the DRA driver serves never registers
/// `nvidia.com/gpu`, so it would stay uninitialized. It moves once initialized.
fn uninitialized(n: &NodeFacts) -> Option<String> {
    let pool = n.labels.get(LABEL_NODEPOOL)?;
    (n.labels.get(LABEL_KARPENTER_INITIALIZED) != Some("true")).then(|| {
        format!(
            "Karpenter (NodePool {pool}) has not initialized this node yet: it waits for the device plugin to register the GPUs it launched the node for, which the DRA driver never does; the node moves once {LABEL_KARPENTER_INITIALIZED}=true"
        )
    })
}

/// What a node of an instance type with `gpus` whole GPUs serves through extended resources
/// once moved (what Karpenter's overlay says it has): `shares` pods per GPU, or one. (A MIG
/// layout serves what the device plugin advertises for it, see `backend::type_resources`.)
pub fn type_resources(x: &ExtendedResource, gpus: i64) -> BTreeMap<String, String> {
    let per_gpu = x.shares.unwrap_or(1);
    (x.names.iter())
        .map(|name| (name.clone(), (gpus * per_gpu).to_string()))
        .collect()
}

/// One backend per node (see the module documentation): the switches of the device plugin and
/// of the DRA kubelet plugin that the policy's decision `d` for node `n` comes with. `busy`:
/// pods hold device-plugin GPUs on it.
pub fn backend_switch(n: &NodeFacts, w: &Prepared, env: &Env, busy: bool, d: Decision) -> Decision {
    if w.spec.backend != Backend::Dra {
        return leave(n, env, d);
    }
    // Whatever a MIG policy lets its layout change under (`proceedWithBusyGpus`), no switch
    // moves under a device-plugin GPU pod.
    let busy = busy || !env.gpu_pods.is_empty();
    let Decision::Write {
        state,
        message,
        device_config,
        mig_layout,
        workload,
        vgpu_config,
        ..
    } = d
    else {
        return d;
    };
    let off_already = !deployed(n.labels.get(LABEL_DEPLOY_DEVICE_PLUGIN));
    // With the GPU Operator in DRA-only mode there is no device plugin to switch off.
    let switch = state == NodeState::Applied && env.gpu_cluster.is_none();
    let extended = w.extended().is_some();
    if let Some(why) = paused_switch(n, extended).filter(|_| switch) {
        return wait(HoldReason::WaitingForPausedOperands, why);
    }
    // A MIG layout changes only under idle GPUs: on a node the DRA driver serves, no allocated
    // claim may remain (the device plugin's pods are counted in `busy`); and with the DRA
    // kubelet plugin stopped, since the driver reads MIG devices only when it starts.
    let now = n.labels.get(LABEL_MIG_CONFIG);
    if mig_layout.as_deref().is_some_and(|l| now != Some(l)) {
        if !env.dra_claims.is_empty() {
            return wait(HoldReason::WaitingForDraClaims, claims_msg(env.dra_claims));
        }
        let value = n.labels.get(LABEL_DEPLOY_DRA_DRIVER);
        if dra_may_serve(n, env) {
            if let Some(why) = paused_switch(n, true) {
                return wait(HoldReason::WaitingForPausedOperands, why);
            }
            // Ours, or taken back by the GPU Operator on a node we moved: ours to stop.
            let ours = n.owned.contains(LABEL_DEPLOY_DRA_DRIVER) || device_plugin_off_by_us(n);
            let message = match ours {
                true => format!(
                    "stopping the DRA kubelet plugin ({LABEL_DEPLOY_DRA_DRIVER}={NOT_DEPLOYED}) before the MIG layout changes: NVIDIA's DRA driver reads MIG devices only when it starts"
                ),
                false => format!(
                    "the DRA kubelet plugin's switch {LABEL_DEPLOY_DRA_DRIVER}={} is not this operator's: the MIG layout changes once the DRA driver no longer serves the node",
                    value.unwrap_or_default()
                ),
            };
            return Decision::Write {
                state: NodeState::Pending,
                message,
                device_config,
                mig_layout: now.map(str::to_string),
                device_plugin_off: device_plugin_off_by_us(n),
                dra_plugin: ours.then_some(false),
                workload,
                vgpu_config,
            };
        }
    }
    // Without a class mapping the name, a node without its device plugin serves no pod.
    if let Some(why) = w.waiting.clone().filter(|_| switch && !off_already) {
        return wait(HoldReason::WaitingForDeviceClass, why);
    }
    if let Some(why) = uninitialized(n).filter(|_| extended && switch && !off_already) {
        return wait(HoldReason::WaitingForNodeInitialization, why);
    }
    if switch && !off_already && busy {
        return wait(HoldReason::WaitingForIdleGPUs, busy_msg(env.gpu_pods));
    }
    // Extended resources: the DRA kubelet plugin starts once the device plugin is off and has
    // withdrawn what it advertised, and no pod holds a device-plugin GPU (the DRA allocator
    // cannot see the device plugin's allocations: it would hand those GPUs out again).
    let start = extended && switch && off_already && !busy && !n.advertises_gpus();
    let dra_plugin = if start {
        Some(true)
    } else {
        owned_dra_switch(n)
    };
    Decision::Write {
        state,
        message,
        device_config,
        mig_layout,
        device_plugin_off: device_plugin_off_by_us(n) || switch && !off_already,
        dra_plugin,
        workload,
        vgpu_config,
    }
}

/// A node whose policy is not DRA's: it leaves the DRA driver first (see
/// [`released_switches`]), then the decision applies as it is.
fn leave(n: &NodeFacts, env: &Env, d: Decision) -> Decision {
    let Decision::Write {
        device_config,
        mig_layout,
        workload,
        vgpu_config,
        ..
    } = &d
    else {
        return d;
    };
    let (device_plugin_off, dra_plugin) = released_switches(n, env);
    if !device_plugin_off && dra_plugin.is_none() {
        return d;
    }
    if !env.dra_claims.is_empty() {
        return wait(HoldReason::WaitingForDraClaims, claims_msg(env.dra_claims));
    }
    let message = match n.labels.get(LABEL_DEPLOY_DRA_DRIVER) {
        Some(v) if v == DRA_DEPLOYED && dra_plugin.is_some() => format!(
            "switching the DRA kubelet plugin off ({LABEL_DEPLOY_DRA_DRIVER}={NOT_DEPLOYED}); the device plugin comes back once the DRA driver's ResourceSlice is gone"
        ),
        Some(v) if v != NOT_DEPLOYED => format!(
            "the DRA kubelet plugin's switch {LABEL_DEPLOY_DRA_DRIVER}={v} is not this operator's: the device plugin stays off until it says {NOT_DEPLOYED}"
        ),
        _ => "NVIDIA's DRA driver still publishes this node's GPUs (a gpu.nvidia.com ResourceSlice): the device plugin comes back once the driver no longer serves the node".into(),
    };
    Decision::Write {
        state: NodeState::Pending,
        message,
        device_config: device_config.clone(),
        // The layout now, ours, while the driver may hold the GPUs (it always may here).
        mig_layout: match n.labels.get(LABEL_MIG_CONFIG) {
            Some(now) if n.owned.contains(LABEL_MIG_CONFIG) && holds_gpus(n, env) => {
                Some(now.to_string())
            }
            _ => mig_layout.clone(),
        },
        device_plugin_off,
        dra_plugin,
        workload: *workload,
        vgpu_config: vgpu_config.clone(),
    }
}

/// What a node leaving the DRA driver (a device-plugin policy, or none) keeps of the switches,
/// `(device plugin off, DRA switch)`: both as they are while allocated claims remain; then our
/// DRA kubelet plugin goes off, and the device plugin we switched off stays off while the DRA
/// driver may serve the node (its slice, or a DRA switch that is on and not ours, or paused).
/// A switch the GPU Operator paused is never written.
pub fn released_switches(n: &NodeFacts, env: &Env) -> (bool, Option<bool>) {
    let ours_off = device_plugin_off_by_us(n);
    let dra = owned_dra_switch(n);
    if !env.dra_claims.is_empty() && (ours_off || dra == Some(true)) {
        return (ours_off, dra);
    }
    let dra = dra
        .filter(|on| *on || env.dra_slice.is_some())
        .map(|_| false);
    (ours_off && dra_may_serve(n, env), dra)
}

/// Why a DRA node is not confirmed yet: the device plugin still advertises its resources (the
/// DRA driver alone must advertise the GPUs); then, with templates, GPU Feature Discovery has
/// not relabelled since our config write, or reports the GPUs shared (the DRA driver's GPUs
/// are not shared by the device plugin); with extended resources, the DRA driver does not
/// publish the node's GPUs with the policy's shares yet.
pub fn unconfirmed(
    n: &NodeFacts,
    w: &Prepared,
    config: (&str, Option<&str>),
    env: &Env,
) -> Option<String> {
    device_plugin_still_advertises(n).or_else(|| match w.extended() {
        // The DRA driver's slice confirms the node: GPU Feature Discovery's sharing labels
        // describe the device plugin, which no longer serves it.
        Some(x) => extended_unconfirmed(n, w, x, env),
        None => gfd_not_reported(n, config).or_else(|| {
            let gfd = GfdReport::read(n.labels.iter());
            super::sharing::replicas_unconfirmed(w.spec.strategy, &gfd, 1)
        }),
    })
}

fn device_plugin_still_advertises(n: &NodeFacts) -> Option<String> {
    let left = n.device_plugin_resources();
    if left.is_empty() {
        return None;
    }
    let shown: Vec<String> = left.iter().map(|(r, c)| format!("{r}={c}")).collect();
    Some(format!(
        "waiting for the device plugin to withdraw {} (allocatable) before the DRA driver alone advertises the GPUs",
        shown.join(", ")
    ))
}

/// Why a node moved to extended resources is not confirmed: its DRA kubelet plugin is not on
/// yet, or the driver's ResourceSlice does not show its GPUs with the policy's shares.
fn extended_unconfirmed(
    n: &NodeFacts,
    w: &Prepared,
    x: &ExtendedResource,
    env: &Env,
) -> Option<String> {
    if n.labels.get(LABEL_DEPLOY_DRA_DRIVER) != Some(DRA_DEPLOYED) {
        if !env.gpu_pods.is_empty() {
            return Some(format!(
                "waiting for device-plugin GPU pods to finish before the DRA kubelet plugin starts: {}",
                some_of(env.gpu_pods)
            ));
        }
        return Some(format!(
            "switching the DRA kubelet plugin on ({LABEL_DEPLOY_DRA_DRIVER}={DRA_DEPLOYED})"
        ));
    }
    let Some(slice) = env.dra_slice else {
        return Some(
            "waiting for NVIDIA's DRA driver to publish the node's GPUs (a gpu.nvidia.com ResourceSlice)".into(),
        );
    };
    match mig_layout_served(n, w, x, slice, env) {
        // MIG devices take one claim each, whatever the driver's shares.
        Some(mig) => mig,
        None if slice.gpus == 0 => {
            Some("the DRA driver's ResourceSlice shows no whole GPU on this node".into())
        }
        None => shares_mismatch(x, slice.shares, slice.mixed_shares),
    }
}

/// Under MIG (`Some`): why the DRA driver's slice does not show the node's layout yet: only the
/// layout's profiles, each with as many MIG devices as the MIG manager made (what the device
/// plugin advertises for the layout; MIG devices are not time-sliced here).
fn mig_layout_served(
    n: &NodeFacts,
    w: &Prepared,
    x: &ExtendedResource,
    slice: &crate::plan::input::DraSlice,
    env: &Env,
) -> Option<Option<String>> {
    w.mig()?;
    // Without its DynamicMIG gate the driver publishes no GPU with MIG on as a whole GPU: one
    // shown would be handed out by a whole-GPU class beside the MIG devices carved from it.
    if slice.gpus > 0 {
        return Some(Some(format!(
            "the DRA driver's ResourceSlice shows {} whole GPUs on this MIG node: the layout must turn MIG on for every GPU, and the driver run without its DynamicMIG feature gate",
            slice.gpus
        )));
    }
    let profiles: BTreeMap<String, &String> = (x.names.iter())
        .filter_map(|n| Some((mig_profile_of(n)?, n)))
        .collect();
    let extra: Vec<String> = (slice.mig.iter())
        .filter(|(p, c)| **c > 0 && !profiles.contains_key(*p))
        .map(|(p, c)| format!("{c} {p}"))
        .collect();
    if !extra.is_empty() {
        return Some(Some(format!(
            "the DRA driver's ResourceSlice shows MIG devices the layout does not make: {}",
            some_of(&extra)
        )));
    }
    if slice.mig.values().sum::<i64>() == 0 {
        return Some(Some(
            "the DRA driver's ResourceSlice shows no MIG device on this node".to_string(),
        ));
    }
    let spec = crate::plan::targets::node_spec(w, n);
    let Some(adv) = super::mig::advertises(&spec, n, env.mig_layouts) else {
        return Some(None);
    };
    let wrong: Vec<String> = (profiles.iter())
        .filter_map(|(profile, name)| {
            let have = slice.mig.get(profile).copied().unwrap_or(0);
            let (min, max) = adv.resources.get(*name).copied().unwrap_or((0, 0));
            (have < min || have > max).then(|| {
                let want = if min == max {
                    format!("{min}")
                } else {
                    format!("{min} to {max}")
                };
                format!("{have} {profile} (the layout makes {want})")
            })
        })
        .collect();
    Some((!wrong.is_empty()).then(|| {
        format!(
            "the DRA driver's ResourceSlice shows MIG devices {}",
            some_of(&wrong)
        )
    }))
}

/// Why the shares the DRA driver publishes do not serve `x`.
fn shares_mismatch(x: &ExtendedResource, have: Option<i64>, mixed: bool) -> Option<String> {
    if mixed {
        return Some("the DRA driver's devices on this node publish different shares: run one consumableShares value on every node".into());
    }
    match (x.shares, have) {
        (a, b) if a == b => None,
        (Some(want), Some(have)) => Some(format!(
            "the DRA driver publishes shares={have} per device, the policy's time-slicing has replicas {want}: set the driver's consumableShares to {want}"
        )),
        (Some(want), None) => Some(format!(
            "the DRA driver publishes no shares, the policy's time-slicing has replicas {want}: enable its ConsumableShares feature gate with consumableShares: {want}"
        )),
        (None, Some(have)) => Some(format!(
            "the DRA driver publishes shares={have} per device: exclusive devices need consumableShares: disabled (each pod's claim would take one share)"
        )),
        (None, None) => None,
    }
}

/// `status.servedBy` keys: which backend serves a node's GPUs now.
pub const SERVED_BY_DEVICE_PLUGIN: &str = "devicePlugin";
pub const SERVED_BY_DRA: &str = "draDriver";
pub const SERVED_BY_BOTH: &str = "both";
pub const SERVED_BY_NONE: &str = "none";

/// Which backend serves node `n`'s GPUs now, as the node reports it: the device plugin
/// advertises them (allocatable), the DRA driver publishes them (`slice`), neither (`none`,
/// between the two), or `both`.
pub fn served_by(n: &NodeFacts, slice: Option<&crate::plan::input::DraSlice>) -> &'static str {
    let dp = n.advertises_gpus();
    let dra = slice.is_some_and(|s| s.gpus > 0 || !s.mig.is_empty());
    match (dp, dra) {
        (true, false) => SERVED_BY_DEVICE_PLUGIN,
        (false, true) => SERVED_BY_DRA,
        (true, true) => SERVED_BY_BOTH,
        (false, false) => SERVED_BY_NONE,
    }
}

/// Whether what serves a node (`by`, see [`served_by`]) is reported on its policy's status: for
/// DRA policies, and for nodes the DRA driver serves or whose DRA switch is ours (a node on its
/// way back). Other policies' statuses stay as they were.
pub fn shows_served_by(p: &Prepared, n: &NodeFacts, by: &str) -> bool {
    p.spec.backend == Backend::Dra
        || by == SERVED_BY_DRA
        || by == SERVED_BY_BOTH
        || n.owned.contains(LABEL_DEPLOY_DRA_DRIVER)
}

/// Name of our DeviceClass mapping extended resource `name` (`nvidia.com/gpu` ->
/// `gpusharing-nvidia.com-gpu`).
pub fn device_class_name(name: &str) -> String {
    format!("gpusharing-{}", name.replace('/', "-"))
}

/// Our DeviceClass mapping extended resource `name` to the DRA driver's whole GPUs, or to its
/// MIG devices of the profile the name is of. The class cannot see nodes: the devices it
/// selects are those of the nodes whose DRA kubelet plugin runs, the nodes already moved.
fn device_class(name: &str) -> serde_json::Value {
    let selects = match mig_profile_of(name) {
        Some(p) => format!(
            "device.driver == '{DRA_DRIVER}' && device.attributes['{DRA_DRIVER}'].type == 'mig' && device.attributes['{DRA_DRIVER}'].profile == '{p}'"
        ),
        None => format!(
            "device.driver == '{DRA_DRIVER}' && device.attributes['{DRA_DRIVER}'].type == 'gpu'"
        ),
    };
    serde_json::json!({
        "apiVersion": "resource.k8s.io/v1",
        "kind": "DeviceClass",
        "metadata": {
            "name": device_class_name(name),
            "labels": {MANAGED_BY.0: MANAGED_BY.1},
        },
        "spec": {
            "selectors": [{"cel": {"expression": selects}}],
            "extendedResourceName": name,
        },
    })
}

/// The DeviceClasses we want: that of the accepted extended-resource policies governing nodes
/// (after [`extended_conflicts`] they all serve one name); and, while nodes we switched to the
/// DRA driver remain (`moved`), every class of ours that maps a name now (their pods were
/// scheduled through it: a policy blocked since, or gone, does not take it from them).
pub fn device_classes(
    prepared: &[Prepared],
    governing: &std::collections::BTreeSet<usize>,
    moved: bool,
    classes: Option<&[DeviceClassFact]>,
) -> BTreeMap<String, serde_json::Value> {
    let wanted = governing
        .iter()
        .map(|i| &prepared[*i])
        .filter(|p| p.accepted())
        .filter_map(|p| p.extended())
        .flat_map(|x| x.names.iter().cloned());
    let kept = classes
        .into_iter()
        .flatten()
        .filter(|c| moved && c.ours)
        .filter_map(|c| c.extended_resource_name.clone());
    wanted
        .chain(kept)
        .map(|name| (device_class_name(&name), device_class(&name)))
        .collect()
}

/// The most quota gaps a status lists.
const MAX_QUOTA_GAPS: usize = 10;

/// Namespaces whose ResourceQuotas limit one of the two names a pod's GPU request through `x`
/// is counted under, and not the other: `requests.<name>` (the pod's request, whichever backend
/// serves it) and our class's device count (the generated claims, and claims of the class).
/// A quota on the request alone leaves claims written against our class unlimited where
/// kube-apiserver does not map the class to the name; one on the device count alone leaves the
/// pods on nodes still served by the device plugin unlimited.
/// Each of `x`'s names (a MIG layout's profiles) is checked.
pub fn quota_gaps(x: &ExtendedResource, quotas: &[QuotaFact]) -> Vec<String> {
    let gaps: Vec<String> = (x.names.iter())
        .flat_map(|name| name_gaps(name, quotas))
        .collect();
    let more = gaps.len().saturating_sub(MAX_QUOTA_GAPS);
    let mut out: Vec<String> = gaps.into_iter().take(MAX_QUOTA_GAPS).collect();
    if more > 0 {
        out.push(format!("and {more} more namespaces"));
    }
    out
}

/// [`quota_gaps`] of one name.
fn name_gaps(name: &str, quotas: &[QuotaFact]) -> Vec<String> {
    let request = format!("requests.{name}");
    let devices = format!("{}{DEVICE_CLASS_QUOTA_SUFFIX}", device_class_name(name));
    let mut by_namespace: BTreeMap<&str, (Vec<&str>, bool, bool)> = BTreeMap::new();
    for q in quotas {
        let (r, d) = (q.hard.contains(&request), q.hard.contains(&devices));
        if r || d {
            let e = by_namespace.entry(&q.namespace).or_default();
            e.0.push(&q.name);
            e.1 |= r;
            e.2 |= d;
        }
    }
    by_namespace
        .into_iter()
        .filter(|(_, (_, r, d))| r != d)
        .map(|(ns, (names, r, _))| {
            let (has, lacks, unlimited) = if r {
                (&request, &devices, "ResourceClaims written against the class")
            } else {
                (&devices, &request, "pods on nodes the device plugin still serves")
            };
            format!(
                "{ns}: ResourceQuota {} limits {has} but not {lacks} ({unlimited} are not limited by it)",
                some_of(&names.iter().map(|n| n.to_string()).collect::<Vec<_>>())
            )
        })
        .collect()
}

/// What decides the extended-resource policies cluster-wide.
pub struct ClusterDra<'a> {
    /// DeviceClasses that map a name, and ours; `None`: they cannot be read.
    pub classes: Option<&'a [DeviceClassFact]>,
    /// The DRA driver's ResourceSlices can be read.
    pub slices_readable: bool,
    /// The GPU Operator's DRA-only `GPUCluster`.
    pub gpu_cluster: Option<&'a str>,
}

/// Refuses the extended-resource policies that cannot be served as they are:
/// - DeviceClasses or ResourceSlices cannot be read (a class of someone else's could map the
///   same name; a node's move could not be confirmed, nor its way back waited for);
/// - a DeviceClass not ours maps their name (kube-scheduler serves a name through the class
///   created last, so ours could lose the name to it at any time);
/// - they disagree with the highest-precedence extended-resource policy on the name or the
///   shares: the DRA driver runs one consumable-shares value on every node, and a class cannot
///   see which node a GPU is on. Precedence alone decides, so a policy gaining or losing nodes
///   never hands the decision to another;
/// - the GPU Operator runs in DRA-only mode (`GPUCluster`) and the policy time-slices: its
///   driver offers no scheduler-accounted sharing between claims.
///
/// `blocked` for policies that govern nodes (`governing`), `latent` otherwise (a conflict found
/// earlier is kept). The others get `waiting` until our class is seen mapping their name.
pub fn extended_conflicts(
    prepared: &mut [Prepared],
    governing: &std::collections::BTreeSet<usize>,
    cluster: &ClusterDra,
) {
    let extended = |p: &Prepared| p.accepted() && p.extended().is_some();
    // The shares are decided by the first policy serving whole GPUs: MIG devices take one claim
    // each whatever the driver's shares (see `validate::dra::MIG_NOT_SHARED`).
    let whole = |p: &Prepared| {
        p.extended()
            .is_some_and(|x| x.names.iter().any(|n| mig_profile_of(n).is_none()))
    };
    let Some(owner) = (prepared.iter().position(|p| extended(p) && whole(p)))
        .or_else(|| prepared.iter().position(extended))
    else {
        return;
    };
    let (owner_name, want) = (
        prepared[owner].name.clone(),
        prepared[owner].extended().cloned().expect("extended"),
    );
    // What maps each kind of device (whole GPUs, a MIG profile): the first policy in
    // precedence that serves it, and its name.
    let mut mapped: BTreeMap<Option<String>, (String, String)> = BTreeMap::new();
    for p in prepared.iter().filter(|p| extended(p)) {
        for name in &p.extended().expect("extended").names {
            mapped
                .entry(mig_profile_of(name))
                .or_insert_with(|| (p.name.clone(), name.clone()));
        }
    }
    let classes = cluster.classes.unwrap_or_default();
    for (i, p) in prepared.iter_mut().enumerate() {
        if !extended(p) {
            continue;
        }
        let x = p.extended().expect("extended");
        let shared_alike = !whole(p) || x.shares == want.shares;
        let conflict = unreadable(cluster)
            .or_else(|| x.names.iter().find_map(|n| foreign_class(classes, n)))
            .or_else(|| {
                (i != owner && !shared_alike).then(|| {
                    format!(
                        "dra.extendedResources with {} conflicts with {} of policy {owner_name}: the DRA driver runs one consumableShares value on every node, so every extended-resource policy must share its devices alike",
                        describe(x),
                        describe(&want)
                    )
                })
            })
            .or_else(|| x.names.iter().find_map(|n| {
                let profile = mig_profile_of(n);
                let (other, theirs) = &mapped[&profile];
                (theirs != n).then(|| format!(
                    "dra.extendedResources maps {n} where policy {other} maps {theirs} to the same devices ({}): a DeviceClass cannot tell nodes apart, so one name serves each kind of device",
                    profile.as_deref().map_or("whole GPUs".to_string(), |p| format!("MIG {p}"))
                ))
            }))
            .or_else(|| cluster.gpu_cluster.and_then(|c| dra_only_refusal(x, c)));
        let Some(conflict) = conflict else {
            p.waiting = x.names.iter().find_map(|n| class_missing(classes, n));
            continue;
        };
        if governing.contains(&i) {
            p.blocked = Some(conflict);
        } else {
            p.latent = Some(conflict);
        }
    }
}

/// Why the cluster cannot be read as extended resources need.
fn unreadable(cluster: &ClusterDra) -> Option<String> {
    if cluster.classes.is_none() {
        return Some("DeviceClasses (resource.k8s.io/v1) cannot be listed: without them the operator cannot tell whether another class maps the name (grant list/watch on deviceclasses; on Kubernetes before 1.34 the DRA API is not served)".into());
    }
    (!cluster.slices_readable).then(|| {
        "ResourceSlices (resource.k8s.io/v1) cannot be listed: without them a moved node cannot be confirmed, nor its way back waited for (grant list/watch on resourceslices)".into()
    })
}

/// Why nodes cannot move yet: our class for `name` is not seen mapping it.
fn class_missing(classes: &[DeviceClassFact], name: &str) -> Option<String> {
    let class = device_class_name(name);
    let ours = classes.iter().find(|c| c.ours && c.name == class);
    match ours.map(|c| c.extended_resource_name.as_deref()) {
        Some(Some(n)) if n == name => None,
        Some(None) => Some(format!(
            "DeviceClass {class} was created without spec.extendedResourceName: kube-apiserver drops the field while its DRAExtendedResource feature gate is off (alpha and off in Kubernetes 1.34 and 1.35; enable it on kube-apiserver, kube-scheduler and kube-controller-manager). No node moves until the class maps {name}"
        )),
        _ => Some(format!(
            "waiting for DeviceClass {class} to map {name} (no node moves before kube-scheduler can serve the name through the DRA driver)"
        )),
    }
}

/// Why `x` cannot be served under the GPU Operator's DRA-only mode (`GPUCluster` `c`): time-slicing
/// (its driver offers no consumable shares) and MIG (no device plugin to apply the layout under,
/// no switch to move nodes with).
fn dra_only_refusal(x: &ExtendedResource, c: &str) -> Option<String> {
    let why = if x.shares.is_some() {
        "its DRA driver offers no consumable shares, so time-slicing cannot be served through extended resources; use exclusive, or the standalone DRA driver chart"
    } else if x.names.iter().any(|n| mig_profile_of(n).is_some()) {
        "there is no device plugin to apply the layout under nor switch to move nodes with, so a MIG pool cannot be moved through extended resources; use the standalone DRA driver chart"
    } else {
        return None;
    };
    Some(format!(
        "the GPU Operator runs in DRA-only mode (GPUCluster {c}): {why}"
    ))
}

fn describe(x: &ExtendedResource) -> String {
    let names: Vec<&str> = x.names.iter().map(String::as_str).collect();
    match x.shares {
        Some(s) => format!("{} shared {s} ways", names.join(", ")),
        None => format!("{} exclusive", names.join(", ")),
    }
}

/// Why a DeviceClass not ours that maps `name` stops us serving it.
fn foreign_class(classes: &[DeviceClassFact], name: &str) -> Option<String> {
    let c = classes
        .iter()
        .find(|c| !c.ours && c.extended_resource_name.as_deref() == Some(name))?;
    let chart = if c.name == DRA_DRIVER {
        " NVIDIA's DRA driver chart creates this class with the mapping whenever GPUs are enabled, and again at each upgrade."
    } else {
        ""
    };
    Some(format!(
        "DeviceClass {class} (not this operator's) maps {name}: when two classes map one name kube-scheduler uses the one created last, so the moved nodes' GPUs would be handed out through it.{chart} Remove the mapping (kubectl patch deviceclass {class} --type=json -p '[{{\"op\":\"remove\",\"path\":\"/spec/extendedResourceName\"}}]') or delete the class",
        class = c.name,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::policies::prepare_all;
    use crate::plan::testing::policy;

    const TS4: &str = "  strategy: timeSlicing\n  timeSlicing: {replicas: 4}\n  backend: dra\n  dra: {extendedResources: true, driverFeatureGates: {ConsumableShares: true}}\n";
    const TS2: &str = "  strategy: timeSlicing\n  timeSlicing: {replicas: 2}\n  backend: dra\n  dra: {extendedResources: true, driverFeatureGates: {ConsumableShares: true}}\n";
    const EXCL: &str = "  strategy: exclusive\n  backend: dra\n  dra: {extendedResources: true}\n";

    fn class(name: &str, ours: bool) -> DeviceClassFact {
        DeviceClassFact {
            name: name.into(),
            extended_resource_name: Some("nvidia.com/gpu".into()),
            ours,
        }
    }

    const OURS: &str = "gpusharing-nvidia.com-gpu";

    fn cluster(classes: Option<&[DeviceClassFact]>) -> ClusterDra<'_> {
        ClusterDra {
            classes,
            slices_readable: true,
            gpu_cluster: None,
        }
    }

    fn names(classes: &BTreeMap<String, serde_json::Value>) -> Vec<&str> {
        classes.keys().map(String::as_str).collect()
    }

    #[test]
    fn policies_that_disagree_on_shares_are_refused_naming_the_one_that_decides() {
        let ps = vec![policy("a", TS4), policy("b", TS2), policy("c", EXCL)];
        let mut prepared = prepare_all(&ps, None);
        let all = (0..3).collect();
        extended_conflicts(&mut prepared, &all, &cluster(Some(&[])));
        let owner = prepared.iter().position(|p| p.blocked.is_none()).unwrap();
        let others: Vec<&Prepared> = prepared.iter().filter(|p| p.blocked.is_some()).collect();
        assert_eq!(others.len(), 2);
        for p in others {
            let why = p.blocked.as_deref().unwrap();
            assert!(
                why.contains(&format!("policy {}", prepared[owner].name)),
                "{why}"
            );
            assert!(why.contains("one consumableShares value"), "{why}");
        }
        // Only the accepted one renders its class; its nodes wait until it maps the name.
        assert!(prepared[owner].waiting.as_deref().unwrap().contains(OURS));
        let classes = device_classes(&prepared, &all, false, Some(&[]));
        assert_eq!(names(&classes), [OURS]);
        let c = &classes[OURS];
        assert_eq!(c["spec"]["extendedResourceName"], "nvidia.com/gpu");
        assert_eq!(c["metadata"]["labels"][MANAGED_BY.0], MANAGED_BY.1);
        let mut prepared = prepare_all(&ps, None);
        extended_conflicts(&mut prepared, &all, &cluster(Some(&[class(OURS, true)])));
        assert_eq!(prepared[owner].waiting, None);
    }

    /// Precedence alone decides: the policy first in precedence keeps deciding when it governs
    /// no node (the others are blocked, not handed the decision by a node changing hands), and
    /// a class is rendered only for policies governing nodes.
    #[test]
    fn precedence_alone_decides_and_a_class_needs_governed_nodes() {
        let ps = vec![policy("a", TS4), policy("b", TS2)];
        let mut prepared = prepare_all(&ps, None);
        let only_b = [1].into();
        extended_conflicts(&mut prepared, &only_b, &cluster(Some(&[])));
        let first = prepared.iter().position(|p| p.name == "a").unwrap();
        let second = 1 - first;
        assert!(prepared[first].blocked.is_none() && prepared[first].latent.is_none());
        let governing = [second].into();
        let mut prepared = prepare_all(&ps, None);
        extended_conflicts(&mut prepared, &governing, &cluster(Some(&[])));
        assert!(
            prepared[second]
                .blocked
                .as_deref()
                .unwrap()
                .contains("policy a")
        );
        // a governs no node: no class; b is blocked: no class.
        assert!(device_classes(&prepared, &governing, false, Some(&[])).is_empty());
        // Nodes we moved keep every class of ours mapping a name.
        let kept = [class(OURS, true), class("gpu.nvidia.com", false)];
        assert_eq!(
            names(&device_classes(&prepared, &governing, true, Some(&kept))),
            [OURS]
        );
        assert!(device_classes(&prepared, &governing, false, Some(&kept)).is_empty());
    }

    /// kube-apiserver drops `extendedResourceName` while DRAExtendedResource is off (1.34 and
    /// 1.35 by default): our class then maps nothing, and no node moves.
    #[test]
    fn a_class_without_its_name_keeps_every_node_where_it_is_naming_the_gate() {
        let ps = vec![policy("a", TS4)];
        let governing = [0].into();
        let dropped = [DeviceClassFact {
            name: OURS.into(),
            extended_resource_name: None,
            ours: true,
        }];
        let mut prepared = prepare_all(&ps, None);
        extended_conflicts(&mut prepared, &governing, &cluster(Some(&dropped)));
        let why = prepared[0].waiting.as_deref().expect("waits");
        assert!(
            why.contains("DRAExtendedResource feature gate is off"),
            "{why}"
        );
        assert!(prepared[0].accepted());
        // ResourceSlices that cannot be read refuse the policy.
        let mut prepared = prepare_all(&ps, None);
        let mut c = cluster(Some(&[]));
        c.slices_readable = false;
        extended_conflicts(&mut prepared, &governing, &c);
        assert!(
            prepared[0]
                .blocked
                .as_deref()
                .unwrap()
                .contains("ResourceSlices")
        );
    }

    #[test]
    fn a_foreign_class_mapping_the_name_refuses_the_policy_with_how_to_resolve_it() {
        let ps = vec![policy("a", TS4)];
        let governing = [0].into();
        let mut prepared = prepare_all(&ps, None);
        let chart = [class("gpu.nvidia.com", false)];
        extended_conflicts(&mut prepared, &governing, &cluster(Some(&chart)));
        let why = prepared[0].blocked.as_deref().expect("refused");
        assert!(why.contains("DeviceClass gpu.nvidia.com"), "{why}");
        assert!(why.contains("NVIDIA's DRA driver chart"), "{why}");
        assert!(
            why.contains("kubectl patch deviceclass gpu.nvidia.com"),
            "{why}"
        );
        assert!(device_classes(&prepared, &governing, false, Some(&chart)).is_empty());
        // Someone else's class is not said to be the chart's.
        let mut prepared = prepare_all(&ps, None);
        let other = [class("team-gpus", false)];
        extended_conflicts(&mut prepared, &governing, &cluster(Some(&other)));
        let why = prepared[0].blocked.as_deref().expect("refused");
        assert!(
            why.contains("DeviceClass team-gpus") && !why.contains("chart"),
            "{why}"
        );
        // Our own class is no conflict; unreadable classes are.
        let mut prepared = prepare_all(&ps, None);
        extended_conflicts(
            &mut prepared,
            &governing,
            &cluster(Some(&[class(OURS, true)])),
        );
        assert_eq!(prepared[0].blocked, None);
        let mut prepared = prepare_all(&ps, None);
        extended_conflicts(&mut prepared, &governing, &cluster(None));
        assert!(
            prepared[0]
                .blocked
                .as_deref()
                .unwrap()
                .contains("cannot be listed")
        );
        // Not governing any node: a warning (latent), nothing refused.
        let mut prepared = prepare_all(&ps, None);
        extended_conflicts(&mut prepared, &Default::default(), &cluster(None));
        assert!(prepared[0].blocked.is_none() && prepared[0].latent.is_some());
        // Time-slicing under the GPU Operator's DRA-only mode cannot be served.
        let mut prepared = prepare_all(&ps, None);
        let mut c = cluster(Some(&[]));
        c.gpu_cluster = Some("cluster");
        extended_conflicts(&mut prepared, &governing, &c);
        assert!(
            prepared[0]
                .blocked
                .as_deref()
                .unwrap()
                .contains("GPUCluster cluster")
        );
    }

    /// A namespace whose quotas limit a GPU request under one of its two names only is
    /// reported, saying what is left unlimited; both (in one quota or two) is no gap.
    #[test]
    fn quotas_covering_one_of_the_two_names_are_reported() {
        let x = ExtendedResource {
            names: ["nvidia.com/gpu".to_string()].into(),
            shares: Some(4),
        };
        let q = |ns: &str, name: &str, keys: &[&str]| QuotaFact {
            namespace: ns.into(),
            name: name.into(),
            hard: keys.iter().map(|k| k.to_string()).collect(),
        };
        let devices = "gpusharing-nvidia.com-gpu.deviceclass.resource.k8s.io/devices";
        let quotas = [
            q("both", "a", &["requests.nvidia.com/gpu"]),
            q("both", "b", &[devices]),
            q("requests-only", "gpu", &["requests.nvidia.com/gpu"]),
            q("devices-only", "gpu", &[devices]),
            q("other", "mig", &["requests.nvidia.com/mig-1g.10gb"]),
        ];
        let gaps = quota_gaps(&x, &quotas);
        assert_eq!(gaps.len(), 2, "{gaps:?}");
        assert!(
            gaps[0].starts_with("devices-only: ResourceQuota gpu limits gpusharing-")
                && gaps[0].contains("pods on nodes the device plugin still serves"),
            "{gaps:?}"
        );
        assert!(
            gaps[1].starts_with(
                "requests-only: ResourceQuota gpu limits requests.nvidia.com/gpu but not"
            ) && gaps[1].contains("ResourceClaims written against the class"),
            "{gaps:?}"
        );
        let many: Vec<QuotaFact> = (0..12)
            .map(|i| q(&format!("ns-{i:02}"), "gpu", &["requests.nvidia.com/gpu"]))
            .collect();
        let gaps = quota_gaps(&x, &many);
        assert_eq!(gaps.len(), 11);
        assert_eq!(gaps[10], "and 2 more namespaces");
        // A MIG pool: each profile's two names are checked.
        let mig = ExtendedResource {
            names: [
                "nvidia.com/mig-1g.10gb".to_string(),
                "nvidia.com/mig-3g.40gb".to_string(),
            ]
            .into(),
            shares: None,
        };
        let quotas = [q(
            "team",
            "mig",
            &[
                "requests.nvidia.com/mig-1g.10gb",
                "requests.nvidia.com/mig-3g.40gb",
                "gpusharing-nvidia.com-mig-3g.40gb.deviceclass.resource.k8s.io/devices",
            ],
        )];
        let gaps = quota_gaps(&mig, &quotas);
        assert_eq!(gaps.len(), 1, "{gaps:?}");
        assert!(
            gaps[0].starts_with("team: ResourceQuota mig limits requests.nvidia.com/mig-1g.10gb but not gpusharing-nvidia.com-mig-1g.10gb.deviceclass"),
            "{gaps:?}"
        );
    }

    #[test]
    fn renamed_time_slicing_maps_the_shared_name() {
        let ps = vec![policy(
            "a",
            "  strategy: timeSlicing\n  timeSlicing: {replicas: 4, renameByDefault: true}\n  backend: dra\n  dra: {extendedResources: true, driverFeatureGates: {ConsumableShares: true}}\n",
        )];
        let prepared = prepare_all(&ps, None);
        let x = prepared[0].extended().expect("extended");
        assert_eq!(
            (
                x.names.iter().map(String::as_str).collect::<Vec<_>>(),
                x.shares
            ),
            (vec!["nvidia.com/gpu.shared"], Some(4))
        );
        let classes = device_classes(&prepared, &[0].into(), false, Some(&[]));
        assert!(classes.contains_key("gpusharing-nvidia.com-gpu.shared"));
    }

    const MIG: &str = "  strategy: mig\n  mig: {migStrategy: mixed, layout: all-balanced}\n  backend: dra\n  dra: {extendedResources: true}\n";

    /// A MIG layout maps one class per profile, selecting the driver's MIG devices of that
    /// profile; whole GPUs and MIG profiles are different devices, so an exclusive whole-GPU
    /// pool and a MIG pool move side by side. One consumable-shares value still holds for all,
    /// and one name per kind of device.
    #[test]
    fn a_mig_layout_maps_a_class_per_profile_beside_whole_gpus() {
        let base = crate::nvidia::default_mig_configs();
        let ps = vec![policy("a", MIG), policy("b", EXCL)];
        let all = (0..2).collect();
        let mut prepared = prepare_all(&ps, Some(&base));
        extended_conflicts(&mut prepared, &all, &cluster(Some(&[])));
        assert!(
            prepared.iter().all(|p| p.accepted()),
            "{:?}",
            prepared.iter().map(|p| &p.blocked).collect::<Vec<_>>()
        );
        let classes = device_classes(&prepared, &all, false, Some(&[]));
        let profiles: Vec<&str> = names(&classes)
            .into_iter()
            .filter_map(|c| c.strip_prefix("gpusharing-nvidia.com-mig-"))
            .collect();
        assert!(
            profiles.contains(&"3g.40gb") && profiles.contains(&"1g.10gb"),
            "{profiles:?}"
        );
        assert!(classes.contains_key(OURS));
        let expr = |c: &str| classes[c]["spec"]["selectors"][0]["cel"]["expression"].clone();
        let mig = expr("gpusharing-nvidia.com-mig-3g.40gb");
        assert!(
            mig.as_str().unwrap().contains("type == 'mig'")
                && mig.as_str().unwrap().contains("profile == '3g.40gb'"),
            "{mig}"
        );
        assert!(expr(OURS).as_str().unwrap().contains("type == 'gpu'"));
        assert_eq!(
            classes["gpusharing-nvidia.com-mig-3g.40gb"]["spec"]["extendedResourceName"],
            "nvidia.com/mig-3g.40gb"
        );
        // Waiting names the first class missing; a policy's nodes move once all are seen.
        let a = prepared.iter().position(|p| p.name == "a").unwrap();
        assert!(
            prepared[a]
                .waiting
                .as_deref()
                .unwrap()
                .contains("gpusharing-nvidia.com-mig-")
        );
        // A class we keep for moved nodes after its policy went selects its profile again.
        let kept = [DeviceClassFact {
            name: "gpusharing-nvidia.com-mig-1g.10gb.me".into(),
            extended_resource_name: Some("nvidia.com/mig-1g.10gb.me".into()),
            ours: true,
        }];
        let classes = device_classes(&[], &Default::default(), true, Some(&kept));
        let c = &classes["gpusharing-nvidia.com-mig-1g.10gb.me"];
        assert!(
            c["spec"]["selectors"][0]["cel"]["expression"]
                .as_str()
                .unwrap()
                .contains("profile == '1g.10gb+me'"),
            "{c}"
        );
        // MIG devices take one claim each whatever the driver's shares: a MIG pool moves beside
        // time-sliced GPUs, whose shares alone must agree.
        let ps = vec![policy("a", MIG), policy("b", TS4), policy("c", TS2)];
        let all3 = (0..3).collect();
        let mut prepared = prepare_all(&ps, Some(&base));
        extended_conflicts(&mut prepared, &all3, &cluster(Some(&[])));
        let blocked: Vec<(&str, &str)> = (prepared.iter())
            .filter_map(|p| Some((p.name.as_str(), p.blocked.as_deref()?)))
            .collect();
        assert_eq!(blocked.len(), 1, "{blocked:?}");
        assert_eq!(blocked[0].0, "c");
        assert!(
            blocked[0].1.contains("one consumableShares value")
                && blocked[0].1.contains("policy b"),
            "{}",
            blocked[0].1
        );
        // The GPU Operator's DRA-only mode has no device plugin to apply a layout under.
        let ps = vec![policy("a", MIG)];
        let mut prepared = prepare_all(&ps, Some(&base));
        let mut c = cluster(Some(&[]));
        c.gpu_cluster = Some("cluster");
        extended_conflicts(&mut prepared, &[0].into(), &c);
        let why = prepared[0].blocked.as_deref().expect("refused");
        assert!(why.contains("a MIG pool cannot be moved"), "{why}");
        // Two names for whole GPUs: the second is refused, naming the first.
        let shared = TS4.replace("{replicas: 4}", "{replicas: 4, renameByDefault: true}");
        let ps = vec![policy("a", TS4), policy("b", &shared)];
        let mut prepared = prepare_all(&ps, None);
        extended_conflicts(&mut prepared, &all, &cluster(Some(&[])));
        let why = prepared[1].blocked.as_deref().expect("refused");
        assert!(
            why.contains("maps nvidia.com/gpu.shared where policy a maps nvidia.com/gpu to the same devices (whole GPUs)"),
            "{why}"
        );
    }

    /// A MIG layout through extended resources: mixed only, fixed, every GPU with MIG on, and
    /// named layouts readable.
    #[test]
    fn what_a_mig_pool_through_extended_resources_cannot_be_is_an_error_naming_the_field() {
        let base = crate::nvidia::default_mig_configs();
        let cases = [
            (MIG.replace("mixed", "single"), "spec.mig.migStrategy"),
            (
                MIG.replace("layout: all-balanced}", "layout: all-balanced, dynamic: {layouts: [all-1g.10gb]}}"),
                "spec.mig.dynamic",
            ),
            (
                MIG.replace("layout: all-balanced}", "layout: all-balanced, timeSlicing: {replicas: 2}}"),
                "spec.mig.timeSlicing",
            ),
            (
                MIG.replace(
                    "{extendedResources: true}",
                    "{extendedResources: true, driverFeatureGates: {DynamicMIG: true}}",
                ),
                "spec.dra.driverFeatureGates.DynamicMIG",
            ),
            (MIG.replace("all-balanced", "all-1g.10gb.me"), "spec.mig.layout"),
            (MIG.replace("extendedResources: true", "namespaces: [team]"), "spec.strategy"),
            (MIG.replace("all-balanced", "all-disabled"), "spec.mig.layout"),
            (
                MIG.replace(
                    "layout: all-balanced}",
                    "customLayout: [{devices: [0], migEnabled: true, migDevices: {1g.10gb: 7}}, {devices: [1], migEnabled: false}]}",
                ),
                "spec.mig.customLayout",
            ),
        ];
        for (spec, path) in cases {
            let ps = vec![policy("a", &spec)];
            let prepared = prepare_all(&ps, Some(&base));
            assert!(
                prepared[0].errors.iter().any(|e| e.path == path),
                "{spec}: {:?}",
                prepared[0].errors
            );
        }
        // A named layout's profiles are unknown without the mig-parted configuration.
        let ps = vec![policy("a", MIG)];
        let prepared = prepare_all(&ps, None);
        assert!(
            prepared[0]
                .errors
                .iter()
                .any(|e| e.path == "spec.mig.layout" && e.message.contains("unknown")),
            "{:?}",
            prepared[0].errors
        );
    }

    #[test]
    fn what_extended_resources_cannot_serve_is_an_error_naming_the_field() {
        let cases = [
            (
                "  strategy: mps\n  mps: {replicas: 2}\n  backend: dra\n  dra: {extendedResources: true}\n",
                "spec.strategy",
            ),
            (
                "  strategy: timeSlicing\n  timeSlicing: {replicas: 4}\n  backend: dra\n  dra: {extendedResources: true}\n",
                "spec.dra.driverFeatureGates.ConsumableShares",
            ),
            (
                "  strategy: exclusive\n  backend: dra\n  dra: {extendedResources: true, driverFeatureGates: {ConsumableShares: true}}\n",
                "spec.dra.driverFeatureGates.ConsumableShares",
            ),
            (
                "  strategy: exclusive\n  backend: dra\n  dra: {extendedResources: true, namespaces: [team]}\n",
                "spec.dra",
            ),
            (
                "  strategy: exclusive\n  backend: dra\n  dra: {}\n",
                "spec.dra.namespaces",
            ),
        ];
        for (spec, path) in cases {
            let ps = vec![policy("a", spec)];
            let prepared = prepare_all(&ps, None);
            assert!(
                prepared[0].errors.iter().any(|e| e.path == path),
                "{spec}: {:?}",
                prepared[0].errors
            );
        }
    }
}
