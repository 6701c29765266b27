//! How a valid policy's nodes are served, one variant per backend: the device plugin sharing
//! whole GPUs, MIG through the MIG manager, virtual machines through the sandbox stack, or
//! NVIDIA's DRA driver. Each variant carries what only that backend needs (a MIG layout, vGPU
//! devices), so no backend's fields are `None` on another's policy.
//!
//! A leaf of `plan/`: the per-backend transitions (`sharing`, `mig`, `vm`, `dra`) read these
//! types; [`NodeTarget`] is what one node of a policy should end up running, chosen per node by
//! `targets::node_target`.

use std::collections::BTreeMap;

use crate::api::crd::{Backend, GpuSharingPolicySpec, Strategy};
use crate::nvidia::MigConfigEntry;
use crate::nvidia::vgpu::VgpuConfigEntry;

/// Which backend serves a policy's nodes. [`Kind::of`] is the one place a policy's spec picks
/// it: everything after reads the kind (or the [`Backing`] it carries), and each kind's logic
/// lives in its own file of `plan/backend/`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Kind {
    /// NVIDIA's device plugin shares whole GPUs: exclusive, time-slicing or MPS.
    Sharing,
    /// MIG instances through the MIG manager, through the device plugin.
    Mig,
    /// Virtual machines through the sandbox stack: passthrough or vGPU.
    Vm,
    /// NVIDIA's DRA driver (any strategy it shares by).
    Dra,
}

impl Kind {
    /// The backend `spec` asks for (valid or not).
    pub fn of(spec: &GpuSharingPolicySpec) -> Kind {
        match (spec.backend, spec.strategy) {
            (Backend::Dra, _) => Kind::Dra,
            (_, Strategy::Vgpu | Strategy::Passthrough) => Kind::Vm,
            (_, Strategy::Mig) => Kind::Mig,
            (_, Strategy::Exclusive | Strategy::TimeSlicing | Strategy::Mps) => Kind::Sharing,
        }
    }

    /// Whether NVIDIA's device plugin serves the node (a device-plugin config key applies).
    pub fn device_plugin(self) -> bool {
        matches!(self, Kind::Sharing | Kind::Mig)
    }
}

/// A valid policy's backend and what it renders to besides its device-plugin config.
#[derive(Debug, Clone, PartialEq)]
pub enum Backing {
    /// NVIDIA's device plugin serves whole GPUs: exclusive, time-slicing or MPS.
    Sharing,
    /// MIG instances through the MIG manager (optionally time-sliced by the device plugin).
    Mig(MigBacking),
    /// Virtual machines through the sandbox stack: passthrough or vGPU.
    Vm(VmBacking),
    /// NVIDIA's DRA driver shares the GPUs; the device plugin is switched off on its nodes.
    Dra(DraBacking),
}

/// A DRA policy's way of reaching pods.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct DraBacking {
    /// `dra.extendedResources`: what pods' unchanged requests are served as; `None` for
    /// ResourceClaimTemplates.
    pub extended: Option<ExtendedResource>,
    /// `strategy: mig` (extended resources only): the layout the MIG manager gives its nodes
    /// before they move, as the MIG backend renders it.
    pub mig: Option<MigBacking>,
}

impl DraBacking {
    /// How a (valid) DRA policy reaches pods: with `dra.extendedResources`, the names its pods
    /// ask for (`nvidia.com/gpu`, `.shared` under `renameByDefault`; under MIG, the names the
    /// device plugin gives the layout's `profiles`) and the shares per device (time-slicing's
    /// replicas; none for exclusive devices).
    pub fn of(
        spec: &GpuSharingPolicySpec,
        mig: Option<MigBacking>,
        profiles: &std::collections::BTreeSet<String>,
    ) -> Self {
        let extended = spec.dra.as_ref().filter(|d| d.extended_resources).map(|_| {
            let ts = spec.time_slicing.as_ref();
            let renamed = ts.is_some_and(|t| t.rename_by_default);
            // MIG devices take one claim each, whatever the driver's shares (time-slicing them
            // is refused).
            let shares = match spec.strategy {
                Strategy::TimeSlicing => ts.and_then(|t| t.replicas).map(i64::from),
                _ => None,
            };
            let names = match spec.strategy {
                Strategy::Mig => profiles
                    .iter()
                    .map(|p| crate::nvidia::mig_resource(p))
                    .collect(),
                _ if renamed => [format!("{GPU_RESOURCE}.shared")].into(),
                _ => [GPU_RESOURCE.to_string()].into(),
            };
            ExtendedResource { names, shares }
        });
        DraBacking { extended, mig }
    }
}

