//! `gpu-sharing-operator plan`: what applying policy files would change in a live cluster,
//! like `kubectl diff` / `terraform plan`. Read-only: one list or get per kind (get/list RBAC is
//! enough), then the pure planner on the cluster's state as it is and as the files want it.

pub mod diff;
pub mod print;
pub mod report;

use std::collections::BTreeMap;
use std::sync::Arc;

use k8s_openapi::api::core::v1::{ConfigMap, Namespace, Node, Pod, ResourceQuota};
use k8s_openapi::api::resource::v1::{DeviceClass, ResourceClaim, ResourceSlice};
use kube::api::{Api, DynamicObject, ListParams};
use kube::{Client, ResourceExt};

use crate::api::crd::GpuSharingPolicy;
use crate::api::names::{
    DEFAULT_MIG_CONFIGMAP, DEFAULT_VGPU_CONFIGMAP, DEVICE_PLUGIN_CONFIGMAP,
    INSTANCE_TYPES_CONFIGMAP, MANAGER, MIG_PARTED_CONFIGMAP, VGPU_DEVICES_CONFIGMAP,
};
use crate::observe::gpu_operator::{DEFAULT_NAMESPACE, active_cluster_policy};
use crate::observe::karpenter::{KarpenterView, node_overlay_resource, node_pool_resource};
use crate::observe::node::{Interner, facts};
use crate::observe::pods::{RUNNING_BOUND_PODS, UNSCHEDULED_PODS};
use crate::observe::{self, ClusterView, Memory, Settings};
use crate::plan::{LabelFilter, PlanInput};
use crate::runtime::controller::{cluster_policy_resource, detect_namespace};
use crate::runtime::taints::taint_of;
use crate::runtime::watches::GPU_CLUSTER_KIND;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("reading {what} from the cluster: {source}")]
    Read {
        what: &'static str,
        #[source]
        source: kube::Error,
    },
}

/// The cluster as it is: the planner's input with the policies in the cluster, and what the
/// preview compares against.
pub struct Snapshot {
    pub input: PlanInput,
    /// The active ClusterPolicy's `spec`, when there is one.
    pub cluster_policy_spec: Option<serde_json::Value>,
    /// The GPU Operator namespace used.
    pub namespace: String,
    /// What could not be read (forbidden) or is not stored in the cluster, and is therefore
    /// assumed: shown to the user.
    pub assumptions: Vec<String>,
}

/// How the controller being previewed runs: the flags of `run` that change what it plans
/// (`plan` takes the same ones).
#[derive(Debug, Clone, Default)]
pub struct RunFlags {
    /// `--readiness-taint`.
    pub readiness_taint: Option<String>,
    /// `--pause-rollouts`.
    pub pause_rollouts: bool,
}

/// What the running controller knows that no object in the cluster records: `plan` cannot
/// read it and says what it assumes instead.
fn memory_assumptions(flags: &RunFlags, assumptions: &mut Vec<String>) {
    assumptions.push(
        "nodes running no GPU pod now are taken as idle for longer than any idle timer (the controller remembers when each last ran one; the cluster does not)".into(),
    );
    assumptions.push(
        "no MIG or vGPU change is taken as stuck (the controller times a pending change from when it saw it start)".into(),
    );
    assumptions.push(
        "no eviction is taken as blocked and no write as refused (the controller's last attempts are not stored in the cluster)".into(),
    );
    if flags.readiness_taint.is_none() {
        assumptions.push(
            "no readiness taint: pass --readiness-taint as the controller runs with it".into(),
        );
    }
    if !flags.pause_rollouts {
        assumptions.push(
            "rollouts are not paused: pass --pause-rollouts if the controller runs with it".into(),
        );
    }
}

fn read(what: &'static str) -> impl FnOnce(kube::Error) -> Error {
    move |source| Error::Read { what, source }
}

fn forbidden(e: &kube::Error) -> bool {
    matches!(e, kube::Error::Api(s) if s.code == 403 || s.code == 404)
}

