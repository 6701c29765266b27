//! The operator's vocabulary: the `GpuSharingPolicy` resource, every name it writes on other
//! objects, and the typed states and reasons its status reports. Depends on nothing else here.

pub mod crd;
pub mod names;
pub mod state;
pub mod yaml;
