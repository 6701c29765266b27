//! The API resources reached without typed bindings: the GPU Operator's ClusterPolicy.

use kube::core::{ApiResource, GroupVersionKind};

/// The ClusterPolicy resource (GPU Operator, `nvidia.com/v1`, cluster-scoped).
pub fn cluster_policy_resource() -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("nvidia.com", "v1", "ClusterPolicy"),
        "clusterpolicies",
    )
}
