//! Demand-driven MIG (`spec.mig.dynamic`): which idle node of a policy gets which layout of its
//! catalogue, for the pods the scheduler could not place because no node offers the MIG profile
//! they ask for.
//!
//! Pure and deterministic. A node's layout under a dynamic policy is recorded on the node
//! (annotation [`ANNOTATION_MIG_DEMAND`], `<layout>@<unix seconds>`), so a restart loses nothing
//! and the per-node transition (`mig::decide`: idle GPUs, the MIG manager, the rollout gate)
//! brings the node there like any other layout change. Here:
//!
//! 1. **Supply**: per node, the free instances (NVIDIA's allocatable minus what bound pods
//!    request) of a configured node, or the instances a node being reshaped will bring
//!    (`coming`), from the geometry model.
//! 2. **Residual demand**: the pending pods, highest priority first then oldest, each placed
//!    whole on the first node (by name) whose supply holds it and whose labels it accepts; the
//!    pods left over are the residual demand.
//! 3. **Choice**: when the demand has been quiet for `quietSeconds` (or waited `maxDelaySeconds`),
//!    for each idle node past its cooldown, each catalogue layout: the residual pods it would
//!    hold, minus the pods its current free instances held. The best (node, layout), by served
//!    pods per priority level, then node and catalogue order, is taken while the rollout
//!    budget lasts and it serves more than the node does now.
//! 4. **Why**: per profile, what is pending, served and coming, and for the rest the first
//!    reason that applies to its pods.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;

use crate::api::crd::{
    DEFAULT_DRAIN_TIMEOUT_SECONDS, DemandStatus, DynamicMig, Mig, ProfileDemand, RecentDrain,
};
use crate::api::names::{
    ANNOTATION_CORDONED, ANNOTATION_MIG_DEMAND, LABEL_GPU_COUNT, LABEL_GPU_MEMORY,
    LABEL_GPU_PRODUCT, LABEL_MIG_CONFIG, LABEL_WORKLOAD,
};

use super::admit::selects_namespace;
use super::capacity::{layout_resources, mig_on_every_gpu};
use super::compat::{mig_profile_refusal, node_rejection};
use super::decision::mig_of;
use super::disruption::{MIN_LIFETIME_WITH_BUSY_NODES, demand_drain};
use super::facts::is_vm_host;
use super::geometry::{NodeModel, node_model, node_refusal};
use super::input::NodeView;
use super::input::PendingPod;
use super::input::PlanInput;
use super::policies::Prepared;
use super::targets::{catalogue, node_layout, recorded};

/// Why demand waits.
pub const PROFILE_NOT_IN_CATALOGUE: &str = "ProfileNotInCatalogue";
pub const NO_MATCHING_NODE: &str = "NoMatchingNode";
pub const NO_IDLE_NODE: &str = "NoIdleNode";
pub const COOLDOWN: &str = "Cooldown";
pub const BUDGET_EXHAUSTED: &str = "BudgetExhausted";
/// The policy's rollout is paused or halted: demand starts no reshape until it resumes.
pub const ROLLOUT_STOPPED: &str = "RolloutStopped";
pub const INFEASIBLE: &str = "Infeasible";
/// Every reshape that would serve the pod takes instances of a profile away from a pool that
/// would then hold fewer than its running and pending pods ask for.
pub const PROFILE_IN_USE: &str = "ProfileInUse";
/// Demand younger than the quiet period (and the maximum delay) is left to batch.
pub const BATCHING: &str = "Batching";

/// What demand planning decided.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct DemandPlan {
    /// Annotation values to write (`Some`) or remove (`None`), by node.
    pub annotations: BTreeMap<String, Option<String>>,
    /// Each dynamic policy's `status.demand`.
    pub statuses: BTreeMap<String, DemandStatus>,
    /// Events for pods the operator acts for: `(namespace/name, node reshaped, message)`.
    pub events: Vec<(String, String, String)>,
    /// Nodes chosen now that are drained first (`drainBusyNodes`): the GPU pods evicted.
    pub drains: BTreeMap<String, usize>,
    /// Seconds after which demand may be acted on without any other change (quiet period,
    /// idle time, cooldown running out).
    pub recheck_in: Option<i64>,
    /// Nodes whose drain for demand is given up before its first eviction: the pods it was
    /// for are gone (the rollout's drain path must not evict on them in this pass).
    pub given_up: BTreeSet<String>,
}

/// One node of a dynamic policy as demand planning sees it.
struct Node<'a> {
    view: &'a NodeView,
    /// The layout it should run (recorded, or the policy's).
    layout: String,
    /// Since when (unix seconds) it has had that layout recorded (0: the policy's own, always).
    since: i64,
    /// The MIG manager confirmed `layout` and the device plugin advertises it.
    configured: bool,
    /// The MIG manager failed on `layout`: the node is held, out of demand's reach.
    failed: bool,
    /// Free instances now (configured) or the instances the layout will bring (reshaping).
    supply: BTreeMap<String, i64>,
    /// Under `drainBusyNodes`, the priorities of the GPU pods a drain would evict (none for an
    /// idle node, and none under `reserveBusyNodes`, which waits for them); `None` when demand
    /// may not take it busy (neither setting, or a pod above the ceiling or protected by
    /// `disruption.neverEvict`).
    evicts: Option<Vec<i32>>,
    /// When its youngest GPU pod started (see [`youngest_pod`]): reshapes are asked of the
    /// nodes likeliest to empty first.
    young: i64,
}

/// A layout's device-plugin resources on a node: resource -> count.
type Resources = Arc<BTreeMap<String, i64>>;
/// A pod's request as device-plugin resources.
type Request = Vec<(String, i64)>;

/// Pods' served counts per priority level (highest first): compared lexicographically.
type Score = Vec<i64>;

/// One reshape considered: the node (its index), the layout, the residual pods it would hold,
/// the placed pods it would displace and the running GPU pods a drain would evict.
struct Choice {
    node: usize,
    layout: String,
    gained: Vec<usize>,
    lost: Vec<usize>,
    evicted: usize,
    /// GPU pods running there (a reserved node waits for them).
    running: usize,
}

