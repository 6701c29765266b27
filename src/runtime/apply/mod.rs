//! The appliers: each writes only what differs from the caches, with server-side apply under our
//! field manager, and records every write (object and reason) in the pass's [`WriteReport`],
//! from which logs and metrics are fed, with what the writes taught about the cluster
//! ([`Learnt`]), from which the control loop's memory is kept (the appliers hold none). One file per kind of object written: our ConfigMaps
//! ([`configmaps`]), node metadata, cordons and readiness taints ([`nodes`]), the ClusterPolicy
//! ([`cluster_policy`]), ResourceClaimTemplates ([`claims`]), DeviceClasses ([`classes`]),
//! Karpenter NodeOverlays
//! ([`overlays`]), pod evictions ([`evict`]) and the layouts demand chose ([`demand`]).

use std::collections::{BTreeMap, BTreeSet};

use kube::api::PatchParams;

use crate::api::names::MANAGER;

pub mod claims;
pub mod classes;
pub mod cluster_policy;
pub mod configmaps;
pub mod demand;
pub mod evict;
pub mod nodes;
pub mod overlays;

pub use claims::apply_claim_templates;
pub use classes::{KIND as DEVICE_CLASS, apply_device_classes};
pub use cluster_policy::apply_cluster_policy;
pub use configmaps::{apply_configmaps, delete_unused_mig_configmap, delete_unused_vgpu_configmap};
pub use demand::apply_demand;
pub use evict::{EVICTION_WAIT, evict};
pub use nodes::{apply_nodes, remove_readiness_taints, set_spare_taints};
pub use overlays::apply_node_overlays;

/// One write to the API server.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Write {
    /// Kind of object (`Node`, `ConfigMap`, `ClusterPolicy`, `ResourceClaimTemplate`,
    /// `GpuSharingPolicyStatus`).
    pub kind: &'static str,
    pub object: String,
    pub reason: String,
}

/// What a write taught that the cluster's objects do not say, for the next passes (see
/// [`crate::runtime::memory`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Learnt {
    /// The API server refused (or did not answer) this pod's eviction. Reported only together
    /// with [`Learnt::EvictionsTried`]: a pass that fails before its evictions are all tried
    /// leaves the last complete list standing.
    EvictionBlocked { pod: String, why: String },
    /// Every eviction of the pass was tried; these nodes are being drained (a foreign cordon
    /// of any other node is forgotten).
    EvictionsTried { draining: BTreeSet<String> },
    /// A node to drain was already cordoned by someone else (seen when we went to cordon it).
    ForeignCordon(String),
    /// A ConfigMap write found the GPU Operator's namespace missing.
    NamespaceMissing(String),
    /// A ConfigMap write went through: the namespace is there.
    NamespaceFound,
    /// These ClusterPolicy fields were applied by us: a later change by someone else is drift.
    ClusterPolicyApplied { fields: BTreeSet<String> },
    /// Someone else had changed our ClusterPolicy fields; we put them back.
    ClusterPolicyRepaired { what: String },
    /// This object of ours is as planned (someone else may have fixed it): a refusal of its
    /// write is over.
    InSync { kind: &'static str, object: String },
    /// The API server refused this write for what the object is (see
    /// [`crate::runtime::error::Error::refused_write`]); the pass went on.
    WriteRefused {
        kind: &'static str,
        object: String,
        why: String,
    },
}

/// Every write of a pass, and what the writes taught.
#[derive(Debug, Default, Clone)]
pub struct WriteReport {
    pub writes: Vec<Write>,
    /// In the order learnt.
    pub learnt: Vec<Learnt>,
}

impl WriteReport {
    pub fn record(
        &mut self,
        kind: &'static str,
        object: impl Into<String>,
        reason: impl Into<String>,
    ) {
        self.writes.push(Write {
            kind,
            object: object.into(),
            reason: reason.into(),
        });
    }

    /// A write of `kind` `object` that failed: the API server's refusal of this one object is
    /// learnt and the pass goes on (`Ok`); any other error is the pass's (`Err`).
    pub fn refused(
        &mut self,
        kind: &'static str,
        object: &str,
        e: crate::runtime::error::Error,
    ) -> Result<(), crate::runtime::error::Error> {
        let why = e.refused_write().ok_or(e)?;
        tracing::warn!(kind, object, why = %why, "the API server refused a write; going on");
        self.learn(Learnt::WriteRefused {
            kind,
            object: object.to_string(),
            why,
        });
        Ok(())
    }

    /// The refusals learnt this pass.
    pub fn refusals(&self) -> impl Iterator<Item = (&'static str, &str, &str)> {
        self.learnt.iter().filter_map(|l| match l {
            Learnt::WriteRefused { kind, object, why } => {
                Some((*kind, object.as_str(), why.as_str()))
            }
            _ => None,
        })
    }

    /// Something learnt, for the control loop's memory.
    pub fn learn(&mut self, learnt: Learnt) {
        self.learnt.push(learnt);
    }

    /// Whether the pass wrote nothing (what it learnt does not count).
    pub fn is_empty(&self) -> bool {
        self.writes.is_empty()
    }

    /// Writes of one kind.
    pub fn count(&self, kind: &str) -> usize {
        self.writes.iter().filter(|w| w.kind == kind).count()
    }

    /// Writes per kind.
    pub fn by_kind(&self) -> BTreeMap<&'static str, u64> {
        let mut out = BTreeMap::new();
        for w in &self.writes {
            *out.entry(w.kind).or_default() += 1;
        }
        out
    }
}

/// Server-side apply under our field manager, taking over fields others set.
fn apply_params() -> PatchParams {
    PatchParams::apply(MANAGER).force()
}
