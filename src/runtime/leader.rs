//! Leader election with a `coordination.k8s.io/v1` Lease, so that of several replicas only one
//! writes. Optimistic concurrency on the Lease's resourceVersion decides races: two candidates
//! can never both succeed in taking the same expired lease.
//!
//! The leader renews every `renew`; a standby takes over once the lease has not been renewed for
//! `lease_duration`. A leader that cannot renew in time stops its controller before the lease
//! can expire, and the process exits (the Deployment restarts it as a standby).

use std::time::Duration;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::Client;
use kube::api::{Api, PostParams};
use tokio::sync::watch;
use tracing::{debug, info, warn};

#[derive(Debug, Clone)]
pub struct LeaderConfig {
    pub namespace: String,
    pub name: String,
    pub identity: String,
    pub lease_duration: Duration,
    pub renew: Duration,
}

impl LeaderConfig {
    /// A leader must get at least one renewal in before it steps down (at 80% of the lease).
    pub fn check(&self) -> Result<(), String> {
        if self.lease_duration < Duration::from_secs(2) {
            return Err("--lease-duration-seconds must be at least 2".into());
        }
        if self.renew.is_zero() || self.renew >= step_down_after(self.lease_duration) {
            return Err(format!(
                "--lease-renew-seconds must be between 1 and 80% of --lease-duration-seconds ({:?}): a leader steps down when it has not renewed by then",
                step_down_after(self.lease_duration)
            ));
        }
        Ok(())
    }
}

/// Whether a lease has not been renewed within its duration at `at` (ours when it does not say).
fn expired(spec: &LeaseSpec, lease_duration: Duration, at: Timestamp) -> bool {
    let Some(renewed) = spec.renew_time.as_ref().or(spec.acquire_time.as_ref()) else {
        return true;
    };
    let dur = spec
        .lease_duration_seconds
        .map_or(lease_duration, |s| Duration::from_secs(s.max(0) as u64));
    let dur = SignedDuration::try_from(dur).unwrap_or(SignedDuration::MAX);
    renewed
        .0
        .saturating_add(dur)
        .is_ok_and(|deadline| deadline < at)
}

/// What a candidate does with the lease as it finds it.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Step {
    /// No lease yet: create it, holding it.
    Create,
    /// We hold it: renew.
    Renew,
    /// Free, released or expired: take it over from `previous` (empty if released).
    TakeOver { previous: String },
    /// Someone else holds an unexpired lease.
    Wait,
}

fn step(lease: Option<&LeaseSpec>, cfg: &LeaderConfig, at: Timestamp) -> Step {
    let Some(spec) = lease else {
        return Step::Create;
    };
    let holder = spec.holder_identity.clone().unwrap_or_default();
    if holder == cfg.identity {
        Step::Renew
    } else if holder.is_empty() || expired(spec, cfg.lease_duration, at) {
        Step::TakeOver { previous: holder }
    } else {
        Step::Wait
    }
}

/// The lease spec after a create, renewal or takeover by `cfg.identity` at `at`.
fn held(current: Option<LeaseSpec>, step: &Step, cfg: &LeaderConfig, at: Timestamp) -> LeaseSpec {
    let mut spec = current.unwrap_or_default();
    let t = Some(MicroTime(at));
    match step {
        Step::Create => {
            spec.acquire_time = t.clone();
            spec.lease_transitions = Some(0);
        }
        Step::TakeOver { .. } => {
            spec.acquire_time = t.clone();
            spec.lease_transitions = Some(spec.lease_transitions.unwrap_or(0) + 1);
        }
        Step::Renew | Step::Wait => {}
    }
    spec.holder_identity = Some(cfg.identity.clone());
    spec.renew_time = t;
    spec.lease_duration_seconds = Some(cfg.lease_duration.as_secs().max(1) as i32);
    spec
}

/// A leader that has not renewed for this long stops writing: 80% of the lease, so it is gone
/// before a standby may take over (at 100%).
fn step_down_after(lease_duration: Duration) -> Duration {
    lease_duration.mul_f32(0.8)
}

