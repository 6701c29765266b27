//! The readiness taint: which nodes carry it, fed by the node watch (only the tainted nodes'
//! names and that taint are kept), and its removal; and the spare taint's writes.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};

use k8s_openapi::api::core::v1::Node;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::watcher;
use kube::{Client, ResourceExt};

use crate::api::names::{MANAGER, TAINT_SPARE, TAINT_SPARE_EFFECT};
use crate::plan::taint::Taint;

/// Nodes carrying the readiness taint.
pub struct Tainted {
    key: String,
    set: Mutex<BTreeMap<String, Taint>>,
    /// Nodes of a (re)list in progress.
    listing: Mutex<BTreeMap<String, Taint>>,
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

    pub fn snapshot(&self) -> BTreeMap<String, Taint> {
        self.set.lock().expect("taint set").clone()
    }

    pub fn is_ready(&self) -> bool {
        self.ready.load(Ordering::Relaxed)
    }

    /// The node's readiness taint, if it has one.
    fn of(&self, n: &Node) -> Option<Taint> {
        taint_of(n, &self.key)
    }

    /// Applies a watch event; returns whether the set of tainted nodes changed.
    pub fn apply(&self, ev: &watcher::Event<Node>) -> bool {
        let mut set = self.set.lock().expect("taint set");
        match ev {
            watcher::Event::Apply(n) => {
                let name = n.name_any();
                match self.of(n) {
                    Some(t) => set.insert(name, t.clone()).as_ref() != Some(&t),
                    None => set.remove(&name).is_some(),
                }
            }
            watcher::Event::Delete(n) => set.remove(&n.name_any()).is_some(),
            watcher::Event::Init => {
                self.listing.lock().expect("listing").clear();
                false
            }
            watcher::Event::InitApply(n) => {
                if let Some(t) = self.of(n) {
                    self.listing
                        .lock()
                        .expect("listing")
                        .insert(n.name_any(), t);
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
/// Node `n`'s taint with this key (any effect), as the readiness-taint cache keeps it; `plan`
/// reads nodes the same way.
pub fn taint_of(n: &Node, key: &str) -> Option<Taint> {
    let spec = n.spec.as_ref()?;
    let t = &spec.taints.as_ref()?[taint_index(n, key)?];
    Some(Taint {
        key: t.key.clone(),
        value: t.value.clone().unwrap_or_default(),
        effect: t.effect.clone(),
    })
}

fn taint_index(n: &Node, key: &str) -> Option<usize> {
    n.spec
        .as_ref()?
        .taints
        .as_ref()?
        .iter()
        .position(|t| t.key == key)
}

/// Puts the spare taint (`gpusharing.io/spare:PreferNoSchedule`, `preferBusyNodes`) on a node,
/// or takes it off: a JSON patch that appends or removes that one entry of the atomic list,
/// guarded by the node's resourceVersion, so a concurrent change of the taints fails it (the
/// next pass retries) and no one else's taint is ever dropped. Returns whether it wrote.
pub async fn set_spare(client: &Client, node: &str, present: bool) -> Result<bool, kube::Error> {
    let api: Api<Node> = Api::all(client.clone());
    let n = api.get(node).await?;
    let taints = n.spec.as_ref().and_then(|s| s.taints.as_deref());
    let at = (taints.into_iter().flatten())
        .position(|t| t.key == TAINT_SPARE && t.effect == TAINT_SPARE_EFFECT);
    let taint = serde_json::json!({"key": TAINT_SPARE, "effect": TAINT_SPARE_EFFECT});
    let change = match (present, at, taints) {
        (true, Some(_), _) | (false, None, _) => return Ok(false),
        (true, None, Some(_)) => {
            serde_json::json!({"op": "add", "path": "/spec/taints/-", "value": taint})
        }
        (true, None, None) => {
            serde_json::json!({"op": "add", "path": "/spec/taints", "value": [taint]})
        }
        (false, Some(i), _) => {
            serde_json::json!({"op": "remove", "path": format!("/spec/taints/{i}")})
        }
    };
    patch_guarded(&api, &n, change).await?;
    Ok(true)
}

/// One change of node `n`'s taints as a JSON patch guarded by the resourceVersion we read, under
/// our field manager (as every write of ours, so the API server records it as ours).
async fn patch_guarded(
    api: &Api<Node>,
    n: &Node,
    change: serde_json::Value,
) -> Result<(), kube::Error> {
    let patch: json_patch::Patch = serde_json::from_value(serde_json::json!([
        {"op": "test", "path": "/metadata/resourceVersion", "value": n.resource_version()},
        change,
    ]))
    .expect("a valid JSON patch");
    let params = PatchParams {
        field_manager: Some(MANAGER.into()),
        ..Default::default()
    };
    api.patch(&n.name_any(), &params, &Patch::Json::<()>(patch))
        .await?;
    Ok(())
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
    let change = serde_json::json!({"op": "remove", "path": format!("/spec/taints/{i}")});
    patch_guarded(&api, &n, change).await?;
    Ok(true)
}
