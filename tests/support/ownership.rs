//! "Nothing we do not own changed", judged from the API server's own records (test code, not
//! the operator's logic). Every write carries its field manager; the API server keeps, per
//! object, which manager set which fields (`metadata.managedFields`, with the time of its last
//! write). For every observed state of a Node, a ConfigMap or the ClusterPolicy:
//!
//! - the fields our manager (`gpu-sharing-operator`, by server-side apply or any other
//!   operation) holds must all be ours: on a node the labels and annotations in
//!   the reviewed list of [`super::allowed`] (written there literally, not taken from the
//!   operator's constants), its taints (the readiness taint) and `spec.unschedulable`;
//!   ConfigMaps only those labelled as ours; in the ClusterPolicy only the settings that point
//!   NVIDIA's components at our configs;
//! - a change made by our manager (its entry has a new time, or holds a new field, between two
//!   consecutive states of the object) changed nothing else: every changed field outside `status` must be one of ours.
//!   A write that removes a field it never owned (a JSON patch, an update) shows up here.
//!   Taints are one atomic list: only taints under `gpusharing.io/` may differ.
//!
//! Known limit: a write of ours that leaves our manager owning no field at all (removing the
//! last taint of a node, say) leaves no `managedFields` entry, so it cannot be attributed.

use std::collections::BTreeMap;

use serde_json::Value;

use super::allowed::{
    CLUSTER_POLICY_FIELDS, CONFIGMAP_OWNER_LABEL as MANAGED_BY, DEMAND_FIELD_MANAGER as DEMAND,
    DEMAND_NODE_ANNOTATION, FIELD_MANAGER as MANAGER, NODE_ANNOTATIONS, NODE_LABELS,
    NODE_SPEC_FIELDS, TAINT_PREFIX as OUR_TAINTS,
};

/// The kinds the watcher judges.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Node,
    ConfigMap,
    ClusterPolicy,
    /// Pods: the operator writes nothing on them (it only asks for evictions).
    Pod,
    /// ResourceClaims: the operator writes nothing on them either.
    ResourceClaim,
}

/// Leaf paths of a `fieldsV1` set (`metadata.labels.nvidia.com/mig.config`). A list entry
/// (`k:`, `v:`, `i:`) ends the path at its list.
fn owned_leaves(v: &Value, prefix: &str, out: &mut Vec<String>) {
    let Some(m) = v.as_object() else {
        return;
    };
    let mut children = false;
    for (k, child) in m {
        if let Some(name) = k.strip_prefix("f:") {
            children = true;
            let p = if prefix.is_empty() {
                name.to_string()
            } else {
                format!("{prefix}.{name}")
            };
            owned_leaves(child, &p, out);
        } else if k != "." {
            children = true;
            out.push(prefix.to_string());
            break;
        }
    }
    if !children && !prefix.is_empty() {
        out.push(prefix.to_string());
    }
}

/// A manager's entries of an object (operation, subresource, time, fields).
fn entries_of<'a>(obj: &'a Value, manager: &str) -> Vec<&'a Value> {
    obj["metadata"]["managedFields"]
        .as_array()
        .map(|a| a.iter().filter(|e| e["manager"] == manager).collect())
        .unwrap_or_default()
}

/// Our manager's entries of an object.
fn our_entries(obj: &Value) -> Vec<&Value> {
    entries_of(obj, MANAGER)
}

/// Leaf values of the object outside `status`, `metadata.managedFields` and the server-kept
/// metadata; arrays are leaves (atomic).
fn leaves(v: &Value, prefix: &str, out: &mut BTreeMap<String, Value>) {
    match v.as_object() {
        Some(m) if !m.is_empty() => {
            for (k, child) in m {
                let p = if prefix.is_empty() {
                    k.clone()
                } else {
                    format!("{prefix}.{k}")
                };
                if matches!(
                    p.as_str(),
                    "status"
                        | "metadata.managedFields"
                        | "metadata.resourceVersion"
                        | "metadata.generation"
                ) {
                    continue;
                }
                leaves(child, &p, out);
            }
        }
        _ => {
            out.insert(prefix.to_string(), v.clone());
        }
    }
}

