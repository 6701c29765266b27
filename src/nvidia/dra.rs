//! The DRA backend: policies rendered as `resource.k8s.io/v1` ResourceClaimTemplates whose
//! opaque config is a `resource.nvidia.com/v1beta1` GpuConfig for NVIDIA's DRA driver
//! (`gpu.nvidia.com`).
//!
//! The driver's validating webhook is off by default, so a bad GpuConfig surfaces only when a
//! pod starts; everything the driver (v0.5.0) would refuse is refused here instead.

use serde_json::{Value, json};

use crate::api::crd::{GpuSharingPolicySpec, Strategy};

pub const DRIVER: &str = "gpu.nvidia.com";
pub const DEVICE_CLASS: &str = "gpu.nvidia.com";
pub const GPU_CONFIG_API: &str = "resource.nvidia.com/v1beta1";
pub const REQUEST: &str = "gpu";

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
                crate::api::names::MANAGED_BY.0: crate::api::names::MANAGED_BY.1,
                crate::api::names::LABEL_POLICY: policy,
            },
        },
        "spec": {"spec": {"devices": devices}},
    })
}
