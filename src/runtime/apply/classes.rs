//! Our DeviceClasses (policies with `dra.extendedResources`): applied when what we want differs
//! from what is there (the name they map, their selector, our label), deleted when no policy
//! renders them any more. Ours are the classes with our managed-by label.

use std::collections::BTreeMap;
use std::sync::Arc;

use k8s_openapi::api::resource::v1::DeviceClass;
use kube::ResourceExt;
use kube::api::{Api, Patch};
use tracing::info;

use super::claims::json_contains;
use super::{WriteReport, apply_params};
use crate::observe::classes::is_ours;
use crate::plan::Plan;
use crate::runtime::context::Context;
use crate::runtime::error::Error;

/// The kind our DeviceClasses' refused writes are remembered under.
pub const KIND: &str = "DeviceClass";

/// Applies the plan's DeviceClasses (but those whose refused write waits its retry, `waits`)
/// and deletes ours it no longer has. Nothing when DeviceClasses cannot be read. A class the API
/// server keeps without `extendedResourceName` (its `DRAExtendedResource` feature gate is off)
/// is a refused write: retried after a wait, not at every pass.
pub async fn apply_device_classes(
    ctx: &Context,
    plan: &Plan,
    waits: impl Fn(&str) -> bool,
    report: &mut WriteReport,
) -> Result<(), Error> {
    let Some(store) = &ctx.caches.device_classes else {
        return Ok(());
    };
    let ours: BTreeMap<String, Arc<DeviceClass>> = store
        .state()
        .into_iter()
        .filter(|c| is_ours(c))
        .map(|c| (c.name_any(), c))
        .collect();
    let api: Api<DeviceClass> = Api::all(ctx.client.clone());
    for (name, want) in &plan.device_classes {
        let same = ours.get(name).is_some_and(|cur| {
            let spec = serde_json::to_value(&cur.spec).unwrap_or_default();
            json_contains(&spec, &want["spec"])
        });
        if same {
            report.learn(super::Learnt::InSync {
                kind: KIND,
                object: name.clone(),
            });
            continue;
        }
        if waits(name) {
            continue;
        }
        let applied = match api.patch(name, &apply_params(), &Patch::Apply(want)).await {
            Ok(c) => c,
            Err(e) => {
                report.refused(KIND, name, e.into())?;
                continue;
            }
        };
        if applied.spec.extended_resource_name.is_none() {
            let why = format!(
                "kube-apiserver dropped spec.extendedResourceName ({}): its DRAExtendedResource feature gate is off (alpha and off in Kubernetes 1.34 and 1.35)",
                want["spec"]["extendedResourceName"]
                    .as_str()
                    .unwrap_or_default()
            );
            tracing::warn!(device_class = %name, why = %why, "the API server dropped a field of our DeviceClass");
            report.learn(super::Learnt::WriteRefused {
                kind: KIND,
                object: name.clone(),
                why,
            });
        }
        let why = if ours.contains_key(name) {
            "its selector or name changed"
        } else {
            "a policy serves pods' extended-resource requests through the DRA driver"
        };
        info!(device_class = %name, reason = why, "applied DeviceClass");
        report.record(KIND, name.clone(), why);
    }
    for name in ours
        .keys()
        .filter(|n| !plan.device_classes.contains_key(*n))
    {
        match api.delete(name, &Default::default()).await {
            Ok(_) => {}
            Err(kube::Error::Api(e)) if e.code == 404 => {}
            Err(e) => {
                report.refused(KIND, name, e.into())?;
                continue;
            }
        }
        let why = "no policy serves extended resources through it any more";
        info!(device_class = %name, reason = why, "deleted DeviceClass");
        report.record(KIND, name.clone(), why);
    }
    Ok(())
}
