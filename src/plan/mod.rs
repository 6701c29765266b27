//! The pure planner: policies + node facts -> the desired state of everything the operator owns.
//!
//! No I/O and no clock: the same input gives the same plan, and planning the state a plan
//! produces gives the same plan again (idempotence). The controller reads its caches into a
//! [`PlanInput`], calls [`plan`], and applies the difference.
//!
//! The files of `plan/` depend one way (`tests/architecture.rs` checks it), each on files
//! listed before it only: the leaves [`labels`], [`taint`], [`input`] (what the planner reads:
//! per-node views, cluster facts, settings, memory), [`facts`] (node readings), [`decision`]
//! (the transition's vocabulary) and [`backend`] (a policy's backend, a node's target); then
//! [`policies`] (validation, precedence, the per-node target), [`capacity`], [`outputs`],
//! [`compat`]; one file per backend's transition: [`sharing`], [`mig`], [`vm`], [`dra`];
//! [`node`] (the per-node transition, dispatching to them), [`drain`], [`rollout`],
//! [`status`]; and [`converge`], a consumer of [`plan`], on top.
//! What this file declares ([`NodeFacts`], [`Plan`], ...) all of them share.

use std::collections::{BTreeMap, BTreeSet};

use serde_json::json;

use crate::api::crd::{Capacity, GpuSharingPolicyStatus, NodeDetail};
use crate::api::names::*;
use crate::api::state::NodeState;
use crate::nvidia::state::Workload;
use crate::nvidia::{self, MIG_DISABLED_LAYOUT};
use crate::validate::FieldError;

pub mod backend;
pub mod capacity;
pub mod compat;
pub mod converge;
pub mod decision;
pub mod dra;
pub mod drain;
pub mod facts;
pub mod input;
pub mod labels;
pub mod mig;
pub mod node;
pub mod outputs;
pub mod policies;
pub mod rollout;
pub mod sharing;
pub mod status;
pub mod taint;
#[cfg(test)]
pub(crate) mod testing;
pub mod vm;

pub use input::{ClusterFacts, Memory, NodeView, PlanInput, Settings};
pub use labels::{
    LabelFilter, LabelLookup, Labels, OwnedKeys, SelectionLabels, SmallMap, selection_labels,
    selector_keys, selector_matches,
};
pub use status::MAX_NODE_DETAILS;

use decision::{Decision, Env};
use policies::Prepared;
use status::{Cluster, Placement, Tally};

/// What the planner knows of a node.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct NodeFacts {
    pub name: String,
    pub labels: Labels,
    /// Managed labels whose value this operator's field manager owns (from managedFields).
    pub owned: OwnedKeys,
    /// The node's annotations under our keys ([`MANAGED_ANNOTATIONS`]) only.
    pub annotations: Labels,
    /// Which of [`MANAGED_ANNOTATIONS`] this operator's field manager owns.
    pub owned_annotations: OwnedKeys,
    /// `status.allocatable` of NVIDIA's extended resources (`nvidia.com/*`) only: what the
    /// device plugin (or the sandbox device plugin) advertises now. Capacity lingers after a
    /// plugin stops; allocatable drops to 0.
    pub allocatable: Labels,
}

impl NodeFacts {
    /// Allocatable units of an extended resource (0 when absent or unparsable).
    pub fn allocatable(&self, resource: &str) -> i64 {
        self.allocatable
            .get(resource)
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    }

    /// NVIDIA device-plugin resources (`nvidia.com/gpu*`, `nvidia.com/mig-*`) still
    /// allocatable on the node, with their counts.
    pub fn device_plugin_resources(&self) -> Vec<(&str, i64)> {
        self.allocatable
            .iter()
            .filter(|(k, _)| is_device_plugin_resource(k))
            .filter_map(|(k, v)| Some((k, v.parse::<i64>().ok().filter(|c| *c > 0)?)))
            .collect()
    }
}