/// The lease spec once its holder gives it up: no holder, so a standby takes it at once.
fn released(mut spec: LeaseSpec) -> LeaseSpec {
    spec.holder_identity = None;
    spec.renew_time = None;
    spec.acquire_time = None;
    spec
}

/// One attempt to take or renew the lease. `Ok(true)`: we hold it now.
async fn try_hold(api: &Api<Lease>, cfg: &LeaderConfig) -> Result<bool, kube::Error> {
    let current = api.get_opt(&cfg.name).await?;
    let at = Timestamp::now();
    // A Lease without a spec is free.
    let empty = LeaseSpec::default();
    let spec = current.as_ref().map(|l| l.spec.as_ref().unwrap_or(&empty));
    let step = step(spec, cfg, at);
    if let Step::TakeOver { previous } = &step {
        info!(previous = %previous, "taking over the leader lease");
    }
    let result = match (step, current) {
        (Step::Wait, _) => return Ok(false),
        (step @ Step::Create, _) | (step, None) => {
            let lease = Lease {
                metadata: ObjectMeta {
                    name: Some(cfg.name.clone()),
                    ..Default::default()
                },
                spec: Some(held(None, &step, cfg, at)),
            };
            api.create(&PostParams::default(), &lease).await
        }
        (step, Some(mut lease)) => {
            lease.spec = Some(held(lease.spec.take(), &step, cfg, at));
            // replace() sends our resourceVersion: a concurrent writer makes this fail with 409.
            api.replace(&cfg.name, &PostParams::default(), &lease).await
        }
    };
    match result {
        Ok(_) => Ok(true),
        Err(kube::Error::Api(e)) if e.code == 409 => Ok(false),
        Err(e) => Err(e),
    }
}

/// Waits until this replica leads, then renews in the background. The returned receiver turns
/// `false` when leadership is lost; sending on the returned sender releases the lease.
pub async fn lead(
    client: Client,
    cfg: LeaderConfig,
) -> (watch::Receiver<bool>, tokio::sync::oneshot::Sender<()>) {
    let api: Api<Lease> = Api::namespaced(client, &cfg.namespace);
    info!(lease = %format!("{}/{}", cfg.namespace, cfg.name), identity = %cfg.identity, "waiting to become leader");
    loop {
        match try_hold(&api, &cfg).await {
            Ok(true) => break,
            Ok(false) => debug!("another replica leads"),
            Err(e) => warn!(error = %e, "leader election: cannot read or write the lease"),
        }
        tokio::time::sleep(cfg.renew).await;
    }
    info!(identity = %cfg.identity, "became leader");
    let (tx, rx) = watch::channel(true);
    let (release_tx, mut release_rx) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(async move {
        let mut last_ok = tokio::time::Instant::now();
        // Give up a little before the lease could expire for the others.
        let deadline = step_down_after(cfg.lease_duration);
        loop {
            tokio::select! {
                _ = tokio::time::sleep(cfg.renew) => {}
                _ = &mut release_rx => {
                    release(&api, &cfg).await;
                    let _ = tx.send(false);
                    return;
                }
            }
            match try_hold(&api, &cfg).await {
                Ok(true) => last_ok = tokio::time::Instant::now(),
                Ok(false) => {
                    warn!("another replica took the leader lease");
                    let _ = tx.send(false);
                    return;
                }
                Err(e) => warn!(error = %e, "cannot renew the leader lease"),
            }
            if last_ok.elapsed() > deadline {
                warn!("could not renew the leader lease in time; stepping down");
                let _ = tx.send(false);
                return;
            }
        }
    });
    (rx, release_tx)
}

