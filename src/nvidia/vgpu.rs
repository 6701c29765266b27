//! NVIDIA's vGPU Device Manager config (`api/spec/v1`): `version: v1`, `vgpu-configs: {<name>:
//! [{devices: all | [indices], device-filter?: ..., vgpu-devices: {<vGPU type>: count}}]}`, and
//! the vGPU type grammar (`A10-12Q`, `A100-1-5C`, `H200-1-18CME`).

use std::collections::BTreeMap;
use std::sync::{Arc, LazyLock};

use serde::{Deserialize, Serialize};

use crate::api::crd::Vgpu;

use super::{AllDevices, MigDevices, content_addressed_name};

/// Key of the vGPU-devices config in its ConfigMap.
pub const VGPU_KEY: &str = "config.yaml";

/// NVIDIA's default vGPU-devices ConfigMap (`default-vgpu-devices-config`) as the GPU Operator
/// ships it, embedded so that `render` can check named types without a cluster; kept
/// byte-identical to the Go module's copy by `tests/nvidia/conformance.sh`.
pub const DEFAULT_VGPU_CONFIGMAP: &str =
    include_str!("../../assets/gpu-operator/default-vgpu-devices-config.yaml");
/// Where [`DEFAULT_VGPU_CONFIGMAP`] comes from.
pub const DEFAULT_VGPU_SOURCE: &str = "GPU Operator main after v25.3.4 (Go module github.com/NVIDIA/gpu-operator v0.0.0-20250917190837-d73a0086a6ba, assets/state-vgpu-device-manager/0500_configmap.yaml)";

/// One entry of a vGPU config.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
pub struct VgpuConfigEntry {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device_filter: Option<serde_json::Value>,
    pub devices: MigDevices,
    pub vgpu_devices: BTreeMap<String, i32>,
}

/// A parsed vGPU type name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VgpuType {
    /// The GPU family, e.g. `A100D`, `L4`, `RTX6000-Ada`.
    pub family: String,
    /// GPU instances of a MIG-backed type (0: time-sliced).
    pub gpu_instances: u32,
    /// Framebuffer in GB (0 means 512 MB).
    pub framebuffer_gb: u32,
    /// Series letter: A, B, C or Q.
    pub series: char,
}

impl VgpuType {
    /// Framebuffer in MiB (the name's GB are GiB; `0` is 512 MiB).
    pub fn framebuffer_mib(&self) -> i64 {
        if self.framebuffer_gb == 0 {
            512
        } else {
            i64::from(self.framebuffer_gb) * 1024
        }
    }
}

fn number(s: &str) -> Option<u32> {
    let ok =
        !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()) && (s == "0" || !s.starts_with('0'));
    ok.then(|| s.parse().ok()).flatten()
}

/// `<GB><series>` with the series one of A, B, C, Q, and for MIG-backed types an optional
/// attribute after it.
fn framebuffer_and_series(s: &str, mig: bool) -> Option<(u32, char)> {
    let digits = s.bytes().take_while(u8::is_ascii_digit).count();
    let (gb, rest) = s.split_at(digits);
    let mut chars = rest.chars();
    let series = chars.next().filter(|c| "ABCQ".contains(*c))?;
    let attr = chars.as_str();
    let attr_ok = attr.is_empty() || mig && ["ME", "NOME", "MEALL", "GFX"].contains(&attr);
    attr_ok.then_some((number(gb)?, series))
}

