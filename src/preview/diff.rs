//! The pure part of `plan`: the cluster as it is, the policies as the files want them -> what
//! would change. The "after" side is the converged plan (NVIDIA's components assumed to
//! succeed, as `render --nodes` shows it), so the preview is the end state, with the waves of
//! node changes that lead there.

use std::collections::{BTreeMap, BTreeSet};

use crate::api::crd::{GpuSharingPolicy, GpuSharingPolicyStatus};
use crate::api::names::{
    LABEL_DEPLOY_DEVICE_PLUGIN, LABEL_DEVICE_PLUGIN_CONFIG, LABEL_MIG_CONFIG, LABEL_POLICY,
    LABEL_VGPU_CONFIG, LABEL_WORKLOAD,
};
use crate::converge::{NotConverged, converge};
use crate::nvidia;
use crate::plan::{self, NodeFacts, PlanInput};
use crate::runtime::cluster_policy_diff;
use crate::validate::FieldError;
use kube::ResourceExt;

// The report's types live in a leaf file that `print` reads too; they stay reachable here.
pub use super::report::{
    Change, KeyChanges, NodePreview, NodeSharing, PolicyChange, PolicyPreview, PolicySide, Preview,
};

/// The labels `plan` compares: ours, except the states the MIG manager and the vGPU Device
/// Manager report.
const COMPARED: [&str; 6] = [
    LABEL_DEVICE_PLUGIN_CONFIG,
    LABEL_MIG_CONFIG,
    LABEL_POLICY,
    LABEL_WORKLOAD,
    LABEL_VGPU_CONFIG,
    LABEL_DEPLOY_DEVICE_PLUGIN,
];

fn sharing(n: &NodeFacts, policies: &[GpuSharingPolicy]) -> NodeSharing {
    let policy = n.labels.get(LABEL_POLICY).map(String::from);
    let strategy = policy.as_deref().and_then(|name| {
        let p = policies.iter().find(|p| p.name_any() == name)?;
        serde_json::to_value(p.spec.strategy)
            .ok()?
            .as_str()
            .map(String::from)
    });
    NodeSharing {
        policy,
        strategy,
        config: n.labels.get(LABEL_DEVICE_PLUGIN_CONFIG).map(String::from),
        mig_layout: n.labels.get(LABEL_MIG_CONFIG).map(String::from),
        workload: n.labels.get(LABEL_WORKLOAD).map(String::from),
        vgpu_config: n.labels.get(LABEL_VGPU_CONFIG).map(String::from),
    }
}

fn side(p: &GpuSharingPolicy, s: Option<&GpuSharingPolicyStatus>) -> PolicySide {
    let ready = s
        .and_then(|s| s.conditions.iter().find(|c| c.type_ == "Ready"))
        .map(|c| format!("{} ({})", c.status.as_str(), c.reason.as_str()))
        .unwrap_or_default();
    PolicySide {
        strategy: serde_json::to_value(p.spec.strategy)
            .ok()
            .and_then(|v| v.as_str().map(String::from))
            .unwrap_or_default(),
        nodes: s.and_then(|s| s.nodes.clone()).unwrap_or_default(),
        ready,
        capacity: s.and_then(|s| s.capacity.clone()),
        mig_geometry: s.map(|s| s.mig_geometry.clone()).unwrap_or_default(),
        degraded: s
            .and_then(|s| s.conditions.iter().find(|c| c.type_ == "Degraded"))
            .filter(|c| c.status.as_str() == "True")
            .map(|c| c.message.clone()),
    }
}

/// The desired policies: the files' (keeping a changed policy's age, so precedence among equal
/// priorities stays as it is; a new one is the newest), plus, unless `prune`, the cluster's
/// policies the files do not name.
pub fn desired(
    current: &[GpuSharingPolicy],
    files: Vec<GpuSharingPolicy>,
    prune: bool,
) -> Vec<GpuSharingPolicy> {
    let named: BTreeSet<String> = files.iter().map(|p| p.name_any()).collect();
    let mut out: Vec<GpuSharingPolicy> = files
        .into_iter()
        .map(|mut p| {
            if let Some(c) = current.iter().find(|c| c.name_any() == p.name_any()) {
                p.metadata.creation_timestamp = c.metadata.creation_timestamp.clone();
                p.metadata.uid = c.metadata.uid.clone();
                let same = serde_json::to_value(&c.spec).ok() == serde_json::to_value(&p.spec).ok();
                p.metadata.generation = c.metadata.generation.map(|g| g + i64::from(!same));
            }
            p
        })
        .collect();
    if !prune {
        out.extend(
            current
                .iter()
                .filter(|c| !named.contains(&c.name_any()))
                .cloned(),
        );
    }
    out
}

