//! The typed states and reasons a policy's status reports. They serialize as the same strings as
//! before and the CRD schema lists them; `Unknown` absorbs values written by another version of
//! the operator, so reading an older or newer status never fails.

use std::fmt;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// Defines a string enum: serde names are the variant names, `Unknown` catches anything else.
macro_rules! string_enum {
    ($(#[$meta:meta])* $name:ident { $($variant:ident),+ $(,)? }) => {
        $(#[$meta])*
        #[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, JsonSchema)]
        pub enum $name {
            $($variant,)+
            #[serde(other)]
            Unknown,
        }

        impl $name {
            pub fn as_str(&self) -> &'static str {
                match self {
                    $(Self::$variant => stringify!($variant),)+
                    Self::Unknown => "Unknown",
                }
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.as_str())
            }
        }

        impl PartialEq<&str> for $name {
            fn eq(&self, other: &&str) -> bool {
                self.as_str() == *other
            }
        }

        impl PartialEq<str> for $name {
            fn eq(&self, other: &str) -> bool {
                self.as_str() == other
            }
        }
    };
}

string_enum!(
    /// What the operator is doing with one node it matched.
    NodeState {
        // Runs what the policy says, as NVIDIA's components report it.
        Applied,
        // Being reconfigured.
        Pending,
        // A MIG change waits for pods using the GPUs to finish.
        Waiting,
        // The policy is not accepted, or cannot run on this node: the node is left as it was.
        Rejected,
        // The policy's MIG layout cannot be placed on this node's GPUs (their model's MIG
        // geometry): the node is left as it was.
        Invalid,
        // The MIG manager failed (or stayed pending past the timeout): left untouched.
        Failed,
        // Its named MIG layout changed content since the node was configured.
        Stale,
        // Another policy of the same priority governs the node (decided by age or name).
        Conflicted,
        // A policy of higher priority governs the node: an intended override.
        Overridden,
        // Waits for its rollout wave (the policy's maxUnavailable budget is in use), or the
        // rollout is paused or halted.
        Queued,
        // Cordoned; the pods that use its GPUs are being evicted (`disruption.mode: drain`).
        Draining,
    }
);

impl HoldReason {
    /// A wait that a drain ends (pods hold the node): under `disruption.mode: drain` the node
    /// is cordoned and its pods evicted. Not a wait for a class, for Karpenter or for the GPU
    /// Operator to resume an operand: evicting pods changes none of those.
    pub fn ended_by_drain(self) -> bool {
        !matches!(
            self,
            HoldReason::WaitingForDeviceClass
                | HoldReason::WaitingForNodeInitialization
                | HoldReason::WaitingForPausedOperands
        )
    }
}

impl NodeState {
    /// The policy cannot run on the node as it is, which is left as it was (`Rejected`,
    /// `Invalid`).
    pub fn refused(self) -> bool {
        matches!(self, NodeState::Rejected | NodeState::Invalid)
    }
}

string_enum!(
    /// Why the operator holds a node it governs as it is (a `Waiting` or `Queued` node): the
    /// `reason` of its entry in `nodeDetails`, counted in `heldNodes` and in the
    /// `gpu_sharing_policy_held_nodes` metric.
    HoldReason {
        // Pods use the node's GPUs and the change needs them idle (a MIG change, MIG off, the
        // device plugin off for DRA).
        WaitingForIdleGPUs,
        // Allocated gpu.nvidia.com ResourceClaims: the device plugin stays off until they go.
        WaitingForDraClaims,
        // The policy's DeviceClass does not map its extended resource name yet (not created
        // yet, or kube-apiserver drops the field: the DRAExtendedResource feature gate is off).
        WaitingForDeviceClass,
        // Karpenter launched the node and has not initialized it yet: it waits for the device
        // plugin's resources, which a node moved to the DRA driver never registers.
        WaitingForNodeInitialization,
        // The GPU Operator paused an operand's switch on the node (`paused-for-*`: a driver
        // upgrade, a MIG change): its device plugin or DRA switches wait until it resumes.
        WaitingForPausedOperands,
        // MPS clients run and the new config restarts the MPS control daemon (drain policies).
        WaitingForMpsClients,
        // Virtual machines use the node's GPUs.
        WaitingForVMs,
        // The policy's maxUnavailable budget is in use.
        WaitingForRolloutWave,
        // An earlier change of ours is not confirmed by NVIDIA's components yet.
        WaitingForConfirmation,
        // The policy (or the operator, --pause-rollouts) pauses its rollout.
        RolloutPaused,
        // The rollout of the policy's generation halted on a failed node.
        RolloutHalted,
    }
);

string_enum!(
    /// `True`, `False` (or `Unknown`), as Kubernetes conditions say it.
    ConditionStatus { True, False }
);

impl From<bool> for ConditionStatus {
    fn from(b: bool) -> Self {
        if b { Self::True } else { Self::False }
    }
}

string_enum!(
    /// The conditions of a policy.
    ConditionType {
        Accepted,
        Ready,
        Progressing,
        Conflicted,
        Overridden,
        Degraded,
        // Only on policies with a custom MIG layout: True when some of their nodes have a GPU
        // model whose MIG geometry the operator does not know (the layout is not checked).
        MigGeometryUnverified,
        // Whether the admission policies keep the operator's account to its own writes, as its
        // last fence check found (dry-run writes they must refuse); absent before one.
        Fenced,
    }
);

string_enum!(
    /// Why a condition has its status (every reason is documented in docs/status.md).
    Reason {
        // Accepted
        Valid,
        InvalidSpec,
        IncompatibleNodes,
        ClusterWideConflict,
        // Ready
        Converged,
        NoNodes,
        Progressing,
        NotAccepted,
        MigLayoutChanged,
        NamespaceMissing,
        // Progressing
        Reconfiguring,
        WaitingForIdleGPUs,
        Idle,
        RollingOut,
        RolloutHalted,
        Paused,
        Draining,
        // Conflicted
        OverlappingPolicy,
        NoOverlap,
        // Overridden
        HigherPriorityPolicy,
        NotOverridden,
        // Degraded
        MigConfigFailed,
        MigGeometryInfeasible,
        VgpuConfigFailed,
        ClusterPolicyMissing,
        ClusterPolicyContested,
        ReadinessTaintNotTolerated,
        GpuClusterPresent,
        WriteRefused,
        Healthy,
        // MigGeometryUnverified
        UnknownGpuModel,
        GeometryChecked,
        // Fenced
        AdmissionPoliciesEnforced,
        NotFenced,
    }
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn states_serialize_as_their_names_and_unknown_values_are_absorbed() {
        assert_eq!(serde_json::to_value(NodeState::Applied).unwrap(), "Applied");
        assert_eq!(
            serde_json::from_value::<Reason>("SomethingNew".into()).unwrap(),
            Reason::Unknown
        );
        assert_eq!(
            serde_json::from_value::<ConditionStatus>("True".into()).unwrap(),
            ConditionStatus::True
        );
        assert!(Reason::WaitingForIdleGPUs == "WaitingForIdleGPUs");
        assert_eq!(ConditionStatus::from(false).as_str(), "False");
    }
}
