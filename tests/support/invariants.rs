//! An independent invariant watcher (test code, not the operator's logic): watches every Node
//! and the ConfigMaps in the GPU Operator's namespace from the start of a test, replays their
//! changes in the API server's order (etcd's global resourceVersion) and checks every observed
//! state of every node against the operator's promises:
//!
//! - a node label `nvidia.com/device-plugin.config` names a key that exists in our device-plugin
//!   ConfigMap at that moment (or `default`);
//! - a node label `nvidia.com/mig.config` names a layout that exists at that moment (ours or
//!   NVIDIA's default mig-parted config);
//! - a device-plugin config with sharing (time-slicing or MPS) is never on a node whose MIG
//!   layout is not yet confirmed by the MIG manager, and sharing of whole GPUs (MIG strategy
//!   `none`) or MPS never on a node whose MIG layout is enabled;
//! - a VM host (`nvidia.com/gpu.workload.config=vm-*`) never carries a container sharing config
//!   or an enabled MIG layout;
//! - nothing we do not own changed: every state of every Node, ConfigMap and ClusterPolicy is
//!   judged by [`super::ownership`] from the API server's field-manager records.
//!
//! The first violation is kept with the history of that node; [`InvariantWatcher::check`]
//! panics with it.
//!
//! A test that edits our objects by hand (deletes our ConfigMap, relabels a node) breaks the
//! invariants itself; it says so first with [`InvariantWatcher::hand_edit`]: violations are then
//! counted as excused until the watcher sees every node valid again (the operator repaired the
//! edit), after which it is strict again. An operator write that breaks an invariant inside that
//! window is not caught; every window must end in a repair.

use std::collections::{BTreeMap, BinaryHeap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::core::v1::{ConfigMap, Node};
use kube::api::DynamicObject;
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client, ResourceExt};

use super::ownership::{self, Kind};
use gpu_sharing_operator::runtime::controller::cluster_policy_resource;

use gpu_sharing_operator::api::names::*;

const DISABLED: &str = "all-disabled";
/// How long an event waits for events of lower resourceVersion from the other watch.
const REORDER: Duration = Duration::from_millis(600);

#[derive(Debug, Clone)]
enum Obj {
    Node(String, BTreeMap<String, String>),
    NodeGone(String),
    ConfigMap(String, BTreeMap<String, String>),
    ConfigMapGone(String),
}

struct Pending {
    rv: u64,
    at: Instant,
    obj: Obj,
}

impl PartialEq for Pending {
    fn eq(&self, o: &Self) -> bool {
        self.rv == o.rv
    }
}
impl Eq for Pending {}
impl PartialOrd for Pending {
    fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Pending {
    // A min-heap on resourceVersion.
    fn cmp(&self, o: &Self) -> std::cmp::Ordering {
        o.rv.cmp(&self.rv)
    }
}

/// What the device plugin would do with one config key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Sharing {
    mps: bool,
    time_slicing: bool,
    mig_strategy_none: bool,
}

fn sharing_of(yaml: &str) -> Sharing {
    let v: serde_json::Value = gpu_sharing_operator::api::yaml::from_str(yaml).unwrap_or_default();
    let s = &v["sharing"];
    Sharing {
        mps: s["mps"].is_object(),
        time_slicing: s["timeSlicing"].is_object(),
        mig_strategy_none: v["flags"]["migStrategy"].as_str().unwrap_or("none") == "none",
    }
}

fn layouts_of(data: &BTreeMap<String, String>) -> Vec<String> {
    let v: serde_json::Value = data
        .get("config.yaml")
        .and_then(|t| gpu_sharing_operator::api::yaml::from_str(t).ok())
        .unwrap_or_default();
    v["mig-configs"]
        .as_object()
        .map(|m| m.keys().cloned().collect())
        .unwrap_or_default()
}

