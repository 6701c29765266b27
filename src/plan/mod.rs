//! The pure planner: policies + node facts -> the desired state of everything the operator owns.
//!
//! No I/O and no clock: the same input gives the same plan, and planning the state a plan
//! produces gives the same plan again (idempotence). The controller reads its caches into a
//! [`PlanInput`], calls [`plan`], and applies the difference.
//!
//! The files of `plan/` depend one way (`tests/architecture.rs` checks it, this file
//! included), each on files listed before it only: the leaves [`labels`], [`taint`],
//! [`facts`] (what the planner knows of a node, [`NodeFacts`], and its readings), [`input`]
//! (what the planner reads: per-node views, cluster facts, settings, memory) and [`backing`]
//! (which backend serves a policy, a node's target); then [`policies`] (validation, what a policy renders
//! to, precedence), [`targets`] (what each node runs), [`disruption`] (which busy nodes a change
//! may drain), [`assign`] (which policy governs which node, the cluster-wide MIG strategy),
//! [`nodeinputs`] (what one node's plan reads: its memo's key), [`decision`]
//! (the transition's vocabulary), [`capacity`], [`outputs`], [`compat`]; [`backend`], one
//! file per backend (its transition, confirmation and capacity) and the registry that
//! dispatches to them; [`node`] (the per-node transition), [`drain`], [`rollout`],
//! [`status`], [`desired`] (the [`Plan`]), [`pipeline`] (the passes: [`plan`], [`Planner`]);
//! a model of NVIDIA's components answering a plan lives outside the planner, in the
//! top-level module `converge`, which uses it (never the other way).
//! This file only declares the modules and re-exports what the crate uses; the files of
//! `plan/` import from each other, never from here.

pub mod admit;
pub mod assign;
pub mod autoscaling;
#[cfg(test)]
mod autoscaling_tests;
pub mod backend;
pub mod backing;
pub mod capacity;
pub mod compat;
pub mod decision;
pub mod demand;
#[cfg(test)]
mod demand_tests;
pub mod desired;
pub mod disruption;
pub mod drain;
pub mod facts;
pub mod geometry;
pub mod input;
pub mod labels;
pub mod memo;
pub mod node;
pub mod nodeinputs;
pub mod nodemap;
pub mod outputs;
pub mod pipeline;
pub mod policies;
pub mod rollout;
pub mod status;
pub mod taint;
pub mod targets;
#[cfg(test)]
pub(crate) mod testing;

pub use self::input::{ClusterFacts, Fence, Memory, NodeView, PlanInput, Settings};
pub use self::labels::{
    LabelFilter, LabelLookup, Labels, OwnedKeys, SelectionLabels, SmallMap, dynamic_selectors,
    selection_labels, selector_keys, selector_matches,
};
pub use self::nodemap::NodeMap;
pub use self::status::MAX_NODE_DETAILS;

pub use self::desired::{Plan, configmap};
pub use self::facts::{NodeFacts, is_device_plugin_resource};
pub use self::pipeline::{Planner, plan};
