//! Validation of the DRA backend's settings: everything NVIDIA's DRA driver (v0.5.0) would
//! refuse (its validating webhook is off by default, so a bad GpuConfig would surface only when
//! a pod starts) is refused here instead.

use crate::api::crd::{Backend, GpuSharingPolicySpec, Strategy};
use crate::nvidia::dra::quantity_bytes;

use super::FieldError;

fn err(path: impl Into<String>, message: impl Into<String>) -> FieldError {
    FieldError {
        path: path.into(),
        message: message.into(),
    }
}

fn is_device_ref(k: &str) -> bool {
    (!k.is_empty() && k.bytes().all(|b| b.is_ascii_digit()))
        || (k.starts_with("GPU-") && k.len() > 4)
}

/// Checks a DRA policy against what the driver accepts. Node-independent.
pub fn validate(
    spec: &GpuSharingPolicySpec,
    errs: &mut Vec<FieldError>,
    warnings: &mut Vec<String>,
) {
    let Some(dra) = &spec.dra else {
        if spec.backend == Backend::Dra {
            errs.push(err("spec.dra", "required when backend is dra"));
        }
        return;
    };
    if spec.backend != Backend::Dra {
        errs.push(err("spec.dra", "must not be set unless backend is dra"));
        return;
    }
    if spec.strategy == Strategy::Mig && !dra.extended_resources {
        errs.push(err(
            "spec.strategy",
            "backend dra serves MIG only with dra.extendedResources (pods keep asking for nvidia.com/mig-<profile>); with ResourceClaimTemplates MIG goes through the device plugin",
        ));
    }
    if dra.extended_resources {
        check_extended(spec, dra, errs, warnings);
        return;
    }
    check_namespaces(&dra.namespaces, errs);
    check_gates(spec, &dra.driver_feature_gates, errs);
    if let Some(m) = &dra.mps {
        check_mps(spec, m, errs, warnings);
    }
    if let Some(ts) = &spec.time_slicing
        && (ts.rename_by_default || ts.fail_requests_greater_than_one || !ts.resources.is_empty())
    {
        warnings.push(
            "spec.timeSlicing renameByDefault, failRequestsGreaterThanOne and resources are device-plugin settings; the DRA driver ignores them".into(),
        );
    }
    if spec.mps.as_ref().is_some_and(|m| m.rename_by_default) {
        warnings.push(
            "spec.mps.renameByDefault is a device-plugin setting; the DRA driver ignores it".into(),
        );
    }
}

/// `extendedResources`: pods keep their `nvidia.com/gpu` requests and the driver's consumable
/// shares do the sharing, so there is no template (no namespaces, name or MPS settings), MPS
/// cannot be prepared, and time-slicing is one replicas value for every GPU.
fn check_extended(
    spec: &GpuSharingPolicySpec,
    dra: &crate::api::crd::Dra,
    errs: &mut Vec<FieldError>,
    warnings: &mut Vec<String>,
) {
    if !dra.namespaces.is_empty() || dra.template_name.is_some() || dra.mps.is_some() {
        errs.push(err(
            "spec.dra",
            "with extendedResources pods keep their nvidia.com/gpu requests and get no ResourceClaimTemplate: namespaces, templateName and mps do not apply",
        ));
    }
    let gates = &dra.driver_feature_gates;
    match spec.strategy {
        Strategy::Mps => errs.push(err(
            "spec.strategy",
            "MPS cannot be served through DRA extended resources: the DRA driver cannot prepare an MPS claim while consumable shares are on; use extendedResources: false (ResourceClaimTemplates) or backend: devicePlugin",
        )),
        Strategy::TimeSlicing => {
            if spec.time_slicing.as_ref().is_some_and(|t| !t.resources.is_empty()) {
                errs.push(err(
                    "spec.timeSlicing.resources",
                    "with dra.extendedResources, time-slicing takes one replicas value for every GPU (the DRA driver's consumable shares): timeSlicing.resources does not apply",
                ));
            }
            if !gates.consumable_shares {
                errs.push(err(
                    "spec.dra.driverFeatureGates.ConsumableShares",
                    "time-slicing through extended resources is the DRA driver's consumable shares: run the driver with its ConsumableShares feature gate and consumableShares set to timeSlicing.replicas, and say so here",
                ));
            }
            if spec.time_slicing.as_ref().is_some_and(|t| t.fail_requests_greater_than_one) {
                warnings.push("spec.timeSlicing.failRequestsGreaterThanOne is a device-plugin setting; under the DRA driver a pod asking for 2 may get 2 shares of one GPU".into());
            }
        }
        Strategy::Mig => check_extended_mig(spec, errs),
        Strategy::Exclusive if gates.consumable_shares => errs.push(err(
            "spec.dra.driverFeatureGates.ConsumableShares",
            "exclusive GPUs need the DRA driver's consumable shares off (consumableShares: disabled): under shares each pod's claim takes one share and GPUs would be shared",
        )),
        _ => {}
    }
}

