//! Validation of a policy spec that does not depend on nodes.
//!
//! The CRD's schema and CEL rules reject most of this at admission; this module checks the same
//! rules (and a few CEL cannot express, such as disjoint device groups) so that `render` without
//! a cluster, and the controller for objects created before a rule existed, give the same clear
//! error. Every rule NVIDIA's parsers enforce is here, so nothing we render is rejected by them.

use std::collections::BTreeSet;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;

use crate::api::crd::{
    GpuSharingPolicySpec, MAX_POLICY_NAME, Mig, MigStrategy, Strategy, TimeSlicing,
};
use crate::nvidia::mig::{MAX_COMPUTE_SLICES, MPS_MAX_REPLICAS, parse_mig_profile};
use crate::nvidia::{self, GPU_RESOURCE};

pub mod dra;
pub mod vgpu;

/// One problem with a policy, with the field it concerns.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{path}: {message}")]
pub struct FieldError {
    pub path: String,
    pub message: String,
}

fn err(path: impl Into<String>, message: impl Into<String>) -> FieldError {
    FieldError {
        path: path.into(),
        message: message.into(),
    }
}

fn is_dns_label_ish(s: &str, allow_dot: bool) -> bool {
    let ok_char = |c: char| {
        c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || (allow_dot && c == '.')
    };
    !s.is_empty()
        && s.chars().all(ok_char)
        && s.chars().next().is_some_and(|c| c.is_ascii_alphanumeric())
        && s.chars().last().is_some_and(|c| c.is_ascii_alphanumeric())
}

/// Checks a resource name as NVIDIA's parser does: lower-case RFC 1123 under `nvidia.com/`,
/// the part after the prefix at most 63 characters.
pub fn check_resource_name(name: &str) -> Result<(), String> {
    let q = nvidia::qualify_resource(name);
    let Some(rest) = q.strip_prefix("nvidia.com/") else {
        return Err(format!("resource name {name:?} must be under nvidia.com/"));
    };
    if q.len() > 63 {
        return Err(format!("resource name {q:?} is longer than 63 characters"));
    }
    if !is_dns_label_ish(rest, true) {
        return Err(format!(
            "resource name {name:?} is not lower-case RFC 1123 (letters, digits, '-' and '.', starting and ending with a letter or digit)"
        ));
    }
    Ok(())
}

/// Whether `s` is a valid label value (what a node label can carry).
pub fn is_label_value(s: &str) -> bool {
    s.len() <= 63
        && (s.is_empty()
            || (s
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
                && s.chars().next().is_some_and(|c| c.is_ascii_alphanumeric())
                && s.chars().last().is_some_and(|c| c.is_ascii_alphanumeric())))
}

fn check_selector(sel: &LabelSelector, errs: &mut Vec<FieldError>) {
    let keys = sel
        .match_labels
        .iter()
        .flatten()
        .map(|(k, _)| ("matchLabels", k))
        .chain(
            sel.match_expressions
                .iter()
                .flatten()
                .map(|e| ("matchExpressions", &e.key)),
        );
    for (field, k) in keys {
        if crate::api::names::UNSTABLE_LABELS.contains(&k.as_str()) {
            errs.push(err(
                format!("spec.nodeSelector.{field}"),
                format!("{k} changes when sharing is applied (set by this operator or by GPU Feature Discovery); selecting on it would make nodes flap between policies"),
            ));
        }
    }
    for (i, e) in sel.match_expressions.iter().flatten().enumerate() {
        let path = format!("spec.nodeSelector.matchExpressions[{i}]");
        let n = e.values.as_ref().map_or(0, |v| v.len());
        match e.operator.as_str() {
            "In" | "NotIn" if n == 0 => errs.push(err(
                format!("{path}.values"),
                format!("operator {} needs at least one value", e.operator),
            )),
            "Exists" | "DoesNotExist" if n > 0 => errs.push(err(
                format!("{path}.values"),
                format!("operator {} takes no values", e.operator),
            )),
            "In" | "NotIn" | "Exists" | "DoesNotExist" => {}
            other => errs.push(err(
                format!("{path}.operator"),
                format!("unknown operator {other:?} (In, NotIn, Exists, DoesNotExist)"),
            )),
        }
    }
}

