//! The watches the controller plans from: policies, nodes (as planner facts only), the GPU
//! Operator namespace's ConfigMaps it reads (each by name), pods that may hold GPUs, our
//! ResourceClaimTemplates and the ClusterPolicy, each into a cache. Every event wakes the
//! control loop.

use std::collections::BTreeMap;
use std::sync::Arc;

use futures::{StreamExt, TryStreamExt, stream};
use k8s_openapi::api::core::v1::{ConfigMap, Namespace, Node, Pod, ResourceQuota};
use k8s_openapi::api::resource::v1::{
    DeviceClass, ResourceClaim, ResourceClaimTemplate, ResourceSlice,
};
use kube::api::{Api, DynamicObject, PartialObjectMeta};
use kube::runtime::reflector::{self, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, ResourceExt};
use tokio::sync::Notify;
use tracing::warn;

use crate::api::crd::GpuSharingPolicy;
use crate::api::names::{MANAGED_BY, MANAGER};
use crate::observe::pods::{RUNNING_BOUND_PODS, UNSCHEDULED_PODS, strip_bound, strip_pending};
use crate::plan::{LabelFilter, selector_keys};
use crate::runtime::nodecache::NodeCache;
use crate::runtime::resources::cluster_policy_resource;
use crate::runtime::taints::Tainted;

/// Nodes per list page when the node watch (re)lists.
const NODE_LIST_PAGE: u32 = 100;

/// How long after a failed watch or pass the caches may lag the server.
const LAG_SUSPECT_FOR: std::time::Duration = std::time::Duration::from_secs(120);

/// When a watch or a pass last failed: until [`LAG_SUSPECT_FOR`] later the caches may lag the
/// server (a watch re-listing after an API server restart, a write whose response was lost).
#[derive(Debug, Default)]
pub struct CacheLag(std::sync::Mutex<Option<std::time::Instant>>);

impl CacheLag {
    /// Something failed now.
    pub fn mark(&self) {
        *self.0.lock().expect("cache lag lock") = Some(std::time::Instant::now());
    }

    /// Whether the caches may lag the server.
    pub fn suspect(&self) -> bool {
        self.0
            .lock()
            .expect("cache lag lock")
            .is_some_and(|at| at.elapsed() < LAG_SUSPECT_FOR)
    }
}

/// The caches a pass reads.
pub struct Caches {
    /// Whether they may lag the server (see `apply::nodes::keep_server_write_time`).
    pub lag: Arc<CacheLag>,
    pub policies: Store<GpuSharingPolicy>,
    pub nodes: Arc<NodeCache>,
    pub configmaps: NamedConfigMaps,
    pub pods: Store<Pod>,
    /// Pods not yet bound to a node, stripped to what demand planning reads.
    pub pending: Store<Pod>,
    /// `None` when the ClusterPolicy CRD is not served.
    pub cluster_policies: Option<Store<DynamicObject>>,
    /// Our ResourceClaimTemplates (DRA backend), when resource.k8s.io/v1 is served.
    pub claim_templates: Option<Store<ResourceClaimTemplate>>,
    /// Namespaces (metadata), when we may list them: a DRA template waits for its namespace.
    pub namespaces: Option<Store<PartialObjectMeta<Namespace>>>,
    /// Nodes carrying the readiness taint (`--readiness-taint` only).
    pub tainted: Option<Arc<Tainted>>,
    /// ResourceClaims (resource.k8s.io/v1), stripped to their allocation: a node leaves DRA only
    /// when no allocated `gpu.nvidia.com` claim remains on it.
    pub claims: Option<Store<ResourceClaim>>,
    /// NVIDIA's DRA driver's ResourceSlices (`spec.driver=gpu.nvidia.com`), stripped to what
    /// [`crate::observe::slices`] reads, when resource.k8s.io/v1 is served.
    pub slices: Option<Store<ResourceSlice>>,
    /// DeviceClasses, stripped to what [`crate::observe::classes`] reads, when they can be
    /// listed (without them no policy may serve extended resources).
    pub device_classes: Option<Store<DeviceClass>>,
    /// ResourceQuotas, stripped to their GPU keys ([`crate::observe::quotas`]), when they can be
    /// listed: the quota report of extended-resource policies.
    pub quotas: Option<Store<ResourceQuota>>,
    /// The GPU Operator's DRA-only `GPUCluster` objects, when that kind is served.
    pub gpu_clusters: Option<Store<DynamicObject>>,
    /// Karpenter's NodePools and every NodeOverlay (ours and others'), when the NodeOverlay
    /// kind is served.
    pub karpenter: Option<(Store<DynamicObject>, Store<DynamicObject>)>,
}