/// A resource NVIDIA's (container) device plugin advertises.
pub fn is_device_plugin_resource(name: &str) -> bool {
    name.starts_with("nvidia.com/gpu") || name.starts_with("nvidia.com/mig-")
}

/// The desired state.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Plan {
    /// Data of the device-plugin ConfigMap.
    pub device_config: BTreeMap<String, String>,
    /// `config.yaml` of the mig-parted ConfigMap, when one is needed.
    pub mig_config: Option<String>,
    /// `config.yaml` of the vGPU-devices ConfigMap, when one is needed (custom vGPU layouts).
    pub vgpu_config: Option<String>,
    /// The part of the ClusterPolicy `spec` we own (a merge patch / apply configuration).
    pub cluster_policy_spec: serde_json::Value,
    /// For every node: the managed labels we want to own, with their values. Nodes that need
    /// none of our labels map to an empty set.
    pub node_labels: BTreeMap<String, SmallMap>,
    /// For every node in `node_labels`: the annotations we want to own ([`MANAGED_ANNOTATIONS`]).
    pub node_annotations: BTreeMap<String, SmallMap>,
    /// Status of every policy, by name.
    pub statuses: BTreeMap<String, GpuSharingPolicyStatus>,
    /// ResourceClaimTemplates of DRA policies, by `namespace/name`.
    pub claim_templates: BTreeMap<String, serde_json::Value>,
    /// The errors of every invalid policy, by name, as typed field errors.
    pub invalid: BTreeMap<String, Vec<FieldError>>,
    /// Nodes whose readiness taint is to be removed now.
    pub untaint: Vec<String>,
    /// Nodes being drained (cordoned through their annotations), with the pods to evict.
    pub drains: BTreeMap<String, drain::Drain>,
}

/// One of the ConfigMaps we own, as the object we apply.
pub fn configmap(
    name: &str,
    namespace: &str,
    kind: &str,
    data: &BTreeMap<String, String>,
) -> serde_json::Value {
    json!({
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": {MANAGED_BY.0: MANAGED_BY.1, CONFIG_LABEL: kind},
        },
        "data": data,
    })
}

/// What planning the nodes produced.
#[derive(Default)]
struct NodePlans<'n> {
    labels: BTreeMap<String, SmallMap>,
    annotations: BTreeMap<String, SmallMap>,
    /// Per policy (index in precedence order).
    tallies: BTreeMap<usize, Tally>,
    /// Per policy: the nodes it governs and does not reject.
    accepted: BTreeMap<usize, Vec<&'n NodeFacts>>,
    /// Device-plugin config keys that node labels we keep or write name.
    used_keys: BTreeSet<String>,
    /// Tainted nodes ready to lose the readiness taint.
    untaint: Vec<String>,
    drains: BTreeMap<String, drain::Drain>,
}

/// What each layout name means now, as a content hash: custom layouts from the policies, named
/// ones from the GPU Operator's config, and what is left in our ConfigMap.
fn layout_hashes<'a>(
    prepared: &'a [Prepared],
    input: &'a PlanInput,
) -> impl Fn(&str) -> Option<String> + 'a {
    let custom: BTreeMap<&str, &str> = prepared
        .iter()
        .filter_map(|p| {
            let m = p.mig()?;
            Some((m.layout.as_str(), m.custom.as_ref()?.1.as_str()))
        })
        .collect();
    move |name: &str| {
        if name == MIG_DISABLED_LAYOUT {
            return None;
        }
        if let Some(h) = custom.get(name) {
            return Some(h.to_string());
        }
        let c = &input.cluster;
        c.base_mig_configs
            .as_ref()
            .and_then(|b| b.get(name))
            .or_else(|| c.current_mig_configs.get(name))
            .map(nvidia::content_hash)
    }
}

