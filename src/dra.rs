//! The DRA backend: policies rendered as `resource.k8s.io/v1` ResourceClaimTemplates whose
//! opaque config is a `resource.nvidia.com/v1beta1` GpuConfig for NVIDIA's DRA driver
//! (`gpu.nvidia.com`).
//!
//! The driver's validating webhook is off by default, so a bad GpuConfig surfaces only when a
//! pod starts; everything the driver (v0.5.0) would refuse is refused here instead.

use serde_json::{Value, json};

use crate::crd::{Backend, GpuSharingPolicySpec, Strategy};
use crate::validate::FieldError;

pub const DRIVER: &str = "gpu.nvidia.com";
pub const DEVICE_CLASS: &str = "gpu.nvidia.com";
pub const GPU_CONFIG_API: &str = "resource.nvidia.com/v1beta1";
pub const REQUEST: &str = "gpu";

fn err(path: impl Into<String>, message: impl Into<String>) -> FieldError {
    FieldError {
        path: path.into(),
        message: message.into(),
    }
}

/// Bytes of a memory quantity (`10Gi`, `35942Mi`, `1.5Gi`, `1G`, `1e9`, `1048576`).
pub fn quantity_bytes(q: &str) -> Option<u128> {
    let split = q
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(q.len());
    let (num, unit) = q.split_at(split);
    if num.is_empty() || num.starts_with('.') || num.ends_with('.') || num.matches('.').count() > 1
    {
        return None;
    }
    let n: f64 = num.parse().ok()?;
    let mult: f64 = match unit {
        "" => 1.0,
        "Ki" => 1024f64,
        "Mi" => 1024f64.powi(2),
        "Gi" => 1024f64.powi(3),
        "Ti" => 1024f64.powi(4),
        "Pi" => 1024f64.powi(5),
        "Ei" => 1024f64.powi(6),
        "k" => 1e3,
        "M" => 1e6,
        "G" => 1e9,
        "T" => 1e12,
        "P" => 1e15,
        "E" => 1e18,
        u if u.starts_with(['e', 'E']) => 10f64.powi(u[1..].parse::<i32>().ok()?),
        _ => return None,
    };
    let bytes = n * mult;
    (bytes.is_finite() && (0.0..1e30).contains(&bytes)).then_some(bytes as u128)
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
    if spec.strategy == Strategy::Mig {
        errs.push(err(
            "spec.strategy",
            "backend dra supports exclusive, timeSlicing and mps; MIG sharing goes through the device plugin",
        ));
    }
    if dra.namespaces.is_empty() {
        errs.push(err("spec.dra.namespaces", "list at least one namespace"));
    }
    let mut seen = std::collections::BTreeSet::new();
    for (i, n) in dra.namespaces.iter().enumerate() {
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
    let gates = &dra.driver_feature_gates;
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
    if let Some(m) = &dra.mps {
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

/// Name of the policy's ResourceClaimTemplate.
pub fn template_name(policy: &str, spec: &GpuSharingPolicySpec) -> String {
    spec.dra
        .as_ref()
        .and_then(|d| d.template_name.clone())
        .unwrap_or_else(|| policy.to_string())
}

/// MPS limits per client (strategy mps): (thread percentage, pinned memory MiB) — explicit settings, else
/// derived from replicas like the device-plugin path (100 / replicas, memory / replicas).
pub fn mps_limits(spec: &GpuSharingPolicySpec, gpu_memory_mib: Option<i64>) -> (i64, Option<i64>) {
    let r = spec.mps.as_ref().map_or(1, |m| m.replicas as i64).max(1);
    let m = spec.dra.as_ref().and_then(|d| d.mps.as_ref());
    let threads = m
        .and_then(|m| m.default_active_thread_percentage)
        .map_or(100 / r, |t| t as i64);
    let memory = match m.and_then(|m| m.default_pinned_device_memory_limit.as_deref()) {
        Some(q) => quantity_bytes(q).map(|b| (b >> 20) as i64),
        // The driver refuses limits below 1Mi: then leave the default out.
        None => gpu_memory_mib.map(|g| g / r).filter(|m| *m >= 1),
    };
    (threads, memory)
}

/// The GpuConfig of a policy, or `None` for exclusive (a plain claim).
pub fn gpu_config(spec: &GpuSharingPolicySpec, gpu_memory_mib: Option<i64>) -> Option<Value> {
    let dra = spec.dra.as_ref()?;
    let sharing = match spec.strategy {
        Strategy::TimeSlicing => json!({
            "strategy": "TimeSlicing",
            // Always emit the interval: an empty timeSlicingConfig crashes older drivers.
            "timeSlicingConfig": {"interval": dra.time_slicing_interval},
        }),
        Strategy::Mps => {
            let (threads, memory) = mps_limits(spec, gpu_memory_mib);
            let mut mps = serde_json::Map::new();
            mps.insert("defaultActiveThreadPercentage".into(), json!(threads));
            match dra
                .mps
                .as_ref()
                .and_then(|m| m.default_pinned_device_memory_limit.clone())
            {
                Some(q) => {
                    mps.insert("defaultPinnedDeviceMemoryLimit".into(), json!(q));
                }
                None => {
                    if let Some(mib) = memory {
                        mps.insert(
                            "defaultPinnedDeviceMemoryLimit".into(),
                            json!(format!("{mib}Mi")),
                        );
                    }
                }
            }
            if let Some(m) = &dra.mps {
                if !m.per_device_pinned_memory_limits.is_empty() {
                    mps.insert(
                        "defaultPerDevicePinnedMemoryLimit".into(),
                        json!(m.per_device_pinned_memory_limits),
                    );
                }
                if m.multi_user {
                    mps.insert("multiUser".into(), json!(true));
                }
            }
            json!({"strategy": "MPS", "mpsConfig": mps})
        }
        _ => return None,
    };
    Some(json!({"apiVersion": GPU_CONFIG_API, "kind": "GpuConfig", "sharing": sharing}))
}

/// The ResourceClaimTemplate object for one namespace.
pub fn claim_template(
    policy: &str,
    namespace: &str,
    spec: &GpuSharingPolicySpec,
    gpu_memory_mib: Option<i64>,
) -> Value {
    let mut devices = json!({
        "requests": [{"name": REQUEST, "exactly": {"deviceClassName": DEVICE_CLASS}}],
    });
    if let Some(cfg) = gpu_config(spec, gpu_memory_mib) {
        devices["config"] =
            json!([{"requests": [REQUEST], "opaque": {"driver": DRIVER, "parameters": cfg}}]);
    }
    json!({
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {
            "name": template_name(policy, spec),
            "namespace": namespace,
            "labels": {
                crate::render::MANAGED_BY.0: crate::render::MANAGED_BY.1,
                crate::plan::LABEL_POLICY: policy,
            },
        },
        "spec": {"spec": {"devices": devices}},
    })
}
