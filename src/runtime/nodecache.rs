//! The node cache: for every node, only what the planner reads ([`NodeFacts`]), built once per
//! watch event and shared with every pass by reference.
//!
//! A reflector store would keep each node's whole metadata (managedFields included) and every
//! pass would copy the labels out of it into the planner's input; at thousands of nodes those two
//! copies were most of the operator's memory. Here the watch event is turned into facts and
//! dropped, and a pass takes `Arc`s. Label keys and values are interned: GFD, NFD and cloud
//! providers put tens of labels on every node, nearly all with the same keys and few values.
//!
//! Only the labels the planner reads are kept ([`LabelFilter`]: NVIDIA's and ours, and the keys
//! the policies select on); the kubelet's, the cloud provider's and Node Feature Discovery's
//! (most of a GPU node's ~58, some unique per node such as its hostname) are dropped. When a
//! policy starts selecting on a label that was dropped, the filter grows and the node watch
//! lists again (nodes a dynamic MIG policy selects keep every label, so pending pods' selectors,
//! which tenants write, never make it list again); until that list is complete [`NodeCache::require`] says no and the controller
//! does not plan (a node missing the label would look unselected and lose its config).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, RwLock};

use k8s_openapi::api::core::v1::Node;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use kube::runtime::watcher;
use tokio::sync::watch;

use crate::api::names::{LABEL_MIG_STATE, LABEL_VGPU_STATE};
use crate::nvidia::state::ConfigState;
pub use crate::observe::node::{Interner, facts};
use crate::plan::{LabelFilter, NodeFacts};

#[derive(Default)]
struct State {
    /// By name: a pass takes them in name order, as the planner plans them.
    nodes: BTreeMap<String, Arc<NodeFacts>>,
    /// A relist in progress: it replaces `nodes` when complete.
    relist: Option<BTreeMap<String, Arc<NodeFacts>>>,
    /// Nodes whose MIG or vGPU change is pending (see [`pending`]), of `nodes` and of the relist.
    pending: BTreeSet<String>,
    relist_pending: BTreeSet<String>,
    strings: Interner,
    /// Nodes replaced or removed since the last purge of unused strings.
    churn: usize,
    /// The labels kept from now on.
    filter: LabelFilter,
    /// The filter of the list in progress.
    relist_filter: Option<LabelFilter>,
    /// The filter of the last complete list: every node in `nodes` has these labels.
    listed: Option<LabelFilter>,
}

impl State {
    /// The node's facts; the cached ones when they are the same (an update of something the
    /// planner does not read, e.g. the node's status): a node keeps its identity while its
    /// facts do not change, and the planner reuses what it planned for it (`plan::memo`).
    fn facts(&mut self, n: Node, manager: &str) -> Arc<NodeFacts> {
        let new = facts(n, manager, &self.filter, &mut self.strings);
        match self.nodes.get(&new.name) {
            Some(old) if **old == new => old.clone(),
            _ => Arc::new(new),
        }
    }

    /// Marks or unmarks a node as pending in `set`.
    fn track(set: &mut BTreeSet<String>, f: &NodeFacts) {
        if pending(f) {
            if !set.contains(&f.name) {
                set.insert(f.name.clone());
            }
        } else {
            set.remove(&f.name);
        }
    }

    /// Purges unused strings once about as many nodes changed as there are: amortised O(1) per
    /// event, and the interner never holds more than about twice what is in use.
    fn churned(&mut self) {
        self.churn += 1;
        if self.churn > self.nodes.len().max(64) {
            self.strings.purge();
            self.churn = 0;
        }
    }
}

/// Shared node cache, fed by a watch of nodes.
pub struct NodeCache {
    manager: String,
    state: RwLock<State>,
    ready: watch::Sender<bool>,
    /// Bumped when the filter grows: the node watch lists again.
    relists: watch::Sender<u64>,
}

