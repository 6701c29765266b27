//! ResourceSlices -> what NVIDIA's DRA driver publishes per node ([`DraSlice`]): its whole GPUs,
//! MIG devices by profile, and their consumable shares. The cache keeps only what the reader
//! reads ([`strip`]); `reader(strip(x)) == reader(x)` is tested below.
//!
//! Slices are written by a node agent (the kubelet plugin): counts are bounded, and only the
//! newest generation of each pool counts (a pool being republished has slices of two).

use std::collections::BTreeMap;

use k8s_openapi::api::resource::v1::{Device, DeviceAttribute, DeviceCapacity, ResourceSlice};

use crate::api::names::DRA_DRIVER;
use crate::plan::input::DraSlice;

/// The field selector of the slices the operator reads: the DRA driver's.
pub fn field_selector() -> String {
    format!("spec.driver={DRA_DRIVER}")
}

/// The most devices of one kind counted on a node: far above any node (64 GPUs x 7 MIG
/// instances), so a slice written by a hostile node agent cannot make sums overflow.
pub const MAX_DEVICES: i64 = 1 << 16;

/// The attribute and capacity names the reader reads.
const TYPE: &str = "type";
const PROFILE: &str = "profile";
const SHARES: &str = "shares";

/// A device attribute by its name, unqualified (the driver's own domain) or qualified.
fn attribute<'a>(d: &'a Device, name: &str) -> Option<&'a str> {
    let attrs = d.attributes.as_ref()?;
    attrs
        .get(name)
        .or_else(|| attrs.get(&format!("{DRA_DRIVER}/{name}")))?
        .string
        .as_deref()
}

fn capacity<'a>(d: &'a Device, name: &str) -> Option<&'a DeviceCapacity> {
    let caps = d.capacity.as_ref()?;
    caps.get(name)
        .or_else(|| caps.get(&format!("{DRA_DRIVER}/{name}")))
}

/// A slice as the cache keeps it: node, driver, pool, and of each device its name, type,
/// profile and `shares` (their value only).
pub fn strip(s: &mut ResourceSlice) {
    s.metadata.managed_fields = None;
    s.metadata.annotations = None;
    s.metadata.labels = None;
    s.metadata.owner_references = None;
    s.spec.node_selector = None;
    s.spec.shared_counters = None;
    for d in s.spec.devices.iter_mut().flatten() {
        let keep = |k: &String| {
            [TYPE, PROFILE, SHARES].iter().any(|n| {
                k == n || k.strip_prefix(DRA_DRIVER).and_then(|r| r.strip_prefix('/')) == Some(n)
            })
        };
        if let Some(a) = d.attributes.as_mut() {
            a.retain(|k, _| keep(k));
            for v in a.values_mut() {
                *v = DeviceAttribute {
                    string: v.string.take(),
                    ..Default::default()
                };
            }
        }
        if let Some(c) = d.capacity.as_mut() {
            c.retain(|k, _| keep(k));
            for v in c.values_mut() {
                v.request_policy = None;
            }
        }
        d.binding_conditions = None;
        d.binding_failure_conditions = None;
        d.consumes_counters = None;
        d.node_selector = None;
        d.taints = None;
    }
}

