//! What `plan` reports: the policies, nodes, config keys and ClusterPolicy fields that would
//! change. Plain serializable data, computed by [`super::diff`] and printed by
//! [`super::print`] (or as YAML/JSON).

use std::collections::BTreeSet;

use serde::Serialize;

use crate::api::crd::Capacity;

/// What happens to a policy object.
#[derive(Serialize, Debug, Clone, Copy, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub enum PolicyChange {
    Added,
    Changed,
    Removed,
    Unchanged,
}

/// A policy's result on one side of the change.
#[derive(Serialize, Debug, Clone, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct PolicySide {
    pub strategy: String,
    /// `applied/matched` nodes.
    pub nodes: String,
    pub ready: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub capacity: Option<Capacity>,
    /// A custom MIG layout's placements per GPU model (`status.migGeometry`).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub mig_geometry: Vec<String>,
    /// The `Degraded` condition's message, when it is True.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub degraded: Option<String>,
}

#[derive(Serialize, Debug, Clone, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct PolicyPreview {
    pub name: String,
    pub change: PolicyChange,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub before: Option<PolicySide>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub after: Option<PolicySide>,
}

/// How a node shares its GPUs: the governing policy and its strategy, the device-plugin config
/// key, the MIG layout, and for VM hosts the workload and vGPU config (from the node's labels).
#[derive(Serialize, Debug, Clone, PartialEq, Eq, Default)]
#[serde(rename_all = "camelCase")]
pub struct NodeSharing {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub policy: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub strategy: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub config: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mig_layout: Option<String>,
    /// `nvidia.com/gpu.workload.config`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub workload: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub vgpu_config: Option<String>,
}

/// One value that changes (a label, a ClusterPolicy field); `None` is absent.
#[derive(Serialize, Debug, Clone, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Change<T> {
    pub key: String,
    pub before: Option<T>,
    pub after: Option<T>,
}

#[derive(Serialize, Debug, Clone, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct NodePreview {
    pub name: String,
    pub before: NodeSharing,
    pub after: NodeSharing,
    /// The first wave (1-based) in which the node changes.
    pub wave: usize,
    pub labels: Vec<Change<String>>,
}

#[derive(Serialize, Debug, Clone, PartialEq, Default)]
pub struct KeyChanges {
    pub added: Vec<String>,
    pub removed: Vec<String>,
}

impl KeyChanges {
    pub(super) fn of<'a>(
        before: impl IntoIterator<Item = &'a String>,
        after: impl IntoIterator<Item = &'a String>,
    ) -> Self {
        let b: BTreeSet<&String> = before.into_iter().collect();
        let a: BTreeSet<&String> = after.into_iter().collect();
        KeyChanges {
            added: a.difference(&b).map(|s| s.to_string()).collect(),
            removed: b.difference(&a).map(|s| s.to_string()).collect(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.added.is_empty() && self.removed.is_empty()
    }
}

/// Everything `plan` reports.
#[derive(Serialize, Debug, Clone, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Preview {
    pub changed: bool,
    pub policies: Vec<PolicyPreview>,
    /// Nodes whose labels change, in name order.
    pub nodes: Vec<NodePreview>,
    /// Nodes changed per wave of writes, in order.
    pub waves: Vec<Vec<String>>,
    pub device_plugin_config_keys: KeyChanges,
    pub mig_layouts: KeyChanges,
    pub claim_templates: KeyChanges,
    /// Our DeviceClasses (policies with `dra.extendedResources`), one line each: name and the
    /// extended resource it maps.
    #[serde(default, skip_serializing_if = "KeyChanges::is_empty")]
    pub device_classes: KeyChanges,
    /// Karpenter NodeOverlays, one line each (name, capacity, NodePools and instance types):
    /// a changed capacity shows as the old line removed and the new one added.
    pub node_overlays: KeyChanges,
    /// The MIG layouts demand would give idle nodes for the pods pending now
    /// (`spec.mig.dynamic`): `node: layout (for pod, ...)`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub demand_layouts: Vec<String>,
    /// Nodes that would gain (`added`) or lose (`removed`) the spare taint
    /// (`gpusharing.io/spare:PreferNoSchedule`, `preferBusyNodes`).
    #[serde(default, skip_serializing_if = "KeyChanges::is_empty")]
    pub spare_taints: KeyChanges,
    /// ClusterPolicy `spec` fields, dotted; `after: None` is a field the operator releases.
    pub cluster_policy: Vec<Change<serde_json::Value>>,
    /// Planning passes until convergence.
    pub passes: usize,
    /// What could not be read, or only the controller's memory or flags hold, and was assumed.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub assumptions: Vec<String>,
}