struct Policy<'a, 'p> {
    w: &'a Prepared<'p>,
    dynamic: &'a DynamicMig,
    nodes: Vec<Node<'a>>,
    now: i64,
    /// Per node: what decides which pods it may take and what a layout gives it (the values
    /// of the label keys pending pods select on, its taints, and its GPU labels). Nodes of one
    /// class are interchangeable, so each question is asked once per class.
    class: Vec<String>,
    offers: &'a Offers<'a>,
    /// A taint key not judged (the readiness taint, which the operator removes).
    transient: Option<&'a str>,
    /// Pending pods the bounds of admission left out (see [`super::admit`]).
    ignored: &'a [crate::api::crd::IgnoredDemand],
    /// Drains for demand in the last hour (from the policy's status), oldest first.
    recent: Vec<RecentDrain>,
    /// Drains chosen in this pass.
    drained_now: std::cell::Cell<usize>,
    /// Why the policy's rollout starts no node change (paused, or halted as its status
    /// records): demand then chooses no node, and gives up choices of busy nodes whose wait
    /// has not begun (their reservation or drain could not start).
    stopped: Option<String>,
}

/// Why `w`'s rollout starts no node change, as the gate will see it: paused (`--pause-rollouts`
/// or `spec.paused`), or halted for this generation (its status).
fn rollout_stopped(w: &Prepared, pause_all: bool) -> Option<String> {
    if pause_all || w.spec.paused {
        return Some("the policy's rollout is paused".into());
    }
    super::rollout::recorded_halt(w).map(|nodes| {
        format!(
            "the policy's rollout is halted ({}); edit the policy to resume",
            nodes.join("; ")
        )
    })
}

/// Seconds a drain counts against `maxDrainsPerHour`.
const DRAIN_WINDOW: i64 = 3600;

/// The policy's drains for demand in the hour before `now` (a time in the future counts as
/// now), oldest first.
fn recent_drains(w: &Prepared, now: i64) -> Vec<RecentDrain> {
    let status = w.policy.status.as_ref().and_then(|s| s.demand.as_ref());
    let mut recent: Vec<RecentDrain> = status
        .map(|d| d.recent_drains.clone())
        .unwrap_or_default()
        .into_iter()
        .map(|r| RecentDrain {
            at: r.at.min(now),
            ..r
        })
        .filter(|r| now - r.at < DRAIN_WINDOW)
        .collect();
    recent.sort_by_key(|r| r.at);
    recent
}

/// A layout's device-plugin resources on a node, per (layout, GPU labels), computed once a
/// pass; `None` for a layout the node's GPUs cannot take (a profile their model does not have).
struct Offers<'a> {
    mig: &'a Mig,
    own: String,
    base: Option<&'a BTreeMap<String, serde_json::Value>>,
    cache: std::cell::RefCell<HashMap<(String, String), Option<Resources>>>,
    mig_on: std::cell::RefCell<HashMap<String, bool>>,
}

impl Offers<'_> {
    fn get(&self, v: &NodeView, layout: &str) -> Option<Resources> {
        let key = (layout.to_string(), gpu_key(v));
        if let Some(hit) = self.cache.borrow().get(&key) {
            return hit.clone();
        }
        let named = (layout != self.own).then_some(layout);
        let got = layout_resources(self.mig, named, v, self.base)
            .filter(|r| named.is_none_or(|l| takes(&self.mig.with_layout(l), v, r)))
            .map(Arc::new);
        self.cache.borrow_mut().insert(key, got.clone());
        got
    }

    /// Whether `layout` has MIG on on every GPU. Demand moves a node only between such layouts:
    /// a MIG mode change resets every GPU of the node (or reboots it), which no pod's demand
    /// is worth; a policy's own layout may leave MIG off on some GPUs.
    fn mig_on(&self, layout: &str) -> bool {
        if let Some(&hit) = self.mig_on.borrow().get(layout) {
            return hit;
        }
        let named = (layout != self.own).then_some(layout);
        let on = mig_on_every_gpu(self.mig, named, self.base);
        self.mig_on.borrow_mut().insert(layout.to_string(), on);
        on
    }
}

/// Whether node `v`'s GPUs can take named layout `mig` bringing `resources`: every profile exists
/// on their model (when GFD's labels name a known one) and fits their memory. NVIDIA's own
/// `all-3g.71gb` has one entry for every GPU: mig-parted would fail it on an A100.
fn takes(mig: &Mig, v: &NodeView, resources: &BTreeMap<String, i64>) -> bool {
    if mig_profile_refusal(mig, v).is_some() {
        return false;
    }
    let NodeModel::Known(model) = node_model(v) else {
        return true;
    };
    resources
        .keys()
        .filter(|r| r.starts_with("nvidia.com/mig-"))
        .all(|r| {
            let r = r.trim_end_matches(".shared");
            model
                .profiles
                .iter()
                .any(|p| crate::nvidia::mig_resource(p.name) == r)
        })
}

/// The GPU labels a layout's instances depend on.
fn gpu_key(v: &NodeView) -> String {
    [LABEL_GPU_PRODUCT, LABEL_GPU_COUNT, LABEL_GPU_MEMORY]
        .iter()
        .map(|k| v.labels.get(k).unwrap_or_default())
        .collect::<Vec<_>>()
        .join("/")
}

/// Each node's class (see [`Policy::class`]).
fn classes(nodes: &[Node], demand: &[PendingPod]) -> Vec<String> {
    let keys: BTreeSet<&String> = demand.iter().flat_map(|p| p.label_keys()).collect();
    nodes
        .iter()
        .map(|n| {
            let mut c = gpu_key(n.view);
            for k in &keys {
                c.push('\u{1f}');
                c.push_str(n.view.labels.get(k).unwrap_or("\u{0}"));
            }
            for t in &n.view.taints {
                c.push_str(&format!("\u{1e}{}={}:{}", t.key, t.value, t.effect));
            }
            c
        })
        .collect()
}

/// Whether a node should carry the spare taint ([`TAINT_SPARE`](crate::api::names::TAINT_SPARE),
/// `preferBusyNodes`): its governing policy is a valid dynamic MIG policy that asks for it, the
/// policy does not refuse the node, and no GPU pod is bound there. kube-scheduler then fills
/// busy nodes first and leaves idle ones free for a reshape; once a pod is bound anyway (nothing
/// else fitted), the taint goes, so the node is filled like any busy one.
pub fn wants_spare(policy: Option<&Prepared>, refused: bool, v: &NodeView) -> bool {
    let Some(p) = policy.filter(|p| p.backing.is_some() && p.blocked.is_none()) else {
        return false;
    };
    let prefer =
        (p.spec.mig.as_ref().and_then(|m| m.dynamic.as_ref())).is_some_and(|d| d.prefer_busy_nodes);
    prefer && !refused && v.gpu_pods.is_empty()
}

