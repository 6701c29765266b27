//! Policies before nodes: validation, what each renders to ([`Prepared`], its [`Backing`]), and
//! precedence. Which policy governs which node is `assign`'s; what each node runs, `targets`';
//! which busy nodes a change may drain, `disruption`'s.

use std::collections::{BTreeMap, BTreeSet};

use crate::api::crd::{GpuSharingPolicy, GpuSharingPolicySpec};
use crate::api::names::ANNOTATION_REAPPLY_MIG;
use crate::nvidia::{self, DEFAULT_KEY, MIG_DISABLED_LAYOUT};
use crate::validate::{self, FieldError};

use super::backing::{Backing, Kind, MigBacking, VmBacking};

/// A policy after validation, with what it renders to. The whole of it is the version its
/// nodes' memos are keyed on (see `memo`).
#[derive(Debug)]
pub struct Prepared<'a> {
    pub name: String,
    pub policy: &'a GpuSharingPolicy,
    pub spec: &'a GpuSharingPolicySpec,
    pub errors: Vec<FieldError>,
    pub warnings: Vec<String>,
    /// Device-plugin config key (`<policy>-<hash>`, or `default` for DRA); `None` if invalid.
    pub key: Option<String>,
    /// The config text behind `key`.
    pub config_text: Option<String>,
    /// The backend and what it renders to; `None` if invalid.
    pub backing: Option<Backing>,
    /// Why the policy is refused cluster-wide (it conflicts with the cluster's MIG strategy).
    pub blocked: Option<String>,
    /// A blocked policy whose nodes are released (back to exclusive) rather than held: MPS under
    /// a cluster-wide `mixed`, which NVIDIA's device plugin refuses to run.
    pub release_when_blocked: bool,
    /// The same conflict for a policy that governs no node yet: a warning only.
    pub latent: Option<String>,
    /// Why its nodes cannot start to move yet, cluster-wide: an extended-resource policy whose
    /// DeviceClass is not seen mapping its name (see `backend::dra::extended_conflicts`).
    pub waiting: Option<String>,
}

impl Prepared<'_> {
    /// A MIG policy's layout (through the device plugin, or before its nodes move to the DRA
    /// driver).
    pub fn mig(&self) -> Option<&MigBacking> {
        match &self.backing {
            Some(Backing::Mig(m)) => Some(m),
            Some(Backing::Dra(d)) => d.mig.as_ref(),
            _ => None,
        }
    }

    /// Which backend serves its nodes.
    pub fn kind(&self) -> Kind {
        Kind::of(self.spec)
    }

    /// A DRA policy served through extended resources: its name and shares.
    pub fn extended(&self) -> Option<&super::backing::ExtendedResource> {
        match &self.backing {
            Some(Backing::Dra(d)) => d.extended.as_ref(),
            _ => None,
        }
    }

    /// A VM policy's sandbox configuration.
    pub fn vm(&self) -> Option<&VmBacking> {
        match &self.backing {
            Some(Backing::Vm(v)) => Some(v),
            _ => None,
        }
    }

    /// Valid and not refused cluster-wide: its nodes may be changed.
    pub fn accepted(&self) -> bool {
        self.errors.is_empty() && self.blocked.is_none()
    }

    /// `disruption.mode: drain`: nodes are drained for changes that need idle GPUs.
    pub fn drains(&self) -> bool {
        self.spec
            .disruption
            .as_ref()
            .is_some_and(|d| d.mode == crate::api::crd::DisruptionMode::Drain)
    }

    /// The admin asked to re-apply named layouts whose content changed.
    pub fn reapply_requested(&self) -> bool {
        self.policy
            .metadata
            .annotations
            .as_ref()
            .is_some_and(|a| a.contains_key(ANNOTATION_REAPPLY_MIG))
    }
}

fn field_error(path: &str, message: String) -> FieldError {
    FieldError {
        path: path.into(),
        message,
    }
}

