//! gpu-sharing-operator: declare how NVIDIA GPUs are shared, and make the cluster match.
//!
//! - [`crd`]: the `GpuSharingPolicy` resource.
//! - [`validate`], [`nvidia`], [`plan`]: the pure core (validation, NVIDIA's formats, the planner).
//! - [`render`]: the offline `render` output.

pub mod controller;
pub mod crd;
pub mod docs;
pub mod dra;
pub mod leader;
pub mod metrics;
pub mod nodecache;
pub mod nvidia;
pub mod plan;
pub mod render;
pub mod validate;
