//! A custom MIG layout checked against the geometry of the GPUs it lands on
//! ([`crate::nvidia::geometry`]): per node, from the GPU model GPU Feature Discovery reports
//! (a layout no GPU of that model can hold makes the node `Invalid`, before anything is written
//! to it); per policy, when its selector pins the product (the policy is refused at once, even
//! before a node matches); and the placements, for the status (`migGeometry`).
//!
//! Only custom layouts are checked: a named layout comes from NVIDIA's mig-parted config,
//! which selects its entries per GPU model itself. A GPU model without a table is not checked
//! (the policy says so, `MigGeometryUnverified`): the MIG manager's `failed` then halts the
//! rollout.

use std::collections::BTreeSet;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;

use crate::api::crd::{GpuSharingPolicySpec, MigDeviceGroup, Strategy};
use crate::api::names::{LABEL_GPU_MEMORY, LABEL_GPU_PRODUCT, SHARED_SUFFIX};
use crate::nvidia::geometry::{self as hw, Model};
use crate::validate::FieldError;

use super::facts::NodeFacts;

/// The custom layout a policy spec checks, when it has one.
fn custom_layout(spec: &GpuSharingPolicySpec) -> Option<&[MigDeviceGroup]> {
    if spec.strategy != Strategy::Mig {
        return None;
    }
    spec.mig.as_ref()?.custom_layout.as_deref()
}

/// One GPU's instances in a group: each profile as many times as its count.
fn instances(g: &MigDeviceGroup) -> Vec<&str> {
    g.mig_devices
        .iter()
        .flat_map(|(p, c)| std::iter::repeat_n(p.as_str(), (*c).max(0) as usize))
        .collect()
}

/// What a node's labels say about its GPUs' model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NodeModel {
    /// A model with a geometry table.
    Known(&'static Model),
    /// A product without one, as GFD names it.
    Unknown(String),
    /// No product label (GFD has not run): nothing to check yet.
    Unlabelled,
}

/// The model of the node's GPUs, from `nvidia.com/gpu.product` and `nvidia.com/gpu.memory`.
/// Under the `single` MIG strategy GFD reports the MIG devices there (`<GPU>-MIG-<profile>`,
/// memory of one instance): the product still names the GPU, the memory is not its own.
pub fn node_model(n: &NodeFacts) -> NodeModel {
    let Some(product) = n.labels.get(LABEL_GPU_PRODUCT) else {
        return NodeModel::Unlabelled;
    };
    let memory = n
        .labels
        .get(LABEL_GPU_MEMORY)
        .filter(|_| !product.contains("-MIG-"))
        .and_then(|m| m.parse::<u64>().ok());
    match hw::model_for(product, memory) {
        Some(m) => NodeModel::Known(m),
        None => NodeModel::Unknown(product.trim_end_matches(SHARED_SUFFIX).to_string()),
    }
}

/// The first group of the layout that `model`'s GPUs cannot hold, as the field it is in and
/// why (with the nearest feasible layout where there is one).
fn first_infeasible(groups: &[MigDeviceGroup], model: &'static Model) -> Option<FieldError> {
    groups
        .iter()
        .enumerate()
        .filter(|(_, g)| g.mig_enabled)
        .find_map(|(i, g)| {
            let e = hw::place(model, &instances(g)).err()?;
            Some(FieldError {
                path: format!("spec.mig.customLayout[{i}].migDevices"),
                message: e.to_string(),
            })
        })
}

/// Why this node's GPUs cannot hold the policy's custom layout, when they cannot.
pub fn node_refusal(spec: &GpuSharingPolicySpec, n: &NodeFacts) -> Option<String> {
    let groups = custom_layout(spec)?;
    let NodeModel::Known(model) = node_model(n) else {
        return None;
    };
    first_infeasible(groups, model).map(|e| e.to_string())
}

/// The products a selector pins: `matchLabels` or an `In` expression on
/// `nvidia.com/gpu.product`.
fn pinned_products(selector: &LabelSelector) -> BTreeSet<&str> {
    let mut products: BTreeSet<&str> = selector
        .match_labels
        .iter()
        .flatten()
        .filter(|(k, _)| k.as_str() == LABEL_GPU_PRODUCT)
        .map(|(_, v)| v.as_str())
        .collect();
    for e in selector.match_expressions.iter().flatten() {
        if e.key == LABEL_GPU_PRODUCT && e.operator == "In" {
            products.extend(e.values.iter().flatten().map(String::as_str));
        }
    }
    products
}

/// The models of the products a policy's selector pins (those with a table).
pub fn pinned_models(spec: &GpuSharingPolicySpec) -> impl Iterator<Item = &'static Model> + '_ {
    pinned_products(&spec.node_selector)
        .into_iter()
        .filter_map(|p| hw::model_for(p, None))
}

/// The errors of a policy whose selector pins GPU products whose GPUs cannot hold its custom
/// layout: known before any node matches.
pub fn pinned_errors(spec: &GpuSharingPolicySpec) -> Vec<FieldError> {
    let Some(groups) = custom_layout(spec) else {
        return Vec::new();
    };
    pinned_models(spec)
        .filter_map(|model| {
            let mut e = first_infeasible(groups, model)?;
            e.message = format!(
                "{} (the node selector pins {LABEL_GPU_PRODUCT} to this model)",
                e.message
            );
            Some(e)
        })
        .collect()
}