/// Parses a vGPU type name as NVIDIA's vGPU Device Manager does: time-sliced
/// `<GPU>-<GB><series>` (the GPU part may carry `-<letters>` words, `RTX6000-Ada`) or MIG-backed
/// `<GPU>-<instances>-<GB><series>[ME|NOME|MEALL|GFX]`.
pub fn parse_vgpu_type(s: &str) -> Option<VgpuType> {
    let upper_alnum = |p: &str| {
        !p.is_empty()
            && p.bytes()
                .all(|b| b.is_ascii_uppercase() || b.is_ascii_digit())
    };
    let parts: Vec<&str> = s.split('-').collect();
    if parts.len() == 3
        && upper_alnum(parts[0])
        && parts[1].len() == 1
        && (b'1'..=b'9').contains(&parts[1].as_bytes()[0])
        && let Some((gb, series)) = framebuffer_and_series(parts[2], true)
    {
        return Some(VgpuType {
            family: parts[0].to_string(),
            gpu_instances: u32::from(parts[1].as_bytes()[0] - b'0'),
            framebuffer_gb: gb,
            series,
        });
    }
    let (last, gpu) = parts.split_last()?;
    let words_ok = gpu.len() >= 2
        && gpu[1..]
            .iter()
            .all(|w| !w.is_empty() && w.bytes().all(|b| b.is_ascii_alphabetic()));
    if gpu.is_empty() || !upper_alnum(gpu[0]) || gpu.len() > 1 && !words_ok {
        return None;
    }
    let (gb, series) = framebuffer_and_series(last, false)?;
    Some(VgpuType {
        family: gpu.join("-"),
        gpu_instances: 0,
        framebuffer_gb: gb,
        series,
    })
}

/// vGPU-devices entries of a custom layout.
pub fn custom_entries(v: &Vgpu) -> Vec<VgpuConfigEntry> {
    v.custom_layout
        .iter()
        .flatten()
        .map(|g| VgpuConfigEntry {
            device_filter: None,
            devices: match g.indices() {
                None => MigDevices::All(AllDevices::All),
                Some(d) => MigDevices::Indices(d.to_vec()),
            },
            vgpu_devices: g.vgpu_devices.clone(),
        })
        .collect()
}

/// Content-addressed name of a policy's custom vGPU layout (`custom-<policy>-<hash>`): the vGPU
/// Device Manager acts only when `nvidia.com/vgpu.config` changes value.
pub fn custom_name(policy: &str, entries: &[VgpuConfigEntry]) -> String {
    content_addressed_name(policy, serde_json::to_value(entries).expect("serializable"))
}

/// The vGPU-devices config: the named entries we were given (NVIDIA's, so named types keep
/// working) and our custom layouts.
pub fn vgpu_config(
    base: &BTreeMap<String, serde_json::Value>,
    custom: &BTreeMap<String, Vec<VgpuConfigEntry>>,
) -> serde_json::Value {
    let mut configs: serde_json::Map<String, serde_json::Value> =
        base.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
    for (k, v) in custom {
        configs.insert(k.clone(), serde_json::to_value(v).expect("serializable"));
    }
    serde_json::json!({"version": "v1", "vgpu-configs": configs})
}

/// The named entries of a vGPU-devices config text.
pub fn parse_vgpu_configs(
    text: &str,
) -> Result<BTreeMap<String, serde_json::Value>, serde_saphyr::Error> {
    #[derive(Deserialize)]
    struct Doc {
        #[serde(rename = "vgpu-configs", default)]
        vgpu_configs: BTreeMap<String, serde_json::Value>,
    }
    thread_local!(static LAST: super::Memo = super::Memo::default());
    LAST.with(|m| {
        m.get_or_parse(text, || {
            let d: Doc = crate::api::yaml::from_str(text)?;
            Ok(d.vgpu_configs)
        })
    })
}

/// The named entries of a vGPU-devices config given as a ConfigMap (its `config.yaml`) or as
/// the config itself.
pub fn vgpu_configs_of_document(
    text: &str,
) -> Result<BTreeMap<String, serde_json::Value>, serde_saphyr::Error> {
    let v: serde_json::Value = crate::api::yaml::from_str(text)?;
    match v
        .get("data")
        .and_then(|d| d.get(VGPU_KEY))
        .and_then(|c| c.as_str())
    {
        Some(inner) => parse_vgpu_configs(inner),
        None => parse_vgpu_configs(text),
    }
}

