//! The desired state a plan describes ([`Plan`]), and the ConfigMap object we apply.

use std::collections::BTreeMap;

use serde_json::json;

use crate::api::crd::GpuSharingPolicyStatus;
use crate::api::names::{CONFIG_LABEL, MANAGED_BY};
use crate::validate::FieldError;

use super::labels::SmallMap;
use super::nodemap::NodeMap;
use super::{demand, drain};

/// The desired state.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Plan {
    /// Data of the device-plugin ConfigMap.
    pub device_config: BTreeMap<String, String>,
    /// `config.yaml` of the mig-parted ConfigMap, when one is needed.
    pub mig_config: Option<String>,
    /// `config.yaml` of the vGPU-devices ConfigMap, when one is needed (custom vGPU layouts).
    pub vgpu_config: Option<String>,
    /// The part of the ClusterPolicy `spec` we own (a merge patch / apply configuration).
    pub cluster_policy_spec: serde_json::Value,
    /// For every node: the managed labels we want to own, with their values. Nodes that need
    /// none of our labels map to an empty set.
    pub node_labels: NodeMap<SmallMap>,
    /// For every node in `node_labels`: the annotations we want to own ([`MANAGED_ANNOTATIONS`](crate::api::names::MANAGED_ANNOTATIONS)).
    pub node_annotations: NodeMap<SmallMap>,
    /// Status of every policy, by name.
    pub statuses: BTreeMap<String, GpuSharingPolicyStatus>,
    /// ResourceClaimTemplates of DRA policies, by `namespace/name`.
    pub claim_templates: BTreeMap<String, serde_json::Value>,
    /// The errors of every invalid policy, by name, as typed field errors.
    pub invalid: BTreeMap<String, Vec<FieldError>>,
    /// Nodes whose readiness taint is to be removed now.
    pub untaint: Vec<String>,
    /// Nodes whose spare taint (`preferBusyNodes`) is to be added (true) or removed (false).
    pub spare: Vec<(String, bool)>,
    /// Nodes being drained (cordoned through their annotations), with the pods to evict.
    pub drains: BTreeMap<String, drain::Drain>,
    /// The nodes of `node_labels` whose labels or annotations differ from what the plan wants
    /// us to own on them (the node writes of this plan), in name order.
    pub nodes_to_write: Vec<String>,
    /// How many nodes the plan labels with each policy's name (`gpusharing.io/policy`).
    pub labelled_nodes: BTreeMap<String, u64>,
    /// Karpenter NodeOverlays of the policies, by name (empty when the kind is not served).
    pub node_overlays: BTreeMap<String, serde_json::Value>,
    /// Our DeviceClasses mapping the extended-resource policies' names, by name.
    pub device_classes: BTreeMap<String, serde_json::Value>,
    /// Demand-driven MIG: the layouts to record on nodes, the events for the pods acted for,
    /// and when to look again.
    pub demand: demand::DemandPlan,
}

/// One of the ConfigMaps we own, as the object we apply.
pub fn configmap(
    name: &str,
    namespace: &str,
    kind: &str,
    data: &BTreeMap<String, String>,
) -> serde_json::Value {
    json!({
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": {MANAGED_BY.0: MANAGED_BY.1, CONFIG_LABEL: kind},
        },
        "data": data,
    })
}
