//! Policies before nodes: validation, what each renders to, precedence, which policy governs
//! which node, and the cluster-wide MIG strategy.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use crate::api::crd::{
    Backend, DemandDrain, DemandReserve, GpuSharingPolicy, GpuSharingPolicySpec, MigStrategy,
    Strategy,
};
use crate::api::names::{ANNOTATION_MIG_DEMAND, ANNOTATION_REAPPLY_MIG};
use crate::nvidia::{self, DEFAULT_KEY, MIG_DISABLED_LAYOUT};
use crate::validate::{self, FieldError};

use super::backend::{Backing, MigBacking, NodeTarget, Serving, VmBacking, VmTarget};
use super::labels::{LabelLookup, Labels, selection_labels, selector_matches};
use super::{facts::NodeFacts, input::NodeView};

/// A policy after validation, with what it renders to. The whole of it is the version its
/// nodes' memos are keyed on (see `memo`).
#[derive(Debug)]
pub struct Prepared<'a> {
    pub name: String,
    pub policy: &'a GpuSharingPolicy,
    pub spec: &'a GpuSharingPolicySpec,
    pub errors: Vec<FieldError>,
    pub warnings: Vec<String>,
    /// Device-plugin config key (`<policy>-<hash>`, or `default` for DRA); `None` if invalid.
    pub key: Option<String>,
    /// The config text behind `key`.
    pub config_text: Option<String>,
    /// The backend and what it renders to; `None` if invalid.
    pub backing: Option<Backing>,
    /// Why the policy is refused cluster-wide (it conflicts with the cluster's MIG strategy).
    pub blocked: Option<String>,
    /// A blocked policy whose nodes are released (back to exclusive) rather than held: MPS under
    /// a cluster-wide `mixed`, which NVIDIA's device plugin refuses to run.
    pub release_when_blocked: bool,
    /// The same conflict for a policy that governs no node yet: a warning only.
    pub latent: Option<String>,
}

impl Prepared<'_> {
    /// A MIG policy's layout.
    pub fn mig(&self) -> Option<&MigBacking> {
        match &self.backing {
            Some(Backing::Mig(m)) => Some(m),
            _ => None,
        }
    }

    /// A VM policy's sandbox configuration.
    pub fn vm(&self) -> Option<&VmBacking> {
        match &self.backing {
            Some(Backing::Vm(v)) => Some(v),
            _ => None,
        }
    }

    /// Valid and not refused cluster-wide: its nodes may be changed.
    pub fn accepted(&self) -> bool {
        self.errors.is_empty() && self.blocked.is_none()
    }

    /// `disruption.mode: drain`: nodes are drained for changes that need idle GPUs.
    pub fn drains(&self) -> bool {
        self.spec
            .disruption
            .as_ref()
            .is_some_and(|d| d.mode == crate::api::crd::DisruptionMode::Drain)
    }

    /// The admin asked to re-apply named layouts whose content changed.
    pub fn reapply_requested(&self) -> bool {
        self.policy
            .metadata
            .annotations
            .as_ref()
            .is_some_and(|a| a.contains_key(ANNOTATION_REAPPLY_MIG))
    }
}

fn field_error(path: &str, message: String) -> FieldError {
    FieldError {
        path: path.into(),
        message,
    }
}

/// What node `n` of the valid policy `w` should end up running: one function for every backend,
/// and the one place a per-node choice goes: the MIG layout demand recorded on the node
/// (`spec.mig.dynamic`, see [`super::demand`]).
pub fn node_target(w: &Prepared, n: &NodeFacts) -> Option<NodeTarget> {
    let serving = match w.backing.as_ref()? {
        Backing::Sharing => Serving::Sharing,
        // Demand may have recorded another layout of the catalogue for this node.
        Backing::Mig(m) => Serving::Mig {
            layout: node_layout(w, n).unwrap_or_else(|| m.layout.clone()),
        },
        Backing::Vm(v) => Serving::Vm(VmTarget {
            workload: v.workload,
            vgpu_config: v.vgpu_config.clone(),
        }),
        Backing::Dra => Serving::Dra,
    };
    Some(NodeTarget {
        device_config: w.key.clone()?,
        serving,
    })
}

