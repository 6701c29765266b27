//! gpu-sharing-operator: declare how NVIDIA GPUs are shared, and make the cluster match.
//!
//! Modules depend one way only: each module uses only the modules its line below names.
//! `tests/architecture.rs` enforces it, and that these lines and the list below name every
//! module. Read from the bottom up, the flow is api <- nvidia <- validate <- plan <- observe <-
//! runtime / offline <- preview, with telemetry beside, using api only, and converge (a model of
//! NVIDIA's components) beside observe, for offline and preview.
//!
//! ```text
//! api       -> (none)
//! nvidia    -> api
//! validate  -> api, nvidia
//! plan      -> api, nvidia, validate
//! converge  -> api, nvidia, validate, plan
//! observe   -> api, nvidia, validate, plan
//! telemetry -> api
//! runtime   -> api, nvidia, validate, plan, observe, telemetry
//! offline   -> api, nvidia, validate, plan, observe, converge
//! preview   -> api, nvidia, validate, plan, observe, runtime, converge
//! ```
//!
//! - [`api`]: the `GpuSharingPolicy` resource, every label/annotation/finalizer/field-manager
//!   name, and the typed node states and condition reasons.
//! - [`nvidia`]: NVIDIA's formats (device-plugin config, mig-parted config, MIG profiles, the
//!   DRA driver's GpuConfig), the MIG geometry of each GPU model, and the content keys.
//! - [`validate`]: what a policy must satisfy, as typed field errors.
//! - [`plan`]: the pure planner: policies + node facts -> desired objects and statuses.
//! - [`converge`]: a model of NVIDIA's components answering a plan (the MIG manager, the vGPU
//!   Device Manager, the device plugins, GFD), for `plan`, `render` and the benchmark.
//! - [`observe`]: Kubernetes objects -> planner facts, one way for the controller's caches,
//!   `plan`'s lists and `render`'s files.
//! - [`runtime`]: watches, caches, appliers, finalizers, leader election.
//! - [`telemetry`]: Prometheus metrics and health endpoints.
//! - [`offline`]: `render`, `mig-geometry` and the CRD reference.
//! - [`preview`]: `plan`, what applying policy files would change in a live cluster (read-only).

pub mod api;
pub mod converge;
pub mod nvidia;
pub mod observe;
pub mod offline;
pub mod plan;
pub mod preview;
pub mod runtime;
pub mod telemetry;
pub mod validate;
