//! The device plugin's sharing (exclusive, time-slicing, MPS) on one node: MIG must be off,
//! and confirmed, before the new device-plugin config is applied.

use crate::api::crd::Strategy;
use crate::api::names::*;
use crate::api::state::{HoldReason, NodeState};
use crate::nvidia::state::GfdReport;
use crate::nvidia::{DEFAULT_KEY, MIG_DISABLED_LAYOUT};

use super::decision::{Decision, Env, busy_msg, hold, mig_of, wait, write};
use super::facts::NodeFacts;
use super::policies::Prepared;

/// Sharing (or exclusive) on a node: MIG must be off, and confirmed, before the new
/// device-plugin config is applied.
pub(super) fn decide(n: &NodeFacts, w: &Prepared, key: &str, env: &Env, busy: bool) -> Decision {
    let mig = mig_of(n);
    let mig_capable = n.labels.get(LABEL_MIG_CAPABLE) == Some("true");
    let confirmed_off = mig.off(MIG_DISABLED_LAYOUT);
    let keep_mig_label = n
        .owned
        .contains(LABEL_MIG_CONFIG)
        .then(|| MIG_DISABLED_LAYOUT.to_string());
    // With `disruption.mode: drain`, a new config under running MPS clients (it restarts the MPS
    // control daemon) waits for the node to be drained, like a MIG change.
    let mps_clients = busy
        && w.drains()
        && n.labels.get(LABEL_GPU_SHARING_STRATEGY) == Some("mps")
        && n.labels.get(LABEL_DEVICE_PLUGIN_CONFIG) != Some(key);
    if (!mig_capable && mig.layout.is_none() || confirmed_off) && mps_clients {
        wait(
            HoldReason::WaitingForMpsClients,
            format!("MPS clients running: {}", env.gpu_pods.join(", ")),
        )
    } else if !mig_capable && mig.layout.is_none() || confirmed_off {
        write(NodeState::Applied, "", key, keep_mig_label)
    } else if mig.layout == Some(MIG_DISABLED_LAYOUT) && mig.failed(env.mig_stuck) {
        hold(
            NodeState::Failed,
            "MIG manager failed to disable MIG (or stayed pending past the timeout); node left untouched",
        )
    } else if mig.layout != Some(MIG_DISABLED_LAYOUT) && busy {
        wait(HoldReason::WaitingForIdleGPUs, busy_msg(env.gpu_pods))
    } else {
        let msg = "waiting for MIG to be disabled and confirmed before sharing is enabled";
        write(
            NodeState::Pending,
            msg,
            DEFAULT_KEY,
            Some(MIG_DISABLED_LAYOUT.into()),
        )
    }
}

/// Why GPU Feature Discovery's report does not confirm `expected` replicas per GPU yet
/// (`nvidia.com/gpu.replicas`; exclusive may report 1; no report confirms nothing against).
pub(super) fn replicas_unconfirmed(
    strategy: Strategy,
    gfd: &GfdReport,
    expected: i64,
) -> Option<String> {
    let ok = match gfd.replicas.and_then(|r| r.parse::<i64>().ok()) {
        None => true,
        Some(r) => r == expected || strategy == Strategy::Exclusive && r == 1,
    };
    (!ok).then(|| {
        format!(
            "GPU Feature Discovery reports nvidia.com/gpu.replicas={}, expected {expected}",
            gfd.replicas.unwrap_or_default()
        )
    })
}
