//! NVIDIA's node state, read once into types: what the MIG manager and the vGPU Device Manager
//! report on a node (`nvidia.com/mig.config.state`, `nvidia.com/vgpu.config.state`), the
//! workload the GPU Operator runs there (`nvidia.com/gpu.workload.config`), its per-node
//! operand switches (`nvidia.com/gpu.deploy.<operand>`), and GPU Feature Discovery's report.
//! The planner matches on these types; the label values live only here.

use crate::api::names::{LABEL_GFD_TIMESTAMP, LABEL_GPU_REPLICAS};

/// Progress a config manager (the MIG manager, the vGPU Device Manager) reports for the config
/// its node label names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConfigState {
    /// Applying it (or it exited early and never will: the planner times this out).
    Pending,
    /// The MIG manager rebooting the node to apply it (`WITH_REBOOT=true`).
    Rebooting,
    Success,
    Failed,
    /// A value neither manager writes.
    Unrecognised,
}

impl ConfigState {
    /// The label value (absent: no state reported).
    pub fn parse(value: Option<&str>) -> Option<Self> {
        Some(match value? {
            "pending" => ConfigState::Pending,
            "rebooting" => ConfigState::Rebooting,
            "success" => ConfigState::Success,
            "failed" => ConfigState::Failed,
            _ => ConfigState::Unrecognised,
        })
    }

    /// The label value this state is written as (what we write with a layout change, and what
    /// the simulated managers answer in the converged view).
    pub fn label_value(self) -> &'static str {
        match self {
            ConfigState::Pending => "pending",
            ConfigState::Rebooting => "rebooting",
            ConfigState::Success => "success",
            ConfigState::Failed => "failed",
            ConfigState::Unrecognised => "unknown",
        }
    }
}

/// What the MIG manager reports on a node: the layout its label names and how far it got.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MigState<'n> {
    /// `nvidia.com/mig.config`.
    pub layout: Option<&'n str>,
    /// `nvidia.com/mig.config.state`.
    pub state: Option<ConfigState>,
}

impl<'n> MigState<'n> {
    pub fn read(layout: Option<&'n str>, state: Option<&str>) -> Self {
        MigState {
            layout,
            state: ConfigState::parse(state),
        }
    }

    /// `layout` is on the node and the MIG manager confirmed it.
    pub fn confirmed(&self, layout: &str) -> bool {
        self.layout == Some(layout) && self.state == Some(ConfigState::Success)
    }

    /// The MIG manager failed on the current layout, or (`stuck`) it stayed pending past the
    /// timeout.
    pub fn failed(&self, stuck: bool) -> bool {
        match self.state {
            Some(ConfigState::Failed) => true,
            Some(ConfigState::Pending) => stuck,
            _ => false,
        }
    }

    /// MIG is confirmed off (`all-disabled` succeeded) or was never set.
    pub fn off(&self, disabled_layout: &str) -> bool {
        match self.layout {
            None => true,
            Some(l) if l == disabled_layout => {
                matches!(self.state, None | Some(ConfigState::Success))
            }
            Some(_) => false,
        }
    }
}

/// What the vGPU Device Manager reports on a node: the config its label names and how far it
/// got.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VgpuState<'n> {
    /// `nvidia.com/vgpu.config`.
    pub config: Option<&'n str>,
    /// `nvidia.com/vgpu.config.state`.
    pub state: Option<ConfigState>,
}

impl<'n> VgpuState<'n> {
    pub fn read(config: Option<&'n str>, state: Option<&str>) -> Self {
        VgpuState {
            config,
            state: ConfigState::parse(state),
        }
    }

    /// `config` is on the node and the vGPU Device Manager created its devices.
    pub fn confirmed(&self, config: &str) -> bool {
        self.config == Some(config) && self.state == Some(ConfigState::Success)
    }

    /// The vGPU Device Manager failed on `config`, or (`stuck`) stayed pending past the timeout.
    pub fn failed(&self, config: &str, stuck: bool) -> bool {
        self.config == Some(config)
            && match self.state {
                Some(ConfigState::Failed) => true,
                Some(ConfigState::Pending) => stuck,
                _ => false,
            }
    }
}

/// The workload the GPU Operator runs on a node (`nvidia.com/gpu.workload.config`, with
/// `sandboxWorkloads.enabled`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Workload {
    Container,
    VmPassthrough,
    VmVgpu,
    /// Another `vm-` value: a VM workload this operator does not configure.
    OtherVm,
    /// A value the GPU Operator does not know (it then uses `defaultWorkload`).
    Unrecognised,
}