/// Demand planning for every dynamic policy. `views` in name order; `winner[i]` the governing
/// policy of `views[i]`; the demand, the MIG configs and the time from the input's cluster
/// facts, `--pause-rollouts` from its settings.
pub fn plan(
    prepared: &[Prepared],
    views: &[&NodeView],
    winner: &[Option<usize>],
    input: &PlanInput,
) -> DemandPlan {
    let (cluster, pause_all) = (&input.cluster, input.settings.pause_rollouts);
    let (demand, base, now) = (
        &cluster.demand,
        cluster.base_mig_configs.as_ref(),
        cluster.now,
    );
    // The readiness taint goes once the node is configured: it keeps no pod away for good.
    let transient = cluster.readiness_taint.as_ref().map(|t| t.key.as_str());
    let mut out = DemandPlan::default();
    let mut governed: BTreeSet<&str> = BTreeSet::new();
    // Pods one policy serves or reshapes for are not another's demand.
    let mut handled: BTreeSet<String> = BTreeSet::new();
    for (i, w) in prepared.iter().enumerate() {
        let Some(mig) = w.spec.mig.as_ref() else {
            continue;
        };
        if mig.dynamic.is_none() {
            continue;
        }
        // A dynamic policy refused for now (an edit with a typo) keeps its nodes' layouts.
        governed.extend(
            views
                .iter()
                .zip(winner)
                .filter(|(_, wi)| **wi == Some(i))
                .map(|(v, _)| v.name()),
        );
        let Some(dynamic) = mig.dynamic.as_ref().filter(|_| w.accepted()) else {
            continue;
        };
        let offers = Offers {
            mig,
            own: w.mig().map(|m| m.layout.clone()).unwrap_or_default(),
            base,
            cache: Default::default(),
            mig_on: Default::default(),
        };
        // Nodes the policy refuses (`Rejected`, `Invalid`) are left as they are: they are not
        // reshaping, take no rollout budget and are offered nothing; a layout chosen for one
        // before (a reservation waiting there) is given up.
        for (v, _) in views
            .iter()
            .zip(winner)
            .filter(|(v, wi)| **wi == Some(i) && refuses(w, v))
        {
            if v.annotations.get(ANNOTATION_MIG_DEMAND).is_some() {
                out.annotations.insert(v.name().to_string(), None);
            }
        }
        let nodes: Vec<Node> = views
            .iter()
            .zip(winner)
            .filter(|(v, wi)| **wi == Some(i) && !refuses(w, v))
            .map(|(v, _)| node(w, v, &offers, now))
            .collect();
        let demand: Vec<PendingPod> = demand
            .iter()
            .filter(|p| !handled.contains(&p.id))
            .filter(|p| selects_namespace(mig, p.namespace_labels.as_ref()))
            .cloned()
            .collect();
        let class = classes(&nodes, &demand);
        let p = Policy {
            w,
            dynamic,
            nodes,
            now,
            class,
            offers: &offers,
            transient,
            ignored: &cluster.demand_ignored,
            recent: recent_drains(w, now),
            drained_now: Default::default(),
            stopped: rollout_stopped(w, pause_all),
        };
        handled.extend(p.plan(&demand, &mut out));
    }
    // A recorded layout on a node no dynamic policy governs any more goes.
    for v in views {
        if v.annotations.get(ANNOTATION_MIG_DEMAND).is_some() && !governed.contains(v.name()) {
            out.annotations.insert(v.name().to_string(), None);
        }
    }
    out
}

/// Whether the policy refuses the node for what it is (its GPUs, a VM host someone else made),
/// as the node's transition does.
fn refuses(w: &Prepared, v: &NodeView) -> bool {
    node_rejection(w.spec, v).is_some()
        || node_refusal(w.spec, v).is_some()
        || is_vm_host(v) && !v.owned.contains(LABEL_WORKLOAD)
}

fn node<'a>(w: &Prepared, v: &'a NodeView, offers: &Offers, now: i64) -> Node<'a> {
    let own = w.mig().map(|m| m.layout.clone()).unwrap_or_default();
    let (layout, since) = match (node_layout(w, v), recorded(v)) {
        // A time in the future (a clock ahead, or a forged value) would pin the cooldown.
        (Some(l), Some((_, t))) => (l, t.min(now)),
        _ => (own, 0),
    };
    let brings = offers.get(v, &layout);
    // Configured: the MIG manager confirmed the layout and the device plugin advertises it
    // (between the two, the instances are still coming).
    let advertised = brings
        .as_ref()
        .is_none_or(|b| b.keys().all(|r| v.allocatable(r) > 0));
    let mig = mig_of(v);
    let configured = mig.confirmed(&layout) && advertised;
    // A node whose MIG manager failed on its layout is held as it is: it brings nothing, and
    // demand goes to other nodes.
    let failed = mig.layout == Some(layout.as_str()) && mig.failed(v.mig_stuck);
    let supply = if failed {
        BTreeMap::new()
    } else if configured {
        v.allocatable
            .iter()
            .filter(|(r, _)| r.starts_with("nvidia.com/mig-"))
            .filter_map(|(r, c)| {
                let free = c.parse::<i64>().ok()? - v.gpu_requests.get(r).copied().unwrap_or(0);
                (free > 0).then(|| (r.to_string(), free))
            })
            .collect()
    } else {
        brings.map(|b| (*b).clone()).unwrap_or_default()
    };
    let dynamic = w.spec.mig.as_ref().and_then(|m| m.dynamic.as_ref());
    // A node demand may reserve waits for its pods: it may be chosen busy, and evicts none.
    let reserve = dynamic.is_some_and(|d| d.reserve_busy_nodes.is_some());
    let evicts = if reserve {
        Some(Vec::new())
    } else {
        demand_drain(w.spec).and_then(|_| {
            v.gpu_pods
                .iter()
                .map(|p| {
                    let priority = v.gpu_pod_details.get(p).map_or(0, |d| d.priority);
                    (!w.never_evicts(v, p, true)).then_some(priority)
                })
                .collect()
        })
    };
    Node {
        view: v,
        layout,
        since,
        configured,
        failed,
        supply,
        evicts,
        young: youngest_pod(v, now),
    }
}

