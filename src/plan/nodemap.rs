//! [`NodeMap`]: a plan's per-node values by node name.
//!
//! A pass builds one for every node it governs (20,000 at the scale the benchmark measures) from
//! nodes it already has in name order, and most passes change nothing: so it is a sorted vector
//! built without comparing names, keyed by the planner's shared names (no string copied), and
//! looked up by binary search.

use std::sync::Arc;

/// Values by node name, in name order.
#[derive(Clone, PartialEq, Eq)]
pub struct NodeMap<V>(Vec<(Arc<str>, V)>);

impl<V> Default for NodeMap<V> {
    fn default() -> Self {
        NodeMap(Vec::new())
    }
}

impl<V> NodeMap<V> {
    /// From pairs already in strictly increasing name order (checked in debug builds).
    pub(crate) fn from_sorted(pairs: Vec<(Arc<str>, V)>) -> Self {
        debug_assert!(pairs.windows(2).all(|w| w[0].0 < w[1].0), "names in order");
        NodeMap(pairs)
    }

    fn position(&self, name: &str) -> Option<usize> {
        self.0.binary_search_by(|(n, _)| (**n).cmp(name)).ok()
    }

    pub fn get<Q: AsRef<str> + ?Sized>(&self, name: &Q) -> Option<&V> {
        self.position(name.as_ref()).map(|i| &self.0[i].1)
    }

    pub fn contains_key<Q: AsRef<str> + ?Sized>(&self, name: &Q) -> bool {
        self.position(name.as_ref()).is_some()
    }

    pub fn iter(&self) -> impl Iterator<Item = (&str, &V)> {
        self.0.iter().map(|(n, v)| (&**n, v))
    }

    pub fn keys(&self) -> impl Iterator<Item = &str> {
        self.0.iter().map(|(n, _)| &**n)
    }

    pub fn values(&self) -> impl Iterator<Item = &V> {
        self.0.iter().map(|(_, v)| v)
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl<V, Q: AsRef<str> + ?Sized> std::ops::Index<&Q> for NodeMap<V> {
    type Output = V;
    fn index(&self, name: &Q) -> &V {
        let name = name.as_ref();
        self.get(name)
            .unwrap_or_else(|| panic!("no node {name:?} in the plan"))
    }
}

impl<'a, V> IntoIterator for &'a NodeMap<V> {
    type Item = (&'a str, &'a V);
    type IntoIter = std::iter::Map<
        std::slice::Iter<'a, (Arc<str>, V)>,
        fn(&'a (Arc<str>, V)) -> (&'a str, &'a V),
    >;
    fn into_iter(self) -> Self::IntoIter {
        self.0.iter().map(|(n, v)| (&**n, v))
    }
}

/// From pairs in any order; a repeated name keeps its last value.
impl<K: AsRef<str>, V> FromIterator<(K, V)> for NodeMap<V> {
    fn from_iter<I: IntoIterator<Item = (K, V)>>(iter: I) -> Self {
        let mut v: Vec<(Arc<str>, V)> = iter
            .into_iter()
            .map(|(k, v)| (Arc::from(k.as_ref()), v))
            .collect();
        v.reverse();
        v.sort_by(|a, b| a.0.cmp(&b.0));
        v.dedup_by(|a, b| a.0 == b.0);
        NodeMap(v)
    }
}

impl<V: std::fmt::Debug> std::fmt::Debug for NodeMap<V> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_map().entries(self.iter()).finish()
    }
}

impl<V: serde::Serialize> serde::Serialize for NodeMap<V> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_map(self.iter())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_maps_behave_like_sorted_maps() {
        let m: NodeMap<i32> = [("b", 1), ("a", 2), ("b", 3)].into_iter().collect();
        assert_eq!(m.keys().collect::<Vec<_>>(), ["a", "b"]);
        assert_eq!(m["b"], 3, "the last value of a repeated name");
        assert_eq!(m.get(&"a".to_string()), Some(&2));
        assert!(m.contains_key("a") && !m.contains_key("c") && m.get("c").is_none());
        assert_eq!(m.len(), 2);
        assert_eq!(
            serde_json::to_value(&m).unwrap(),
            serde_json::json!({"a": 2, "b": 3})
        );
        let sorted = NodeMap::from_sorted(vec![("a".into(), 2), ("b".into(), 3)]);
        assert_eq!(sorted, m);
        assert_eq!(format!("{m:?}"), r#"{"a": 2, "b": 3}"#);
    }
}