impl NodeCache {
    /// An empty cache keeping the labels of `filter`; `manager` is the field manager whose
    /// label ownership is recorded.
    pub fn new(manager: &str, filter: LabelFilter) -> Self {
        NodeCache {
            manager: manager.into(),
            state: RwLock::new(State {
                filter,
                ..Default::default()
            }),
            ready: watch::Sender::new(false),
            relists: watch::Sender::new(0),
        }
    }

    /// Whether every node in the cache has the labels `keys`, and the nodes `whole` selects
    /// all their labels (a complete list kept them). If not, keeps them from now on and asks
    /// the node watch to list again (see [`relists`](Self::relists)); the answer turns true
    /// once that list is complete. Both come from the policies (an admin's edit), never from
    /// pods.
    pub fn require(&self, keys: &BTreeSet<String>, whole: &[LabelSelector]) -> bool {
        let mut s = self.state.write().expect("node cache lock");
        let covered = |l: &LabelFilter| l.covers(keys) && l.covers_whole(whole);
        if s.listed.as_ref().is_some_and(covered) {
            return true;
        }
        let grew = s.filter.extend(keys);
        if s.filter.extend_whole(whole) || grew {
            drop(s);
            tracing::info!(
                keys = ?keys,
                "a policy selects on node labels the cache did not keep: listing nodes again"
            );
            self.relists.send_modify(|n| *n += 1);
        }
        false
    }

    /// The label filter in force (it only grows).
    pub fn filter(&self) -> LabelFilter {
        self.state.read().expect("node cache lock").filter.clone()
    }

    /// Changes when the node watch must list again.
    pub fn relists(&self) -> watch::Receiver<u64> {
        self.relists.subscribe()
    }

    /// Applies one watch event. A relist (`Init` .. `InitDone`) replaces the whole content
    /// atomically, so nodes deleted while the watch was down disappear.
    pub fn apply(&self, event: watcher::Event<Node>) {
        let mut s = self.state.write().expect("node cache lock");
        match event {
            watcher::Event::Apply(n) => {
                let f = s.facts(n, &self.manager);
                State::track(&mut s.pending, &f);
                if let Some(old) = s.nodes.insert(f.name.clone(), f.clone())
                    && !Arc::ptr_eq(&old, &f)
                {
                    s.churned();
                }
            }
            watcher::Event::Delete(n) => {
                if let Some(name) = &n.metadata.name
                    && s.nodes.remove(name).is_some()
                {
                    s.pending.remove(name);
                    s.churned();
                }
            }
            watcher::Event::Init => {
                s.relist = Some(BTreeMap::new());
                s.relist_pending.clear();
                s.relist_filter = Some(s.filter.clone());
            }
            watcher::Event::InitApply(n) => {
                let f = s.facts(n, &self.manager);
                State::track(&mut s.relist_pending, &f);
                s.relist
                    .get_or_insert_with(BTreeMap::new)
                    .insert(f.name.clone(), f);
            }
            watcher::Event::InitDone => {
                if let Some(fresh) = s.relist.take() {
                    s.nodes = fresh;
                    s.pending = std::mem::take(&mut s.relist_pending);
                    s.strings.purge();
                    s.churn = 0;
                    s.listed = s.relist_filter.take();
                }
                drop(s);
                self.ready.send_replace(true);
            }
        }
    }

    /// Every node, in name order.
    pub fn snapshot(&self) -> Vec<Arc<NodeFacts>> {
        let s = self.state.read().expect("node cache lock");
        s.nodes.values().cloned().collect()
    }

    /// The nodes whose MIG or vGPU change is pending (`nvidia.com/mig.config.state` or
    /// `nvidia.com/vgpu.config.state` says `pending`), in name order: the only ones whose
    /// pending timers can run (see [`crate::runtime::memory`]), found without reading every
    /// node's labels each pass.
    pub fn pending(&self) -> Vec<Arc<NodeFacts>> {
        let s = self.state.read().expect("node cache lock");
        s.pending
            .iter()
            .filter_map(|name| s.nodes.get(name).cloned())
            .collect()
    }

