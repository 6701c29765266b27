//! The per-node transition: from a node's facts, the policy that governs it (if any) and the
//! environment, a [`Decision`] (release the node, hold it as it is, or write labels), then the
//! labels and annotations we want to own on it.
//!
//! The rules it enforces, whatever the order of events:
//! - MIG and sharing are never on a node at once: MIG goes to `all-disabled` and is confirmed by
//!   the MIG manager before a sharing config is applied; sharing is switched off before a MIG
//!   layout changes.
//! - A MIG layout change needs idle GPUs (unless the policy opts out), and marks
//!   `mig.config.state=pending` with the label, so an old `success` never confirms a new layout.
//! - A node the MIG manager failed on (or that stayed pending past the timeout) is left alone.
//! - A node counts as `Applied` only when NVIDIA's components confirm what the spec says.
//! - One backend per node: a node a DRA policy governs gets the device plugin switched off
//!   (`nvidia.com/gpu.deploy.device-plugin=false`, with idle GPUs, never while the MIG manager
//!   works) and counts as `Applied` only once the device plugin's allocatable is gone; it gets
//!   the device plugin back only when no allocated `gpu.nvidia.com` ResourceClaim remains on it.

use crate::api::names::*;
use crate::api::state::{HoldReason, NodeState};
use crate::nvidia::state::{ConfigState, NOT_DEPLOYED, Workload, deployed};
use crate::nvidia::{DEFAULT_KEY, MIG_DISABLED_LAYOUT};

use super::backend::{self, dra, vm};
use super::decision::hold;
use super::facts::NodeFacts;
use super::facts::is_vm_host;
use super::policies::Prepared;
use super::targets::node_target;

use super::decision::{Decision, Env};

/// The transition of one node (see the module documentation).
pub fn decide(n: &NodeFacts, policy: Option<&Prepared>, env: &Env) -> Decision {
    let Some(w) = policy else {
        return Decision::Release;
    };
    if !w.accepted() && w.release_when_blocked && w.errors.is_empty() {
        return Decision::Release;
    }
    if !w.accepted() {
        return hold(
            NodeState::Rejected,
            "policy not accepted; node left as it was",
        );
    }
    if let Some((state, why)) = backend::refusal(w, n, env) {
        return hold(state, why);
    }
    // A layout demand chose never goes onto busy GPUs, whatever proceedWithBusyGpus says.
    let busy = !env.gpu_pods.is_empty()
        && (!w
            .spec
            .mig
            .as_ref()
            .is_some_and(|m| m.proceed_with_busy_gpus)
            || super::disruption::demand_reshape(w, n));
    let t = node_target(w, n).expect("accepted policies have a target");
    let d = backend::decide(n, w, &t, env, busy);
    dra::backend_switch(n, w, env, busy, keep_container_workload(n, d))
}

/// A container node whose workload label we own keeps `container` (so a cluster default of
/// `vm-*` never takes it over).
fn keep_container_workload(n: &NodeFacts, mut d: Decision) -> Decision {
    if let Decision::Write { workload, .. } = &mut d
        && workload.is_none()
        && n.owned.contains(LABEL_WORKLOAD)
        && !is_vm_host(n)
    {
        *workload = Some("container");
    }
    d
}

/// What we want to own on a node: labels, annotations, and the state reported for it.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Outcome {
    pub state: Option<NodeState>,
    pub message: String,
    /// Why the node is held as it is, when it waits.
    pub reason: Option<HoldReason>,
    pub labels: super::labels::SmallMap,
    pub annotations: super::labels::SmallMap,
}

/// One governed node's plan, as the per-node transition made it, before the rollout gate.
pub struct Entry<'n, 'm> {
    pub node: &'n super::input::NodeView,
    /// Index of the governing policy (precedence order).
    pub policy: Option<usize>,
    /// What the node should end up running, as its rollout mark records it (see
    /// [`super::backing::NodeTarget::mark`]); `None` without a valid policy.
    pub target: Option<&'m str>,
    /// The transition holds the node as it is.
    pub hold: bool,
    /// The planner's memo of it until the gate changes it.
    pub outcome: std::borrow::Cow<'m, Outcome>,
    /// What it offers, when `Applied` before the gate.
    pub capacity: Option<super::capacity::NodeCapacity>,
    /// Before the gate: the labels it wants are the ones we own on it now.
    pub in_sync: bool,
    /// An earlier change of ours on it is not confirmed yet.
    pub earlier_unconfirmed: bool,
}

/// Turns a decision into the labels and annotations we want to own, and downgrades `Applied` to
/// `Pending` until NVIDIA's components confirm it.
pub fn outcome(n: &NodeFacts, policy: Option<&Prepared>, env: &Env, d: Decision) -> Outcome {
    let mut out = match (d, policy) {
        (Decision::Release, _) | (Decision::Write { .. }, None) => released(n, env),
        (
            Decision::Hold {
                state,
                message,
                reason,
            },
            _,
        ) => {
            let mut o = Outcome {
                reason,
                ..held(n, state, message)
            };
            if dra::device_plugin_back(n, policy, env, state) {
                o.labels.remove(LABEL_DEPLOY_DEVICE_PLUGIN);
                o.message.push_str(
                    "; the device plugin comes back meanwhile: the DRA driver does not serve this node yet",
                );
            }
            o
        }
        (
            Decision::Write {
                state,
                message,
                device_config,
                mig_layout,
                device_plugin_off,
                dra_plugin,
                workload,
                vgpu_config,
            },
            Some(w),
        ) => {
            let mut o = written(n, w, env, state, message, device_config, mig_layout);
            if let Some(wl) = workload {
                o.labels.insert(LABEL_WORKLOAD.to_string(), wl.to_string());
                // Handing a VM host back to containers brings the container stack back up:
                // GPU Feature Discovery's next report after this write confirms it, as after
                // a device-plugin config change.
                if is_vm_host(n) && !Workload::parse(Some(wl)).is_some_and(Workload::is_vm) {
                    o.annotations
                        .insert(ANNOTATION_CONFIG_WRITTEN.to_string(), env.now().to_string());
                }
            }
            if let Some(v) = vgpu_config {
                o.labels.insert(LABEL_VGPU_CONFIG.to_string(), v);
            }
            if let Some(why) =
                vm::unconfirmed(n, w, &o.labels).filter(|_| o.state == Some(NodeState::Applied))
            {
                o.state = Some(NodeState::Pending);
                o.message = why;
            }
            if let Some(on) = dra_plugin {
                let v = if on { dra::DRA_DEPLOYED } else { NOT_DEPLOYED };
                o.labels
                    .insert(LABEL_DEPLOY_DRA_DRIVER.to_string(), v.to_string());
            }
            if device_plugin_off {
                o.labels.insert(
                    LABEL_DEPLOY_DEVICE_PLUGIN.to_string(),
                    NOT_DEPLOYED.to_string(),
                );
                if o.state == Some(NodeState::Applied)
                    && deployed(n.labels.get(LABEL_DEPLOY_DEVICE_PLUGIN))
                {
                    o.state = Some(NodeState::Pending);
                    o.message = format!(
                        "switching the device plugin off ({LABEL_DEPLOY_DEVICE_PLUGIN}=false)"
                    );
                }
            }
            o
        }
    };
    mark_pending(n, &mut out.labels);
    out
}

/// A node held as it is while it waits for its rollout wave (or the rollout is paused or
/// halted), for `reason`.
pub fn queued(n: &NodeFacts, message: String, reason: HoldReason) -> Outcome {
    let mut o = held(n, NodeState::Queued, message);
    o.reason = Some(reason);
    mark_pending(n, &mut o.labels);
    o
}

fn released(n: &NodeFacts, env: &Env) -> Outcome {
    let mut labels = super::labels::SmallMap::default();
    if n.owned.contains(LABEL_MIG_CONFIG) {
        // MIG changes need idle GPUs: a node whose GPU pods still run, or which the DRA driver
        // may still hold, keeps its layout until they are gone, then goes back to all-disabled.
        let layout = n
            .labels
            .get(LABEL_MIG_CONFIG)
            .filter(|_| !env.gpu_pods.is_empty() || dra::holds_gpus(n, env))
            .unwrap_or(MIG_DISABLED_LAYOUT);
        labels.insert(LABEL_MIG_CONFIG.into(), layout.into());
    }
    // The device plugin comes back only when no DRA claim holds the node's GPUs and the DRA
    // driver we switched on has withdrawn.
    let (dp_off, dra_switch) = dra::released_switches(n, env);
    if dp_off {
        labels.insert(LABEL_DEPLOY_DEVICE_PLUGIN.into(), NOT_DEPLOYED.into());
    }
    if let Some(on) = dra_switch {
        let v = if on { dra::DRA_DEPLOYED } else { NOT_DEPLOYED };
        labels.insert(LABEL_DEPLOY_DRA_DRIVER.into(), v.into());
    }
    // A VM host we made stays one while VMs use its GPUs.
    if is_vm_host(n) && n.owned.contains(LABEL_WORKLOAD) && !env.vm_pods.is_empty() {
        for key in [LABEL_WORKLOAD, LABEL_VGPU_CONFIG] {
            if let Some(v) = n.labels.get(key).filter(|_| n.owned.contains(key)) {
                labels.insert(key.into(), v.into());
            }
        }
    }
    Outcome {
        labels,
        ..Default::default()
    }
}