/// What the DRA driver publishes, by node: only `gpu.nvidia.com` slices of a node
/// (`spec.nodeName`), of each pool only its newest generation.
pub fn dra_slices<'a>(
    slices: impl IntoIterator<Item = &'a ResourceSlice>,
) -> BTreeMap<String, DraSlice> {
    let ours: Vec<&ResourceSlice> = slices
        .into_iter()
        .filter(|s| s.spec.driver == DRA_DRIVER && s.spec.node_name.is_some())
        .collect();
    let mut newest: BTreeMap<(&str, &str), i64> = BTreeMap::new();
    for s in &ours {
        let key = (
            s.spec.node_name.as_deref().unwrap_or_default(),
            s.spec.pool.name.as_str(),
        );
        let g = newest.entry(key).or_insert(s.spec.pool.generation);
        *g = (*g).max(s.spec.pool.generation);
    }
    let mut out: BTreeMap<String, DraSlice> = BTreeMap::new();
    let mut shares: BTreeMap<String, std::collections::BTreeSet<Option<i64>>> = BTreeMap::new();
    for s in ours {
        let node = s.spec.node_name.as_deref().unwrap_or_default();
        if newest.get(&(node, s.spec.pool.name.as_str())) != Some(&s.spec.pool.generation) {
            continue;
        }
        let e = out.entry(node.to_string()).or_default();
        for d in s.spec.devices.iter().flatten() {
            let kind = attribute(d, TYPE);
            if matches!(kind, Some("gpu" | "mig")) {
                let sh = capacity(d, SHARES).and_then(|c| c.value.0.parse::<i64>().ok());
                let seen = shares.entry(node.to_string()).or_default();
                if seen.len() < 3 {
                    seen.insert(sh);
                }
            }
            match kind {
                Some("gpu") => e.gpus = (e.gpus + 1).min(MAX_DEVICES),
                Some("mig") => {
                    if let Some(p) = attribute(d, PROFILE).filter(|p| p.len() <= 32)
                        && (e.mig.len() < 64 || e.mig.contains_key(p))
                    {
                        let c = e.mig.entry(p.to_string()).or_default();
                        *c = (*c + 1).min(MAX_DEVICES);
                    }
                }
                _ => {}
            }
        }
    }
    for (node, seen) in shares {
        if let Some(e) = out.get_mut(&node) {
            e.mixed_shares = seen.len() > 1;
            e.shares = if e.mixed_shares {
                seen.iter().flatten().min().copied()
            } else {
                seen.into_iter().next().flatten()
            };
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use serde_json::json;

    fn slice(node: &str, generation: i64, devices: serde_json::Value) -> ResourceSlice {
        serde_json::from_value(json!({
            "metadata": {"name": format!("{node}-{generation}"), "labels": {"x": "y"},
                "managedFields": [{"manager": "kubelet"}]},
            "spec": {"driver": DRA_DRIVER, "nodeName": node,
                "pool": {"name": node, "generation": generation, "resourceSliceCount": 1},
                "devices": devices}
        }))
        .unwrap()
    }

    fn gpu(i: usize, shares: Option<i64>) -> serde_json::Value {
        let mut d = json!({"name": format!("gpu-{i}"),
            "attributes": {"type": {"string": "gpu"}, "uuid": {"string": format!("GPU-{i}")},
                "productName": {"string": "NVIDIA A100"}},
            "capacity": {"memory": {"value": "40Gi"}}});
        if let Some(s) = shares {
            d["capacity"]["shares"] = json!({"value": s.to_string(),
                "requestPolicy": {"default": "1", "validRange": {"min": "1"}}});
        }
        d
    }

    /// A MIG device; the driver's consumable shares apply to it as to a whole GPU.
    fn mig(i: usize, profile: &str, shares: Option<i64>) -> serde_json::Value {
        let mut d = json!({"name": format!("gpu-{i}-mig-{profile}"),
            "attributes": {"type": {"string": "mig"}, "profile": {"string": profile}},
            "capacity": {"multiprocessors": {"value": "14"}}});
        if let Some(s) = shares {
            d["capacity"]["shares"] = json!({"value": s.to_string()});
        }
        d
    }

    #[test]
    fn counts_gpus_mig_and_shares_of_the_newest_generation() {
        let old = slice("a", 1, json!([gpu(0, None)]));
        let new = slice(
            "a",
            2,
            json!([gpu(0, Some(4)), gpu(1, Some(4)), mig(2, "1g.10gb", Some(4))]),
        );
        let other = {
            let mut s = slice("b", 1, json!([gpu(0, None)]));
            s.spec.driver = "other.example.com".into();
            s
        };
        let read = dra_slices([&old, &new, &other]);
        assert_eq!(read.len(), 1);
        let a = &read["a"];
        assert_eq!((a.gpus, a.shares, a.mixed_shares), (2, Some(4), false));
        assert_eq!(a.mig["1g.10gb"], 1);
        // A MIG device without the shares its GPUs have: the node's shares disagree.
        let c = slice("c", 1, json!([gpu(0, Some(4)), mig(1, "1g.10gb", None)]));
        assert!(dra_slices([&c])["c"].mixed_shares);
    }

    #[test]
    fn gpus_that_disagree_on_shares_are_reported_mixed() {
        let s = slice("a", 1, json!([gpu(0, Some(4)), gpu(1, None)]));
        let a = &dra_slices([&s])["a"];
        assert!(a.mixed_shares);
        assert_eq!(a.shares, Some(4));
    }

    fn slice_gen() -> impl Strategy<Value = ResourceSlice> {
        let device = (0usize..8, prop::option::of(1i64..9), prop::bool::ANY).prop_map(
            |(i, shares, is_mig)| {
                if is_mig {
                    mig(i, "1g.10gb", None)
                } else {
                    gpu(i, shares)
                }
            },
        );
        (
            prop::sample::select(vec!["a", "b"]),
            1i64..3,
            prop::collection::vec(device, 0..6),
        )
            .prop_map(|(node, generation, devices)| slice(node, generation, json!(devices)))
    }

    proptest! {
        #[test]
        fn the_reader_reads_the_same_from_stripped_slices(
            slices in prop::collection::vec(slice_gen(), 0..6)
        ) {
            let mut stripped = slices.clone();
            stripped.iter_mut().for_each(strip);
            prop_assert_eq!(dra_slices(&stripped), dra_slices(&slices));
        }
    }
}