impl Caches {
    /// Waits until every cache has listed once.
    pub async fn wait_until_ready(&self) {
        self.policies.wait_until_ready().await.ok();
        self.nodes.wait_until_ready().await;
        self.configmaps.wait_until_ready().await;
        self.pods.wait_until_ready().await.ok();
        self.pending.wait_until_ready().await.ok();
        if let Some(c) = &self.cluster_policies {
            c.wait_until_ready().await.ok();
        }
        if let Some(c) = &self.claim_templates {
            c.wait_until_ready().await.ok();
        }
        if let Some(c) = &self.namespaces {
            c.wait_until_ready().await.ok();
        }
        if let Some(c) = &self.claims {
            c.wait_until_ready().await.ok();
        }
        if let Some(c) = &self.slices {
            c.wait_until_ready().await.ok();
        }
        if let Some(c) = &self.device_classes {
            c.wait_until_ready().await.ok();
        }
        if let Some(c) = &self.quotas {
            c.wait_until_ready().await.ok();
        }
        if let Some(c) = &self.gpu_clusters {
            c.wait_until_ready().await.ok();
        }
        if let Some((pools, overlays)) = &self.karpenter {
            pools.wait_until_ready().await.ok();
            overlays.wait_until_ready().await.ok();
        }
        while self.tainted.as_ref().is_some_and(|t| !t.is_ready()) {
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
    }
}

/// The ConfigMaps of the GPU Operator's namespace the operator reads, each in a cache of its
/// own, kept by a watch with a `metadata.name` field selector. The RBAC grants `get`, `list` and
/// `watch` on exactly these names (`resourceNames`; a list or watch matches such a rule only
/// with that selector), so nothing else in the namespace is read or cached: not NVIDIA's vGPU
/// `licensing-config`, which holds a licence token.
#[derive(Clone, Default)]
pub struct NamedConfigMaps(BTreeMap<String, Store<ConfigMap>>);

impl NamedConfigMaps {
    /// Starts one watch per name in `namespace`, added to `streams`.
    fn watch(client: &Client, namespace: &str, names: &[&str], streams: &mut Streams) -> Self {
        let api: Api<ConfigMap> = Api::namespaced(client.clone(), namespace);
        let stores = names
            .iter()
            .map(|name| {
                let cfg = watcher::Config::default().fields(&format!("metadata.name={name}"));
                (name.to_string(), cache(api.clone(), cfg, (), streams))
            })
            .collect();
        NamedConfigMaps(stores)
    }

    /// The ConfigMap `name`, when it exists; `None` too for a name not watched.
    pub fn get(&self, name: &str) -> Option<Arc<ConfigMap>> {
        let store = self.0.get(name)?;
        store.state().into_iter().find(|c| c.name_any() == name)
    }

