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

/// Whether a key names what a policy of ours serves (kept first when a quota lists too many).
fn ours(key: &str) -> bool {
    key.starts_with("requests.nvidia.com/gpu") || key.starts_with("gpusharing-")
}

/// A quota with scopes limits only some pods (by priority class, say): it does not cover the
/// namespace's GPU requests as a whole.
fn scoped(q: &ResourceQuota) -> bool {
    q.spec.as_ref().is_some_and(|s| {
        s.scopes.as_ref().is_some_and(|v| !v.is_empty()) || s.scope_selector.is_some()
    })
}

/// A ResourceQuota as the cache keeps it: name, namespace, whether it has scopes, and the
/// relevant hard limits' keys (at most [`MAX_KEYS`], ours first).
pub fn strip(q: &mut ResourceQuota) {
    let was_scoped = scoped(q);
    q.metadata.managed_fields = None;
    q.metadata.annotations = None;
    q.metadata.labels = None;
    q.status = None;
    if let Some(spec) = q.spec.as_mut() {
        spec.scopes = was_scoped.then(|| vec!["Scoped".to_string()]);
        spec.scope_selector = None;
        if let Some(hard) = spec.hard.as_mut() {
            let (first, rest): (Vec<_>, Vec<_>) = std::mem::take(hard)
                .into_iter()
                .filter(|(k, _)| relevant(k))
                .partition(|(k, _)| ours(k));
            *hard = first.into_iter().chain(rest).take(MAX_KEYS).collect();
        }
    }
}

/// The unscoped quotas that limit any relevant key, by namespace and name.
pub fn facts<'a>(quotas: impl IntoIterator<Item = &'a ResourceQuota>) -> Vec<QuotaFact> {
    let mut out: Vec<QuotaFact> = quotas
        .into_iter()
        .filter(|q| !scoped(q))
        .filter_map(|q| {
            let keys = q.spec.as_ref()?.hard.as_ref()?.keys();
            let (first, rest): (Vec<&String>, Vec<&String>) =
                keys.filter(|k| relevant(k)).partition(|k| ours(k));
            let hard: BTreeSet<String> = first
                .into_iter()
                .chain(rest)
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

    fn scoped_quota(ns: &str, name: &str, hard: &[&str]) -> ResourceQuota {
        let mut q = quota(ns, name, hard);
        q.spec.as_mut().unwrap().scopes = Some(vec!["PriorityClass".into()]);
        q
    }

    /// Past the bound, the keys a policy of ours serves are kept first.
    #[test]
    fn a_quota_listing_too_many_keys_keeps_ours() {
        let mut keys: Vec<String> = (0..40)
            .map(|i| format!("requests.nvidia.com/a{i:02}"))
            .collect();
        keys.push("requests.nvidia.com/gpu".into());
        let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
        let mut q = quota("a", "many", &refs);
        let read = facts([&q]);
        strip(&mut q);
        assert_eq!(facts([&q]), read);
        assert_eq!(read[0].hard.len(), MAX_KEYS);
        assert!(read[0].hard.contains("requests.nvidia.com/gpu"));
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
            scoped_quota("d", "high-priority", &["requests.nvidia.com/gpu"]),
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