/// Whether a named layout may be in a dynamic catalogue: in the mig-parted config, with MIG
/// enabled on every GPU it configures. `Err` says why not.
pub fn check_layout(
    layout: &str,
    base: Option<&BTreeMap<String, serde_json::Value>>,
) -> Result<(), String> {
    if layout == MIG_DISABLED_LAYOUT {
        return Err("all-disabled switches MIG mode off".into());
    }
    let Some(base) = base else {
        return Ok(());
    };
    let Some(entries) = base.get(layout).and_then(|e| e.as_array()) else {
        return Err(format!(
            "{layout:?} is not a layout of the mig-parted configuration"
        ));
    };
    if entries
        .iter()
        .any(|e| e.get("mig-enabled").and_then(|m| m.as_bool()) != Some(true))
    {
        return Err(format!(
            "{layout:?} turns MIG mode off on some GPUs; switching MIG mode needs a GPU reset, which the catalogue never asks for"
        ));
    }
    Ok(())
}

/// Deterministic precedence: priority (high first), then oldest, then name.
fn precedence(p: &GpuSharingPolicy) -> (std::cmp::Reverse<i32>, bool, String, String) {
    let ts = p
        .metadata
        .creation_timestamp
        .as_ref()
        .map(|t| t.0.to_string());
    (
        // Reversed, not negated: `-i32::MIN` overflows.
        std::cmp::Reverse(p.spec.priority),
        ts.is_none(),
        ts.unwrap_or_default(),
        p.metadata.name.clone().unwrap_or_default(),
    )
}

fn prepare<'a>(
    p: &'a GpuSharingPolicy,
    base: Option<&BTreeMap<String, serde_json::Value>>,
) -> Prepared<'a> {
    let name = p.metadata.name.clone().unwrap_or_default();
    let (mut errors, warnings) = validate::validate(&name, &p.spec);
    if errors.is_empty() {
        errors.extend(super::geometry::pinned_errors(&p.spec));
    }
    let backing = errors
        .is_empty()
        .then(|| backing(&name, &p.spec, base, &mut errors));
    let backing = backing.filter(|_| errors.is_empty());
    let (key, config_text) = match &backing {
        // The DRA driver shares the GPUs, or virtual machines get them: the device plugin, if
        // it runs, must not share.
        Some(Backing::Dra(_) | Backing::Vm(_)) => (Some(DEFAULT_KEY.to_string()), None),
        Some(_) => {
            let text = nvidia::device_plugin_yaml(&nvidia::device_plugin_config(&p.spec));
            (Some(nvidia::content_key(&name, &text)), Some(text))
        }
        None => (None, None),
    };
    Prepared {
        name,
        policy: p,
        spec: &p.spec,
        errors,
        warnings,
        key,
        config_text,
        backing,
        blocked: None,
        release_when_blocked: false,
        waiting: None,
        latent: None,
    }
}

/// The backend of a valid policy; a named MIG layout the mig-parted config lacks is an error.
fn backing(
    name: &str,
    spec: &GpuSharingPolicySpec,
    base: Option<&BTreeMap<String, serde_json::Value>>,
    errors: &mut Vec<FieldError>,
) -> Backing {
    match Kind::of(spec) {
        Kind::Dra => dra_backing(name, spec, base, errors),
        Kind::Sharing => Backing::Sharing,
        Kind::Vm => vm_backing(name, spec),
        Kind::Mig => mig_backing(name, spec, base, errors),
    }
}

/// A DRA policy's backing; under MIG (extended resources), its layout as the MIG backend's, and
/// the profiles pods ask for: every GPU the layout configures must have MIG on (a GPU with MIG
/// off would be served whole, under a name the policy does not map).
fn dra_backing(
    name: &str,
    spec: &GpuSharingPolicySpec,
    base: Option<&BTreeMap<String, serde_json::Value>>,
    errors: &mut Vec<FieldError>,
) -> Backing {
    let mig = match (spec.strategy == crate::api::crd::Strategy::Mig)
        .then(|| mig_backing(name, spec, base, errors))
    {
        Some(Backing::Mig(m)) => Some(m),
        _ => None,
    };
    let profiles = match &mig {
        Some(m) if errors.is_empty() => layout_profiles(m, base).unwrap_or_else(|why| {
            let path = match m.custom {
                Some(_) => "spec.mig.customLayout",
                None => "spec.mig.layout",
            };
            errors.push(field_error(path, why));
            BTreeSet::new()
        }),
        _ => BTreeSet::new(),
    };
    Backing::Dra(super::backing::DraBacking::of(spec, mig, &profiles))
}