/// NVIDIA's default named entries ([`DEFAULT_VGPU_CONFIGMAP`]), parsed once.
pub fn default_vgpu_configs() -> Arc<BTreeMap<String, serde_json::Value>> {
    static PARSED: LazyLock<Arc<BTreeMap<String, serde_json::Value>>> = LazyLock::new(|| {
        Arc::new(
            vgpu_configs_of_document(DEFAULT_VGPU_CONFIGMAP).expect("the embedded default parses"),
        )
    });
    PARSED.clone()
}

/// The entries of a named config (`None` if it is not a list of entries).
pub fn entries_of(v: &serde_json::Value) -> Option<Vec<VgpuConfigEntry>> {
    serde_json::from_value(v.clone()).ok()
}

/// The GPU model a GFD product label names (`NVIDIA-A100-SXM4-80GB` -> `A100`, `NVIDIA-L4` ->
/// `L4`, `NVIDIA-H200-NVL` -> `H200`).
pub fn product_model(product: &str) -> Option<&str> {
    let p = product.strip_prefix("NVIDIA-").unwrap_or(product);
    let model = p.split('-').next()?;
    (!model.is_empty()).then_some(model)
}

/// Why a vGPU type cannot run on a GPU of this product, where the names tell: the type's family
/// must be the GPU's model with NVIDIA's variant letters (`D` marks the 80 GB A100/A800 and the
/// 32 GB V100 types; `X`, `L`, `M`, `S` board variants).
pub fn family_mismatch(t: &str, product: &str) -> Option<String> {
    let vt = parse_vgpu_type(t)?;
    let model = product_model(product)?;
    let variant = vt.family.strip_prefix(model);
    let ok = variant.is_some_and(|v| v.chars().all(|c| "DXLMS".contains(c)));
    if !ok && !vt.family.starts_with("DC") {
        return Some(format!(
            "vGPU type {t} is for {} GPUs, not {product}",
            vt.family
        ));
    }
    let large = product.contains("80GB") || product.contains("32GB");
    let d_variant = variant.is_some_and(|v| v.contains('D'));
    if ["A100", "A800", "V100"].contains(&model) && d_variant != large {
        let (wants, size) = if d_variant {
            ("large-memory", "80 GB; 32 GB for V100")
        } else {
            ("standard", "40 GB; 16 GB for V100")
        };
        return Some(format!(
            "vGPU type {t} ({} family) is for the {wants} {model} ({size}), not {product}",
            vt.family
        ));
    }
    None
}

/// A GPU's framebuffer as vGPU types count it (nominal GB: NVIDIA's types of one family add up
/// to the board's memory, which is more than the usable MiB GPU Feature Discovery reports), from
/// NVIDIA's named configs: the most any one of them gives a GPU of that family.
pub fn board_gb(base: &BTreeMap<String, serde_json::Value>, family: &str) -> Option<u32> {
    base.values()
        .filter_map(entries_of)
        .flatten()
        .filter(|e| e.device_filter.is_none())
        .flat_map(|e| e.vgpu_devices.into_iter())
        .filter_map(|(t, c)| {
            let vt = parse_vgpu_type(&t)?;
            (vt.family == family).then(|| vt.framebuffer_gb * c.max(0) as u32)
        })
        .max()
}