/// The values of the keys we own among `have` (a node's labels or annotations).
fn keep<T: FromIterator<(String, String)>>(
    owned: &super::labels::OwnedKeys,
    have: &super::labels::Labels,
) -> T {
    owned
        .iter()
        .filter_map(|k| have.get(k).map(|v| (k.clone(), v.to_string())))
        .collect()
}

/// Whether the node's labels and annotations already are the ones the plan wants us to own:
/// the same keys owned by us, with the same values (nothing to write). Checked for every node
/// a pass plans again: no allocation.
pub fn metadata_in_sync(
    n: &NodeFacts,
    labels: &super::labels::SmallMap,
    annotations: &super::labels::SmallMap,
) -> bool {
    same_keys(n.owned, |k| MANAGED_LABELS.contains(&k), labels)
        && labels.iter().all(|(k, v)| n.labels.get(k) == Some(v))
        && same_keys(n.owned_annotations, |_| true, annotations)
        && annotations
            .iter()
            .all(|(k, v)| n.annotations.get(k) == Some(v))
}

/// The keys we own (those `counted` counts) are exactly the keys we want.
fn same_keys(
    owned: super::labels::OwnedKeys,
    counted: impl Fn(&str) -> bool,
    want: &super::labels::SmallMap,
) -> bool {
    let mine = owned.iter().filter(|k| counted(k)).count();
    mine == want.len() && want.keys().all(|k| counted(k) && owned.contains(k))
}

/// The labels we own on a node now.
pub fn owned_labels(n: &NodeFacts) -> super::labels::SmallMap {
    keep(&n.owned, &n.labels)
}

fn held(n: &NodeFacts, state: NodeState, message: String) -> Outcome {
    Outcome {
        state: Some(state),
        message,
        reason: None,
        labels: keep(&n.owned, &n.labels),
        annotations: keep(&n.owned_annotations, &n.annotations),
    }
}

fn written(
    n: &NodeFacts,
    w: &Prepared,
    env: &Env,
    state: NodeState,
    message: String,
    dp: String,
    mig: Option<String>,
) -> Outcome {
    let annotations = annotations(n, env, &dp, mig.as_deref());
    let (state, message) = if state == NodeState::Applied {
        match unconfirmed(n, w, &dp, &annotations, env)
            .or_else(|| not_advertised(n, w, env.mig_layouts))
        {
            Some(why) => (NodeState::Pending, why),
            None => (state, message),
        }
    } else {
        (state, message)
    };
    let mut labels = super::labels::SmallMap::default();
    labels.insert(LABEL_POLICY.to_string(), w.name.clone());
    labels.insert(LABEL_DEVICE_PLUGIN_CONFIG.to_string(), dp);
    if let Some(m) = mig {
        labels.insert(LABEL_MIG_CONFIG.to_string(), m);
    }
    Outcome {
        state: Some(state),
        message,
        reason: None,
        labels,
        annotations,
    }
}

/// Our annotations: when the device-plugin config label last changed (kept while it stays), and
/// which MIG layout content the node was labelled with. A node without the label already runs
/// the default config (the ClusterPolicy's `devicePlugin.config.default`, which is ours, and
/// NVIDIA's own default otherwise, both whole GPUs): labelling it `default` changes nothing the
/// device plugin or GPU Feature Discovery would report, so it is no config change to wait for.
fn annotations(n: &NodeFacts, env: &Env, dp: &str, mig: Option<&str>) -> super::labels::SmallMap {
    let mut a = super::labels::SmallMap::default();
    let current = n.labels.get(LABEL_DEVICE_PLUGIN_CONFIG);
    let unchanged = current == Some(dp) || current.is_none() && dp == DEFAULT_KEY;
    if !unchanged {
        a.insert(ANNOTATION_CONFIG_WRITTEN.to_string(), env.now().to_string());
    } else if let Some(v) = n.annotations.get(ANNOTATION_CONFIG_WRITTEN) {
        a.insert(ANNOTATION_CONFIG_WRITTEN.to_string(), v.to_string());
    }
    if let Some(m) = mig.filter(|m| *m != MIG_DISABLED_LAYOUT) {
        let kept = n
            .annotations
            .get(ANNOTATION_MIG_LAYOUT)
            .filter(|v| v.rsplit_once('@').is_some_and(|(l, _)| l == m));
        match kept {
            Some(v) if n.labels.get(LABEL_MIG_CONFIG) == Some(m) => {
                a.insert(ANNOTATION_MIG_LAYOUT.to_string(), v.to_string());
            }
            _ => {
                if let Some(h) = (env.layout_hash)(m) {
                    a.insert(ANNOTATION_MIG_LAYOUT.to_string(), format!("{m}@{h}"));
                }
            }
        }
    }
    a
}

/// Why a node whose labels say `Applied` is not confirmed yet, if it is not: the labels must
/// be in place, then the policy's backend judges what NVIDIA's components report
/// ([`backend::unconfirmed`]).
fn unconfirmed(
    n: &NodeFacts,
    w: &Prepared,
    dp: &str,
    annotations: &super::labels::SmallMap,
    env: &Env,
) -> Option<String> {
    if n.labels.get(LABEL_DEVICE_PLUGIN_CONFIG) != Some(dp) {
        return Some(format!("labelling node with config {dp}"));
    }
    let written = annotations
        .get(ANNOTATION_CONFIG_WRITTEN)
        .map(String::as_str);
    backend::unconfirmed(n, w, (dp, written), env)
}

/// Why a node whose labels and GPU Feature Discovery's report say `Applied` is not confirmed
/// yet: the device plugin does not advertise (the node's allocatable) what it serves under the
/// policy: the resources with their counts (only the resources, when the counts are inferred).
/// GFD's report can come before: it relabels after our config write, and again after the MIG
/// manager reshapes the GPUs, while the kubelet takes the device plugin's new devices later.
fn not_advertised(
    n: &NodeFacts,
    w: &Prepared,
    layouts: Option<&std::collections::BTreeMap<String, serde_json::Value>>,
) -> Option<String> {
    let spec = super::targets::node_spec(w, n);
    let want = super::backend::advertises(&spec, n, layouts)?;
    let missing: Vec<String> = want
        .resources
        .iter()
        .filter(|(r, (min, max))| !(*min..=*max).contains(&n.allocatable(r)))
        .map(|(r, (min, max))| {
            if min == max {
                format!("{r}={min}")
            } else {
                format!("{r}={min}..{max}")
            }
        })
        .collect();
    if missing.is_empty() {
        return None;
    }
    let have: Vec<String> = n
        .device_plugin_resources()
        .iter()
        .map(|(r, c)| format!("{r}={c}"))
        .collect();
    let have = if have.is_empty() {
        "nothing".to_string()
    } else {
        have.join(", ")
    };
    Some(format!(
        "waiting for the device plugin to advertise {} (allocatable now: {have})",
        missing.join(", ")
    ))
}

