//! The MIG backend's part of the per-node transition: a node reaches its layout through the MIG
//! manager with sharing off, with idle GPUs (unless the policy opts out), and a named layout
//! whose content changed since the node was configured is re-applied only when the admin asks.

use crate::api::crd::{MigStrategy, Strategy};
use crate::api::names::*;
use crate::api::state::{HoldReason, NodeState};
use crate::nvidia::state::{ConfigState, GfdReport};
use crate::nvidia::{self, DEFAULT_KEY, MIG_DISABLED_LAYOUT};

use super::capacity::{replicas_of, ts_replicas};
use super::decision::{Decision, Env, busy_msg, hold, mig_of, wait, write};
use super::facts::NodeFacts;
use super::policies::Prepared;

/// The layout this node should run: the policy's, or the pre-upgrade `custom-<policy>` name the
/// node still carries while its content is the same (no reconfiguration for a new name).
fn target_layout(n: &NodeFacts, w: &Prepared, layout: &str, env: &Env) -> String {
    if let Some((_, hash)) = custom_of(w, layout) {
        let legacy = nvidia::legacy_custom_layout_name(&w.name);
        let same = (env.layout_hash)(&legacy).as_ref() == Some(hash);
        if n.labels.get(LABEL_MIG_CONFIG) == Some(legacy.as_str()) && same {
            return legacy;
        }
    }
    layout.to_string()
}

/// The policy's custom layout, when `layout` is it.
fn custom_of<'w>(
    w: &'w Prepared,
    layout: &str,
) -> Option<&'w (Vec<nvidia::MigConfigEntry>, String)> {
    w.mig()
        .filter(|m| m.layout == layout)
        .and_then(|m| m.custom.as_ref())
}

/// A named layout whose content changed since we labelled the node: `(then, now)` hashes.
fn stale_layout(n: &NodeFacts, w: &Prepared, env: &Env, layout: &str) -> Option<(String, String)> {
    if custom_of(w, layout).is_some() || !mig_of(n).confirmed(layout) {
        return None;
    }
    let (l, then) = n.annotations.get(ANNOTATION_MIG_LAYOUT)?.rsplit_once('@')?;
    let now = (env.layout_hash)(layout)?;
    (l == layout && now != then).then(|| (then.to_string(), now))
}

/// The transition of a node governed by a MIG policy towards its device-plugin config `key`
/// and MIG `layout`.
pub(super) fn decide(
    n: &NodeFacts,
    w: &Prepared,
    key: &str,
    layout: &str,
    env: &Env,
    busy: bool,
) -> Decision {
    let layout = target_layout(n, w, layout, env);
    let mig = mig_of(n);
    let dp = n.labels.get(LABEL_DEVICE_PLUGIN_CONFIG);
    let sharing_on = dp.is_some_and(|k| k != DEFAULT_KEY);
    if mig.layout == Some(layout.as_str()) && mig.failed(env.mig_stuck) {
        return hold(
            NodeState::Failed,
            format!(
                "MIG manager reported failed (or stayed pending past the timeout) for layout {layout}; node left untouched"
            ),
        );
    }
    if let Some((then, now)) = stale_layout(n, w, env, &layout) {
        return if !w.reapply_requested() {
            hold(
                NodeState::Stale,
                format!(
                    "layout {layout} changed content since this node was configured ({then} -> {now}); the MIG manager does not re-read an unchanged label: annotate the policy with {ANNOTATION_REAPPLY_MIG}=true to re-apply it through {MIG_DISABLED_LAYOUT}"
                ),
            )
        } else if busy {
            wait(HoldReason::WaitingForIdleGPUs, busy_msg(env.gpu_pods))
        } else if sharing_on {
            let msg = format!("removing the sharing config before re-applying layout {layout}");
            write(NodeState::Pending, msg, DEFAULT_KEY, Some(layout))
        } else {
            let msg = format!(
                "re-applying layout {layout} (its content changed) through {MIG_DISABLED_LAYOUT}"
            );
            write(
                NodeState::Pending,
                msg,
                DEFAULT_KEY,
                Some(MIG_DISABLED_LAYOUT.into()),
            )
        };
    }
    if w.reapply_requested()
        && mig.layout == Some(MIG_DISABLED_LAYOUT)
        && mig.state == Some(ConfigState::Pending)
    {
        // A re-apply goes through a confirmed all-disabled: the MIG manager skips a layout it
        // believes applied, so flipping straight back would change nothing.
        let msg = format!(
            "waiting for {MIG_DISABLED_LAYOUT} to be confirmed before re-applying layout {layout}"
        );
        return write(
            NodeState::Pending,
            msg,
            DEFAULT_KEY,
            Some(MIG_DISABLED_LAYOUT.into()),
        );
    }
    if mig.confirmed(&layout) {
        write(NodeState::Applied, "", key, Some(layout))
    } else if mig.layout != Some(layout.as_str()) && busy {
        // Idle GPUs are needed to change the layout: hold everything.
        wait(HoldReason::WaitingForIdleGPUs, busy_msg(env.gpu_pods))
    } else if dp.is_some_and(|k| k != DEFAULT_KEY && k != key) {
        // First take the sharing config off; the layout changes on a later step.
        let held = n
            .owned
            .contains(LABEL_MIG_CONFIG)
            .then(|| mig.layout.map(str::to_string))
            .flatten();
        let msg = "removing the sharing config before changing the MIG layout";
        write(NodeState::Pending, msg, DEFAULT_KEY, held)
    } else {
        // Sharing stays off while the layout changes.
        let msg = format!("waiting for MIG layout {layout}");
        write(NodeState::Pending, msg, DEFAULT_KEY, Some(layout))
    }
}