/// The layouts a dynamic policy may put on a node: its own first, then the catalogue's.
pub fn catalogue(w: &Prepared) -> Vec<String> {
    let own = w.mig().map(|m| m.layout.clone());
    let dynamic = w.spec.mig.as_ref().and_then(|m| m.dynamic.as_ref());
    own.into_iter()
        .chain(dynamic.into_iter().flat_map(|d| d.layouts.iter().cloned()))
        .fold(Vec::new(), |mut out, l| {
            if !out.contains(&l) {
                out.push(l);
            }
            out
        })
}

/// The layout demand recorded on a node, and since when (unix seconds; 0 when unreadable):
/// the one parser of [`ANNOTATION_MIG_DEMAND`] (`<layout>@<seconds>`).
pub fn recorded(n: &NodeFacts) -> Option<(&str, i64)> {
    let (l, t) = n.annotations.get(ANNOTATION_MIG_DEMAND)?.rsplit_once('@')?;
    Some((l, t.parse().unwrap_or(0)))
}

/// The layout node `v` of dynamic policy `w` should run: the one demand recorded on it while it
/// is in the catalogue, else the policy's own.
pub fn node_layout(w: &Prepared, v: &NodeFacts) -> Option<String> {
    let (l, _) = recorded(v)?;
    let dynamic = w.spec.mig.as_ref().and_then(|m| m.dynamic.as_ref());
    let in_catalogue =
        w.mig()?.layout == l || dynamic.is_some_and(|d| d.layouts.iter().any(|x| x == l));
    in_catalogue.then(|| l.to_string())
}

/// The policy's spec as node `n` runs it: with the MIG layout demand recorded for the node in
/// place of the policy's own (what the device plugin advertises there, and what the node is
/// judged Ready against).
pub fn node_spec<'a>(w: &'a Prepared, n: &NodeFacts) -> std::borrow::Cow<'a, GpuSharingPolicySpec> {
    spec_on_node(w.spec, n)
}

/// [`node_spec`] from the spec alone: the recorded layout counts when it is one of
/// `spec.mig.dynamic.layouts` (the policy's own layout needs no change).
pub fn spec_on_node<'a>(
    spec: &'a GpuSharingPolicySpec,
    n: &NodeFacts,
) -> std::borrow::Cow<'a, GpuSharingPolicySpec> {
    let recorded = recorded(n).map(|(l, _)| l);
    let mig = spec.mig.as_ref();
    let dynamic = mig.and_then(|m| m.dynamic.as_ref());
    match (recorded, dynamic) {
        (Some(l), Some(d))
            if mig.and_then(|m| m.layout.as_deref()) != Some(l)
                && d.layouts.iter().any(|x| x == l) =>
        {
            std::borrow::Cow::Owned(spec.with_mig_layout(l))
        }
        _ => std::borrow::Cow::Borrowed(spec),
    }
}

/// The node's target is a layout demand recorded on it (`spec.mig.dynamic`).
pub fn demand_reshape(w: &Prepared, n: &NodeFacts) -> bool {
    w.spec.mig.as_ref().is_some_and(|m| m.dynamic.is_some()) && node_layout(w, n).is_some()
}

/// `spec.mig.dynamic.drainBusyNodes`: which busy nodes demand may drain. Only with a
/// `namespaceSelector`: admission refuses drains without one, and a policy stored before that
/// rule gets no drains either.
pub fn demand_drain(spec: &GpuSharingPolicySpec) -> Option<&DemandDrain> {
    let dynamic = spec.mig.as_ref()?.dynamic.as_ref()?;
    dynamic.namespace_selector.as_ref()?;
    dynamic.drain_busy_nodes.as_ref()
}

/// Under drains or reservations a layout stays at least this long, whatever a policy stored
/// before the admission rule says.
pub const MIN_LIFETIME_WITH_BUSY_NODES: i64 = 60;

/// `spec.mig.dynamic.reserveBusyNodes`: demand may cordon busy nodes and wait for them.
pub fn demand_reserve(spec: &GpuSharingPolicySpec) -> Option<&DemandReserve> {
    spec.mig
        .as_ref()?
        .dynamic
        .as_ref()?
        .reserve_busy_nodes
        .as_ref()
}

