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
//!   `none`) or MPS never on a node whose MIG layout is enabled or whose GPUs have MIG on.
//!   "Confirmed" and "MIG on" come from the simulated MIG manager's own record on the node
//!   (its `simulator.gpusharing.io/` annotations: the layout it last applied, its error, each
//!   GPU's MIG state), never from a label the operator's field manager writes
//!   (`nvidia.com/mig.config.state` is one of those);
//! - a VM host (`nvidia.com/gpu.workload.config=vm-*`) never carries a container sharing config
//!   or an enabled MIG layout;
//! - a node on which GPU pods run (bound, not finished, asking for `nvidia.com/gpu*` or
//!   `nvidia.com/mig-*`) never gets another `nvidia.com/mig.config` or
//!   `nvidia.com/gpu.workload.config`: its GPUs change only when idle (drains evict first);
//! - no GPU is ever allocated through DRA (an allocated `gpu.nvidia.com` ResourceClaim on a
//!   node, KEP-5004's generated claims included) while a device-plugin GPU pod runs on that
//!   node (bound, not finished, its GPU request not served through DRA): the DRA allocator
//!   cannot see the device plugin's allocations, so both at once hand a GPU out twice;
//! - nothing we do not own changed: every state of every Node, ConfigMap, ClusterPolicy and Pod
//!   is judged by [`super::ownership`] from the API server's field-manager records.
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
use kube::runtime::watcher;
use kube::{Api, Client, ResourceExt};

use super::ownership::{self, Kind};
use gpu_sharing_operator::runtime::controller::cluster_policy_resource;

use gpu_sharing_operator::api::names::*;

const DISABLED: &str = "all-disabled";
/// How long an event waits for events of lower resourceVersion from the other watch.
const REORDER: Duration = Duration::from_millis(600);

#[derive(Debug, Clone)]
enum Obj {
    /// A node's labels, and its annotations written by the simulator.
    Node(String, BTreeMap<String, String>, BTreeMap<String, String>),
    NodeGone(String),
    ConfigMap(String, BTreeMap<String, String>),
    ConfigMapGone(String),
    /// A pod (`namespace/name`) and the node whose GPUs it holds now, if any, with whether
    /// kube-scheduler served its request through DRA (extended resources).
    Pod(String, Option<(String, bool)>),
    PodGone(String),
    /// A ResourceClaim (`namespace/name`) and the node of its `gpu.nvidia.com` allocation.
    Claim(String, Option<String>),
    ClaimGone(String),
}

/// The node whose GPUs a pod holds (bound, not finished, asking for NVIDIA's device-plugin
/// resources), and whether kube-scheduler served the request through DRA.
fn gpu_node(p: &k8s_openapi::api::core::v1::Pod) -> Option<(String, bool)> {
    let spec = p.spec.as_ref()?;
    let phase = p.status.as_ref().and_then(|s| s.phase.as_deref());
    if matches!(phase, Some("Succeeded" | "Failed")) {
        return None;
    }
    let gpu = spec.containers.iter().any(|c| {
        let r = c.resources.as_ref();
        [
            r.and_then(|r| r.limits.as_ref()),
            r.and_then(|r| r.requests.as_ref()),
        ]
        .into_iter()
        .flatten()
        .flat_map(|m| m.keys())
        .any(|k| k.starts_with("nvidia.com/gpu") || k.starts_with("nvidia.com/mig-"))
    });
    // Served through DRA: every NVIDIA resource it asks for is mapped to its generated claim.
    let mapped = (p.status.as_ref())
        .and_then(|s| s.extended_resource_claim_status.as_ref())
        .map(|x| {
            x.request_mappings
                .iter()
                .map(|m| m.resource_name.as_str())
                .collect::<Vec<_>>()
        });
    let dra = mapped.is_some_and(|m| {
        spec.containers
            .iter()
            .filter_map(|c| c.resources.as_ref())
            .flat_map(|r| {
                r.limits
                    .iter()
                    .chain(r.requests.iter())
                    .flat_map(|m| m.keys())
            })
            .filter(|k| k.starts_with("nvidia.com/gpu") || k.starts_with("nvidia.com/mig-"))
            .all(|k| m.contains(&k.as_str()))
    });
    spec.node_name.clone().filter(|_| gpu).map(|n| (n, dra))
}