/// `path` is one of ours, or a map holding only ours (an apply of `spec: {}` holds `spec`).
fn ours(kind: Kind, obj: &Value, path: &str) -> bool {
    let holder = |leaf: &str| leaf.strip_prefix(path).is_some_and(|r| r.starts_with('.'));
    match kind {
        Kind::Node
            if [
                "metadata",
                "metadata.labels",
                "metadata.annotations",
                "spec",
            ]
            .contains(&path) =>
        {
            true
        }
        Kind::ClusterPolicy if CLUSTER_POLICY_FIELDS.iter().any(|l| holder(l)) => true,
        Kind::Node => {
            NODE_LABELS
                .iter()
                .any(|l| path == format!("metadata.labels.{l}"))
                || NODE_ANNOTATIONS
                    .iter()
                    .any(|a| path == format!("metadata.annotations.{a}"))
                || NODE_SPEC_FIELDS.contains(&path)
                || path == "spec.taints"
        }
        Kind::ConfigMap => obj["metadata"]["labels"][MANAGED_BY.0] == MANAGED_BY.1,
        Kind::ClusterPolicy => CLUSTER_POLICY_FIELDS.contains(&path),
        Kind::Pod | Kind::ResourceClaim => false,
    }
}

/// The leaves of `prev` and `cur` (see [`leaves`]), and the paths whose value differs.
fn changed_leaves(
    prev: &Value,
    cur: &Value,
) -> (
    BTreeMap<String, Value>,
    BTreeMap<String, Value>,
    Vec<String>,
) {
    let (mut before, mut after) = (BTreeMap::new(), BTreeMap::new());
    leaves(prev, "", &mut before);
    leaves(cur, "", &mut after);
    let changed = before
        .iter()
        .filter(|(k, v)| after.get(*k) != Some(*v))
        .map(|(k, _)| k.clone())
        .chain(after.keys().filter(|k| !before.contains_key(*k)).cloned())
        .collect();
    (before, after, changed)
}

/// What the demand's manager may hold: on a node, its one annotation (and the maps holding it).
fn demands(kind: Kind, path: &str) -> bool {
    kind == Kind::Node
        && (["metadata", "metadata.annotations"].contains(&path)
            || path == format!("metadata.annotations.{DEMAND_NODE_ANNOTATION}"))
}

fn held_by(obj: &Value, manager: &str) -> std::collections::BTreeSet<String> {
    let mut out = Vec::new();
    for e in entries_of(obj, manager) {
        owned_leaves(&e["fieldsV1"], "", &mut out);
    }
    out.into_iter().collect()
}

fn held(obj: &Value) -> std::collections::BTreeSet<String> {
    held_by(obj, MANAGER)
}

/// Our manager wrote `cur` (on top of `prev`): one of its entries has a new time (or is new),
/// or it holds a field it did not. Another manager taking a field from us also changes our
/// entry (the field leaves it), which is not a write of ours. A write of ours that changes the
/// values of the same fields within the same second is not seen.
fn written_by_us(prev: &Value, cur: &Value) -> bool {
    written_by(prev, cur, MANAGER)
}

/// [`written_by_us`] for any manager.
fn written_by(prev: &Value, cur: &Value, manager: &str) -> bool {
    let stamp = |e: &Value| {
        (
            e["operation"].clone(),
            e["subresource"].clone(),
            e["time"].clone(),
        )
    };
    let before: Vec<_> = entries_of(prev, manager).into_iter().map(stamp).collect();
    entries_of(cur, manager)
        .into_iter()
        .any(|e| !before.contains(&stamp(e)))
        || !held_by(cur, manager).is_subset(&held_by(prev, manager))
}

/// What the demand's manager holds or changed besides its one node annotation.
fn not_demands(kind: Kind, prev: Option<&Value>, cur: &Value) -> Vec<String> {
    let mut out: Vec<String> = held_by(cur, DEMAND)
        .into_iter()
        .filter(|path| !demands(kind, path))
        .map(|path| format!("{DEMAND} holds {path}"))
        .collect();
    let Some(prev) = prev.filter(|p| written_by(p, cur, DEMAND)) else {
        return out;
    };
    let (_, _, changed) = changed_leaves(prev, cur);
    // (Two states apart by a relist may hold a write of our other manager too.)
    let ours_too = written_by_us(prev, cur);
    out.extend(
        changed
            .into_iter()
            .filter(|path| !(demands(kind, path) || ours_too && ours(kind, prev, path)))
            .map(|path| format!("{DEMAND} changed {path}")),
    );
    out
}

fn foreign_taints(v: Option<&Value>) -> Vec<Value> {
    v.and_then(Value::as_array)
        .map(|a| {
            a.iter()
                .filter(|t| !t["key"].as_str().unwrap_or("").starts_with(OUR_TAINTS))
                .cloned()
                .collect()
        })
        .unwrap_or_default()
}