/// MIG through extended resources: one DeviceClass per profile (`mixed`), the layout fixed (no
/// demand-driven layouts), and MIG devices not time-sliced: NVIDIA's DRA driver (v0.5.0)
/// publishes a MIG device's multiprocessors, engines and memory slices without a request
/// policy, so each claim takes the whole device whatever `consumableShares` says (kube-scheduler
/// 1.36 binds one pod per MIG device under shares 4, `tests/e2e_dra_migration.rs`).
fn check_extended_mig(spec: &GpuSharingPolicySpec, errs: &mut Vec<FieldError>) {
    let Some(mig) = &spec.mig else { return };
    if mig.mig_strategy != crate::api::crd::MigStrategy::Mixed {
        errs.push(err(
            "spec.mig.migStrategy",
            "MIG through dra.extendedResources needs migStrategy: mixed: pods ask for nvidia.com/mig-<profile>, each mapped by its own DeviceClass (under single a MIG device and a whole GPU share one name)",
        ));
    }
    if mig.dynamic.is_some() {
        errs.push(err(
            "spec.mig.dynamic",
            "demand-driven layouts go through the device plugin: through dra.extendedResources the layout is fixed",
        ));
    }
    if mig.time_slicing.is_some() {
        errs.push(err("spec.mig.timeSlicing", MIG_NOT_SHARED));
    }
    if spec
        .dra
        .as_ref()
        .is_some_and(|d| d.driver_feature_gates.dynamic_mig)
    {
        errs.push(err(
            "spec.dra.driverFeatureGates.DynamicMIG",
            "the MIG manager applies this policy's layout: with its DynamicMIG gate the DRA driver makes MIG devices itself and publishes the GPUs whole beside them",
        ));
    }
}

/// Why MIG devices cannot be time-sliced through DRA extended resources.
pub const MIG_NOT_SHARED: &str = "MIG devices cannot be time-sliced through dra.extendedResources: NVIDIA's DRA driver publishes a MIG device's multiprocessors, engines and memory slices without a request policy, so each pod's claim takes the whole device whatever consumableShares says; time-slice MIG devices through the device plugin (backend: devicePlugin)";

/// Namespaces the templates go to: valid names, each once.
fn check_namespaces(namespaces: &[String], errs: &mut Vec<FieldError>) {
    if namespaces.is_empty() {
        errs.push(err("spec.dra.namespaces", "list at least one namespace"));
    }
    let mut seen = std::collections::BTreeSet::new();
    for (i, n) in namespaces.iter().enumerate() {
        let ok = !n.is_empty()
            && n.len() <= 63
            && n.bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
            && !n.starts_with('-')
            && !n.ends_with('-');
        if !ok {
            errs.push(err(
                format!("spec.dra.namespaces[{i}]"),
                format!("{n:?} is not a namespace name"),
            ));
        }
        if !seen.insert(n) {
            errs.push(err(
                format!("spec.dra.namespaces[{i}]"),
                format!("{n:?} is listed twice"),
            ));
        }
    }
}

/// What the driver's feature gates allow for the strategy.
fn check_gates(
    spec: &GpuSharingPolicySpec,
    gates: &crate::api::crd::DraFeatureGates,
    errs: &mut Vec<FieldError>,
) {
    match spec.strategy {
        Strategy::TimeSlicing if !gates.time_slicing_settings => errs.push(err(
            "spec.dra.driverFeatureGates.TimeSlicingSettings",
            "the DRA driver rejects strategy TimeSlicing unless its TimeSlicingSettings feature gate is enabled (alpha, off by default)",
        )),
        Strategy::Mps => {
            if !gates.mps_support {
                errs.push(err(
                    "spec.dra.driverFeatureGates.MPSSupport",
                    "the DRA driver rejects strategy MPS unless its MPSSupport feature gate is enabled (alpha, off by default)",
                ));
            }
            if gates.mps_support && gates.dynamic_mig {
                errs.push(err(
                    "spec.dra.driverFeatureGates",
                    "MPSSupport cannot be enabled together with DynamicMIG in the DRA driver",
                ));
            }
            if gates.consumable_shares {
                errs.push(err(
                    "spec.dra.driverFeatureGates.ConsumableShares",
                    "MPS claims cannot be prepared while ConsumableShares is enabled in a non-disabled mode",
                ));
            }
        }
        _ => {}
    }
}

/// The MPS limits: thread share 0..100, memory quantities of at least 1Mi, device keys the
/// template's one-GPU claim can have.
fn check_mps(
    spec: &GpuSharingPolicySpec,
    m: &crate::api::crd::DraMps,
    errs: &mut Vec<FieldError>,
    warnings: &mut Vec<String>,
) {
    if spec.strategy != Strategy::Mps {
        errs.push(err("spec.dra.mps", "only with strategy mps"));
    }
    if let Some(t) = m.default_active_thread_percentage
        && !(0..=100).contains(&t)
    {
        errs.push(err(
            "spec.dra.mps.defaultActiveThreadPercentage",
            format!("must be 0..100, got {t}"),
        ));
    }
    let check_q = |path: String, q: &str, errs: &mut Vec<FieldError>| match quantity_bytes(q) {
        None => errs.push(err(
            path,
            format!("{q:?} is not a memory quantity such as 10Gi"),
        )),
        Some(b) if b < 1 << 20 => errs.push(err(
            path,
            format!("{q} is below the driver's minimum of 1Mi"),
        )),
        _ => {}
    };
    if let Some(q) = &m.default_pinned_device_memory_limit {
        check_q(
            "spec.dra.mps.defaultPinnedDeviceMemoryLimit".into(),
            q,
            errs,
        );
    }
    for (k, q) in &m.per_device_pinned_memory_limits {
        if !is_device_ref(k) {
            errs.push(err(
                format!("spec.dra.mps.perDevicePinnedMemoryLimits[{k:?}]"),
                "the template's claim holds exactly one GPU: the only device index is \"0\" (or use that GPU's UUID)",
            ));
        } else if k.starts_with("GPU-") {
            warnings.push(format!(
                "spec.dra.mps.perDevicePinnedMemoryLimits[{k:?}]: a GPU UUID key makes claims from this template fail on every other GPU"
            ));
        }
        check_q(
            format!("spec.dra.mps.perDevicePinnedMemoryLimits[{k:?}]"),
            q,
            errs,
        );
    }
}