    /// Distinct label strings held (a metric: the cache's memory grows with it).
    pub fn strings(&self) -> usize {
        self.state.read().expect("node cache lock").strings.len()
    }

    /// Resolves once the first list is complete.
    pub async fn wait_until_ready(&self) {
        let mut rx = self.ready.subscribe();
        let _ = rx.wait_for(|r| *r).await;
    }
}

/// Whether NVIDIA's MIG manager or vGPU Device Manager says a change is pending on the node.
fn pending(f: &NodeFacts) -> bool {
    [LABEL_MIG_STATE, LABEL_VGPU_STATE]
        .iter()
        .any(|l| ConfigState::parse(f.labels.get(l)) == Some(ConfigState::Pending))
}

#[cfg(test)]
mod tests {
    use super::*;
    use kube::api::ObjectMeta;
    use serde_json::json;

    fn node(name: &str, product: &str, managed: serde_json::Value) -> Node {
        Node {
            metadata: ObjectMeta {
                name: Some(name.into()),
                labels: Some([("nvidia.com/gpu.product".to_string(), product.to_string())].into()),
                managed_fields: serde_json::from_value(managed).unwrap(),
                ..Default::default()
            },
            ..Default::default()
        }
    }

    #[test]
    fn facts_keep_labels_and_only_our_applied_labels() {
        let managed = json!([
            {"manager": "ours", "operation": "Apply",
             "fieldsV1": {"f:metadata": {"f:labels": {"f:nvidia.com/device-plugin.config": {}, "f:gpusharing.io/policy": {}}}}},
            {"manager": "ours", "operation": "Update",
             "fieldsV1": {"f:metadata": {"f:labels": {"f:nvidia.com/mig.config": {}}}}},
            {"manager": "gpu-feature-discovery", "operation": "Apply",
             "fieldsV1": {"f:metadata": {"f:labels": {"f:nvidia.com/gpu.product": {}}}}}
        ]);
        let f = facts(
            node("a", "NVIDIA-L4", managed),
            "ours",
            &LabelFilter::default(),
            &mut Interner::default(),
        );
        assert_eq!(f.name, "a");
        assert_eq!(&f.labels["nvidia.com/gpu.product"], "NVIDIA-L4");
        assert_eq!(
            f.owned,
            crate::plan::OwnedKeys::from([
                "gpusharing.io/policy".to_string(),
                "nvidia.com/device-plugin.config".to_string()
            ])
        );
    }

    #[tokio::test]
    async fn relist_replaces_content_and_marks_ready() {
        let c = NodeCache::new("ours", LabelFilter::default());
        c.apply(watcher::Event::Init);
        c.apply(watcher::Event::InitApply(node("b", "L4", json!([]))));
        c.apply(watcher::Event::InitApply(node("a", "L4", json!([]))));
        // Not visible before the list completes.
        assert!(c.snapshot().is_empty());
        c.apply(watcher::Event::InitDone);
        c.wait_until_ready().await;
        let names: Vec<String> = c.snapshot().iter().map(|n| n.name.clone()).collect();
        assert_eq!(names, ["a", "b"]);

        c.apply(watcher::Event::Apply(node("a", "H200", json!([]))));
        c.apply(watcher::Event::Delete(node("b", "L4", json!([]))));
        let snap = c.snapshot();
        assert_eq!(snap.len(), 1);
        assert_eq!(&snap[0].labels["nvidia.com/gpu.product"], "H200");
        drop(snap);

        // A relist after a watch gap drops nodes deleted meanwhile.
        c.apply(watcher::Event::Init);
        c.apply(watcher::Event::InitApply(node("c", "L4", json!([]))));
        c.apply(watcher::Event::InitDone);
        let names: Vec<String> = c.snapshot().iter().map(|n| n.name.clone()).collect();
        assert_eq!(names, ["c"]);
        // Strings of the dropped nodes were purged: one key, one value remain.
        assert_eq!(c.strings(), 2);
    }