fn check_time_slicing(
    ts: &TimeSlicing,
    path: &str,
    errs: &mut Vec<FieldError>,
    warnings: &mut Vec<String>,
) {
    if ts.replicas.is_none() && ts.resources.is_empty() {
        errs.push(err(
            path,
            "set replicas, or at least one entry in resources",
        ));
    }
    if let Some(r) = ts.replicas
        && r < 2
    {
        errs.push(err(
            format!("{path}.replicas"),
            format!("must be >= 2, got {r} (NVIDIA: number of replicas must be >= 2; for no sharing use strategy exclusive)"),
        ));
    }
    let mut seen = BTreeSet::new();
    for (i, r) in ts.resources.iter().enumerate() {
        let rp = format!("{path}.resources[{i}]");
        if r.name.is_empty() {
            errs.push(err(format!("{rp}.name"), "no resource name specified"));
        } else if let Err(m) = check_resource_name(&r.name) {
            errs.push(err(format!("{rp}.name"), m));
        }
        if r.replicas < 2 {
            errs.push(err(
                format!("{rp}.replicas"),
                format!(
                    "must be >= 2, got {} (NVIDIA: number of replicas must be >= 2)",
                    r.replicas
                ),
            ));
        }
        if !seen.insert(nvidia::qualify_resource(&r.name)) {
            errs.push(err(
                format!("{rp}.name"),
                format!("duplicate resource {:?}: the device plugin and GPU Feature Discovery would disagree", r.name),
            ));
        }
        if let Some(rename) = &r.rename {
            if let Err(m) = check_resource_name(rename) {
                errs.push(err(format!("{rp}.rename"), m));
            }
            warnings.push(format!(
                "{rp}.rename is accepted by the NVIDIA device plugin but ignored at runtime: {} is advertised under its own name",
                r.name
            ));
        }
        if let Some(devs) = &r.devices {
            for (j, d) in devs.iter().enumerate() {
                let s = d.as_str();
                let index = |x: &str| !x.is_empty() && x.bytes().all(|b| b.is_ascii_digit());
                let ok = index(s)
                    || s.split_once(':').is_some_and(|(a, b)| index(a) && index(b))
                    || ((s.starts_with("GPU-") || s.starts_with("MIG-")) && s.len() > 4);
                if !ok {
                    errs.push(err(
                        format!("{rp}.devices[{j}]"),
                        format!("{s:?} is not a device index (\"0\"), MIG index (\"0:1\") or GPU-/MIG- UUID"),
                    ));
                }
            }
            warnings.push(format!(
                "{rp}.devices is accepted by the NVIDIA device plugin but ignored at runtime: every device of {} is replicated",
                r.name
            ));
        }
    }
}

/// `extended`: served through DRA extended resources, where MIG time-slicing is refused on its
/// own (`dra::MIG_NOT_SHARED`): the device plugin's checks of its resources would only add
/// advice that cannot help.
fn check_mig(mig: &Mig, extended: bool, errs: &mut Vec<FieldError>, warnings: &mut Vec<String>) {
    match (&mig.layout, &mig.custom_layout) {
        (Some(_), Some(_)) | (None, None) => errs.push(err(
            "spec.mig",
            "set exactly one of layout (a named mig-parted layout) and customLayout",
        )),
        _ => {}
    }
    if let Some(l) = &mig.layout
        && (l.is_empty() || !is_label_value(l))
    {
        errs.push(err(
            "spec.mig.layout",
            format!("{l:?} is not a valid label value (it is written to the node label nvidia.com/mig.config)"),
        ));
    }
    if let Some(groups) = &mig.custom_layout {
        check_custom_layout(groups, errs);
    }
    if mig.mig_strategy == MigStrategy::Single {
        check_single_strategy(mig, errs);
    }
    match &mig.time_slicing {
        Some(ts) if extended => check_time_slicing(ts, "spec.mig.timeSlicing", errs, warnings),
        Some(ts) => check_mig_time_slicing(mig, ts, errs, warnings),
        None => {}
    }
}