/// A hand edit in progress: its name, when it began, the node states excused since.
#[derive(Debug)]
struct Excuse {
    what: String,
    since: Instant,
    states: usize,
}

/// How long a hand edit that breaks nothing stays excused (its own event arrives well within).
const EDIT_GRACE: Duration = Duration::from_secs(3);

#[derive(Default)]
struct State {
    nodes: BTreeMap<String, (u64, BTreeMap<String, String>)>,
    configmaps: BTreeMap<String, (u64, BTreeMap<String, String>)>,
    history: BTreeMap<String, Vec<(u64, String)>>,
    violation: Option<String>,
    checked: usize,
    synced: [bool; 2],
    heap: BinaryHeap<Pending>,
    /// A hand edit in progress.
    excused: Option<Excuse>,
    /// The newest resourceVersion applied.
    last_rv: u64,
    /// Hand edits repaired: name, excused states, resourceVersion of the repair.
    repaired: Vec<(String, usize, u64)>,
    /// Our part of each object, each state once (see [`InvariantWatcher::our_changes`]).
    our_changes: BTreeMap<String, Vec<String>>,
}

/// The labels the invariants read, as one line of a node's history.
fn summary(labels: &BTreeMap<String, String>) -> String {
    [
        LABEL_DEVICE_PLUGIN_CONFIG,
        LABEL_MIG_CONFIG,
        LABEL_MIG_STATE,
        LABEL_WORKLOAD,
        LABEL_VGPU_CONFIG,
        LABEL_POLICY,
    ]
    .iter()
    .filter_map(|k| labels.get(*k).map(|v| format!("{k}={v}")))
    .collect::<Vec<_>>()
    .join(" ")
}

impl State {
    fn violations_of(&self, labels: &BTreeMap<String, String>) -> Vec<String> {
        let mut out = Vec::new();
        let empty = BTreeMap::new();
        let device = self
            .configmaps
            .get(DEVICE_PLUGIN_CONFIGMAP)
            .map(|(_, d)| d)
            .unwrap_or(&empty);
        let mig = labels.get(LABEL_MIG_CONFIG).map(String::as_str);
        let mig_state = labels.get(LABEL_MIG_STATE).map(String::as_str);
        let mig_enabled = mig.is_some_and(|m| m != DISABLED);
        let mig_confirmed = mig.is_none() || mig_state.is_none_or(|s| s == "success");
        let mut sharing = None;
        if let Some(key) = labels.get(LABEL_DEVICE_PLUGIN_CONFIG) {
            match device.get(key) {
                Some(cfg) => sharing = Some(sharing_of(cfg)),
                None if key == "default" => {}
                None => out.push(format!(
                    "{LABEL_DEVICE_PLUGIN_CONFIG}={key} names no key of {DEVICE_PLUGIN_CONFIGMAP}"
                )),
            }
        }
        if let Some(m) = mig {
            let exists = [MIG_PARTED_CONFIGMAP, DEFAULT_MIG_CONFIGMAP]
                .iter()
                .any(|cm| {
                    self.configmaps
                        .get(*cm)
                        .is_some_and(|(_, d)| layouts_of(d).iter().any(|l| l == m))
                });
            if !exists {
                out.push(format!("{LABEL_MIG_CONFIG}={m} names no MIG layout"));
            }
        }
        if let Some(s) = sharing {
            if (s.mps || s.time_slicing) && !mig_confirmed {
                out.push(format!(
                    "sharing on while MIG layout {mig:?} is not confirmed ({LABEL_MIG_STATE}={mig_state:?})"
                ));
            }
            if s.mps && mig_enabled {
                out.push(format!("MPS on a node with MIG layout {mig:?}"));
            }
            if s.time_slicing && s.mig_strategy_none && mig_enabled {
                out.push(format!(
                    "time-slicing of whole GPUs on a node with MIG layout {mig:?}"
                ));
            }
        }
        if labels
            .get(LABEL_WORKLOAD)
            .is_some_and(|w| w.starts_with("vm-"))
        {
            if sharing.is_some_and(|s| s.mps || s.time_slicing) {
                out.push("a VM host with a container sharing config".into());
            }
            if mig_enabled {
                out.push(format!("a VM host with MIG layout {mig:?}"));
            }
        }
        out
    }

