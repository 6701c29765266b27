//! Virtual machines (`strategy: vgpu` / `passthrough`): the GPU Operator's sandbox workloads.
//!
//! The invariant: a node is never a VM host (`nvidia.com/gpu.workload.config=vm-*`) and a
//! container-sharing node (a sharing device-plugin config, or a MIG layout other than
//! `all-disabled`) at once. So:
//! - container -> VM: the sharing config and the MIG layout come off first (MIG back to
//!   `all-disabled`, confirmed by the MIG manager), with idle GPUs; only then the workload label
//!   (and, for vGPU, `nvidia.com/vgpu.config`, marked `pending`) is written;
//! - VM -> container: only when no VM uses the GPUs (pods asking for the sandbox device plugin's
//!   resources, as KubeVirt's virt-launcher pods do), the workload label goes back to
//!   `container` with the device plugin sharing nothing; sharing follows on a later step, as
//!   from any exclusive node;
//! - a VM node counts as `Applied` only once the sandbox side confirms: `vgpu.config.state=
//!   success` for vGPU, and the sandbox device plugin advertising the GPUs (allocatable).

use std::collections::BTreeMap;

use crate::api::crd::Strategy;
use crate::api::names::*;
use crate::api::state::{HoldReason, NodeState};
use crate::nvidia::state::{VgpuState, deployed};
use crate::nvidia::vgpu::{family_mismatch, group_overflow, parse_vgpu_type};
use crate::nvidia::{DEFAULT_KEY, MIG_DISABLED_LAYOUT};

use crate::plan::backing::VmTarget;
use crate::plan::capacity::{NodeCapacity, cap, vgpu_devices};
use crate::plan::decision::{Decision, Env, busy_msg, hold, mig_of, wait, write};
use crate::plan::facts::{gpu_count, gpu_memory_mib};
use crate::plan::policies::Prepared;
use crate::plan::{facts::NodeFacts, labels::SmallMap};

use crate::plan::decision::Sandbox;
use crate::plan::facts::{is_vgpu_resource, is_vm_host, sandbox_resources};

fn vm_users_msg(pods: &[String]) -> String {
    let shown: Vec<&str> = pods.iter().take(5).map(String::as_str).collect();
    format!(
        "WaitingForVMs: {} VM pods use the node's GPUs ({}); the GPUs change hands when they are gone",
        pods.len(),
        shown.join(", ")
    )
}

/// Why a VM strategy cannot run on this node (or in this cluster), naming the field.
pub fn rejection(w: &Prepared, n: &NodeFacts, sandbox: &Sandbox) -> Option<String> {
    if let Some(m) = sandbox.mode.as_deref().filter(|m| *m != "kubevirt") {
        return Some(format!(
            "ClusterPolicy spec.sandboxWorkloads.mode is {m}: VMs get GPUs through KubeVirt's sandbox device plugin only with mode kubevirt"
        ));
    }
    if w.spec.strategy == Strategy::Vgpu && !sandbox.vgpu_manager_enabled {
        return Some("ClusterPolicy spec.vgpuManager.enabled is not true: vGPU needs NVIDIA's vGPU Manager (an image you build with your licensed vGPU driver) on the node".into());
    }
    for (label, what) in [
        (
            LABEL_DEPLOY_SANDBOX_DEVICE_PLUGIN,
            "the sandbox device plugin",
        ),
        (LABEL_DEPLOY_VGPU_DEVICE_MANAGER, "the vGPU Device Manager"),
    ] {
        let needed =
            label == LABEL_DEPLOY_SANDBOX_DEVICE_PLUGIN || w.spec.strategy == Strategy::Vgpu;
        if needed && !deployed(n.labels.get(label)) {
            return Some(format!(
                "{label}=false on this node: the GPU Operator keeps {what} off it"
            ));
        }
    }
    if n.labels.get("nvidia.com/gpu.present") == Some("false") {
        return Some(
            "nvidia.com/gpu.present=false: the GPU Operator does not manage this node".into(),
        );
    }
    vgpu_mismatch(w, n)
}