impl Prepared<'_> {
    /// Whether node `n`'s change drains it when its GPUs are busy: a layout demand recorded
    /// under `drainBusyNodes` or `reserveBusyNodes` (a drain that evicts nothing: the cordon
    /// alone, until the pods finish), any other change under `disruption.mode: drain`.
    pub fn drains_node(&self, n: &NodeFacts) -> bool {
        if demand_reshape(self, n) {
            demand_drain(self.spec).is_some() || demand_reserve(self.spec).is_some()
        } else {
            self.drains()
        }
    }

    /// Whether a drain for this policy leaves GPU pod `pod` of node `v` alone:
    /// `disruption.neverEvict` selects it, or, in a drain for demand, it is above the priority
    /// ceiling.
    pub fn never_evicts(&self, v: &NodeView, pod: &str, demand: bool) -> bool {
        let details = v.gpu_pod_details.get(pod);
        let labels = details.map(|d| &d.labels);
        let priority = details.map_or(0, |d| d.priority);
        let never = self
            .spec
            .disruption
            .as_ref()
            .and_then(|d| d.never_evict.as_ref())
            .is_some_and(|sel| selector_matches(sel, labels.unwrap_or(&Labels::default())));
        never || demand && demand_drain(self.spec).is_some_and(|d| priority > d.max_pod_priority)
    }
}

/// Whether a named layout may be in a dynamic catalogue: in the mig-parted config, with MIG
/// enabled on every GPU it configures. `Err` says why not.
pub fn check_layout(
    layout: &str,
    base: Option<&BTreeMap<String, serde_json::Value>>,
) -> Result<(), String> {
    if layout == MIG_DISABLED_LAYOUT {
        return Err("all-disabled switches MIG mode off".into());
    }
    let Some(base) = base else {
        return Ok(());
    };
    let Some(entries) = base.get(layout).and_then(|e| e.as_array()) else {
        return Err(format!(
            "{layout:?} is not a layout of the mig-parted configuration"
        ));
    };
    if entries
        .iter()
        .any(|e| e.get("mig-enabled").and_then(|m| m.as_bool()) != Some(true))
    {
        return Err(format!(
            "{layout:?} turns MIG mode off on some GPUs; switching MIG mode needs a GPU reset, which the catalogue never asks for"
        ));
    }
    Ok(())
}

/// Deterministic precedence: priority (high first), then oldest, then name.
fn precedence(p: &GpuSharingPolicy) -> (std::cmp::Reverse<i32>, bool, String, String) {
    let ts = p
        .metadata
        .creation_timestamp
        .as_ref()
        .map(|t| t.0.to_string());
    (
        // Reversed, not negated: `-i32::MIN` overflows.
        std::cmp::Reverse(p.spec.priority),
        ts.is_none(),
        ts.unwrap_or_default(),
        p.metadata.name.clone().unwrap_or_default(),
    )
}

fn prepare<'a>(
    p: &'a GpuSharingPolicy,
    base: Option<&BTreeMap<String, serde_json::Value>>,
) -> Prepared<'a> {
    let name = p.metadata.name.clone().unwrap_or_default();
    let (mut errors, warnings) = validate::validate(&name, &p.spec);
    if errors.is_empty() {
        errors.extend(super::geometry::pinned_errors(&p.spec));
    }
    let backing = errors
        .is_empty()
        .then(|| backing(&name, &p.spec, base, &mut errors));
    let backing = backing.filter(|_| errors.is_empty());
    let (key, config_text) = match &backing {
        // The DRA driver shares the GPUs, or virtual machines get them: the device plugin, if
        // it runs, must not share.
        Some(Backing::Dra | Backing::Vm(_)) => (Some(DEFAULT_KEY.to_string()), None),
        Some(_) => {
            let text = nvidia::device_plugin_yaml(&nvidia::device_plugin_config(&p.spec));
            (Some(nvidia::content_key(&name, &text)), Some(text))
        }
        None => (None, None),
    };
    Prepared {
        name,
        policy: p,
        spec: &p.spec,
        errors,
        warnings,
        key,
        config_text,
        backing,
        blocked: None,
        release_when_blocked: false,
        latent: None,
    }
}

