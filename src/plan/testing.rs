//! Fixtures for the planner's unit tests: one policy builder and one node builder instead of
//! one per test module (the integration tests use the `testkit` crate's).

use crate::api::crd::GpuSharingPolicy;
use crate::api::names::MANAGED_LABELS;
use crate::plan::facts::NodeFacts;
use crate::plan::labels::Labels;

/// A policy from its whole YAML manifest (panics on invalid YAML: fixtures are written by hand).
pub fn policy_yaml(yaml: &str) -> GpuSharingPolicy {
    crate::api::yaml::from_str(yaml).unwrap_or_else(|e| panic!("invalid policy YAML: {e}\n{yaml}"))
}

/// A policy named `name` with the `spec` lines given (indented by two spaces), its
/// `nodeSelector` among them.
pub fn policy_spec(name: &str, spec: &str) -> GpuSharingPolicy {
    policy_yaml(&format!(
        "apiVersion: gpusharing.io/v1alpha1\nkind: GpuSharingPolicy\nmetadata: {{name: {name}}}\nspec:\n{spec}"
    ))
}

/// A policy named `name` selecting every node, with the `spec` lines given (indented by two
/// spaces), e.g. `"  strategy: mps\n  mps: {replicas: 4}\n"`.
pub fn policy(name: &str, spec: &str) -> GpuSharingPolicy {
    policy_spec(name, &format!("  nodeSelector: {{}}\n{spec}"))
}

/// Node `n`: 8 x A100 SXM4 80GB (MIG-capable) as GPU Feature Discovery labels it, with `extra`
/// labels; every managed label present is ours.
pub fn a100_node(extra: &[(&str, &str)]) -> NodeFacts {
    let mut labels: Labels = [
        ("nvidia.com/gpu.product", "NVIDIA-A100-SXM4-80GB"),
        ("nvidia.com/gpu.count", "8"),
        ("nvidia.com/gpu.memory", "81920"),
        ("nvidia.com/mig.capable", "true"),
        ("nvidia.com/gpu.compute.major", "8"),
    ]
    .into_iter()
    .collect();
    labels.extend(extra.iter().copied());
    let owned = MANAGED_LABELS
        .iter()
        .filter(|k| labels.contains_key(k))
        .map(|k| k.to_string())
        .collect();
    NodeFacts {
        name: "n".into(),
        labels,
        owned,
        ..Default::default()
    }
}