/// Why GPU Feature Discovery's report does not confirm a MIG policy's node yet: the
/// ClusterPolicy's MIG strategy (cluster-wide) the device plugin runs with, and, when MIG
/// instances are time-sliced, their replicas.
pub(super) fn unconfirmed(n: &NodeFacts, w: &Prepared, gfd: &GfdReport) -> Option<String> {
    let mig = w.spec.mig.as_ref();
    let is_mig = w.spec.strategy == Strategy::Mig;
    // The device plugin takes its MIG strategy from the ClusterPolicy (cluster-wide), which
    // may still be switching back: until GFD reports the policy's, the node serves the other.
    if let (true, Some(want)) = (is_mig, mig.map(|m| m.mig_strategy.as_str()))
        && let Some(got) = n.labels.get(LABEL_GFD_MIG_STRATEGY)
        && got != want
    {
        return Some(format!(
            "waiting for GPU Feature Discovery to report {LABEL_GFD_MIG_STRATEGY}={want} (it reports {got}; the ClusterPolicy's mig.strategy applies cluster-wide)"
        ));
    }
    let expected = replicas_of(w.spec) as i64;
    let ts = mig.and_then(|m| m.time_slicing.as_ref());
    let mixed = mig.is_some_and(|m| m.mig_strategy == MigStrategy::Mixed);
    if is_mig && ts.is_some() && mixed {
        // Under `mixed` GFD reports each MIG profile's replicas on its own resource
        // (`nvidia.com/mig-<profile>.replicas`); the MIG-enabled GPUs themselves are labelled
        // without sharing (`nvidia.com/gpu.replicas=0`). A profile the config does not share
        // (resources that name others) has 1.
        let wanted = |k: &str| match ts {
            Some(ts) => ts_replicas(ts, k.trim_end_matches(".replicas")),
            None => expected,
        };
        let wrong: Vec<String> = gfd
            .mig_replicas
            .iter()
            .filter(|(k, v)| v.parse::<i64>().ok() != Some(wanted(k)))
            .map(|(k, v)| format!("{k}={v}, expected {}", wanted(k)))
            .collect();
        return (!wrong.is_empty())
            .then(|| format!("GPU Feature Discovery reports {}", wrong.join(", ")));
    }
    // Without time-slicing GFD reports 0 or 1 for MIG: nothing to compare.
    if is_mig && ts.is_none() {
        return None;
    }
    super::sharing::replicas_unconfirmed(w.spec.strategy, gfd, expected)
}