/// A vGPU type (or a group of them) that does not fit the node's GPU, per device group: the
/// type's family against the GPU product, the group against the board's framebuffer (nominal
/// GB, from NVIDIA's named configs; without them, GPU Feature Discovery's memory with 10% for
/// what the driver reserves) and the GPU's MIG compute slices.
fn vgpu_mismatch(w: &Prepared, n: &NodeFacts) -> Option<String> {
    // GFD appends `-SHARED` under sharing and `-MIG-<profile>` under the `single` MIG
    // strategy: the board is what comes before.
    let product = n.labels.get(LABEL_GPU_PRODUCT).map(|p| {
        let p = p.trim_end_matches(SHARED_SUFFIX);
        p.find("-MIG-").map_or(p, |i| &p[..i])
    });
    let memory_gb = gpu_memory_mib(n).map(|m| (m * 11 / 10 / 1024) as u32);
    let gpus = gpu_count(n);
    let vm = w.vm()?;
    for (i, e) in vm.vgpu_entries.iter().enumerate() {
        if let (crate::nvidia::MigDevices::Indices(d), Some(gpus)) = (&e.devices, gpus)
            && let Some(bad) = d.iter().find(|i| i64::from(**i) >= gpus)
        {
            return Some(format!(
                "GPU index {bad} does not exist: the node has {gpus} GPUs"
            ));
        }
        for t in e.vgpu_devices.keys() {
            if let Some(why) = product.and_then(|p| family_mismatch(t, p)) {
                return Some(why);
            }
        }
        let family = e
            .vgpu_devices
            .keys()
            .find_map(|t| parse_vgpu_type(t))
            .map(|t| t.family);
        let board = family
            .and_then(|f| vm.vgpu_board_gb.get(&f).copied())
            .or(memory_gb);
        if let Some(why) = board.and_then(|b| group_overflow(&e.vgpu_devices, b)) {
            return Some(format!("device group {i}: {why}"));
        }
    }
    None
}

/// The transition of a node governed by a VM policy (see the module documentation).
pub fn decide(n: &NodeFacts, t: &VmTarget, env: &Env, busy: bool) -> Decision {
    let target = t.workload;
    let wl = n.labels.get(LABEL_WORKLOAD);
    let mig = mig_of(n);
    let mig_kept = n
        .owned
        .contains(LABEL_MIG_CONFIG)
        .then(|| mig.layout.map(str::to_string))
        .flatten();
    let vm = |state, msg: String| Decision::Write {
        state,
        message: msg,
        device_config: DEFAULT_KEY.to_string(),
        mig_layout: mig_kept.clone(),
        device_plugin_off: false,
        dra_plugin: None,
        workload: Some(target),
        vgpu_config: t.vgpu_config.clone(),
    };
    if is_vm_host(n) && wl != Some(target) {
        // From one kind of VM host to the other.
        if !env.vm_pods.is_empty() {
            return wait(HoldReason::WaitingForVMs, vm_users_msg(env.vm_pods));
        }
        let msg = format!(
            "switching the node from {} to {target}",
            wl.unwrap_or_default()
        );
        return vm(NodeState::Pending, msg);
    }
    if wl == Some(target) {
        return on_vm_host(n, t, env, vm);
    }
    // Container -> VM: idle GPUs, sharing off and MIG disabled (confirmed) first.
    if busy {
        return wait(HoldReason::WaitingForIdleGPUs, busy_msg(env.gpu_pods));
    }
    let sharing_on = n
        .labels
        .get(LABEL_DEVICE_PLUGIN_CONFIG)
        .is_some_and(|k| k != DEFAULT_KEY);
    let mig_off = mig.off(MIG_DISABLED_LAYOUT);
    if mig.layout == Some(MIG_DISABLED_LAYOUT) && mig.failed(env.mig_stuck) {
        return hold(
            NodeState::Failed,
            "MIG manager failed to disable MIG (or stayed pending past the timeout); node left untouched",
        );
    }
    if sharing_on || !mig_off {
        let mut d = write(
            NodeState::Pending,
            "taking the sharing config and the MIG layout off before the GPUs go to virtual machines",
            DEFAULT_KEY,
            mig.layout.map(|_| MIG_DISABLED_LAYOUT.to_string()),
        );
        if let Decision::Write { workload, .. } = &mut d {
            *workload = n.owned.contains(LABEL_WORKLOAD).then_some("container");
        }
        return d;
    }
    vm(
        NodeState::Pending,
        format!("handing the GPUs to virtual machines ({LABEL_WORKLOAD}={target})"),
    )
}