/// A custom layout's device groups: disjoint, covering GPUs 0..15, profiles that fit a GPU.
fn check_custom_layout(groups: &[crate::api::crd::MigDeviceGroup], errs: &mut Vec<FieldError>) {
    if groups.is_empty() {
        errs.push(err(
            "spec.mig.customLayout",
            "needs at least one device group",
        ));
    }
    let mut used: BTreeSet<i32> = BTreeSet::new();
    let all_groups = groups.iter().filter(|g| g.indices().is_none()).count();
    if all_groups > 0 && groups.len() > 1 {
        errs.push(err(
            "spec.mig.customLayout",
            "a group with `devices: all` (or without devices) covers all GPUs, so it must be the only group",
        ));
    }
    for (i, g) in groups.iter().enumerate() {
        check_group(i, g, &mut used, errs);
    }
}

/// The error for a `devices` value that is neither `all` nor a list of GPU indices (the schema
/// cannot refuse it: see [`crate::api::crd::GpuSelection`]).
pub(crate) fn invalid_devices(v: &serde_json::Value) -> String {
    let mut got = v.to_string();
    if got.len() > MAX_SHOWN {
        let cut = (0..=MAX_SHOWN)
            .rev()
            .find(|i| got.is_char_boundary(*i))
            .unwrap_or(0);
        got.truncate(cut);
        got.push_str("...");
    }
    format!(
        "must be `all` or a list of GPU indices (0-15), as NVIDIA's configs write it; got {got}"
    )
}

/// The most of a refused value a message shows.
const MAX_SHOWN: usize = 64;

/// One device group of a custom layout (`used`: GPUs already in earlier groups).
fn check_group(
    i: usize,
    g: &crate::api::crd::MigDeviceGroup,
    used: &mut BTreeSet<i32>,
    errs: &mut Vec<FieldError>,
) {
    let gp = format!("spec.mig.customLayout[{i}]");
    if let Some(crate::api::crd::GpuSelection::Invalid(v)) = &g.devices {
        errs.push(err(format!("{gp}.devices"), invalid_devices(v)));
    } else if let Some(devs) = g.indices() {
        if devs.is_empty() {
            errs.push(err(
                format!("{gp}.devices"),
                "list at least one GPU index, or write `devices: all`",
            ));
        }
        for d in devs {
            if !(0..=15).contains(d) {
                errs.push(err(
                    format!("{gp}.devices"),
                    format!("GPU index {d} is out of range 0..15"),
                ));
            } else if !used.insert(*d) {
                errs.push(err(
                    format!("{gp}.devices"),
                    format!("GPU {d} appears in more than one group"),
                ));
            }
        }
    }
    if g.mig_enabled && g.mig_devices.is_empty() {
        errs.push(err(
            format!("{gp}.migDevices"),
            "required when migEnabled is true (mig-parted: missing required field 'mig-devices' when 'mig-enabled' is true)",
        ));
    }
    if !g.mig_enabled && !g.mig_devices.is_empty() {
        errs.push(err(
            format!("{gp}.migDevices"),
            "must be empty when migEnabled is false (mig-parted: MIG devices included when 'mig-enabled' is false)",
        ));
    }
    let mut slices = 0;
    for (p, c) in &g.mig_devices {
        match parse_mig_profile(p) {
            None => errs.push(err(
                format!("{gp}.migDevices[{p:?}]"),
                "not a MIG profile name (expected [Nc.]Ng.NNgb[+me|+me.all|+gfx|-me], e.g. 1g.10gb)",
            )),
            Some(prof) => slices += prof.slices as i32 * c,
        }
        if !(1..=7).contains(c) {
            errs.push(err(
                format!("{gp}.migDevices[{p:?}]"),
                format!("count {c} is out of range 1..7 (mig-parted rejects a count of 0)"),
            ));
        }
    }
    if slices > MAX_COMPUTE_SLICES {
        errs.push(err(
            format!("{gp}.migDevices"),
            format!("the profiles need {slices} GPU slices per GPU, more than the {MAX_COMPUTE_SLICES} a GPU has"),
        ));
    }
}