    fn labelled(name: &str, labels: &[(&str, &str)]) -> Node {
        let mut n = node(name, "NVIDIA-L4", json!([]));
        let l = n.metadata.labels.as_mut().unwrap();
        for (k, v) in labels {
            l.insert(k.to_string(), v.to_string());
        }
        n
    }

    #[tokio::test]
    async fn only_planner_labels_are_kept_and_a_new_selector_key_lists_again() {
        let keys = |k: &[&str]| k.iter().map(|s| s.to_string()).collect::<BTreeSet<_>>();
        let c = NodeCache::new("ours", LabelFilter::new(keys(&["team"])));
        let mut relists = c.relists();
        let list = |c: &NodeCache| {
            c.apply(watcher::Event::Init);
            c.apply(watcher::Event::InitApply(labelled(
                "a",
                &[
                    ("kubernetes.io/hostname", "a"),
                    ("team", "ml"),
                    ("topology.kubernetes.io/zone", "z1"),
                    ("gpusharing.io/profile", "p"),
                ],
            )));
            c.apply(watcher::Event::InitDone);
        };
        // Nothing listed yet: not even the seeded keys are there.
        assert!(!c.require(&keys(&["team"]), &[]));
        assert!(
            !relists.has_changed().unwrap(),
            "the first list is coming anyway"
        );
        list(&c);
        assert!(c.require(&keys(&["team"]), &[]));
        let labels = |c: &NodeCache| -> Vec<String> {
            c.snapshot()[0]
                .labels
                .iter()
                .map(|(k, _)| k.to_string())
                .collect()
        };
        assert_eq!(
            labels(&c),
            ["gpusharing.io/profile", "nvidia.com/gpu.product", "team"],
            "hostname and zone are not read by the planner"
        );
        // A policy now selects on the zone: no plan until the nodes are listed again with it.
        assert!(!c.require(&keys(&["team", "topology.kubernetes.io/zone"]), &[]));
        assert!(relists.has_changed().unwrap());
        relists.mark_unchanged();
        assert!(!c.require(&keys(&["topology.kubernetes.io/zone"]), &[]));
        assert!(!relists.has_changed().unwrap(), "one relist per new key");
        // An update before the list is complete already keeps it, but is not enough.
        c.apply(watcher::Event::Apply(labelled(
            "a",
            &[("topology.kubernetes.io/zone", "z1")],
        )));
        assert!(!c.require(&keys(&["topology.kubernetes.io/zone"]), &[]));
        list(&c);
        assert!(c.require(&keys(&["topology.kubernetes.io/zone", "team"]), &[]));
        assert_eq!(
            labels(&c),
            [
                "gpusharing.io/profile",
                "nvidia.com/gpu.product",
                "team",
                "topology.kubernetes.io/zone"
            ]
        );
        // Keys under NVIDIA's and our prefixes are always there.
        assert!(c.require(&keys(&["nvidia.com/gpu.family", "gpusharing.io/x"]), &[]));
    }

    /// A dynamic policy's selector: the nodes it matches keep every label (pending pods select
    /// on any of them), after one list; nothing a pod selects on lists again.
    #[tokio::test]
    async fn nodes_a_dynamic_policy_selects_keep_every_label() {
        let c = NodeCache::new("ours", LabelFilter::default());
        let dynamic: LabelSelector =
            serde_json::from_value(json!({"matchLabels": {"gpusharing.io/profile": "dyn"}}))
                .unwrap();
        let list = |c: &NodeCache| {
            c.apply(watcher::Event::Init);
            for (name, profile) in [("a", "dyn"), ("b", "static")] {
                c.apply(watcher::Event::InitApply(labelled(
                    name,
                    &[
                        ("gpusharing.io/profile", profile),
                        ("tenant.example/rack", "r1"),
                    ],
                )));
            }
            c.apply(watcher::Event::InitDone);
        };
        list(&c);
        let mut relists = c.relists();
        assert!(!c.require(&BTreeSet::new(), std::slice::from_ref(&dynamic)));
        assert!(
            relists.has_changed().unwrap(),
            "a new dynamic selector lists again"
        );
        relists.mark_unchanged();
        list(&c);
        assert!(c.require(&BTreeSet::new(), std::slice::from_ref(&dynamic)));
        let rack = |name: &str| {
            c.snapshot()
                .iter()
                .find(|n| n.name == name)
                .and_then(|n| n.labels.get("tenant.example/rack").map(str::to_string))
        };
        assert_eq!(rack("a").as_deref(), Some("r1"));
        assert_eq!(
            rack("b"),
            None,
            "other nodes keep only the planner's labels"
        );
        assert!(!relists.has_changed().unwrap());
    }

