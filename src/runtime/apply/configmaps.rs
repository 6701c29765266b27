//! Our ConfigMaps in the GPU Operator's namespace (device-plugin config, custom MIG and vGPU
//! layouts): applied before anything points to them, deleted only once nothing does.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::ConfigMap;
use kube::ResourceExt;
use kube::api::{Api, Patch};
use tracing::info;

use super::{Learnt, WriteReport, apply_params};
use crate::api::names::*;
use crate::nvidia::MIG_PARTED_KEY;
use crate::plan::{self, Plan};
use crate::runtime::cluster_policy_diff::value_at;
use crate::runtime::context::Context;
use crate::runtime::error::Error;

/// Applies a ConfigMap when its data or our labels differ from the cache.
async fn apply_configmap(
    ctx: &Context,
    name: &str,
    kind: &str,
    data: &BTreeMap<String, String>,
    why: &str,
    report: &mut WriteReport,
) -> Result<(), Error> {
    let current = ctx.configmap(name);
    let same = current.as_ref().is_some_and(|c| {
        let cur: BTreeMap<String, String> =
            c.data.clone().unwrap_or_default().into_iter().collect();
        let labels = c.labels();
        cur == *data
            && labels.get(MANAGED_BY.0).map(String::as_str) == Some(MANAGED_BY.1)
            && labels.get(CONFIG_LABEL).map(String::as_str) == Some(kind)
    });
    if same {
        return Ok(());
    }
    let obj = plan::configmap(name, &ctx.namespace, kind, data);
    let api: Api<ConfigMap> = Api::namespaced(ctx.client.clone(), &ctx.namespace);
    match api.patch(name, &apply_params(), &Patch::Apply(&obj)).await {
        Ok(_) => report.learn(Learnt::NamespaceFound),
        Err(kube::Error::Api(e)) if e.code == 404 => {
            report.learn(Learnt::NamespaceMissing(ctx.namespace.clone()));
            return Err(Error::NamespaceMissing(ctx.namespace.clone()));
        }
        Err(e) => return Err(e.into()),
    }
    let id = format!("{}/{name}", ctx.namespace);
    info!(configmap = %id, keys = data.len(), reason = why, "applied ConfigMap");
    report.record("ConfigMap", id, why);
    Ok(())
}

/// Our ConfigMaps, before anything points to what they hold. With no policy and no ConfigMap
/// yet there is nothing to write.
pub async fn apply_configmaps(
    ctx: &Context,
    plan: &Plan,
    has_policies: bool,
    report: &mut WriteReport,
) -> Result<(), Error> {
    if has_policies || ctx.configmap(&ctx.config.device_configmap).is_some() {
        let name = &ctx.config.device_configmap;
        let why = "policies changed";
        apply_configmap(ctx, name, "device-plugin", &plan.device_config, why, report).await?;
    }
    if let Some(m) = &plan.mig_config {
        let mut data = BTreeMap::new();
        data.insert(MIG_PARTED_KEY.to_string(), m.clone());
        let why = "custom MIG layouts changed";
        apply_configmap(
            ctx,
            &ctx.config.mig_configmap,
            "mig-parted",
            &data,
            why,
            report,
        )
        .await?;
    }
    if let Some(v) = &plan.vgpu_config {
        let mut data = BTreeMap::new();
        data.insert(crate::nvidia::vgpu::VGPU_KEY.to_string(), v.clone());
        let why = "custom vGPU layouts changed";
        let name = &ctx.config.vgpu_configmap;
        apply_configmap(ctx, name, "vgpu-devices", &data, why, report).await?;
    }
    Ok(())
}

/// The vGPU-devices ConfigMap goes only once nothing points to it.
pub async fn delete_unused_vgpu_configmap(
    ctx: &Context,
    plan: &Plan,
    report: &mut WriteReport,
) -> Result<(), Error> {
    if plan.vgpu_config.is_some() {
        return Ok(());
    }
    let name = &ctx.config.vgpu_configmap;
    let exists = ctx.configmap(name).is_some();
    let referenced = ctx.active_cluster_policy().is_some_and(|cp| {
        value_at(cp.data.get("spec"), "spec.vgpuDeviceManager.config.name").and_then(|v| v.as_str())
            == Some(name.as_str())
    });
    if exists && !referenced {
        let api: Api<ConfigMap> = Api::namespaced(ctx.client.clone(), &ctx.namespace);
        api.delete(name, &Default::default()).await?;
        let why = "no custom vGPU layout left";
        info!(configmap = %name, reason = why, "deleted vGPU-devices ConfigMap");
        report.record("ConfigMap", format!("{}/{name}", ctx.namespace), why);
    }
    Ok(())
}

/// The mig-parted ConfigMap goes only once nothing points to it.
pub async fn delete_unused_mig_configmap(
    ctx: &Context,
    plan: &Plan,
    report: &mut WriteReport,
) -> Result<(), Error> {
    if plan.mig_config.is_some() {
        return Ok(());
    }
    let name = &ctx.config.mig_configmap;
    let exists = ctx.configmap(name).is_some();
    let referenced = ctx.active_cluster_policy().is_some_and(|cp| {
        value_at(cp.data.get("spec"), "spec.migManager.config.name").and_then(|v| v.as_str())
            == Some(name.as_str())
    });
    if exists && !referenced {
        let api: Api<ConfigMap> = Api::namespaced(ctx.client.clone(), &ctx.namespace);
        api.delete(name, &Default::default()).await?;
        let why = "no custom layout left";
        info!(configmap = %name, reason = why, "deleted mig-parted ConfigMap");
        report.record("ConfigMap", format!("{}/{name}", ctx.namespace), why);
    }
    Ok(())
}