    async fn wait_until_ready(&self) {
        for store in self.0.values() {
            store.wait_until_ready().await.ok();
        }
    }
}

/// Pods waiting for a node (demand for dynamic MIG layouts): their cache and its stream. The
/// stream wakes the control loop only for pods that may be demand, and only while some policy
/// is dynamic: anyone may create pending pods, and each wake restarts the pass's quiet period.
fn pending_watch(
    client: &Client,
    policies: Store<GpuSharingPolicy>,
) -> (
    Store<Pod>,
    futures::stream::BoxStream<'static, Result<(), watcher::Error>>,
) {
    let (pending, pendingw) = reflector::store();
    let stream = reflector::reflector(
        pendingw,
        watcher(
            Api::<Pod>::all(client.clone()),
            watcher::Config::default().fields(UNSCHEDULED_PODS),
        )
        .default_backoff()
        .modify(strip_pending),
    )
    .try_filter(move |event| {
        let demand = |p: &Pod| p.spec.is_some();
        let matters = match event {
            watcher::Event::Apply(p) | watcher::Event::Delete(p) => demand(p),
            // A list (the first, or after a watch error) is one wake at its end.
            watcher::Event::Init | watcher::Event::InitApply(_) => false,
            watcher::Event::InitDone => true,
        };
        let dynamic = || {
            policies
                .state()
                .iter()
                .any(|p| p.spec.mig.as_ref().is_some_and(|m| m.dynamic.is_some()))
        };
        futures::future::ready(matters && dynamic())
    })
    .map_ok(|_| ())
    .boxed();
    (pending, stream)
}

/// Starts every watch: returns the caches and the future that drives them (it notifies
/// `notify` on every event and ends only if every stream ends). `configmaps` names the
/// ConfigMaps of the GPU Operator's namespace to watch (each by name).
pub async fn start(
    client: &Client,
    namespace: &str,
    configmaps: &[&str],
    readiness_taint: Option<&str>,
    notify: Arc<Notify>,
) -> (Caches, impl std::future::Future<Output = ()> + use<>) {
    // The node cache keeps the labels the policies select on: read them before the first list
    // (otherwise the first pass would list every node a second time).
    let selected = match Api::<GpuSharingPolicy>::all(client.clone())
        .list(&Default::default())
        .await
    {
        Ok(l) => selector_keys(l.items.iter()),
        Err(_) => Default::default(),
    };
    let nodes = Arc::new(NodeCache::new(MANAGER, LabelFilter::new(selected)));
    let cp_api: Api<DynamicObject> = Api::all_with(client.clone(), &cluster_policy_resource());
    let cluster_policy_served = cp_api.list(&Default::default()).await.is_ok();
    let (pods, podw) = reflector::store();
    let tainted = readiness_taint.map(|key| Arc::new(Tainted::new(key)));
    // Node cache: only what the planner reads, built from each event (see nodecache); the
    // readiness taint's set of nodes is fed by the same watch.
    let node_stream = node_watch(client, &nodes, tainted.clone());
    // Pods that may hold GPUs (MIG changes wait for idle GPUs): only bound, unfinished pods,
    // stripped to what the check needs.
    let pod_stream = reflector::reflector(
        podw,
        watcher(
            Api::<Pod>::all(client.clone()),
            watcher::Config::default().fields(RUNNING_BOUND_PODS),
        )
        .default_backoff()
        .modify(strip_bound),
    )
    .boxed();
    let mut streams: Streams = vec![pod_stream.map_ok(|_| ()).boxed(), node_stream];
    let all = watcher::Config::default;
    let policies = cache(Api::all(client.clone()), all(), (), &mut streams);
    let (pending, pending_stream) = pending_watch(client, policies.clone());
    streams.push(pending_stream);
    let configmaps = NamedConfigMaps::watch(client, namespace, configmaps, &mut streams);
    let claim_templates = claim_template_watch(client, &mut streams).await;
    let namespaces = namespace_watch(client, &mut streams).await;
    let claims = claim_watch(client, &mut streams).await;
    let (slices, device_classes, quotas) = extended_resource_watches(client, &mut streams).await;
    let gpu_clusters = gpu_cluster_watch(client, &mut streams).await;
    let karpenter = karpenter_watch(client, &mut streams).await;
    let cluster_policies = if cluster_policy_served {
        // The GPU Operator acts on the oldest ClusterPolicy.
        Some(cache(
            cp_api,
            all(),
            cluster_policy_resource(),
            &mut streams,
        ))
    } else {
        warn!(
            "the ClusterPolicy CRD (nvidia.com/v1) is not served: nodes are labelled, but no device plugin reads the config"
        );
        None
    };
    let lag: Arc<CacheLag> = Default::default();
    let events = {
        let notify = notify.clone();
        let lag = lag.clone();
        stream::select_all(streams).for_each(move |r| {
            if let Err(e) = r {
                warn!(error = %e, "watch error");
                lag.mark();
            }
            notify.notify_one();
            futures::future::ready(())
        })
    };
    let caches = Caches {
        lag,
        policies,
        nodes,
        configmaps,
        pods,
        pending,
        cluster_policies,
        claim_templates,
        namespaces,
        tainted,
        claims,
        slices,
        device_classes,
        quotas,
        gpu_clusters,
        karpenter,
    };
    (caches, events)
}

/// The node watch feeding the node cache (and the readiness taint's set of nodes): a new watch,
/// so a new list, whenever the cache's label filter grows.
fn node_watch(
    client: &Client,
    nodes: &Arc<NodeCache>,
    tainted: Option<Arc<Tainted>>,
) -> futures::stream::BoxStream<'static, Result<(), watcher::Error>> {
    let (nodes, client) = (nodes.clone(), client.clone());
    let relists = nodes.relists();
    stream::unfold((), move |()| {
        let mut grown = relists.clone();
        grown.mark_unchanged();
        let (nodes, tainted) = (nodes.clone(), tainted.clone());
        let watch = watcher(
            Api::<Node>::all(client.clone()),
            // Small list pages: a page of whole nodes (managedFields, status) is decoded
            // at once before it is reduced to facts.
            watcher::Config::default().page_size(NODE_LIST_PAGE),
        )
        .default_backoff()
        .take_until(async move {
            if grown.changed().await.is_err() {
                std::future::pending::<()>().await;
            }
        })
        .map_ok(move |ev| {
            if let Some(t) = &tainted {
                t.apply(&ev);
            }
            nodes.apply(ev)
        });
        futures::future::ready(Some((watch, ())))
    })
    .flatten()
    .boxed()
}