/// A node already labelled for this policy's kind of VM host.
fn on_vm_host(
    n: &NodeFacts,
    t: &VmTarget,
    env: &Env,
    vm: impl Fn(NodeState, String) -> Decision,
) -> Decision {
    let Some(want) = t.vgpu_config.as_deref() else {
        return vm(NodeState::Applied, String::new());
    };
    let vgpu = VgpuState::read(
        n.labels.get(LABEL_VGPU_CONFIG),
        n.labels.get(LABEL_VGPU_STATE),
    );
    let cur = vgpu.config;
    if vgpu.failed(want, env.vgpu_stuck) {
        return hold(
            NodeState::Failed,
            format!(
                "vGPU Device Manager reported failed (or stayed pending past the timeout) for config {want}; node left untouched"
            ),
        );
    }
    if cur != Some(want) && cur.is_some() && !env.vm_pods.is_empty() {
        return wait(HoldReason::WaitingForVMs, vm_users_msg(env.vm_pods));
    }
    if vgpu.confirmed(want) {
        vm(NodeState::Applied, String::new())
    } else {
        vm(
            NodeState::Pending,
            format!("waiting for the vGPU Device Manager to create the vGPU devices of {want}"),
        )
    }
}

/// A node a container policy (or none) governs that is a VM host we made: it goes back to
/// containers only when no VM uses its GPUs; in that step the device plugin shares nothing.
/// `None` when the node is not such a VM host.
pub fn leave(n: &NodeFacts, env: &Env) -> Option<Decision> {
    if !(is_vm_host(n) && n.owned.contains(LABEL_WORKLOAD)) {
        return None;
    }
    if !env.vm_pods.is_empty() {
        return Some(wait(HoldReason::WaitingForVMs, vm_users_msg(env.vm_pods)));
    }
    let mig_kept = n
        .owned
        .contains(LABEL_MIG_CONFIG)
        .then(|| n.labels.get(LABEL_MIG_CONFIG).map(str::to_string))
        .flatten();
    let mut d = write(
        NodeState::Pending,
        format!("handing the GPUs back to containers ({LABEL_WORKLOAD}=container)"),
        DEFAULT_KEY,
        mig_kept,
    );
    if let Decision::Write { workload, .. } = &mut d {
        *workload = Some("container");
    }
    Some(d)
}

/// Why a VM node whose labels say `Applied` is not confirmed yet: its labels must be in place
/// and the sandbox device plugin must advertise the GPUs.
pub fn unconfirmed(n: &NodeFacts, w: &Prepared, want: &SmallMap) -> Option<String> {
    if !w.spec.strategy.is_vm() {
        return None;
    }
    for key in [LABEL_WORKLOAD, LABEL_VGPU_CONFIG] {
        if let Some(v) = want.get(key)
            && n.labels.get(key) != Some(v.as_str())
        {
            return Some(format!("labelling node {key}={v}"));
        }
    }
    let advertised = sandbox_resources(n);
    if advertised.is_empty() {
        return Some("waiting for the sandbox device plugin to advertise the GPUs to virtual machines (no nvidia.com/<device> allocatable yet)".to_string());
    }
    // What it advertises must be this mode's: a node moving between vGPU and passthrough
    // still shows the other mode's devices until the plugin re-registers. (A change of vGPU
    // type is confirmed by the vGPU Device Manager's state label.)
    // Other `nvidia.com/*` resources (the Network Operator's, say) are no GPU's: a vGPU host
    // needs a vGPU device, a passthrough host none left.
    let passthrough = w.spec.strategy == Strategy::Passthrough;
    let vgpu = advertised.iter().find(|(r, _)| is_vgpu_resource(r));
    if !passthrough {
        return vgpu.is_none().then(|| {
            "waiting for the sandbox device plugin to advertise vGPU devices (nvidia.com/NVIDIA_<type>)".to_string()
        });
    }
    vgpu.map(|(r, c)| {
        let want = "passthrough GPUs";
        format!(
            "waiting for the sandbox device plugin to advertise {want} (it still advertises {r}={c})"
        )
    })
}

