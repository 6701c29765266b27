//! The test kit of gpu-sharing-operator: what the integration tests (`tests/`) and the scale
//! benchmark (`bench/`) share, and nothing the operator binary uses.
//!
//! - [`cluster`]: a local control plane (`kube-local`) per test, per test binary, or for a
//!   benchmark run.
//! - [`objects`]: server-side apply of YAML, CRDs waited for, the node-label setter.
//! - [`poll`]: the polling helper.
//! - [`fixtures`]: policies and nodes as the planner takes them.
//! - [`https`]: one HTTPS `GET` with a bearer token, as a scraper makes it.
//! - [`apiserver`]: kube-apiserver's own counters of the writes it served.
//! - [`metrics`]: readings of the operator's own metrics (passes that ended well).
//!
//! ```ignore
//! use testkit::*;
//!
//! #[tokio::test]
//! async fn my_test() {
//!     let cluster = TestCluster::start().await;
//!     apply_yaml(&cluster.client, include_str!("../crds/x.yaml")).await.unwrap();
//!     until("a node", Duration::from_secs(10), || async { Some(()) }).await;
//! }
//! ```

pub mod apiserver;
pub mod cluster;
pub mod fixtures;
pub mod https;
pub mod metrics;
pub mod objects;
pub mod poll;

pub use cluster::*;
pub use objects::*;
pub use poll::*;