/// The backend of a valid policy; a named MIG layout the mig-parted config lacks is an error.
fn backing(
    name: &str,
    spec: &GpuSharingPolicySpec,
    base: Option<&BTreeMap<String, serde_json::Value>>,
    errors: &mut Vec<FieldError>,
) -> Backing {
    if spec.backend == Backend::Dra {
        return Backing::Dra;
    }
    if spec.strategy.is_vm() {
        let mut vm = VmBacking {
            workload: spec.strategy.workload(),
            vgpu_config: None,
            vgpu_custom: None,
            vgpu_entries: Vec::new(),
            vgpu_board_gb: BTreeMap::new(),
        };
        if let Some(v) = &spec.vgpu {
            if v.custom_layout.is_some() {
                let entries = nvidia::vgpu::custom_entries(v);
                let hash =
                    nvidia::content_hash(&serde_json::to_value(&entries).expect("serializable"));
                vm.vgpu_config = Some(nvidia::vgpu::custom_name(name, &entries));
                vm.vgpu_entries = entries.clone();
                vm.vgpu_custom = Some((entries, hash));
            } else {
                vm.vgpu_config = v.type_.clone();
            }
        }
        return Backing::Vm(vm);
    }
    let Some(mig) = &spec.mig else {
        return Backing::Sharing;
    };
    if let Some(d) = &mig.dynamic {
        for (i, l) in d.layouts.iter().enumerate() {
            if let Err(why) = check_layout(l, base) {
                errors.push(field_error(&format!("spec.mig.dynamic.layouts[{i}]"), why));
            }
        }
    }
    if mig.custom_layout.is_some() {
        let entries = nvidia::custom_layout_entries(mig);
        let hash = nvidia::content_hash(&serde_json::to_value(&entries).expect("serializable"));
        let layout = nvidia::custom_layout_name(name, &entries);
        return Backing::Mig(MigBacking {
            layout,
            custom: Some((entries, hash)),
        });
    }
    let l = mig.layout.clone().unwrap_or_default();
    let known = l == MIG_DISABLED_LAYOUT || base.is_some_and(|b| b.contains_key(&l));
    if base.is_some() && !known {
        errors.push(field_error(
            "spec.mig.layout",
            format!("{l:?} is not a layout of the mig-parted configuration (the MIG manager would fail with: selected mig-config not present)"),
        ));
    }
    Backing::Mig(MigBacking {
        layout: l,
        custom: None,
    })
}

/// A named vGPU type must be an entry of the vGPU Device Manager's config (NVIDIA's default
/// names one per type); unknown names would leave the node `failed`.
pub fn check_vgpu_types(prepared: &mut [Prepared], base: &BTreeMap<String, serde_json::Value>) {
    for p in prepared.iter_mut().filter(|p| p.errors.is_empty()) {
        let Some(Backing::Vm(vm)) = &mut p.backing else {
            continue;
        };
        if let Some(t) = p.spec.vgpu.as_ref().and_then(|v| v.type_.as_ref()) {
            if let Some(entries) = base.get(t).and_then(nvidia::vgpu::entries_of) {
                vm.vgpu_entries = entries;
            } else {
                p.errors.push(field_error(
                    "spec.vgpu.type",
                    format!("{t:?} is not an entry of the vGPU Device Manager's config (NVIDIA's default names one per vGPU type, e.g. A100-1-5C, L4-6Q); the vGPU Device Manager would fail with: config not present"),
                ));
                p.key = None;
                p.backing = None;
                continue;
            }
        }
        let families: BTreeSet<String> = vm
            .vgpu_entries
            .iter()
            .flat_map(|e| e.vgpu_devices.keys())
            .filter_map(|t| nvidia::vgpu::parse_vgpu_type(t))
            .map(|t| t.family)
            .collect();
        for f in families {
            if let Some(gb) = nvidia::vgpu::board_gb(base, &f) {
                vm.vgpu_board_gb.insert(f, gb);
            }
        }
    }
}

