//! What the per-node transition decides ([`Decision`]) and what it decides from besides the
//! node and its policy ([`Env`], the ClusterPolicy's [`Sandbox`] settings, the node's MIG
//! situation). The container transition (`node.rs`) and the VM transition (`vm.rs`) both speak
//! this vocabulary; keeping it in this leaf lets `node` call into `vm` without `vm` importing
//! `node` back.

use crate::api::names::{LABEL_MIG_CONFIG, LABEL_MIG_STATE};
use crate::api::state::{HoldReason, NodeState};
use crate::nvidia::state::MigState;

use super::facts::NodeFacts;
pub use super::input::Sandbox;
use super::nodeinputs::NodeInputs;

/// What the transition knows besides the node and its policy.
pub struct Env<'a> {
    /// Pods using GPUs on this node.
    pub gpu_pods: &'a [String],
    /// The node's MIG state has said `pending` for longer than the MIG timeout.
    pub mig_stuck: bool,
    /// Unix seconds, recorded when the device-plugin config label changes. Read through
    /// [`Env::now`], which remembers that it was read: a node whose plan did not read the clock
    /// plans the same at any time (incremental planning reuses it, see `memo`).
    pub(super) now: i64,
    pub(super) now_read: std::cell::Cell<bool>,
    /// What a layout name means now, as a content hash (`None`: unknown, or `all-disabled`).
    pub layout_hash: &'a dyn Fn(&str) -> Option<String>,
    /// Allocated `gpu.nvidia.com` ResourceClaims on this node (`namespace/name`).
    pub dra_claims: &'a [String],
    /// What NVIDIA's DRA driver publishes for this node (`None`: nothing).
    pub dra_slice: Option<&'a super::input::DraSlice>,
    /// The GPU Operator's DRA-only `GPUCluster`, when one exists: no device plugin to configure.
    pub gpu_cluster: Option<&'a str>,
    /// Pods on this node using the sandbox device plugin's resources (VMs).
    pub vm_pods: &'a [String],
    /// The node's `nvidia.com/vgpu.config.state` has said `pending` past the timeout.
    pub vgpu_stuck: bool,
    /// The ClusterPolicy's sandbox settings.
    pub sandbox: &'a Sandbox,
    /// Named mig-parted layouts (what the device plugin will advertise under a named layout).
    pub mig_layouts: Option<&'a std::collections::BTreeMap<String, serde_json::Value>>,
    /// The ClusterPolicy's MIG strategy as read (`None`: not set, or unknown).
    pub cluster_mig_strategy: Option<&'a str>,
}

impl<'a> Env<'a> {
    /// What the transition knows of the node of these inputs.
    pub fn of(i: &'a NodeInputs, layout_hash: &'a dyn Fn(&str) -> Option<String>) -> Env<'a> {
        Env {
            gpu_pods: i.gpu_pods,
            mig_stuck: i.mig_stuck,
            now: i.now,
            now_read: Default::default(),
            layout_hash,
            dra_claims: i.dra_claims,
            dra_slice: i.dra_slice,
            gpu_cluster: i.cluster.gpu_cluster,
            vm_pods: i.vm_pods,
            vgpu_stuck: i.vgpu_stuck,
            sandbox: i.cluster.sandbox,
            mig_layouts: i.cluster.mig_layouts,
            cluster_mig_strategy: i.cluster.cluster_mig_strategy,
        }
    }
}

impl Env<'_> {
    /// The clock (unix seconds), noting that this node's plan depends on it.
    pub fn now(&self) -> i64 {
        self.now_read.set(true);
        self.now
    }

    /// Whether the plan made with this environment read the clock.
    pub fn read_clock(&self) -> bool {
        self.now_read.get()
    }

    /// An environment with nothing in it (no pods, no claims), for offline planning and tests.
    pub fn idle(now: i64, layout_hash: &dyn Fn(&str) -> Option<String>) -> Env<'_> {
        Env {
            gpu_pods: &[],
            mig_stuck: false,
            now,
            now_read: Default::default(),
            layout_hash,
            dra_claims: &[],
            dra_slice: None,
            gpu_cluster: None,
            vm_pods: &[],
            vgpu_stuck: false,
            sandbox: &NO_SANDBOX,
            mig_layouts: None,
            cluster_mig_strategy: None,
        }
    }
}

