//! Is the operator fenced? The admission policies (`config/*-admission-policy.yaml`) are what
//! keep its broad RBAC to its own fields, and they fail open silently: a policy without its
//! binding, a chart value turning one off, a cluster before 1.30, or a policy matching another
//! account (another namespace or ServiceAccount name). So the operator checks from where it
//! runs, as the account it runs as: dry-run writes (`dryRun=All`: admitted or refused exactly
//! like real writes, never stored) that the policies must refuse. It reports the verdict as the
//! metric `gpu_sharing_fenced`, a log line and every policy's `Fenced` condition, and
//! `run --require-fenced` fails readiness while it is not fenced.
//!
//! The probes, each made when its object exists: a foreign label on a node (node policy), a
//! driver image on the ClusterPolicy (ClusterPolicy policy), a label on a GpuSharingPolicy
//! (owned-objects policy).

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::Node;
use kube::api::{Api, DynamicObject, ListParams, Patch, PatchParams};
use kube::{Client, ResourceExt};
use serde_json::{Value, json};
use tracing::{Instrument, info, info_span, warn};

use crate::api::crd::GpuSharingPolicy;
use crate::plan::Fence;
use crate::runtime::resources::cluster_policy_resource;
use crate::telemetry::metrics::Metrics;

/// The label the probes write: no policy of ours may let it through.
pub const PROBE_LABEL: &str = "example.com/gpu-sharing-fence-probe";
/// The ClusterPolicy driver image the probe writes.
pub const PROBE_IMAGE: &str = "example.com/gpu-sharing-fence-probe:dry-run";

/// What the API server answered to one dry-run write.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Refused (403: an admission policy, or RBAC): fenced here. The API server's message.
    Refused(String),
    /// Admitted: the write would have happened.
    Allowed,
    /// Not known (the API server unreachable, another error).
    Failed(String),
}

/// One probe: what it wrote, on which object, and the answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Probe {
    pub what: String,
    pub outcome: Outcome,
}

/// The last conclusive verdict, shared with the control loop, which reports it on every
/// policy's status; it wakes the loop when the verdict changes.
#[derive(Debug, Default)]
pub struct State {
    last: std::sync::Mutex<Option<Fence>>,
    changed: tokio::sync::Notify,
}