/// Every policy not being deleted, validated and in precedence order, with the errors that
/// depend on other policies (two DRA policies rendering one template) or on the GPU Operator's
/// config (named layouts next to a custom one need its default config).
pub fn prepare_all<'a>(
    policies: &'a [GpuSharingPolicy],
    base: Option<&BTreeMap<String, serde_json::Value>>,
) -> Vec<Prepared<'a>> {
    let mut sorted: Vec<&GpuSharingPolicy> = policies
        .iter()
        .filter(|p| p.metadata.deletion_timestamp.is_none())
        .collect();
    sorted.sort_by_key(|p| precedence(p));
    let mut prepared: Vec<Prepared> = sorted.iter().map(|p| prepare(p, base)).collect();
    let mut template_owner: BTreeMap<String, String> = BTreeMap::new();
    for p in prepared.iter_mut().filter(|p| p.errors.is_empty()) {
        let Some(dra) = &p.spec.dra else { continue };
        let name = nvidia::dra::template_name(&p.name, p.spec);
        for ns in &dra.namespaces {
            let id = format!("{ns}/{name}");
            if let Some(first) = template_owner.get(&id) {
                p.errors.push(field_error(
                    "spec.dra",
                    format!("ResourceClaimTemplate {id} is already rendered by policy {first}"),
                ));
            } else {
                template_owner.insert(id, p.name.clone());
            }
        }
        if !p.errors.is_empty() {
            p.key = None;
        }
    }
    // A custom layout points the MIG manager at our ConfigMap; named layouts must then be in it,
    // which needs the GPU Operator's default config.
    let any_custom = prepared
        .iter()
        .any(|p| p.errors.is_empty() && p.mig().is_some_and(|m| m.custom.is_some()));
    if any_custom && base.is_none() {
        for p in prepared.iter_mut().filter(|p| p.errors.is_empty()) {
            if let Some(l) = p.spec.mig.as_ref().and_then(|m| m.layout.as_ref())
                && l != MIG_DISABLED_LAYOUT
            {
                p.errors.push(field_error(
                    "spec.mig.layout",
                    format!("{l:?} cannot be served: a custom layout replaces the MIG manager's config with ours, and the GPU Operator's default-mig-parted-config (whose named layouts we would carry over) was not found"),
                ));
                p.key = None;
                p.config_text = None;
            }
        }
    }
    prepared
}

/// Which policies select which nodes, and which one governs each node.
#[derive(Default)]
pub struct Assignment<'n> {
    /// By policy (index in precedence order): the names of the nodes it selects, in the nodes'
    /// order.
    pub matched: Vec<Vec<&'n str>>,
    /// The same nodes, by position in the nodes given.
    pub matched_at: Vec<Vec<usize>>,
    /// By node (position in the nodes given): the index of the policy that governs it.
    pub winner: Vec<Option<usize>>,
}

/// Matches every node against the policies; the first in precedence order wins a node. A node
/// is checked only against the policies that can select it: those whose first `matchLabels`
/// entry it carries (looked up by that label's value), and those without `matchLabels`. The
/// same answer as checking every policy, without the cost of nodes x policies.
///
/// `known` gives, by node, the policies that select it when already known (the planner's
/// memo); the others are matched here and returned as `(position, policies)`.
pub fn assign<'n>(
    prepared: &[Prepared],
    nodes: &[&'n NodeFacts],
    known: &[Option<&[usize]>],
) -> (Assignment<'n>, Vec<(usize, Vec<usize>)>) {
    let mut by_label: HashMap<(&str, &str), Vec<usize>> = HashMap::new();
    let mut keys: BTreeSet<&str> = BTreeSet::new();
    let mut unindexed = Vec::new();
    for (i, p) in prepared.iter().enumerate() {
        let first = p.spec.node_selector.match_labels.as_ref();
        match first.and_then(|m| m.iter().next()) {
            Some((k, v)) => {
                keys.insert(k);
                by_label.entry((k, v)).or_default().push(i);
            }
            None => unindexed.push(i),
        }
    }
    let mut a = Assignment {
        matched: vec![Vec::new(); prepared.len()],
        matched_at: vec![Vec::new(); prepared.len()],
        winner: vec![None; nodes.len()],
    };
    let mut fresh = Vec::new();
    let mut candidates = Vec::new();
    for (pos, n) in nodes.iter().enumerate() {
        let selecting = match known.get(pos).copied().flatten() {
            Some(s) => s,
            None => {
                let sel_labels = selection_labels(&n.labels);
                candidates.clear();
                candidates.extend_from_slice(&unindexed);
                for k in &keys {
                    if let Some(found) = sel_labels.label(k).and_then(|v| by_label.get(&(*k, v))) {
                        candidates.extend_from_slice(found);
                    }
                }
                candidates.sort_unstable();
                candidates
                    .retain(|&i| selector_matches(&prepared[i].spec.node_selector, &sel_labels));
                fresh.push((pos, candidates.clone()));
                &candidates[..]
            }
        };
        for &i in selecting {
            a.matched[i].push(n.name.as_str());
            a.matched_at[i].push(pos);
            a.winner[pos].get_or_insert(i);
        }
    }
    (a, fresh)
}

