//! Node -> [`NodeFacts`]: what the planner knows of a node (its metadata as far as the planner
//! reads it, the labels and annotations our field manager owns, NVIDIA's allocatable), one
//! conversion for the controller's node cache, `plan`'s one-shot list and `render`'s files.

use std::collections::HashSet;
use std::sync::Arc;

use k8s_openapi::api::core::v1::Node;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ManagedFieldsEntry;

use crate::api::names::{OBSERVED_ANNOTATIONS, TAINT_UNSCHEDULABLE};
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

/// Shared copies of label strings.
#[derive(Default)]
pub struct Interner {
    strings: HashSet<Arc<str>>,
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

    /// Forgets strings no node uses any more.
    pub fn purge(&mut self) {
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
    let taints = node
        .spec
        .and_then(|s| s.taints)
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
    let meta = node.metadata;
    let managed = meta.managed_fields.as_deref().unwrap_or_default();
    // Only our own annotations: other controllers put large ones on nodes.
    let annotations = meta
        .annotations
        .iter()
        .flatten()
        .filter(|(k, _)| OBSERVED_ANNOTATIONS.contains(&k.as_str()))
        .map(|(k, v)| (strings.intern(k), strings.intern(v)))
        .collect::<Vec<_>>();
    let labels = meta
        .labels
        .unwrap_or_default()
        .iter()
        .filter(|(k, _)| filter.keeps(k))
        .map(|(k, v)| (strings.intern(k), strings.intern(v)))
        .collect::<Vec<_>>();
    NodeFacts {
        owned: owned_labels(managed, manager),
        owned_annotations: owned_annotations(managed, manager),
        name: meta.name.unwrap_or_default(),
        labels: Labels::from_pairs(labels),
        annotations: Labels::from_pairs(annotations),
        allocatable: Labels::from_pairs(allocatable),
        taints,
    }
}
