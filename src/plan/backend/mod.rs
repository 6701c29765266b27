//! One file per backend: how a node reaches what its policy's backend serves, and what NVIDIA's
//! components report when it has. [`sharing`] (the device plugin sharing whole GPUs: exclusive,
//! time-slicing, MPS), [`mig`] (the MIG manager), [`vm`] (the sandbox stack: passthrough,
//! vGPU), [`dra`] (NVIDIA's DRA driver, the device plugin switched off).

pub mod dra;
pub mod mig;
pub mod sharing;
pub mod vm;

use std::collections::BTreeMap;

use serde_json::Value;

use crate::api::crd::{GpuSharingPolicySpec, Strategy};

use super::backing::{Kind, NodeTarget, Serving};
use super::capacity::{Advertised, NodeCapacity};
use super::compat::node_rejection;
use super::decision::{Decision, Env};
use super::facts::{NodeFacts, is_vm_host};
use super::geometry::node_refusal;
use super::input::Sandbox;
use super::policies::Prepared;
use super::targets::node_spec;
use crate::api::state::NodeState;

// The registry: each question below is answered by the file of the policy's backend. A new
// backend is a new file beside these and one arm in each match.

/// How a policy divides its GPUs, whatever serves them: a MIG layout is the MIG backend's
/// (through the device plugin or the DRA driver), whole GPUs shared are the sharing backend's.
fn division(spec: &GpuSharingPolicySpec) -> Kind {
    match (Kind::of(spec), spec.strategy) {
        (Kind::Dra, Strategy::Mig) => Kind::Mig,
        (Kind::Dra, _) => Kind::Sharing,
        (k, _) => k,
    }
}

/// Replicas per GPU (per MIG instance) a policy's nodes advertise.
pub fn replicas(w: &Prepared) -> i32 {
    match division(w.spec) {
        Kind::Sharing | Kind::Dra => sharing::replicas(w.spec),
        Kind::Mig => mig::replicas(w.spec),
        Kind::Vm => 1,
    }
}

/// What NVIDIA's device plugin advertises on `node` (its allocatable) under `spec`, the
/// policy's spec as it applies to this node (a dynamic MIG node's layout); `None` where the
/// device plugin serves nothing (VMs, DRA) or the count is unknown.
pub fn advertises(
    spec: &GpuSharingPolicySpec,
    node: &NodeFacts,
    base: Option<&BTreeMap<String, Value>>,
) -> Option<Advertised> {
    match Kind::of(spec) {
        Kind::Sharing => sharing::advertises(spec, node),
        Kind::Mig => mig::advertises(spec, node, base),
        Kind::Vm | Kind::Dra => None,
    }
}

/// What the device plugin advertises on `node` while it serves the node: [`advertises`], and for
/// a MIG pool moving to the DRA driver its layout (until the node moves; the driver then serves
/// the same names and counts, one pod per MIG device).
pub fn advertises_unmoved(
    spec: &GpuSharingPolicySpec,
    node: &NodeFacts,
    base: Option<&BTreeMap<String, Value>>,
) -> Option<Advertised> {
    match division(spec) {
        Kind::Mig => mig::advertises(spec, node, base),
        _ => advertises(spec, node, base),
    }
}

/// What one applied node of the policy contributes to its capacity.
pub fn node_capacity(
    w: &Prepared,
    node: &NodeFacts,
    base: Option<&BTreeMap<String, Value>>,
) -> NodeCapacity {
    match division(w.spec) {
        Kind::Sharing | Kind::Dra => sharing::capacity(w.spec, node),
        Kind::Mig => mig::capacity(&node_spec(w, node), node, base),
        Kind::Vm => vm::capacity(w, node),
    }
}