/// Namespaces, as metadata only (a template is created as soon as its namespace appears). An
/// operator without the RBAC to list them assumes every namespace exists, as before.
async fn namespace_watch(
    client: &Client,
    streams: &mut Streams,
) -> Option<Store<PartialObjectMeta<Namespace>>> {
    let api: Api<PartialObjectMeta<Namespace>> = Api::all(client.clone());
    if let Err(e) = api
        .list_metadata(&kube::api::ListParams::default().limit(1))
        .await
    {
        warn!(error = %e, "cannot list namespaces: DRA policies are reported Ready without checking that their namespaces exist");
        return None;
    }
    Some(cache(api, watcher::Config::default(), (), streams))
}

/// ResourceClaims in every namespace, kept only with their allocation (`status.allocation`):
/// what [`crate::observe::claims::dra_claims`] reads.
async fn claim_watch(client: &Client, streams: &mut Streams) -> Option<Store<ResourceClaim>> {
    let strip = |c: &mut ResourceClaim| {
        c.metadata.managed_fields = None;
        c.metadata.annotations = None;
        c.metadata.labels = None;
        c.spec = Default::default();
        if let Some(s) = c.status.as_mut() {
            s.devices = None;
            s.reserved_for = None;
        }
    };
    stripped_watch(
        Api::all(client.clone()),
        watcher::Config::default(),
        strip,
        "cannot list ResourceClaims: nodes leaving a DRA policy get the device plugin back without checking for allocated claims",
        streams,
    )
    .await
}

/// NVIDIA's DRA driver's ResourceSlices, the DeviceClasses and the ResourceQuotas: what DRA
/// extended resources read.
async fn extended_resource_watches(
    client: &Client,
    streams: &mut Streams,
) -> (
    Option<Store<ResourceSlice>>,
    Option<Store<DeviceClass>>,
    Option<Store<ResourceQuota>>,
) {
    let slices = stripped_watch(
        Api::<ResourceSlice>::all(client.clone()),
        watcher::Config::default().fields(&crate::observe::slices::field_selector()),
        crate::observe::slices::strip,
        "cannot list ResourceSlices: nodes moving to DRA extended resources are not confirmed",
        streams,
    )
    .await;
    let device_classes = stripped_watch(
        Api::<DeviceClass>::all(client.clone()),
        watcher::Config::default(),
        crate::observe::classes::strip,
        "cannot list DeviceClasses: policies with dra.extendedResources are refused",
        streams,
    )
    .await;
    let quotas = stripped_watch(
        Api::<ResourceQuota>::all(client.clone()),
        watcher::Config::default(),
        crate::observe::quotas::strip,
        "cannot list ResourceQuotas: policies with dra.extendedResources report no quota gaps",
        streams,
    )
    .await;
    (slices, device_classes, quotas)
}

/// A watch of `api` kept in a store after `strip`, when it can be listed (else `None`, with the
/// warning `unreadable`).
async fn stripped_watch<K>(
    api: Api<K>,
    config: watcher::Config,
    strip: fn(&mut K),
    unreadable: &'static str,
    streams: &mut Streams,
) -> Option<Store<K>>
where
    K: kube::Resource<DynamicType = ()>
        + Clone
        + std::fmt::Debug
        + serde::de::DeserializeOwned
        + Send
        + Sync
        + 'static,
{
    let mut lp = kube::api::ListParams::default().limit(1);
    if let Some(f) = &config.field_selector {
        lp = lp.fields(f);
    }
    if let Err(e) = api.list(&lp).await {
        warn!(error = %e, "{unreadable}");
        return None;
    }
    let writer = reflector::store::Writer::default();
    let store = writer.as_reader();
    streams.push(
        reflector::reflector(writer, watcher(api, config).default_backoff().modify(strip))
            .map_ok(|_| ())
            .boxed(),
    );
    Some(store)
}

