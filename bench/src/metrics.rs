//! kube-apiserver's request counters: the writes of each phase, by resource and verb.

use super::*;

pub(crate) use testkit::apiserver::{Counts, diff};

pub(crate) async fn scrape(client: &Client) -> anyhow::Result<Counts> {
    testkit::apiserver::write_counts(client).await
}

/// Writes of one phase, by what the operator writes.
#[derive(Debug, Default, Clone)]
pub(crate) struct Writes {
    pub(crate) nodes: i64,
    pub(crate) configmaps: i64,
    pub(crate) cluster_policy: i64,
    pub(crate) status: i64,
    /// Writes to the policy object itself (finalizers), the benchmark's own removed.
    pub(crate) policy_meta: i64,
    pub(crate) events: i64,
    /// Anything else (e.g. the apiserver's own leases): not the operator's.
    pub(crate) other: i64,
    /// Non-2xx responses among the operator's writes.
    pub(crate) failed: i64,
    pub(crate) detail: Vec<String>,
}

impl Writes {
    pub(crate) fn from(d: &Counts, bench_policy_writes: i64) -> Writes {
        let mut w = Writes::default();
        for ((group, resource, sub, verb, code), v) in d {
            let v = v.round() as i64;
            let ours = match (group.as_str(), resource.as_str(), sub.as_str()) {
                ("", "nodes", "") => {
                    w.nodes += v;
                    true
                }
                ("", "configmaps", "") => {
                    w.configmaps += v;
                    true
                }
                ("nvidia.com", "clusterpolicies", _) => {
                    w.cluster_policy += v;
                    true
                }
                ("gpusharing.io", "gpusharingpolicies", "status") => {
                    w.status += v;
                    true
                }
                ("gpusharing.io", "gpusharingpolicies", "") => {
                    w.policy_meta += v;
                    true
                }
                ("events.k8s.io", "events", _) | ("", "events", _) => {
                    w.events += v;
                    true
                }
                _ => {
                    w.other += v;
                    false
                }
            };
            if ours && !code.starts_with('2') {
                w.failed += v;
            }
            let g = if group.is_empty() { "core" } else { group };
            let s = if sub.is_empty() {
                String::new()
            } else {
                format!("/{sub}")
            };
            w.detail
                .push(format!("{g}/{resource}{s} {verb} {code}: {v}"));
        }
        w.policy_meta -= bench_policy_writes;
        w
    }

    /// Writes the operator issued, events and finalizers not included.
    pub(crate) fn core(&self) -> i64 {
        self.nodes + self.configmaps + self.cluster_policy + self.status
    }

    pub(crate) fn add(&self, o: &Writes) -> Writes {
        Writes {
            nodes: self.nodes + o.nodes,
            configmaps: self.configmaps + o.configmaps,
            cluster_policy: self.cluster_policy + o.cluster_policy,
            status: self.status + o.status,
            policy_meta: self.policy_meta + o.policy_meta,
            events: self.events + o.events,
            other: self.other + o.other,
            failed: self.failed + o.failed,
            detail: self.detail.iter().chain(&o.detail).cloned().collect(),
        }
    }

    pub(crate) fn breakdown(&self) -> String {
        format!(
            "labels {} + ConfigMap {} + ClusterPolicy {} + status {}",
            self.nodes, self.configmaps, self.cluster_policy, self.status
        )
    }
}
