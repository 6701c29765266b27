//! ResourceClaims -> the nodes NVIDIA's DRA driver has allocated devices on: a node leaves DRA
//! for the device plugin only when no allocated `gpu.nvidia.com` claim is left on it.

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::ResourceExt;

/// The DRA driver whose claims keep a node on DRA.
pub use crate::api::names::DRA_DRIVER;

/// The nodes an allocated claim's `gpu.nvidia.com` devices are on: the allocation's node
/// selector (`metadata.name` fields, as the scheduler writes it for node-local devices), else
/// the devices' pools (NVIDIA's driver names each node's pool after the node).
fn claim_nodes(c: &ResourceClaim) -> BTreeSet<String> {
    let Some(a) = c.status.as_ref().and_then(|s| s.allocation.as_ref()) else {
        return BTreeSet::new();
    };
    let results = a.devices.iter().flat_map(|d| d.results.iter().flatten());
    let ours: Vec<_> = results.filter(|r| r.driver == DRA_DRIVER).collect();
    if ours.is_empty() {
        return BTreeSet::new();
    }
    let by_selector: BTreeSet<String> = a
        .node_selector
        .iter()
        .flat_map(|s| &s.node_selector_terms)
        .flat_map(|t| t.match_fields.iter().flatten())
        .filter(|f| f.key == "metadata.name" && f.operator == "In")
        .flat_map(|f| f.values.iter().flatten().cloned())
        .collect();
    if by_selector.is_empty() {
        ours.iter().map(|r| r.pool.clone()).collect()
    } else {
        by_selector
    }
}

/// The allocated `gpu.nvidia.com` claims by node (`namespace/name`, sorted).
pub fn dra_claims<'a>(
    claims: impl IntoIterator<Item = &'a ResourceClaim>,
) -> BTreeMap<String, Vec<String>> {
    let mut out: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for c in claims {
        let id = format!("{}/{}", c.namespace().unwrap_or_default(), c.name_any());
        for node in claim_nodes(c) {
            out.entry(node).or_default().push(id.clone());
        }
    }
    for v in out.values_mut() {
        v.sort();
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn claim(name: &str, status: serde_json::Value) -> ResourceClaim {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": name, "namespace": "team"},
            "spec": {},
            "status": status,
        }))
        .unwrap()
    }

    #[test]
    fn allocated_nvidia_claims_are_read_by_node() {
        let result = |driver: &str, pool: &str| serde_json::json!({"request": "gpu", "driver": driver, "pool": pool, "device": "gpu-0"});
        let by_selector = claim(
            "a",
            serde_json::json!({"allocation": {
                "devices": {"results": [result(DRA_DRIVER, "pool-x")]},
                "nodeSelector": {"nodeSelectorTerms": [{"matchFields": [
                    {"key": "metadata.name", "operator": "In", "values": ["node-1"]}]}]}}}),
        );
        let by_pool = claim(
            "b",
            serde_json::json!({"allocation": {"devices": {"results": [result(DRA_DRIVER, "node-2")]}}}),
        );
        let other_driver = claim(
            "c",
            serde_json::json!({"allocation": {"devices": {"results": [result("net.example.com", "node-1")]}}}),
        );
        let unallocated = claim("d", serde_json::json!({}));
        let all = [by_selector, by_pool, other_driver, unallocated];
        let by_node = dra_claims(all.iter());
        assert_eq!(by_node.len(), 2);
        assert_eq!(by_node["node-1"], ["team/a"]);
        assert_eq!(by_node["node-2"], ["team/b"]);
    }
}