    #[tokio::test]
    async fn pending_lists_the_nodes_whose_mig_or_vgpu_change_is_pending() {
        let c = NodeCache::new("ours", LabelFilter::default());
        let names =
            |c: &NodeCache| -> Vec<String> { c.pending().iter().map(|n| n.name.clone()).collect() };
        c.apply(watcher::Event::Init);
        c.apply(watcher::Event::InitApply(labelled(
            "a",
            &[("nvidia.com/mig.config.state", "pending")],
        )));
        c.apply(watcher::Event::InitApply(labelled(
            "b",
            &[("nvidia.com/mig.config.state", "success")],
        )));
        c.apply(watcher::Event::InitApply(labelled(
            "c",
            &[("nvidia.com/vgpu.config.state", "pending")],
        )));
        assert!(names(&c).is_empty(), "not before the list is complete");
        c.apply(watcher::Event::InitDone);
        assert_eq!(names(&c), ["a", "c"]);
        c.apply(watcher::Event::Apply(labelled(
            "a",
            &[("nvidia.com/mig.config.state", "success")],
        )));
        c.apply(watcher::Event::Apply(labelled(
            "b",
            &[("nvidia.com/mig.config.state", "pending")],
        )));
        c.apply(watcher::Event::Delete(labelled("c", &[])));
        assert_eq!(names(&c), ["b"]);
        // A relist replaces them with its own.
        c.apply(watcher::Event::Init);
        c.apply(watcher::Event::InitApply(labelled(
            "d",
            &[("nvidia.com/mig.config.state", "pending")],
        )));
        c.apply(watcher::Event::InitDone);
        assert_eq!(names(&c), ["d"]);
    }

    #[test]
    fn labels_are_shared_between_nodes_and_unused_strings_purged() {
        let c = NodeCache::new("ours", LabelFilter::default());
        c.apply(watcher::Event::Init);
        for i in 0..10 {
            c.apply(watcher::Event::InitApply(node(
                &format!("n{i}"),
                "NVIDIA-H200",
                json!([]),
            )));
        }
        c.apply(watcher::Event::InitDone);
        let snap = c.snapshot();
        let a = snap[0].labels.iter().next().unwrap().1.as_ptr();
        let b = snap[9].labels.iter().next().unwrap().1.as_ptr();
        assert_eq!(a, b, "the same value is one allocation");
        // The same labels: one set, however many nodes carry it.
        assert_eq!(snap[0].labels.holders(), snap[9].labels.holders());
        assert!(
            snap[0].labels.holders() >= 11,
            "{}",
            snap[0].labels.holders()
        );
        assert_eq!(c.strings(), 2);
        drop(snap);
        // Every node changes product, more often than there are nodes: the old value goes.
        for round in 0..7 {
            for i in 0..10 {
                let p = format!("GPU-{round}");
                c.apply(watcher::Event::Apply(node(&format!("n{i}"), &p, json!([]))));
            }
        }
        assert!(
            c.strings() <= 2 + 10,
            "interner holds {} strings",
            c.strings()
        );
        assert!(
            c.snapshot()
                .iter()
                .all(|n| n.labels.get("nvidia.com/gpu.product") == Some("GPU-6"))
        );
    }
}
