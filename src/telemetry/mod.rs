//! Metrics and the health endpoints.

pub mod metrics;
