//! ResourceQuotas -> which of the names a GPU request is counted under each one limits:
//! `requests.<extended resource>` (a pod's request, whichever backend serves it) and
//! `<class>.deviceclass.resource.k8s.io/devices` (the devices of a DeviceClass's claims, the
//! generated claims of DRA extended resources included). KEP-5004 asks quotas to cover both.

use std::collections::BTreeSet;

use k8s_openapi::api::core::v1::ResourceQuota;
use kube::ResourceExt;

use crate::api::names::DEVICE_CLASS_QUOTA_SUFFIX;
use crate::plan::input::QuotaFact;

/// The most hard limits a quota keeps (only NVIDIA's and device classes' count; an admin's
/// quota lists a handful).
const MAX_KEYS: usize = 32;

/// Whether a quota key is one of a GPU request's: NVIDIA's extended resources or a device
/// class's device count.
fn relevant(key: &str) -> bool {
    key.starts_with("requests.nvidia.com/") || key.ends_with(DEVICE_CLASS_QUOTA_SUFFIX)
}

/// A ResourceQuota as the cache keeps it: name, namespace, the relevant hard limits' keys.
pub fn strip(q: &mut ResourceQuota) {
    q.metadata.managed_fields = None;
    q.metadata.annotations = None;
    q.metadata.labels = None;
    q.status = None;
    if let Some(spec) = q.spec.as_mut() {
        spec.scopes = None;
        spec.scope_selector = None;
        if let Some(hard) = spec.hard.as_mut() {
            hard.retain(|k, _| relevant(k));
            while hard.len() > MAX_KEYS {
                hard.pop_last();
            }
        }
    }
}

/// The quotas that limit any relevant key, by namespace and name.
pub fn facts<'a>(quotas: impl IntoIterator<Item = &'a ResourceQuota>) -> Vec<QuotaFact> {
    let mut out: Vec<QuotaFact> = quotas
        .into_iter()
        .filter_map(|q| {
            let hard: BTreeSet<String> = (q.spec.as_ref()?.hard.as_ref()?.keys())
                .filter(|k| relevant(k))
                .take(MAX_KEYS)
                .cloned()
                .collect();
            (!hard.is_empty()).then(|| QuotaFact {
                namespace: q.namespace().unwrap_or_default(),
                name: q.name_any(),
                hard,
            })
        })
        .collect();
    out.sort_by(|a, b| (&a.namespace, &a.name).cmp(&(&b.namespace, &b.name)));
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn quota(ns: &str, name: &str, hard: &[&str]) -> ResourceQuota {
        let hard: serde_json::Map<String, serde_json::Value> =
            hard.iter().map(|k| (k.to_string(), json!("4"))).collect();
        serde_json::from_value(json!({"metadata": {"name": name, "namespace": ns,
            "annotations": {"a": "b"}}, "spec": {"hard": hard}}))
        .unwrap()
    }

    #[test]
    fn the_reader_reads_the_same_from_stripped_quotas_and_keeps_only_gpu_keys() {
        let all = vec![
            quota(
                "b",
                "q",
                &["requests.nvidia.com/gpu", "requests.cpu", "pods"],
            ),
            quota(
                "a",
                "q",
                &["gpusharing-nvidia.com-gpu.deviceclass.resource.k8s.io/devices"],
            ),
            quota("c", "cpu-only", &["requests.cpu"]),
        ];
        let mut stripped = all.clone();
        stripped.iter_mut().for_each(strip);
        assert_eq!(facts(&stripped), facts(&all));
        let read = facts(&all);
        let seen: Vec<(&str, Vec<&str>)> = (read.iter())
            .map(|q| {
                (
                    q.namespace.as_str(),
                    q.hard.iter().map(String::as_str).collect(),
                )
            })
            .collect();
        assert_eq!(
            seen,
            [
                (
                    "a",
                    vec!["gpusharing-nvidia.com-gpu.deviceclass.resource.k8s.io/devices"]
                ),
                ("b", vec!["requests.nvidia.com/gpu"]),
            ]
        );
    }
}