/// The device plugin's single strategy needs every GPU in MIG mode with one profile.
fn check_single_strategy(mig: &Mig, errs: &mut Vec<FieldError>) {
    if let Some(groups) = &mig.custom_layout {
        let profiles: BTreeSet<&String> =
            groups.iter().flat_map(|g| g.mig_devices.keys()).collect();
        if groups.iter().any(|g| !g.mig_enabled) {
            errs.push(err(
                "spec.mig.customLayout",
                "migStrategy single needs MIG enabled on every GPU (device plugin: all devices on the node must be configured with the same migEnabled value); use mixed",
            ));
        } else if profiles.len() > 1 {
            errs.push(err(
                "spec.mig.customLayout",
                "migStrategy single allows one MIG profile per node (device plugin: more than one MIG device type present on node); use mixed",
            ));
        }
    } else if let Some(l) = &mig.layout
        && l != "all-disabled"
        && nvidia::layout_profiles(mig).is_none_or(|p| p.len() > 1)
    {
        errs.push(err(
            "spec.mig.layout",
            format!("migStrategy single allows one MIG profile per node, and layout {l:?} may create several; use mixed"),
        ));
    }
}

/// Time-slicing of MIG devices: resources this layout really offers, under the strategy's names.
fn check_mig_time_slicing(
    mig: &Mig,
    ts: &TimeSlicing,
    errs: &mut Vec<FieldError>,
    warnings: &mut Vec<String>,
) {
    check_time_slicing(ts, "spec.mig.timeSlicing", errs, warnings);
    if mig.mig_strategy == MigStrategy::Mixed
        && let Some(profiles) = nvidia::layout_profiles(mig)
    {
        let offered: BTreeSet<String> = nvidia::time_sliced_profiles(mig)
            .iter()
            .map(|p| nvidia::mig_resource(p))
            .collect();
        // A catalogue layout whose profiles depend on the GPU model (`all-balanced`) may offer
        // any: its resources cannot be checked here.
        let unknown = mig
            .dynamic
            .iter()
            .flat_map(|d| &d.layouts)
            .any(|l| nvidia::layout_profiles(&mig.with_layout(l)).is_none_or(|p| p.is_empty()));
        for (i, r) in ts.resources.iter().enumerate().filter(|_| !unknown) {
            let q = nvidia::qualify_resource(&r.name);
            if q != GPU_RESOURCE && !offered.contains(&q) {
                errs.push(err(
                    format!("spec.mig.timeSlicing.resources[{i}].name"),
                    format!(
                        "{} is not created by this layout (it offers {}): time-slicing it would do nothing",
                        r.name,
                        offered.iter().cloned().collect::<Vec<_>>().join(", ")
                    ),
                ));
            }
        }
        if ts.resources.is_empty()
            && profiles
                .iter()
                .any(|p| parse_mig_profile(p).is_some_and(|x| x.compute.is_some()))
        {
            errs.push(err(
                "spec.mig.timeSlicing",
                "compute-instance profiles (Nc.Ng.NNgb) are not advertised as resources by the device plugin: name the resources to time-slice",
            ));
        }
    }
    match mig.mig_strategy {
        MigStrategy::Single => {
            for (i, r) in ts.resources.iter().enumerate() {
                if nvidia::qualify_resource(&r.name) != GPU_RESOURCE {
                    errs.push(err(
                        format!("spec.mig.timeSlicing.resources[{i}].name"),
                        format!("with migStrategy single MIG devices are advertised as {GPU_RESOURCE}, not {}", r.name),
                    ));
                }
            }
        }
        MigStrategy::Mixed => {
            if ts.resources.is_empty() {
                match nvidia::layout_profiles(mig) {
                    Some(p) if !p.is_empty() => {}
                    _ => errs.push(err(
                        "spec.mig.timeSlicing.resources",
                        format!(
                            "required with migStrategy mixed for layout {:?}: its MIG profiles depend on the GPU model, so name the nvidia.com/mig-<profile> resources to time-slice",
                            mig.layout.as_deref().unwrap_or("")
                        ),
                    )),
                }
                let catalogue = mig
                    .dynamic
                    .iter()
                    .flat_map(|d| d.layouts.iter().enumerate());
                for (i, l) in catalogue {
                    if nvidia::layout_profiles(&mig.with_layout(l)).is_none_or(|p| p.is_empty()) {
                        errs.push(err(
                            format!("spec.mig.dynamic.layouts[{i}]"),
                            format!("with mig.timeSlicing and no resources, demand's layouts must name their MIG profile (all-<profile>): {l:?} may create several, depending on the GPU model; name the nvidia.com/mig-<profile> resources to time-slice in spec.mig.timeSlicing.resources"),
                        ));
                    }
                }
            }
        }
    }
}