/// A MIG layout change also sets `nvidia.com/mig.config.state=pending` in the same write: until
/// the MIG manager reports, the old `success` must not be read as confirming the new layout. We
/// keep owning `pending` only until the MIG manager overwrites it (its update takes the field
/// over), so we never remove or overwrite its report. A vGPU config change does the same with
/// `nvidia.com/vgpu.config.state` for the vGPU Device Manager.
fn mark_pending(n: &NodeFacts, labels: &mut super::labels::SmallMap) {
    for (config, state) in [
        (LABEL_MIG_CONFIG, LABEL_MIG_STATE),
        (LABEL_VGPU_CONFIG, LABEL_VGPU_STATE),
    ] {
        let Some(want) = labels.get(config) else {
            continue;
        };
        let pending = ConfigState::Pending.label_value();
        let ours_pending = n.owned.contains(state) && n.labels.get(state) == Some(pending);
        if n.labels.get(config) != Some(want.as_str()) || ours_pending {
            labels.insert(state.to_string(), pending.to_string());
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;
    use crate::api::crd::GpuSharingPolicy;
    use crate::plan::policies::prepare_all;
    use crate::plan::testing::{a100_node as node, policy};

    fn base() -> BTreeMap<String, serde_json::Value> {
        let mut m = BTreeMap::new();
        m.insert(
            "all-1g.10gb".to_string(),
            crate::api::yaml::from_str(
                "[{devices: all, mig-enabled: true, mig-devices: {1g.10gb: 7}}]",
            )
            .unwrap(),
        );
        m
    }

    const MPS: &str = "  strategy: mps\n  mps: {replicas: 4}\n";
    const MPS_20: &str = "  strategy: mps\n  mps: {replicas: 20}\n";
    const MIG: &str = "  strategy: mig\n  mig: {migStrategy: single, layout: all-1g.10gb}\n";
    const MIG_BUSY_OK: &str = "  strategy: mig\n  mig: {migStrategy: single, layout: all-1g.10gb, proceedWithBusyGpus: true}\n";
    const DRA: &str = "  strategy: mps\n  mps: {replicas: 2}\n  backend: dra\n  dra: {namespaces: [team], driverFeatureGates: {MPSSupport: true}}\n";
    const INVALID: &str = "  strategy: mps\n  mps: {replicas: 1}\n";

    /// What a row expects of the decision: the state, and for writes the device-plugin key
    /// ("KEY" for the policy's own) and MIG layout. (`Applied` is the decision's; confirmation by
    /// NVIDIA's components is tested below.)
    #[derive(Debug, PartialEq)]
    enum Want {
        Release,
        Hold(NodeState),
        Write(NodeState, &'static str, Option<&'static str>),
    }

    /// What a case is called, the policy's spec, the node's extra labels, the pods using its GPUs,
    /// whether its MIG state is stuck, and what is expected.
    type Row<'a> = (
        &'a str,
        Option<&'a str>,
        Vec<(&'a str, &'a str)>,
        &'a [&'a str],
        bool,
        Want,
    );

    #[test]
    fn transitions() {
        use NodeState::*;
        let none: &[&str] = &[];
        let busy = &["team/job"][..];
        #[rustfmt::skip]
        let rows: Vec<Row> = vec![
            ("no policy: release", None, vec![], none, false, Want::Release),
            ("invalid policy: hold", Some(INVALID), vec![], none, false, Want::Hold(Rejected)),
            ("MPS above 16 clients below CC 7.5: rejected",
                Some(MPS_20), vec![("nvidia.com/gpu.compute.major", "7")], none, false, Want::Hold(Rejected)),
            ("MIG on a GPU without MIG: rejected",
                Some(MIG), vec![("nvidia.com/mig.capable", "false")], none, false, Want::Hold(Rejected)),
            ("sharing, MIG never set: applied", Some(MPS), vec![("nvidia.com/mig.capable", "false")], none, false,
                Want::Write(Applied, "KEY", None)),
            ("sharing, MIG on: disable it first, no sharing meanwhile",
                Some(MPS), vec![("nvidia.com/mig.config", "all-1g.10gb"), ("nvidia.com/mig.config.state", "success")],
                none, false, Want::Write(Pending, "default", Some("all-disabled"))),
            ("sharing, all-disabled not confirmed yet: wait",
                Some(MPS), vec![("nvidia.com/mig.config", "all-disabled"), ("nvidia.com/mig.config.state", "pending")],
                none, false, Want::Write(Pending, "default", Some("all-disabled"))),
            ("sharing, all-disabled confirmed: sharing on",
                Some(MPS), vec![("nvidia.com/mig.config", "all-disabled"), ("nvidia.com/mig.config.state", "success")],
                none, false, Want::Write(Applied, "KEY", Some("all-disabled"))),
            ("sharing, disabling MIG failed: left alone",
                Some(MPS), vec![("nvidia.com/mig.config", "all-disabled"), ("nvidia.com/mig.config.state", "failed")],
                none, false, Want::Hold(Failed)),
            ("sharing, disabling MIG pending past the timeout: left alone",
                Some(MPS), vec![("nvidia.com/mig.config", "all-disabled"), ("nvidia.com/mig.config.state", "pending")],
                none, true, Want::Hold(Failed)),
            ("sharing, MIG on and GPUs busy: wait for idle",
                Some(MPS), vec![("nvidia.com/mig.config", "all-1g.10gb"), ("nvidia.com/mig.config.state", "success")],
                busy, false, Want::Hold(Waiting)),
            ("MIG, sharing config on: take it off first, layout unchanged",
                Some(MIG), vec![("nvidia.com/device-plugin.config", "other-12345678"), ("nvidia.com/mig.config", "all-disabled"),
                ("nvidia.com/mig.config.state", "success")], none, false, Want::Write(Pending, "default", Some("all-disabled"))),
            ("MIG, sharing off: change the layout",
                Some(MIG), vec![("nvidia.com/device-plugin.config", "default"), ("nvidia.com/mig.config", "all-disabled"),
                ("nvidia.com/mig.config.state", "success")], none, false, Want::Write(Pending, "default", Some("all-1g.10gb"))),
            ("MIG, layout confirmed: its config on",
                Some(MIG), vec![("nvidia.com/mig.config", "all-1g.10gb"), ("nvidia.com/mig.config.state", "success")],
                none, false, Want::Write(Applied, "KEY", Some("all-1g.10gb"))),
            ("MIG, layout failed: left alone",
                Some(MIG), vec![("nvidia.com/mig.config", "all-1g.10gb"), ("nvidia.com/mig.config.state", "failed")],
                none, false, Want::Hold(Failed)),
            ("MIG, layout pending past the timeout: left alone",
                Some(MIG), vec![("nvidia.com/mig.config", "all-1g.10gb"), ("nvidia.com/mig.config.state", "pending")],
                none, true, Want::Hold(Failed)),
            ("MIG, layout change with busy GPUs: wait",
                Some(MIG), vec![("nvidia.com/mig.config", "all-disabled"), ("nvidia.com/mig.config.state", "success")],
                busy, false, Want::Hold(Waiting)),
            ("MIG, busy GPUs but the policy proceeds",
                Some(MIG_BUSY_OK), vec![("nvidia.com/mig.config", "all-disabled"), ("nvidia.com/mig.config.state", "success")],
                busy, false, Want::Write(Pending, "default", Some("all-1g.10gb"))),
            ("DRA: the device plugin shares nothing",
                Some(DRA), vec![("nvidia.com/mig.capable", "false")], none, false, Want::Write(Applied, "default", None)),
        ];
        let hash = |l: &str| (l != MIG_DISABLED_LAYOUT).then(|| "h".to_string());
        for (what, spec, labels, pods, stuck, want) in rows {
            let policies: Vec<GpuSharingPolicy> =
                spec.map(|s| policy("p", s)).into_iter().collect();
            let base = base();
            let prepared = prepare_all(&policies, Some(&base));
            let n = node(&labels);
            let pods = pods.iter().map(|s| s.to_string()).collect::<Vec<_>>();
            let env = Env {
                gpu_pods: &pods,
                mig_stuck: stuck,
                ..Env::idle(100, &hash)
            };
            let p = prepared.first();
            let key = p.and_then(|p| p.key.clone()).unwrap_or_default();
            let got = match decide(&n, p, &env) {
                Decision::Release => Want::Release,
                Decision::Hold { state, .. } => Want::Hold(state),
                Decision::Write {
                    state,
                    device_config,
                    mig_layout,
                    ..
                } => {
                    let dp = match device_config.as_str() {
                        DEFAULT_KEY => DEFAULT_KEY,
                        k if k == key => "KEY",
                        _ => device_config.leak(),
                    };
                    Want::Write(state, dp, mig_layout.map(|m| &*m.leak()))
                }
            };
            assert_eq!(got, want, "{what}");
        }
    }

    #[test]
    fn outcomes_keep_what_a_hold_owns_and_release_gives_back() {
        let hash = |_: &str| None;
        let env = Env::idle(100, &hash);
        let mut n = node(&[
            ("nvidia.com/mig.config", "all-1g.10gb"),
            ("nvidia.com/mig.config.state", "success"),
            ("nvidia.com/device-plugin.config", "p-12345678"),
        ]);
        n.annotations.insert(ANNOTATION_CONFIG_WRITTEN, "42");
        n.owned_annotations.insert(ANNOTATION_CONFIG_WRITTEN);
        let held = outcome(&n, None, &env, hold(NodeState::Failed, "x"));
        assert_eq!(held.labels.len(), 3);
        assert_eq!(held.annotations[ANNOTATION_CONFIG_WRITTEN], "42");
        let released = outcome(&n, None, &env, Decision::Release);
        // Our MIG layout goes back to all-disabled, marked pending; nothing else stays ours.
        assert_eq!(
            released.labels,
            [
                (
                    LABEL_MIG_CONFIG.to_string(),
                    MIG_DISABLED_LAYOUT.to_string()
                ),
                (LABEL_MIG_STATE.to_string(), "pending".to_string())
            ]
            .into_iter()
            .collect::<super::super::labels::SmallMap>()
        );
        assert!(released.annotations.is_empty());
        // While GPU pods run there, the layout stays (MIG changes need idle GPUs).
        let pods = ["ml/train".to_string()];
        let busy = Env {
            gpu_pods: &pods,
            ..Env::idle(100, &hash)
        };
        let released = outcome(&n, None, &busy, Decision::Release);
        assert_eq!(
            released.labels.get(LABEL_MIG_CONFIG).map(String::as_str),
            Some("all-1g.10gb")
        );
    }

    #[test]
    fn applied_waits_for_gfd_after_our_write() {
        let hash = |_: &str| None;
        let env = Env::idle(100, &hash);
        let policies = vec![policy("p", MPS)];
        let prepared = prepare_all(&policies, None);
        let key = prepared[0].key.clone().unwrap();
        let mut n = node(&[
            ("nvidia.com/mig.capable", "false"),
            ("nvidia.com/device-plugin.config", &key),
            ("nvidia.com/gfd.timestamp", "90"),
        ]);
        n.annotations.insert(ANNOTATION_CONFIG_WRITTEN, "95");
        let state = |n: &NodeFacts| {
            let d = decide(n, Some(&prepared[0]), &env);
            outcome(n, Some(&prepared[0]), &env, d).state.unwrap()
        };
        assert_eq!(
            state(&n),
            NodeState::Pending,
            "GFD labelled before our write"
        );
        n.labels.insert("nvidia.com/gfd.timestamp", "96");
        n.labels.insert("nvidia.com/gpu.replicas", "2");
        assert_eq!(state(&n), NodeState::Pending, "GFD reports other replicas");
        n.labels.insert("nvidia.com/gpu.replicas", "4");
        // GFD reports before the kubelet takes the device plugin's new devices.
        n.allocatable = [("nvidia.com/gpu", "8")].into_iter().collect();
        assert_eq!(state(&n), NodeState::Pending, "the old devices");
        let d = decide(&n, Some(&prepared[0]), &env);
        let message = outcome(&n, Some(&prepared[0]), &env, d).message;
        assert_eq!(
            message,
            "waiting for the device plugin to advertise nvidia.com/gpu=32 (allocatable now: nvidia.com/gpu=8)"
        );
        n.allocatable = [("nvidia.com/gpu", "32")].into_iter().collect();
        assert_eq!(state(&n), NodeState::Applied);
    }

    #[test]
    fn a_mig_layout_is_applied_once_the_device_plugin_advertises_its_instances() {
        let hash = |_: &str| None;
        let mixed = "  strategy: mig\n  mig:\n    migStrategy: mixed\n    customLayout:\n    - {migEnabled: true, migDevices: {3g.40gb: 1, 2g.20gb: 2}}\n";
        let renamed = "  strategy: mig\n  mig:\n    migStrategy: mixed\n    customLayout:\n    - {migEnabled: true, migDevices: {3g.40gb: 1, 2g.20gb: 2}}\n    timeSlicing: {replicas: 2, renameByDefault: true}\n";
        let env = Env::idle(100, &hash);
        for (spec, want) in [
            (
                mixed,
                [
                    ("nvidia.com/mig-2g.20gb", "16"),
                    ("nvidia.com/mig-3g.40gb", "8"),
                ],
            ),
            (
                renamed,
                [
                    ("nvidia.com/mig-2g.20gb.shared", "32"),
                    ("nvidia.com/mig-3g.40gb.shared", "16"),
                ],
            ),
        ] {
            let policies = vec![policy("p", spec)];
            let prepared = prepare_all(&policies, None);
            assert!(prepared[0].errors.is_empty(), "{:?}", prepared[0].errors);
            let w = &prepared[0];
            // Our writes until we want nothing more, the MIG manager's `success` after each
            // (its update takes the field over from our `pending`).
            let mut n = node(&[]);
            for _ in 0..4 {
                let d = decide(&n, Some(w), &env);
                let o = outcome(&n, Some(w), &env, d);
                crate::plan::facts::apply_to_node(&mut n, &o.labels, &o.annotations);
                if n.labels.get(LABEL_MIG_STATE) == Some("pending") {
                    n.labels.insert(LABEL_MIG_STATE, "success");
                    n.owned.remove(LABEL_MIG_STATE);
                }
            }
            n.labels.insert("nvidia.com/mig-3g.40gb.replicas", "2");
            n.labels.insert("nvidia.com/mig-2g.20gb.replicas", "2");
            let state = |n: &NodeFacts| {
                let d = decide(n, Some(w), &env);
                let o = outcome(n, Some(w), &env, d);
                (o.state.unwrap(), o.message)
            };
            // The MIG manager said `success`; the device plugin still runs the whole GPUs.
            n.allocatable = [("nvidia.com/gpu", "8")].into_iter().collect();
            let (s, m) = state(&n);
            assert_eq!(s, NodeState::Pending, "{spec}: {m}");
            assert!(
                m.contains(want[0].0) && m.contains("nvidia.com/gpu=8"),
                "{m}"
            );
            // One profile advertised, the other not yet.
            n.allocatable.insert(want[0].0, want[0].1);
            assert_eq!(state(&n).0, NodeState::Pending, "{spec}");
            n.allocatable.insert(want[1].0, "1");
            assert_eq!(state(&n).0, NodeState::Pending, "{spec}: a wrong count");
            n.allocatable.insert(want[1].0, want[1].1);
            n.allocatable.insert("nvidia.com/gpu", "0");
            let (s, m) = state(&n);
            assert_eq!(s, NodeState::Applied, "{spec}: {m}");
        }
    }

    #[test]
    fn dra_switches_the_device_plugin_off_and_back_only_when_safe() {
        let hash = |_: &str| None;
        let dra = vec![policy("d", DRA)];
        let mps = vec![policy("m", MPS)];
        let (dra, mps) = (prepare_all(&dra, None), prepare_all(&mps, None));
        let step = |n: &NodeFacts, w: &Prepared, env: &Env| {
            let d = decide(n, Some(w), env);
            outcome(n, Some(w), env, d)
        };
        let off = |o: &Outcome| o.labels.get(LABEL_DEPLOY_DEVICE_PLUGIN).cloned();
        let pods = vec!["team/cuda".to_string()];
        let claims = vec!["team/claim-0".to_string()];
        let idle = Env::idle(100, &hash);

        // The device plugin still holds GPUs for a pod: wait, do not switch.
        let mut n = node(&[
            ("nvidia.com/mig.capable", "false"),
            ("nvidia.com/gpu.deploy.device-plugin", "true"),
        ]);
        // The GPU Operator's `true`, not ours.
        n.owned.remove(LABEL_DEPLOY_DEVICE_PLUGIN);
        n.allocatable = [("nvidia.com/gpu", "8")].into_iter().collect();
        let busy = Env {
            gpu_pods: &pods,
            ..Env::idle(100, &hash)
        };
        let o = step(&n, &dra[0], &busy);
        assert_eq!(o.state, Some(NodeState::Waiting));
        assert_eq!(off(&o), None);
        // Idle: switched off, Pending until the label is there and allocatable is gone.
        let o = step(&n, &dra[0], &idle);
        assert_eq!(off(&o).as_deref(), Some("false"));
        assert_eq!(o.state, Some(NodeState::Pending));
        n.labels.insert(LABEL_DEPLOY_DEVICE_PLUGIN, "false");
        n.owned.insert(LABEL_DEPLOY_DEVICE_PLUGIN);
        n.labels.insert(LABEL_DEVICE_PLUGIN_CONFIG, DEFAULT_KEY);
        let o = step(&n, &dra[0], &idle);
        assert_eq!(o.state, Some(NodeState::Pending), "{}", o.message);
        assert!(o.message.contains("nvidia.com/gpu=8"), "{}", o.message);
        n.allocatable = [("nvidia.com/gpu", "0")].into_iter().collect();
        let o = step(&n, &dra[0], &idle);
        assert_eq!(o.state, Some(NodeState::Applied), "{}", o.message);
        assert_eq!(off(&o).as_deref(), Some("false"));

        // Back to the device plugin: not while a DRA claim is allocated on the node.
        let claimed = Env {
            dra_claims: &claims,
            ..Env::idle(100, &hash)
        };
        let o = step(&n, &mps[0], &claimed);
        assert_eq!(o.state, Some(NodeState::Waiting));
        assert_eq!(off(&o).as_deref(), Some("false"), "held as it was");
        let o = outcome(&n, None, &claimed, Decision::Release);
        assert_eq!(off(&o).as_deref(), Some("false"), "released but claimed");
        let o = step(&n, &mps[0], &idle);
        assert_eq!(off(&o), None, "the device plugin comes back");
        assert_eq!(
            o.labels.get(LABEL_DEVICE_PLUGIN_CONFIG),
            mps[0].key.as_ref()
        );
        assert_eq!(off(&outcome(&n, None, &idle, Decision::Release)), None);

        // Someone else's `false` is left to them: never owned, so never removed by us.
        n.owned.remove(LABEL_DEPLOY_DEVICE_PLUGIN);
        let o = step(&n, &dra[0], &idle);
        assert_eq!(off(&o), None);
        assert_eq!(o.state, Some(NodeState::Applied), "{}", o.message);

        // MIG disabling in progress: the switch waits for the MIG manager.
        let mut m = node(&[
            ("nvidia.com/mig.config", "all-disabled"),
            ("nvidia.com/mig.config.state", "pending"),
        ]);
        m.allocatable = [("nvidia.com/gpu", "8")].into_iter().collect();
        let o = step(&m, &dra[0], &idle);
        assert_eq!(off(&o), None);
        assert_eq!(o.state, Some(NodeState::Pending));

        // The GPU Operator in DRA-only mode: nothing to switch; device-plugin policies hold.
        let dra_only = Env {
            gpu_cluster: Some("cluster"),
            ..Env::idle(100, &hash)
        };
        let fresh = node(&[("nvidia.com/mig.capable", "false")]);
        assert_eq!(off(&step(&fresh, &dra[0], &dra_only)), None);
        let o = step(&fresh, &mps[0], &dra_only);
        assert_eq!(o.state, Some(NodeState::Rejected));
        assert!(o.message.contains("GPUCluster cluster"), "{}", o.message);
    }

    const EXTENDED: &str = "  strategy: timeSlicing\n  timeSlicing: {replicas: 4}\n  backend: dra\n  dra: {extendedResources: true, driverFeatureGates: {ConsumableShares: true}}\n";

    fn step(n: &NodeFacts, w: &Prepared, env: &Env) -> Outcome {
        let d = decide(n, Some(w), env);
        outcome(n, Some(w), env, d)
    }

    /// The device plugin's and the DRA kubelet plugin's switches an outcome owns.
    fn switches(o: &Outcome) -> (Option<&str>, Option<&str>) {
        (
            o.labels.get(LABEL_DEPLOY_DEVICE_PLUGIN).map(String::as_str),
            o.labels.get(LABEL_DEPLOY_DRA_DRIVER).map(String::as_str),
        )
    }

    /// Writes an outcome's switches to the node, as the API server would.
    fn apply_switches(n: &mut NodeFacts, o: &Outcome) {
        for k in [LABEL_DEPLOY_DEVICE_PLUGIN, LABEL_DEPLOY_DRA_DRIVER] {
            match o.labels.get(k) {
                Some(v) => {
                    n.labels.insert(k, v.as_str());
                    n.owned.insert(k);
                }
                None => {
                    n.labels.remove(k);
                    n.owned.remove(k);
                }
            }
        }
        n.labels.insert(LABEL_DEVICE_PLUGIN_CONFIG, DEFAULT_KEY);
    }

    fn sliced(shares: Option<i64>) -> crate::plan::input::DraSlice {
        crate::plan::input::DraSlice {
            gpus: 8,
            shares,
            ..Default::default()
        }
    }

    /// Time-slicing through the device plugin, moved to DRA extended resources: the device
    /// plugin goes off only on an idle node, the DRA kubelet plugin comes on only once the
    /// device plugin has withdrawn, the node is confirmed by the driver's slice with the
    /// policy's shares. At no step are both on.
    #[test]
    fn a_node_moves_to_dra_extended_resources_one_backend_at_a_time() {
        let hash = |_: &str| None;
        let policies = [policy("x", EXTENDED)];
        let ext = prepare_all(&policies, None);
        assert!(ext[0].errors.is_empty(), "{:?}", ext[0].errors);
        let pods = vec!["team/cuda".to_string()];
        let idle = Env::idle(100, &hash);
        let mut n = node(&[("nvidia.com/mig.capable", "false")]);
        n.allocatable = [("nvidia.com/gpu", "32")].into_iter().collect();
        // A device-plugin GPU pod runs: nothing switches.
        let busy = Env {
            gpu_pods: &pods,
            ..Env::idle(100, &hash)
        };
        let o = step(&n, &ext[0], &busy);
        assert_eq!(o.state, Some(NodeState::Waiting), "{}", o.message);
        assert_eq!(switches(&o), (None, None));
        // Idle: the device plugin goes off; the DRA kubelet plugin not yet.
        let o = step(&n, &ext[0], &idle);
        assert_eq!(switches(&o), (Some("false"), None));
        assert_eq!(o.state, Some(NodeState::Pending));
        apply_switches(&mut n, &o);
        // Off, but its resources are still allocatable: still no DRA.
        let o = step(&n, &ext[0], &idle);
        assert_eq!(switches(&o), (Some("false"), None), "{}", o.message);
        assert!(o.message.contains("withdraw"), "{}", o.message);
        n.allocatable = [("nvidia.com/gpu", "0")].into_iter().collect();
        // Withdrawn: the DRA kubelet plugin comes on; Pending until its slice shows 4 shares.
        let o = step(&n, &ext[0], &idle);
        assert_eq!(switches(&o), (Some("false"), Some("true")));
        assert_eq!(o.state, Some(NodeState::Pending));
        apply_switches(&mut n, &o);
        let o = step(&n, &ext[0], &idle);
        assert!(o.message.contains("ResourceSlice"), "{}", o.message);
        let two = sliced(Some(2));
        let wrong = Env {
            dra_slice: Some(&two),
            ..Env::idle(100, &hash)
        };
        let o = step(&n, &ext[0], &wrong);
        assert_eq!(o.state, Some(NodeState::Pending));
        assert!(o.message.contains("consumableShares to 4"), "{}", o.message);
        let four = sliced(Some(4));
        let served = Env {
            dra_slice: Some(&four),
            ..Env::idle(100, &hash)
        };
        let o = step(&n, &ext[0], &served);
        assert_eq!(o.state, Some(NodeState::Applied), "{}", o.message);
        assert_eq!(switches(&o), (Some("false"), Some("true")));
    }

    /// The MIG layout an outcome owns.
    fn layout(o: &Outcome) -> Option<&str> {
        o.labels.get(LABEL_MIG_CONFIG).map(String::as_str)
    }

    /// What a MIG node's transition knows: NVIDIA's named layouts (`base`), the DRA driver's
    /// `slice` and the claims allocated on the node.
    fn mig_env<'a>(
        base: &'a BTreeMap<String, serde_json::Value>,
        hash: &'a dyn Fn(&str) -> Option<String>,
        slice: Option<&'a crate::plan::input::DraSlice>,
        claims: &'a [String],
    ) -> Env<'a> {
        Env {
            mig_layouts: Some(base),
            dra_slice: slice,
            dra_claims: claims,
            ..Env::idle(100, hash)
        }
    }

    const MIG_EXTENDED: &str = "  strategy: mig\n  mig: {migStrategy: mixed, layout: all-3g.40gb}\n  backend: dra\n  dra: {extendedResources: true}\n";

    /// A MIG pool moves to DRA extended resources: the MIG manager applies the layout first
    /// under the device plugin, then the node moves as a whole-GPU node does, and is confirmed
    /// only by a slice showing as many MIG devices of each profile as the layout makes. A
    /// layout change on the moved node waits for the DRA driver's claims to go.
    #[test]
    fn a_mig_pool_moves_once_its_layout_is_applied_and_its_slice_shows_the_layout() {
        let hash = |_: &str| None;
        let base = crate::nvidia::default_mig_configs();
        let policies = [policy("m", MIG_EXTENDED)];
        let mig = prepare_all(&policies, Some(&base));
        assert!(mig[0].errors.is_empty(), "{:?}", mig[0].errors);
        let env = |slice, claims| mig_env(&base, &hash, slice, claims);
        let idle = env(None, &[]);
        let mut n = node(&[]);
        n.allocatable = [("nvidia.com/gpu", "8")].into_iter().collect();
        // The layout first, through the MIG manager; the device plugin stays on.
        let o = step(&n, &mig[0], &idle);
        assert_eq!(layout(&o), Some("all-3g.40gb"));
        assert_eq!(switches(&o), (None, None), "{}", o.message);
        n.labels.insert(LABEL_MIG_CONFIG, "all-3g.40gb");
        n.labels.insert(LABEL_MIG_STATE, "success");
        n.owned.insert(LABEL_MIG_CONFIG);
        n.allocatable = [("nvidia.com/gpu", "0"), ("nvidia.com/mig-3g.40gb", "16")]
            .into_iter()
            .collect();
        // Applied by the MIG manager: the device plugin goes off, then the DRA kubelet plugin on.
        let o = step(&n, &mig[0], &idle);
        assert_eq!(switches(&o), (Some("false"), None), "{}", o.message);
        apply_switches(&mut n, &o);
        n.allocatable = [("nvidia.com/mig-3g.40gb", "0")].into_iter().collect();
        let o = step(&n, &mig[0], &idle);
        assert_eq!(switches(&o), (Some("false"), Some("true")), "{}", o.message);
        apply_switches(&mut n, &o);
        // Confirmed by the slice's MIG devices, as many as the layout makes (2 per GPU).
        let short = crate::plan::input::DraSlice {
            mig: [("3g.40gb".to_string(), 8)].into(),
            ..Default::default()
        };
        let o = step(&n, &mig[0], &env(Some(&short), &[]));
        assert_eq!(o.state, Some(NodeState::Pending));
        assert!(
            o.message.contains("8 3g.40gb (the layout makes 16)"),
            "{}",
            o.message
        );
        let full = crate::plan::input::DraSlice {
            mig: [("3g.40gb".to_string(), 16)].into(),
            ..Default::default()
        };
        let o = step(&n, &mig[0], &env(Some(&full), &[]));
        assert_eq!(o.state, Some(NodeState::Applied), "{}", o.message);
    }

    /// A MIG node already moved to the DRA driver (layout all-3g.40gb, 16 devices in its slice):
    /// another layout waits for the claims, then stops the DRA kubelet plugin (the driver reads
    /// MIG devices only when it starts) before the MIG manager reshapes; a node released keeps
    /// its layout while claims remain; no switch moves under a device-plugin pod, whatever
    /// `proceedWithBusyGpus` says.
    #[test]
    fn a_moved_mig_node_reshapes_only_without_claims_and_with_its_dra_plugin_stopped() {
        let hash = |_: &str| None;
        let base = crate::nvidia::default_mig_configs();
        let env = |slice, claims| mig_env(&base, &hash, slice, claims);
        let idle = env(None, &[]);
        let mut n = node(&[
            (LABEL_MIG_CONFIG, "all-3g.40gb"),
            (LABEL_MIG_STATE, "success"),
            (LABEL_DEPLOY_DEVICE_PLUGIN, "false"),
            (LABEL_DEPLOY_DRA_DRIVER, "true"),
        ]);
        n.allocatable = [("nvidia.com/mig-3g.40gb", "0")].into_iter().collect();
        let full = crate::plan::input::DraSlice {
            mig: [("3g.40gb".to_string(), 16)].into(),
            ..Default::default()
        };
        // Another layout: held on the DRA driver while a claim is allocated on the node.
        let other = [policy(
            "m",
            &MIG_EXTENDED.replace("all-3g.40gb", "all-1g.10gb"),
        )];
        let other = prepare_all(&other, Some(&base));
        let claims = vec!["team/cuda-extended-resources-x7k2q".to_string()];
        let o = step(&n, &other[0], &env(Some(&full), &claims));
        assert_eq!(
            o.reason,
            Some(HoldReason::WaitingForDraClaims),
            "{}",
            o.message
        );
        assert_eq!(layout(&o), Some("all-3g.40gb"));
        assert_eq!(switches(&o), (Some("false"), Some("true")));
        // Released meanwhile (the policy deleted): the layout stays while the claims do.
        let o = outcome(&n, None, &env(Some(&full), &claims), Decision::Release);
        assert_eq!(layout(&o), Some("all-3g.40gb"));
        // Claims gone: the DRA kubelet plugin stops first (the driver reads MIG devices only
        // when it starts), the old layout held; the device plugin stays off.
        let o = step(&n, &other[0], &env(Some(&full), &[]));
        assert_eq!(layout(&o), Some("all-3g.40gb"));
        assert_eq!(
            switches(&o),
            (Some("false"), Some("false")),
            "{}",
            o.message
        );
        apply_switches(&mut n, &o);
        // Its slice gone: the new layout goes to the MIG manager, nothing switched on.
        let o = step(&n, &other[0], &idle);
        assert_eq!(layout(&o), Some("all-1g.10gb"));
        assert_eq!(
            switches(&o),
            (Some("false"), Some("false")),
            "{}",
            o.message
        );
        n.labels.insert(LABEL_MIG_CONFIG, "all-1g.10gb");
        // Applied by the MIG manager: the DRA kubelet plugin starts again, and a slice showing
        // whole GPUs on the MIG node does not confirm it.
        let o = step(&n, &other[0], &idle);
        assert_eq!(switches(&o), (Some("false"), Some("true")), "{}", o.message);
        apply_switches(&mut n, &o);
        let whole = crate::plan::input::DraSlice {
            gpus: 8,
            mig: [("1g.10gb".to_string(), 56)].into(),
            ..Default::default()
        };
        let o = step(&n, &other[0], &env(Some(&whole), &[]));
        assert!(
            o.message.contains("8 whole GPUs on this MIG node"),
            "{}",
            o.message
        );
    }

    /// Another layout for a moved MIG node, when its DRA switch is not simply ours: paused by
    /// the GPU Operator it waits; someone else's it is left alone, the layout held; a slice
    /// showing other profiles does not confirm; a MIG manager that fails while the plugin is
    /// stopped gets the node its device plugin back; a released node keeps its layout while the
    /// driver may still serve it.
    #[test]
    fn a_moved_mig_node_reshapes_only_with_a_switch_it_may_write() {
        let hash = |_: &str| None;
        let base = crate::nvidia::default_mig_configs();
        let env = |slice, claims| mig_env(&base, &hash, slice, claims);
        let seven = [policy(
            "m",
            &MIG_EXTENDED.replace("all-3g.40gb", "all-7g.80gb"),
        )];
        let seven = prepare_all(&seven, Some(&base));
        let moved = |dra: &str| {
            let mut n = node(&[
                (LABEL_MIG_CONFIG, "all-3g.40gb"),
                (LABEL_MIG_STATE, "success"),
                (LABEL_DEPLOY_DEVICE_PLUGIN, "false"),
                (LABEL_DEPLOY_DRA_DRIVER, dra),
                (LABEL_DEVICE_PLUGIN_CONFIG, DEFAULT_KEY),
            ]);
            n.allocatable = [("nvidia.com/mig-3g.40gb", "0")].into_iter().collect();
            n
        };
        let held = |o: &Outcome| layout(o) == Some("all-3g.40gb");
        let o = step(
            &moved("paused-for-driver-upgrade"),
            &seven[0],
            &env(None, &[]),
        );
        assert_eq!(
            o.reason,
            Some(HoldReason::WaitingForPausedOperands),
            "{}",
            o.message
        );
        let mut theirs = moved("true");
        theirs.owned.remove(LABEL_DEPLOY_DRA_DRIVER);
        theirs.owned.remove(LABEL_DEPLOY_DEVICE_PLUGIN);
        let o = step(&theirs, &seven[0], &env(None, &[]));
        assert!(
            held(&o) && o.message.contains("is not this operator's"),
            "{}",
            o.message
        );
        assert_eq!(o.labels.get(LABEL_DEPLOY_DRA_DRIVER), None);
        // Released while the slice lingers: the layout stays until the driver is gone.
        let three = crate::plan::input::DraSlice {
            mig: [("3g.40gb".to_string(), 16)].into(),
            ..Default::default()
        };
        let o = outcome(
            &moved("false"),
            None,
            &env(Some(&three), &[]),
            Decision::Release,
        );
        assert!(held(&o), "{:?}", o.labels);
        // The plugin started on the new layout, but its slice shows the old profile too.
        let mut n = moved("true");
        n.labels.insert(LABEL_MIG_CONFIG, "all-7g.80gb");
        let mixed = crate::plan::input::DraSlice {
            mig: [("3g.40gb".to_string(), 2), ("7g.80gb".to_string(), 8)].into(),
            ..Default::default()
        };
        let o = step(&n, &seven[0], &env(Some(&mixed), &[]));
        assert!(
            o.message.contains("does not make: 2 3g.40gb"),
            "{}",
            o.message
        );
        // The MIG manager failed with the plugin stopped: the device plugin comes back.
        let mut failed = moved("false");
        failed.labels.insert(LABEL_MIG_CONFIG, "all-7g.80gb");
        failed.labels.insert(LABEL_MIG_STATE, "failed");
        let o = step(&failed, &seven[0], &env(None, &[]));
        assert_eq!(o.state, Some(NodeState::Failed), "{}", o.message);
        assert_eq!(switches(&o).0, None, "{}", o.message);
        assert!(
            o.message.contains("device plugin comes back"),
            "{}",
            o.message
        );
        // Pending past the timeout is not a failure said: it may still be reshaping.
        failed.labels.insert(LABEL_MIG_STATE, "pending");
        let stuck = Env {
            mig_stuck: true,
            ..env(None, &[])
        };
        let o = step(&failed, &seven[0], &stuck);
        assert_eq!(o.state, Some(NodeState::Failed), "{}", o.message);
        assert_eq!(switches(&o).0, Some("false"), "{}", o.message);
    }

    /// A MIG node with a device-plugin pod does not move, whatever `proceedWithBusyGpus` says,
    /// and a custom layout leaving GPUs out is refused on the node.
    #[test]
    fn a_mig_node_moves_never_under_device_plugin_pods_nor_with_gpus_left_out() {
        let hash = |_: &str| None;
        let base = crate::nvidia::default_mig_configs();
        let env = |slice, claims| mig_env(&base, &hash, slice, claims);
        let idle = env(None, &[]);
        // A device-plugin pod holds a node back whatever proceedWithBusyGpus says.
        let busy_ok = [policy(
            "m",
            &MIG_EXTENDED.replace("all-3g.40gb}", "all-3g.40gb, proceedWithBusyGpus: true}"),
        )];
        let busy_ok = prepare_all(&busy_ok, Some(&base));
        let mut fresh = node(&[
            (LABEL_MIG_CONFIG, "all-3g.40gb"),
            (LABEL_MIG_STATE, "success"),
        ]);
        fresh.allocatable = [("nvidia.com/mig-3g.40gb", "16")].into_iter().collect();
        let pods = vec!["team/cuda".to_string()];
        let busy = Env {
            gpu_pods: &pods,
            ..env(None, &[])
        };
        let o = step(&fresh, &busy_ok[0], &busy);
        assert_eq!(switches(&o), (None, None), "{}", o.message);
        // A custom layout leaving GPUs out is refused on the node, which stays as it is.
        let part = [policy(
            "m",
            &MIG_EXTENDED.replace(
                "layout: all-3g.40gb}",
                "customLayout: [{devices: [0, 1, 2, 3], migEnabled: true, migDevices: {3g.40gb: 2}}]}",
            ),
        )];
        let part = prepare_all(&part, Some(&base));
        assert!(part[0].errors.is_empty(), "{:?}", part[0].errors);
        let o = step(&fresh, &part[0], &idle);
        assert_eq!(o.state, Some(NodeState::Rejected), "{}", o.message);
        assert!(
            o.message.contains("GPUs 4,5,6,7 are in no device group"),
            "{}",
            o.message
        );
        assert_eq!(switches(&o), (None, None));
    }

    /// Back from DRA extended resources to the device plugin: the DRA kubelet plugin stays while
    /// claims remain, then goes off, and the device plugin returns only once the slice is gone.
    #[test]
    fn a_node_leaves_dra_extended_resources_only_when_its_claims_and_slice_are_gone() {
        let hash = |_: &str| None;
        let policies = [policy(
            "t",
            "  strategy: timeSlicing\n  timeSlicing: {replicas: 4}\n",
        )];
        let ts = prepare_all(&policies, None);
        let claims = vec!["team/cuda-extended-resources-x7k2q".to_string()];
        let four = sliced(Some(4));
        let idle = Env::idle(100, &hash);
        let served = Env {
            dra_slice: Some(&four),
            ..Env::idle(100, &hash)
        };
        let mut n = node(&[
            ("nvidia.com/mig.capable", "false"),
            (LABEL_DEPLOY_DEVICE_PLUGIN, "false"),
            (LABEL_DEPLOY_DRA_DRIVER, "true"),
        ]);
        n.allocatable = [("nvidia.com/gpu", "0")].into_iter().collect();
        // Held while a generated claim is allocated on the node, governed or released.
        let claimed = Env {
            dra_claims: &claims,
            dra_slice: Some(&four),
            ..Env::idle(100, &hash)
        };
        let o = step(&n, &ts[0], &claimed);
        assert_eq!(o.state, Some(NodeState::Waiting));
        assert_eq!(switches(&o), (Some("false"), Some("true")));
        let o = outcome(&n, None, &claimed, Decision::Release);
        assert_eq!(switches(&o), (Some("false"), Some("true")));
        // Claims gone: the DRA kubelet plugin goes off, the device plugin stays off.
        let o = step(&n, &ts[0], &served);
        assert_eq!(switches(&o), (Some("false"), Some("false")));
        assert_eq!(o.state, Some(NodeState::Pending));
        apply_switches(&mut n, &o);
        // Its slice lingers: still off.
        let o = step(&n, &ts[0], &served);
        assert_eq!(switches(&o).0, Some("false"), "{}", o.message);
        let o = outcome(&n, None, &served, Decision::Release);
        assert_eq!(switches(&o), (Some("false"), Some("false")));
        // Slice gone: the device plugin comes back and the DRA switch is given up.
        let o = step(&n, &ts[0], &idle);
        assert_eq!(switches(&o), (None, None), "{}", o.message);
        assert_eq!(o.labels.get(LABEL_DEVICE_PLUGIN_CONFIG), ts[0].key.as_ref());
    }

    /// Switches are never written over the GPU Operator's `paused-for-*` values, nodes do not
    /// start to move before our class maps the name, and a device plugin we switched off stays
    /// off while a DRA switch that is not ours is on.
    #[test]
    fn switches_wait_for_paused_operands_our_class_and_foreign_dra_switches() {
        let hash = |_: &str| None;
        let policies = [policy("x", EXTENDED)];
        let mut ext = prepare_all(&policies, None);
        let idle = Env::idle(100, &hash);
        let mut n = node(&[("nvidia.com/mig.capable", "false")]);
        n.allocatable = [("nvidia.com/gpu", "32")].into_iter().collect();
        // The class is not seen mapping the name: the device plugin stays on.
        ext[0].waiting = Some("waiting for DeviceClass".into());
        let o = step(&n, &ext[0], &idle);
        assert_eq!(
            o.reason,
            Some(HoldReason::WaitingForDeviceClass),
            "{}",
            o.message
        );
        assert_eq!(switches(&o), (None, None));
        ext[0].waiting = None;
        // The MIG manager paused the device plugin: nothing is written over it.
        n.labels
            .insert(LABEL_DEPLOY_DEVICE_PLUGIN, "paused-for-mig-change");
        let o = step(&n, &ext[0], &idle);
        assert_eq!(o.reason, Some(HoldReason::WaitingForPausedOperands));
        assert!(o.message.contains("paused-for-mig-change"), "{}", o.message);
        assert_eq!(switches(&o), (None, None));
        n.labels.remove(LABEL_DEPLOY_DEVICE_PLUGIN);
        // Moved: device plugin off, DRA kubelet plugin on (ours).
        let o = step(&n, &ext[0], &idle);
        apply_switches(&mut n, &o);
        n.allocatable = [("nvidia.com/gpu", "0")].into_iter().collect();
        let o = step(&n, &ext[0], &idle);
        apply_switches(&mut n, &o);
        assert_eq!(switches(&o), (Some("false"), Some("true")));
        // A driver upgrade pauses the DRA kubelet plugin (its update takes the label over).
        n.labels
            .insert(LABEL_DEPLOY_DRA_DRIVER, "paused-for-driver-upgrade");
        n.owned.remove(LABEL_DEPLOY_DRA_DRIVER);
        let o = step(&n, &ext[0], &idle);
        assert_eq!(o.reason, Some(HoldReason::WaitingForPausedOperands));
        // Resumed: the GPU Operator's update put true back and holds the label; the next pass
        // applies true again, so the switch is ours once more (shared, no value changes).
        n.labels.insert(LABEL_DEPLOY_DRA_DRIVER, "true");
        let o = step(&n, &ext[0], &idle);
        assert_eq!(switches(&o), (Some("false"), Some("true")), "{}", o.message);
        n.labels
            .insert(LABEL_DEPLOY_DRA_DRIVER, "paused-for-driver-upgrade");
        // Released meanwhile: the pause is not written over, and the device plugin stays off.
        let o = outcome(&n, None, &idle, Decision::Release);
        assert_eq!(switches(&o), (Some("false"), None), "{}", o.message);
        // Someone else's DRA switch says true: the device plugin stays off under a
        // device-plugin policy too, saying whose switch holds it.
        n.labels.insert(LABEL_DEPLOY_DRA_DRIVER, "true");
        let tp = [policy(
            "t",
            "  strategy: timeSlicing\n  timeSlicing: {replicas: 4}\n",
        )];
        let ts = prepare_all(&tp, None);
        let o = step(&n, &ts[0], &idle);
        assert_eq!(switches(&o), (Some("false"), None), "{}", o.message);
        assert!(
            o.message.contains("is not this operator's"),
            "{}",
            o.message
        );
        // It says false: the device plugin comes back.
        n.labels.insert(LABEL_DEPLOY_DRA_DRIVER, "false");
        let o = step(&n, &ts[0], &idle);
        assert_eq!(switches(&o), (None, None), "{}", o.message);
    }

    /// A policy refused between the two steps of a move (device plugin off, DRA kubelet plugin
    /// not yet on) does not leave its node without a backend: the device plugin comes back.
    #[test]
    fn a_node_refused_mid_move_gets_its_device_plugin_back() {
        let hash = |_: &str| None;
        let policies = [policy("x", EXTENDED)];
        let mut ext = prepare_all(&policies, None);
        let idle = Env::idle(100, &hash);
        let mut n = node(&[("nvidia.com/mig.capable", "false")]);
        n.allocatable = [("nvidia.com/gpu", "32")].into_iter().collect();
        let o = step(&n, &ext[0], &idle);
        apply_switches(&mut n, &o);
        assert_eq!(switches(&o), (Some("false"), None));
        ext[0].blocked = Some("DeviceClass gpu.nvidia.com maps nvidia.com/gpu".into());
        let o = step(&n, &ext[0], &idle);
        assert_eq!(o.state, Some(NodeState::Rejected));
        assert_eq!(switches(&o), (None, None), "{}", o.message);
        // Once the DRA driver serves it, a refusal holds it as it is.
        let four = sliced(Some(4));
        let served = Env {
            dra_slice: Some(&four),
            ..Env::idle(100, &hash)
        };
        let o = step(&n, &ext[0], &served);
        assert_eq!(switches(&o), (Some("false"), None), "{}", o.message);
    }

    /// A node Karpenter launched keeps its device plugin until Karpenter initialized it: it
    /// waits for the resources its pods asked for, which the DRA driver never registers.
    #[test]
    fn a_node_karpenter_launched_moves_once_karpenter_initialized_it() {
        let hash = |_: &str| None;
        let policies = [policy("x", EXTENDED)];
        let ext = prepare_all(&policies, None);
        let idle = Env::idle(100, &hash);
        let mut n = node(&[("nvidia.com/mig.capable", "false"), (LABEL_NODEPOOL, "gpu")]);
        n.allocatable = [("nvidia.com/gpu", "8")].into_iter().collect();
        let o = step(&n, &ext[0], &idle);
        assert_eq!(o.reason, Some(HoldReason::WaitingForNodeInitialization));
        assert!(o.message.contains("NodePool gpu"), "{}", o.message);
        assert_eq!(switches(&o), (None, None));
        n.labels.insert(LABEL_KARPENTER_INITIALIZED, "true");
        let o = step(&n, &ext[0], &idle);
        assert_eq!(switches(&o).0, Some("false"), "{}", o.message);
    }
}

