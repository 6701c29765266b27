//! Metrics and the health endpoints.

pub mod auth;
pub mod metrics;
pub mod server;
pub mod tls;