    /// Inside a hand edit: counts the violating nodes; when there are none, the edit is
    /// repaired and the watcher strict again.
    fn check_excused(&mut self, rv: u64) {
        let bad = self
            .nodes
            .values()
            .filter(|(_, l)| !self.violations_of(l).is_empty())
            .count();
        self.checked += self.nodes.len();
        let Some(e) = self.excused.as_mut() else {
            return;
        };
        e.states += bad;
        if bad == 0 && (e.states > 0 || e.since.elapsed() > EDIT_GRACE) {
            self.repaired.push((e.what.clone(), e.states, rv));
            self.excused = None;
        }
    }

    /// Checks every node (a ConfigMap change can break a label that did not change).
    fn check_all(&mut self, rv: u64, only: Option<&str>) {
        if self.violation.is_some() || !(self.synced[0] && self.synced[1]) {
            return;
        }
        if self.excused.is_some() {
            return self.check_excused(rv);
        }
        let names: Vec<String> = match only {
            Some(n) => vec![n.to_string()],
            None => self.nodes.keys().cloned().collect(),
        };
        for name in names {
            let Some((_, labels)) = self.nodes.get(&name) else {
                continue;
            };
            self.checked += 1;
            let v = self.violations_of(labels);
            if !v.is_empty() {
                let history = self
                    .history
                    .get(&name)
                    .map(|h| {
                        h.iter()
                            .map(|(rv, s)| format!("  rv {rv}: {s}"))
                            .collect::<Vec<_>>()
                            .join("\n")
                    })
                    .unwrap_or_default();
                let msg = format!(
                    "invariant violated on node {name} at resourceVersion {rv}: {}\nhistory of {name}:\n{history}",
                    v.join("; ")
                );
                eprintln!("INVARIANT WATCHER: {msg}");
                self.violation = Some(msg);
                return;
            }
        }
    }

    fn apply(&mut self, p: Pending) {
        self.last_rv = self.last_rv.max(p.rv);
        match p.obj {
            Obj::Node(name, labels) => {
                if self.nodes.get(&name).is_some_and(|(rv, _)| *rv >= p.rv) {
                    return;
                }
                let line = summary(&labels);
                let h = self.history.entry(name.clone()).or_default();
                if h.last().is_none_or(|(_, l)| *l != line) {
                    h.push((p.rv, line));
                }
                self.nodes.insert(name.clone(), (p.rv, labels));
                self.check_all(p.rv, Some(&name));
            }
            Obj::NodeGone(name) => {
                self.nodes.remove(&name);
            }
            Obj::ConfigMap(name, data) => {
                if self
                    .configmaps
                    .get(&name)
                    .is_some_and(|(rv, _)| *rv >= p.rv)
                {
                    return;
                }
                self.configmaps.insert(name, (p.rv, data));
                self.check_all(p.rv, None);
            }
            Obj::ConfigMapGone(name) => {
                self.configmaps.remove(&name);
                self.check_all(p.rv, None);
            }
        }
    }

    /// Applies the buffered events old enough that nothing earlier can still arrive.
    fn drain(&mut self, all: bool) {
        while let Some(top) = self.heap.peek() {
            if !all && top.at.elapsed() < REORDER {
                break;
            }
            let p = self.heap.pop().unwrap();
            self.apply(p);
        }
    }
}

