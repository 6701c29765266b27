//! Node -> [`NodeFacts`]: what the planner knows of a node (its metadata as far as the planner
//! reads it, the labels and annotations our field manager owns, NVIDIA's allocatable), one
//! conversion for the controller's node cache, `plan`'s one-shot list and `render`'s files.

use std::collections::{BTreeSet, HashSet};
use std::sync::Arc;

use k8s_openapi::api::core::v1::Node;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ManagedFieldsEntry;

use crate::api::names::{
    ANNOTATION_CORDONED, ANNOTATION_MIG_DEMAND, DEMAND_MANAGER, MANAGED_ANNOTATIONS, TAINT_SPARE,
    TAINT_SPARE_EFFECT, TAINT_UNSCHEDULABLE,
};
use crate::observe::managed::owned_keys;
use crate::plan::taint::Taint;
use crate::plan::{LabelFilter, Labels, NodeFacts, OwnedKeys};

/// Our managed labels a field manager owns through server-side apply, read from a node's
/// managedFields (straight into bits: no set of strings per watch event).
pub fn owned_labels(entries: &[ManagedFieldsEntry], manager: &str) -> OwnedKeys {
    owned_keys(entries, manager, &["f:metadata", "f:labels"]).collect()
}

/// Our managed annotations a field manager owns through server-side apply.
pub fn owned_annotations(entries: &[ManagedFieldsEntry], manager: &str) -> OwnedKeys {
    owned_keys(entries, manager, &["f:metadata", "f:annotations"]).collect()
}

/// The annotations of [`crate::api::names::OBSERVED_ANNOTATIONS`] whose value the right field manager owns: ours
/// by `manager`, the demand's layout by [`DEMAND_MANAGER`].
pub fn believed_annotations<'a>(
    entries: &'a [ManagedFieldsEntry],
    manager: &'a str,
) -> BTreeSet<&'a str> {
    const PATH: &[&str] = &["f:metadata", "f:annotations"];
    owned_keys(entries, manager, PATH)
        .filter(|k| MANAGED_ANNOTATIONS.contains(k))
        .chain(owned_keys(entries, DEMAND_MANAGER, PATH).filter(|k| *k == ANNOTATION_MIG_DEMAND))
        .collect()
}

/// Shared copies of label strings.
#[derive(Default)]
pub struct Interner {
    strings: HashSet<Arc<str>>,
    /// Whole sets of pairs (a node's labels, annotations, allocatable), stored once however
    /// many nodes carry them: at 20,000 nodes of a few hundred pools this was the largest thing
    /// the operator held (19 MB of pointers to shared strings).
    sets: HashSet<Labels>,
}

impl Interner {
    pub fn intern(&mut self, s: &str) -> Arc<str> {
        if let Some(a) = self.strings.get(s) {
            return a.clone();
        }
        let a: Arc<str> = Arc::from(s);
        self.strings.insert(a.clone());
        a
    }

    /// These pairs as a set shared with every node that has the same ones.
    pub fn labels(&mut self, pairs: Vec<(Arc<str>, Arc<str>)>) -> Labels {
        let l = Labels::from_pairs(pairs);
        if let Some(shared) = self.sets.get(&l) {
            return shared.clone();
        }
        self.sets.insert(l.clone());
        l
    }

    /// Forgets the sets, then the strings, no node uses any more.
    pub fn purge(&mut self) {
        self.sets.retain(|l| l.holders() > 1);
        self.strings.retain(|a| Arc::strong_count(a) > 1);
    }

    pub fn len(&self) -> usize {
        self.strings.len()
    }

    pub fn is_empty(&self) -> bool {
        self.strings.is_empty()
    }
}