/// For the status: where each group's instances go on each of `models` (groups that cannot be
/// placed there are reported by the nodes they make `Invalid`). Nothing for a policy without a
/// custom layout.
pub fn report(spec: &GpuSharingPolicySpec, models: &BTreeSet<&'static str>) -> Vec<String> {
    let Some(groups) = custom_layout(spec) else {
        return Vec::new();
    };
    let mut lines = Vec::new();
    for model in models.iter().filter_map(|m| hw::model_by_name(m)) {
        for (i, g) in groups.iter().enumerate().filter(|(_, g)| g.mig_enabled) {
            if let Ok(placed) = hw::place(model, &instances(g)) {
                lines.push(format!(
                    "customLayout[{i}] on {}",
                    hw::render(model, &placed)
                ));
            }
        }
    }
    lines
}

/// For a policy with a custom layout: the GPU models of the nodes it runs on (`accepted`) and
/// of the products its selector pins, known (by name) and unknown (by product); each distinct
/// product and memory label is looked up once.
pub fn gpu_models(
    spec: &GpuSharingPolicySpec,
    accepted: &[&NodeFacts],
) -> (BTreeSet<&'static str>, BTreeSet<String>) {
    let (mut known, mut unknown) = (BTreeSet::new(), BTreeSet::new());
    if !checks(spec) {
        return (known, unknown);
    }
    known.extend(pinned_models(spec).map(|m| m.name));
    let mut seen: BTreeSet<(Option<&str>, Option<&str>)> = BTreeSet::new();
    for n in accepted {
        let key = (
            n.labels.get(LABEL_GPU_PRODUCT),
            n.labels.get(LABEL_GPU_MEMORY),
        );
        if !seen.insert(key) {
            continue;
        }
        match node_model(n) {
            NodeModel::Known(m) => {
                known.insert(m.name);
            }
            NodeModel::Unknown(product) => {
                unknown.insert(product);
            }
            NodeModel::Unlabelled => {}
        }
    }
    (known, unknown)
}

/// Whether the policy has a custom layout to check.
pub fn checks(spec: &GpuSharingPolicySpec) -> bool {
    custom_layout(spec).is_some()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::testing::policy;

    fn spec(devices: &[(&str, i32)], selector: &[(&str, &str)]) -> GpuSharingPolicySpec {
        let devices: Vec<String> = devices.iter().map(|(p, c)| format!("{p}: {c}")).collect();
        let mut s = policy(
            "p",
            &format!(
                "  strategy: mig\n  mig:\n    migStrategy: mixed\n    customLayout:\n    - {{migEnabled: true, migDevices: {{{}}}}}\n",
                devices.join(", ")
            ),
        )
        .spec;
        s.node_selector.match_labels = Some(
            selector
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        );
        s
    }

    fn a100(product: &str) -> NodeFacts {
        let mut n = NodeFacts {
            name: "a".into(),
            ..Default::default()
        };
        n.labels.insert(LABEL_GPU_PRODUCT, product);
        n.labels.insert(LABEL_GPU_MEMORY, "81920");
        n
    }

    #[test]
    fn a_layout_the_model_cannot_hold_is_refused_on_its_nodes_naming_the_field() {
        let bad = spec(&[("3g.40gb", 2), ("1g.10gb", 1)], &[]);
        let why = node_refusal(&bad, &a100("NVIDIA-A100-SXM4-80GB")).unwrap();
        assert!(
            why.starts_with("spec.mig.customLayout[0].migDevices: A100-SXM4-80GB cannot hold"),
            "{why}"
        );
        assert!(why.contains("no slot is left for 1g.10gb"), "{why}");
        assert!(why.contains("nearest feasible layout"), "{why}");
        let good = spec(&[("3g.40gb", 1), ("2g.20gb", 1), ("1g.10gb", 2)], &[]);
        assert_eq!(node_refusal(&good, &a100("NVIDIA-A100-SXM4-80GB")), None);
        // An unknown model is not checked; a node GFD has not labelled neither.
        assert_eq!(node_refusal(&bad, &a100("NVIDIA-Future-GPU")), None);
        assert_eq!(
            node_model(&a100("NVIDIA-Future-GPU-SHARED")),
            NodeModel::Unknown("NVIDIA-Future-GPU".into())
        );
        assert_eq!(node_model(&NodeFacts::default()), NodeModel::Unlabelled);
    }

    #[test]
    fn a_selector_pinning_the_product_refuses_the_policy_at_once() {
        let bad = spec(
            &[("3g.40gb", 2), ("2g.20gb", 1)],
            &[(LABEL_GPU_PRODUCT, "NVIDIA-A100-SXM4-80GB")],
        );
        let errs = pinned_errors(&bad);
        assert_eq!(errs.len(), 1, "{errs:?}");
        assert_eq!(errs[0].path, "spec.mig.customLayout[0].migDevices");
        assert!(
            errs[0].message.contains("pins nvidia.com/gpu.product"),
            "{errs:?}"
        );
        // Not pinned, or pinned to a model that can hold it: nothing at policy level.
        assert!(pinned_errors(&spec(&[("3g.40gb", 2), ("2g.20gb", 1)], &[])).is_empty());
        let fine = spec(
            &[("3g.40gb", 2)],
            &[(LABEL_GPU_PRODUCT, "NVIDIA-A100-SXM4-80GB")],
        );
        assert!(pinned_errors(&fine).is_empty());
    }

    #[test]
    fn the_report_shows_where_instances_go() {
        let s = spec(&[("3g.40gb", 1), ("2g.20gb", 1), ("1g.10gb", 2)], &[]);
        let lines = report(&s, &["A100-SXM4-80GB"].into());
        assert_eq!(
            lines,
            [
                "customLayout[0] on A100-SXM4-80GB: [3g.40gb@4][2g.20gb@0][1g.10gb@2][1g.10gb@3], free: none"
            ]
        );
    }
}
