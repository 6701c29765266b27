//! What works without a cluster: `render`, `mig-geometry` and the CRD reference.

pub mod docs;
pub mod geometry;
pub mod render;