/// The node of a claim's `gpu.nvidia.com` allocation (NVIDIA's driver names each node's pool
/// after the node).
fn claim_node(c: &k8s_openapi::api::resource::v1::ResourceClaim) -> Option<String> {
    let results = c.status.as_ref()?.allocation.as_ref()?.devices.as_ref()?;
    (results.results.iter().flatten())
        .find(|r| r.driver == DRA_DRIVER)
        .map(|r| r.pool.clone())
}

/// Labels that change what a node's GPUs are: never while GPU pods run there.
const GPU_SHAPE_LABELS: [&str; 2] = [LABEL_MIG_CONFIG, LABEL_WORKLOAD];

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

/// A node's labels and the simulator's annotations on it.
type NodeSeen = (BTreeMap<String, String>, BTreeMap<String, String>);

#[derive(Default)]
struct State {
    nodes: BTreeMap<String, (u64, NodeSeen)>,
    configmaps: BTreeMap<String, (u64, BTreeMap<String, String>)>,
    history: BTreeMap<String, Vec<(u64, String)>>,
    violation: Option<String>,
    checked: usize,
    synced: [bool; 4],
    heap: BinaryHeap<Pending>,
    /// A hand edit in progress.
    excused: Option<Excuse>,
    /// The newest resourceVersion applied.
    last_rv: u64,
    /// Hand edits repaired: name, excused states, resourceVersion of the repair.
    repaired: Vec<(String, usize, u64)>,
    /// Our part of each object, each state once (see [`InvariantWatcher::our_changes`]).
    our_changes: BTreeMap<String, Vec<String>>,
    /// Watch errors not yet followed by a complete re-list of that watch, by watch.
    unrecovered: BTreeMap<&'static str, String>,
    /// Watch errors seen (each followed by a re-list).
    watch_errors: usize,
    /// Pods holding GPUs: `namespace/name` -> node.
    gpu_pods: BTreeMap<String, String>,
    /// Those of `gpu_pods` kube-scheduler served through DRA.
    dra_served: std::collections::BTreeSet<String>,
    /// Allocated `gpu.nvidia.com` ResourceClaims: `namespace/name` -> node.
    dra_claims: BTreeMap<String, String>,
}

/// The simulated MIG manager's own record on a node (`tests/nvidia/internal/sim`): these
/// annotations are written only by the simulator, never by the operator.
pub const SIM_ANNOTATIONS: &str = "simulator.gpusharing.io/";
const SIM_HARDWARE: &str = "simulator.gpusharing.io/hardware";
const SIM_APPLIED_MIG: &str = "simulator.gpusharing.io/applied-mig-config";
const SIM_MIG_GEOMETRY: &str = "simulator.gpusharing.io/mig-geometry";
const SIM_MIG_ERROR: &str = "simulator.gpusharing.io/mig-manager-error";

/// What the MIG manager (the simulator) says about a node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MigRecord {
    /// The GPUs can do MIG (the simulator's recorded hardware, else GFD's
    /// `nvidia.com/mig.capable` label, which the operator never writes).
    pub capable: bool,
    /// The `nvidia.com/mig.config` value it last acted on, success or failure.
    pub applied: Option<String>,
    /// Its last action failed.
    pub failed: bool,
    /// GPUs with MIG mode on, from its geometry (none before its first successful apply).
    pub mig_on_gpus: usize,
}

