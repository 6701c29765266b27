//! What our field manager owns on an object, read from its `managedFields` (server-side apply).
//! One reader for every object: node labels and annotations, ClusterPolicy spec fields.

use std::collections::BTreeSet;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::ManagedFieldsEntry;

/// The `fieldsV1` subtrees at `path` (e.g. `["f:metadata", "f:labels"]`) of `manager`'s apply
/// entries.
fn subtrees<'a>(
    entries: &'a [ManagedFieldsEntry],
    manager: &'a str,
    path: &'a [&'a str],
) -> impl Iterator<Item = &'a serde_json::Value> + 'a {
    entries
        .iter()
        .filter(move |e| {
            e.manager.as_deref() == Some(manager) && e.operation.as_deref() == Some("Apply")
        })
        .filter_map(move |e| {
            let root = &e.fields_v1.as_ref()?.0;
            path.iter().try_fold(root, |v, k| v.get(*k))
        })
}

/// The keys `manager` owns directly under `path` (label or annotation names, without `f:`).
pub fn owned_keys<'a>(
    entries: &'a [ManagedFieldsEntry],
    manager: &'a str,
    path: &'a [&'a str],
) -> impl Iterator<Item = &'a str> + 'a {
    subtrees(entries, manager, path)
        .filter_map(|v| v.as_object())
        .flat_map(|m| m.keys())
        .filter_map(|k| k.strip_prefix("f:"))
}

/// The leaf paths `manager` owns under `f:<root>`, dotted (`spec.devicePlugin.config.name`).
/// Only for objects whose field names contain no dots (not labels).
pub fn owned_leaf_paths(
    entries: &[ManagedFieldsEntry],
    manager: &str,
    root: &str,
) -> BTreeSet<String> {
    fn walk(v: &serde_json::Value, prefix: &str, out: &mut BTreeSet<String>) {
        match v.as_object() {
            Some(m) if !m.is_empty() => {
                for (k, c) in m {
                    if let Some(name) = k.strip_prefix("f:") {
                        walk(c, &format!("{prefix}.{name}"), out);
                    }
                }
            }
            _ => {
                out.insert(prefix.to_string());
            }
        }
    }
    let key = format!("f:{root}");
    let mut out = BTreeSet::new();
    for v in subtrees(entries, manager, &[key.as_str()]) {
        walk(v, root, &mut out);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::FieldsV1;

    fn entry(manager: &str, operation: &str, fields: serde_json::Value) -> ManagedFieldsEntry {
        ManagedFieldsEntry {
            manager: Some(manager.into()),
            operation: Some(operation.into()),
            fields_v1: Some(FieldsV1(fields)),
            ..Default::default()
        }
    }

    #[test]
    fn only_our_apply_entries_count() {
        let entries = [
            entry(
                "us",
                "Apply",
                serde_json::json!({"f:metadata": {"f:labels": {"f:nvidia.com/mig.config": {}}, "f:annotations": {"f:a": {}}},
                    "f:spec": {"f:devicePlugin": {"f:config": {"f:name": {}, "f:default": {}}}}}),
            ),
            entry(
                "us",
                "Update",
                serde_json::json!({"f:metadata": {"f:labels": {"f:x": {}}}}),
            ),
            entry(
                "them",
                "Apply",
                serde_json::json!({"f:metadata": {"f:labels": {"f:y": {}}}}),
            ),
        ];
        let labels: BTreeSet<&str> =
            owned_keys(&entries, "us", &["f:metadata", "f:labels"]).collect();
        assert_eq!(labels, ["nvidia.com/mig.config"].into());
        let annotations: BTreeSet<&str> =
            owned_keys(&entries, "us", &["f:metadata", "f:annotations"]).collect();
        assert_eq!(annotations, ["a"].into());
        assert_eq!(
            owned_leaf_paths(&entries, "us", "spec"),
            [
                "spec.devicePlugin.config.default".to_string(),
                "spec.devicePlugin.config.name".to_string()
            ]
            .into()
        );
    }
}
