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

fn now() -> MicroTime {
    MicroTime(Timestamp::now())
}

fn expired(l: &Lease, lease_duration: Duration) -> bool {
    let Some(spec) = &l.spec else { return true };
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
        .is_ok_and(|deadline| deadline < Timestamp::now())
}

/// One attempt to take or renew the lease. `Ok(true)`: we hold it now.
async fn try_hold(api: &Api<Lease>, cfg: &LeaderConfig) -> Result<bool, kube::Error> {
    let secs = cfg.lease_duration.as_secs().max(1) as i32;
    match api.get_opt(&cfg.name).await? {
        None => {
            let lease = Lease {
                metadata: ObjectMeta {
                    name: Some(cfg.name.clone()),
                    ..Default::default()
                },
                spec: Some(LeaseSpec {
                    holder_identity: Some(cfg.identity.clone()),
                    lease_duration_seconds: Some(secs),
                    acquire_time: Some(now()),
                    renew_time: Some(now()),
                    lease_transitions: Some(0),
                    ..Default::default()
                }),
            };
            match api.create(&PostParams::default(), &lease).await {
                Ok(_) => Ok(true),
                Err(kube::Error::Api(e)) if e.code == 409 => Ok(false),
                Err(e) => Err(e),
            }
        }
        Some(mut lease) => {
            let spec = lease.spec.get_or_insert_with(Default::default);
            let holder = spec.holder_identity.clone().unwrap_or_default();
            let mine = holder == cfg.identity;
            if !mine && !holder.is_empty() && !expired(&lease, cfg.lease_duration) {
                return Ok(false);
            }
            let spec = lease.spec.get_or_insert_with(Default::default);
            if !mine {
                spec.holder_identity = Some(cfg.identity.clone());
                spec.acquire_time = Some(now());
                spec.lease_transitions = Some(spec.lease_transitions.unwrap_or(0) + 1);
                info!(previous = %holder, "taking over the leader lease");
            }
            spec.renew_time = Some(now());
            spec.lease_duration_seconds = Some(secs);
            // replace() sends our resourceVersion: a concurrent writer makes this fail with 409.
            match api.replace(&cfg.name, &PostParams::default(), &lease).await {
                Ok(_) => Ok(true),
                Err(kube::Error::Api(e)) if e.code == 409 => Ok(false),
                Err(e) => Err(e),
            }
        }
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
        let deadline = cfg.lease_duration.mul_f32(0.8);
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
        if let Some(spec) = lease.spec.as_mut() {
            spec.holder_identity = None;
            spec.renew_time = None;
            spec.acquire_time = None;
        }
        match api.replace(&cfg.name, &PostParams::default(), &lease).await {
            Ok(_) => info!("released the leader lease"),
            Err(e) => warn!(error = %e, "could not release the leader lease"),
        }
    }
}