/// Why one GPU cannot hold these vGPU devices: their framebuffer exceeds the board's (`board_gb`
/// nominal GB), or MIG-backed ones need more than the GPU's 7 compute slices.
pub fn group_overflow(devices: &BTreeMap<String, i32>, board_gb: u32) -> Option<String> {
    let mut gb = 0u32;
    let mut slices = 0u32;
    for (t, c) in devices {
        let vt = parse_vgpu_type(t)?;
        gb += vt.framebuffer_gb * (*c).max(0) as u32;
        slices += vt.gpu_instances * (*c).max(0) as u32;
    }
    let shown: Vec<String> = devices.iter().map(|(t, c)| format!("{c} x {t}")).collect();
    if gb > board_gb {
        Some(format!(
            "{} need {gb} GB of framebuffer per GPU, the GPU has {board_gb} GB",
            shown.join(", ")
        ))
    } else if slices > crate::nvidia::mig::MAX_COMPUTE_SLICES as u32 {
        Some(format!(
            "{} need {slices} MIG compute slices per GPU, a GPU has {}",
            shown.join(", "),
            crate::nvidia::mig::MAX_COMPUTE_SLICES
        ))
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vgpu_types_parse_as_nvidia_names_them() {
        let t = parse_vgpu_type("A100-1-5C").unwrap();
        assert_eq!(
            (
                t.family.as_str(),
                t.gpu_instances,
                t.framebuffer_gb,
                t.series
            ),
            ("A100", 1, 5, 'C')
        );
        let t = parse_vgpu_type("H200-1-18CME").unwrap();
        assert_eq!((t.gpu_instances, t.framebuffer_gb), (1, 18));
        let t = parse_vgpu_type("RTX6000-Ada-4Q").unwrap();
        assert_eq!((t.family.as_str(), t.framebuffer_gb), ("RTX6000-Ada", 4));
        let t = parse_vgpu_type("M60-0Q").unwrap();
        assert_eq!(t.framebuffer_mib(), 512);
        assert_eq!(
            parse_vgpu_type("L4-24Q").unwrap().framebuffer_mib(),
            24 * 1024
        );
        for bad in [
            "",
            "A100",
            "a100-4C",
            "A100-4X",
            "A100-04C",
            "A100-0-5C",
            "A100-4CME",
            "A100--4C",
        ] {
            assert_eq!(parse_vgpu_type(bad), None, "{bad}");
        }
    }

    #[test]
    fn every_type_of_nvidias_default_config_parses() {
        let base = default_vgpu_configs();
        assert!(base.len() > 500, "{} entries", base.len());
        for (name, v) in base.iter() {
            let entries = entries_of(v).unwrap_or_else(|| panic!("{name}"));
            for e in entries {
                for t in e.vgpu_devices.keys() {
                    assert!(parse_vgpu_type(t).is_some(), "{name}: {t}");
                }
            }
        }
    }

    #[test]
    fn types_that_cannot_run_on_the_gpu_are_named() {
        let a100_80 = "NVIDIA-A100-SXM4-80GB";
        let a100_40 = "NVIDIA-A100-PCIE-40GB";
        assert_eq!(family_mismatch("A100D-1-10C", a100_80), None);
        assert_eq!(family_mismatch("A100DX-40C", a100_80), None);
        assert!(family_mismatch("A100D-1-10C", a100_40).is_some());
        assert!(family_mismatch("A100-1-5C", a100_80).is_some());
        assert!(family_mismatch("L4-6Q", a100_80).unwrap().contains("L4"));
        assert_eq!(family_mismatch("L4-6Q", "NVIDIA-L4"), None);
        assert_eq!(family_mismatch("H200-1-18C", "NVIDIA-H200"), None);

        let base = default_vgpu_configs();
        assert_eq!(board_gb(&base, "L4"), Some(24));
        assert_eq!(board_gb(&base, "A100D"), Some(80));
        // H200-71C: 2 is NVIDIA's own entry: the nominal sizes round up.
        assert_eq!(board_gb(&base, "H200"), Some(142));
        let group = |pairs: &[(&str, i32)]| -> BTreeMap<String, i32> {
            pairs.iter().map(|(t, c)| (t.to_string(), *c)).collect()
        };
        assert_eq!(
            group_overflow(&group(&[("L4-6Q", 4)]), 24),
            None,
            "NVIDIA's own L4-6Q entry"
        );
        let m = group_overflow(&group(&[("L4-12Q", 4)]), 24).unwrap();
        assert!(m.contains("48 GB"), "{m}");
        assert_eq!(
            group_overflow(&group(&[("A100D-1-10C", 4), ("A100D-3-40C", 1)]), 80),
            None
        );
        let m = group_overflow(&group(&[("A100D-1-10C", 2), ("A100D-3-40C", 2)]), 200).unwrap();
        assert!(m.contains("8 MIG compute slices"), "{m}");
    }
}