/// What our manager holds or changed that is not ours, going from `prev` (the previous state
/// of the same object seen by this watch, if any) to `cur`. Empty when all is well.
pub fn not_ours(kind: Kind, prev: Option<&Value>, cur: &Value) -> Vec<String> {
    let mut out = not_demands(kind, prev, cur);
    // A ConfigMap is ours if it was labelled ours before this write.
    let judged = prev.unwrap_or(cur);
    let entries = our_entries(cur);
    for e in &entries {
        let mut held = Vec::new();
        owned_leaves(&e["fieldsV1"], "", &mut held);
        for path in held {
            if !ours(kind, judged, &path) {
                out.push(format!(
                    "{MANAGER} holds {path} ({} {})",
                    e["operation"].as_str().unwrap_or("?"),
                    e["subresource"].as_str().unwrap_or("")
                ));
            }
        }
    }
    let Some(prev) = prev else {
        return out;
    };
    if !written_by_us(prev, cur) {
        return out;
    }
    // Our manager wrote this state: everything that changed must be ours.
    let (before, after, changed) = changed_leaves(prev, cur);
    for path in &changed {
        if kind == Kind::Node && path == "spec.taints" {
            if foreign_taints(before.get(path)) != foreign_taints(after.get(path)) {
                out.push(format!(
                    "{MANAGER} changed taints it does not own: {:?} -> {:?}",
                    before.get(path),
                    after.get(path)
                ));
            }
            continue;
        }
        if !ours(kind, judged, path) {
            out.push(format!(
                "{MANAGER} changed {path}: {} -> {}",
                before.get(path).map_or("(none)".into(), Value::to_string),
                after.get(path).map_or("(none)".into(), Value::to_string)
            ));
        }
    }
    out
}

/// What of an object is ours, as one line, without the fields NVIDIA's components write too
/// (`*.config.state`): a change of it is a write of ours (counted to compare runs).
pub fn our_part(kind: Kind, obj: &Value) -> String {
    let mut all = BTreeMap::new();
    leaves(obj, "", &mut all);
    let mut out: Vec<String> = all
        .iter()
        .filter(|(path, _)| !path.ends_with(".config.state") && ours(kind, obj, path))
        .filter(|(path, _)| kind != Kind::ConfigMap || path.starts_with("data."))
        .map(|(path, v)| {
            if path == "spec.taints" {
                format!("{path}={:?}", {
                    let mut t: Vec<_> = v
                        .as_array()
                        .into_iter()
                        .flatten()
                        .filter(|t| t["key"].as_str().unwrap_or("").starts_with(OUR_TAINTS))
                        .map(|t| t["key"].to_string())
                        .collect();
                    t.sort();
                    t
                })
            } else if kind == Kind::ConfigMap {
                // The key and a short digest of its content.
                let s = v.to_string();
                let h = s
                    .bytes()
                    .fold(0u32, |h, b| h.wrapping_mul(31).wrapping_add(b as u32));
                format!("{path}#{h:08x}")
            } else {
                format!("{path}={v}")
            }
        })
        .collect();
    out.sort();
    out.join(" ")
}

#[cfg(test)]
mod demand_manager_tests {
    use super::*;

    fn node(annotations: Value, labels: Value, fields: Value, time: &str) -> Value {
        serde_json::json!({
            "metadata": {
                "name": "n",
                "annotations": annotations,
                "labels": labels,
                "managedFields": [{
                    "manager": DEMAND, "operation": "Apply", "time": time,
                    "fieldsType": "FieldsV1", "fieldsV1": fields,
                }],
            },
        })
    }

    /// The demand's manager may hold and change its one annotation, nothing else.
    #[test]
    fn the_demand_manager_may_hold_only_its_annotation() {
        let own = serde_json::json!({"f:metadata": {"f:annotations": {format!("f:{DEMAND_NODE_ANNOTATION}"): {}}}});
        let prev = node(
            serde_json::json!({}),
            serde_json::json!({}),
            serde_json::json!({}),
            "t0",
        );
        let ok = node(
            serde_json::json!({DEMAND_NODE_ANNOTATION: "all-1g.10gb@1"}),
            serde_json::json!({}),
            own.clone(),
            "t1",
        );
        assert_eq!(not_ours(Kind::Node, Some(&prev), &ok), Vec::<String>::new());
        let label =
            serde_json::json!({"f:metadata": {"f:labels": {"f:nvidia.com/mig.config": {}}}});
        let bad = node(
            serde_json::json!({}),
            serde_json::json!({"nvidia.com/mig.config": "all-1g.10gb"}),
            label,
            "t1",
        );
        let found = not_ours(Kind::Node, Some(&prev), &bad);
        assert!(
            found
                .iter()
                .any(|f| f.contains("holds metadata.labels.nvidia.com/mig.config")),
            "{found:?}"
        );
        assert!(
            found
                .iter()
                .any(|f| f.contains("changed metadata.labels.nvidia.com/mig.config")),
            "{found:?}"
        );
    }
}