/// The MIG profiles of a layout served through DRA extended resources; `Err` says why it cannot
/// be: a GPU with MIG off, or a named layout whose content is unknown.
fn layout_profiles(
    m: &MigBacking,
    base: Option<&BTreeMap<String, serde_json::Value>>,
) -> Result<BTreeSet<String>, String> {
    let entries: Vec<nvidia::MigConfigEntry> = match &m.custom {
        Some((entries, _)) => entries.clone(),
        None => {
            let named = base.and_then(|b| b.get(&m.layout)).ok_or_else(|| {
                format!(
                    "the profiles of layout {:?} are unknown until the GPU Operator's mig-parted configuration can be read: each needs its DeviceClass",
                    m.layout
                )
            })?;
            serde_json::from_value(named.clone())
                .map_err(|e| format!("layout {:?} cannot be read: {e}", m.layout))?
        }
    };
    if entries.iter().any(|e| !e.mig_enabled) {
        return Err(format!(
            "layout {:?} turns MIG off on some GPUs: through DRA extended resources every GPU of a MIG policy must have MIG on (a GPU with MIG off would be served whole, under a name the policy does not map)",
            m.layout
        ));
    }
    let profiles: BTreeSet<String> = entries
        .iter()
        .flat_map(|e| e.mig_devices.iter().flatten())
        .map(|(p, _)| p.clone())
        .collect();
    // `+me`, `+gfx`, `-me`: the capacity model counts them under their base profile, so their
    // devices could not be confirmed nor counted for an overlay.
    if let Some(p) = profiles.iter().find(|p| p.contains(['+', '-'])) {
        return Err(format!(
            "layout {:?} has profile {p}: MIG profiles with media or graphics extensions are not served through DRA extended resources by this operator",
            m.layout
        ));
    }
    Ok(profiles)
}

/// A VM policy's sandbox configuration: its workload and vGPU layout.
fn vm_backing(name: &str, spec: &GpuSharingPolicySpec) -> Backing {
    let mut vm = VmBacking {
        workload: spec.strategy.workload(),
        vgpu_config: None,
        vgpu_custom: None,
        vgpu_entries: Vec::new(),
        vgpu_board_gb: BTreeMap::new(),
    };
    if let Some(v) = &spec.vgpu {
        if v.custom_layout.is_some() {
            let entries = nvidia::vgpu::custom_entries(v);
            let hash = nvidia::content_hash(&serde_json::to_value(&entries).expect("serializable"));
            vm.vgpu_config = Some(nvidia::vgpu::custom_name(name, &entries));
            vm.vgpu_entries = entries.clone();
            vm.vgpu_custom = Some((entries, hash));
        } else {
            vm.vgpu_config = v.type_.clone();
        }
    }
    Backing::Vm(vm)
}

/// A MIG policy's layout; a named layout the mig-parted config lacks is an error.
fn mig_backing(
    name: &str,
    spec: &GpuSharingPolicySpec,
    base: Option<&BTreeMap<String, serde_json::Value>>,
    errors: &mut Vec<FieldError>,
) -> Backing {
    let Some(mig) = &spec.mig else {
        return Backing::Sharing;
    };
    if let Some(d) = &mig.dynamic {
        for (i, l) in d.layouts.iter().enumerate() {
            if let Err(why) = check_layout(l, base) {
                errors.push(field_error(&format!("spec.mig.dynamic.layouts[{i}]"), why));
            }
        }
    }
    if mig.custom_layout.is_some() {
        let entries = nvidia::custom_layout_entries(mig);
        let hash = nvidia::content_hash(&serde_json::to_value(&entries).expect("serializable"));
        let layout = nvidia::custom_layout_name(name, &entries);
        return Backing::Mig(MigBacking {
            layout,
            custom: Some((entries, hash)),
        });
    }
    let l = mig.layout.clone().unwrap_or_default();
    let known = l == MIG_DISABLED_LAYOUT || base.is_some_and(|b| b.contains_key(&l));
    if base.is_some() && !known {
        errors.push(field_error(
            "spec.mig.layout",
            format!("{l:?} is not a layout of the mig-parted configuration (the MIG manager would fail with: selected mig-config not present)"),
        ));
    }
    Backing::Mig(MigBacking {
        layout: l,
        custom: None,
    })
}

