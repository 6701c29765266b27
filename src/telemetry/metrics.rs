//! Prometheus metrics and the handlers of the `/metrics`, `/healthz`, `/readyz` endpoints.
//!
//! Metrics use `prometheus-client`, the Prometheus project's Rust client (as kube-rs's
//! controller-rs does), exposed in the OpenMetrics text format; the endpoints are served by
//! `axum` on the hyper stack kube already depends on ([`super::server`]: `/metrics` behind
//! authentication over HTTPS, the health endpoints on a port of their own).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

use crate::api::crd::GpuSharingPolicyStatus;
use crate::api::state::ConditionStatus;

/// Upper bounds of the reconcile duration histogram, in seconds.
const BUCKETS: [f64; 9] = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0];

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KindLabel {
    kind: String,
}

/// Why a pass failed: the controller error's `metric_label()` (one fixed value per variant).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ErrorLabel {
    error: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StrategyLabel {
    strategy: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PolicyLabel {
    policy: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ConditionLabel {
    policy: String,
    condition: String,
    reason: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PolicyNodesLabel {
    policy: String,
    state: String,
}

/// Per-policy gauges, from the statuses of the last plan (policies gone from it drop out).
#[derive(Default)]
struct PolicyGauges {
    condition: Family<ConditionLabel, Gauge>,
    nodes: Family<PolicyNodesLabel, Gauge>,
    schedulable: Family<PolicyLabel, Gauge>,
    halted: Family<PolicyLabel, Gauge>,
    held: Family<PolicyHeldLabel, Gauge>,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PolicyHeldLabel {
    policy: String,
    reason: String,
}

impl PolicyGauges {
    fn register(&self, registry: &mut Registry) {
        registry.register(
            "gpu_sharing_policy_condition",
            "A policy's status conditions: 1 when the condition is True, else 0 (with its reason)",
            self.condition.clone(),
        );
        registry.register(
            "gpu_sharing_policy_nodes",
            "A policy's nodes by state: matched, applied, unavailable (changed, not yet \
             confirmed), queued (waiting for their rollout wave), conflicting",
            self.nodes.clone(),
        );
        registry.register(
            "gpu_sharing_policy_schedulable_replicas",
            "Schedulable nvidia.com/* units a policy's applied nodes offer",
            self.schedulable.clone(),
        );
        registry.register(
            "gpu_sharing_policy_held_nodes",
            "A policy's nodes held as they are, by why (the status's heldNodes: \
             WaitingForIdleGPUs, WaitingForRolloutWave, RolloutPaused, ...)",
            self.held.clone(),
        );
        registry.register(
            "gpu_sharing_policy_rollout_halted",
            "1 while a policy's rollout is halted (a node failed or timed out)",
            self.halted.clone(),
        );
    }

    fn clear(&self) {
        self.condition.clear();
        self.nodes.clear();
        self.schedulable.clear();
        self.halted.clear();
        self.held.clear();
    }

    fn set(&self, name: &str, s: &GpuSharingPolicyStatus) {
        let policy = || name.to_string();
        for c in &s.conditions {
            self.condition
                .get_or_create(&ConditionLabel {
                    policy: policy(),
                    condition: c.type_.as_str().into(),
                    reason: c.reason.as_str().into(),
                })
                .set(i64::from(c.status == ConditionStatus::True));
        }
        let rollout = s.rollout.as_ref();
        for (state, n) in [
            ("matched", s.matched_nodes),
            ("applied", s.applied_nodes),
            ("unavailable", s.unavailable_nodes),
            ("queued", rollout.map_or(0, |r| r.queued_nodes)),
            ("conflicting", s.conflicting_nodes),
        ] {
            self.nodes
                .get_or_create(&PolicyNodesLabel {
                    policy: policy(),
                    state: state.into(),
                })
                .set(i64::from(n));
        }
        for (reason, n) in &s.held_nodes {
            self.held
                .get_or_create(&PolicyHeldLabel {
                    policy: policy(),
                    reason: reason.as_str().into(),
                })
                .set(i64::from(*n));
        }
        let label = PolicyLabel { policy: policy() };
        self.schedulable
            .get_or_create(&label)
            .set(s.capacity.as_ref().map_or(0, |c| c.schedulable_replicas));
        self.halted.get_or_create(&label).set(i64::from(
            rollout.is_some_and(|r| r.halted_generation.is_some()),
        ));
    }
}

/// The operator's metrics.
pub struct Metrics {
    registry: Registry,
    reconciles: Counter,
    reconcile_errors: Family<ErrorLabel, Counter>,
    duration: Histogram,
    writes: Family<KindLabel, Counter>,
    nodes: Family<StrategyLabel, Gauge>,
    conflicted_policies: Gauge,
    cached_nodes: Gauge,
    cached_label_strings: Gauge,
    leader: Gauge,
    /// 1 when the last fence check found every dry-run write it must not make refused.
    fenced: Gauge,
    policies: PolicyGauges,
    /// Whether the caches are synced and a first pass ran.
    ready: AtomicBool,
    /// `run --require-fenced`: not ready while not fenced.
    require_fenced: AtomicBool,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics")
            .field("reconciles", &self.reconciles.get())
            .finish_non_exhaustive()
    }
}

impl Default for Metrics {
    fn default() -> Self {
        let mut registry = Registry::default();
        let reconciles = Counter::default();
        let reconcile_errors = Family::<ErrorLabel, Counter>::default();
        let duration = Histogram::new(BUCKETS);
        let writes = Family::<KindLabel, Counter>::default();
        let nodes = Family::<StrategyLabel, Gauge>::default();
        let (conflicted_policies, cached_nodes, cached_label_strings, leader) = Default::default();
        let fenced = Gauge::default();
        registry.register(
            "gpu_sharing_reconciles",
            "Cluster-wide reconcile passes",
            reconciles.clone(),
        );
        registry.register(
            "gpu_sharing_reconcile_errors",
            "Reconcile passes that failed (retried with backoff), by error",
            reconcile_errors.clone(),
        );
        registry.register(
            "gpu_sharing_reconcile_duration_seconds",
            "Duration of reconcile passes",
            duration.clone(),
        );
        registry.register(
            "gpu_sharing_api_writes",
            "Writes to the API server, by kind of object",
            writes.clone(),
        );
        registry.register(
            "gpu_sharing_nodes",
            "Nodes governed by a policy, by strategy",
            nodes.clone(),
        );
        let gauges: [(&str, &str, &Gauge); 5] = [
            (
                "gpu_sharing_conflicted_policies",
                "Policies that lose nodes to another policy",
                &conflicted_policies,
            ),
            (
                "gpu_sharing_cached_nodes",
                "Nodes in the operator's node cache",
                &cached_nodes,
            ),
            (
                "gpu_sharing_cached_label_strings",
                "Distinct label keys and values the node cache holds (shared between nodes)",
                &cached_label_strings,
            ),
            (
                "gpu_sharing_leader",
                "Whether this replica is the leader",
                &leader,
            ),
            (
                "gpu_sharing_fenced",
                "1 when the API server refused every dry-run write the admission policies forbid \
                 the operator (a foreign node label, a ClusterPolicy driver image, a policy label); \
                 0 when one went through, or before the first check",
                &fenced,
            ),
        ];
        for (name, help, g) in gauges {
            registry.register(name, help, g.clone());
        }
        let policies = PolicyGauges::default();
        policies.register(&mut registry);
        Metrics {
            registry,
            reconciles,
            reconcile_errors,
            duration,
            writes,
            nodes,
            conflicted_policies,
            cached_nodes,
            cached_label_strings,
            leader,
            fenced,
            policies,
            ready: AtomicBool::new(false),
            require_fenced: AtomicBool::new(false),
        }
    }
}

impl Metrics {
    /// Counts a pass and its duration; a failed one also under its error's label.
    /// Exposes the failure counter of every error label at 0 (a labelled family has no series
    /// until its first increment; an alert or dashboard on it would see none).
    pub fn declare_errors(&self, labels: &[&str]) {
        for l in labels {
            let _ = self
                .reconcile_errors
                .get_or_create(&ErrorLabel { error: (*l).into() });
        }
    }

    pub fn observe_reconcile(&self, took: Duration, failure: Option<&str>) {
        self.reconciles.inc();
        if let Some(error) = failure {
            let _ = self
                .reconcile_errors
                .get_or_create(&ErrorLabel {
                    error: error.into(),
                })
                .inc();
        }
        self.duration.observe(took.as_secs_f64());
    }

    /// Counts writes of one kind of object (fed from each pass's write report).
    pub fn count_writes(&self, kind: &str, n: u64) {
        self.writes
            .get_or_create(&KindLabel { kind: kind.into() })
            .inc_by(n);
    }

    /// Nodes per strategy, as the last plan has them (strategies gone from it drop out).
    pub fn set_nodes_per_strategy(&self, counts: impl IntoIterator<Item = (String, u64)>) {
        self.nodes.clear();
        for (strategy, n) in counts {
            self.nodes
                .get_or_create(&StrategyLabel { strategy })
                .set(n as i64);
        }
    }

    /// Per-policy gauges from the statuses of the last plan, replacing the previous set.
    pub fn set_policies<'a>(
        &self,
        statuses: impl IntoIterator<Item = (&'a String, &'a GpuSharingPolicyStatus)>,
    ) {
        self.policies.clear();
        for (name, s) in statuses {
            self.policies.set(name, s);
        }
    }

    /// A replica that stops leading stops reporting policies (the new leader does).
    pub fn clear_policies(&self) {
        self.policies.clear();
    }

    pub fn set_conflicted_policies(&self, n: u64) {
        self.conflicted_policies.set(n as i64);
    }

    pub fn set_node_cache(&self, nodes: u64, label_strings: u64) {
        self.cached_nodes.set(nodes as i64);
        self.cached_label_strings.set(label_strings as i64);
    }

    pub fn set_leader(&self, leading: bool) {
        self.leader.set(i64::from(leading));
    }

    pub fn set_ready(&self) {
        self.ready.store(true, Ordering::Relaxed);
    }

    pub fn is_ready(&self) -> bool {
        self.ready.load(Ordering::Relaxed)
    }

    pub fn is_leader(&self) -> bool {
        self.leader.get() == 1
    }

    /// The result of a fence check (`runtime::fence`).
    pub fn set_fenced(&self, fenced: bool) {
        self.fenced.set(i64::from(fenced));
    }

    pub fn is_fenced(&self) -> bool {
        self.fenced.get() == 1
    }

    /// `run --require-fenced`: `/readyz` fails while the operator is not fenced.
    pub fn require_fenced(&self, on: bool) {
        self.require_fenced.store(on, Ordering::Relaxed);
    }

    /// The OpenMetrics text exposition.
    pub fn render(&self) -> String {
        let mut s = String::new();
        encode(&mut s, &self.registry).expect("writing to a String cannot fail");
        s
    }
}

pub(super) async fn exposition(State(m): State<Arc<Metrics>>) -> impl IntoResponse {
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        m.render(),
    )
}

pub(super) async fn readyz(State(m): State<Arc<Metrics>>) -> (StatusCode, &'static str) {
    if m.require_fenced.load(Ordering::Relaxed) && !m.is_fenced() {
        // Every replica, standbys too: none may take over unfenced.
        (
            StatusCode::SERVICE_UNAVAILABLE,
            "not fenced: the admission policies do not refuse the operator's forbidden writes (gpu_sharing_fenced)\n",
        )
    } else if m.is_ready() {
        (StatusCode::OK, "ok\n")
    } else if !m.is_leader() {
        // A standby never runs a pass: it is ready to take over, and a Deployment's rollout
        // (maxUnavailable 0) or `helm install --wait` waits for every replica to be Ready.
        (StatusCode::OK, "standby\n")
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "caches not synced\n")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_standby_is_ready_and_a_leader_after_its_first_pass() {
        let m = Arc::new(Metrics::default());
        let code = |m: &Arc<Metrics>| {
            let m = m.clone();
            async move { readyz(State(m)).await.0 }
        };
        assert_eq!(code(&m).await, StatusCode::OK, "a standby");
        m.set_leader(true);
        assert_eq!(
            code(&m).await,
            StatusCode::SERVICE_UNAVAILABLE,
            "no pass yet"
        );
        m.set_ready();
        assert_eq!(code(&m).await, StatusCode::OK);
    }

    #[tokio::test]
    async fn with_require_fenced_no_replica_is_ready_unfenced() {
        let m = Arc::new(Metrics::default());
        let code = |m: &Arc<Metrics>| {
            let m = m.clone();
            async move { readyz(State(m)).await.0 }
        };
        assert!(m.render().contains("gpu_sharing_fenced 0"));
        m.set_ready();
        m.set_leader(true);
        assert_eq!(code(&m).await, StatusCode::OK, "not required");
        m.require_fenced(true);
        assert_eq!(code(&m).await, StatusCode::SERVICE_UNAVAILABLE);
        m.set_leader(false);
        assert_eq!(code(&m).await, StatusCode::SERVICE_UNAVAILABLE, "a standby");
        m.set_fenced(true);
        assert_eq!(code(&m).await, StatusCode::OK);
        assert!(m.render().contains("gpu_sharing_fenced 1"));
        m.set_fenced(false);
        assert_eq!(code(&m).await, StatusCode::SERVICE_UNAVAILABLE);
    }

    #[test]
    fn failed_passes_are_counted_by_error() {
        let m = Metrics::default();
        let took = Duration::from_millis(5);
        m.observe_reconcile(took, Some("kube"));
        m.observe_reconcile(took, Some("namespace_missing"));
        m.observe_reconcile(took, Some("kube"));
        m.observe_reconcile(took, None);
        let text = m.render();
        for want in [
            "gpu_sharing_reconciles_total 4",
            "gpu_sharing_reconcile_errors_total{error=\"kube\"} 2",
            "gpu_sharing_reconcile_errors_total{error=\"namespace_missing\"} 1",
        ] {
            assert!(text.contains(want), "missing {want:?} in\n{text}");
        }
    }

    #[test]
    fn declared_error_labels_are_exposed_before_the_first_failure() {
        let m = Metrics::default();
        assert!(!m.render().contains("gpu_sharing_reconcile_errors_total"));
        m.declare_errors(&["kube", "json"]);
        let text = m.render();
        for want in [
            "gpu_sharing_reconcile_errors_total{error=\"kube\"} 0",
            "gpu_sharing_reconcile_errors_total{error=\"json\"} 0",
        ] {
            assert!(text.contains(want), "missing {want:?} in\n{text}");
        }
    }

    #[test]
    fn exposition_names_every_metric_the_alerts_and_dashboards_use() {
        let m = Metrics::default();
        m.observe_reconcile(Duration::from_millis(20), None);
        m.observe_reconcile(Duration::from_millis(20), Some("kube"));
        m.count_writes("Node", 3);
        m.set_nodes_per_strategy([("mps".to_string(), 2)]);
        m.set_nodes_per_strategy([("timeSlicing".to_string(), 1)]);
        m.set_leader(true);
        m.set_node_cache(5, 40);
        let status = |ready: bool, halted: Option<i64>| GpuSharingPolicyStatus {
            conditions: vec![crate::api::crd::Condition {
                type_: crate::api::state::ConditionType::Ready,
                status: ready.into(),
                reason: crate::api::state::Reason::Converged,
                message: String::new(),
                last_transition_time: None,
                observed_generation: None,
            }],
            matched_nodes: 3,
            applied_nodes: 2,
            unavailable_nodes: 1,
            rollout: Some(crate::api::crd::RolloutStatus {
                queued_nodes: 4,
                halted_generation: halted,
                ..Default::default()
            }),
            capacity: Some(crate::api::crd::Capacity {
                schedulable_replicas: 32,
                ..Default::default()
            }),
            held_nodes: [(crate::api::state::HoldReason::WaitingForRolloutWave, 4)].into(),
            ..Default::default()
        };
        let gone = [("gone".to_string(), status(true, None))];
        m.set_policies(gone.iter().map(|(n, s)| (n, s)));
        let now = [("h200".to_string(), status(false, Some(2)))];
        m.set_policies(now.iter().map(|(n, s)| (n, s)));
        let text = m.render();
        for want in [
            "gpu_sharing_reconciles_total 2",
            "gpu_sharing_reconcile_errors_total{error=\"kube\"} 1",
            "gpu_sharing_reconcile_duration_seconds_bucket{le=\"0.025\"} 2",
            "gpu_sharing_reconcile_duration_seconds_count 2",
            "gpu_sharing_api_writes_total{kind=\"Node\"} 3",
            "gpu_sharing_nodes{strategy=\"timeSlicing\"} 1",
            "gpu_sharing_leader 1",
            "gpu_sharing_cached_nodes 5",
            "gpu_sharing_cached_label_strings 40",
            "gpu_sharing_conflicted_policies 0",
            "gpu_sharing_policy_condition{policy=\"h200\",condition=\"Ready\",reason=\"Converged\"} 0",
            "gpu_sharing_policy_nodes{policy=\"h200\",state=\"matched\"} 3",
            "gpu_sharing_policy_nodes{policy=\"h200\",state=\"queued\"} 4",
            "gpu_sharing_policy_nodes{policy=\"h200\",state=\"unavailable\"} 1",
            "gpu_sharing_policy_schedulable_replicas{policy=\"h200\"} 32",
            "gpu_sharing_policy_rollout_halted{policy=\"h200\"} 1",
            "gpu_sharing_policy_held_nodes{policy=\"h200\",reason=\"WaitingForRolloutWave\"} 4",
            "# EOF",
        ] {
            assert!(text.contains(want), "missing {want:?} in\n{text}");
        }
        assert!(
            !text.contains("strategy=\"mps\""),
            "stale strategies drop out:\n{text}"
        );
        assert!(
            !text.contains("policy=\"gone\""),
            "deleted policies drop out:\n{text}"
        );
    }
}
