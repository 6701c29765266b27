//! Prometheus metrics (text format) and the `/metrics`, `/healthz`, `/readyz` endpoints.
//!
//! A tiny HTTP/1.1 responder on a tokio listener: three GET paths need no web framework.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tracing::{debug, info};

/// Upper bounds of the reconcile duration histogram, in seconds.
const BUCKETS: [f64; 9] = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0];

/// The operator's metrics.
#[derive(Default)]
pub struct Metrics {
    pub reconciles: AtomicU64,
    pub reconcile_errors: AtomicU64,
    /// Microseconds, summed.
    duration_sum_us: AtomicU64,
    buckets: [AtomicU64; BUCKETS.len()],
    /// API writes by kind of object.
    writes: Mutex<BTreeMap<String, u64>>,
    /// Nodes per strategy (from the last plan), and policies reporting Conflicted.
    nodes_per_strategy: Mutex<BTreeMap<String, u64>>,
    pub conflicted_policies: AtomicU64,
    /// Nodes in the node cache, and distinct label strings it holds (its memory grows with
    /// both).
    pub cached_nodes: AtomicU64,
    pub cached_label_strings: AtomicU64,
    /// Whether this replica leads (always true without leader election).
    pub leader: AtomicBool,
    /// Whether the caches are synced and a first pass ran.
    pub ready: AtomicBool,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics")
            .field("reconciles", &self.reconciles)
            .finish_non_exhaustive()
    }
}

