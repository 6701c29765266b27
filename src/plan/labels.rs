//! Node labels as the planner holds them (interned, sorted pairs) and label selectors over them.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;

use crate::api::crd::GpuSharingPolicy;
use crate::api::names::{
    LABEL_GPU_PRODUCT, LABEL_INSTANCE_TYPE, LABEL_KARPENTER_INITIALIZED, LABEL_NODEPOOL,
    MANAGED_ANNOTATIONS, MANAGED_LABELS, PROVIDER_GPU_LABELS, SHARED_SUFFIX,
};

/// The node label prefixes the planner reads on every node: NVIDIA's (GPU Feature Discovery's,
/// the GPU Operator's, the ones we write) and ours. A node's other labels (the kubelet's, the
/// cloud provider's, Node Feature Discovery's: most of a GPU node's ~58) matter only when a
/// policy's node selector names them.
pub const PLANNER_LABEL_PREFIXES: [&str; 2] = ["nvidia.com/", "gpusharing.io/"];

/// The label keys the policies' node selectors read (`matchLabels` and `matchExpressions`).
/// The node selectors of the dynamic MIG policies: the nodes they match keep every label (see
/// [`LabelFilter`]).
pub fn dynamic_selectors<'a>(
    policies: impl IntoIterator<Item = &'a GpuSharingPolicy>,
) -> Vec<LabelSelector> {
    let mut out: Vec<LabelSelector> = Vec::new();
    for p in policies {
        let dynamic = p.spec.mig.as_ref().is_some_and(|m| m.dynamic.is_some());
        if dynamic && !out.contains(&p.spec.node_selector) {
            out.push(p.spec.node_selector.clone());
        }
    }
    out
}

pub fn selector_keys<'a>(
    policies: impl IntoIterator<Item = &'a GpuSharingPolicy>,
) -> BTreeSet<String> {
    let mut keys = BTreeSet::new();
    for p in policies {
        let sel = &p.spec.node_selector;
        keys.extend(sel.match_labels.iter().flatten().map(|(k, _)| k.clone()));
        keys.extend(
            sel.match_expressions
                .iter()
                .flatten()
                .map(|e| e.key.clone()),
        );
    }
    keys
}

/// The node labels a cache must keep for the planner to plan as it would with all of them:
/// those under [`PLANNER_LABEL_PREFIXES`], the instance type and the cloud providers' GPU labels
/// (what Karpenter's instance types are learnt from) and the keys given (the policies' selector
/// keys). Nodes that a dynamic MIG policy's selector matches keep every label: pending pods'
/// node selectors and affinity are judged against them, and those keys are the pod authors',
/// so they must never make the cache list every node again.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LabelFilter {
    keys: BTreeSet<String>,
    all: bool,
    /// Nodes these select keep every label (the dynamic policies' node selectors).
    whole: Vec<LabelSelector>,
}

impl LabelFilter {
    pub fn new(keys: BTreeSet<String>) -> Self {
        LabelFilter {
            keys,
            all: false,
            whole: Vec::new(),
        }
    }

    /// Keeps every label of the nodes `selectors` match too; whether that is new.
    pub fn extend_whole(&mut self, selectors: &[LabelSelector]) -> bool {
        let before = self.whole.len();
        for s in selectors {
            if !self.whole.contains(s) {
                self.whole.push(s.clone());
            }
        }
        self.whole.len() != before
    }

    /// Every node `selectors` match keeps every label.
    pub fn covers_whole(&self, selectors: &[LabelSelector]) -> bool {
        self.all || selectors.iter().all(|s| self.whole.contains(s))
    }

    /// Whether a node with these (complete) labels keeps all of them.
    pub fn keeps_all_of(&self, labels: &BTreeMap<String, String>) -> bool {
        self.all || self.whole.iter().any(|s| selector_matches(s, labels))
    }

    /// Keeps every label (a one-off read that plans policies not known in advance).
    pub fn everything() -> Self {
        LabelFilter {
            keys: BTreeSet::new(),
            all: true,
            whole: Vec::new(),
        }
    }

    pub fn keeps(&self, key: &str) -> bool {
        self.all
            || PLANNER_LABEL_PREFIXES.iter().any(|p| key.starts_with(p))
            || key == LABEL_INSTANCE_TYPE
            || key == LABEL_NODEPOOL
            || key == LABEL_KARPENTER_INITIALIZED
            || PROVIDER_GPU_LABELS.contains(&key)
            || self.keys.contains(key)
    }

