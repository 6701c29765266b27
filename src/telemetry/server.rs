//! The endpoints `run` serves, each on a listener of its own (as controller-runtime operators
//! do):
//!
//! - `/metrics` on `--metrics-addr`: HTTPS ([`super::tls`]), and only for a caller whose bearer
//!   token passes a TokenReview and who may `get` the non-resource URL `/metrics`
//!   ([`super::auth`]): 401 without a token or with one the API server does not know, 403 for a
//!   user without the permission, 503 (`Retry-After: 1`) when no review turn frees up in time
//!   ([`auth::REVIEW_WAIT`]). `--metrics-insecure` serves it over plain HTTP to anyone
//!   (local use, `make demo`).
//! - `/healthz` and `/readyz` on `--health-addr`: plain HTTP without authentication, for the
//!   kubelet's probes.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use axum::Router;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use tokio::net::TcpListener;
use tracing::{debug, info, warn};

use super::auth::{self, Authorizer, Decision};
use super::metrics::{Metrics, exposition, readyz};
use super::tls::{self, CertSource, TlsListener};

/// How `run` serves its endpoints.
#[derive(Clone, Debug, Default)]
pub struct Config {
    /// Address of `/metrics`; `None`: not served.
    pub metrics_addr: Option<String>,
    /// Plain HTTP and no authentication for `/metrics`.
    pub metrics_insecure: bool,
    /// `tls.crt` and `tls.key` for `/metrics`; `None`: a self-signed certificate.
    pub metrics_cert_dir: Option<PathBuf>,
    /// Address of `/healthz` and `/readyz`; `None`: not served.
    pub health_addr: Option<String>,
}

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        addr: String,
        source: std::io::Error,
    },
    #[error("metrics TLS: {0}")]
    Tls(String),
}

/// The running endpoints, with the addresses they listen on; dropping this stops them.
#[derive(Debug)]
pub struct Endpoints {
    pub metrics_addr: Option<SocketAddr>,
    pub health_addr: Option<SocketAddr>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Drop for Endpoints {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

struct Scrape {
    metrics: Arc<Metrics>,
    /// `None`: `--metrics-insecure`.
    auth: Option<Authorizer>,
}

fn unauthorized() -> Response {
    (
        StatusCode::UNAUTHORIZED,
        [(header::WWW_AUTHENTICATE, "Bearer")],
        "Unauthorized: a bearer token the API server authenticates is required\n",
    )
        .into_response()
}

async fn scrape(State(s): State<Arc<Scrape>>, headers: HeaderMap) -> Response {
    if let Some(auth) = &s.auth {
        let Some(token) = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(auth::bearer_token)
        else {
            return unauthorized();
        };
        match auth.check(token).await {
            Ok(Decision::Allowed) => {}
            Ok(Decision::Unauthenticated) => return unauthorized(),
            Ok(Decision::Forbidden) => {
                return (
                    StatusCode::FORBIDDEN,
                    "Forbidden: the user may not get the non-resource URL /metrics\n",
                )
                    .into_response();
            }
            Err(auth::CheckError::Busy) => {
                debug!("metrics: too many token reviews in flight; answered 503");
                return (
                    StatusCode::SERVICE_UNAVAILABLE,
                    [(header::RETRY_AFTER, "1")],
                    "too many token reviews in flight\n",
                )
                    .into_response();
            }
            Err(e) => {
                warn!(error = %e, "metrics: cannot review a scraper's token");
                return (
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "cannot review the token with the API server\n",
                )
                    .into_response();
            }
        }
    }
    exposition(State(s.metrics.clone())).await.into_response()
}

/// `/metrics`, behind authentication when `auth` is given.
pub fn metrics_router(metrics: Arc<Metrics>, auth: Option<Authorizer>) -> Router {
    Router::new()
        .route(auth::METRICS_PATH, get(scrape))
        .with_state(Arc::new(Scrape { metrics, auth }))
}

/// `/healthz` (the process is alive) and `/readyz` (caches synced and a first pass done; a
/// standby replica is ready too, so rollouts are not blocked).
pub fn health_router(metrics: Arc<Metrics>) -> Router {
    Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .with_state(metrics)
}

async fn bind(addr: &str) -> Result<TcpListener, Error> {
    TcpListener::bind(addr).await.map_err(|source| Error::Bind {
        addr: addr.to_string(),
        source,
    })
}

/// Binds and serves the endpoints until the returned [`Endpoints`] is dropped. `client` makes
/// the token and access reviews of `/metrics` (unless insecure): `run` gives it a client of its
/// own, not the controller's, so that reviews and reconciles do not share a connection pool.
/// At most [`tls::MAX_CONNECTIONS`] connections to `/metrics` are open (or in their TLS
/// handshake) at once; more wait in the listen backlog. Fails at once on an address
/// that cannot be bound or a certificate directory that does not load.
pub async fn start(
    config: &Config,
    metrics: Arc<Metrics>,
    client: kube::Client,
) -> Result<Endpoints, Error> {
    // Built first, so that a failure below stops what already started.
    let mut ep = Endpoints {
        metrics_addr: None,
        health_addr: None,
        tasks: Vec::new(),
    };
    if let Some(addr) = &config.metrics_addr {
        let listener = bind(addr).await?;
        let local = listener.local_addr().ok();
        ep.metrics_addr = local;
        if config.metrics_insecure {
            info!(addr = ?local, "serving /metrics over plain HTTP without authentication (--metrics-insecure)");
            let router = metrics_router(metrics.clone(), None);
            let listener = tls::CappedListener::new(listener, tls::MAX_CONNECTIONS);
            ep.tasks.push(tokio::spawn(async move {
                if let Err(e) = axum::serve(listener, router).await {
                    warn!(error = %e, "metrics endpoint stopped");
                }
            }));
        } else {
            let source = match &config.metrics_cert_dir {
                Some(dir) => CertSource::Dir(dir.clone()),
                None => CertSource::SelfSigned,
            };
            let tls_config = tls::server_config(&source).map_err(Error::Tls)?;
            let listener =
                TlsListener::new(listener, tls_config).map_err(|source| Error::Bind {
                    addr: addr.clone(),
                    source,
                })?;
            info!(addr = ?local, certificate = ?source, "serving /metrics over HTTPS to callers allowed to get /metrics");
            let router = metrics_router(metrics.clone(), Some(Authorizer::new(client)));
            ep.tasks.push(tokio::spawn(async move {
                if let Err(e) = axum::serve(listener, router).await {
                    warn!(error = %e, "metrics endpoint stopped");
                }
            }));
        }
    }
    if let Some(addr) = &config.health_addr {
        let listener = bind(addr).await?;
        ep.health_addr = listener.local_addr().ok();
        info!(addr = ?ep.health_addr, "serving /healthz and /readyz");
        let router = health_router(metrics);
        ep.tasks.push(tokio::spawn(async move {
            if let Err(e) = axum::serve(listener, router).await {
                warn!(error = %e, "health endpoint stopped");
            }
        }));
    }
    Ok(ep)
}
