//! Karpenter's NodePools and NodeOverlays -> the planner's [`AutoscalingFacts`].

use std::collections::BTreeMap;

use kube::ResourceExt;
use kube::api::{ApiResource, DynamicObject};
use serde_json::Value;

use crate::api::names::MANAGED_BY;
use crate::plan::autoscaling::{DEFAULT_WEIGHT, TABLE_KEY};
use crate::plan::input::{AutoscalingFacts, NodePool, Overlay, Requirement};

/// Karpenter's NodePool (`karpenter.sh/v1`).
pub fn node_pool_resource() -> ApiResource {
    ApiResource {
        group: "karpenter.sh".into(),
        version: "v1".into(),
        api_version: "karpenter.sh/v1".into(),
        kind: "NodePool".into(),
        plural: "nodepools".into(),
    }
}

/// Karpenter's NodeOverlay (`karpenter.sh/v1alpha1`, behind its `NodeOverlay` feature gate).
pub fn node_overlay_resource() -> ApiResource {
    ApiResource {
        group: "karpenter.sh".into(),
        version: "v1alpha1".into(),
        api_version: "karpenter.sh/v1alpha1".into(),
        kind: "NodeOverlay".into(),
        plural: "nodeoverlays".into(),
    }
}

/// What a reader saw of Karpenter: its NodePools and every NodeOverlay.
#[derive(Debug, Clone, Default)]
pub struct KarpenterView<'a> {
    pub node_pools: Vec<&'a DynamicObject>,
    pub overlays: Vec<&'a DynamicObject>,
}

/// Whether a NodeOverlay is ours (our managed-by label).
pub fn is_ours(o: &DynamicObject) -> bool {
    o.labels().get(MANAGED_BY.0).map(String::as_str) == Some(MANAGED_BY.1)
}

fn requirements(v: &Value) -> Vec<Requirement> {
    v.as_array()
        .into_iter()
        .flatten()
        .filter_map(|r| {
            Some(Requirement {
                key: r["key"].as_str()?.to_string(),
                operator: r["operator"].as_str()?.to_string(),
                values: r["values"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter_map(|x| x.as_str().map(str::to_string))
                    .collect(),
            })
        })
        .collect()
}

/// The planner's facts: NodePools in name order, the overlays not ours, the admin's table
/// (from the operator's ConfigMap data, when there is one).
pub fn facts(
    view: KarpenterView,
    table: Option<&BTreeMap<String, String>>,
    weight: Option<i32>,
) -> AutoscalingFacts {
    let mut node_pools: Vec<NodePool> = view
        .node_pools
        .iter()
        .map(|np| {
            let t = &np.data["spec"]["template"];
            NodePool {
                name: np.name_any(),
                labels: t["metadata"]["labels"]
                    .as_object()
                    .into_iter()
                    .flatten()
                    .filter_map(|(k, v)| Some((k.clone(), v.as_str()?.to_string())))
                    .collect(),
                requirements: requirements(&t["spec"]["requirements"]),
            }
        })
        .collect();
    node_pools.sort_by(|a, b| a.name.cmp(&b.name));
    let mut foreign_overlays: Vec<Overlay> = view
        .overlays
        .iter()
        .filter(|o| !is_ours(o))
        .map(|o| Overlay {
            name: o.name_any(),
            weight: o.data["spec"]["weight"].as_i64().unwrap_or(0) as i32,
            requirements: requirements(&o.data["spec"]["requirements"]),
            resources: o.data["spec"]["capacity"]
                .as_object()
                .map(|m| m.keys().cloned().collect())
                .unwrap_or_default(),
        })
        .collect();
    foreign_overlays.sort_by(|a, b| a.name.cmp(&b.name));
    AutoscalingFacts {
        node_pools,
        foreign_overlays,
        table: table.and_then(|d| d.get(TABLE_KEY).cloned()),
        weight: weight.unwrap_or(DEFAULT_WEIGHT),
    }
}