    /// The keys given to keep (besides the prefixes and names every filter keeps).
    pub fn keys(&self) -> &BTreeSet<String> {
        &self.keys
    }

    /// Every key of `keys` is kept.
    pub fn covers(&self, keys: &BTreeSet<String>) -> bool {
        keys.iter().all(|k| self.keeps(k))
    }

    /// Keeps `keys` too; whether that kept anything new.
    pub fn extend(&mut self, keys: &BTreeSet<String>) -> bool {
        let before = self.keys.len();
        self.keys.extend(
            keys.iter()
                .filter(|k| !self.keeps(k))
                .cloned()
                .collect::<Vec<_>>(),
        );
        self.keys.len() != before
    }

    /// `labels` without what the planner does not read.
    pub fn apply(&self, labels: &Labels) -> Labels {
        Labels(
            labels
                .0
                .iter()
                .filter(|(k, _)| self.keeps(k))
                .cloned()
                .collect(),
        )
    }
}

/// A node's labels: (key, value) pairs sorted by key, as shared strings. The node cache interns
/// them, so a key or value found on thousands of nodes (`nvidia.com/gpu.product=NVIDIA-H200`)
/// is stored once, and so is a whole set of labels found on many nodes (nodes of one pool
/// differ only in labels no policy reads): most nodes cost one pointer for all their labels.
#[derive(Clone, Default, PartialEq, Eq, Hash)]
pub struct Labels(Arc<[(Arc<str>, Arc<str>)]>);

impl Labels {
    /// From pairs in any order; a repeated key keeps its last value.
    pub fn from_pairs(mut pairs: Vec<(Arc<str>, Arc<str>)>) -> Self {
        pairs.reverse();
        pairs.sort_by(|a, b| a.0.cmp(&b.0));
        pairs.dedup_by(|a, b| a.0 == b.0);
        Labels(pairs.into())
    }

    /// How many holders share these pairs (the node cache forgets sets no node uses).
    pub fn holders(&self) -> usize {
        Arc::strong_count(&self.0)
    }

    fn position(&self, key: &str) -> Result<usize, usize> {
        self.0.binary_search_by(|(k, _)| (**k).cmp(key))
    }

    pub fn get(&self, key: &str) -> Option<&str> {
        self.position(key).ok().map(|i| &*self.0[i].1)
    }

    /// A label's value, shared (interned values are stored once).
    pub fn get_shared(&self, key: &str) -> Option<Arc<str>> {
        self.position(key).ok().map(|i| self.0[i].1.clone())
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
        let mut v = self.0.to_vec();
        match v.binary_search_by(|(k, _)| k.cmp(&key)) {
            Ok(i) => v[i].1 = value,
            Err(i) => v.insert(i, (key, value)),
        }
        self.0 = v.into();
    }

    /// Removes a label, returning its value.
    pub fn remove(&mut self, key: &str) -> Option<Arc<str>> {
        let i = self.position(key).ok()?;
        let mut v = self.0.to_vec();
        let (_, value) = v.remove(i);
        self.0 = v.into();
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
        let mut v = self.0.to_vec();
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

/// Every key the operator may own on a node: its managed labels, then its annotations.
fn managed_keys() -> &'static [String] {
    static KEYS: std::sync::LazyLock<Vec<String>> = std::sync::LazyLock::new(|| {
        crate::api::names::MANAGED_LABELS
            .iter()
            .chain(crate::api::names::MANAGED_ANNOTATIONS.iter())
            .map(|k| k.to_string())
            .collect()
    });
    &KEYS
}

/// Which of the operator's managed label and annotation keys a field manager owns on a node: a
/// bit per key, so the node cache spends one byte on it instead of a set of strings (thousands
/// of nodes). Keys outside that set are never ours to own and are not recorded.
#[derive(Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct OwnedKeys(u16);

impl OwnedKeys {
    fn bit(key: &str) -> Option<u16> {
        managed_keys().iter().position(|k| k == key).map(|i| 1 << i)
    }

    pub fn contains(&self, key: &str) -> bool {
        Self::bit(key).is_some_and(|b| self.0 & b != 0)
    }

