//! The readiness taint: which nodes carry it, fed by the node watch (only the names of tainted
//! nodes are kept), and its removal.

use std::collections::BTreeSet;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};

use k8s_openapi::api::core::v1::Node;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::watcher;
use kube::{Client, ResourceExt};

/// Nodes carrying the readiness taint.
pub struct Tainted {
    key: String,
    set: Mutex<BTreeSet<String>>,
    /// Nodes of a (re)list in progress.
    listing: Mutex<BTreeSet<String>>,
    ready: AtomicBool,
}

impl Tainted {
    pub fn new(key: &str) -> Self {
        Tainted {
            key: key.to_string(),
            set: Mutex::default(),
            listing: Mutex::default(),
            ready: AtomicBool::new(false),
        }
    }

    pub fn key(&self) -> &str {
        &self.key
    }

    pub fn snapshot(&self) -> BTreeSet<String> {
        self.set.lock().expect("taint set").clone()
    }

    pub fn is_ready(&self) -> bool {
        self.ready.load(Ordering::Relaxed)
    }

    fn has(&self, n: &Node) -> bool {
        taint_index(n, &self.key).is_some()
    }

    /// Applies a watch event; returns whether the set of tainted nodes changed.
    pub fn apply(&self, ev: &watcher::Event<Node>) -> bool {
        let mut set = self.set.lock().expect("taint set");
        match ev {
            watcher::Event::Apply(n) => {
                let name = n.name_any();
                if self.has(n) {
                    set.insert(name)
                } else {
                    set.remove(&name)
                }
            }
            watcher::Event::Delete(n) => set.remove(&n.name_any()),
            watcher::Event::Init => {
                self.listing.lock().expect("listing").clear();
                false
            }
            watcher::Event::InitApply(n) => {
                if self.has(n) {
                    self.listing.lock().expect("listing").insert(n.name_any());
                }
                false
            }
            watcher::Event::InitDone => {
                let listed = std::mem::take(&mut *self.listing.lock().expect("listing"));
                let changed = *set != listed;
                *set = listed;
                self.ready.store(true, Ordering::Relaxed);
                changed
            }
        }
    }
}

/// Index of the taint with `key` in the node's taints.
fn taint_index(n: &Node, key: &str) -> Option<usize> {
    n.spec
        .as_ref()?
        .taints
        .as_ref()?
        .iter()
        .position(|t| t.key == key)
}

/// Removes the readiness taint from a node: taints are an atomic list, so the removal is a JSON
/// patch of that one entry, guarded by the node's resourceVersion (a concurrent change of the
/// taints makes it fail and the next pass retries). Returns whether a taint was removed.
pub async fn remove(client: &Client, node: &str, key: &str) -> Result<bool, kube::Error> {
    let api: Api<Node> = Api::all(client.clone());
    let n = api.get(node).await?;
    let Some(i) = taint_index(&n, key) else {
        return Ok(false);
    };
    let patch: json_patch::Patch = serde_json::from_value(serde_json::json!([
        {"op": "test", "path": "/metadata/resourceVersion", "value": n.resource_version()},
        {"op": "remove", "path": format!("/spec/taints/{i}")},
    ]))
    .expect("a valid JSON patch");
    api.patch(node, &PatchParams::default(), &Patch::Json::<()>(patch))
        .await?;
    Ok(true)
}
