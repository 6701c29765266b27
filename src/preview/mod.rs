//! `gpu-sharing-operator plan`: what applying policy files would change in a live cluster,
//! like `kubectl diff` / `terraform plan`. Read-only: one list or get per kind (get/list RBAC is
//! enough), then the pure planner on the cluster's state as it is and as the files want it.

pub mod diff;
pub mod print;
pub mod report;

use std::collections::BTreeMap;
use std::sync::Arc;

use k8s_openapi::api::core::v1::{ConfigMap, Namespace, Node, Pod};
use kube::api::{Api, DynamicObject, ListParams};
use kube::{Client, ResourceExt};

use crate::api::crd::GpuSharingPolicy;
use crate::api::names::{
    DEFAULT_MIG_CONFIGMAP, DEFAULT_VGPU_CONFIGMAP, DEVICE_PLUGIN_CONFIGMAP, MANAGER,
    MIG_PARTED_CONFIGMAP, VGPU_DEVICES_CONFIGMAP,
};
use crate::plan::{LabelFilter, PlanInput};
use crate::runtime::controller::{cluster_policy_resource, detect_namespace};
use crate::runtime::input::{mig_configs, read_gpu_pods, sandbox_of, vgpu_configs};
use crate::runtime::nodecache::{Interner, facts};
use crate::runtime::watches::RUNNING_BOUND_PODS;

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
    /// What could not be read (forbidden) and is therefore assumed: shown to the user.
    pub assumptions: Vec<String>,
}

fn read(what: &'static str) -> impl FnOnce(kube::Error) -> Error {
    move |source| Error::Read { what, source }
}

fn forbidden(e: &kube::Error) -> bool {
    matches!(e, kube::Error::Api(s) if s.code == 403 || s.code == 404)
}

/// Reads everything the planner needs. Nodes, policies, the ClusterPolicy and our ConfigMaps
/// are required; pods (the idle-GPU wait) and namespaces (DRA templates) are optional: without
/// the permission they are assumed (no GPU pods, every namespace exists) and said so.
pub async fn snapshot(client: &Client, namespace: Option<String>) -> Result<Snapshot, Error> {
    let namespace = match namespace {
        Some(n) => n,
        None => detect_namespace(client)
            .await
            .unwrap_or_else(|| "gpu-operator".into()),
    };
    let lp = ListParams::default();
    let mut strings = Interner::default();
    let nodes = Api::<Node>::all(client.clone())
        .list(&lp)
        .await
        .map_err(read("nodes"))?
        .items
        .into_iter()
        .map(|n| facts(n, MANAGER, &LabelFilter::everything(), &mut strings))
        .collect();
    let policies: Vec<GpuSharingPolicy> = Api::<GpuSharingPolicy>::all(client.clone())
        .list(&lp)
        .await
        .map_err(read("GpuSharingPolicies"))?
        .items;
    let cps: Api<DynamicObject> = Api::all_with(client.clone(), &cluster_policy_resource());
    let mut cps = match cps.list(&lp).await {
        Ok(l) => l.items,
        Err(e) if matches!(&e, kube::Error::Api(s) if s.code == 404) => vec![],
        Err(e) => return Err(read("ClusterPolicies")(e)),
    };
    cps.sort_by_key(|o| (o.metadata.creation_timestamp.clone(), o.name_any()));
    let cluster_policy = cps.into_iter().next();
    let cms: Api<ConfigMap> = Api::namespaced(client.clone(), &namespace);
    let mut cm = BTreeMap::new();
    for name in [
        DEVICE_PLUGIN_CONFIGMAP,
        MIG_PARTED_CONFIGMAP,
        DEFAULT_MIG_CONFIGMAP,
        VGPU_DEVICES_CONFIGMAP,
        DEFAULT_VGPU_CONFIGMAP,
    ] {
        let got = cms.get_opt(name).await.map_err(read("ConfigMaps"))?;
        cm.insert(name, got.map(Arc::new));
    }
    let mut assumptions = Vec::new();
    let running = ListParams::default().fields(RUNNING_BOUND_PODS);
    let pods = match Api::<Pod>::all(client.clone()).list(&running).await {
        Ok(l) => l.items,
        Err(e) if forbidden(&e) => {
            assumptions.push(
                "pods cannot be listed: no GPU is assumed busy (MIG changes may wait longer)"
                    .into(),
            );
            Vec::new()
        }
        Err(e) => return Err(read("pods")(e)),
    };
    let namespaces = match Api::<Namespace>::all(client.clone())
        .list_metadata(&lp)
        .await
    {
        Ok(l) => Some(l.items.iter().map(|n| n.name_any()).collect()),
        Err(e) if forbidden(&e) => {
            assumptions.push(
                "namespaces cannot be listed: every namespace a DRA policy lists is assumed to exist"
                    .into(),
            );
            None
        }
        Err(e) => return Err(read("namespaces")(e)),
    };
    let mut input = PlanInput::new(policies, nodes);
    input.current_device_config = cm[DEVICE_PLUGIN_CONFIGMAP]
        .as_ref()
        .and_then(|c| c.data.clone())
        .unwrap_or_default();
    input.base_mig_configs = mig_configs(cm[DEFAULT_MIG_CONFIGMAP].clone());
    input.current_mig_configs = mig_configs(cm[MIG_PARTED_CONFIGMAP].clone()).unwrap_or_default();
    if let Some(base) = vgpu_configs(cm[DEFAULT_VGPU_CONFIGMAP].clone()) {
        input.base_vgpu_configs = Arc::new(base);
    }
    input.current_vgpu_configs =
        vgpu_configs(cm[VGPU_DEVICES_CONFIGMAP].clone()).unwrap_or_default();
    input.sandbox = sandbox_of(cluster_policy.as_ref());
    read_gpu_pods(&mut input, pods.iter());
    input.namespaces = namespaces;
    input.cluster_policy_found = cluster_policy.is_some();
    input.now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64);
    Ok(Snapshot {
        input,
        cluster_policy_spec: cluster_policy.and_then(|c| c.data.get("spec").cloned()),
        namespace,
        assumptions,
    })
}
