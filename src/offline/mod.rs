//! What works without a cluster: `render` and the CRD reference.

pub mod docs;
pub mod render;