/// The VM transition (`vm.rs`) as the planner runs it: through this file's [`decide`] and
/// [`outcome`], which dispatch to it. Here rather than in `vm.rs`, so that `vm` never imports
/// `node`.
#[cfg(test)]
mod vm_tests {
    use super::*;
    use crate::plan::decision::Sandbox;
    use crate::plan::policies::{check_vgpu_types, prepare_all};
    use crate::plan::testing::{a100_node as node, policy};

    const VGPU: &str = "  strategy: vgpu\n  vgpu: {type: A100D-1-10C}\n";
    const PASS: &str = "  strategy: passthrough\n";
    const TS: &str = "  strategy: timeSlicing\n  timeSlicing: {replicas: 4}\n";

    struct Case<'a> {
        env: Env<'a>,
    }

    fn step(n: &NodeFacts, p: Option<&Prepared>, c: &Case) -> Outcome {
        let d = crate::plan::node::decide(n, p, &c.env);
        outcome(n, p, &c.env, d)
    }

    /// Applies an outcome's labels the way the API server does for our field manager.
    fn apply(n: &mut NodeFacts, o: &Outcome) {
        crate::plan::facts::apply_to_node(n, &o.labels, &o.annotations);
    }

    fn is_vm_and_container_at_once(n: &NodeFacts) -> bool {
        let sharing = n
            .labels
            .get(LABEL_DEVICE_PLUGIN_CONFIG)
            .is_some_and(|k| k != DEFAULT_KEY);
        let mig_on = n
            .labels
            .get(LABEL_MIG_CONFIG)
            .is_some_and(|l| l != MIG_DISABLED_LAYOUT)
            || n.labels.get(LABEL_MIG_CONFIG) == Some(MIG_DISABLED_LAYOUT)
                && n.labels.get(LABEL_MIG_STATE) == Some("pending");
        is_vm_host(n) && (sharing || mig_on)
    }

    #[test]
    fn container_to_vgpu_and_back_never_mixes_the_two() {
        let hash = |_: &str| None;
        let sandbox = Sandbox {
            mode: None,
            vgpu_manager_enabled: true,
        };
        let policies = vec![policy("v", VGPU), policy("t", TS)];
        let mut prepared = prepare_all(&policies, None);
        check_vgpu_types(&mut prepared, &crate::nvidia::vgpu::default_vgpu_configs());
        let (v, t) = (
            prepared.iter().find(|p| p.name == "v").unwrap(),
            prepared.iter().find(|p| p.name == "t").unwrap(),
        );
        assert!(v.errors.is_empty(), "{:?}", v.errors);
        assert_eq!(v.vm().unwrap().vgpu_entries.len(), 1);
        let key = t.key.clone().unwrap();
        let case = |pods: &'static [String], vm: &'static [String]| Case {
            env: Env {
                gpu_pods: pods,
                vm_pods: vm,
                sandbox: &sandbox,
                ..Env::idle(100, &hash)
            },
        };
        let busy: &'static [String] = Box::leak(vec!["team/cuda".to_string()].into_boxed_slice());
        let vms: &'static [String] =
            Box::leak(vec!["vms/virt-launcher-a".to_string()].into_boxed_slice());
        let idle = case(&[], &[]);

        // A time-sliced MIG node (MIG on): the VM policy waits for idle GPUs, then takes sharing
        // and MIG off, and only after the MIG manager confirmed writes the workload label.
        let mut n = node(&[
            (LABEL_DEVICE_PLUGIN_CONFIG, &key),
            (LABEL_MIG_CONFIG, "all-1g.10gb"),
            (LABEL_MIG_STATE, "success"),
        ]);
        assert_eq!(
            step(&n, Some(v), &case(busy, &[])).state,
            Some(NodeState::Waiting)
        );
        let mut history = vec![n.labels.clone()];
        for round in 0..6 {
            let o = step(&n, Some(v), &idle);
            apply(&mut n, &o);
            history.push(n.labels.clone());
            assert!(
                !is_vm_and_container_at_once(&n),
                "round {round}: {:?}",
                n.labels
            );
            // The MIG manager and the vGPU Device Manager confirm what is pending.
            for (cfg, state) in [
                (LABEL_MIG_CONFIG, LABEL_MIG_STATE),
                (LABEL_VGPU_CONFIG, LABEL_VGPU_STATE),
            ] {
                if n.labels.get(state) == Some("pending") && n.labels.contains_key(cfg) {
                    n.labels.insert(state, "success");
                    n.owned.remove(state);
                }
            }
            // The sandbox device plugin advertises the vGPUs; another NVIDIA resource (the
            // Network Operator's) does not keep the node from confirming.
            if is_vm_host(&n) {
                let alloc = [
                    ("nvidia.com/NVIDIA_A100D-1-10C", "56"),
                    ("nvidia.com/hostdev", "4"),
                ];
                n.allocatable = alloc.into_iter().collect();
            }
            history.push(n.labels.clone());
        }
        let o = step(&n, Some(v), &idle);
        assert_eq!(
            o.state,
            Some(NodeState::Applied),
            "{}: {:?}",
            o.message,
            n.labels
        );
        assert_eq!(n.labels.get(LABEL_WORKLOAD), Some("vm-vgpu"));
        assert_eq!(n.labels.get(LABEL_VGPU_CONFIG), Some("A100D-1-10C"));
        assert_eq!(n.labels.get(LABEL_MIG_CONFIG), Some(MIG_DISABLED_LAYOUT));
        assert_eq!(n.labels.get(LABEL_DEVICE_PLUGIN_CONFIG), Some(DEFAULT_KEY));
        // The workload label came only after MIG was confirmed off.
        let first_vm = history
            .iter()
            .position(|l| l.get(LABEL_WORKLOAD).is_some())
            .unwrap();
        assert_eq!(history[first_vm - 1].get(LABEL_MIG_STATE), Some("success"));

        back_to_containers(&mut n, t, &key, &case(&[], &[]), &case(&[], vms));
    }

    /// The VM host `n` goes back to the container policy `t` (whose key is `key`).
    fn back_to_containers(n: &mut NodeFacts, t: &Prepared, key: &str, idle: &Case, vms: &Case) {
        // Not while a VM runs; then `container` with sharing off first.
        let o = step(n, Some(t), vms);
        assert_eq!(o.state, Some(NodeState::Waiting));
        assert!(o.message.contains("virt-launcher"), "{}", o.message);
        let o = outcome(n, None, &vms.env, Decision::Release);
        assert_eq!(
            o.labels.get(LABEL_WORKLOAD).map(String::as_str),
            Some("vm-vgpu"),
            "kept while VMs run"
        );
        let o = step(n, Some(t), idle);
        assert_eq!(
            o.labels.get(LABEL_WORKLOAD).map(String::as_str),
            Some("container")
        );
        assert_eq!(
            o.labels.get(LABEL_DEVICE_PLUGIN_CONFIG).map(String::as_str),
            Some(DEFAULT_KEY)
        );
        assert_eq!(
            o.labels.get(LABEL_VGPU_CONFIG),
            None,
            "the vGPU config goes with it"
        );
        apply(n, &o);
        n.allocatable = Labels::default();
        let o = step(n, Some(t), idle);
        assert_eq!(
            o.labels.get(LABEL_DEVICE_PLUGIN_CONFIG),
            Some(&key.to_string()),
            "sharing follows"
        );
        assert_eq!(
            o.labels.get(LABEL_WORKLOAD).map(String::as_str),
            Some("container")
        );
    }

    use crate::plan::labels::Labels;

    #[test]
    fn what_cannot_work_is_rejected_with_the_field_named() {
        let hash = |_: &str| None;
        let policies = vec![
            policy("v", VGPU),
            policy("p", PASS),
            policy(
                "l4",
                "  strategy: vgpu\n  vgpu: {customLayout: [{vgpuDevices: {L4-12Q: 2}}]}\n",
            ),
            policy(
                "big",
                "  strategy: vgpu\n  vgpu: {customLayout: [{vgpuDevices: {A100D-40C: 3}}]}\n",
            ),
            policy("unknown", "  strategy: vgpu\n  vgpu: {type: A100D-99C}\n"),
        ];
        let mut prepared = prepare_all(&policies, None);
        check_vgpu_types(&mut prepared, &crate::nvidia::vgpu::default_vgpu_configs());
        let get = |name: &str| prepared.iter().find(|p| p.name == name).unwrap();
        let unknown = get("unknown");
        assert_eq!(unknown.errors[0].path, "spec.vgpu.type");
        let n = node(&[]);
        let reject = |p: &Prepared, s: &Sandbox| {
            let env = Env {
                sandbox: s,
                ..Env::idle(1, &hash)
            };
            match crate::plan::node::decide(&n, Some(p), &env) {
                Decision::Hold {
                    state: NodeState::Rejected,
                    message,
                    ..
                } => Some(message),
                _ => None,
            }
        };
        let ok = Sandbox {
            mode: None,
            vgpu_manager_enabled: true,
        };
        assert_eq!(reject(get("v"), &ok), None);
        assert_eq!(reject(get("p"), &ok), None);
        let kata = Sandbox {
            mode: Some("kata".into()),
            vgpu_manager_enabled: true,
        };
        assert!(
            reject(get("p"), &kata)
                .unwrap()
                .contains("spec.sandboxWorkloads.mode")
        );
        let no_manager = Sandbox::default();
        assert!(
            reject(get("v"), &no_manager)
                .unwrap()
                .contains("spec.vgpuManager.enabled")
        );
        assert_eq!(
            reject(get("p"), &no_manager),
            None,
            "passthrough needs no vGPU Manager"
        );
        assert!(reject(get("l4"), &ok).unwrap().contains("L4"));
        let m = reject(get("big"), &ok).unwrap();
        assert!(
            m.contains("120 GB of framebuffer per GPU, the GPU has 80 GB"),
            "{m}"
        );
    }

    /// The GPU Operator in DRA-only mode has no sandbox stack to configure either: a VM policy's
    /// nodes are left as they are, as the policy's status says (GpuClusterPresent).
    #[test]
    fn a_vm_policy_holds_under_a_dra_only_gpu_operator() {
        let hash = |_: &str| None;
        let sandbox = Sandbox {
            mode: None,
            vgpu_manager_enabled: true,
        };
        let policies = [policy("p", PASS)];
        let prepared = prepare_all(&policies, None);
        let env = Env {
            gpu_cluster: Some("cluster"),
            sandbox: &sandbox,
            ..Env::idle(100, &hash)
        };
        let o = step(&node(&[]), Some(&prepared[0]), &Case { env });
        assert_eq!(o.state, Some(NodeState::Rejected), "{}", o.message);
        assert!(o.message.contains("GPUCluster cluster"), "{}", o.message);
    }
}