/// A list that may be forbidden (or not served): `None` then, with what is assumed instead
/// added to `assumptions`.
async fn optional<T>(
    what: &'static str,
    assumed: &str,
    assumptions: &mut Vec<String>,
    list: impl std::future::Future<Output = Result<T, kube::Error>>,
) -> Result<Option<T>, Error> {
    match list.await {
        Ok(l) => Ok(Some(l)),
        Err(e) if forbidden(&e) => {
            assumptions.push(format!("{what} cannot be listed: {assumed}"));
            Ok(None)
        }
        Err(e) => Err(read(what)(e)),
    }
}

/// What the DRA backend reads: ResourceClaims, NVIDIA's DRA driver's ResourceSlices and the
/// DeviceClasses; each assumed absent when it cannot be listed.
async fn dra_objects(client: &Client, assumptions: &mut Vec<String>) -> Result<DraObjects, Error> {
    let lp = ListParams::default();
    let claims = optional(
        "ResourceClaims",
        "no DRA claim is assumed allocated (nodes leaving DRA are shown getting the device plugin back)",
        assumptions,
        Api::<ResourceClaim>::all(client.clone()).list(&lp),
    )
    .await?
    .map(|l| l.items)
    .unwrap_or_default();
    let slices = optional(
        "ResourceSlices",
        "policies with dra.extendedResources are shown refused, as the operator refuses them without ResourceSlices",
        assumptions,
        Api::<ResourceSlice>::all(client.clone())
            .list(&lp.clone().fields(&observe::slices::field_selector())),
    )
    .await?
    .map(|l| l.items);
    let device_classes = optional(
        "DeviceClasses",
        "no DeviceClass is assumed to map an extended resource name",
        assumptions,
        Api::<DeviceClass>::all(client.clone()).list(&lp),
    )
    .await?
    .map(|l| l.items)
    .unwrap_or_default();
    let quotas = optional(
        "ResourceQuotas",
        "no quota gap is reported",
        assumptions,
        Api::<ResourceQuota>::all(client.clone()).list(&lp),
    )
    .await?
    .map(|l| l.items);
    Ok((claims, slices, device_classes, quotas))
}

/// ResourceClaims, ResourceSlices, DeviceClasses and ResourceQuotas (`None`: not readable, as
/// the controller reads them).
type DraObjects = (
    Vec<ResourceClaim>,
    Option<Vec<ResourceSlice>>,
    Vec<DeviceClass>,
    Option<Vec<ResourceQuota>>,
);

/// The GPU Operator's `GPUCluster` objects (group `nvidia.com`, any version, found through
/// discovery), by name; none when the kind is not served.
async fn gpu_clusters(
    client: &Client,
    assumptions: &mut Vec<String>,
) -> Result<Vec<String>, Error> {
    let Ok(group) = kube::discovery::group(client, "nvidia.com").await else {
        return Ok(vec![]);
    };
    let Some((ar, _)) = group
        .resources_by_stability()
        .into_iter()
        .find(|(ar, _)| ar.kind == GPU_CLUSTER_KIND)
    else {
        return Ok(vec![]);
    };
    let api: Api<DynamicObject> = Api::all_with(client.clone(), &ar);
    let assumed = "the GPU Operator is assumed not to run in DRA-only mode";
    let list = optional(
        "GPUClusters",
        assumed,
        assumptions,
        api.list_metadata(&ListParams::default()),
    )
    .await?;
    Ok(list
        .map(|l| l.items.iter().map(|o| o.name_any()).collect())
        .unwrap_or_default())
}

/// The pending pods admitted as demand, as the controller admits them.
fn admitted_demand(
    policies: &[GpuSharingPolicy],
    configmaps: &BTreeMap<String, BTreeMap<String, String>>,
    namespaces: &crate::plan::admit::NamespaceLabels,
    pending: &[Pod],
) -> crate::plan::admit::Admitted {
    let sources = crate::plan::admit::Sources {
        mig_configs: || {
            observe::gpu_operator::mig_configs(configmaps.get(DEFAULT_MIG_CONFIGMAP))
                .unwrap_or_else(crate::nvidia::default_mig_configs)
        },
        namespaces: || namespaces.clone(),
    };
    // As a controller that has kept the policies' keys only.
    let keys = crate::plan::selector_keys(policies);
    let budget = crate::plan::admit::KeyBudget {
        policy: &keys,
        filter: &LabelFilter::new(keys.clone()),
    };
    crate::plan::admit::admit(policies, sources, &budget, observe::pods::demand(pending))
}

