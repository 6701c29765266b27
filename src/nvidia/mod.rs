//! NVIDIA's configuration formats, as our own serde types, and the pure renderers that produce
//! them from policies.
//!
//! Field names are exactly the JSON names NVIDIA's parsers look for (device plugin
//! `api/config/v1`, mig-parted `api/spec/v1`): their parsers silently ignore unknown keys, so a
//! misspelt key would mean "no sharing" without any error. Each struct only has the fields we
//! emit, and the conformance test in `tests/nvidia/` parses everything we render with NVIDIA's own
//! code.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::api::crd::{GpuSharingPolicySpec, Mig, MigStrategy, Strategy, TimeSlicing};

pub mod dra;
pub mod emit;
pub mod geometry;
pub mod mig;
pub mod state;
pub mod vgpu;

/// The key of the mig-parted ConfigMap the MIG manager reads.
pub const MIG_PARTED_KEY: &str = "config.yaml";
/// The device-plugin ConfigMap key that means "no sharing"; the ClusterPolicy default.
pub const DEFAULT_KEY: &str = "default";
/// The layout that turns MIG off on every GPU.
pub const MIG_DISABLED_LAYOUT: &str = "all-disabled";
/// The resource name of full GPUs (and of MIG devices with the `single` strategy).
pub const GPU_RESOURCE: &str = "nvidia.com/gpu";

/// NVIDIA device plugin config file, `version: v1`.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct DevicePluginConfig {
    pub version: String,
    pub flags: Flags,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sharing: Option<Sharing>,
}

/// `flags`: only the MIG strategy is ours to set; everything else stays with the GPU Operator.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct Flags {
    #[serde(rename = "migStrategy")]
    pub mig_strategy: String,
}

/// `sharing`: never both sub-sections (NVIDIA silently prefers MPS).
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct Sharing {
    #[serde(
        rename = "timeSlicing",
        default,
        skip_serializing_if = "Option::is_none"
    )]
    pub time_slicing: Option<ReplicatedResources>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mps: Option<ReplicatedResources>,
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct ReplicatedResources {
    #[serde(rename = "renameByDefault")]
    pub rename_by_default: bool,
    #[serde(
        rename = "failRequestsGreaterThanOne",
        default,
        skip_serializing_if = "Option::is_none"
    )]
    pub fail_requests_greater_than_one: Option<bool>,
    pub resources: Vec<ReplicatedResource>,
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct ReplicatedResource {
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rename: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub devices: Option<Vec<String>>,
    pub replicas: i32,
}

/// mig-parted config file, `version: v1`.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct MigPartedConfig {
    pub version: String,
    #[serde(rename = "mig-configs")]
    pub mig_configs: BTreeMap<String, Vec<MigConfigEntry>>,
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct MigConfigEntry {
    pub devices: MigDevices,
    #[serde(rename = "mig-enabled")]
    pub mig_enabled: bool,
    #[serde(
        rename = "mig-devices",
        default,
        skip_serializing_if = "Option::is_none"
    )]
    pub mig_devices: Option<BTreeMap<String, i32>>,
}

