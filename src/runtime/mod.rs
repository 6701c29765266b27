//! Talking to the cluster: watches and caches, the plan input, the appliers that write the
//! difference, finalizers and statuses, events and leader election.

pub mod apply;
pub mod cleanup;
pub mod cluster_policy_diff;
pub mod context;
pub mod controller;
pub mod depth;
pub mod error;
pub mod fence;
pub mod finalize;
pub mod input;
pub mod leader;
pub mod memory;
pub mod nodecache;
pub mod resources;
pub mod taints;
pub mod watches;
