//! Objects on a test cluster: server-side apply of YAML (any kind, through discovery), CRDs
//! waited for, the one node-label setter, the GPU Operator's ClusterPolicy API.

use std::path::Path;
use std::time::Duration;

use anyhow::{Context as _, anyhow};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, DynamicObject, Patch, PatchParams};
use kube::core::GroupVersionKind;
use kube::discovery::{self, Scope};
use kube::{Client, ResourceExt};

use crate::poll::wait_for;

/// Field manager the helpers use for server-side apply.
pub const TEST_FIELD_MANAGER: &str = "gpu-sharing-tests";

/// Waits until the CRD `name` (e.g. `gpusharingpolicies.gpusharing.io`) is
/// Established, i.e. its API is served.
pub async fn wait_crd_established(
    client: &Client,
    name: &str,
    timeout: Duration,
) -> anyhow::Result<()> {
    let api: Api<CustomResourceDefinition> = Api::all(client.clone());
    let ok = wait_for(timeout, || {
        let api = api.clone();
        async move {
            match api.get_opt(name).await {
                Ok(Some(crd)) => crd
                    .status
                    .and_then(|s| s.conditions)
                    .unwrap_or_default()
                    .iter()
                    .any(|c| c.type_ == "Established" && c.status == "True"),
                _ => false,
            }
        }
    })
    .await;
    if ok {
        Ok(())
    } else {
        Err(anyhow!("CRD {name} not Established within {timeout:?}"))
    }
}

/// Splits multi-document YAML into JSON values, skipping empty documents.
pub fn parse_yaml_documents(yaml: &str) -> anyhow::Result<Vec<serde_json::Value>> {
    let mut out = Vec::new();
    for v in gpu_sharing_operator::api::yaml::documents::<serde_json::Value>(yaml)? {
        match &v {
            serde_json::Value::Null => continue,
            serde_json::Value::Object(m) if m.is_empty() => continue,
            _ => out.push(v),
        }
    }
    Ok(out)
}

/// Server-side applies every document of a multi-document YAML (any kind,
/// resolved through discovery). Namespaced objects without a namespace go to
/// `default`. A `status` in a document is applied through the status
/// subresource too. CRDs are waited for until Established, so custom
/// resources may follow in the same YAML. Returns the applied objects.
pub async fn apply_yaml(client: &Client, yaml: &str) -> anyhow::Result<Vec<DynamicObject>> {
    apply_yaml_in(client, None, yaml).await
}