/// ClusterPolicy sandbox settings nobody configured.
static NO_SANDBOX: Sandbox = Sandbox {
    mode: None,
    vgpu_manager_enabled: false,
};

/// What to do with a node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// No policy governs it: give back what we own (a MIG layout we set goes to `all-disabled`).
    Release,
    /// Leave every label and annotation we own exactly as it is.
    Hold {
        state: NodeState,
        message: String,
        /// Why, for a node that waits (`Waiting`).
        reason: Option<HoldReason>,
    },
    /// Own these labels (besides the policy label).
    Write {
        state: NodeState,
        message: String,
        device_config: String,
        mig_layout: Option<String>,
        /// Own `nvidia.com/gpu.deploy.device-plugin=false` (a DRA policy's node).
        device_plugin_off: bool,
        /// Own `nvidia.com/gpu.deploy.dra-driver`: `true` on a node moved to DRA extended
        /// resources, `false` while it leaves them (`None`: not ours).
        dra_plugin: Option<bool>,
        /// Own `nvidia.com/gpu.workload.config` with this value.
        workload: Option<&'static str>,
        /// Own `nvidia.com/vgpu.config` with this value (a vGPU policy's node).
        vgpu_config: Option<String>,
    },
}

pub(super) fn hold(state: NodeState, message: impl Into<String>) -> Decision {
    Decision::Hold {
        state,
        message: message.into(),
        reason: None,
    }
}

/// The node waits for something on it to finish (`Waiting`), for `reason`.
pub(super) fn wait(reason: HoldReason, message: impl Into<String>) -> Decision {
    Decision::Hold {
        state: NodeState::Waiting,
        message: message.into(),
        reason: Some(reason),
    }
}

pub(super) fn write(
    state: NodeState,
    message: impl Into<String>,
    dp: &str,
    mig: Option<String>,
) -> Decision {
    Decision::Write {
        state,
        message: message.into(),
        device_config: dp.to_string(),
        mig_layout: mig,
        device_plugin_off: false,
        dra_plugin: None,
        workload: None,
        vgpu_config: None,
    }
}

/// Why a MIG change waits on this node.
pub(super) fn busy_msg(pods: &[String]) -> String {
    format!("WaitingForIdleGPUs: pods using GPUs: {}", some_of(pods))
}

/// At most five of `names`, and how many more there are.
pub(crate) fn some_of(names: &[String]) -> String {
    const SHOWN: usize = 5;
    let shown: Vec<&str> = names.iter().take(SHOWN).map(String::as_str).collect();
    match names.len().saturating_sub(SHOWN) {
        0 => shown.join(", "),
        more => format!("{} and {more} more", shown.join(", ")),
    }
}

/// Why GPU Feature Discovery has not reported device-plugin config `dp` yet: its timestamp is
/// not newer than our label write (`written`, unix seconds, when known).
pub(crate) fn gfd_not_reported(
    n: &NodeFacts,
    (dp, written): (&str, Option<&str>),
) -> Option<String> {
    super::facts::gfd_behind(n, written).map(|w| {
        format!(
            "waiting for GPU Feature Discovery to report config {dp} (nvidia.com/gfd.timestamp not newer than our label write at {w})"
        )
    })
}

/// The node's current MIG situation, as the MIG manager reports it.
pub(super) fn mig_of(n: &NodeFacts) -> MigState<'_> {
    MigState::read(
        n.labels.get(LABEL_MIG_CONFIG),
        n.labels.get(LABEL_MIG_STATE),
    )
}