/// The cluster-wide MIG strategy: that of the highest-precedence valid MIG policy governing a
/// node, else of the highest-precedence valid MIG policy that would not switch a governing MPS
/// policy's nodes off MPS (a `mixed` policy selecting no node, a dynamic one say, must not).
/// Policies that disagree with it (or MPS while it is `mixed`) are marked: `blocked` if they
/// govern nodes, `latent` otherwise; so is a `mixed` policy left out for MPS.
/// Without any node (e.g. `render` without `--nodes`) every policy counts as governing, so
/// conflicts are still reported.
pub fn cluster_mig_strategy(
    prepared: &mut [Prepared],
    winner: &[Option<usize>],
) -> Option<MigStrategy> {
    let mut governing: BTreeSet<usize> = winner.iter().flatten().copied().collect();
    if governing.is_empty() {
        governing = (0..prepared.len()).collect();
    }
    let valid_mig = |p: &Prepared| p.errors.is_empty() && p.spec.mig.is_some();
    let mixed =
        |p: &Prepared| p.spec.mig.as_ref().map(|m| m.mig_strategy) == Some(MigStrategy::Mixed);
    let mps = governing
        .iter()
        .map(|&i| &prepared[i])
        .find(|p| p.errors.is_empty() && p.spec.strategy == Strategy::Mps)
        .map(|p| p.name.clone());
    let owner = (0..prepared.len())
        .find(|i| valid_mig(&prepared[*i]) && governing.contains(i))
        .or_else(|| {
            (0..prepared.len())
                .find(|i| valid_mig(&prepared[*i]) && !(mps.is_some() && mixed(&prepared[*i])))
        });
    let Some(owner) = owner else {
        for p in prepared.iter_mut().filter(|p| valid_mig(p) && mixed(p)) {
            p.latent = mps.as_ref().map(|m| {
                format!("its migStrategy mixed becomes the cluster-wide MIG strategy, and the nodes of MPS policy {m} are switched off MPS (held back while this policy governs no node)")
            });
        }
        return None;
    };
    let cm = prepared[owner].spec.mig.as_ref()?.mig_strategy;
    let owner = prepared[owner].name.clone();
    for (i, p) in prepared.iter_mut().enumerate() {
        if !p.errors.is_empty() {
            continue;
        }
        let mut conflict = None;
        if let Some(m) = &p.spec.mig
            && m.mig_strategy != cm
        {
            conflict = Some(format!(
                "migStrategy {} conflicts with {} of policy {owner}: the GPU Operator's mig.strategy is cluster-wide",
                m.mig_strategy.as_str(),
                cm.as_str()
            ));
        }
        if p.spec.strategy == Strategy::Mps && cm == MigStrategy::Mixed {
            conflict = Some(format!(
                "MPS does not work with the cluster-wide MIG strategy mixed set by policy {owner}: its nodes are switched off MPS"
            ));
            // Held as they are, its nodes' device plugins would refuse MPS once the
            // ClusterPolicy says mixed: they go back to exclusive first (see `plan`).
            p.release_when_blocked = true;
        }
        if governing.contains(&i) {
            p.blocked = conflict;
        } else {
            p.latent = conflict;
        }
    }
    Some(cm)
}
