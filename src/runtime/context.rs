//! The running controller's settings ([`Config`], from `gpu-sharing-operator run`) and shared
//! state ([`Context`]: client, caches, event recorder), which the control loop, the appliers,
//! the finalizers and the plan input all read. What earlier passes learnt is not here: the
//! control loop keeps it ([`crate::runtime::memory`]).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use kube::runtime::events::{Event, EventType, Recorder};
use kube::{Client, Resource};
use tracing::debug;

use crate::api::crd::GpuSharingPolicy;
use crate::api::names::*;
use crate::runtime::watches::Caches;
use crate::telemetry::metrics::Metrics;

/// Settings of `gpu-sharing-operator run`.
#[derive(Debug, Clone)]
pub struct Config {
    /// GPU Operator namespace; detected from the ClusterPolicy status when `None`.
    pub namespace: Option<String>,
    pub device_configmap: String,
    pub mig_configmap: String,
    /// Name of our vGPU-devices ConfigMap (custom vGPU layouts).
    pub vgpu_configmap: String,
    /// Full resync period (drift is also caught by the watches).
    pub resync: Duration,
    /// Where to count what happens (served on /metrics by the binary).
    pub metrics: Arc<Metrics>,
    /// How long `nvidia.com/mig.config.state=pending` may last before the node is reported
    /// Degraded and left alone.
    pub mig_timeout: Duration,
    /// Start no node change for any policy (`--pause-rollouts`); status stays current.
    pub pause_rollouts: bool,
    /// The readiness taint's key (`--readiness-taint`), removed from nodes once configured.
    pub readiness_taint: Option<String>,
    /// The client for evictions: one built with `kube::Config::default_retry` off. The Eviction
    /// API answers 429 while a PodDisruptionBudget forbids an eviction, and kube's default
    /// client retries 429 (honouring Retry-After), so through it a refusal only looks slow.
    /// Without one, evictions go through the main client and an eviction still unanswered
    /// after [`EVICTION_WAIT`](crate::runtime::apply::EVICTION_WAIT) is reported as unanswered.
    pub eviction_client: Option<EvictionClient>,
    /// The fence check's last verdict (`runtime::fence::watch` writes it), reported on every
    /// policy's status.
    pub fence: Arc<crate::runtime::fence::State>,
}

impl Config {
    /// The ConfigMaps of the GPU Operator's namespace the operator reads, all it reads there:
    /// its own three, NVIDIA's default MIG and vGPU configs and the admin's instance-type
    /// table. The RBAC grants reading exactly these by name (config/rbac.yaml), and the
    /// runtime watches each by name.
    pub fn configmaps_read(&self) -> [&str; 6] {
        [
            &self.device_configmap,
            &self.mig_configmap,
            &self.vgpu_configmap,
            DEFAULT_MIG_CONFIGMAP,
            DEFAULT_VGPU_CONFIGMAP,
            INSTANCE_TYPES_CONFIGMAP,
        ]
    }
}

/// A client built with kube's default retry off, for evictions ([`Config::eviction_client`]).
#[derive(Clone)]
pub struct EvictionClient(pub Client);

impl std::fmt::Debug for EvictionClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("EvictionClient")
    }
}

impl Default for Config {
    fn default() -> Self {
        Config {
            namespace: None,
            device_configmap: DEVICE_PLUGIN_CONFIGMAP.into(),
            mig_configmap: MIG_PARTED_CONFIGMAP.into(),
            vgpu_configmap: VGPU_DEVICES_CONFIGMAP.into(),
            resync: Duration::from_secs(300),
            metrics: Arc::default(),
            mig_timeout: Duration::from_secs(600),
            pause_rollouts: false,
            readiness_taint: None,
            eviction_client: None,
            fence: Arc::default(),
        }
    }
}

/// Shared state of the running controller.
pub struct Context {
    pub client: Client,
    pub config: Config,
    pub namespace: String,
    pub(crate) caches: Caches,
    recorder: Recorder,
    /// Events in flight at once (see [`Context::event`]).
    events: Arc<tokio::sync::Semaphore>,
    /// Passes so far (each pass's tracing span carries its number).
    passes: AtomicU64,
}

/// Events published at once. They go off the critical path, but not all at once: a pass that
/// labels 200 policies' nodes has 400 to publish, and unbounded they opened some 200
/// connections to the API server, which then idled in the client's pool with their buffers
/// (about a tenth of the operator's memory at 20,000 nodes).
const EVENTS_IN_FLIGHT: usize = 4;

impl Context {
    /// A fresh context: no pass yet.
    pub(crate) fn new(
        client: Client,
        config: Config,
        namespace: String,
        caches: Caches,
        recorder: Recorder,
    ) -> Self {
        Context {
            client,
            config,
            namespace,
            caches,
            recorder,
            events: Arc::new(tokio::sync::Semaphore::new(EVENTS_IN_FLIGHT)),
            passes: AtomicU64::new(0),
        }
    }

    /// The next pass's number (1 for the first).
    pub(crate) fn next_pass(&self) -> u64 {
        self.passes.fetch_add(1, Ordering::Relaxed) + 1
    }

    /// Publishes an event on any object (a pending pod).
    pub(crate) async fn publish(
        &self,
        ev: &Event,
        reference: &k8s_openapi::api::core::v1::ObjectReference,
    ) -> Result<(), kube::Error> {
        self.recorder.publish(ev, reference).await
    }

    /// Publishes an event on a policy, off the critical path: a slow events API never delays
    /// the next write.
    pub(crate) async fn event(
        &self,
        policy: &GpuSharingPolicy,
        type_: EventType,
        reason: &str,
        note: String,
    ) {
        let ev = Event {
            type_,
            reason: reason.into(),
            note: Some(note),
            action: "Reconcile".into(),
            secondary: None,
        };
        let recorder = self.recorder.clone();
        let reference = policy.object_ref(&());
        let slots = self.events.clone();
        tokio::spawn(async move {
            // The semaphore is never closed.
            let Ok(_slot) = slots.acquire_owned().await else {
                return;
            };
            if let Err(e) = recorder.publish(&ev, &reference).await {
                debug!(error = %e, "event not published");
            }
        });
    }
}
