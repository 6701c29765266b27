//! What works without a cluster: `render` and the CRD reference.

pub mod converge;
pub mod docs;
pub mod render;
