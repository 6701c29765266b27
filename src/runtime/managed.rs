//! What our field manager owns on an object: read in [`crate::observe::managed`] (the one reader
//! of `managedFields`), named here for the appliers that remove what we no longer want.

pub use crate::observe::managed::owned_leaf_paths;