impl MigRecord {
    pub fn of(labels: &BTreeMap<String, String>, annotations: &BTreeMap<String, String>) -> Self {
        let json = |k: &str| {
            annotations
                .get(k)
                .and_then(|v| serde_json::from_str::<serde_json::Value>(v).ok())
        };
        let capable = match json(SIM_HARDWARE) {
            Some(hw) => hw["migCapable"] == true,
            None => labels.get("nvidia.com/mig.capable").map(String::as_str) == Some("true"),
        };
        let mig_on_gpus = json(SIM_MIG_GEOMETRY)
            .and_then(|g| g.as_array().cloned())
            .map(|gpus| gpus.iter().filter(|g| g["e"] == true).count())
            .unwrap_or(0);
        MigRecord {
            capable,
            applied: annotations.get(SIM_APPLIED_MIG).cloned(),
            failed: annotations.contains_key(SIM_MIG_ERROR),
            mig_on_gpus,
        }
    }

    /// The MIG manager is done with the node's `nvidia.com/mig.config` value `layout`: it
    /// applied exactly that layout and did not fail. A node without the label is confirmed
    /// only while no GPU has MIG on; a GPU that cannot do MIG has nothing to confirm.
    pub fn confirms(&self, layout: Option<&str>) -> bool {
        if !self.capable {
            return true;
        }
        match layout {
            None => self.mig_on_gpus == 0,
            Some(l) => self.applied.as_deref() == Some(l) && !self.failed,
        }
    }
}

/// The simulator's annotations of a node (the MIG manager's and device plugin's record).
pub fn sim_annotations(n: &Node) -> BTreeMap<String, String> {
    n.annotations()
        .iter()
        .filter(|(k, _)| k.starts_with(SIM_ANNOTATIONS))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect()
}