    /// Records `key` (ignored unless it is a managed key); returns whether it was new.
    pub fn insert(&mut self, key: impl AsRef<str>) -> bool {
        let Some(b) = Self::bit(key.as_ref()) else {
            return false;
        };
        let new = self.0 & b == 0;
        self.0 |= b;
        new
    }

    pub fn remove(&mut self, key: &str) -> bool {
        let Some(b) = Self::bit(key) else {
            return false;
        };
        let had = self.0 & b != 0;
        self.0 &= !b;
        had
    }

    pub fn iter(&self) -> impl Iterator<Item = &'static String> + '_ {
        managed_keys()
            .iter()
            .enumerate()
            .filter(|(i, _)| self.0 & (1 << i) != 0)
            .map(|(_, k)| k)
    }

    pub fn len(&self) -> usize {
        self.0.count_ones() as usize
    }

    pub fn is_empty(&self) -> bool {
        self.0 == 0
    }
}

impl std::fmt::Debug for OwnedKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_set().entries(self.iter()).finish()
    }
}

impl<S: AsRef<str>> FromIterator<S> for OwnedKeys {
    fn from_iter<I: IntoIterator<Item = S>>(iter: I) -> Self {
        let mut o = OwnedKeys::default();
        for k in iter {
            o.insert(k);
        }
        o
    }
}

impl<S: AsRef<str>, const N: usize> From<[S; N]> for OwnedKeys {
    fn from(keys: [S; N]) -> Self {
        keys.into_iter().collect()
    }
}

impl IntoIterator for OwnedKeys {
    type Item = String;
    type IntoIter = std::vec::IntoIter<String>;
    fn into_iter(self) -> Self::IntoIter {
        self.iter().cloned().collect::<Vec<_>>().into_iter()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::names::*;

    #[test]
    fn owned_keys_behave_like_a_set_of_managed_keys() {
        let mut o: OwnedKeys = [LABEL_MIG_CONFIG, ANNOTATION_CONFIG_WRITTEN].into();
        assert!(o.contains(LABEL_MIG_CONFIG) && o.contains(ANNOTATION_CONFIG_WRITTEN));
        assert!(!o.contains(LABEL_POLICY));
        assert!(o.insert(LABEL_POLICY) && !o.insert(LABEL_POLICY));
        assert!(
            !o.insert("example.com/not-ours"),
            "only managed keys are recorded"
        );
        assert_eq!(o.len(), 3);
        assert!(o.remove(LABEL_MIG_CONFIG) && !o.contains(LABEL_MIG_CONFIG));
        let keys: Vec<String> = o.into_iter().collect();
        assert_eq!(keys, [LABEL_POLICY, ANNOTATION_CONFIG_WRITTEN]);
        assert_eq!(std::mem::size_of::<OwnedKeys>(), 2);
        assert!(managed_keys().len() <= 16, "one bit per managed key");
    }
}

/// A few key/value pairs (the labels or annotations a plan wants on one node): a sorted vector,
/// which for a handful of entries costs a fraction of a `BTreeMap` node, across thousands of
/// nodes a pass. Shared: a clone is a reference (a pass hands each node's remembered labels to
/// its plan without copying them) and a change copies only a shared map (copy on write). Our
/// own keys ([`MANAGED_LABELS`], [`MANAGED_ANNOTATIONS`]) are kept as the constants themselves:
/// looking one up reads no per-node string.
#[derive(Clone, PartialEq, Eq)]
pub struct SmallMap(Arc<Vec<(Key, String)>>);

type Key = std::borrow::Cow<'static, str>;

/// The key as one of our constants when it is one.
fn key_of(key: String) -> Key {
    match MANAGED_LABELS
        .iter()
        .chain(MANAGED_ANNOTATIONS.iter())
        .find(|k| **k == key)
    {
        Some(k) => Key::Borrowed(k),
        None => Key::Owned(key),
    }
}

impl Default for SmallMap {
    /// The empty map: one shared allocation for all of them.
    fn default() -> Self {
        static EMPTY: std::sync::LazyLock<SmallMap> =
            std::sync::LazyLock::new(|| SmallMap(Arc::new(Vec::new())));
        EMPTY.clone()
    }
}

impl SmallMap {
    pub fn insert(&mut self, key: String, value: String) {
        let v = Arc::make_mut(&mut self.0);
        match v.binary_search_by(|(k, _)| (**k).cmp(key.as_str())) {
            Ok(i) => v[i].1 = value,
            Err(i) => v.insert(i, (key_of(key), value)),
        }
    }