/// Like [`apply_yaml`], putting namespaced objects into `namespace` (if
/// given) whatever their manifest says.
pub async fn apply_yaml_in(
    client: &Client,
    namespace: Option<&str>,
    yaml: &str,
) -> anyhow::Result<Vec<DynamicObject>> {
    let mut applied = Vec::new();
    for doc in parse_yaml_documents(yaml)? {
        let mut obj: DynamicObject =
            serde_json::from_value(doc).context("not a Kubernetes object")?;
        let types = obj
            .types
            .clone()
            .ok_or_else(|| anyhow!("object without apiVersion/kind"))?;
        let gvk = GroupVersionKind::try_from(&types)?;
        let name = obj.name_any();
        // A CRD can be Established a moment before its group is in discovery: retry briefly.
        let mut tries = 0;
        let (ar, caps) = loop {
            match discovery::pinned_kind(client, &gvk).await {
                Ok(found) => break found,
                Err(_) if tries < 50 => {
                    tries += 1;
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                Err(e) => {
                    return Err(e).with_context(|| {
                        format!("discovering {}/{}", types.api_version, types.kind)
                    });
                }
            }
        };
        let api: Api<DynamicObject> = match caps.scope {
            Scope::Cluster => {
                obj.metadata.namespace = None;
                Api::all_with(client.clone(), &ar)
            }
            Scope::Namespaced => {
                let ns = namespace
                    .map(str::to_string)
                    .or_else(|| obj.metadata.namespace.clone())
                    .unwrap_or_else(|| "default".into());
                obj.metadata.namespace = Some(ns.clone());
                Api::namespaced_with(client.clone(), &ns, &ar)
            }
        };
        let pp = PatchParams::apply(TEST_FIELD_MANAGER).force();
        let status = obj.data.as_object_mut().and_then(|m| m.remove("status"));
        let mut result = api
            .patch(&name, &pp, &Patch::Apply(&obj))
            .await
            .with_context(|| format!("applying {} {name}", types.kind))?;
        if let Some(status) = status
            && types.kind != "CustomResourceDefinition"
            && caps
                .subresources
                .iter()
                .any(|(sr, _)| sr.plural == "status")
        {
            let body = serde_json::json!({
                "apiVersion": types.api_version,
                "kind": types.kind,
                "metadata": {"name": name},
                "status": status,
            });
            result = api
                .patch_status(&name, &pp, &Patch::Apply(&body))
                .await
                .with_context(|| format!("applying status of {} {name}", types.kind))?;
        }
        if types.kind == "CustomResourceDefinition" {
            wait_crd_established(client, &name, Duration::from_secs(30)).await?;
        }
        applied.push(result);
    }
    Ok(applied)
}

/// [`apply_yaml`] for a file, or for every `*.yaml`/`*.yml` file of a
/// directory in name order.
pub async fn apply_path(client: &Client, path: &Path) -> anyhow::Result<Vec<DynamicObject>> {
    let mut files = Vec::new();
    if path.is_dir() {
        for e in std::fs::read_dir(path)? {
            let p = e?.path();
            if matches!(p.extension().and_then(|x| x.to_str()), Some("yaml" | "yml")) {
                files.push(p);
            }
        }
        files.sort();
    } else {
        files.push(path.to_path_buf());
    }
    let mut out = Vec::new();
    for f in files {
        let yaml = std::fs::read_to_string(&f).with_context(|| format!("read {}", f.display()))?;
        out.extend(
            apply_yaml(client, &yaml)
                .await
                .with_context(|| format!("applying {}", f.display()))?,
        );
    }
    Ok(out)
}

/// Sets (`Some`) or removes (`None`) labels on a node with a merge patch, as
/// an admin or GPU Feature Discovery would.
pub async fn set_node_labels(
    client: &Client,
    node: &str,
    labels: &[(&str, Option<&str>)],
) -> anyhow::Result<()> {
    let map: serde_json::Map<String, serde_json::Value> = labels
        .iter()
        .map(|(k, v)| {
            (
                k.to_string(),
                v.map_or(serde_json::Value::Null, |v| v.into()),
            )
        })
        .collect();
    let api: Api<k8s_openapi::api::core::v1::Node> = Api::all(client.clone());
    api.patch(
        node,
        &PatchParams::default(),
        &Patch::Merge(serde_json::json!({"metadata": {"labels": map}})),
    )
    .await
    .with_context(|| format!("labelling node {node}"))?;
    Ok(())
}

/// The GPU Operator's ClusterPolicy API (`nvidia.com/v1`, cluster-scoped).
pub fn cluster_policy_api(client: &Client) -> Api<DynamicObject> {
    let ar = kube::api::ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("nvidia.com", "v1", "ClusterPolicy"),
        "clusterpolicies",
    );
    Api::all_with(client.clone(), &ar)
}

/// A bound token of ServiceAccount `namespace/name` from the TokenRequest API (one hour).
pub async fn service_account_token(
    client: &Client,
    namespace: &str,
    name: &str,
) -> anyhow::Result<String> {
    use k8s_openapi::api::authentication::v1::{TokenRequest, TokenRequestSpec};
    use k8s_openapi::api::core::v1::ServiceAccount;
    let sas: Api<ServiceAccount> = Api::namespaced(client.clone(), namespace);
    let tr = TokenRequest {
        spec: TokenRequestSpec {
            audiences: vec![],
            expiration_seconds: Some(3600),
            ..Default::default()
        },
        ..Default::default()
    };
    let made = sas
        .create_token_request(name, &kube::api::PostParams::default(), &tr)
        .await?;
    Ok(made
        .status
        .ok_or_else(|| anyhow::anyhow!("TokenRequest for {namespace}/{name}: no status"))?
        .token)
}