/// Seconds since the epoch now.
fn unix_now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64)
}

/// The readiness taint's key and, by node, the taint with that key.
type Tainted = Option<(String, BTreeMap<String, crate::plan::taint::Taint>)>;

/// The nodes' facts, and the readiness taint's nodes as the controller's taint cache keeps
/// them (the taint with that key, any effect).
async fn nodes(
    client: &Client,
    flags: &RunFlags,
) -> Result<(Vec<Arc<crate::plan::NodeFacts>>, Tainted), Error> {
    let raw = Api::<Node>::all(client.clone())
        .list(&ListParams::default())
        .await
        .map_err(read("nodes"))?
        .items;
    let tainted = flags.readiness_taint.as_ref().map(|key| {
        let tainted = raw
            .iter()
            .filter_map(|n| Some((n.name_any(), taint_of(n, key)?)))
            .collect();
        (key.clone(), tainted)
    });
    let mut strings = Interner::default();
    let facts = raw
        .into_iter()
        .map(|n| Arc::new(facts(n, MANAGER, &LabelFilter::everything(), &mut strings)))
        .collect();
    Ok((facts, tainted))
}

/// Reads everything the planner needs, as the controller's caches hold it, and builds the
/// planner's input the same way ([`observe::plan_input`]). Nodes, policies, the ClusterPolicy
/// and our ConfigMaps are required; pods (the idle-GPU wait), ResourceClaims (nodes leaving
/// DRA), GPUClusters and namespaces (DRA templates) are optional: without the permission they
/// are assumed (no GPU pods, no allocated claims, no DRA-only mode, every namespace exists)
/// and said so. The controller's flags that change what it plans come in `flags` (`plan` takes
/// them as `run` does); what only its memory holds is assumed and said so too.
pub async fn snapshot(
    client: &Client,
    namespace: Option<String>,
    flags: &RunFlags,
) -> Result<Snapshot, Error> {
    let namespace = match namespace {
        Some(n) => n,
        None => detect_namespace(client)
            .await
            .unwrap_or_else(|| DEFAULT_NAMESPACE.into()),
    };
    let lp = ListParams::default();
    let (nodes, tainted) = nodes(client, flags).await?;
    let policies: Vec<GpuSharingPolicy> = Api::<GpuSharingPolicy>::all(client.clone())
        .list(&lp)
        .await
        .map_err(read("GpuSharingPolicies"))?
        .items;
    let cps: Api<DynamicObject> = Api::all_with(client.clone(), &cluster_policy_resource());
    let cluster_policies = match cps.list(&lp).await {
        Ok(l) => l.items,
        Err(e) if matches!(&e, kube::Error::Api(s) if s.code == 404) => vec![],
        Err(e) => return Err(read("ClusterPolicies")(e)),
    };
    let mut assumptions = Vec::new();
    memory_assumptions(flags, &mut assumptions);
    let configmaps = configmaps(client, &namespace, &mut assumptions).await?;
    let running = ListParams::default().fields(RUNNING_BOUND_PODS);
    let pods = optional(
        "pods",
        "no GPU is assumed busy (MIG changes may wait longer)",
        &mut assumptions,
        Api::<Pod>::all(client.clone()).list(&running),
    )
    .await?
    .map(|l| l.items)
    .unwrap_or_default();
    let unbound = ListParams::default().fields(UNSCHEDULED_PODS);
    let pending = optional(
        "pending pods",
        "no pod is assumed pending (demand-driven MIG layouts are not shown)",
        &mut assumptions,
        Api::<Pod>::all(client.clone()).list(&unbound),
    )
    .await?
    .map(|l| l.items)
    .unwrap_or_default();
    let (claims, slices, device_classes, quotas) = dra_objects(client, &mut assumptions).await?;
    let gpu_clusters = gpu_clusters(client, &mut assumptions).await?;
    let namespaces = optional(
        "namespaces",
        "every namespace a DRA policy lists is assumed to exist; no pod of a namespaceSelector is demand",
        &mut assumptions,
        Api::<Namespace>::all(client.clone()).list_metadata(&lp),
    )
    .await?
    .map(|l| l.items.iter().map(|n| (n.name_any(), n.labels().clone())).collect());
    let karpenter = karpenter_objects(client, &mut assumptions).await?;
    let admitted = admitted_demand(&policies, &configmaps, &namespaces, &pending);
    let cluster_policy_spec =
        active_cluster_policy(&cluster_policies).and_then(|c| c.data.get("spec").cloned());
    let view = ClusterView {
        policies,
        nodes,
        pods: pods.iter().collect(),
        demand: admitted.pods,
        demand_ignored: admitted.ignored,
        claims: claims.iter().collect(),
        slices: slices.as_ref().map(|s| s.iter().collect()),
        device_classes: Some(device_classes.iter().collect()),
        quotas: quotas.as_ref().map(|q| q.iter().collect()),
        cluster_policies: Some(cluster_policies.iter().collect()),
        gpu_clusters,
        configmaps,
        namespaces: namespaces.map(|n| n.into_keys().collect()),
        tainted,
        karpenter: karpenter.as_ref().map(|(pools, overlays)| KarpenterView {
            node_pools: pools.iter().collect(),
            overlays: overlays.iter().collect(),
        }),
        now: unix_now(),
    };
    let settings = Settings {
        pause_rollouts: flags.pause_rollouts,
        ..Settings::default()
    };
    let input = observe::plan_input(view, &settings, Memory::default());
    Ok(Snapshot {
        input,
        cluster_policy_spec,
        namespace,
        assumptions,
    })
}