/// The labels and records the invariants read, as one line of a node's history.
fn summary(labels: &BTreeMap<String, String>, annotations: &BTreeMap<String, String>) -> String {
    let m = MigRecord::of(labels, annotations);
    let record = format!(
        " [MIG manager: applied={:?} failed={} mig-on GPUs={}]",
        m.applied, m.failed, m.mig_on_gpus
    );
    let labels = [
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
    .join(" ");
    labels + &record
}

impl State {
    fn violations_of(&self, (labels, annotations): &NodeSeen) -> Vec<String> {
        let mut out = Vec::new();
        let empty = BTreeMap::new();
        let device = self
            .configmaps
            .get(DEVICE_PLUGIN_CONFIGMAP)
            .map(|(_, d)| d)
            .unwrap_or(&empty);
        let mig = labels.get(LABEL_MIG_CONFIG).map(String::as_str);
        let mig_state = labels.get(LABEL_MIG_STATE).map(String::as_str);
        let record = MigRecord::of(labels, annotations);
        // MIG on: asked for (the label) or still there (the MIG manager's geometry).
        let mig_enabled = mig.is_some_and(|m| m != DISABLED) || record.mig_on_gpus > 0;
        let mig_confirmed = record.confirms(mig);
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
                    "sharing on while MIG layout {mig:?} is not confirmed by the MIG manager ({record:?}; {LABEL_MIG_STATE}={mig_state:?})"
                ));
            }
            if s.mps && mig_enabled {
                out.push(format!(
                    "MPS on a node with MIG layout {mig:?} ({} GPUs with MIG on)",
                    record.mig_on_gpus
                ));
            }
            if s.time_slicing && s.mig_strategy_none && mig_enabled {
                out.push(format!(
                    "time-slicing of whole GPUs on a node with MIG layout {mig:?} ({} GPUs with MIG on)",
                    record.mig_on_gpus
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
                out.push(format!(
                    "a VM host with MIG layout {mig:?} ({} GPUs with MIG on)",
                    record.mig_on_gpus
                ));
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
            .filter(|(_, seen)| !self.violations_of(seen).is_empty())
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
        if self.violation.is_some() || !self.synced.iter().all(|s| *s) {
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
            let Some((_, seen)) = self.nodes.get(&name) else {
                continue;
            };
            self.checked += 1;
            let v = self.violations_of(seen);
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
            Obj::Node(name, labels, annotations) => {
                if self.nodes.get(&name).is_some_and(|(rv, _)| *rv >= p.rv) {
                    return;
                }
                self.check_busy_relabel(&name, &labels, p.rv);
                let line = summary(&labels, &annotations);
                let h = self.history.entry(name.clone()).or_default();
                if h.last().is_none_or(|(_, l)| *l != line) {
                    h.push((p.rv, line));
                }
                self.nodes
                    .insert(name.clone(), (p.rv, (labels, annotations)));
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
            Obj::Pod(key, Some((node, dra))) => {
                match dra {
                    true => self.dra_served.insert(key.clone()),
                    false => self.dra_served.remove(&key),
                };
                self.gpu_pods.insert(key, node.clone());
                self.check_both_backends(&node, p.rv);
            }
            Obj::Pod(key, None) | Obj::PodGone(key) => {
                self.gpu_pods.remove(&key);
                self.dra_served.remove(&key);
            }
            Obj::Claim(key, Some(node)) => {
                self.dra_claims.insert(key, node.clone());
                self.check_both_backends(&node, p.rv);
            }
            Obj::Claim(key, None) | Obj::ClaimGone(key) => {
                self.dra_claims.remove(&key);
            }
        }
    }

    /// A GPU allocated through DRA on a node where a device-plugin GPU pod runs.
    fn check_both_backends(&mut self, node: &str, rv: u64) {
        if self.violation.is_some() {
            return;
        }
        let on = |(_, n): &(&String, &String)| *n == node;
        let device_plugin: Vec<&String> = (self.gpu_pods.iter())
            .filter(on)
            .filter(|(p, _)| !self.dra_served.contains(*p))
            .map(|(p, _)| p)
            .collect();
        let claims: Vec<&String> = self.dra_claims.iter().filter(on).map(|(c, _)| c).collect();
        if device_plugin.is_empty() || claims.is_empty() {
            return;
        }
        let msg = format!(
            "node {node} at resourceVersion {rv}: GPUs allocated through DRA ({claims:?}) while device-plugin GPU pods run on it ({device_plugin:?})"
        );
        eprintln!("INVARIANT WATCHER: {msg}");
        self.violation = Some(msg);
    }

    /// A node whose GPU-shaping labels change while GPU pods run on it.
    fn check_busy_relabel(&mut self, name: &str, labels: &BTreeMap<String, String>, rv: u64) {
        if self.violation.is_some() || self.excused.is_some() {
            return;
        }
        let Some((_, (old, _))) = self.nodes.get(name) else {
            return;
        };
        let changed: Vec<String> = GPU_SHAPE_LABELS
            .iter()
            .filter(|k| old.get(**k) != labels.get(**k))
            .map(|k| format!("{k}: {:?} -> {:?}", old.get(*k), labels.get(*k)))
            .collect();
        let pods: Vec<&String> = self
            .gpu_pods
            .iter()
            .filter(|(_, n)| *n == name)
            .map(|(p, _)| p)
            .collect();
        if changed.is_empty() || pods.is_empty() {
            return;
        }
        let msg = format!(
            "node {name} relabelled at resourceVersion {rv} while GPU pods run on it ({pods:?}): {}",
            changed.join(", ")
        );
        eprintln!("INVARIANT WATCHER: {msg}");
        self.violation = Some(msg);
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
/// index of the flag its first complete list sets, if the watcher waits for it. A watch error
/// is never ignored: the watch is started again from a fresh list, and the error counts as
/// unrecovered (failing [`InvariantWatcher::check`]) until that list is complete.
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
    let name: &'static str = match kind {
        Kind::Node => "nodes",
        Kind::ConfigMap => "configmaps",
        Kind::ClusterPolicy => "clusterpolicies",
        Kind::Pod => "pods",
        Kind::ResourceClaim => "resourceclaims",
    };
    tokio::spawn(async move {
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
        loop {
            let mut stream = watcher(api.clone(), watcher::Config::default()).boxed();
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
                        let mut st = state.lock().unwrap();
                        if let Some(i) = synced {
                            st.synced[i] = true;
                        }
                        st.unrecovered.remove(name);
                    }
                    // The ClusterPolicy watch (not waited for) may have no CRD to watch.
                    Err(_) if synced.is_none() => break,
                    Err(e) => {
                        eprintln!("invariant watcher: {name} watch error: {e}; listing again");
                        let mut st = state.lock().unwrap();
                        st.watch_errors += 1;
                        st.unrecovered.insert(name, e.to_string());
                        break;
                    }
                }
            }
            // The CRD of the ClusterPolicy may not be served, and a restarting API server
            // refuses connections for a while: do not spin.
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    })
}