/// The resource NVIDIA's device plugin advertises whole GPUs as.
pub const GPU_RESOURCE: &str = "nvidia.com/gpu";

/// A policy served through DRA extended resources (KEP-5004): the names pods ask for, each
/// mapped by a DeviceClass of ours, and the consumable shares per device its nodes' DRA driver
/// must publish.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ExtendedResource {
    /// The names pods ask for, each mapped by a class of ours. Whole GPUs: `nvidia.com/gpu`, or
    /// `nvidia.com/gpu.shared` under `timeSlicing.renameByDefault`. MIG: the device plugin's
    /// name of each profile of the layout (`nvidia.com/mig-<profile>`), which the profile its
    /// class selects is read back from (`nvidia::mig_profile_of`).
    pub names: std::collections::BTreeSet<String>,
    /// Shares per GPU: time-slicing's replicas; `None` for exclusive GPUs (shares off) and for
    /// MIG devices (each takes one claim, whatever the driver's shares).
    pub shares: Option<i64>,
}

/// A MIG policy's layout.
#[derive(Debug, Clone, PartialEq)]
pub struct MigBacking {
    /// The mig-parted layout name its nodes get (named, or a custom layout's content-addressed
    /// name).
    pub layout: String,
    /// A custom layout: its mig-parted entries and their content hash.
    pub custom: Option<(Vec<MigConfigEntry>, String)>,
}

/// A VM policy's sandbox configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct VmBacking {
    /// `nvidia.com/gpu.workload.config` on its nodes (`vm-passthrough`, `vm-vgpu`).
    pub workload: &'static str,
    /// `strategy: vgpu`: the vGPU Device Manager config its nodes are labelled with
    /// (`nvidia.com/vgpu.config`): the named type, or the custom layout's content-addressed name.
    pub vgpu_config: Option<String>,
    /// A custom vGPU layout: its entries and their content hash.
    pub vgpu_custom: Option<(Vec<VgpuConfigEntry>, String)>,
    /// The vGPU devices its nodes get: the custom layout's entries, or the named config's (empty
    /// when unknown).
    pub vgpu_entries: Vec<VgpuConfigEntry>,
    /// The board framebuffer (nominal GB) of each vGPU family its layout uses, from NVIDIA's
    /// named configs.
    pub vgpu_board_gb: BTreeMap<String, u32>,
}

/// What one node of a policy should end up running (its rollout target): the device-plugin
/// config key and what the policy's backend puts on the node besides. Each backend's transition
/// takes only its own part ([`Serving`]), so no backend reads another's fields.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeTarget {
    /// The device-plugin config key (`default` under DRA and for VMs).
    pub device_config: String,
    pub serving: Serving,
}

/// What the node runs besides the device-plugin config, one variant per backend (as
/// [`Backing`], for one node: a dynamic MIG policy's layout may differ per node).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Serving {
    /// The device plugin shares whole GPUs.
    Sharing,
    /// This MIG layout, through the MIG manager.
    Mig { layout: String },
    /// A VM host for the sandbox stack.
    Vm(VmTarget),
    /// NVIDIA's DRA driver; the device plugin switched off. With extended resources, the DRA
    /// kubelet plugin switched on once the device plugin has withdrawn; under MIG, once the MIG
    /// manager has applied `layout`.
    Dra {
        extended: Option<ExtendedResource>,
        layout: Option<String>,
    },
}

/// A VM host's target: `nvidia.com/gpu.workload.config`, and for vGPU the vGPU Device
/// Manager's config (`nvidia.com/vgpu.config`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VmTarget {
    pub workload: &'static str,
    pub vgpu_config: Option<String>,
}

impl NodeTarget {
    /// The target as the rollout mark on a node records it: the config key and the MIG layout
    /// (`<key>+<layout>`), `dra`, or the VM workload and vGPU config (`vm-vgpu+<config>`).
    pub fn mark(&self) -> String {
        match &self.serving {
            Serving::Sharing => self.device_config.clone(),
            Serving::Mig { layout } => format!("{}+{layout}", self.device_config),
            Serving::Vm(VmTarget {
                workload,
                vgpu_config: Some(c),
            }) => format!("{workload}+{c}"),
            Serving::Vm(VmTarget { workload, .. }) => workload.to_string(),
            Serving::Dra { extended: None, .. } => "dra".to_string(),
            Serving::Dra {
                layout: Some(l), ..
            } => format!("dra-extended+{l}"),
            Serving::Dra { .. } => "dra-extended".to_string(),
        }
    }
}
