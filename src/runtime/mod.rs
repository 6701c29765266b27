//! Talking to the cluster: watches and caches, the plan input, the appliers that write the
//! difference, finalizers, events and leader election.

pub mod controller;
pub mod leader;
pub mod nodecache;