impl Workload {
    pub fn parse(value: Option<&str>) -> Option<Self> {
        Some(match value? {
            "container" => Workload::Container,
            "vm-passthrough" => Workload::VmPassthrough,
            "vm-vgpu" => Workload::VmVgpu,
            v if v.starts_with("vm-") => Workload::OtherVm,
            _ => Workload::Unrecognised,
        })
    }

    /// Runs VMs: the sandbox stack instead of the container one.
    pub fn is_vm(self) -> bool {
        matches!(
            self,
            Workload::VmPassthrough | Workload::VmVgpu | Workload::OtherVm
        )
    }
}

/// What GPU Feature Discovery reports on a node, as far as confirming a config goes.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GfdReport<'n> {
    /// `nvidia.com/gfd.timestamp`: when it last labelled the node (unix seconds).
    pub timestamp: Option<i64>,
    /// `nvidia.com/gpu.replicas`, as written.
    pub replicas: Option<&'n str>,
    /// `nvidia.com/mig-<profile>.replicas` (the `mixed` strategy): label key and value.
    pub mig_replicas: Vec<(&'n str, &'n str)>,
}

impl<'n> GfdReport<'n> {
    /// From a node's labels.
    pub fn read(labels: impl IntoIterator<Item = (&'n str, &'n str)>) -> Self {
        let mut r = GfdReport::default();
        for (k, v) in labels {
            if k == LABEL_GFD_TIMESTAMP {
                r.timestamp = v.parse().ok();
            } else if k == LABEL_GPU_REPLICAS {
                r.replicas = Some(v);
            } else if k.starts_with("nvidia.com/mig-") && k.ends_with(".replicas") {
                r.mig_replicas.push((k, v));
            }
        }
        r
    }
}

/// A per-node operand switch of the GPU Operator (`nvidia.com/gpu.deploy.<operand>`): only
/// `false` keeps the operand off the node.
pub fn deployed(value: Option<&str>) -> bool {
    value != Some("false")
}

/// The value of a per-node operand switch that keeps the operand off.
pub const NOT_DEPLOYED: &str = "false";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn states_read_as_the_managers_write_them() {
        assert_eq!(ConfigState::parse(None), None);
        for s in [
            ConfigState::Pending,
            ConfigState::Rebooting,
            ConfigState::Success,
            ConfigState::Failed,
        ] {
            assert_eq!(ConfigState::parse(Some(s.label_value())), Some(s));
        }
        assert_eq!(
            ConfigState::parse(Some("done")),
            Some(ConfigState::Unrecognised)
        );
        let m = MigState::read(Some("all-1g.10gb"), Some("pending"));
        assert!(!m.confirmed("all-1g.10gb") && !m.failed(false) && m.failed(true));
        let r = MigState::read(Some("all-1g.10gb"), Some("rebooting"));
        assert!(
            !r.confirmed("all-1g.10gb") && !r.failed(true),
            "rebooting is not stuck"
        );
        assert!(MigState::read(None, None).off("all-disabled"));
        assert!(MigState::read(Some("all-disabled"), None).off("all-disabled"));
        assert!(!MigState::read(Some("all-disabled"), Some("pending")).off("all-disabled"));
        let v = VgpuState::read(Some("A100-1-5C"), Some("failed"));
        assert!(v.failed("A100-1-5C", false) && !v.failed("A100-2-10C", false));
        assert_eq!(Workload::parse(Some("vm-vgpu")), Some(Workload::VmVgpu));
        assert!(Workload::parse(Some("vm-other")).unwrap().is_vm());
        assert!(!Workload::parse(Some("container")).unwrap().is_vm());
        assert!(deployed(None) && deployed(Some("true")) && !deployed(Some(NOT_DEPLOYED)));
        let gfd = GfdReport::read([
            ("nvidia.com/gfd.timestamp", "1800000000"),
            ("nvidia.com/gpu.replicas", "0"),
            ("nvidia.com/mig-1g.10gb.replicas", "2"),
            ("nvidia.com/mig-1g.10gb.count", "7"),
        ]);
        assert_eq!(gfd.timestamp, Some(1_800_000_000));
        assert_eq!(gfd.replicas, Some("0"));
        assert_eq!(gfd.mig_replicas, [("nvidia.com/mig-1g.10gb.replicas", "2")]);
    }
}
