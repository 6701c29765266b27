//! `gpu-sharing-operator cleanup`: what an uninstall runs before the operator goes (the Helm
//! chart's pre-delete hook). Deletes every GpuSharingPolicy and waits until the running operator
//! has released their nodes and removed its finalizer, so no policy is left stuck on a finalizer
//! nobody will remove and no node keeps a label naming a config that is gone.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use kube::api::{Api, DeleteParams, DynamicObject, ListParams};
use kube::{Client, ResourceExt};
use tracing::info;

use crate::api::crd::GpuSharingPolicy;
use crate::api::names::{FINALIZER, LABEL_DEPLOY_DRA_DRIVER, LABEL_POLICY, MANAGED_BY, MANAGER};
use crate::observe::managed::{owned_keys, owned_leaf_paths};
use crate::runtime::resources::cluster_policy_resource;

/// Why a cleanup did not finish.
#[derive(Debug, thiserror::Error)]
pub enum CleanupError {
    #[error("kubernetes API: {0}")]
    Kube(#[from] kube::Error),
    #[error(
        "timed out after {timeout:?}: still present: {remaining}. Is the operator running? \
         (`kubectl get pods -l app.kubernetes.io/name=gpu-sharing-operator -A`) It removes its \
         finalizer only once it has released a policy's nodes."
    )]
    Timeout {
        timeout: Duration,
        remaining: String,
    },
}

/// What is left to wait for.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Remaining {
    /// Policies still present (on our finalizer).
    pub policies: BTreeSet<String>,
    /// Nodes still labelled with a policy, or with our DRA kubelet plugin's switch.
    pub nodes: BTreeSet<String>,
    /// ClusterPolicy fields the operator still owns (`<clusterpolicy>:spec.devicePlugin.config.name`).
    pub cluster_policy_fields: BTreeSet<String>,
    /// Our DeviceClasses (extended resources), deleted by the pass after the last policy goes.
    pub device_classes: BTreeSet<String>,
}

impl Remaining {
    pub fn is_empty(&self) -> bool {
        self.policies.is_empty()
            && self.nodes.is_empty()
            && self.cluster_policy_fields.is_empty()
            && self.device_classes.is_empty()
    }
}

impl std::fmt::Display for Remaining {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let list = |s: &BTreeSet<String>| s.iter().cloned().collect::<Vec<_>>().join(", ");
        write!(
            f,
            "{} policies [{}], {} nodes labelled {LABEL_POLICY} or with our DRA switch [{}], ClusterPolicy fields [{}], DeviceClasses [{}]",
            self.policies.len(),
            list(&self.policies),
            self.nodes.len(),
            list(&self.nodes),
            list(&self.cluster_policy_fields),
            list(&self.device_classes)
        )
    }
}

async fn remaining(client: &Client) -> Result<Remaining, kube::Error> {
    let policies: Api<GpuSharingPolicy> = Api::all(client.clone());
    let nodes: Api<k8s_openapi::api::core::v1::Node> = Api::all(client.clone());
    let policies = policies
        .list_metadata(&ListParams::default())
        .await?
        .items
        .iter()
        .map(|p| p.name_any())
        .collect();
    // Released nodes keep our DRA kubelet plugin's switch while its claims remain: it is ours to
    // hand back too. (A device plugin we switched off stays off while someone else's DRA driver
    // serves the node: that is the node's state without us, not ours to wait for.)
    let switches = [LABEL_DEPLOY_DRA_DRIVER];
    let nodes = nodes
        .list_metadata(&ListParams::default())
        .await?
        .items
        .iter()
        .filter(|n| {
            let entries = n.metadata.managed_fields.as_deref().unwrap_or_default();
            n.labels().contains_key(LABEL_POLICY)
                || owned_keys(entries, MANAGER, &["f:metadata", "f:labels"])
                    .any(|k| switches.contains(&k))
        })
        .map(|n| n.name_any())
        .collect();
    // The ClusterPolicy fields we set (device plugin / MIG manager / vGPU Device Manager config,
    // sandbox workloads) are withdrawn by the operator's pass after the last policy goes. No
    // ClusterPolicy kind (no GPU Operator): nothing to wait for.
    let cps: Api<DynamicObject> = Api::all_with(client.clone(), &cluster_policy_resource());
    let mut cluster_policy_fields = BTreeSet::new();
    match cps.list_metadata(&ListParams::default()).await {
        Ok(list) => {
            for cp in list.items {
                let entries = cp.metadata.managed_fields.as_deref().unwrap_or_default();
                // An emptied `f:spec: {}` entry owns nothing.
                let owned = owned_leaf_paths(entries, MANAGER, "spec");
                for f in owned.into_iter().filter(|f| f.starts_with("spec.")) {
                    cluster_policy_fields.insert(format!("{}:{f}", cp.name_any()));
                }
            }
        }
        Err(kube::Error::Api(e)) if e.code == 404 => {}
        Err(e) => return Err(e),
    }
    // Our DeviceClasses; none to wait for where resource.k8s.io/v1 is not served.
    let classes: Api<k8s_openapi::api::resource::v1::DeviceClass> = Api::all(client.clone());
    let selector = format!("{}={}", MANAGED_BY.0, MANAGED_BY.1);
    let device_classes = match classes
        .list_metadata(&ListParams::default().labels(&selector))
        .await
    {
        Ok(l) => l.items.iter().map(|c| c.name_any()).collect(),
        Err(kube::Error::Api(e)) if e.code == 404 || e.code == 403 => BTreeSet::new(),
        Err(e) => return Err(e),
    };
    Ok(Remaining {
        policies,
        nodes,
        cluster_policy_fields,
        device_classes,
    })
}

/// Deletes every policy and waits, up to `timeout`, until none is left, no node carries a
/// policy label and the operator owns no ClusterPolicy field. Policies without our finalizer
/// (the operator never saw them) go at once.
pub async fn run(client: Client, timeout: Duration) -> Result<(), CleanupError> {
    let api: Api<GpuSharingPolicy> = Api::all(client.clone());
    let start = Instant::now();
    for p in api.list_metadata(&ListParams::default()).await?.items {
        let name = p.name_any();
        if p.metadata.deletion_timestamp.is_none() {
            let held = p.finalizers().iter().any(|f| f == FINALIZER);
            info!(policy = %name, finalizer = held, "deleting");
            match api.delete(&name, &DeleteParams::default()).await {
                Ok(_) => {}
                Err(kube::Error::Api(e)) if e.code == 404 => {}
                Err(e) => return Err(e.into()),
            }
        }
    }
    let mut last = String::new();
    loop {
        let left = remaining(&client).await?;
        if left.is_empty() {
            info!(took = ?start.elapsed(), "every policy deleted and every node released");
            return Ok(());
        }
        let now = left.to_string();
        if now != last {
            info!(remaining = %now, "waiting for the operator to release nodes");
            last = now;
        }
        if start.elapsed() >= timeout {
            return Err(CleanupError::Timeout {
                timeout,
                remaining: last,
            });
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}
