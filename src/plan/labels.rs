//! Node labels as the planner holds them (interned, sorted pairs) and label selectors over them.

use std::collections::BTreeMap;
use std::sync::Arc;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;

use crate::api::names::{LABEL_GPU_PRODUCT, SHARED_SUFFIX};

/// A node's labels: (key, value) pairs sorted by key, as shared strings. The node cache interns
/// them, so a key or value found on thousands of nodes (`nvidia.com/gpu.product=NVIDIA-H200`)
/// is stored once; a node costs two pointers per label.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct Labels(Box<[(Arc<str>, Arc<str>)]>);

impl Labels {
    /// From pairs in any order; a repeated key keeps its last value.
    pub fn from_pairs(mut pairs: Vec<(Arc<str>, Arc<str>)>) -> Self {
        pairs.reverse();
        pairs.sort_by(|a, b| a.0.cmp(&b.0));
        pairs.dedup_by(|a, b| a.0 == b.0);
        Labels(pairs.into_boxed_slice())
    }

    fn position(&self, key: &str) -> Result<usize, usize> {
        self.0.binary_search_by(|(k, _)| (**k).cmp(key))
    }

    pub fn get(&self, key: &str) -> Option<&str> {
        self.position(key).ok().map(|i| &*self.0[i].1)
    }

    pub fn contains_key(&self, key: &str) -> bool {
        self.position(key).is_ok()
    }

    pub fn iter(&self) -> impl Iterator<Item = (&str, &str)> {
        self.0.iter().map(|(k, v)| (&**k, &**v))
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Sets a label (rebuilds the pairs: for tests and small edits, not hot paths).
    pub fn insert(&mut self, key: impl Into<Arc<str>>, value: impl Into<Arc<str>>) {
        let (key, value) = (key.into(), value.into());
        let mut v = std::mem::take(&mut self.0).into_vec();
        match v.binary_search_by(|(k, _)| k.cmp(&key)) {
            Ok(i) => v[i].1 = value,
            Err(i) => v.insert(i, (key, value)),
        }
        self.0 = v.into_boxed_slice();
    }

    /// Removes a label, returning its value.
    pub fn remove(&mut self, key: &str) -> Option<Arc<str>> {
        let i = self.position(key).ok()?;
        let mut v = std::mem::take(&mut self.0).into_vec();
        let (_, value) = v.remove(i);
        self.0 = v.into_boxed_slice();
        Some(value)
    }
}

impl std::fmt::Debug for Labels {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_map().entries(self.iter()).finish()
    }
}

impl std::ops::Index<&str> for Labels {
    type Output = str;
    fn index(&self, key: &str) -> &str {
        self.get(key).unwrap_or_else(|| panic!("no label {key:?}"))
    }
}

impl<K: Into<Arc<str>>, V: Into<Arc<str>>> FromIterator<(K, V)> for Labels {
    fn from_iter<I: IntoIterator<Item = (K, V)>>(iter: I) -> Self {
        Labels::from_pairs(
            iter.into_iter()
                .map(|(k, v)| (k.into(), v.into()))
                .collect(),
        )
    }
}

impl<K: Into<Arc<str>>, V: Into<Arc<str>>> Extend<(K, V)> for Labels {
    fn extend<I: IntoIterator<Item = (K, V)>>(&mut self, iter: I) {
        let mut v = std::mem::take(&mut self.0).into_vec();
        v.extend(iter.into_iter().map(|(k, v)| (k.into(), v.into())));
        *self = Labels::from_pairs(v);
    }
}

impl From<BTreeMap<String, String>> for Labels {
    fn from(m: BTreeMap<String, String>) -> Self {
        m.into_iter().collect()
    }
}

/// Label lookup, for selectors over node labels and plain maps alike.
pub trait LabelLookup {
    fn label(&self, key: &str) -> Option<&str>;
}

impl LabelLookup for Labels {
    fn label(&self, key: &str) -> Option<&str> {
        self.get(key)
    }
}

impl LabelLookup for BTreeMap<String, String> {
    fn label(&self, key: &str) -> Option<&str> {
        self.get(key).map(String::as_str)
    }
}

/// The labels selectors are matched against: the product without GFD's `-SHARED` suffix (and
/// without a `-MIG-...` suffix of the mixed strategy), so a policy selecting
/// `nvidia.com/gpu.product=NVIDIA-H200` keeps its nodes once they are shared.
pub fn selection_labels(labels: &Labels) -> SelectionLabels<'_> {
    let product = labels.get(LABEL_GPU_PRODUCT).map(|p| {
        let p = p.strip_suffix(SHARED_SUFFIX).unwrap_or(p);
        p.find("-MIG-").map_or(p, |i| &p[..i])
    });
    SelectionLabels { labels, product }
}

/// A node's labels as selectors see them (see [`selection_labels`]).
pub struct SelectionLabels<'a> {
    labels: &'a Labels,
    product: Option<&'a str>,
}

impl LabelLookup for SelectionLabels<'_> {
    fn label(&self, key: &str) -> Option<&str> {
        if key == LABEL_GPU_PRODUCT {
            self.product
        } else {
            self.labels.get(key)
        }
    }
}

/// Whether a label selector matches a label set.
pub fn selector_matches(sel: &LabelSelector, labels: &impl LabelLookup) -> bool {
    for (k, v) in sel.match_labels.iter().flatten() {
        if labels.label(k) != Some(v.as_str()) {
            return false;
        }
    }
    for e in sel.match_expressions.iter().flatten() {
        let vals = e.values.as_deref().unwrap_or_default();
        let cur = labels.label(&e.key);
        let ok = match e.operator.as_str() {
            "In" => cur.is_some_and(|c| vals.iter().any(|v| v == c)),
            "NotIn" => cur.is_none_or(|c| vals.iter().all(|v| v != c)),
            "Exists" => cur.is_some(),
            "DoesNotExist" => cur.is_none(),
            _ => false,
        };
        if !ok {
            return false;
        }
    }
    true
}