/// `devices: all` or a list of indices.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(untagged)]
pub enum MigDevices {
    All(AllDevices),
    Indices(Vec<i32>),
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub enum AllDevices {
    #[serde(rename = "all")]
    All,
}

/// Adds the `nvidia.com/` prefix the way NVIDIA's parser does.
pub fn qualify_resource(name: &str) -> String {
    if name.contains('/') {
        name.to_string()
    } else {
        format!("nvidia.com/{name}")
    }
}

/// The MIG profiles a policy's MIG layout creates, when we know them: custom layouts always,
/// named layouts of the form `all-<profile>` (with the `.me`/`.gfx` suffix conventions of the
/// default mig-parted config mapped back to profile names).
pub fn layout_profiles(mig: &Mig) -> Option<Vec<String>> {
    if let Some(groups) = &mig.custom_layout {
        let mut v: Vec<String> = groups
            .iter()
            .filter(|g| g.mig_enabled)
            .flat_map(|g| {
                g.mig_devices
                    .iter()
                    .filter(|(_, c)| **c > 0)
                    .map(|(p, _)| p.clone())
            })
            .collect();
        v.sort();
        v.dedup();
        return Some(v);
    }
    let layout = mig.layout.as_deref()?;
    let rest = layout.strip_prefix("all-")?;
    if matches!(rest, "disabled" | "enabled" | "balanced") {
        return if rest == "disabled" {
            Some(vec![])
        } else {
            None
        };
    }
    // all-1g.5gb.me -> 1g.5gb+me, all-1g.24gb.me.all -> 1g.24gb+me.all, all-1g.24gb.gfx -> +gfx
    let profile = if let Some(p) = rest.strip_suffix(".me.all") {
        format!("{p}+me.all")
    } else if let Some(p) = rest.strip_suffix(".me") {
        format!("{p}+me")
    } else if let Some(p) = rest.strip_suffix(".gfx") {
        format!("{p}+gfx")
    } else {
        rest.to_string()
    };
    if mig::is_mig_profile(&profile) {
        Some(vec![profile])
    } else {
        None
    }
}

/// The resource name under which a MIG profile is advertised with the `mixed` strategy.
/// The MIG profiles `mig.timeSlicing` without `resources` shares under `mixed`: those of the
/// policy's layout and, under `mig.dynamic`, of each catalogue layout whose name gives its
/// profile (`all-<profile>`; validation refuses the others), as demand may give a node any of
/// them.
pub fn time_sliced_profiles(mig: &Mig) -> Vec<String> {
    let catalogue = mig.dynamic.iter().flat_map(|d| &d.layouts);
    let mut v: Vec<String> = layout_profiles(mig)
        .into_iter()
        .chain(catalogue.filter_map(|l| layout_profiles(&mig.with_layout(l))))
        .flatten()
        .collect();
    v.sort();
    v.dedup();
    v
}

/// The device plugin advertises `1g.10gb+me` as `nvidia.com/mig-1g.10gb.me` ('+' becomes '.').
pub fn mig_resource(profile: &str) -> String {
    format!("nvidia.com/mig-{}", profile.replace('+', "."))
}

/// The MIG profile a resource name of [`mig_resource`] advertises (`.shared` under
/// `renameByDefault` allowed): `nvidia.com/mig-1g.10gb.me` is `1g.10gb+me`. `None` for any
/// other name.
pub fn mig_profile_of(resource: &str) -> Option<String> {
    let rest = resource.strip_prefix("nvidia.com/mig-")?;
    let rest = rest.strip_suffix(".shared").unwrap_or(rest);
    // Only '+' became '.': a profile's own dots end at its memory ("gb").
    let p = match rest.split_once("gb.") {
        Some((head, tail)) => format!("{head}gb+{tail}"),
        None => rest.to_string(),
    };
    mig::parse_mig_profile(&p).is_some().then_some(p)
}

fn replicated(ts: &TimeSlicing, default_names: &[String]) -> ReplicatedResources {
    let resources = if ts.resources.is_empty() {
        let replicas = ts.replicas.unwrap_or(2);
        default_names
            .iter()
            .map(|n| ReplicatedResource {
                name: n.clone(),
                rename: None,
                devices: None,
                replicas,
            })
            .collect()
    } else {
        ts.resources
            .iter()
            .map(|r| ReplicatedResource {
                name: qualify_resource(&r.name),
                rename: r.rename.clone(),
                devices: r.devices.clone(),
                replicas: r.replicas,
            })
            .collect()
    };
    ReplicatedResources {
        rename_by_default: ts.rename_by_default,
        fail_requests_greater_than_one: Some(ts.fail_requests_greater_than_one),
        resources,
    }
}

/// The device-plugin config of one policy. Call only on a validated spec.
pub fn device_plugin_config(spec: &GpuSharingPolicySpec) -> DevicePluginConfig {
    let (mig_strategy, sharing) = match spec.strategy {
        // VM nodes run no container device plugin; should one run, it shares nothing.
        Strategy::Exclusive | Strategy::Vgpu | Strategy::Passthrough => ("none".to_string(), None),
        Strategy::TimeSlicing => {
            let ts = spec.time_slicing.clone().unwrap_or_default();
            let r = replicated(&ts, &[GPU_RESOURCE.to_string()]);
            (
                "none".to_string(),
                Some(Sharing {
                    time_slicing: Some(r),
                    mps: None,
                }),
            )
        }
        Strategy::Mps => {
            let mps = spec.mps.clone().unwrap_or_default();
            let r = ReplicatedResources {
                rename_by_default: mps.rename_by_default,
                fail_requests_greater_than_one: None,
                resources: vec![ReplicatedResource {
                    name: GPU_RESOURCE.to_string(),
                    rename: None,
                    devices: None,
                    replicas: mps.replicas,
                }],
            };
            (
                "none".to_string(),
                Some(Sharing {
                    time_slicing: None,
                    mps: Some(r),
                }),
            )
        }
        Strategy::Mig => {
            let mig = spec
                .mig
                .as_ref()
                .expect("validated: mig strategy has a mig block");
            let sharing = mig.time_slicing.as_ref().map(|ts| {
                let names = match mig.mig_strategy {
                    MigStrategy::Single => vec![GPU_RESOURCE.to_string()],
                    MigStrategy::Mixed => time_sliced_profiles(mig)
                        .iter()
                        .map(|p| mig_resource(p))
                        .collect(),
                };
                Sharing {
                    time_slicing: Some(replicated(ts, &names)),
                    mps: None,
                }
            });
            (mig.mig_strategy.as_str().to_string(), sharing)
        }
    };
    DevicePluginConfig {
        version: "v1".into(),
        flags: Flags { mig_strategy },
        sharing,
    }
}

/// The config of the `default` key: no sharing.
pub fn exclusive_config(mig_strategy: &str) -> DevicePluginConfig {
    DevicePluginConfig {
        version: "v1".into(),
        flags: Flags {
            mig_strategy: mig_strategy.to_string(),
        },
        sharing: None,
    }
}

/// YAML text of anything we write that no key is computed from (the mig-parted config).
pub fn to_yaml<T: Serialize>(v: &T) -> String {
    serde_saphyr::to_string(v).expect("our config types always serialize")
}

/// YAML text of a device-plugin config, as written into the ConfigMap and hashed into its key:
/// frozen (see [`emit`]), so upgrading the operator never changes a key.
pub fn device_plugin_yaml(c: &DevicePluginConfig) -> String {
    emit::device_plugin_yaml(c)
}

/// Content-addressed ConfigMap key: `<policy>-<first 8 hex of sha256(content)>`. New content
/// means a new key, hence a node label change, which is the only thing that makes the device
/// plugin reload its config.
pub fn content_key(policy: &str, content: &str) -> String {
    let digest = Sha256::digest(content.as_bytes());
    let hex: String = digest.iter().take(4).map(|b| format!("{b:02x}")).collect();
    format!("{policy}-{hex}")
}

/// Whether a device-plugin ConfigMap key is one of this policy's (`<policy>-<8 hex>`): the
/// parsing side of [`content_key`].
pub fn is_key_of(policy: &str, key: &str) -> bool {
    key.strip_prefix(policy)
        .and_then(|r| r.strip_prefix('-'))
        .is_some_and(|h| h.len() == 8 && h.bytes().all(|b| b.is_ascii_hexdigit()))
}

/// The name custom layouts had before they were content-addressed (`custom-<policy>`). A node
/// still labelled with it keeps it while its content equals the policy's layout, so upgrading
/// the operator does not reconfigure MIG on running nodes.
pub fn legacy_custom_layout_name(policy: &str) -> String {
    format!("custom-{policy}")
}

/// Longest label value (`nvidia.com/mig.config` names the layout).
const MAX_LABEL_VALUE: usize = 63;

/// Content-addressed mig-parted layout name of a policy's custom layout:
/// `custom-<policy>-<first 8 hex of sha256 of the layout>`. The MIG manager, like the device
/// plugin, acts only when the node label's value changes, so an edited layout must get a new
/// name to ever reach the node. A policy name too long for a label value is shortened, and the
/// hash then covers the full name too, so two policies never share a name by accident.
pub fn custom_layout_name(policy: &str, entries: &[MigConfigEntry]) -> String {
    content_addressed_name(policy, serde_json::to_value(entries).expect("serializable"))
}

/// `custom-<policy>-<first 8 hex of the content's hash>`, shortened to fit a label value (see
/// [`custom_layout_name`]).
pub fn content_addressed_name(policy: &str, content: serde_json::Value) -> String {
    let name = format!("custom-{policy}-{}", content_hash(&content));
    if name.len() <= MAX_LABEL_VALUE {
        return name;
    }
    let hash = content_hash(&serde_json::json!([policy, content]));
    let keep = MAX_LABEL_VALUE - "custom-".len() - 1 - hash.len();
    format!("custom-{}-{hash}", policy[..keep].trim_end_matches('-'))
}

/// First 8 hex digits of the sha256 of a value's canonical JSON (object keys sorted at every
/// level), so the hash depends on the content only, not on how a ConfigMap orders its keys or
/// which YAML library wrote it.
pub fn content_hash(v: &serde_json::Value) -> String {
    fn canonical(v: &serde_json::Value, out: &mut String) {
        match v {
            serde_json::Value::Object(m) => {
                let sorted: BTreeMap<&String, &serde_json::Value> = m.iter().collect();
                out.push('{');
                for (i, (k, v)) in sorted.into_iter().enumerate() {
                    if i > 0 {
                        out.push(',');
                    }
                    out.push_str(&serde_json::to_string(k).expect("string"));
                    out.push(':');
                    canonical(v, out);
                }
                out.push('}');
            }
            serde_json::Value::Array(a) => {
                out.push('[');
                for (i, v) in a.iter().enumerate() {
                    if i > 0 {
                        out.push(',');
                    }
                    canonical(v, out);
                }
                out.push(']');
            }
            other => out.push_str(&other.to_string()),
        }
    }
    let mut text = String::new();
    canonical(v, &mut text);
    let digest = Sha256::digest(text.as_bytes());
    digest.iter().take(4).map(|b| format!("{b:02x}")).collect()
}

/// mig-parted entries of a custom layout.
pub fn custom_layout_entries(mig: &Mig) -> Vec<MigConfigEntry> {
    mig.custom_layout
        .iter()
        .flatten()
        .map(|g| MigConfigEntry {
            devices: match g.indices() {
                None => MigDevices::All(AllDevices::All),
                Some(d) => MigDevices::Indices(d.to_vec()),
            },
            mig_enabled: g.mig_enabled,
            mig_devices: if g.mig_enabled {
                Some(g.mig_devices.clone())
            } else {
                None
            },
        })
        .collect()
}

/// The `all-disabled` layout, always present in our mig-parted config: it is what nodes move
/// through when they leave MIG.
pub fn disabled_layout() -> Vec<MigConfigEntry> {
    vec![MigConfigEntry {
        devices: MigDevices::All(AllDevices::All),
        mig_enabled: false,
        mig_devices: None,
    }]
}

/// The mig-parted config: the named layouts we were given (from the GPU Operator's default
/// config, so named layouts keep working), `all-disabled`, and our custom layouts.
pub fn mig_parted_config(
    base: &BTreeMap<String, serde_json::Value>,
    custom: &BTreeMap<String, Vec<MigConfigEntry>>,
) -> serde_json::Value {
    let mut configs = serde_json::Map::new();
    for (k, v) in base {
        configs.insert(k.clone(), v.clone());
    }
    configs.insert(
        MIG_DISABLED_LAYOUT.into(),
        serde_json::to_value(disabled_layout()).expect("serializable"),
    );
    for (k, v) in custom {
        configs.insert(k.clone(), serde_json::to_value(v).expect("serializable"));
    }
    serde_json::json!({"version": "v1", "mig-configs": configs})
}

/// Reads the `mig-configs` of a mig-parted config text (for example the GPU Operator's
/// `default-mig-parted-config`), keeping every layout as it is.
/// NVIDIA's default mig-parted ConfigMap (`default-mig-parted-config`) as the GPU Operator ships
/// it, embedded so that `render` can check named layouts without a cluster. Kept byte-identical
/// to the Go module's copy by `tests/nvidia/conformance.sh` (see `assets/gpu-operator/README.md`).
pub const DEFAULT_MIG_PARTED_CONFIGMAP: &str =
    include_str!("../../assets/gpu-operator/default-mig-parted-config.yaml");
/// Where [`DEFAULT_MIG_PARTED_CONFIGMAP`] comes from: the GPU Operator release line and the Go
/// module version it was read from.
pub const DEFAULT_MIG_PARTED_SOURCE: &str = "GPU Operator main after v25.3.4 (Go module github.com/NVIDIA/gpu-operator v0.0.0-20250917190837-d73a0086a6ba, assets/state-mig-manager/0400_configmap.yaml)";

/// The named layouts of a mig-parted config given as a ConfigMap (its `config.yaml`) or as the
/// config itself.
pub fn mig_configs_of_document(
    text: &str,
) -> Result<BTreeMap<String, serde_json::Value>, serde_saphyr::Error> {
    let v: serde_json::Value = crate::api::yaml::from_str(text)?;
    match v
        .get("data")
        .and_then(|d| d.get(MIG_PARTED_KEY))
        .and_then(|c| c.as_str())
    {
        Some(inner) => parse_mig_configs(inner),
        None => parse_mig_configs(text),
    }
}

/// The named layouts of NVIDIA's default mig-parted config ([`DEFAULT_MIG_PARTED_CONFIGMAP`]).
pub fn default_mig_configs() -> BTreeMap<String, serde_json::Value> {
    mig_configs_of_document(DEFAULT_MIG_PARTED_CONFIGMAP).expect("the embedded default parses")
}

/// The named layouts of a mig-parted config text.
pub fn parse_mig_configs(
    text: &str,
) -> Result<BTreeMap<String, serde_json::Value>, serde_saphyr::Error> {
    #[derive(Deserialize)]
    struct Doc {
        #[serde(rename = "mig-configs", default)]
        mig_configs: BTreeMap<String, serde_json::Value>,
    }
    thread_local!(static LAST: Memo = Memo::default());
    LAST.with(|m| {
        m.get_or_parse(text, || {
            let d: Doc = crate::api::yaml::from_str(text)?;
            Ok(d.mig_configs)
        })
    })
}

/// The last text parsed and its result, per thread: every planning pass reads the same
/// (large) ConfigMap text again, and parsing it was most of a pass's time (found profiling
/// the fuzz targets).
#[derive(Default)]
pub(crate) struct Memo(std::cell::RefCell<Option<(String, BTreeMap<String, serde_json::Value>)>>);

impl Memo {
    pub(crate) fn get_or_parse(
        &self,
        text: &str,
        parse: impl FnOnce() -> Result<BTreeMap<String, serde_json::Value>, serde_saphyr::Error>,
    ) -> Result<BTreeMap<String, serde_json::Value>, serde_saphyr::Error> {
        if let Some((t, v)) = &*self.0.borrow()
            && t == text
        {
            return Ok(v.clone());
        }
        let v = parse()?;
        *self.0.borrow_mut() = Some((text.to_string(), v.clone()));
        Ok(v)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_embedded_default_mig_parted_config_has_nvidias_named_layouts() {
        let m = default_mig_configs();
        for name in [
            MIG_DISABLED_LAYOUT,
            "all-enabled",
            "all-1g.10gb",
            "all-balanced",
        ] {
            assert!(m.contains_key(name), "{name} missing");
        }
        assert_eq!(m["all-1g.10gb"][0]["mig-devices"]["1g.10gb"], 7);
    }

    /// A resource name of a MIG profile reads back as the profile, the device plugin's '+' to
    /// '.' included; other names are not profiles.
    #[test]
    fn mig_resource_names_read_back_as_their_profiles() {
        for p in [
            "1g.10gb",
            "1c.2g.20gb",
            "1g.10gb+me",
            "1g.24gb+gfx",
            "1g.24gb-me",
            "1g.24gb+me.all",
        ] {
            assert_eq!(mig_profile_of(&mig_resource(p)).as_deref(), Some(p));
            let shared = format!("{}.shared", mig_resource(p));
            assert_eq!(mig_profile_of(&shared).as_deref(), Some(p));
        }
        for other in [
            "nvidia.com/gpu",
            "nvidia.com/mig-",
            "nvidia.com/mig-big",
            "example.com/mig-1g.10gb",
        ] {
            assert_eq!(mig_profile_of(other), None, "{other}");
        }
    }

    #[test]
    fn content_keys_are_parsed_back() {
        let k = content_key("l4-heavy", "version: v1\n");
        assert!(is_key_of("l4-heavy", &k), "{k}");
        assert!(!is_key_of("l4", &k), "another policy's prefix");
        assert!(!is_key_of("l4-heavy", "l4-heavy-default"));
        assert!(!is_key_of("l4-heavy", "default"));
    }

    /// `devices: all` (mig-parted's own spelling) and an absent `devices` mean the same GPUs:
    /// both render `devices: all`, so a policy rewritten from one to the other keeps its layout
    /// name and no node is relabelled. A list renders as the list.
    #[test]
    fn devices_all_renders_as_nvidia_writes_it_and_keeps_the_layout_name() {
        let mig = |yaml: &str| -> Mig { crate::api::yaml::from_str(yaml).unwrap() };
        let absent = mig(
            "{migStrategy: mixed, customLayout: [{migEnabled: true, migDevices: {1g.10gb: 7}}]}",
        );
        let all = mig(
            "{migStrategy: mixed, customLayout: [{devices: all, migEnabled: true, migDevices: {1g.10gb: 7}}]}",
        );
        let listed = mig(
            "{migStrategy: mixed, customLayout: [{devices: [0, 1], migEnabled: true, migDevices: {1g.10gb: 7}}, {devices: [2, 3], migEnabled: false}]}",
        );
        let (a, b) = (custom_layout_entries(&absent), custom_layout_entries(&all));
        assert_eq!(a, b);
        assert_eq!(custom_layout_name("p", &a), custom_layout_name("p", &b));
        let text = |m: &Mig| serde_json::to_value(custom_layout_entries(m)).unwrap();
        assert_eq!(text(&all)[0]["devices"], "all");
        assert_eq!(text(&listed)[0]["devices"], serde_json::json!([0, 1]));
        assert_eq!(text(&listed)[1]["devices"], serde_json::json!([2, 3]));
    }

    /// The API reads `devices` as NVIDIA's formats do: the word `all` or a list of indices.
    #[test]
    fn devices_is_all_or_a_list_and_round_trips() {
        use crate::api::crd::{GpuSelection, MigDeviceGroup};
        let g: MigDeviceGroup =
            crate::api::yaml::from_str("{devices: all, migEnabled: false}").unwrap();
        assert_eq!(g.devices, Some(GpuSelection::All));
        assert_eq!(g.indices(), None);
        assert_eq!(serde_json::to_value(&g).unwrap()["devices"], "all");
        let g: MigDeviceGroup =
            crate::api::yaml::from_str("{devices: [3, 1], migEnabled: false}").unwrap();
        assert_eq!(g.indices(), Some(&[3, 1][..]));
        assert_eq!(
            serde_json::to_value(&g).unwrap()["devices"],
            serde_json::json!([3, 1])
        );
        // Anything else still reads (the policy must get a status), kept as written.
        let g: MigDeviceGroup =
            crate::api::yaml::from_str("{devices: any, migEnabled: false}").unwrap();
        assert_eq!(g.devices, Some(GpuSelection::Invalid("any".into())));
        assert_eq!(serde_json::to_value(&g).unwrap()["devices"], "any");
        let g: MigDeviceGroup =
            crate::api::yaml::from_str("{devices: [0, \"1\"], migEnabled: false}").unwrap();
        assert_eq!(
            g.devices,
            Some(GpuSelection::Invalid(serde_json::json!([0, "1"])))
        );
        // A list longer than a node's GPUs is not kept whole, and its message is short.
        let long = format!(
            "{{devices: [{}], migEnabled: false}}",
            vec!["7"; 100_000].join(",")
        );
        let g: MigDeviceGroup = crate::api::yaml::from_str(&long).unwrap();
        let Some(GpuSelection::Invalid(v)) = &g.devices else {
            panic!("{:?}", g.devices);
        };
        assert_eq!(v, "a list of 100000 GPU indices");
    }
}