/// The pod's requests as device-plugin resources.
fn wants(p: &PendingPod) -> impl Iterator<Item = (String, i64)> + '_ {
    p.profiles
        .iter()
        .map(|(prof, c)| (format!("nvidia.com/mig-{prof}"), *c))
}

/// The seconds a pod's value counts besides its wait: a pod that just became pending is worth
/// as much as its slices times this, one that waited ten minutes eleven times that.
const VALUE_BASE_SECONDS: i64 = 60;

/// What serving pending pod `p` is worth: the compute slices it asks for, times
/// [`VALUE_BASE_SECONDS`] plus the seconds it has waited (saturating).
fn value(p: &PendingPod, now: i64) -> i64 {
    let waited = now.saturating_sub(p.since).clamp(0, i64::from(i32::MAX));
    slices(p).saturating_mul(VALUE_BASE_SECONDS + waited)
}

/// The compute slices of a pod's MIG request: the `Ng` of each profile (`3g` of `3g.40gb`
/// and of `1c.3g.40gb`, the GPU instance it takes; [`parse_mig_profile`](crate::nvidia::mig::parse_mig_profile)) times the count; 1 for a name that is no MIG profile.
pub(super) fn slices(p: &PendingPod) -> i64 {
    p.profiles
        .iter()
        .map(|(prof, c)| profile_slices(prof).saturating_mul(*c))
        .fold(0i64, i64::saturating_add)
}

fn profile_slices(profile: &str) -> i64 {
    crate::nvidia::mig::parse_mig_profile(profile.trim_end_matches(".shared"))
        .map_or(1, |p| i64::from(p.slices))
}

/// What each GPU pod a drain of `v` would evict is worth: the compute slices its GPU pods
/// request on average, as if it had just become pending.
fn evicted_value(v: &NodeView) -> i64 {
    let slices: i64 = v
        .gpu_requests
        .iter()
        .filter_map(|(r, c)| {
            Some(profile_slices(r.strip_prefix("nvidia.com/mig-")?).saturating_mul(*c))
        })
        .fold(0i64, i64::saturating_add);
    let each = slices / (v.gpu_pods.len() as i64).max(1);
    each.max(1).saturating_mul(VALUE_BASE_SECONDS)
}

/// Whether `supply` holds a pod's whole request (see [`wants`]).
fn holds(supply: &BTreeMap<String, i64>, req: &[(String, i64)]) -> bool {
    req.iter()
        .all(|(r, c)| supply.get(r).copied().unwrap_or(0) >= *c)
}

fn take(supply: &mut BTreeMap<String, i64>, req: &[(String, i64)]) {
    for (r, c) in req {
        *supply.entry(r.clone()).or_default() -= c;
    }
}

/// The instances of each resource the policy's nodes have or are being given, and what the
/// pods running on them and pending for them ask for. A reshape never takes instances of a
/// profile away while the pool would then hold fewer than those pods ask for: serving one
/// profile's queue must not start another's (a busy node reserved today is the capacity a
/// profile's next pods need; the shortage would be reshaped back, one attrition later).
#[derive(Default)]
struct Stock {
    have: BTreeMap<String, i64>,
    need: BTreeMap<String, i64>,
    /// The first resource a reshape was refused for: `(resource, have, need)`, for the
    /// pods' reason.
    refused: std::cell::RefCell<Option<(String, i64, i64)>>,
}

impl Stock {
    /// Whether changing a node from offering `before` to `after` takes instances of a resource
    /// away that running and pending pods need (notes the first such resource).
    fn short(&self, before: Option<&BTreeMap<String, i64>>, after: &BTreeMap<String, i64>) -> bool {
        let gone = before.into_iter().flatten().find_map(|(r, c)| {
            let left = c - after.get(r).copied().unwrap_or(0);
            let have = self.have.get(r).copied().unwrap_or(0);
            let need = self.need.get(r).copied().unwrap_or(0);
            (left > 0 && have - left < need).then(|| (r.clone(), have, need))
        });
        let short = gone.is_some();
        let mut refused = self.refused.borrow_mut();
        if refused.is_none() {
            *refused = gone;
        }
        short
    }

    /// A node chosen now goes from offering `before` to `after`.
    fn moved(
        &mut self,
        before: Option<&BTreeMap<String, i64>>,
        after: Option<&BTreeMap<String, i64>>,
    ) {
        for (r, c) in before.into_iter().flatten() {
            *self.have.entry(r.clone()).or_default() -= c;
        }
        for (r, c) in after.into_iter().flatten() {
            *self.have.entry(r.clone()).or_default() += c;
        }
    }
}

/// When the youngest of the node's GPU pods started (`status.startTime`; one not started yet
/// counts as starting `now`); 0 for an idle node.
fn youngest_pod(v: &NodeView, now: i64) -> i64 {
    v.gpu_pods
        .iter()
        .map(|p| {
            v.gpu_pod_details
                .get(p)
                .map(|d| d.started)
                .filter(|t| *t > 0)
                .map_or(now, |t| t.min(now))
        })
        .max()
        .unwrap_or(0)
}

impl Policy<'_, '_> {
    /// What the policy's nodes offer (as they are, or as they are being reshaped to) and what
    /// their running pods and the pending pods `reqs` ask for.
    fn stock(&self, reqs: &[Request]) -> Stock {
        let mut stock = Stock::default();
        for n in self.nodes.iter().filter(|n| !n.failed) {
            stock.moved(None, self.layout_on(n, &n.layout).as_deref());
            for (r, c) in &n.view.gpu_requests {
                *stock.need.entry(r.clone()).or_default() += c;
            }
        }
        for (r, c) in reqs.iter().flatten() {
            *stock.need.entry(r.clone()).or_default() += c;
        }
        stock
    }