/// A named vGPU type must be an entry of the vGPU Device Manager's config (NVIDIA's default
/// names one per type); unknown names would leave the node `failed`.
pub fn check_vgpu_types(prepared: &mut [Prepared], base: &BTreeMap<String, serde_json::Value>) {
    for p in prepared.iter_mut().filter(|p| p.errors.is_empty()) {
        let Some(Backing::Vm(vm)) = &mut p.backing else {
            continue;
        };
        if let Some(t) = p.spec.vgpu.as_ref().and_then(|v| v.type_.as_ref()) {
            if let Some(entries) = base.get(t).and_then(nvidia::vgpu::entries_of) {
                vm.vgpu_entries = entries;
            } else {
                p.errors.push(field_error(
                    "spec.vgpu.type",
                    format!("{t:?} is not an entry of the vGPU Device Manager's config (NVIDIA's default names one per vGPU type, e.g. A100-1-5C, L4-6Q); the vGPU Device Manager would fail with: config not present"),
                ));
                p.key = None;
                p.backing = None;
                continue;
            }
        }
        let families: BTreeSet<String> = vm
            .vgpu_entries
            .iter()
            .flat_map(|e| e.vgpu_devices.keys())
            .filter_map(|t| nvidia::vgpu::parse_vgpu_type(t))
            .map(|t| t.family)
            .collect();
        for f in families {
            if let Some(gb) = nvidia::vgpu::board_gb(base, &f) {
                vm.vgpu_board_gb.insert(f, gb);
            }
        }
    }
}

/// Every policy not being deleted, validated and in precedence order, with the errors that
/// depend on other policies (two DRA policies rendering one template) or on the GPU Operator's
/// config (named layouts next to a custom one need its default config).
pub fn prepare_all<'a>(
    policies: &'a [GpuSharingPolicy],
    base: Option<&BTreeMap<String, serde_json::Value>>,
) -> Vec<Prepared<'a>> {
    let mut sorted: Vec<&GpuSharingPolicy> = policies
        .iter()
        .filter(|p| p.metadata.deletion_timestamp.is_none())
        .collect();
    sorted.sort_by_key(|p| precedence(p));
    let mut prepared: Vec<Prepared> = sorted.iter().map(|p| prepare(p, base)).collect();
    let mut template_owner: BTreeMap<String, String> = BTreeMap::new();
    for p in prepared.iter_mut().filter(|p| p.errors.is_empty()) {
        let Some(dra) = &p.spec.dra else { continue };
        let name = nvidia::dra::template_name(&p.name, p.spec);
        for ns in &dra.namespaces {
            let id = format!("{ns}/{name}");
            if let Some(first) = template_owner.get(&id) {
                p.errors.push(field_error(
                    "spec.dra",
                    format!("ResourceClaimTemplate {id} is already rendered by policy {first}"),
                ));
            } else {
                template_owner.insert(id, p.name.clone());
            }
        }
        if !p.errors.is_empty() {
            p.key = None;
        }
    }
    // A custom layout points the MIG manager at our ConfigMap; named layouts must then be in it,
    // which needs the GPU Operator's default config.
    let any_custom = prepared
        .iter()
        .any(|p| p.errors.is_empty() && p.mig().is_some_and(|m| m.custom.is_some()));
    if any_custom && base.is_none() {
        for p in prepared.iter_mut().filter(|p| p.errors.is_empty()) {
            if let Some(l) = p.spec.mig.as_ref().and_then(|m| m.layout.as_ref())
                && l != MIG_DISABLED_LAYOUT
            {
                p.errors.push(field_error(
                    "spec.mig.layout",
                    format!("{l:?} cannot be served: a custom layout replaces the MIG manager's config with ours, and the GPU Operator's default-mig-parted-config (whose named layouts we would carry over) was not found"),
                ));
                p.key = None;
                p.config_text = None;
            }
        }
    }
    prepared
}