/// Karpenter's NodePools and NodeOverlays, when the NodeOverlay kind is served and may be
/// listed (otherwise no overlay is planned, and a forbidden list is said).
async fn karpenter_objects(
    client: &Client,
    assumptions: &mut Vec<String>,
) -> Result<Option<(Vec<DynamicObject>, Vec<DynamicObject>)>, Error> {
    let lp = ListParams::default();
    let overlays = Api::<DynamicObject>::all_with(client.clone(), &node_overlay_resource());
    let overlays = match overlays.list(&lp).await {
        Ok(l) => l.items,
        Err(kube::Error::Api(s)) if s.code == 404 => return Ok(None),
        Err(e) if forbidden(&e) => {
            assumptions
                .push("NodeOverlays cannot be listed: Karpenter's overlays are not planned".into());
            return Ok(None);
        }
        Err(e) => return Err(read("NodeOverlays")(e)),
    };
    let pools = Api::<DynamicObject>::all_with(client.clone(), &node_pool_resource());
    let pools = optional(
        "NodePools",
        "no NodePool is assumed (no overlay is planned)",
        assumptions,
        pools.list(&lp),
    )
    .await?
    .map(|l| l.items)
    .unwrap_or_default();
    Ok(Some((pools, overlays)))
}

/// The data of the ConfigMaps the planner reads (ours, NVIDIA's defaults, the admin's
/// instance-type table), by name, from the GPU Operator's namespace.
async fn configmaps(
    client: &Client,
    namespace: &str,
    assumptions: &mut Vec<String>,
) -> Result<BTreeMap<String, BTreeMap<String, String>>, Error> {
    let cms: Api<ConfigMap> = Api::namespaced(client.clone(), namespace);
    let mut out = BTreeMap::new();
    for name in [
        DEVICE_PLUGIN_CONFIGMAP,
        MIG_PARTED_CONFIGMAP,
        DEFAULT_MIG_CONFIGMAP,
        VGPU_DEVICES_CONFIGMAP,
        DEFAULT_VGPU_CONFIGMAP,
        INSTANCE_TYPES_CONFIGMAP,
    ] {
        let got = match cms.get_opt(name).await {
            // The admin's table is optional to read (a viewer role from before it existed).
            Err(e) if name == INSTANCE_TYPES_CONFIGMAP && forbidden(&e) => {
                assumptions.push(format!(
                    "ConfigMap {INSTANCE_TYPES_CONFIGMAP} cannot be read: instance types are learnt from the nodes only"
                ));
                None
            }
            got => got.map_err(read("ConfigMaps"))?,
        };
        if let Some(data) = got.and_then(|c| c.data) {
            out.insert(name.to_string(), data);
        }
    }
    Ok(out)
}