/// Judges one observed state for "nothing we do not own changed"; `prev` holds the previous
/// state of each object from the same watch (cleared at a relist), so a change can be
/// attributed.
fn judge<K: serde::Serialize + ResourceExt>(
    s: &Mutex<State>,
    kind: Kind,
    prev: &mut HashMap<String, serde_json::Value>,
    obj: &K,
) {
    let name = obj.name_any();
    let Ok(cur) = serde_json::to_value(obj) else {
        return;
    };
    let bad = ownership::not_ours(kind, prev.get(&name), &cur);
    let part = ownership::our_part(kind, &cur);
    let mut st = s.lock().unwrap();
    let seen = st
        .our_changes
        .entry(format!("{kind:?}/{name}"))
        .or_default();
    if seen.last() != Some(&part) {
        seen.push(part);
    }
    if !bad.is_empty() && st.violation.is_none() {
        let msg = format!(
            "something we do not own changed: {kind:?} {name} at resourceVersion {}: {}",
            rv_of(obj.meta()),
            bad.join("; ")
        );
        eprintln!("INVARIANT WATCHER: {msg}");
        st.violation = Some(msg);
    }
    drop(st);
    prev.insert(name, cur);
}

/// Watches `api`: every state is judged (`judge`), and what `replay` makes of it (`deleted`:
/// the object is gone) is queued for the invariants in resourceVersion order; `synced` is the
/// index of the flag its first complete list sets, if the watcher waits for it.
fn spawn_watch<K>(
    api: Api<K>,
    kind: Kind,
    state: Arc<Mutex<State>>,
    synced: Option<usize>,
    replay: impl Fn(&K, bool) -> Option<Obj> + Send + Sync + 'static,
) -> tokio::task::JoinHandle<()>
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + serde::Serialize + std::fmt::Debug,
    K: Send + Sync + 'static,
{
    tokio::spawn(async move {
        let mut stream = watcher(api, watcher::Config::default())
            .default_backoff()
            .boxed();
        let mut prev = HashMap::new();
        let queue = |o: &K, deleted: bool| {
            if let Some(obj) = replay(o, deleted) {
                state.lock().unwrap().heap.push(Pending {
                    rv: rv_of(o.meta()),
                    at: Instant::now(),
                    obj,
                });
            }
        };
        while let Some(ev) = stream.next().await {
            match ev {
                Ok(watcher::Event::Apply(o) | watcher::Event::InitApply(o)) => {
                    judge(&state, kind, &mut prev, &o);
                    queue(&o, false);
                }
                Ok(watcher::Event::Init) => prev.clear(),
                Ok(watcher::Event::Delete(o)) => {
                    prev.remove(&o.name_any());
                    queue(&o, true);
                }
                Ok(watcher::Event::InitDone) => {
                    if let Some(i) = synced {
                        state.lock().unwrap().synced[i] = true;
                    }
                }
                Err(_) => {}
            }
        }
    })
}