/// The GPU Operator's `GPUCluster` (group `nvidia.com`, any version), found through discovery:
/// in DRA-only mode it replaces the ClusterPolicy, and the operator reports it instead of
/// configuring a device plugin that does not run.
async fn gpu_cluster_watch(client: &Client, streams: &mut Streams) -> Option<Store<DynamicObject>> {
    let group = kube::discovery::group(client, "nvidia.com").await.ok()?;
    let (ar, _) = group
        .resources_by_stability()
        .into_iter()
        .find(|(ar, _)| ar.kind == GPU_CLUSTER_KIND)?;
    let api: Api<DynamicObject> = Api::all_with(client.clone(), &ar);
    if let Err(e) = api.list(&kube::api::ListParams::default().limit(1)).await {
        warn!(error = %e, "GPUCluster is served but cannot be listed: the GPU Operator's DRA-only mode goes unnoticed");
        return None;
    }
    Some(cache(api, watcher::Config::default(), ar, streams))
}

/// Karpenter's NodePools and NodeOverlays, when NodeOverlays can be listed (Karpenter's CRD is
/// installed; its `NodeOverlay` feature gate is Karpenter's own business). Looked for at start,
/// like the other optional kinds: installing Karpenter later needs a restart of the operator.
async fn karpenter_watch(
    client: &Client,
    streams: &mut Streams,
) -> Option<(Store<DynamicObject>, Store<DynamicObject>)> {
    use crate::observe::karpenter::{node_overlay_resource, node_pool_resource};
    let overlays: Api<DynamicObject> = Api::all_with(client.clone(), &node_overlay_resource());
    let lp = kube::api::ListParams::default().limit(1);
    if let Err(e) = overlays.list(&lp).await {
        if !matches!(&e, kube::Error::Api(s) if s.code == 404) {
            warn!(error = %e, "NodeOverlays cannot be listed: Karpenter is not told about shared GPUs");
        }
        return None;
    }
    let pools: Api<DynamicObject> = Api::all_with(client.clone(), &node_pool_resource());
    if let Err(e) = pools.list(&lp).await {
        warn!(error = %e, "NodeOverlays are served but NodePools cannot be listed: Karpenter is not told about shared GPUs");
        return None;
    }
    let all = watcher::Config::default;
    let pools = cache(pools, all(), node_pool_resource(), streams);
    let overlays = cache(overlays, all(), node_overlay_resource(), streams);
    Some((pools, overlays))
}

/// Kind of the GPU Operator's DRA-only cluster resource.
pub const GPU_CLUSTER_KIND: &str = "GPUCluster";

type Streams = Vec<futures::stream::BoxStream<'static, Result<(), watcher::Error>>>;

/// Our ResourceClaimTemplates, in any namespace (resource.k8s.io/v1, Kubernetes 1.34+).
async fn claim_template_watch(
    client: &Client,
    streams: &mut Streams,
) -> Option<Store<ResourceClaimTemplate>> {
    let rct_api: Api<ResourceClaimTemplate> = Api::all(client.clone());
    let managed = format!("{}={}", MANAGED_BY.0, MANAGED_BY.1);
    if rct_api
        .list(&kube::api::ListParams::default().labels(&managed).limit(1))
        .await
        .is_ok()
    {
        let cfg = watcher::Config::default().labels(&managed);
        Some(cache(rct_api, cfg, (), streams))
    } else {
        warn!(
            "resource.k8s.io/v1 ResourceClaimTemplates are not served: policies with backend dra cannot be applied"
        );
        None
    }
}

/// A store of what `api` lists (as `cfg` selects), kept current by a watch added to `streams`.
fn cache<K>(
    api: Api<K>,
    cfg: watcher::Config,
    dyntype: K::DynamicType,
    streams: &mut Streams,
) -> Store<K>
where
    K: kube::Resource
        + Clone
        + serde::de::DeserializeOwned
        + std::fmt::Debug
        + Send
        + Sync
        + 'static,
    K::DynamicType: Eq + std::hash::Hash + Clone + Send + Sync,
{
    let writer = reflector::store::Writer::new(dyntype);
    let store = writer.as_reader();
    streams.push(
        reflector::reflector(writer, watcher(api, cfg).default_backoff())
            .map_ok(|_| ())
            .boxed(),
    );
    store
}
