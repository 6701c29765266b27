//! What one node's plan before the rollout gate reads: [`NodeInputs`], the per-node planner's
//! only argument, with its cluster-wide part [`NodeCluster`]. Both are the key of the node's
//! memo (see `memo`), built here in one place. A leaf of `plan/`: the transitions (`decision`)
//! and the memo read it, it reads neither.

use std::collections::BTreeMap;

use super::facts::NodeFacts;
use super::input::{ClusterFacts, NodeView, Sandbox};
use super::policies::Prepared;

/// The cluster-wide inputs of one node's plan before the gate, besides the clock: what a layout
/// name means (custom layouts, NVIDIA's and our MIG configs), the DRA-only `GPUCluster`, the
/// ClusterPolicy's sandbox settings. Built in one place ([`NodeCluster::of`]) and versioned
/// whole by its `Debug` text, so a field added here enters the memo key by itself.
#[derive(Debug)]
pub struct NodeCluster<'a> {
    /// The policies' custom layouts: layout name -> content hash.
    custom_layouts: BTreeMap<&'a str, &'a str>,
    /// Named mig-parted layouts (the GPU Operator's default config), when known.
    pub mig_layouts: Option<&'a BTreeMap<String, serde_json::Value>>,
    /// Layouts of our own mig-parted ConfigMap as it is now.
    current_mig_configs: &'a BTreeMap<String, serde_json::Value>,
    /// The GPU Operator's DRA-only `GPUCluster`, when one exists.
    pub gpu_cluster: Option<&'a str>,
    /// The ClusterPolicy's sandbox settings.
    pub sandbox: &'a Sandbox,
    /// The ClusterPolicy's MIG strategy as read.
    pub cluster_mig_strategy: Option<&'a str>,
}

impl<'a> NodeCluster<'a> {
    /// The part of the cluster's facts (and of the policies: their custom layouts) that a
    /// node's plan before the gate reads. Every field of [`ClusterFacts`] is named here: a new
    /// one does not compile until it is placed in this struct or said to be read elsewhere.
    pub fn of(prepared: &'a [Prepared], c: &'a ClusterFacts) -> Self {
        let ClusterFacts {
            now: _,                   // NodeInputs::now (a plan that reads it is not reused)
            current_device_config: _, // outputs: the keys nodes still name
            base_mig_configs,
            current_mig_configs,
            base_vgpu_configs: _, // through the prepared policies (check_vgpu_types)
            current_vgpu_configs: _, // outputs
            namespaces: _,        // DRA claim templates and statuses
            cluster_policy_found: _, // statuses
            sandbox,
            cluster_mig_strategy,
            readiness_taint: _, // after the gate (the taint's removal)
            gpu_cluster,
            autoscaling: _,       // Karpenter's overlays, from the capacities
            demand: _,            // demand, after the gate
            demand_ignored: _,    // statuses
            device_classes: _,    // through the prepared policies (dra::extended_conflicts)
            slices_unreadable: _, // through the prepared policies (dra::extended_conflicts)
            quotas: _,            // statuses
        } = c;
        NodeCluster {
            custom_layouts: prepared
                .iter()
                .filter_map(|p| {
                    let m = p.mig()?;
                    Some((m.layout.as_str(), m.custom.as_ref()?.1.as_str()))
                })
                .collect(),
            mig_layouts: base_mig_configs.as_ref(),
            current_mig_configs,
            gpu_cluster: gpu_cluster.as_deref(),
            sandbox,
            cluster_mig_strategy: cluster_mig_strategy.as_deref(),
        }
    }

    /// What a layout name means now, as a content hash: a custom layout of a policy, a named
    /// one of the GPU Operator's config, or one left in our ConfigMap (`None`: unknown, or
    /// `all-disabled`).
    pub fn layout_hash(&self, name: &str) -> Option<String> {
        if name == crate::nvidia::MIG_DISABLED_LAYOUT {
            return None;
        }
        if let Some(h) = self.custom_layouts.get(name) {
            return Some(h.to_string());
        }
        self.mig_layouts
            .and_then(|b| b.get(name))
            .or_else(|| self.current_mig_configs.get(name))
            .map(crate::nvidia::content_hash)
    }
}

/// Everything one node's plan before the gate reads: the per-node planner's only argument,
/// built in one place ([`NodeInputs::of`]). The memo reuses a plan only when each part is the
/// same (see the module's documentation).
pub struct NodeInputs<'a> {
    /// The node's facts.
    pub facts: &'a NodeFacts,
    /// Pods using GPUs on the node.
    pub gpu_pods: &'a [String],
    /// Pods using the sandbox device plugin's resources (VMs).
    pub vm_pods: &'a [String],
    /// Allocated `gpu.nvidia.com` ResourceClaims on the node.
    pub dra_claims: &'a [String],
    /// What the DRA driver publishes for the node.
    pub dra_slice: Option<&'a super::input::DraSlice>,
    /// The MIG state has said `pending` past the MIG timeout.
    pub mig_stuck: bool,
    /// The vGPU state has said `pending` past its timeout.
    pub vgpu_stuck: bool,
    /// The policy that governs the node, if any.
    pub policy: Option<&'a Prepared<'a>>,
    /// The cluster-wide part.
    pub cluster: &'a NodeCluster<'a>,
    /// Unix seconds, read through `Env::now`.
    pub now: i64,
}

impl<'a> NodeInputs<'a> {
    /// The inputs of node `v` governed by `policy`. Takes from the view what the per-node
    /// planner reads (the rest of it, drains' and demand's, is read after the gate).
    pub fn of(
        v: &'a NodeView,
        policy: Option<&'a Prepared<'a>>,
        cluster: &'a NodeCluster<'a>,
        now: i64,
    ) -> Self {
        NodeInputs {
            facts: &v.facts,
            gpu_pods: &v.gpu_pods,
            vm_pods: &v.vm_pods,
            dra_claims: &v.dra_claims,
            dra_slice: v.dra_slice.as_ref(),
            mig_stuck: v.mig_stuck,
            vgpu_stuck: v.vgpu_stuck,
            policy,
            cluster,
            now,
        }
    }
}
