//! Whether a policy can run on a node at all (hardware limits the policy's spec cannot know).

use std::collections::BTreeSet;

use crate::api::crd::{GpuSharingPolicySpec, Mig, Strategy};
use crate::api::names::*;
use crate::nvidia::{self, mig};

use super::capacity::profile_fits_memory;
use super::facts::NodeFacts;
use super::facts::{gpu_count, gpu_memory_mib, label_i64};
use super::geometry::{NodeModel, node_model};

/// Node-specific reasons a policy cannot be applied to a node.
pub fn node_rejection(spec: &GpuSharingPolicySpec, node: &NodeFacts) -> Option<String> {
    let product = node
        .labels
        .get(LABEL_GPU_PRODUCT)
        .map(|p| p.trim_end_matches(SHARED_SUFFIX).to_string())
        .unwrap_or_else(|| "unknown GPU".into());
    let multi_user = spec
        .dra
        .as_ref()
        .and_then(|d| d.mps.as_ref())
        .is_some_and(|m| m.multi_user);
    if multi_user && label_i64(node, LABEL_CC_MAJOR).is_some_and(|m| m < 7) {
        return Some(format!(
            "{product}: MPS multiUser needs a Volta or newer GPU (compute capability 7.0+)"
        ));
    }
    match spec.strategy {
        Strategy::Mps => {
            let replicas = spec.mps.as_ref()?.replicas;
            let major = label_i64(node, LABEL_CC_MAJOR);
            let minor = label_i64(node, LABEL_CC_MINOR).unwrap_or(0);
            if let Some(major) = major
                && (major, minor) < (7, 5)
                && replicas > mig::MPS_MAX_REPLICAS_OLD_GPUS
            {
                return Some(format!(
                    "{product} has compute capability {major}.{minor}: MPS allows at most {} clients below 7.5, policy asks {replicas}",
                    mig::MPS_MAX_REPLICAS_OLD_GPUS
                ));
            }
            None
        }
        Strategy::Mig => {
            let mig = spec.mig.as_ref()?;
            if node.labels.get(LABEL_MIG_CAPABLE) != Some("true") {
                return Some(format!(
                    "{product} does not support MIG (nvidia.com/mig.capable is not true)"
                ));
            }
            // Under the `single` strategy GFD describes the MIG devices on `nvidia.com/gpu.*`
            // (product `<GPU>-MIG-<profile>`, or `-MIG-INVALID` with count and memory 0 while
            // the GPUs are not all split alike): count and memory are not the GPUs' then.
            let physical = !product.contains("-MIG-");
            let gpus = gpu_count(node).filter(|_| physical);
            if let (Some(groups), Some(gpus)) = (&mig.custom_layout, gpus) {
                let mut covered = BTreeSet::new();
                for g in groups {
                    match g.indices() {
                        None => covered.extend(0..gpus as i32),
                        Some(d) => {
                            for i in d {
                                if *i as i64 >= gpus {
                                    return Some(format!(
                                        "GPU index {i} does not exist: the node has {gpus} GPUs"
                                    ));
                                }
                                covered.insert(*i);
                            }
                        }
                    }
                }
                let missing: Vec<String> = (0..gpus as i32)
                    .filter(|i| !covered.contains(i))
                    .map(|i| i.to_string())
                    .collect();
                if !missing.is_empty() {
                    return Some(format!(
                        "GPUs {} are in no device group of customLayout (mig-parted requires every GPU to be covered)",
                        missing.join(",")
                    ));
                }
            }
            mig_profile_refusal(mig, node)
        }
        _ => None,
    }
}

/// Why the node's GPUs cannot hold a MIG profile the layout names, when they cannot: a profile
/// the GPU model (known from its product) does not have, or whose memory is not 1/8, 1/4, 1/2
/// or all of the GPU's. Under the `single` strategy GFD's labels describe the MIG devices, not
/// the GPUs: the product still names the model, the memory is not the GPU's.
pub fn mig_profile_refusal(mig: &Mig, node: &NodeFacts) -> Option<String> {
    let product = node
        .labels
        .get(LABEL_GPU_PRODUCT)
        .map(|p| p.trim_end_matches(SHARED_SUFFIX).to_string())
        .unwrap_or_else(|| "unknown GPU".into());
    let physical = !product.contains("-MIG-");
    let profiles = nvidia::layout_profiles(mig).unwrap_or_default();
    // A custom layout's profiles are checked with its placements (`geometry::node_refusal`).
    if mig.custom_layout.is_none()
        && let NodeModel::Known(model) = node_model(node)
        && let Some(p) = profiles.iter().find(|p| model.profile(p).is_none())
    {
        return Some(format!("MIG profile {p} does not exist on {}", model.name));
    }
    let mem = gpu_memory_mib(node).filter(|_| physical)?;
    profiles.iter().find_map(|p| {
        let prof = mig::parse_mig_profile(p)?;
        (!profile_fits_memory(&prof, mem)).then(|| {
            format!(
                "MIG profile {p} does not exist on {product} ({mem} MiB per GPU): its memory must be 1/8, 1/4, 1/2 or all of the GPU's"
            )
        })
    })
}