fn policy_previews(
    current: &[GpuSharingPolicy],
    desired: &[GpuSharingPolicy],
    before: &plan::Plan,
    after: &plan::Plan,
) -> Vec<PolicyPreview> {
    let mut names: BTreeSet<String> = current.iter().map(|p| p.name_any()).collect();
    names.extend(desired.iter().map(|p| p.name_any()));
    names
        .into_iter()
        .map(|name| {
            let c = current.iter().find(|p| p.name_any() == name);
            let d = desired.iter().find(|p| p.name_any() == name);
            let change = match (c, d) {
                (None, _) => PolicyChange::Added,
                (_, None) => PolicyChange::Removed,
                (Some(c), Some(d)) if c.metadata.generation != d.metadata.generation => {
                    PolicyChange::Changed
                }
                _ => PolicyChange::Unchanged,
            };
            PolicyPreview {
                before: c.map(|p| side(p, before.statuses.get(&name))),
                after: d.map(|p| side(p, after.statuses.get(&name))),
                name,
                change,
            }
        })
        .collect()
}

/// ClusterPolicy fields the operator sets (after) or set and releases (before only), against
/// the cluster's values: the applier's own diff.
fn cluster_policy_changes(
    cluster: Option<&serde_json::Value>,
    before: &plan::Plan,
    after: &plan::Plan,
) -> Vec<Change<serde_json::Value>> {
    let released = Some(&before.cluster_policy_spec);
    cluster_policy_diff::changes(cluster, &after.cluster_policy_spec, released)
        .into_iter()
        .map(|c| Change {
            key: c.key,
            before: c.current,
            after: c.wanted,
        })
        .collect()
}

fn node_previews(
    current: &PlanInput,
    after: &PlanInput,
    desired: &[GpuSharingPolicy],
    waves: &[BTreeSet<String>],
) -> Vec<NodePreview> {
    let finals: BTreeMap<&str, &NodeFacts> = after
        .nodes
        .iter()
        .map(|n| (n.name.as_str(), &**n))
        .collect();
    let mut out = Vec::new();
    for n in &current.nodes {
        let Some(f) = finals.get(n.name.as_str()) else {
            continue;
        };
        let labels: Vec<Change<String>> = COMPARED
            .iter()
            .filter_map(|k| {
                let (b, a) = (n.labels.get(k), f.labels.get(k));
                (b != a).then(|| Change {
                    key: k.to_string(),
                    before: b.map(String::from),
                    after: a.map(String::from),
                })
            })
            .collect();
        if labels.is_empty() {
            continue;
        }
        out.push(NodePreview {
            name: n.name.clone(),
            before: sharing(n, &current.policies),
            after: sharing(f, desired),
            wave: waves
                .iter()
                .position(|w| w.contains(&n.name))
                .map_or(0, |i| i + 1),
            labels,
        });
    }
    out.sort_by(|a, b| a.name.cmp(&b.name));
    out
}

