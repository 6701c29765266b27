//! The ClusterPolicy diff, pure: our part of its `spec` as dotted leaf fields
//! (`spec.mig.strategy`), and which of them differ from what the cluster holds. The applier
//! writes from it (and finds drift in it); `plan` shows it.

use std::collections::{BTreeMap, BTreeSet};

use serde_json::Value;

/// One ClusterPolicy field whose value in the cluster is not the wanted one. `None` is absent
/// (or null); `wanted: None` is a field we release (it keeps its value until someone else sets
/// it: a change only in ownership).
#[derive(Debug, Clone, PartialEq)]
pub struct FieldChange {
    /// Dotted path from the object's root (`spec.devicePlugin.config.name`).
    pub key: String,
    pub current: Option<Value>,
    pub wanted: Option<Value>,
}

fn leaves(prefix: &str, v: &Value, out: &mut BTreeMap<String, Value>) {
    match v.as_object() {
        Some(m) if !m.is_empty() => {
            for (k, x) in m {
                leaves(&format!("{prefix}.{k}"), x, out);
            }
        }
        // An empty object sets nothing: no field to own.
        Some(_) => {}
        None => {
            out.insert(prefix.to_string(), v.clone());
        }
    }
}

/// The leaf fields of a ClusterPolicy `spec` (the plan's part of it), keyed by dotted path
/// from the object's root (`spec.mig.strategy`).
pub fn fields(spec: &Value) -> BTreeMap<String, Value> {
    let mut out = BTreeMap::new();
    leaves("spec", spec, &mut out);
    out
}

/// The value at a dotted path from the object's root (`spec.mig.strategy`) in a ClusterPolicy
/// `spec`; absent or null: `None`.
pub fn value_at<'a>(spec: Option<&'a Value>, key: &str) -> Option<&'a Value> {
    key.split('.')
        .skip(1)
        .try_fold(spec?, |v, k| v.get(k))
        .filter(|v| !v.is_null())
}

/// The fields of `wanted` whose value in the cluster's `spec` differs, and, when given, the
/// fields of `released` (what we owned before) that `wanted` no longer sets and the cluster
/// still has. In path order.
pub fn changes(
    cluster: Option<&Value>,
    wanted: &Value,
    released: Option<&Value>,
) -> Vec<FieldChange> {
    let want = fields(wanted);
    let before = released.map(fields).unwrap_or_default();
    let keys: BTreeSet<&String> = want.keys().chain(before.keys()).collect();
    keys.into_iter()
        .filter_map(|key| {
            let current = value_at(cluster, key).cloned();
            let wanted = want.get(key).cloned();
            (current != wanted).then(|| FieldChange {
                key: key.clone(),
                current,
                wanted,
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn fields_are_dotted_leaves_and_an_empty_spec_has_none() {
        let spec = json!({"devicePlugin": {"config": {"name": "cm", "default": "default"}},
            "mig": {"strategy": "single"}, "sandboxWorkloads": {}});
        let f = fields(&spec);
        assert_eq!(
            f.keys().collect::<Vec<_>>(),
            [
                "spec.devicePlugin.config.default",
                "spec.devicePlugin.config.name",
                "spec.mig.strategy"
            ]
        );
        assert!(fields(&json!({})).is_empty());
    }

    #[test]
    fn only_differing_wanted_fields_and_released_fields_still_set_are_changes() {
        let cluster = json!({"mig": {"strategy": "single"}, "devicePlugin": {"config": {"name": "cm"}},
            "migManager": {"config": {"name": "ours"}}, "driver": {"enabled": true}});
        let wanted =
            json!({"mig": {"strategy": "none"}, "devicePlugin": {"config": {"name": "cm"}}});
        let before = json!({"mig": {"strategy": "single"}, "migManager": {"config": {"name": "ours"}},
            "vgpuDeviceManager": {"config": {"name": "gone"}}});
        let c = changes(Some(&cluster), &wanted, Some(&before));
        assert_eq!(
            c,
            [
                FieldChange {
                    key: "spec.mig.strategy".into(),
                    current: Some(json!("single")),
                    wanted: Some(json!("none")),
                },
                FieldChange {
                    key: "spec.migManager.config.name".into(),
                    current: Some(json!("ours")),
                    wanted: None,
                },
            ]
        );
        assert!(changes(Some(&cluster), &json!({}), Some(&json!({}))).is_empty());
        let none = changes(None, &wanted, None);
        assert_eq!(
            none.len(),
            2,
            "no ClusterPolicy spec: every wanted field differs"
        );
        assert!(none.iter().all(|c| c.current.is_none()));
    }

    #[test]
    fn null_is_absent() {
        let cluster = json!({"mig": {"strategy": null}});
        assert_eq!(value_at(Some(&cluster), "spec.mig.strategy"), None);
        assert_eq!(
            value_at(Some(&cluster), "spec.mig"),
            Some(&json!({"strategy": null}))
        );
    }
}