    /// The pods this policy's nodes could take (by labels), highest priority first, then
    /// oldest, then by id; and the ones no node of it accepts.
    fn pods<'d>(&self, demand: &'d [PendingPod]) -> Vec<&'d PendingPod> {
        let reps = self.representatives(|_| true);
        let mut pods: Vec<&PendingPod> = demand
            .iter()
            .filter(|p| reps.iter().any(|&i| self.fits(p, self.nodes[i].view)))
            .collect();
        pods.sort_by(|a, b| {
            (Reverse(a.priority), a.since, &a.id).cmp(&(Reverse(b.priority), b.since, &b.id))
        });
        pods
    }

    /// Whether pod `p` may be placed on `v` (see [`PendingPod::fits`]).
    fn fits(&self, p: &PendingPod, v: &NodeView) -> bool {
        p.fits(v, self.transient)
    }

    /// The first node of each class among those `keep` admits.
    fn representatives(&self, keep: impl Fn(usize) -> bool) -> Vec<usize> {
        let mut seen = BTreeSet::new();
        (0..self.nodes.len())
            .filter(|&i| keep(i) && seen.insert(self.class[i].as_str()))
            .collect()
    }

    /// What `layout` gives node `n`.
    fn layout_on(&self, n: &Node, layout: &str) -> Option<Resources> {
        self.offers.get(n.view, layout)
    }

    fn idle_for(&self, n: &Node) -> Option<i64> {
        n.view
            .gpu_pods
            .is_empty()
            .then(|| self.now - n.view.last_busy)
    }

    /// Plans this policy's demand into `out`; returns the pods it serves or reshapes for.
    fn plan(&self, demand: &[PendingPod], out: &mut DemandPlan) -> Vec<String> {
        let pods = self.pods(demand);
        let evicted = self
            .nodes
            .iter()
            .flat_map(|n| n.evicts.iter().flatten().copied());
        let levels = priority_levels(pods.iter().map(|p| p.priority).chain(evicted));
        let reqs: Vec<Vec<(String, i64)>> = pods.iter().map(|p| wants(p).collect()).collect();
        let values: Vec<i64> = pods.iter().map(|p| value(p, self.now)).collect();
        let (placed, mut residual) = self.baseline(&pods, &reqs);
        let mut st = Tally::default();
        for (i, ks) in placed.iter().enumerate() {
            for &k in ks {
                st.add(
                    pods[k],
                    if self.nodes[i].configured {
                        "served"
                    } else {
                        "coming"
                    },
                );
            }
        }
        let reshaping_now = self
            .nodes
            .iter()
            .filter(|n| !n.configured && !n.failed)
            .count();
        let budget = super::rollout::budget(self.w.spec, self.nodes.len());
        let mut room = if self.stopped.is_some() {
            0
        } else {
            budget.saturating_sub(reshaping_now)
        };
        let act = self.settled(&pods, &residual, out);
        let catalogue = catalogue(self.w);
        let mut stock = self.stock(&reqs);
        let mut taken: BTreeSet<usize> = BTreeSet::new();
        while act && !residual.is_empty() {
            let best = self.best(
                (&pods, &reqs, &values),
                &residual,
                &placed,
                &levels,
                &catalogue,
                (&taken, &stock),
            );
            let Some(c) = best else {
                break;
            };
            if room == 0 {
                break;
            }
            room -= 1;
            taken.insert(c.node);
            let n = &self.nodes[c.node];
            stock.moved(
                self.layout_on(n, &n.layout).as_deref(),
                self.layout_on(n, &c.layout).as_deref(),
            );
            self.record(&c, &pods, &mut st, out);
            residual.retain(|k| !c.gained.contains(k));
            for k in c.lost {
                st.remove(pods[k], "served");
                residual.push(k);
            }
            residual.sort_unstable();
        }
        // Reasons for what is left.
        for &k in &residual {
            let why = self.why(pods[k], &catalogue, (&taken, room, act, &stock), out);
            st.unmet(pods[k], why);
        }
        self.keep_recorded(&placed, out);
        let reshaping = self.reshaping(out);
        out.statuses.insert(
            self.w.name.clone(),
            DemandStatus {
                profiles: st.profiles(),
                reshaping,
                ignored: self.ignored.to_vec(),
                recent_drains: self.recent_drains(out),
            },
        );
        let left: BTreeSet<usize> = residual.iter().copied().collect();
        (0..pods.len())
            .filter(|k| !left.contains(k))
            .map(|k| pods[k].id.clone())
            .collect()
    }

    /// Records a choice: the layout on the node, the pods it serves as coming, an event for
    /// each of them.
    fn record(&self, c: &Choice, pods: &[&PendingPod], st: &mut Tally, out: &mut DemandPlan) {
        let (n, layout, evicted) = (&self.nodes[c.node], &c.layout, c.evicted);
        out.annotations.insert(
            n.view.name().to_string(),
            Some(format!("{layout}@{}", self.now)),
        );
        let model = n.view.labels.get(LABEL_GPU_PRODUCT).unwrap_or_default();
        if evicted > 0 {
            out.drains.insert(n.view.name().to_string(), evicted);
            self.drained_now.set(self.drained_now.get() + 1);
        }
        let running = n.view.gpu_pods.len();
        let drain = if evicted > 0 {
            format!(" (draining it: {evicted} GPU pod(s) evicted)")
        } else if running > 0 {
            format!(" (cordoned until its {running} running GPU pod(s) finish)")
        } else {
            String::new()
        };
        for &k in &c.gained {
            st.add(pods[k], "coming");
            out.events.push((
                pods[k].id.clone(),
                n.view.name().to_string(),
                format!(
                    "reshaping node {} to {model} layout {layout} for this pod{drain}",
                    n.view.name()
                ),
            ));
        }
    }

    /// The pods placed on the supply as it is and as it is coming (by node), and the rest.
    fn baseline(
        &self,
        pods: &[&PendingPod],
        reqs: &[Vec<(String, i64)>],
    ) -> (Vec<Vec<usize>>, Vec<usize>) {
        let mut supply: Vec<BTreeMap<String, i64>> =
            self.nodes.iter().map(|n| n.supply.clone()).collect();
        let mut placed: Vec<Vec<usize>> = vec![Vec::new(); self.nodes.len()];
        let mut residual = Vec::new();
        for (k, p) in pods.iter().enumerate() {
            match (0..self.nodes.len())
                .find(|&i| holds(&supply[i], &reqs[k]) && self.fits(p, self.nodes[i].view))
            {
                Some(i) => {
                    take(&mut supply[i], &reqs[k]);
                    placed[i].push(k);
                }
                None => residual.push(k),
            }
        }
        (placed, residual)
    }

    /// Whether the residual demand has been quiet for `quietSeconds`, or its oldest pod waited
    /// `maxDelaySeconds`; if not, a recheck when one of them will be so.
    fn settled(&self, pods: &[&PendingPod], residual: &[usize], out: &mut DemandPlan) -> bool {
        let youngest = residual.iter().map(|&k| pods[k].since).max();
        let oldest = residual.iter().map(|&k| pods[k].since).min();
        let (Some(y), Some(o)) = (youngest, oldest) else {
            return false;
        };
        let d = self.dynamic;
        if self.now - y >= d.quiet_seconds || self.now - o >= d.max_delay_seconds {
            return true;
        }
        recheck(
            out,
            (y + d.quiet_seconds - self.now).min(o + d.max_delay_seconds - self.now),
        );
        false
    }

    /// The drains of the last hour with those chosen now, for the status.
    fn recent_drains(&self, out: &DemandPlan) -> Vec<RecentDrain> {
        let mine = |node: &String| self.nodes.iter().any(|n| n.view.name() == node);
        let now = out
            .drains
            .keys()
            .filter(|n| mine(n))
            .map(|node| RecentDrain {
                node: node.clone(),
                at: self.now,
            });
        self.recent.iter().cloned().chain(now).collect()
    }

    /// `node: layout` of the nodes being reshaped, and of those chosen now.
    fn reshaping(&self, out: &DemandPlan) -> Vec<String> {
        let own = self.w.mig().map(|m| m.layout.as_str()).unwrap_or_default();
        let mut reshaping = Vec::new();
        for n in self.nodes.iter().filter(|n| !n.failed) {
            let name = n.view.name();
            // The layout the node is to run after this pass: chosen now, given back (kept),
            // its recorded one, or the policy's own once the record goes.
            let target = match out.annotations.get(name) {
                Some(Some(v)) => v.rsplit_once('@').map_or(v.as_str(), |(l, _)| l),
                Some(None) => own,
                None => n.layout.as_str(),
            };
            let pending = if target == n.layout {
                !n.configured
            } else {
                !mig_of(n.view).confirmed(target)
            };
            if pending {
                reshaping.push(format!("{name}: {target}"));
            }
        }
        reshaping.sort();
        reshaping
    }

    /// Seconds a demand drain may take: `disruption.drainTimeoutSeconds`.
    fn drain_timeout(&self) -> i64 {
        self.w
            .spec
            .disruption
            .as_ref()
            .and_then(|d| d.drain_timeout_seconds)
            .unwrap_or(DEFAULT_DRAIN_TIMEOUT_SECONDS)
    }

    /// Recorded layouts stay; one the catalogue no longer has goes. A layout chosen for a node
    /// that runs GPU pods again before its change started (a pod was bound to its old free
    /// instances) is given up, unless demand may drain the node as it is now and the drain has
    /// not overrun its time: the node keeps the layout it has.
    ///
    /// A node reserved (`reserveBusyNodes`) is given back too when no pending pod is placed on
    /// the layout it waits for any more (the pods were deleted, or bound elsewhere), or when it
    /// waited `maxWaitSeconds`.
    fn keep_recorded(&self, placed: &[Vec<usize>], out: &mut DemandPlan) {
        let catalogue = catalogue(self.w);
        let reserve = self.dynamic.reserve_busy_nodes.as_ref();
        for (i, n) in self.nodes.iter().enumerate() {
            let name = n.view.name().to_string();
            if out.annotations.contains_key(&name) || recorded(n.view).is_none() {
                continue;
            }
            let Some(target) = node_layout(self.w, n.view) else {
                out.annotations.insert(name, None);
                continue;
            };
            let label = n.view.labels.get(LABEL_MIG_CONFIG);
            let busy = label != Some(target.as_str()) && !n.view.gpu_pods.is_empty();
            // A drain for demand that overran `drainTimeoutSeconds` (a PodDisruptionBudget
            // that never allows the eviction) is given up too: the node is uncordoned.
            let deadline = n.since + reserve.map_or(self.drain_timeout(), |r| r.max_wait_seconds);
            let overran = self.now >= deadline;
            // The pods a reservation waits for, or a drain not yet begun was chosen for, are
            // gone (deleted, or bound elsewhere): nothing is evicted for them.
            let begun = n.view.annotations.get(ANNOTATION_CORDONED).is_some();
            let unneeded = (reserve.is_some() || !begun) && placed[i].is_empty();
            if busy && n.evicts.is_some() && !overran {
                recheck(out, deadline - self.now);
            }
            let stopped = self.stopped.is_some() && !begun;
            if busy && (unneeded || stopped) && n.evicts.as_ref().is_some_and(|e| !e.is_empty()) {
                out.given_up.insert(name.clone());
            }
            if busy && (n.evicts.is_none() || overran || unneeded || stopped) {
                let keep = label
                    .filter(|l| catalogue.iter().any(|c| c == l))
                    .map(|l| format!("{l}@{}", self.now));
                out.annotations.insert(name, keep);
            }
        }
    }

    /// The nodes in the order reshapes are asked of them, the first the one ties go to: idle
    /// nodes first, then by when their youngest GPU pod started and how many run (a reserved
    /// node waits for them to end: the node whose pods all started long ago is likely to
    /// empty first), then by name.
    fn order(&self) -> Vec<usize> {
        let mut order: Vec<usize> = (0..self.nodes.len()).collect();
        order.sort_by_key(|&i| {
            let n = &self.nodes[i];
            (n.young, n.view.gpu_pods.len(), i)
        });
        order
    }

    /// The residual pods `offer` on node `v` would hold, oldest first.
    fn gains(
        &self,
        offer: &BTreeMap<String, i64>,
        (pods, reqs): (&[&PendingPod], &[Request]),
        residual: &[usize],
        v: &NodeView,
    ) -> Vec<usize> {
        let mut s = offer.clone();
        let mut gained = Vec::new();
        for &k in residual {
            if holds(&s, &reqs[k]) && self.fits(pods[k], v) {
                take(&mut s, &reqs[k]);
                gained.push(k);
            }
        }
        gained
    }

    /// The (node, layout) of most value among those that serve more residual pods than they
    /// displace (see [`value`]), with the residual pods it serves and
    /// the placed pods it displaces; `None` when no reshape serves more than it displaces.
    fn best(
        &self,
        (pods, reqs, values): (&[&PendingPod], &[Request], &[i64]),
        residual: &[usize],
        placed: &[Vec<usize>],
        levels: &[i32],
        catalogue: &[String],
        (taken, stock): (&BTreeSet<usize>, &Stock),
    ) -> Option<Choice> {
        // Per priority level, the pending pods `ks` weighed by `weight`, plus `each` for every
        // evicted pod.
        let tally = |ks: &[usize], weight: &dyn Fn(usize) -> i64, evicts: &[i32], each: i64| {
            levels
                .iter()
                .map(|l| {
                    let pending: i64 = ks
                        .iter()
                        .filter(|&&k| pods[k].priority == *l)
                        .map(|&k| weight(k))
                        .fold(0i64, i64::saturating_add);
                    let evicted = evicts.iter().filter(|p| *p == l).count() as i64;
                    pending.saturating_add(each.saturating_mul(evicted))
                })
                .collect::<Score>()
        };
        // Pods served, one each.
        let score = |ks: &[usize], evicts: &[i32]| tally(ks, &|_| 1, evicts, 1);
        // Among the reshapes that serve more pods than they displace, at each priority level,
        // the one of most value wins: a pod's value is its compute slices times its wait
        // (see [`value`]), so the pods that waited longest are served first and a large
        // profile is not passed over for many small ones.
        let worth =
            |ks: &[usize], evicts: &[i32], each: i64| tally(ks, &|k| values[k], evicts, each);
        let mut best: Option<(Score, Choice)> = None;
        // Nodes of one class, with the same layout, no pods placed on them and none to evict,
        // answer alike: the first stands for the others (in [`Policy::order`]).
        let order = self.order();
        let mut asked: BTreeSet<(&str, &str)> = BTreeSet::new();
        for i in order {
            let n = &self.nodes[i];
            if taken.contains(&i) || self.blocked(n).is_some() || !self.offers.mig_on(&n.layout) {
                continue;
            }
            let evicts: &[i32] = n.evicts.as_deref().unwrap_or_default();
            let running = n.view.gpu_pods.len();
            if placed[i].is_empty()
                && evicts.is_empty()
                && !asked.insert((self.class[i].as_str(), n.layout.as_str()))
            {
                continue;
            }
            let current = self.layout_on(n, &n.layout);
            let others = catalogue.iter().filter(|l| **l != n.layout);
            for layout in others.filter(|l| self.offers.mig_on(l)) {
                let Some(offer) = self.layout_on(n, layout) else {
                    continue;
                };
                let gained = self.gains(&offer, (pods, reqs), residual, n.view);
                let lost = placed[i].clone();
                let (g, l) = (score(&gained, &[]), score(&lost, evicts));
                let net: Score = g.iter().zip(&l).map(|(a, b)| a - b).collect();
                if net.iter().find(|x| **x != 0).is_none_or(|x| *x < 0) {
                    continue;
                }
                // A drain's trade is weighed above, pod for pod; a reshape that evicts nothing
                // must not start a queue for a profile in use.
                if evicts.is_empty() && stock.short(current.as_deref(), &offer) {
                    continue;
                }
                let each = evicted_value(n.view);
                let (g, l) = (worth(&gained, &[], each), worth(&lost, evicts, each));
                let net: Score = g.iter().zip(&l).map(|(a, b)| a - b).collect();
                // Ties go to the choice that evicts fewer pods, then to the node likelier to
                // empty first (an idle node first; see [`Policy::order`]).
                let cost = (evicts.len(), n.young, running);
                if best.as_ref().is_none_or(|(b, c)| {
                    let young = self.nodes[c.node].young;
                    net > *b || net == *b && cost < (c.evicted, young, c.running)
                }) {
                    let c = Choice {
                        node: i,
                        layout: layout.clone(),
                        gained,
                        lost,
                        evicted: evicts.len(),
                        running,
                    };
                    best = Some((net, c));
                }
            }
        }
        best.map(|(_, c)| c)
    }

    /// Why node `n` may not be reshaped now: `(reason, seconds until it may)`.
    fn blocked(&self, n: &Node) -> Option<(&'static str, i64)> {
        if !n.configured || n.failed {
            return Some((NO_IDLE_NODE, 0));
        }
        // A node demand may drain (within maxDrainsPerHour) or reserve need not be idle.
        let drains = n.evicts.as_ref().is_some_and(|e| !e.is_empty());
        let spent = drains.then(|| self.drains_spent()).flatten();
        match self.idle_for(n) {
            _ if n.evicts.is_some() && spent.is_none() => {}
            None => return Some((NO_IDLE_NODE, spent.unwrap_or(0))),
            Some(idle) if idle < self.dynamic.idle_seconds => {
                return Some((NO_IDLE_NODE, self.dynamic.idle_seconds - idle));
            }
            _ => {}
        }
        let age = self.now - n.since;
        let lifetime = self.min_lifetime();
        if n.since > 0 && age < lifetime {
            return Some((COOLDOWN, lifetime - age));
        }
        None
    }

    /// `minLayoutLifetimeSeconds`, at least [`MIN_LIFETIME_WITH_BUSY_NODES`] when demand may
    /// take busy nodes (a node must not be drained or cordoned again and again).
    fn min_lifetime(&self) -> i64 {
        let busy = self.dynamic.reserve_busy_nodes.is_some() || demand_drain(self.w.spec).is_some();
        let d = self.dynamic.min_layout_lifetime_seconds;
        if busy {
            d.max(MIN_LIFETIME_WITH_BUSY_NODES)
        } else {
            d
        }
    }

    /// When `maxDrainsPerHour` drains were made in the last hour (this pass's included): the
    /// seconds until the oldest of them leaves the hour.
    fn drains_spent(&self) -> Option<i64> {
        let max = demand_drain(self.w.spec)?.max_drains_per_hour.max(1) as usize;
        (self.recent.len() + self.drained_now.get() >= max).then(|| {
            self.recent
                .first()
                .map_or(DRAIN_WINDOW, |r| r.at + DRAIN_WINDOW - self.now)
        })
    }

    /// The first reason that keeps `p` waiting, with a message; asks for a recheck when time
    /// alone would lift it. What no reshape can change is said even while the demand batches.
    fn why(
        &self,
        p: &PendingPod,
        catalogue: &[String],
        (taken, room, act, stock): (&BTreeSet<usize>, usize, bool, &Stock),
        out: &mut DemandPlan,
    ) -> (&'static str, String) {
        let mut class_fits: BTreeMap<&str, bool> = BTreeMap::new();
        let fitting: Vec<(usize, &Node)> = self
            .nodes
            .iter()
            .enumerate()
            .filter(|(i, n)| {
                *class_fits
                    .entry(self.class[*i].as_str())
                    .or_insert_with(|| self.fits(p, n.view))
            })
            .collect();
        if fitting.is_empty() {
            return (
                NO_MATCHING_NODE,
                format!(
                    "no node of the policy accepts pod {} (node selector, required node affinity, untolerated taints)",
                    p.id
                ),
            );
        }
        let req: Vec<(String, i64)> = wants(p).collect();
        let offers = |n: &Node, l: &String, whole: bool| {
            self.layout_on(n, l).is_some_and(|s| {
                if whole {
                    holds(&s, &req)
                } else {
                    req.iter().all(|(r, _)| s.get(r).is_some_and(|c| *c > 0))
                }
            })
        };
        let fits: BTreeSet<usize> = fitting.iter().map(|(i, _)| *i).collect();
        let reps = self.representatives(|i| fits.contains(&i));
        let any_layout = |whole: bool| {
            reps.iter()
                .any(|&i| catalogue.iter().any(|l| offers(&self.nodes[i], l, whole)))
        };
        let profiles = p.profiles.keys().cloned().collect::<Vec<_>>().join(", ");
        if !any_layout(false) {
            return (
                PROFILE_NOT_IN_CATALOGUE,
                format!("no layout of the catalogue offers {profiles} on the policy's GPUs"),
            );
        }
        if !any_layout(true) {
            return (
                INFEASIBLE,
                format!(
                    "no single node's layout holds all that pod {} asks for",
                    p.id
                ),
            );
        }
        if !act {
            return (
                BATCHING,
                "waiting for the demand to settle (quietSeconds)".to_string(),
            );
        }
        let free: Vec<&(usize, &Node)> = fitting
            .iter()
            .filter(|(i, n)| !taken.contains(i) && self.blocked(n).is_none())
            .collect();
        if !free.is_empty() {
            // Nodes that time alone will free (idle time, cooldown) may serve it then.
            if let Some(wait) = fitting
                .iter()
                .filter_map(|(_, n)| self.blocked(n).map(|b| b.1))
                .filter(|w| *w > 0)
                .min()
            {
                recheck(out, wait);
            }
            return self.no_room_why(room, stock);
        }
        self.blocked_why(p, &fitting, out)
    }

    /// Why a pod some free node could serve waits: the rollout is stopped, its budget is
    /// used up (`room` 0), or no reshape serves more than it displaces.
    fn no_room_why(&self, room: usize, stock: &Stock) -> (&'static str, String) {
        if let Some(why) = &self.stopped {
            return (ROLLOUT_STOPPED, why.clone());
        }
        if room == 0 {
            let budget = super::rollout::budget(self.w.spec, self.nodes.len());
            let msg = format!(
                "{budget} node(s) are already being reshaped, as many as the rollout budget allows"
            );
            return (BUDGET_EXHAUSTED, msg);
        }
        if let Some((resource, have, need)) = stock.refused.borrow().as_ref() {
            let profile = resource.trim_start_matches("nvidia.com/mig-");
            let msg = format!(
                "the reshapes that would serve it take away {profile} instances, of which the pool has {have} and its running and pending pods ask for {need}"
            );
            return (PROFILE_IN_USE, msg);
        }
        (
            INFEASIBLE,
            "the nodes that may be reshaped serve more of the pending demand as they are (or a drain would evict as many pods as it serves)".into(),
        )
    }

    /// Why `p` waits when every node it could use is blocked: the cooldown, or no idle node.
    fn blocked_why(
        &self,
        p: &PendingPod,
        fitting: &[(usize, &Node)],
        out: &mut DemandPlan,
    ) -> (&'static str, String) {
        let blocks: Vec<(&'static str, i64)> = fitting
            .iter()
            .filter_map(|(_, n)| self.blocked(n))
            .collect();
        if let Some(wait) = blocks.iter().filter(|b| b.1 > 0).map(|b| b.1).min() {
            recheck(out, wait);
        }
        if let Some((_, wait)) = blocks.iter().find(|b| b.0 == COOLDOWN) {
            return (
                COOLDOWN,
                format!(
                    "the idle nodes' layouts are younger than minLayoutLifetimeSeconds (next in {wait} s)"
                ),
            );
        }
        let runs = match demand_drain(self.w.spec) {
            None => "runs GPU pods, was busy in the last idleSeconds".to_string(),
            Some(d) if self.drains_spent().is_some() => format!(
                "runs GPU pods, and drainBusyNodes.maxDrainsPerHour {} is spent",
                d.max_drains_per_hour
            ),
            Some(d) => format!(
                "runs GPU pods above drainBusyNodes.maxPodPriority {} or protected by disruption.neverEvict",
                d.max_pod_priority
            ),
        };
        (
            NO_IDLE_NODE,
            format!(
                "every node pod {} could use {runs}, or is being reconfigured",
                p.id
            ),
        )
    }
}

