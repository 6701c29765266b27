//! The device plugin's sharing (exclusive, time-slicing, MPS) on one node: MIG must be off,
//! and confirmed, before the new device-plugin config is applied.

use crate::api::crd::{GpuSharingPolicySpec, Strategy};
use crate::api::names::*;
use crate::api::state::{HoldReason, NodeState};
use crate::nvidia::state::GfdReport;
use crate::nvidia::{DEFAULT_KEY, MIG_DISABLED_LAYOUT};

use crate::plan::capacity::{
    Advertised, NodeCapacity, advertised_name, cap, most_replicas, ts_replicas,
};
use crate::plan::decision::{Decision, Env, busy_msg, gfd_not_reported, hold, mig_of, wait, write};
use crate::plan::facts::{NodeFacts, gpu_count, gpu_memory_mib, is_vm_host};
use crate::plan::policies::Prepared;

/// Sharing (or exclusive) on a node: MIG must be off, and confirmed, before the new
/// device-plugin config is applied.
pub fn decide(n: &NodeFacts, w: &Prepared, key: &str, env: &Env, busy: bool) -> Decision {
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

/// Why a container backend (the device plugin's sharing, MIG, DRA) is not applied over node
/// `n`: it is a VM host someone else made.
pub fn foreign_vm_host(n: &NodeFacts) -> Option<String> {
    (is_vm_host(n) && !n.owned.contains(LABEL_WORKLOAD)).then(|| {
        format!(
            "the node is a VM host ({LABEL_WORKLOAD}={}, set by someone else): a container strategy is not applied over it",
            n.labels.get(LABEL_WORKLOAD).unwrap_or_default()
        )
    })
}

/// Why GPU Feature Discovery's report does not confirm the device plugin's sharing on node `n`
/// yet: it has not relabelled since our config write, or reports other replicas.
pub fn unconfirmed(n: &NodeFacts, w: &Prepared, config: (&str, Option<&str>)) -> Option<String> {
    gfd_not_reported(n, config).or_else(|| {
        let gfd = GfdReport::read(n.labels.iter());
        replicas_unconfirmed(w.spec.strategy, &gfd, replicas(w.spec) as i64)
    })
}

/// Why GPU Feature Discovery's report does not confirm `expected` replicas per GPU yet
/// (`nvidia.com/gpu.replicas`; exclusive may report 1; no report confirms nothing against).
pub fn replicas_unconfirmed(strategy: Strategy, gfd: &GfdReport, expected: i64) -> Option<String> {
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

/// Replicas per GPU the device plugin advertises: 1 exclusive, the time-slicing or MPS replicas
/// (the most any resource gets).
pub fn replicas(spec: &GpuSharingPolicySpec) -> i32 {
    match spec.strategy {
        Strategy::TimeSlicing => spec.time_slicing.as_ref().map_or(1, most_replicas),
        Strategy::Mps => spec.mps.as_ref().map_or(1, |m| m.replicas),
        _ => 1,
    }
}

/// What the device plugin advertises on `node` (see [`Advertised`]): `count` GPUs, times the
/// replicas, renamed `.shared` when asked; `None` without GPU Feature Discovery's GPU count.
pub fn advertises(spec: &GpuSharingPolicySpec, node: &NodeFacts) -> Option<Advertised> {
    let count = gpu_count(node)?;
    let gpu = crate::nvidia::GPU_RESOURCE;
    let (name, units) = match spec.strategy {
        Strategy::TimeSlicing => {
            let ts = spec.time_slicing.as_ref()?;
            let r = ts_replicas(ts, gpu);
            (advertised_name(gpu, r, ts.rename_by_default), count * r)
        }
        Strategy::Mps => {
            let m = spec.mps.as_ref()?;
            let r = m.replicas as i64;
            (advertised_name(gpu, r, m.rename_by_default), count * r)
        }
        _ => (gpu.to_string(), count),
    };
    Some(Advertised {
        resources: [(name, (units, units))].into_iter().collect(),
    })
}

/// One node's capacity: its GPUs times the replicas; MPS divides memory and threads among its
/// clients (as the DRA driver's MPS limits do); time-slicing isolates no memory.
pub fn capacity(spec: &GpuSharingPolicySpec, node: &NodeFacts) -> NodeCapacity {
    let gpus = gpu_count(node).unwrap_or(0);
    let mem = gpu_memory_mib(node);
    let node_cap = |schedulable, memory, threads, isolated| {
        cap(gpus, Some(schedulable), memory, threads, isolated)
    };
    match spec.strategy {
        Strategy::TimeSlicing => {
            let ts = spec.time_slicing.as_ref();
            let r = ts
                .and_then(|t| {
                    t.replicas.or_else(|| {
                        t.resources
                            .iter()
                            .find(|r| {
                                crate::nvidia::qualify_resource(&r.name)
                                    == crate::nvidia::GPU_RESOURCE
                            })
                            .map(|r| r.replicas)
                    })
                })
                .unwrap_or(1) as i64;
            node_cap(gpus * r, mem, None, false)
        }
        Strategy::Mps => {
            let r = replicas(spec) as i64;
            let (threads, memory) = crate::nvidia::dra::mps_limits(spec, mem);
            node_cap(gpus * r, memory, Some(threads), true)
        }
        _ => node_cap(gpus, mem, Some(100), true),
    }
}

/// Whether clients are isolated in memory: not under time-slicing.
pub fn memory_isolation(spec: &GpuSharingPolicySpec) -> bool {
    spec.strategy != Strategy::TimeSlicing
}