/// One VM node's capacity: passthrough hands out whole GPUs; vGPU the layout's vGPU devices
/// (counted as for an instance type, [`type_resources`]), each with its type's framebuffer (the
/// smallest type's, when a layout mixes them). GPUs are counted from GPU Feature Discovery's
/// label (left from the node's container days) or else the sandbox device plugin's allocatable.
pub fn capacity(w: &Prepared, node: &NodeFacts) -> NodeCapacity {
    let passthrough = w.spec.strategy == Strategy::Passthrough;
    // Without GFD's count, a passthrough host's GPUs are what the sandbox device plugin
    // advertises, bounded as GFD's count is.
    let sandbox = sandbox_resources(node)
        .iter()
        .map(|(_, c)| *c)
        .fold(0i64, i64::saturating_add)
        .min(crate::plan::facts::MAX_GPUS_PER_NODE);
    let gpus = gpu_count(node).unwrap_or(if passthrough { sandbox } else { 0 });
    let mem = gpu_memory_mib(node);
    if passthrough {
        return cap(gpus, Some(gpus), mem, Some(100), true);
    }
    let entries = w.vm().map_or(&[][..], |v| &v.vgpu_entries);
    let total = vgpu_devices(entries, gpus).map(|by_type| by_type.values().sum::<i64>());
    let fb = entries
        .iter()
        .flat_map(|e| e.vgpu_devices.keys())
        .filter_map(|t| parse_vgpu_type(t))
        .map(|t| t.framebuffer_mib())
        .min();
    cap(gpus, total, fb, None, true)
}

/// What the sandbox device plugin (KubeVirt's, deployed by the GPU Operator) advertises on a VM
/// host of `gpus` GPUs (an instance type Karpenter may launch): passthrough GPUs under their
/// PCI device name (`pci_name`), vGPUs under `NVIDIA_<type>`, as many as the policy's layout
/// creates. `Err` says why it is unknown.
pub fn type_resources(
    w: &Prepared,
    gpus: i64,
    pci_name: Option<&str>,
    sandbox: &Sandbox,
) -> Result<BTreeMap<String, String>, String> {
    if let Some(m) = sandbox.mode.as_deref().filter(|m| *m != "kubevirt") {
        return Err(format!(
            "the ClusterPolicy's sandboxWorkloads.mode is {m}: no KubeVirt device plugin advertises the GPUs"
        ));
    }
    if w.spec.strategy == Strategy::Passthrough {
        let name = pci_name.ok_or(
            "the sandbox device plugin's name for its GPUs is unknown: no passthrough node of this type runs, and the instance-type table gives no pciDeviceName",
        )?;
        return Ok(BTreeMap::from([(
            format!("nvidia.com/{name}"),
            gpus.to_string(),
        )]));
    }
    if !sandbox.vgpu_manager_enabled {
        return Err(
            "the ClusterPolicy's vgpuManager.enabled is false: no vGPU devices are created".into(),
        );
    }
    let entries = w.vm().map_or(&[][..], |v| &v.vgpu_entries);
    if entries.is_empty() || entries.iter().any(|e| e.device_filter.is_some()) {
        return Err("the vGPU layout's devices per GPU are unknown for this type".into());
    }
    let by_type = vgpu_devices(entries, gpus).unwrap_or_default();
    Ok(by_type
        .into_iter()
        .map(|(t, c)| (format!("nvidia.com/NVIDIA_{t}"), c.to_string()))
        .collect())
}