#[derive(Debug, thiserror::Error)]
pub enum PreviewError {
    /// Policies the planner refuses on this cluster (e.g. a named MIG layout its mig-parted
    /// config lacks), by name.
    #[error("{}", .0.iter().map(|(p, e)| format!("policy {p:?}: {e}")).collect::<Vec<_>>().join("\n"))]
    Invalid(Vec<(String, FieldError)>),
    #[error(transparent)]
    NotConverged(#[from] NotConverged),
}

/// One line per NodeOverlay of a plan: `name: capacity (NodePools: instance types)`.
pub fn overlay_lines(plan: &plan::Plan) -> Vec<String> {
    let list = |v: &serde_json::Value| -> String {
        v.as_array()
            .into_iter()
            .flatten()
            .filter_map(|x| x.as_str())
            .collect::<Vec<_>>()
            .join(", ")
    };
    plan.node_overlays
        .iter()
        .map(|(name, o)| {
            let spec = &o["spec"];
            let capacity: Vec<String> = spec["capacity"]
                .as_object()
                .into_iter()
                .flatten()
                .map(|(r, q)| format!("{r}={}", q.as_str().unwrap_or_default()))
                .collect();
            format!(
                "{name}: {} (NodePools {}: {})",
                capacity.join(" "),
                list(&spec["requirements"][0]["values"]),
                list(&spec["requirements"][1]["values"])
            )
        })
        .collect()
}

/// Our DeviceClasses, one line each: `name -> extended resource`.
pub fn class_lines(plan: &plan::Plan) -> Vec<String> {
    plan.device_classes
        .iter()
        .map(|(name, c)| {
            let r = c["spec"]["extendedResourceName"]
                .as_str()
                .unwrap_or_default();
            format!("{name} -> {r}")
        })
        .collect()
}

/// `node: layout (for pod, ...)` for each node demand reshapes in `plan`.
pub fn demand_lines(plan: &plan::Plan) -> Vec<String> {
    plan.demand
        .annotations
        .iter()
        .filter_map(|(node, v)| {
            let layout = v.as_deref()?.rsplit_once('@')?.0;
            let pods: Vec<&str> = plan
                .demand
                .events
                .iter()
                .filter(|(_, n, _)| n == node)
                .map(|(p, _, _)| p.as_str())
                .collect();
            let drain = match plan.demand.drains.get(node) {
                Some(n) => format!("; drains it, evicting {n} GPU pod(s)"),
                None => String::new(),
            };
            Some(format!("{node}: {layout} (for {}{drain})", pods.join(", ")))
        })
        .collect()
}

/// The nodes the plan puts the spare taint on (`added`) or takes it off (`removed`).
fn spare_changes(plan: &plan::Plan) -> KeyChanges {
    let (on, off): (Vec<_>, Vec<_>) = plan.spare.iter().partition(|(_, present)| *present);
    KeyChanges {
        added: on.into_iter().map(|(n, _)| n.clone()).collect(),
        removed: off.into_iter().map(|(n, _)| n.clone()).collect(),
    }
}

/// What applying the desired policies (see [`desired`]) to the cluster `current` would change.
/// `cluster_policy` is the active ClusterPolicy's spec; `checked` names the policies whose
/// planner errors make the input invalid (the files'; the cluster's own keep their status).
pub fn preview(
    current: &PlanInput,
    cluster_policy: Option<&serde_json::Value>,
    desired_policies: Vec<GpuSharingPolicy>,
    checked: &BTreeSet<String>,
) -> Result<Preview, PreviewError> {
    let before = plan::plan(current);
    let mut input = current.clone();
    input.policies = desired_policies;
    let first = plan::plan(&input);
    let invalid: Vec<(String, FieldError)> = first
        .invalid
        .iter()
        .filter(|(name, _)| checked.contains(*name))
        .flat_map(|(name, errs)| errs.iter().map(|e| (name.clone(), e.clone())))
        .collect();
    if !invalid.is_empty() {
        return Err(PreviewError::Invalid(invalid));
    }
    let c = converge(input)?;
    let after = &c.plan;
    let policies = policy_previews(&current.policies, &c.input.policies, &before, after);
    let nodes = node_previews(current, &c.input, &c.input.policies, &c.waves);
    let layouts = |text: Option<&String>| -> Vec<String> {
        text.and_then(|t| nvidia::parse_mig_configs(t).ok())
            .map(|m| m.into_keys().collect())
            .unwrap_or_default()
    };
    let mig_before: Vec<String> = current
        .cluster
        .current_mig_configs
        .keys()
        .cloned()
        .collect();
    let mig_after = layouts(after.mig_config.as_ref());
    let mut p = Preview {
        changed: false,
        device_plugin_config_keys: KeyChanges::of(
            current.cluster.current_device_config.keys(),
            after.device_config.keys(),
        ),
        mig_layouts: KeyChanges::of(&mig_before, &mig_after),
        claim_templates: KeyChanges::of(
            before.claim_templates.keys(),
            after.claim_templates.keys(),
        ),
        device_classes: KeyChanges::of(&class_lines(&before), &class_lines(after)),
        node_overlays: KeyChanges::of(&overlay_lines(&before), &overlay_lines(after)),
        demand_layouts: demand_lines(&first),
        spare_taints: spare_changes(&first),
        cluster_policy: cluster_policy_changes(cluster_policy, &before, after),
        waves: c
            .waves
            .iter()
            .map(|w| w.iter().cloned().collect())
            .collect(),
        passes: c.passes,
        policies,
        nodes,
        assumptions: Vec::new(),
    };
    p.changed = p
        .policies
        .iter()
        .any(|x| x.change != PolicyChange::Unchanged)
        || !p.nodes.is_empty()
        || !p.device_plugin_config_keys.is_empty()
        || !p.mig_layouts.is_empty()
        || !p.claim_templates.is_empty()
        || !p.device_classes.is_empty()
        || !p.node_overlays.is_empty()
        || !p.demand_layouts.is_empty()
        || !p.spare_taints.is_empty()
        || !p.cluster_policy.is_empty();
    Ok(p)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::Labels;

    fn policy(yaml: &str) -> GpuSharingPolicy {
        let mut p = crate::plan::testing::policy_yaml(yaml);
        p.metadata.generation = Some(1);
        p
    }

    fn a100() -> NodeFacts {
        let mut labels = Labels::default();
        for (k, v) in [
            ("nvidia.com/gpu.product", "NVIDIA-A100-SXM4-80GB"),
            ("nvidia.com/gpu.count", "8"),
            ("nvidia.com/gpu.memory", "81920"),
            ("nvidia.com/mig.capable", "true"),
            ("nvidia.com/mig.config", "all-disabled"),
            ("nvidia.com/mig.config.state", "success"),
        ] {
            labels.insert(k, v);
        }
        NodeFacts {
            name: "a100-0".into(),
            labels,
            ..Default::default()
        }
    }

    const MIG: &str = "metadata: {name: a100}\nspec:\n  nodeSelector: {matchLabels: {nvidia.com/gpu.product: NVIDIA-A100-SXM4-80GB}}\n  strategy: mig\n  mig: {migStrategy: single, layout: all-1g.10gb}\n";
    const MPS: &str = "metadata: {name: a100}\nspec:\n  nodeSelector: {matchLabels: {nvidia.com/gpu.product: NVIDIA-A100-SXM4-80GB}}\n  strategy: mps\n  mps: {replicas: 2}\n";

    /// The cluster once the operator converged on `policies`.
    fn converged(policies: Vec<GpuSharingPolicy>) -> (PlanInput, serde_json::Value) {
        let mut input = PlanInput::new(policies, vec![a100()]);
        input.cluster.base_mig_configs = Some(nvidia::default_mig_configs());
        let c = converge(input).unwrap();
        (c.input, c.plan.cluster_policy_spec)
    }

    fn names(policies: &[GpuSharingPolicy]) -> BTreeSet<String> {
        policies.iter().map(|p| p.name_any()).collect()
    }

    /// `plan` names the pods a demand layout is for, and says when the node is drained for it.
    #[test]
    fn demand_lines_name_the_pods_and_the_drain() {
        let mut p = plan::Plan::default();
        let d = &mut p.demand;
        for (node, at) in [("a", "all-3g.40gb@7"), ("b", "all-1g.10gb@7")] {
            d.annotations.insert(node.into(), Some(at.into()));
        }
        d.annotations.insert("c".into(), None);
        for (pod, node) in [("ml/p0", "a"), ("ml/p1", "a"), ("ml/q", "b")] {
            d.events.push((pod.into(), node.into(), String::new()));
        }
        d.drains.insert("a".into(), 1);
        assert_eq!(
            demand_lines(&p),
            [
                "a: all-3g.40gb (for ml/p0, ml/p1; drains it, evicting 1 GPU pod(s))",
                "b: all-1g.10gb (for ml/q)",
            ]
        );
    }

    #[test]
    fn the_files_the_cluster_runs_change_nothing() {
        let files = vec![policy(MIG)];
        let (cluster, cp) = converged(files.clone());
        let want = desired(&cluster.policies, files.clone(), false);
        let p = preview(&cluster, Some(&cp), want, &names(&files)).unwrap();
        assert!(!p.changed, "{p:#?}");
        assert!(p.nodes.is_empty() && p.cluster_policy.is_empty());
        assert_eq!(p.passes, 1);
        assert_eq!(p.policies[0].change, PolicyChange::Unchanged);
    }

    /// Moving a time-sliced pool to DRA extended resources: `plan` shows our DeviceClass and the
    /// node's switches, and the converged view has the DRA driver serving it.
    #[test]
    fn a_move_to_dra_extended_resources_shows_the_class_and_the_switches() {
        const TS: &str = "metadata: {name: a100}\nspec:\n  nodeSelector: {matchLabels: {nvidia.com/gpu.product: NVIDIA-A100-SXM4-80GB}}\n  strategy: timeSlicing\n  timeSlicing: {replicas: 4}\n";
        let ext = format!(
            "{TS}  backend: dra\n  dra: {{extendedResources: true, driverFeatureGates: {{ConsumableShares: true}}}}\n"
        );
        let mut a = a100();
        a.labels.insert("nvidia.com/mig.capable", "false");
        let mut input = PlanInput::new(vec![policy(TS)], vec![a]);
        input.cluster.base_mig_configs = Some(nvidia::default_mig_configs());
        let cluster = converge(input).unwrap().input;
        let files = vec![policy(&ext)];
        let want = desired(&cluster.policies, files.clone(), false);
        let p = preview(&cluster, None, want, &names(&files)).unwrap();
        assert_eq!(
            p.device_classes.added,
            ["gpusharing-nvidia.com-gpu -> nvidia.com/gpu"]
        );
        let n = &p.nodes[0];
        assert_eq!(n.after.strategy.as_deref(), Some("timeSlicing"), "{n:?}");
        // Device plugin off, then the DRA kubelet plugin on: more than one wave.
        assert!(p.waves.len() >= 2, "{:?}", p.waves);
        let after = p.policies[0].after.as_ref().unwrap();
        assert_eq!(after.nodes, "1/1", "{after:?}");
        assert!(after.ready.starts_with("True"), "{after:?}");
    }

    /// A MIG pool moving to DRA extended resources: `plan` shows one class per profile, and the
    /// converged view has the DRA driver serving the layout the MIG manager applied.
    #[test]
    fn a_mig_pool_moving_to_dra_shows_a_class_per_profile() {
        let mixed = MIG.replace("single", "mixed").replace("1g.10gb", "3g.40gb");
        let (cluster, cp) = converged(vec![policy(&mixed)]);
        let files = vec![policy(&format!(
            "{mixed}  backend: dra\n  dra: {{extendedResources: true}}\n"
        ))];
        let want = desired(&cluster.policies, files.clone(), false);
        let p = preview(&cluster, Some(&cp), want, &names(&files)).unwrap();
        assert_eq!(
            p.device_classes.added,
            ["gpusharing-nvidia.com-mig-3g.40gb -> nvidia.com/mig-3g.40gb"]
        );
        let n = &p.nodes[0];
        assert_eq!(n.after.mig_layout.as_deref(), Some("all-3g.40gb"), "{n:?}");
        let after = p.policies[0].after.as_ref().unwrap();
        assert_eq!(after.nodes, "1/1", "{after:?}");
        assert!(after.ready.starts_with("True"), "{after:?}");
    }

    #[test]
    fn mig_to_mps_shows_the_waves_through_all_disabled_and_the_cluster_policy() {
        let (cluster, cp) = converged(vec![policy(MIG)]);
        let files = vec![policy(MPS)];
        let want = desired(&cluster.policies, files.clone(), false);
        let p = preview(&cluster, Some(&cp), want, &names(&files)).unwrap();
        assert!(p.changed);
        let n = &p.nodes[0];
        assert_eq!(n.before.mig_layout.as_deref(), Some("all-1g.10gb"));
        assert_eq!(n.after.mig_layout.as_deref(), Some("all-disabled"));
        assert_eq!(n.before.strategy.as_deref(), Some("mig"));
        assert_eq!(n.after.strategy.as_deref(), Some("mps"));
        // Sharing off, MIG off and confirmed, then the MPS config: one node, several waves.
        assert!(p.waves.len() >= 2, "{:?}", p.waves);
        assert!(p.waves.iter().all(|w| w.iter().any(|n| n == "a100-0")));
        assert_eq!(n.wave, 1);
        // The cluster-wide MIG strategy goes back to none (MPS cannot run with MIG).
        let strategy = p
            .cluster_policy
            .iter()
            .find(|c| c.key == "spec.mig.strategy")
            .unwrap_or_else(|| panic!("{:?}", p.cluster_policy));
        assert_eq!(strategy.before, Some(serde_json::json!("single")));
        let after = &p.policies[0].after.as_ref().unwrap();
        assert_eq!(after.capacity.as_ref().unwrap().schedulable_replicas, 16);
        assert_eq!(p.policies[0].change, PolicyChange::Changed);
    }

    #[test]
    fn a_layout_missing_from_the_clusters_config_is_invalid_input() {
        let (cluster, cp) = converged(vec![]);
        let files = vec![policy(&MIG.replace("all-1g.10gb", "all-9g.99gb"))];
        let want = desired(&cluster.policies, files.clone(), false);
        let err = preview(&cluster, Some(&cp), want, &names(&files)).unwrap_err();
        assert!(matches!(err, PreviewError::Invalid(_)), "{err}");
        assert!(err.to_string().contains("spec.mig.layout"), "{err}");
    }

    #[test]
    fn an_empty_operator_spec_is_no_cluster_policy_change() {
        // No policy before: the operator owns no ClusterPolicy field, and the cluster's own
        // settings are not ours to show.
        let (cluster, cp) = converged(vec![]);
        assert_eq!(cp, serde_json::json!({}));
        let theirs = serde_json::json!({"driver": {"enabled": true}});
        let p = preview(&cluster, Some(&theirs), vec![], &BTreeSet::new()).unwrap();
        assert!(!p.changed, "{p:#?}");
        let files = vec![policy(MIG)];
        let want = desired(&cluster.policies, files.clone(), false);
        let p = preview(&cluster, Some(&theirs), want, &names(&files)).unwrap();
        let keys: Vec<&str> = p.cluster_policy.iter().map(|c| c.key.as_str()).collect();
        assert!(keys.contains(&"spec.mig.strategy"), "{keys:?}");
        assert!(
            keys.iter()
                .all(|k| k.starts_with("spec.") && *k != "spec.driver.enabled")
        );
        assert!(
            p.cluster_policy.iter().all(|c| c.after.is_some()),
            "{keys:?}"
        );
    }

    #[test]
    fn prune_removes_what_the_files_do_not_name() {
        let (cluster, _) = converged(vec![policy(MIG)]);
        let other = policy(&MPS.replace("name: a100", "name: other"));
        assert_eq!(
            desired(&cluster.policies, vec![other.clone()], false).len(),
            2
        );
        let pruned = desired(&cluster.policies, vec![other], true);
        assert_eq!(names(&pruned), BTreeSet::from(["other".to_string()]));
    }

    #[test]
    fn a_vgpu_type_change_is_a_node_change() {
        const VGPU: &str = "metadata: {name: a100}\nspec:\n  nodeSelector: {matchLabels: {nvidia.com/gpu.product: NVIDIA-A100-SXM4-80GB}}\n  strategy: vgpu\n  vgpu: {type: A100D-1-10C}\n";
        let mut input = PlanInput::new(vec![policy(VGPU)], vec![a100()]);
        input.cluster.sandbox.vgpu_manager_enabled = true;
        let c = converge(input).unwrap();
        let (cluster, cp) = (c.input, c.plan.cluster_policy_spec);
        assert_eq!(cp["sandboxWorkloads"]["enabled"], true);
        let files = vec![policy(&VGPU.replace("A100D-1-10C", "A100D-2-20C"))];
        let want = desired(&cluster.policies, files.clone(), false);
        let p = preview(&cluster, Some(&cp), want, &names(&files)).unwrap();
        assert!(
            p.changed,
            "only nvidia.com/vgpu.config changes, and that is a change"
        );
        let n = &p.nodes[0];
        assert_eq!(n.before.workload.as_deref(), Some("vm-vgpu"));
        assert_eq!(n.before.vgpu_config.as_deref(), Some("A100D-1-10C"));
        assert_eq!(n.after.vgpu_config.as_deref(), Some("A100D-2-20C"));
        let text = crate::preview::print::text(&p);
        assert!(
            text.contains("vm-vgpu A100D-1-10C -> vm-vgpu A100D-2-20C"),
            "{text}"
        );
    }
}