/// Validates a policy; returns the errors, and warnings about settings that have no effect.
pub fn validate(name: &str, spec: &GpuSharingPolicySpec) -> (Vec<FieldError>, Vec<String>) {
    let mut errs = Vec::new();
    let mut warnings = Vec::new();
    if name.len() > MAX_POLICY_NAME {
        errs.push(err(
            "metadata.name",
            format!("must be at most {MAX_POLICY_NAME} characters (the config key <name>-<hash> is a node label value)"),
        ));
    }
    if !is_dns_label_ish(name, false) {
        errs.push(err(
            "metadata.name",
            "must consist of lower-case letters, digits and '-'",
        ));
    }
    check_selector(&spec.node_selector, &mut errs);
    let blocks = [
        (
            Strategy::TimeSlicing,
            "timeSlicing",
            spec.time_slicing.is_some(),
        ),
        (Strategy::Mps, "mps", spec.mps.is_some()),
        (Strategy::Mig, "mig", spec.mig.is_some()),
    ];
    for (s, field, present) in blocks {
        if spec.strategy == s && !present {
            errs.push(err(
                format!("spec.{field}"),
                format!("required when strategy is {}", s.as_str()),
            ));
        }
        if spec.strategy != s && present {
            let extra = if spec.strategy == Strategy::Mps && s == Strategy::Mig {
                " (MPS cannot be combined with MIG)"
            } else {
                ""
            };
            errs.push(err(
                format!("spec.{field}"),
                format!(
                    "must not be set when strategy is {}{extra}",
                    spec.strategy.as_str()
                ),
            ));
        }
    }
    if let Some(ts) = &spec.time_slicing {
        check_time_slicing(ts, "spec.timeSlicing", &mut errs, &mut warnings);
    }
    if let Some(mps) = &spec.mps
        && !(2..=MPS_MAX_REPLICAS).contains(&mps.replicas)
    {
        errs.push(err(
            "spec.mps.replicas",
            format!("must be between 2 and {MPS_MAX_REPLICAS} (16 on GPUs below compute capability 7.5), got {}", mps.replicas),
        ));
    }
    if let Some(mig) = &spec.mig {
        let extended = spec.dra.as_ref().is_some_and(|d| d.extended_resources);
        check_mig(mig, extended, &mut errs, &mut warnings);
    }
    dra::validate(spec, &mut errs, &mut warnings);
    vgpu::validate(spec, &mut errs);
    (errs, warnings)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resource_names() {
        assert!(check_resource_name("nvidia.com/gpu").is_ok());
        assert!(check_resource_name("gpu").is_ok());
        assert!(check_resource_name("nvidia.com/mig-1g.10gb").is_ok());
        assert!(check_resource_name("nvidia.com/GPU").is_err());
        assert!(check_resource_name("amd.com/gpu").is_err());
        assert!(check_resource_name(&format!("nvidia.com/{}", "a".repeat(53))).is_err());
        assert!(check_resource_name(&format!("nvidia.com/{}", "a".repeat(52))).is_ok());
    }

    #[test]
    fn label_values() {
        assert!(is_label_value("all-1g.10gb"));
        assert!(is_label_value(""));
        assert!(!is_label_value("-x"));
        assert!(!is_label_value(&"a".repeat(64)));
    }

    /// `devices: all` is a group for all GPUs, like a group without devices: alone it is
    /// valid, next to another group it is refused, naming the field.
    #[test]
    fn time_slicing_a_dynamic_policy_covers_its_catalogue() {
        let spec = |layouts: &str, ts: &str| -> GpuSharingPolicySpec {
            crate::api::yaml::from_str(&format!(
                "{{nodeSelector: {{}}, strategy: mig, mig: {{migStrategy: mixed, layout: all-1g.10gb, timeSlicing: {ts}, dynamic: {{layouts: {layouts}}}}}}}"
            ))
            .unwrap()
        };
        // Layouts named after their profile: shared without naming them.
        let (errs, _) = validate("p", &spec("[all-3g.40gb]", "{replicas: 2}"));
        assert!(errs.is_empty(), "{errs:?}");
        let c = crate::nvidia::device_plugin_config(&spec("[all-3g.40gb]", "{replicas: 2}"));
        let shared: Vec<String> = c
            .sharing
            .unwrap()
            .time_slicing
            .unwrap()
            .resources
            .into_iter()
            .map(|r| r.name)
            .collect();
        assert_eq!(shared, ["nvidia.com/mig-1g.10gb", "nvidia.com/mig-3g.40gb"]);
        // A layout whose profiles depend on the GPU model: name the resources.
        let (errs, _) = validate("p", &spec("[all-3g.40gb, all-balanced]", "{replicas: 2}"));
        assert_eq!(errs.len(), 1, "{errs:?}");
        assert_eq!(errs[0].path, "spec.mig.dynamic.layouts[1]");
        let named = "{resources: [{name: nvidia.com/mig-2g.20gb, replicas: 2}]}";
        let (errs, _) = validate("p", &spec("[all-balanced]", named));
        assert!(errs.is_empty(), "{errs:?}");
    }

    #[test]
    fn devices_all_covers_every_gpu() {
        let spec = |groups: &str| -> GpuSharingPolicySpec {
            crate::api::yaml::from_str(&format!(
                "{{nodeSelector: {{}}, strategy: mig, mig: {{migStrategy: mixed, customLayout: {groups}}}}}"
            ))
            .unwrap()
        };
        let (errs, _) = validate(
            "p",
            &spec("[{devices: all, migEnabled: true, migDevices: {1g.10gb: 7}}]"),
        );
        assert!(errs.is_empty(), "{errs:?}");
        let (errs, _) = validate(
            "p",
            &spec(
                "[{devices: all, migEnabled: true, migDevices: {1g.10gb: 7}}, {devices: [0], migEnabled: false}]",
            ),
        );
        let text = format!("{errs:?}");
        assert!(
            text.contains("spec.mig.customLayout") && text.contains("`devices: all`"),
            "{text}"
        );
        let (errs, _) = validate("p", &spec("[{devices: [0, 0], migEnabled: false}]"));
        assert!(
            format!("{errs:?}").contains("spec.mig.customLayout[0].devices"),
            "{errs:?}"
        );
        // A refused value is shown cut short.
        let deep: serde_json::Value =
            serde_json::from_str(&format!("{}1{}", "[".repeat(100), "]".repeat(100))).unwrap();
        let msg = invalid_devices(&deep);
        assert!(msg.len() < 200 && msg.ends_with("[[[..."), "{msg}");
        // What the schema cannot refuse (see GpuSelection) is refused here, naming the field.
        let (errs, _) = validate("p", &spec("[{devices: any, migEnabled: false}]"));
        assert_eq!(errs.len(), 1, "{errs:?}");
        assert_eq!(errs[0].path, "spec.mig.customLayout[0].devices");
        assert!(
            errs[0].message.ends_with("got \"any\""),
            "{}",
            errs[0].message
        );
    }
}
