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

use crate::api::crd::Strategy;
use crate::api::names::*;
use crate::api::state::NodeState;
use crate::nvidia::vgpu::{VgpuConfigEntry, family_mismatch, group_overflow, parse_vgpu_type};
use crate::nvidia::{DEFAULT_KEY, MIG_DISABLED_LAYOUT};

use super::capacity::label_i64;
use super::node::{Decision, Env, Mig, busy_msg, hold, write};
use super::policies::Prepared;
use super::{NodeFacts, SmallMap, is_device_plugin_resource};

/// What the ClusterPolicy says about sandbox workloads (the fields the operator cannot set for
/// the user).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Sandbox {
    /// `spec.sandboxWorkloads.mode` (`kubevirt` when absent).
    pub mode: Option<String>,
    /// `spec.vgpuManager.enabled`.
    pub vgpu_manager_enabled: bool,
}

/// The node is a VM host (by its workload label).
pub fn is_vm_host(n: &NodeFacts) -> bool {
    n.labels
        .get(LABEL_WORKLOAD)
        .is_some_and(|w| w.starts_with("vm-"))
}

/// Resources the sandbox device plugin advertises on the node (`nvidia.com/<PCI device name>`
/// for passthrough, `nvidia.com/<mdev type>` for vGPU): NVIDIA resources that are not the
/// container device plugin's.
pub fn sandbox_resources(n: &NodeFacts) -> Vec<(&str, i64)> {
    n.allocatable
        .iter()
        .filter(|(k, _)| !is_device_plugin_resource(k))
        .filter_map(|(k, v)| Some((k, v.parse::<i64>().ok().filter(|c| *c > 0)?)))
        .collect()
}

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
        if needed && n.labels.get(label) == Some("false") {
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
    let product = n
        .labels
        .get(LABEL_GPU_PRODUCT)
        .map(|p| p.trim_end_matches(SHARED_SUFFIX));
    let memory_gb = label_i64(n, LABEL_GPU_MEMORY).map(|m| (m * 11 / 10 / 1024) as u32);
    let gpus = label_i64(n, LABEL_GPU_COUNT);
    for (i, e) in w.vgpu_entries.iter().enumerate() {
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
            .and_then(|f| w.vgpu_board_gb.get(&f).copied())
            .or(memory_gb);
        if let Some(why) = board.and_then(|b| group_overflow(&e.vgpu_devices, b)) {
            return Some(format!("device group {i}: {why}"));
        }
    }
    None
}