/// The priorities of pending pods and of the pods drains would evict, highest first, each
/// once.
fn priority_levels(priorities: impl Iterator<Item = i32>) -> Vec<i32> {
    let mut levels: Vec<i32> = priorities.collect();
    levels.sort_unstable_by(|a, b| b.cmp(a));
    levels.dedup();
    levels
}

fn recheck(out: &mut DemandPlan, secs: i64) {
    let secs = secs.max(1);
    out.recheck_in = Some(out.recheck_in.map_or(secs, |r| r.min(secs)));
}

/// Demand per profile as it is counted.
#[derive(Default)]
struct Tally {
    by_profile: BTreeMap<String, ProfileDemand>,
}

impl Tally {
    fn entry(&mut self, prof: &str) -> &mut ProfileDemand {
        self.by_profile
            .entry(prof.to_string())
            .or_insert_with(|| ProfileDemand {
                profile: prof.to_string(),
                ..Default::default()
            })
    }

    fn add(&mut self, p: &PendingPod, how: &str) {
        for (prof, c) in &p.profiles {
            let e = self.entry(prof);
            e.pending += c;
            match how {
                "served" => e.served += c,
                _ => e.coming += c,
            }
        }
    }

    fn remove(&mut self, p: &PendingPod, how: &str) {
        for (prof, c) in &p.profiles {
            let e = self.entry(prof);
            e.pending -= c;
            match how {
                "served" => e.served -= c,
                _ => e.coming -= c,
            }
        }
    }

    fn unmet(&mut self, p: &PendingPod, (reason, message): (&str, String)) {
        for (prof, c) in &p.profiles {
            let e = self.entry(prof);
            e.pending += c;
            if e.reason.is_none() {
                e.reason = Some(reason.to_string());
                e.message = Some(message.clone());
            }
        }
    }

    fn profiles(self) -> Vec<ProfileDemand> {
        self.by_profile.into_values().collect()
    }
}
