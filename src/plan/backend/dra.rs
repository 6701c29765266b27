//! The DRA backend's part of the per-node transition: one backend per node. Under a DRA policy
//! a node gets NVIDIA's device plugin switched off once its sharing is settled and no pod holds
//! a device-plugin GPU; under a device-plugin policy a node we switched off gets the device
//! plugin back only when no allocated `gpu.nvidia.com` ResourceClaim remains on it.

use crate::api::crd::Backend;
use crate::api::names::*;
use crate::api::state::{HoldReason, NodeState};
use crate::nvidia::state::{GfdReport, deployed};

use crate::plan::decision::{Decision, Env, busy_msg, gfd_not_reported, wait};
use crate::plan::facts::NodeFacts;
use crate::plan::policies::Prepared;

/// We switched the node's device plugin off (and it still is).
pub fn device_plugin_off_by_us(n: &NodeFacts) -> bool {
    n.owned.contains(LABEL_DEPLOY_DEVICE_PLUGIN)
        && !deployed(n.labels.get(LABEL_DEPLOY_DEVICE_PLUGIN))
}

/// Why the node's device plugin cannot come back yet: allocated DRA claims on it.
fn claims_msg(claims: &[String]) -> String {
    let shown: Vec<&str> = claims.iter().take(5).map(String::as_str).collect();
    format!(
        "WaitingForDraClaims: {} allocated gpu.nvidia.com ResourceClaims on this node ({}); the device plugin comes back when they are gone",
        claims.len(),
        shown.join(", ")
    )
}

/// One backend per node. Under a DRA policy a node whose sharing is settled (`Applied`) gets
/// the device plugin switched off, once no pod holds a device-plugin GPU (the DRA driver would
/// hand those GPUs out again); other steps keep the switch as it is. Under a device-plugin
/// policy a node we switched off gets the device plugin back only when no allocated DRA claim
/// remains on it.
pub fn backend_switch(n: &NodeFacts, w: &Prepared, env: &Env, busy: bool, d: Decision) -> Decision {
    let ours_off = device_plugin_off_by_us(n);
    if w.spec.backend != Backend::Dra {
        return match d {
            Decision::Write { .. } if ours_off && !env.dra_claims.is_empty() => {
                wait(HoldReason::WaitingForDraClaims, claims_msg(env.dra_claims))
            }
            d => d,
        };
    }
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
    if switch && !off_already && busy {
        return wait(HoldReason::WaitingForIdleGPUs, busy_msg(env.gpu_pods));
    }
    Decision::Write {
        state,
        message,
        device_config,
        mig_layout,
        device_plugin_off: ours_off || switch && !off_already,
        workload,
        vgpu_config,
    }
}

/// Why a DRA node is not confirmed yet: the device plugin still advertises its resources (the
/// DRA driver alone must advertise the GPUs), GPU Feature Discovery has not relabelled since
/// our config write, or reports the GPUs shared (the DRA driver's GPUs are not shared by the
/// device plugin).
pub fn unconfirmed(n: &NodeFacts, w: &Prepared, config: (&str, Option<&str>)) -> Option<String> {
    device_plugin_still_advertises(n)
        .or_else(|| gfd_not_reported(n, config))
        .or_else(|| {
            let gfd = GfdReport::read(n.labels.iter());
            super::sharing::replicas_unconfirmed(w.spec.strategy, &gfd, 1)
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