impl State {
    pub fn get(&self) -> Option<Fence> {
        self.last.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    fn set(&self, f: Fence) {
        let mut last = self.last.lock().unwrap_or_else(|e| e.into_inner());
        if last.as_ref() != Some(&f) {
            *last = Some(f);
            self.changed.notify_one();
        }
    }

    /// Resolves once the verdict changed since the last call.
    pub async fn changed(&self) {
        self.changed.notified().await;
    }
}

/// The verdict: `Some(false)` when any probe went through, `Some(true)` when every probe was
/// refused (at least one made), `None` when unknown (a probe failed, or nothing to probe).
pub fn verdict(probes: &[Probe]) -> Option<bool> {
    if probes.iter().any(|p| p.outcome == Outcome::Allowed) {
        return Some(false);
    }
    let all_refused = probes
        .iter()
        .all(|p| matches!(p.outcome, Outcome::Refused(_)));
    (all_refused && !probes.is_empty()).then_some(true)
}

fn outcome<T>(r: Result<T, kube::Error>) -> Option<Outcome> {
    match r {
        Ok(_) => Some(Outcome::Allowed),
        Err(kube::Error::Api(e)) if e.code == 403 => Some(Outcome::Refused(e.message)),
        // The object went between the list and the write: no probe.
        Err(kube::Error::Api(e)) if e.code == 404 => None,
        Err(e) => Some(Outcome::Failed(e.to_string())),
    }
}

/// A dry-run merge patch of the first object `api` lists; `None` when there is none (or the
/// kind is not served).
async fn probe_first(api: Api<DynamicObject>, kind: &str, patch: Value) -> Option<Probe> {
    let first = match api.list_metadata(&ListParams::default().limit(1)).await {
        Ok(l) => l.items.into_iter().next()?,
        Err(kube::Error::Api(e)) if e.code == 404 => return None,
        Err(e) => {
            return Some(Probe {
                what: format!("listing {kind}s"),
                outcome: Outcome::Failed(e.to_string()),
            });
        }
    };
    let name = first.name_any();
    let pp = PatchParams {
        dry_run: true,
        ..Default::default()
    };
    let r = api.patch(&name, &pp, &Patch::Merge(&patch)).await;
    Some(Probe {
        what: format!("{kind} {name}: {patch}"),
        outcome: outcome(r)?,
    })
}

/// The dry-run writes the admission policies must refuse, as this client's account.
pub async fn probes(client: &Client) -> Vec<Probe> {
    let label = json!({"metadata": {"labels": {PROBE_LABEL: "dry-run"}}});
    let node = kube::api::ApiResource::erase::<Node>(&());
    let policy = kube::api::ApiResource::erase::<GpuSharingPolicy>(&());
    let image = json!({"spec": {"driver": {"image": PROBE_IMAGE}}});
    let all = |ar: &kube::api::ApiResource| Api::<DynamicObject>::all_with(client.clone(), ar);
    let (n, cp, p) = futures::join!(
        probe_first(all(&node), "Node", label.clone()),
        probe_first(all(&cluster_policy_resource()), "ClusterPolicy", image),
        probe_first(all(&policy), "GpuSharingPolicy", label),
    );
    [n, cp, p].into_iter().flatten().collect()
}

/// One check: probes, then the metric, the shared state and a log line. Returns the verdict.
pub async fn check(client: &Client, metrics: &Metrics, state: &State) -> Option<bool> {
    let probes = probes(client).await;
    let v = verdict(&probes);
    let allowed: Vec<&str> = probes
        .iter()
        .filter(|p| p.outcome == Outcome::Allowed)
        .map(|p| p.what.as_str())
        .collect();
    match v {
        Some(true) => {
            metrics.set_fenced(true);
            let what: Vec<&str> = probes.iter().map(|p| p.what.as_str()).collect();
            state.set(Fence {
                fenced: true,
                message: cut(&format!(
                    "the API server refused every forbidden dry-run write of the operator's account: {}",
                    what.join("; ")
                )),
            });
            info!(
                probes = probes.len(),
                "fenced: the API server refused every forbidden dry-run write"
            );
        }
        Some(false) => {
            metrics.set_fenced(false);
            state.set(Fence {
                fenced: false,
                message: cut(&format!(
                    "the API server let forbidden dry-run writes of the operator's account through ({}): install and bind the admission policies for its ServiceAccount (docs/install.md)",
                    allowed.join("; ")
                )),
            });
            warn!(
                allowed = %allowed.join("; "),
                "NOT fenced: the API server let forbidden dry-run writes through; install and bind the admission policies for this ServiceAccount (docs/install.md)"
            );
        }
        None => {
            let failed: Vec<String> = probes
                .iter()
                .filter_map(|p| match &p.outcome {
                    Outcome::Failed(e) => Some(format!("{}: {e}", p.what)),
                    _ => None,
                })
                .collect();
            warn!(failed = %failed.join("; "), probes = probes.len(), "fence check inconclusive; the last result stands");
        }
    }
    v
}

/// A condition message of at most 1,024 characters (the probes name objects).
fn cut(s: &str) -> String {
    const MAX: usize = 1024;
    match s.char_indices().nth(MAX) {
        Some((i, _)) => format!("{}...", &s[..i]),
        None => s.to_string(),
    }
}

/// Checks at start and then every `every` (never again when zero), for as long as it runs.
pub async fn watch(client: Client, metrics: Arc<Metrics>, state: Arc<State>, every: Duration) {
    loop {
        check(&client, &metrics, &state)
            .instrument(info_span!("fence_check"))
            .await;
        if every.is_zero() {
            return;
        }
        tokio::time::sleep(every).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(outcome: Outcome) -> Probe {
        Probe {
            what: "x".into(),
            outcome,
        }
    }

    #[test]
    fn fenced_only_when_every_probe_made_was_refused() {
        let refused = || p(Outcome::Refused("denied".into()));
        assert_eq!(verdict(&[refused(), refused()]), Some(true));
        assert_eq!(verdict(&[refused(), p(Outcome::Allowed)]), Some(false));
        assert_eq!(
            verdict(&[p(Outcome::Failed("timeout".into())), p(Outcome::Allowed)]),
            Some(false),
            "one write through is enough"
        );
        assert_eq!(
            verdict(&[refused(), p(Outcome::Failed("timeout".into()))]),
            None
        );
        assert_eq!(verdict(&[]), None, "nothing to probe");
    }

    #[test]
    fn a_403_is_a_refusal_and_a_404_no_probe() {
        let status = |code| {
            Err::<(), _>(kube::Error::Api(
                kube::core::Status::failure("denied", "Forbidden")
                    .with_code(code)
                    .boxed(),
            ))
        };
        assert_eq!(
            outcome(status(403)),
            Some(Outcome::Refused("denied".into()))
        );
        assert_eq!(outcome(status(404)), None);
        assert!(matches!(outcome(status(500)), Some(Outcome::Failed(_))));
        assert_eq!(outcome(Ok::<(), kube::Error>(())), Some(Outcome::Allowed));
    }
}