/// Watches from `start` until dropped; [`check`](Self::check) reports. The watches run on a
/// thread and runtime of their own with a client of their own, so they go on receiving while
/// the test's runtime is blocked (in a `Drop`, for the final check).
pub struct InvariantWatcher {
    state: Arc<Mutex<State>>,
    stop: Mutex<Option<tokio::sync::oneshot::Sender<()>>>,
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
    /// Turned off by the test ([`InvariantWatcher::turn_off`]): no final check.
    off: std::sync::atomic::AtomicBool,
}

fn rv_of(meta: &kube::api::ObjectMeta) -> u64 {
    meta.resource_version
        .as_deref()
        .and_then(|r| r.parse().ok())
        .unwrap_or(0)
}

/// Starts the watches on the current runtime; returns their tasks.
async fn watch_all(
    client: Client,
    ns: String,
    state: Arc<Mutex<State>>,
) -> Vec<tokio::task::JoinHandle<()>> {
    let node_task = spawn_watch(
        Api::<Node>::all(client.clone()),
        Kind::Node,
        state.clone(),
        Some(0),
        |n, deleted| {
            Some(if deleted {
                Obj::NodeGone(n.name_any())
            } else {
                Obj::Node(n.name_any(), n.labels().clone(), sim_annotations(n))
            })
        },
    );
    let cm_task = spawn_watch(
        Api::<ConfigMap>::namespaced(client.clone(), &ns),
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
    // The ClusterPolicy only for ownership (its CRD may not be served: not waited for, and
    // its watch errors do not count).
    let cp_task = spawn_watch(
        Api::<DynamicObject>::all_with(client.clone(), &cluster_policy_resource()),
        Kind::ClusterPolicy,
        state.clone(),
        None,
        |_, _| None,
    );
    let pod_task = spawn_watch(
        Api::<k8s_openapi::api::core::v1::Pod>::all(client.clone()),
        Kind::Pod,
        state.clone(),
        Some(2),
        |p, deleted| {
            let key = format!("{}/{}", p.namespace().unwrap_or_default(), p.name_any());
            Some(if deleted {
                Obj::PodGone(key)
            } else {
                Obj::Pod(key, gpu_node(p))
            })
        },
    );
    let claim_task = spawn_watch(
        Api::<k8s_openapi::api::resource::v1::ResourceClaim>::all(client.clone()),
        Kind::ResourceClaim,
        state.clone(),
        Some(3),
        |c, deleted| {
            let key = format!("{}/{}", c.namespace().unwrap_or_default(), c.name_any());
            Some(if deleted {
                Obj::ClaimGone(key)
            } else {
                Obj::Claim(key, claim_node(c))
            })
        },
    );
    let s = state.clone();
    let drain_task = tokio::spawn(async move {
        loop {
            tokio::time::sleep(Duration::from_millis(100)).await;
            s.lock().unwrap().drain(false);
        }
    });
    vec![
        node_task, cm_task, cp_task, pod_task, claim_task, drain_task,
    ]
}

impl InvariantWatcher {
    /// Starts watching Nodes and the ConfigMaps of namespace `ns` of the control plane that
    /// `kubeconfig` reaches; returns once both initial lists are in.
    pub async fn start(kubeconfig: &std::path::Path, ns: &str) -> InvariantWatcher {
        let state = Arc::new(Mutex::new(State::default()));
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let (kubeconfig, ns, st) = (kubeconfig.to_path_buf(), ns.to_string(), state.clone());
        let thread = std::thread::Builder::new()
            .name("invariant-watcher".into())
            .spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .expect("the invariant watcher's runtime");
                rt.block_on(async move {
                    let client = testkit::client_from_kubeconfig(&kubeconfig)
                        .await
                        .expect("the invariant watcher's client");
                    let tasks = watch_all(client, ns, st).await;
                    stopped.await.ok();
                    for t in tasks {
                        t.abort();
                    }
                });
            })
            .expect("the invariant watcher's thread");
        let w = InvariantWatcher {
            state,
            stop: Mutex::new(Some(stop)),
            thread: Mutex::new(Some(thread)),
            off: Default::default(),
        };
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            {
                let mut st = w.state.lock().unwrap();
                if st.synced.iter().all(|s| *s) {
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

    /// No final check (the test breaks the invariants on purpose and does not repair them).
    pub fn turn_off(&self) {
        self.off.store(true, std::sync::atomic::Ordering::Relaxed);
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
                if let Some(v) = st.violation.clone() {
                    drop(st);
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
        self.verdict()
    }

    /// Judges everything received: the first violation, or a watch error whose watch has not
    /// listed again (states were missed and never judged), fails.
    fn verdict(&self) -> usize {
        let mut st = self.state.lock().unwrap();
        st.drain(true);
        // Panics after the lock is released: the watches go on (and a later check works).
        let failure = st.violation.clone().or_else(|| {
            (!st.unrecovered.is_empty()).then(|| {
                format!(
                    "invariant watcher: watch errors without a complete re-list since: {:?}",
                    st.unrecovered
                )
            })
        });
        if let Some(f) = failure {
            drop(st);
            panic!("{f}");
        }
        if st.watch_errors > 0 {
            eprintln!(
                "invariant watcher: {} watch errors, each followed by a complete re-list",
                st.watch_errors
            );
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

    /// The final check, from a `Drop` while the control plane still runs (see
    /// [`testkit::TestCluster::before_stop`]): blocks the calling thread through the
    /// reorder window (the watches run on their own thread meanwhile), then judges. Returns
    /// `None` when the test turned the watcher off.
    pub fn final_check(&self) -> Option<usize> {
        if self.off.load(std::sync::atomic::Ordering::Relaxed) {
            return None;
        }
        std::thread::sleep(REORDER + Duration::from_millis(200));
        Some(self.verdict())
    }
}

impl Drop for InvariantWatcher {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.lock().unwrap().take() {
            stop.send(()).ok();
        }
        if let Some(t) = self.thread.lock().unwrap().take() {
            t.join().ok();
        }
    }
}

#[cfg(test)]
mod both_backends_tests {
    use super::*;

    fn event(rv: u64, obj: Obj) -> Pending {
        Pending {
            rv,
            at: Instant::now(),
            obj,
        }
    }

    /// The rule's own test: a DRA allocation next to a device-plugin pod is caught, next to a
    /// pod kube-scheduler served through DRA it is not, and on another node neither.
    #[test]
    fn a_dra_allocation_beside_a_device_plugin_pod_is_a_violation() {
        let mut st = State::default();
        st.apply(event(1, Obj::Pod("t/dra".into(), Some(("a".into(), true)))));
        st.apply(event(2, Obj::Claim("t/dra-claim".into(), Some("a".into()))));
        st.apply(event(3, Obj::Pod("t/dp".into(), Some(("b".into(), false)))));
        assert_eq!(st.violation, None);
        st.apply(event(4, Obj::Pod("t/dp".into(), None)));
        st.apply(event(
            5,
            Obj::Pod("t/late".into(), Some(("a".into(), false))),
        ));
        let v = st.violation.expect("caught");
        assert!(v.contains("node a") && v.contains("t/late"), "{v}");
    }
}