/// The transition of a node governed by a VM policy (see the module documentation).
pub fn decide(n: &NodeFacts, w: &Prepared, env: &Env, busy: bool) -> Decision {
    let target = w.spec.strategy.workload();
    let wl = n.labels.get(LABEL_WORKLOAD);
    let mig = Mig::of(n);
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
        workload: Some(target),
        vgpu_config: w.vgpu_config.clone(),
    };
    if is_vm_host(n) && wl != Some(target) {
        // From one kind of VM host to the other.
        if !env.vm_pods.is_empty() {
            return hold(NodeState::Waiting, vm_users_msg(env.vm_pods));
        }
        let msg = format!(
            "switching the node from {} to {target}",
            wl.unwrap_or_default()
        );
        return vm(NodeState::Pending, msg);
    }
    if wl == Some(target) {
        return on_vm_host(n, w, env, vm);
    }
    // Container -> VM: idle GPUs, sharing off and MIG disabled (confirmed) first.
    if busy {
        return hold(NodeState::Waiting, busy_msg(env.gpu_pods));
    }
    let sharing_on = n
        .labels
        .get(LABEL_DEVICE_PLUGIN_CONFIG)
        .is_some_and(|k| k != DEFAULT_KEY);
    let mig_off = match mig.layout {
        None => true,
        Some(MIG_DISABLED_LAYOUT) => matches!(mig.state, None | Some("success")),
        Some(_) => false,
    };
    if mig.layout == Some(MIG_DISABLED_LAYOUT) && mig.failed(env) {
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
    w: &Prepared,
    env: &Env,
    vm: impl Fn(NodeState, String) -> Decision,
) -> Decision {
    let Some(want) = w.vgpu_config.as_deref() else {
        return vm(NodeState::Applied, String::new());
    };
    let cur = n.labels.get(LABEL_VGPU_CONFIG);
    let state = n.labels.get(LABEL_VGPU_STATE);
    if cur == Some(want) && (state == Some("failed") || env.vgpu_stuck && state == Some("pending"))
    {
        return hold(
            NodeState::Failed,
            format!(
                "vGPU Device Manager reported failed (or stayed pending past the timeout) for config {want}; node left untouched"
            ),
        );
    }
    if cur != Some(want) && cur.is_some() && !env.vm_pods.is_empty() {
        return hold(NodeState::Waiting, vm_users_msg(env.vm_pods));
    }
    if cur == Some(want) && state == Some("success") {
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
        return Some(hold(NodeState::Waiting, vm_users_msg(env.vm_pods)));
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
    sandbox_resources(n).is_empty().then(|| {
        "waiting for the sandbox device plugin to advertise the GPUs to virtual machines (no nvidia.com/<device> allocatable yet)".to_string()
    })
}

/// vGPU devices per GPU index under a policy's layout (`None`: the layout is unknown); every
/// GPU of `gpus` for `devices: all`.
pub fn vgpus_per_gpu(entries: &[VgpuConfigEntry], gpus: i64) -> Option<Vec<(i64, i64)>> {
    if entries.is_empty() {
        return None;
    }
    let mut out = Vec::new();
    for g in 0..gpus {
        let count: i64 = entries
            .iter()
            .filter(|e| match &e.devices {
                crate::nvidia::MigDevices::All(_) => e.device_filter.is_none(),
                crate::nvidia::MigDevices::Indices(d) => d.contains(&(g as i32)),
            })
            .map(|e| e.vgpu_devices.values().map(|c| i64::from(*c)).sum::<i64>())
            .sum();
        out.push((g, count));
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::crd::GpuSharingPolicy;
    use crate::plan::node::{Outcome, outcome};
    use crate::plan::policies::{check_vgpu_types, prepare_all};

    fn policy(name: &str, spec: &str) -> GpuSharingPolicy {
        let text = format!(
            "apiVersion: gpusharing.io/v1alpha1\nkind: GpuSharingPolicy\nmetadata: {{name: {name}}}\nspec:\n  nodeSelector: {{}}\n{spec}"
        );
        crate::api::yaml::from_str(&text).unwrap()
    }

    const VGPU: &str = "  strategy: vgpu\n  vgpu: {type: A100D-1-10C}\n";
    const PASS: &str = "  strategy: passthrough\n";
    const TS: &str = "  strategy: timeSlicing\n  timeSlicing: {replicas: 4}\n";

    /// An A100 80GB node; managed labels present are ours unless listed in `foreign`.
    fn node(labels: &[(&str, &str)]) -> NodeFacts {
        let mut n = NodeFacts {
            name: "n".into(),
            ..Default::default()
        };
        for (k, v) in [
            ("nvidia.com/gpu.product", "NVIDIA-A100-SXM4-80GB"),
            ("nvidia.com/gpu.count", "8"),
            ("nvidia.com/gpu.memory", "81920"),
            ("nvidia.com/mig.capable", "true"),
        ]
        .iter()
        .chain(labels)
        {
            n.labels.insert(*k, *v);
            n.owned.insert(*k);
        }
        n
    }

    struct Case<'a> {
        env: Env<'a>,
    }

    fn step(n: &NodeFacts, p: Option<&Prepared>, c: &Case) -> Outcome {
        let d = crate::plan::node::decide(n, p, &c.env);
        outcome(n, p, &c.env, d)
    }

    /// Applies an outcome's labels the way the API server does for our field manager.
    fn apply(n: &mut NodeFacts, o: &Outcome) {
        crate::plan::converge::apply_to_node(n, &o.labels, &o.annotations);
    }

    fn is_vm_and_container_at_once(n: &NodeFacts) -> bool {
        let sharing = n
            .labels
            .get(LABEL_DEVICE_PLUGIN_CONFIG)
            .is_some_and(|k| k != DEFAULT_KEY);
        let mig_on = n
            .labels
            .get(LABEL_MIG_CONFIG)
            .is_some_and(|l| l != MIG_DISABLED_LAYOUT)
            || n.labels.get(LABEL_MIG_CONFIG) == Some(MIG_DISABLED_LAYOUT)
                && n.labels.get(LABEL_MIG_STATE) == Some("pending");
        is_vm_host(n) && (sharing || mig_on)
    }

    #[test]
    fn container_to_vgpu_and_back_never_mixes_the_two() {
        let hash = |_: &str| None;
        let sandbox = Sandbox {
            mode: None,
            vgpu_manager_enabled: true,
        };
        let policies = vec![policy("v", VGPU), policy("t", TS)];
        let mut prepared = prepare_all(&policies, None);
        check_vgpu_types(&mut prepared, &crate::nvidia::vgpu::default_vgpu_configs());
        let (v, t) = (
            prepared.iter().find(|p| p.name == "v").unwrap(),
            prepared.iter().find(|p| p.name == "t").unwrap(),
        );
        assert!(v.errors.is_empty(), "{:?}", v.errors);
        assert_eq!(v.vgpu_entries.len(), 1);
        let key = t.key.clone().unwrap();
        let case = |pods: &'static [String], vm: &'static [String]| Case {
            env: Env {
                gpu_pods: pods,
                vm_pods: vm,
                sandbox: &sandbox,
                ..Env::idle(100, &hash)
            },
        };
        let busy: &'static [String] = Box::leak(vec!["team/cuda".to_string()].into_boxed_slice());
        let vms: &'static [String] =
            Box::leak(vec!["vms/virt-launcher-a".to_string()].into_boxed_slice());
        let idle = case(&[], &[]);

        // A time-sliced MIG node (MIG on): the VM policy waits for idle GPUs, then takes sharing
        // and MIG off, and only after the MIG manager confirmed writes the workload label.
        let mut n = node(&[
            (LABEL_DEVICE_PLUGIN_CONFIG, &key),
            (LABEL_MIG_CONFIG, "all-1g.10gb"),
            (LABEL_MIG_STATE, "success"),
        ]);
        assert_eq!(
            step(&n, Some(v), &case(busy, &[])).state,
            Some(NodeState::Waiting)
        );
        let mut history = vec![n.labels.clone()];
        for round in 0..6 {
            let o = step(&n, Some(v), &idle);
            apply(&mut n, &o);
            history.push(n.labels.clone());
            assert!(
                !is_vm_and_container_at_once(&n),
                "round {round}: {:?}",
                n.labels
            );
            // The MIG manager and the vGPU Device Manager confirm what is pending.
            for (cfg, state) in [
                (LABEL_MIG_CONFIG, LABEL_MIG_STATE),
                (LABEL_VGPU_CONFIG, LABEL_VGPU_STATE),
            ] {
                if n.labels.get(state) == Some("pending") && n.labels.contains_key(cfg) {
                    n.labels.insert(state, "success");
                    n.owned.remove(state);
                }
            }
            if is_vm_host(&n) {
                n.allocatable = [("nvidia.com/NVIDIA_A100D-1-10C", "56")]
                    .into_iter()
                    .collect();
            }
            history.push(n.labels.clone());
        }
        let o = step(&n, Some(v), &idle);
        assert_eq!(
            o.state,
            Some(NodeState::Applied),
            "{}: {:?}",
            o.message,
            n.labels
        );
        assert_eq!(n.labels.get(LABEL_WORKLOAD), Some("vm-vgpu"));
        assert_eq!(n.labels.get(LABEL_VGPU_CONFIG), Some("A100D-1-10C"));
        assert_eq!(n.labels.get(LABEL_MIG_CONFIG), Some(MIG_DISABLED_LAYOUT));
        assert_eq!(n.labels.get(LABEL_DEVICE_PLUGIN_CONFIG), Some(DEFAULT_KEY));
        // The workload label came only after MIG was confirmed off.
        let first_vm = history
            .iter()
            .position(|l| l.get(LABEL_WORKLOAD).is_some())
            .unwrap();
        assert_eq!(history[first_vm - 1].get(LABEL_MIG_STATE), Some("success"));

        back_to_containers(&mut n, t, &key, &case(&[], &[]), &case(&[], vms));
    }

    /// The VM host `n` goes back to the container policy `t` (whose key is `key`).
    fn back_to_containers(n: &mut NodeFacts, t: &Prepared, key: &str, idle: &Case, vms: &Case) {
        // Not while a VM runs; then `container` with sharing off first.
        let o = step(n, Some(t), vms);
        assert_eq!(o.state, Some(NodeState::Waiting));
        assert!(o.message.contains("virt-launcher"), "{}", o.message);
        let o = outcome(n, None, &vms.env, Decision::Release);
        assert_eq!(
            o.labels.get(LABEL_WORKLOAD).map(String::as_str),
            Some("vm-vgpu"),
            "kept while VMs run"
        );
        let o = step(n, Some(t), idle);
        assert_eq!(
            o.labels.get(LABEL_WORKLOAD).map(String::as_str),
            Some("container")
        );
        assert_eq!(
            o.labels.get(LABEL_DEVICE_PLUGIN_CONFIG).map(String::as_str),
            Some(DEFAULT_KEY)
        );
        assert_eq!(
            o.labels.get(LABEL_VGPU_CONFIG),
            None,
            "the vGPU config goes with it"
        );
        apply(n, &o);
        n.allocatable = Labels::default();
        let o = step(n, Some(t), idle);
        assert_eq!(
            o.labels.get(LABEL_DEVICE_PLUGIN_CONFIG),
            Some(&key.to_string()),
            "sharing follows"
        );
        assert_eq!(
            o.labels.get(LABEL_WORKLOAD).map(String::as_str),
            Some("container")
        );
    }

    use crate::plan::Labels;

    #[test]
    fn what_cannot_work_is_rejected_with_the_field_named() {
        let hash = |_: &str| None;
        let policies = vec![
            policy("v", VGPU),
            policy("p", PASS),
            policy(
                "l4",
                "  strategy: vgpu\n  vgpu: {customLayout: [{vgpuDevices: {L4-12Q: 2}}]}\n",
            ),
            policy(
                "big",
                "  strategy: vgpu\n  vgpu: {customLayout: [{vgpuDevices: {A100D-40C: 3}}]}\n",
            ),
            policy("unknown", "  strategy: vgpu\n  vgpu: {type: A100D-99C}\n"),
        ];
        let mut prepared = prepare_all(&policies, None);
        check_vgpu_types(&mut prepared, &crate::nvidia::vgpu::default_vgpu_configs());
        let get = |name: &str| prepared.iter().find(|p| p.name == name).unwrap();
        let unknown = get("unknown");
        assert_eq!(unknown.errors[0].path, "spec.vgpu.type");
        let n = node(&[]);
        let reject = |p: &Prepared, s: &Sandbox| {
            let env = Env {
                sandbox: s,
                ..Env::idle(1, &hash)
            };
            match crate::plan::node::decide(&n, Some(p), &env) {
                Decision::Hold {
                    state: NodeState::Rejected,
                    message,
                } => Some(message),
                _ => None,
            }
        };
        let ok = Sandbox {
            mode: None,
            vgpu_manager_enabled: true,
        };
        assert_eq!(reject(get("v"), &ok), None);
        assert_eq!(reject(get("p"), &ok), None);
        let kata = Sandbox {
            mode: Some("kata".into()),
            vgpu_manager_enabled: true,
        };
        assert!(
            reject(get("p"), &kata)
                .unwrap()
                .contains("spec.sandboxWorkloads.mode")
        );
        let no_manager = Sandbox::default();
        assert!(
            reject(get("v"), &no_manager)
                .unwrap()
                .contains("spec.vgpuManager.enabled")
        );
        assert_eq!(
            reject(get("p"), &no_manager),
            None,
            "passthrough needs no vGPU Manager"
        );
        assert!(reject(get("l4"), &ok).unwrap().contains("L4"));
        let m = reject(get("big"), &ok).unwrap();
        assert!(
            m.contains("120 GB of framebuffer per GPU, the GPU has 80 GB"),
            "{m}"
        );
    }
}
