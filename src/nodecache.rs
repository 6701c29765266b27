//! The node cache: for every node, only what the planner reads ([`NodeFacts`]), built once per
//! watch event and shared with every pass by reference.
//!
//! A reflector store would keep each node's whole metadata (managedFields included) and every
//! pass would copy the labels out of it into the planner's input; at thousands of nodes those two
//! copies were most of the operator's memory. Here the watch event is turned into facts and
//! dropped, and a pass takes `Arc`s.

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, RwLock};

use k8s_openapi::api::core::v1::Node;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ManagedFieldsEntry;
use kube::api::PartialObjectMeta;
use kube::runtime::watcher;
use tokio::sync::watch;

use crate::plan::NodeFacts;

/// Labels a field manager owns through server-side apply, read from a node's managedFields.
pub fn owned_labels(entries: &[ManagedFieldsEntry], manager: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for e in entries.iter().filter(|e| {
        e.manager.as_deref() == Some(manager) && e.operation.as_deref() == Some("Apply")
    }) {
        if let Some(labels) = e
            .fields_v1
            .as_ref()
            .and_then(|f| f.0.get("f:metadata"))
            .and_then(|m| m.get("f:labels"))
            .and_then(|l| l.as_object())
        {
            for k in labels.keys() {
                if let Some(name) = k.strip_prefix("f:") {
                    out.insert(name.to_string());
                }
            }
        }
    }
    out
}

/// What the planner knows of a node, from its metadata.
pub fn facts(node: PartialObjectMeta<Node>, manager: &str) -> NodeFacts {
    let meta = node.metadata;
    NodeFacts {
        owned: owned_labels(meta.managed_fields.as_deref().unwrap_or_default(), manager),
        name: meta.name.unwrap_or_default(),
        labels: meta.labels.unwrap_or_default(),
    }
}

#[derive(Default)]
struct State {
    nodes: HashMap<String, Arc<NodeFacts>>,
    /// A relist in progress: it replaces `nodes` when complete.
    relist: Option<HashMap<String, Arc<NodeFacts>>>,
}

/// Shared node cache, fed by a metadata watch of nodes.
pub struct NodeCache {
    manager: String,
    state: RwLock<State>,
    ready: watch::Sender<bool>,
}

impl NodeCache {
    /// An empty cache; `manager` is the field manager whose label ownership is recorded.
    pub fn new(manager: &str) -> Self {
        NodeCache {
            manager: manager.into(),
            state: Default::default(),
            ready: watch::Sender::new(false),
        }
    }

    /// Applies one watch event. A relist (`Init` .. `InitDone`) replaces the whole content
    /// atomically, so nodes deleted while the watch was down disappear.
    pub fn apply(&self, event: watcher::Event<PartialObjectMeta<Node>>) {
        let mut s = self.state.write().expect("node cache lock");
        match event {
            watcher::Event::Apply(n) => {
                let f = facts(n, &self.manager);
                s.nodes.insert(f.name.clone(), Arc::new(f));
            }
            watcher::Event::Delete(n) => {
                if let Some(name) = &n.metadata.name {
                    s.nodes.remove(name);
                }
            }
            watcher::Event::Init => s.relist = Some(HashMap::new()),
            watcher::Event::InitApply(n) => {
                let f = facts(n, &self.manager);
                s.relist
                    .get_or_insert_with(HashMap::new)
                    .insert(f.name.clone(), Arc::new(f));
            }
            watcher::Event::InitDone => {
                if let Some(fresh) = s.relist.take() {
                    s.nodes = fresh;
                }
                drop(s);
                self.ready.send_replace(true);
            }
        }
    }

    /// Every node, in name order.
    pub fn snapshot(&self) -> Vec<Arc<NodeFacts>> {
        let s = self.state.read().expect("node cache lock");
        let mut v: Vec<Arc<NodeFacts>> = s.nodes.values().cloned().collect();
        v.sort_by(|a, b| a.name.cmp(&b.name));
        v
    }

    /// Resolves once the first list is complete.
    pub async fn wait_until_ready(&self) {
        let mut rx = self.ready.subscribe();
        let _ = rx.wait_for(|r| *r).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kube::api::ObjectMeta;
    use serde_json::json;

    fn node(name: &str, product: &str, managed: serde_json::Value) -> PartialObjectMeta<Node> {
        let mut n = PartialObjectMeta::<Node>::default();
        n.metadata = ObjectMeta {
            name: Some(name.into()),
            labels: Some([("nvidia.com/gpu.product".to_string(), product.to_string())].into()),
            managed_fields: serde_json::from_value(managed).unwrap(),
            ..Default::default()
        };
        n
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
        let f = facts(node("a", "NVIDIA-L4", managed), "ours");
        assert_eq!(f.name, "a");
        assert_eq!(f.labels["nvidia.com/gpu.product"], "NVIDIA-L4");
        assert_eq!(
            f.owned,
            BTreeSet::from([
                "gpusharing.io/policy".to_string(),
                "nvidia.com/device-plugin.config".to_string()
            ])
        );
    }

    #[tokio::test]
    async fn relist_replaces_content_and_marks_ready() {
        let c = NodeCache::new("ours");
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
        assert_eq!(snap[0].labels["nvidia.com/gpu.product"], "H200");

        // A relist after a watch gap drops nodes deleted meanwhile.
        c.apply(watcher::Event::Init);
        c.apply(watcher::Event::InitApply(node("c", "L4", json!([]))));
        c.apply(watcher::Event::InitDone);
        let names: Vec<String> = c.snapshot().iter().map(|n| n.name.clone()).collect();
        assert_eq!(names, ["c"]);
    }
}
