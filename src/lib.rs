//! gpu-sharing-operator: declare how NVIDIA GPUs are shared, and make the cluster match.
//!
//! Modules depend one way only (a test in `tests/architecture.rs` enforces it):
//!
//! ```text
//! api  <-  nvidia  <-  validate  <-  plan  <-  runtime
//!  ^                                  ^   <-  offline
//!  +---------- telemetry -------------+
//! ```
//!
//! - [`api`]: the `GpuSharingPolicy` resource, every label/annotation/finalizer/field-manager
//!   name, and the typed node states and condition reasons.
//! - [`nvidia`]: NVIDIA's formats (device-plugin config, mig-parted config, MIG profiles, the
//!   DRA driver's GpuConfig) and the content keys.
//! - [`validate`]: what a policy must satisfy, as typed field errors.
//! - [`plan`]: the pure planner: policies + node facts -> desired objects and statuses.
//! - [`runtime`]: watches, caches, appliers, finalizers, leader election.
//! - [`telemetry`]: Prometheus metrics and health endpoints.
//! - [`offline`]: `render` and the CRD reference.

pub mod api;
pub mod nvidia;
pub mod offline;
pub mod plan;
pub mod preview;
pub mod runtime;
pub mod telemetry;
pub mod validate;