/// Runs the per-node transition on every node, gates the changes through each policy's rollout
/// budget, and gathers what it found per policy.
fn plan_nodes<'n>(
    input: &PlanInput,
    prepared: &[Prepared],
    nodes: &[&'n NodeView],
    winner: &BTreeMap<&str, usize>,
) -> NodePlans<'n> {
    let hashes = layout_hashes(prepared, input);
    let mut entries: Vec<node::Entry<'n>> = Vec::with_capacity(nodes.len());
    for &v in nodes {
        let n: &'n NodeFacts = &v.facts;
        let wi = winner.get(n.name.as_str()).copied();
        let policy = wi.map(|i| &prepared[i]);
        let env = Env::of(v, &input.cluster, &hashes);
        let decision = node::decide(n, policy, &env);
        let hold = matches!(decision, Decision::Hold { .. });
        entries.push(node::Entry {
            node: v,
            policy: wi,
            target: policy
                .and_then(|w| policies::node_target(w, n))
                .map(|t| t.mark()),
            hold,
            outcome: node::outcome(n, policy, &env, decision),
        });
    }
    let (progress, drains) = rollout::gate(&mut entries, prepared, input, node::queued);
    let mut out = NodePlans {
        drains,
        ..Default::default()
    };
    for (i, p) in progress {
        out.tallies.entry(i).or_default().rollout = Some(p);
    }
    for node::Entry {
        node: v,
        policy: wi,
        target: _,
        hold,
        outcome: o,
    } in entries
    {
        let n: &'n NodeFacts = &v.facts;
        if let Some(t) = input.cluster.readiness_taint.as_ref()
            && t.tolerated_on(&n.name)
            && taint::ready_to_untaint(n, wi.is_some(), o.state)
        {
            out.untaint.push(n.name.clone());
        }
        if hold {
            out.used_keys.extend(o.labels.values().cloned());
        } else if let Some(k) = o.labels.get(LABEL_DEVICE_PLUGIN_CONFIG) {
            out.used_keys.insert(k.clone());
        }
        if let (Some(i), Some(state)) = (wi, o.state) {
            let p = &prepared[i];
            let t = out.tallies.entry(i).or_default();
            if state == NodeState::Applied {
                t.applied += 1;
                let c = if p.spec.strategy.is_vm() {
                    capacity::vm_capacity(p, n)
                } else {
                    capacity::node_capacity(p.spec, n, input.cluster.base_mig_configs.as_ref())
                };
                let total = t.capacity.get_or_insert_with(|| Capacity {
                    memory_isolation: true,
                    ..Default::default()
                });
                t.capacity_unknown |= !capacity::add_capacity(total, &c);
            }
            if state != NodeState::Rejected {
                out.accepted.entry(i).or_default().push(n);
            }
            t.details.push(NodeDetail {
                name: n.name.clone(),
                state,
                message: o.message,
                reason: o.reason,
            });
        }
        out.labels.insert(n.name.clone(), o.labels);
        out.annotations.insert(n.name.clone(), o.annotations);
    }
    out
}

/// The first node (by name) whose device-plugin config label names an MPS config of our
/// ConfigMap as it is now: a node whose device plugin runs MPS.
fn mps_running<'a>(input: &PlanInput, nodes: &[&'a NodeFacts]) -> Option<&'a str> {
    let mps_keys: BTreeSet<&str> = input
        .cluster
        .current_device_config
        .iter()
        .filter(|(_, text)| {
            text.contains("mps:")
                && crate::api::yaml::from_str::<serde_json::Value>(text)
                    .is_ok_and(|v| v["sharing"]["mps"].is_object())
        })
        .map(|(k, _)| k.as_str())
        .collect();
    if mps_keys.is_empty() {
        return None;
    }
    nodes
        .iter()
        .find(|n| {
            n.labels
                .get(LABEL_DEVICE_PLUGIN_CONFIG)
                .is_some_and(|k| mps_keys.contains(k))
        })
        .map(|n| n.name.as_str())
}

