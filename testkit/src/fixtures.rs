//! Policies and nodes as the planner takes them, for tests and the benchmark: one builder of
//! each instead of one per test file.

use gpu_sharing_operator::api::crd::GpuSharingPolicy;
use gpu_sharing_operator::plan::{Labels, NodeFacts};

/// A policy from its YAML manifest (panics on invalid YAML: fixtures are written by hand).
pub fn policy_yaml(yaml: &str) -> GpuSharingPolicy {
    gpu_sharing_operator::api::yaml::from_str(yaml)
        .unwrap_or_else(|e| panic!("invalid policy YAML: {e}\n{yaml}"))
}

/// A policy named `name` with the `spec` lines given (indented by two spaces, without
/// `nodeSelector`: it selects every node), e.g. `"  strategy: mps\n  mps: {replicas: 4}\n"`.
pub fn policy(name: &str, spec: &str) -> GpuSharingPolicy {
    policy_yaml(&format!(
        "apiVersion: gpusharing.io/v1alpha1\nkind: GpuSharingPolicy\nmetadata: {{name: {name}}}\nspec:\n  nodeSelector: {{}}\n{spec}"
    ))
}

/// GPU Feature Discovery's labels for a node with `count` GPUs of `product` with `memory_mib`
/// each.
pub fn gpu_labels(
    product: &str,
    count: u32,
    memory_mib: u64,
    mig_capable: bool,
) -> Vec<(String, String)> {
    vec![
        ("nvidia.com/gpu.product".into(), product.into()),
        ("nvidia.com/gpu.count".into(), count.to_string()),
        ("nvidia.com/gpu.memory".into(), memory_mib.to_string()),
        ("nvidia.com/mig.capable".into(), mig_capable.to_string()),
    ]
}

/// A node as the planner knows it: `name` with `labels` (none of them ours).
pub fn node<K: AsRef<str>, V: AsRef<str>>(
    name: &str,
    labels: impl IntoIterator<Item = (K, V)>,
) -> NodeFacts {
    let mut l = Labels::default();
    for (k, v) in labels {
        l.insert(k.as_ref(), v.as_ref());
    }
    NodeFacts {
        name: name.into(),
        labels: l,
        ..Default::default()
    }
}

/// An 8 x H200 node (141 GB, 143771 MiB each; no MIG), as GPU Feature Discovery labels it.
pub fn h200_node(name: &str) -> NodeFacts {
    node(name, gpu_labels("NVIDIA-H200", 8, 143771, false))
}

/// An 8 x A100 SXM4 80 GB node (MIG-capable), as GPU Feature Discovery labels it.
pub fn a100_node(name: &str) -> NodeFacts {
    node(name, gpu_labels("NVIDIA-A100-SXM4-80GB", 8, 81920, true))
}