/// Gives the lease up on a clean shutdown, so a standby takes over at once.
async fn release(api: &Api<Lease>, cfg: &LeaderConfig) {
    if let Ok(Some(mut lease)) = api.get_opt(&cfg.name).await
        && lease
            .spec
            .as_ref()
            .and_then(|s| s.holder_identity.as_deref())
            == Some(cfg.identity.as_str())
    {
        lease.spec = lease.spec.take().map(released);
        match api.replace(&cfg.name, &PostParams::default(), &lease).await {
            Ok(_) => info!("released the leader lease"),
            Err(e) => warn!(error = %e, "could not release the leader lease"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(identity: &str) -> LeaderConfig {
        LeaderConfig {
            namespace: "ns".into(),
            name: "lease".into(),
            identity: identity.into(),
            lease_duration: Duration::from_secs(15),
            renew: Duration::from_secs(2),
        }
    }

    fn at(s: i64) -> Timestamp {
        Timestamp::from_second(1_800_000_000 + s).unwrap()
    }

    #[test]
    fn a_missing_lease_is_created_and_held() {
        let a = cfg("a");
        assert_eq!(step(None, &a, at(0)), Step::Create);
        let spec = held(None, &Step::Create, &a, at(0));
        assert_eq!(spec.holder_identity.as_deref(), Some("a"));
        assert_eq!(spec.lease_duration_seconds, Some(15));
        assert_eq!(spec.lease_transitions, Some(0));
        assert_eq!(spec.acquire_time, spec.renew_time);
    }

    #[test]
    fn a_holder_renews_and_others_wait_until_expiry() {
        let (a, b) = (cfg("a"), cfg("b"));
        let spec = held(None, &Step::Create, &a, at(0));
        assert_eq!(step(Some(&spec), &a, at(5)), Step::Renew);
        let renewed = held(Some(spec.clone()), &Step::Renew, &a, at(5));
        assert_eq!(
            renewed.acquire_time, spec.acquire_time,
            "renewal keeps acquireTime"
        );
        assert_eq!(renewed.renew_time, Some(MicroTime(at(5))));
        // Within the lease (15 s after the last renewal, inclusive): the standby waits.
        assert_eq!(step(Some(&renewed), &b, at(20)), Step::Wait);
        // Past it: the standby takes over, counting a transition.
        assert_eq!(
            step(Some(&renewed), &b, at(21)),
            Step::TakeOver {
                previous: "a".into()
            }
        );
        let taken = held(
            Some(renewed),
            &Step::TakeOver {
                previous: "a".into(),
            },
            &b,
            at(21),
        );
        assert_eq!(taken.holder_identity.as_deref(), Some("b"));
        assert_eq!(taken.lease_transitions, Some(1));
        assert_eq!(taken.acquire_time, Some(MicroTime(at(21))));
    }

    #[test]
    fn expiry_follows_the_duration_the_lease_states() {
        let a = cfg("a");
        let mut spec = held(None, &Step::Create, &a, at(0));
        spec.lease_duration_seconds = Some(60);
        assert!(!expired(&spec, a.lease_duration, at(59)));
        assert!(expired(&spec, a.lease_duration, at(61)));
        // A lease that was never renewed nor acquired is free.
        assert!(expired(&LeaseSpec::default(), a.lease_duration, at(0)));
    }

    #[test]
    fn a_leader_steps_down_before_a_standby_may_take_over() {
        let d = Duration::from_secs(15);
        assert_eq!(step_down_after(d), Duration::from_secs(12));
        assert!(step_down_after(d) < d);
    }

    #[test]
    fn lease_timings_leave_room_for_a_renewal() {
        let mut c = cfg("a");
        assert!(c.check().is_ok());
        c.lease_duration = Duration::from_secs(3);
        c.renew = Duration::from_secs(1);
        assert!(c.check().is_ok(), "the failover test's timings");
        c.renew = Duration::from_secs(3);
        assert!(c.check().unwrap_err().contains("80%"));
        c.lease_duration = Duration::from_secs(1);
        assert!(c.check().is_err());
    }

    #[test]
    fn a_released_lease_is_taken_at_once() {
        let (a, b) = (cfg("a"), cfg("b"));
        let spec = released(held(None, &Step::Create, &a, at(0)));
        assert_eq!(spec.holder_identity, None);
        // Well within what would have been a's lease.
        assert_eq!(
            step(Some(&spec), &b, at(1)),
            Step::TakeOver {
                previous: String::new()
            }
        );
    }
}