    /// Gives back the room insertions left unused: a node's planned maps live as long as its
    /// memo, 20,000 of each at that scale.
    pub fn shrink(&mut self) {
        if self.0.capacity() > self.0.len() {
            Arc::make_mut(&mut self.0).shrink_to_fit();
        }
    }

    /// Removes `key`; returns its value.
    pub fn remove(&mut self, key: &str) -> Option<String> {
        let i = self.0.binary_search_by(|(k, _)| (**k).cmp(key)).ok()?;
        Some(Arc::make_mut(&mut self.0).remove(i).1)
    }

    pub fn get(&self, key: &str) -> Option<&String> {
        self.0
            .binary_search_by(|(k, _)| (**k).cmp(key))
            .ok()
            .map(|i| &self.0[i].1)
    }

    pub fn contains_key(&self, key: &str) -> bool {
        self.get(key).is_some()
    }

    pub fn keys(&self) -> impl Iterator<Item = &str> {
        self.0.iter().map(|(k, _)| &**k)
    }

    pub fn values(&self) -> impl Iterator<Item = &String> {
        self.0.iter().map(|(_, v)| v)
    }

    pub fn iter(&self) -> impl Iterator<Item = (&str, &String)> {
        self.0.iter().map(|(k, v)| (&**k, v))
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl std::fmt::Debug for SmallMap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_map().entries(self.iter()).finish()
    }
}

impl std::ops::Index<&str> for SmallMap {
    type Output = String;
    fn index(&self, key: &str) -> &String {
        self.get(key).unwrap_or_else(|| panic!("no key {key:?}"))
    }
}

impl<'a> IntoIterator for &'a SmallMap {
    type Item = (&'a str, &'a String);
    type IntoIter = std::iter::Map<
        std::slice::Iter<'a, (Key, String)>,
        fn(&'a (Key, String)) -> (&'a str, &'a String),
    >;
    fn into_iter(self) -> Self::IntoIter {
        self.0.iter().map(|(k, v)| (&**k, v))
    }
}

impl IntoIterator for SmallMap {
    type Item = (String, String);
    type IntoIter = std::vec::IntoIter<(String, String)>;
    fn into_iter(self) -> Self::IntoIter {
        Arc::unwrap_or_clone(self.0)
            .into_iter()
            .map(|(k, v)| (k.into_owned(), v))
            .collect::<Vec<_>>()
            .into_iter()
    }
}

impl PartialEq<BTreeMap<String, String>> for SmallMap {
    fn eq(&self, other: &BTreeMap<String, String>) -> bool {
        self.len() == other.len()
            && self
                .iter()
                .zip(other.iter())
                .all(|(a, b)| a.0 == b.0 && a.1 == b.1)
    }
}

impl FromIterator<(String, String)> for SmallMap {
    fn from_iter<I: IntoIterator<Item = (String, String)>>(iter: I) -> Self {
        let mut m = SmallMap(Arc::new(Vec::new()));
        for (k, v) in iter {
            m.insert(k, v);
        }
        m
    }
}

impl serde::Serialize for SmallMap {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_map(self.iter())
    }
}

#[cfg(test)]
mod small_map_tests {
    use super::*;

    #[test]
    fn small_maps_behave_like_sorted_maps() {
        let mut m: SmallMap = [("b".to_string(), "2".to_string())].into_iter().collect();
        m.insert("a".into(), "1".into());
        m.insert("b".into(), "3".into());
        assert_eq!(m.keys().collect::<Vec<_>>(), ["a", "b"]);
        assert_eq!(m["b"], "3");
        assert!(m.contains_key("a") && !m.contains_key("c"));
        assert_eq!(
            serde_json::to_value(&m).unwrap(),
            serde_json::json!({"a": "1", "b": "3"})
        );
        // A clone shares the pairs until one of the two changes.
        let mut c = m.clone();
        assert!(Arc::ptr_eq(&c.0, &m.0));
        c.insert("c".into(), "4".into());
        assert!(!m.contains_key("c") && c["c"] == "4");
        assert!(SmallMap::default().is_empty());
    }
}