/// Computes the desired state.
pub fn plan(input: &PlanInput) -> Plan {
    let c = &input.cluster;
    let mut prepared = policies::prepare_all(&input.policies, c.base_mig_configs.as_ref());
    policies::check_vgpu_types(&mut prepared, &c.base_vgpu_configs);
    // Nodes in name order, whatever order the caches gave them in.
    let mut views: Vec<&NodeView> = input.nodes.iter().collect();
    views.sort_by(|a, b| a.name.cmp(&b.name));
    let nodes: Vec<&NodeFacts> = views.iter().map(|v| &*v.facts).collect();
    let assignment = policies::assign(&prepared, &nodes);
    let mut cluster_mig = policies::cluster_mig_strategy(&mut prepared, &assignment.winner);
    // `mixed` waits until no node runs MPS any more: NVIDIA's device plugin refuses MPS under
    // mixed, so the MPS nodes go back to exclusive first (their policy is blocked and they are
    // released, see `policies::cluster_mig_strategy`), then the cluster-wide setting changes.
    if cluster_mig == Some(crate::api::crd::MigStrategy::Mixed)
        && mps_running(input, &nodes).is_some()
    {
        cluster_mig = None;
    }
    let mut np = plan_nodes(input, &prepared, &views, &assignment.winner);

    let device_config = outputs::device_config(&prepared, input, &np.used_keys);
    let mig_config = outputs::mig_config(&prepared, input, &nodes, &np.labels);
    let vgpu_config = outputs::vgpu_config(&prepared, input, &nodes, &np.labels);
    let cluster_policy_spec = outputs::cluster_policy_spec(
        input,
        outputs::Owned {
            any_policy: !prepared.is_empty(),
            mig_config: mig_config.is_some(),
            cluster_mig,
            vm_nodes: np.labels.values().any(|l| {
                Workload::parse(l.get(LABEL_WORKLOAD).map(String::as_str))
                    .is_some_and(Workload::is_vm)
            }),
            vgpu_config: vgpu_config.is_some(),
        },
    );
    let cluster = Cluster {
        cluster_policy_found: c.cluster_policy_found,
        cluster_policy_contested: input.memory.cluster_policy_contested.as_deref(),
        untolerated_taint: c
            .readiness_taint
            .as_ref()
            .filter(|t| t.untolerated())
            .map(|t| t.key.as_str()),
        gpu_cluster: c.gpu_cluster.as_deref(),
        gpu_operator_namespace_missing: input.memory.gpu_operator_namespace_missing.as_deref(),
    };
    let mut claim_templates = BTreeMap::new();
    let mut statuses = BTreeMap::new();
    let mut invalid = BTreeMap::new();
    for (i, p) in prepared.iter().enumerate() {
        let accepted = np.accepted.remove(&i).unwrap_or_default();
        let (templates, missing_namespaces) =
            outputs::claim_templates(p, &accepted, c.namespaces.as_ref());
        let matched: &[&str] = assignment.matched.get(&p.name).map_or(&[], Vec::as_slice);
        // A node another policy wins is overridden when that policy has the higher priority
        // (intended), and a conflict when only age or name decided.
        let (mut conflicting, mut overridden) = (Vec::new(), Vec::new());
        for n in matched.iter().filter(|n| assignment.winner[*n] != i) {
            let w = &prepared[assignment.winner[n]];
            if w.spec.priority > p.spec.priority {
                overridden.push(format!("{n} (overridden by {})", w.name));
            } else {
                conflicting.push(format!("{n} (won by {})", w.name));
            }
        }
        let place = Placement {
            matched,
            conflicting,
            overridden,
            missing_namespaces,
            templates: templates.iter().map(|(id, _)| id.clone()).collect(),
        };
        let tally = np.tallies.remove(&i).unwrap_or_default();
        statuses.insert(p.name.clone(), status::status(p, tally, place, &cluster));
        claim_templates.extend(templates);
        if !p.errors.is_empty() {
            invalid.insert(p.name.clone(), p.errors.clone());
        }
    }
    Plan {
        device_config,
        mig_config,
        vgpu_config,
        cluster_policy_spec,
        node_labels: np.labels,
        node_annotations: np.annotations,
        statuses,
        claim_templates,
        invalid,
        untaint: np.untaint,
        drains: np.drains,
    }
}