impl Metrics {
    pub fn observe_reconcile(&self, took: Duration, ok: bool) {
        self.reconciles.fetch_add(1, Ordering::Relaxed);
        if !ok {
            self.reconcile_errors.fetch_add(1, Ordering::Relaxed);
        }
        self.duration_sum_us
            .fetch_add(took.as_micros() as u64, Ordering::Relaxed);
        let secs = took.as_secs_f64();
        for (i, b) in BUCKETS.iter().enumerate() {
            if secs <= *b {
                self.buckets[i].fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    pub fn count_write(&self, kind: &str) {
        *self
            .writes
            .lock()
            .expect("metrics lock")
            .entry(kind.to_string())
            .or_default() += 1;
    }

    pub fn writes_total(&self) -> u64 {
        self.writes.lock().expect("metrics lock").values().sum()
    }

    pub fn set_nodes_per_strategy(&self, counts: BTreeMap<String, u64>) {
        *self.nodes_per_strategy.lock().expect("metrics lock") = counts;
    }

    /// Prometheus text exposition format.
    pub fn render(&self) -> String {
        let mut s = String::new();
        let reconciles = self.reconciles.load(Ordering::Relaxed);
        let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
        family(
            &mut s,
            "gpu_sharing_reconciles_total",
            "counter",
            "Cluster-wide reconcile passes.",
        );
        sample(&mut s, "gpu_sharing_reconciles_total", "", reconciles);
        family(
            &mut s,
            "gpu_sharing_reconcile_errors_total",
            "counter",
            "Reconcile passes that failed (retried with backoff).",
        );
        sample(
            &mut s,
            "gpu_sharing_reconcile_errors_total",
            "",
            load(&self.reconcile_errors),
        );
        let hist = "gpu_sharing_reconcile_duration_seconds";
        family(&mut s, hist, "histogram", "Duration of reconcile passes.");
        for (b, count) in BUCKETS.iter().zip(&self.buckets) {
            sample(
                &mut s,
                &format!("{hist}_bucket"),
                &format!("le=\"{b}\""),
                load(count),
            );
        }
        sample(&mut s, &format!("{hist}_bucket"), "le=\"+Inf\"", reconciles);
        let sum = load(&self.duration_sum_us) as f64 / 1e6;
        sample(&mut s, &format!("{hist}_sum"), "", sum);
        sample(&mut s, &format!("{hist}_count"), "", reconciles);
        family(
            &mut s,
            "gpu_sharing_api_writes_total",
            "counter",
            "Writes to the API server, by kind of object.",
        );
        for (kind, n) in self.writes.lock().expect("metrics lock").iter() {
            sample(
                &mut s,
                "gpu_sharing_api_writes_total",
                &format!("kind=\"{kind}\""),
                n,
            );
        }
        family(
            &mut s,
            "gpu_sharing_nodes",
            "gauge",
            "Nodes governed by a policy, by strategy.",
        );
        for (strategy, n) in self.nodes_per_strategy.lock().expect("metrics lock").iter() {
            sample(
                &mut s,
                "gpu_sharing_nodes",
                &format!("strategy=\"{strategy}\""),
                n,
            );
        }
        for (name, help, v) in [
            (
                "gpu_sharing_conflicted_policies",
                "Policies that lose nodes to another policy.",
                load(&self.conflicted_policies),
            ),
            (
                "gpu_sharing_cached_nodes",
                "Nodes in the operator's node cache.",
                load(&self.cached_nodes),
            ),
            (
                "gpu_sharing_cached_label_strings",
                "Distinct label keys and values the node cache holds (shared between nodes).",
                load(&self.cached_label_strings),
            ),
            (
                "gpu_sharing_leader",
                "Whether this replica is the leader.",
                u64::from(self.leader.load(Ordering::Relaxed)),
            ),
        ] {
            family(&mut s, name, "gauge", help);
            sample(&mut s, name, "", v);
        }
        s
    }
}

/// The `# HELP` and `# TYPE` lines of a metric family.
fn family(s: &mut String, name: &str, kind: &str, help: &str) {
    let _ = writeln!(s, "# HELP {name} {help}");
    let _ = writeln!(s, "# TYPE {name} {kind}");
}

/// One sample line, with labels (`k="v",...`) when not empty.
fn sample(s: &mut String, name: &str, labels: &str, value: impl std::fmt::Display) {
    if labels.is_empty() {
        let _ = writeln!(s, "{name} {value}");
    } else {
        let _ = writeln!(s, "{name}{{{labels}}} {value}");
    }
}

fn response(status: &str, content_type: &str, body: &str) -> String {
    format!(
        "HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
}

/// Serves `/metrics`, `/healthz` (the process is alive) and `/readyz` (caches synced and a
/// first pass done; a standby replica is ready too, so rollouts are not blocked).
pub async fn serve(listener: TcpListener, metrics: Arc<Metrics>) {
    info!(addr = %listener.local_addr().map(|a| a.to_string()).unwrap_or_default(), "serving /metrics, /healthz, /readyz");
    loop {
        let Ok((mut sock, _)) = listener.accept().await else {
            continue;
        };
        let metrics = metrics.clone();
        tokio::spawn(async move {
            // Read the request head (it may arrive in several segments): closing the socket
            // with unread bytes would make the kernel reset the connection.
            let mut buf = Vec::with_capacity(1024);
            let mut chunk = [0u8; 1024];
            let n = loop {
                let r = tokio::time::timeout(Duration::from_secs(5), sock.read(&mut chunk)).await;
                match r {
                    Ok(Ok(0)) => break buf.len(),
                    Ok(Ok(k)) => {
                        buf.extend_from_slice(&chunk[..k]);
                        if buf.windows(4).any(|w| w == b"\r\n\r\n") || buf.len() > 8192 {
                            break buf.len();
                        }
                    }
                    _ => return,
                }
            };
            let req = String::from_utf8_lossy(&buf[..n]);
            let path = req.split_whitespace().nth(1).unwrap_or("/");
            let resp = match path {
                "/metrics" => response("200 OK", "text/plain; version=0.0.4", &metrics.render()),
                "/healthz" => response("200 OK", "text/plain", "ok\n"),
                "/readyz" if metrics.ready.load(Ordering::Relaxed) => {
                    response("200 OK", "text/plain", "ok\n")
                }
                "/readyz" => response(
                    "503 Service Unavailable",
                    "text/plain",
                    "caches not synced\n",
                ),
                _ => response("404 Not Found", "text/plain", "not found\n"),
            };
            if let Err(e) = sock.write_all(resp.as_bytes()).await {
                debug!(error = %e, "metrics client went away");
            }
        });
    }
}