/// What the planner knows of a node: its metadata (the labels `filter` keeps), and the
/// allocatable count of NVIDIA's extended resources (the rest of the status, images and
/// conditions, is dropped here).
pub fn facts(node: Node, manager: &str, filter: &LabelFilter, strings: &mut Interner) -> NodeFacts {
    let allocatable = node
        .status
        .and_then(|s| s.allocatable)
        .unwrap_or_default()
        .into_iter()
        .filter(|(k, _)| k.starts_with("nvidia.com/"))
        .map(|(k, v)| (strings.intern(&k), strings.intern(&v.0)))
        .collect::<Vec<_>>();
    let meta = node.metadata;
    let managed = meta.managed_fields.as_deref().unwrap_or_default();
    // Our annotations are believed only where our field managers own them: anyone with node
    // `patch` could write one (a forged cordon mark, demand layout or rollout time) to steer us.
    let believed = believed_annotations(managed, manager);
    // A cordon is a taint to the scheduler; one of our drains is not (it goes once the node is
    // confirmed), someone else's is.
    let ours = believed.contains(ANNOTATION_CORDONED)
        && meta
            .annotations
            .as_ref()
            .is_some_and(|a| a.contains_key(ANNOTATION_CORDONED));
    let spec = node.spec.unwrap_or_default();
    let spare = (spec.taints.iter().flatten())
        .any(|t| t.key == TAINT_SPARE && t.effect == TAINT_SPARE_EFFECT);
    let mut taints: Vec<Taint> = spec
        .taints
        .unwrap_or_default()
        .into_iter()
        .filter(|t| matches!(t.effect.as_str(), "NoSchedule" | "NoExecute"))
        .filter(|t| t.key != TAINT_UNSCHEDULABLE)
        .map(|t| Taint {
            key: t.key,
            value: t.value.unwrap_or_default(),
            effect: t.effect,
        })
        .collect();
    if spec.unschedulable == Some(true) && !ours {
        taints.push(Taint {
            key: TAINT_UNSCHEDULABLE.into(),
            value: String::new(),
            effect: "NoSchedule".into(),
        });
    }
    // Only our own annotations: other controllers put large ones on nodes.
    let annotations = meta
        .annotations
        .iter()
        .flatten()
        .filter(|(k, _)| believed.contains(k.as_str()))
        .map(|(k, v)| (strings.intern(k), strings.intern(v)))
        .collect::<Vec<_>>();
    let all_labels = meta.labels.unwrap_or_default();
    let whole = filter.keeps_all_of(&all_labels);
    let labels = all_labels
        .iter()
        .filter(|(k, _)| whole || filter.keeps(k))
        .map(|(k, v)| (strings.intern(k), strings.intern(v)))
        .collect::<Vec<_>>();
    NodeFacts {
        owned: owned_labels(managed, manager),
        owned_annotations: owned_annotations(managed, manager),
        name: meta.name.unwrap_or_default(),
        labels: strings.labels(labels),
        annotations: strings.labels(annotations),
        allocatable: strings.labels(allocatable),
        taints,
        spare,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn taints_of(node: serde_json::Value) -> Vec<(String, String)> {
        let node: Node = serde_json::from_value(node).unwrap();
        facts(
            node,
            "ours",
            &LabelFilter::default(),
            &mut Interner::default(),
        )
        .taints
        .into_iter()
        .map(|t| (t.key, t.effect))
        .collect()
    }

    /// The taints demand planning judges: NoSchedule and NoExecute ones; a cordon as the
    /// unschedulable taint, unless it is one of our drains'.
    #[test]
    fn taints_and_cordons_as_demand_sees_them() {
        let spec = serde_json::json!({
            "unschedulable": true,
            "taints": [
                {"key": "dedicated", "value": "ml", "effect": "NoSchedule"},
                {"key": "soft", "effect": "PreferNoSchedule"},
                {"key": "gone", "effect": "NoExecute"},
                {"key": TAINT_UNSCHEDULABLE, "effect": "NoSchedule"},
            ],
        });
        let unschedulable = (TAINT_UNSCHEDULABLE.to_string(), "NoSchedule".to_string());
        let someone_elses =
            taints_of(serde_json::json!({"metadata": {"name": "a"}, "spec": spec.clone()}));
        assert_eq!(
            someone_elses,
            [
                ("dedicated".to_string(), "NoSchedule".to_string()),
                ("gone".to_string(), "NoExecute".to_string()),
                unschedulable.clone(),
            ]
        );
        let marked = |manager: &str| {
            serde_json::json!({
                "metadata": {
                    "name": "a",
                    "annotations": {ANNOTATION_CORDONED: "true"},
                    "managedFields": [owning(manager, ANNOTATION_CORDONED)],
                },
                "spec": spec.clone(),
            })
        };
        let ours = taints_of(marked("ours"));
        assert!(!ours.contains(&unschedulable), "{ours:?}");
        assert_eq!(ours.len(), 2);
        // The same mark written by anyone else is someone else's cordon.
        let forged = taints_of(marked("kubectl-annotate"));
        assert!(forged.contains(&unschedulable), "{forged:?}");
    }

    /// A managedFields entry: `manager` applied annotation `key`.
    fn owning(manager: &str, key: &str) -> serde_json::Value {
        serde_json::json!({
            "manager": manager,
            "operation": "Apply",
            "fieldsType": "FieldsV1",
            "fieldsV1": {"f:metadata": {"f:annotations": {format!("f:{key}"): {}}}},
        })
    }

    /// Our annotations count only where the right field manager owns them: the demand's layout
    /// by the demand's manager, the others by ours; a forged one is not seen at all.
    #[test]
    fn annotations_are_believed_only_from_their_owner() {
        let node = |entries: Vec<serde_json::Value>| {
            let n: Node = serde_json::from_value(serde_json::json!({
                "metadata": {
                    "name": "a",
                    "annotations": {
                        ANNOTATION_MIG_DEMAND: "all-1g.10gb@4102444800",
                        ANNOTATION_CORDONED: "true",
                        "other.io/big": "x",
                    },
                    "managedFields": entries,
                },
            }))
            .unwrap();
            let f = facts(n, "ours", &LabelFilter::default(), &mut Interner::default());
            let mut keys: Vec<String> = f.annotations.iter().map(|(k, _)| k.to_string()).collect();
            keys.sort();
            keys
        };
        assert!(node(vec![]).is_empty());
        assert!(
            node(vec![
                owning("kubectl-annotate", ANNOTATION_MIG_DEMAND),
                owning(DEMAND_MANAGER, ANNOTATION_CORDONED),
                owning("ours", ANNOTATION_MIG_DEMAND),
            ])
            .is_empty()
        );
        assert_eq!(
            node(vec![
                owning(DEMAND_MANAGER, ANNOTATION_MIG_DEMAND),
                owning("ours", ANNOTATION_CORDONED),
            ]),
            [ANNOTATION_CORDONED, ANNOTATION_MIG_DEMAND]
        );
    }
}