/// Watches from `start` until dropped; [`check`](Self::check) reports.
pub struct InvariantWatcher {
    state: Arc<Mutex<State>>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

fn rv_of(meta: &kube::api::ObjectMeta) -> u64 {
    meta.resource_version
        .as_deref()
        .and_then(|r| r.parse().ok())
        .unwrap_or(0)
}

impl InvariantWatcher {
    /// Starts watching Nodes and the ConfigMaps of namespace `ns`; returns once both initial
    /// lists are in.
    pub async fn start(client: &Client, ns: &str) -> InvariantWatcher {
        let state = Arc::new(Mutex::new(State::default()));
        let node_task = spawn_watch(
            Api::<Node>::all(client.clone()),
            Kind::Node,
            state.clone(),
            Some(0),
            |n, deleted| {
                Some(if deleted {
                    Obj::NodeGone(n.name_any())
                } else {
                    Obj::Node(n.name_any(), n.labels().clone())
                })
            },
        );
        let cm_task = spawn_watch(
            Api::<ConfigMap>::namespaced(client.clone(), ns),
            Kind::ConfigMap,
            state.clone(),
            Some(1),
            |c, deleted| {
                Some(if deleted {
                    Obj::ConfigMapGone(c.name_any())
                } else {
                    Obj::ConfigMap(c.name_any(), c.data.clone().unwrap_or_default())
                })
            },
        );
        // The ClusterPolicy only for ownership (its CRD may not be served: not waited for).
        let cp_task = spawn_watch(
            Api::<DynamicObject>::all_with(client.clone(), &cluster_policy_resource()),
            Kind::ClusterPolicy,
            state.clone(),
            None,
            |_, _| None,
        );
        let s = state.clone();
        let drain_task = tokio::spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_millis(100)).await;
                s.lock().unwrap().drain(false);
            }
        });
        let w = InvariantWatcher {
            state,
            tasks: vec![node_task, cm_task, cp_task, drain_task],
        };
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            {
                let mut st = w.state.lock().unwrap();
                if st.synced[0] && st.synced[1] {
                    st.drain(true);
                    st.check_all(0, None);
                    break;
                }
            }
            assert!(
                Instant::now() < deadline,
                "the invariant watcher's initial lists"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        w
    }

    /// The test is about to break the invariants itself with the edit `what` (see the module
    /// documentation). Waits for the events in flight first, so that earlier states are judged
    /// strictly.
    pub async fn hand_edit(&self, what: &str) {
        tokio::time::sleep(REORDER + Duration::from_millis(200)).await;
        let mut st = self.state.lock().unwrap();
        st.drain(true);
        assert!(
            st.excused.is_none(),
            "hand edit {what:?} while {:?} is not repaired yet",
            st.excused
        );
        st.excused = Some(Excuse {
            what: what.to_string(),
            since: Instant::now(),
            states: 0,
        });
    }

    /// Waits (up to `timeout`) until the last hand edit is repaired; returns the node states
    /// it excused.
    pub async fn repaired(&self, timeout: Duration) -> usize {
        let deadline = Instant::now() + timeout;
        loop {
            {
                let mut st = self.state.lock().unwrap();
                st.drain(false);
                if let Some(v) = &st.violation {
                    panic!("{v}");
                }
                if st.excused.is_some() {
                    let rv = st.last_rv;
                    st.check_all(rv, None);
                }
                if st.excused.is_none() {
                    let (what, n, rv) = st.repaired.last().cloned().expect("a hand edit");
                    eprintln!(
                        "hand edit {what:?} repaired at resourceVersion {rv} ({n} node states excused)"
                    );
                    return n;
                }
                assert!(
                    Instant::now() < deadline,
                    "hand edit {:?} not repaired within {timeout:?}",
                    st.excused
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Panics with the first violation (and that node's history) seen so far, after letting
    /// the events in flight arrive. Returns how many node states were checked.
    pub async fn check(&self) -> usize {
        tokio::time::sleep(REORDER + Duration::from_millis(200)).await;
        let mut st = self.state.lock().unwrap();
        st.drain(true);
        if let Some(v) = &st.violation {
            panic!("{v}");
        }
        st.checked
    }
}

impl InvariantWatcher {
    /// Every state of our part of each object (`Node/<name>`, `ConfigMap/<name>`,
    /// `ClusterPolicy/<name>`) in the order seen, from its first sight: one entry per write of
    /// ours that changed it (and per hand edit of it).
    pub async fn our_changes(&self) -> BTreeMap<String, Vec<String>> {
        tokio::time::sleep(REORDER + Duration::from_millis(200)).await;
        self.state.lock().unwrap().our_changes.clone()
    }

    /// [`check`](Self::check) without waiting (for a guard's `Drop`): judges the events already
    /// received.
    pub fn check_now(&self) -> usize {
        let mut st = self.state.lock().unwrap();
        st.drain(true);
        if let Some(v) = &st.violation {
            panic!("{v}");
        }
        st.checked
    }
}

impl Drop for InvariantWatcher {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}