/// What a node of an instance type (its GPU labels and count, and the sandbox device plugin's
/// name for its GPUs) advertises under the policy, for a Karpenter overlay: resource -> count.
/// `Err` says why it is unknown.
pub fn type_resources(
    w: &Prepared,
    node: &NodeFacts,
    (gpus, pci_name): (i64, Option<&str>),
    base: Option<&BTreeMap<String, Value>>,
    sandbox: &Sandbox,
) -> Result<BTreeMap<String, String>, String> {
    if w.kind() == Kind::Vm {
        return vm::type_resources(w, gpus, pci_name, sandbox);
    }
    if let Some(x) = w.extended().filter(|_| division(w.spec) == Kind::Sharing) {
        return Ok(dra::type_resources(x, gpus));
    }
    let adv = advertises_unmoved(w.spec, node, base).ok_or_else(|| {
        let gpu = node.labels.get(crate::api::names::LABEL_GPU_PRODUCT);
        format!("the capacity is unknown for {}", gpu.unwrap_or("this GPU"))
    })?;
    Ok(adv
        .resources
        .iter()
        .map(|(r, (min, _))| (r.clone(), min.to_string()))
        .collect())
}

/// Why node `n` is left as it was: `Rejected` when the policy's backend cannot serve it (its
/// GPUs cannot take the strategy, a VM host someone else made under a container backend, the
/// GPU Operator in DRA-only mode under any backend but DRA), `Invalid` when a MIG layout does
/// not fit its GPUs; checked in that order.
pub fn refusal(w: &Prepared, n: &NodeFacts, env: &Env) -> Option<(NodeState, String)> {
    let kind = w.kind();
    let own = match kind {
        Kind::Vm => vm::rejection(w, n, env.sandbox),
        Kind::Sharing | Kind::Mig | Kind::Dra => node_rejection(w.spec, n),
    };
    if let Some(why) = own {
        return Some((NodeState::Rejected, why));
    }
    if let Some(why) = node_refusal(w.spec, n) {
        return Some((NodeState::Invalid, why));
    }
    let foreign = (kind != Kind::Vm)
        .then(|| sharing::foreign_vm_host(n))
        .flatten();
    let dra_only = env.gpu_cluster.filter(|_| kind != Kind::Dra).map(|c| {
        format!(
            "the GPU Operator runs in DRA-only mode (GPUCluster {c}): there is no device plugin to configure; use backend: dra"
        )
    });
    foreign.or(dra_only).map(|why| (NodeState::Rejected, why))
}

/// The backend's step for node `n` towards its target `t`; `busy`: GPU pods run there that a
/// change needing idle GPUs must wait for.
pub fn decide(n: &NodeFacts, w: &Prepared, t: &NodeTarget, env: &Env, busy: bool) -> Decision {
    let key = t.device_config.as_str();
    match &t.serving {
        Serving::Vm(target) => vm::decide(n, target, env, busy),
        // A VM host we made goes back to containers first, whatever the container backend.
        _ if is_vm_host(n) => vm::leave(n, env).expect("a VM host we labelled"),
        Serving::Mig { layout }
        | Serving::Dra {
            layout: Some(layout),
            ..
        } => mig::decide(n, w, key, layout, env, busy),
        Serving::Sharing | Serving::Dra { .. } => sharing::decide(n, w, key, env, busy),
    }
}

/// Why a node whose labels are in place is not confirmed by what NVIDIA's components report,
/// judged by the policy's backend: `config` is the device-plugin config key and when we last
/// wrote it (GPU Feature Discovery must have relabelled since); `env` has the ClusterPolicy's
/// MIG strategy and what the DRA driver publishes. VM hosts are confirmed from their labels
/// ([`vm::unconfirmed`]).
pub fn unconfirmed(
    n: &NodeFacts,
    w: &Prepared,
    config: (&str, Option<&str>),
    env: &Env,
) -> Option<String> {
    match w.kind() {
        Kind::Vm => None,
        Kind::Sharing => sharing::unconfirmed(n, w, config),
        Kind::Mig => mig::unconfirmed(n, w, config, env.cluster_mig_strategy),
        Kind::Dra => dra::unconfirmed(n, w, config, env),
    }
}

/// Whether the policy's clients are isolated in memory: not under time-slicing (of whole GPUs
/// or of MIG instances).
pub fn memory_isolation(w: &Prepared) -> bool {
    match division(w.spec) {
        Kind::Sharing | Kind::Dra => sharing::memory_isolation(w.spec),
        Kind::Mig => mig::memory_isolation(w.spec),
        Kind::Vm => true,
    }
}
