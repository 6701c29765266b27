//! Upgrades must not relabel nodes. A device-plugin config key hashes the config's YAML text,
//! which serde_yaml 0.9 wrote before the operator moved to serde-saphyr; the frozen emitter
//! (`nvidia::emit`) must write exactly those bytes for every config we can render. Here
//! serde_yaml (a dev-dependency only for this proof) is the reference: every example, and random
//! configs over everything validation lets through.

use gpu_sharing_operator::nvidia::{
    self, DevicePluginConfig, Flags, ReplicatedResource, ReplicatedResources, Sharing,
};
use gpu_sharing_operator::offline::render;
use proptest::prelude::*;

fn same_bytes(c: &DevicePluginConfig) {
    let frozen = nvidia::device_plugin_yaml(c);
    let reference = serde_yaml::to_string(c).unwrap();
    assert_eq!(frozen, reference, "for {c:?}");
    // And it reads back as the same config.
    let back: DevicePluginConfig = gpu_sharing_operator::api::yaml::from_str(&frozen).unwrap();
    assert_eq!(&back, c);
}

#[test]
fn every_example_renders_the_bytes_it_always_did() {
    let mut seen = 0;
    for entry in std::fs::read_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/examples")).unwrap() {
        for p in render::load_policies(&entry.unwrap().path()).unwrap() {
            same_bytes(&nvidia::device_plugin_config(&p.spec));
            seen += 1;
        }
    }
    assert!(seen >= 6, "{seen} policies");
    same_bytes(&nvidia::exclusive_config("none"));
}

fn resource_name() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("nvidia.com/gpu".to_string()),
        Just("nvidia.com/gpu.shared".to_string()),
        "(1|2|3|4|7)g\\.(5|10|12|18|20|24|35|40|71|80|141)gb(\\.me|\\.me\\.all|\\.gfx)?"
            .prop_map(|p| format!("nvidia.com/mig-{p}")),
        "[a-z][a-z0-9-]{0,20}[a-z0-9]".prop_map(|n| format!("nvidia.com/{n}")),
    ]
}

fn device() -> impl Strategy<Value = String> {
    prop_oneof![
        (0u32..16).prop_map(|i| i.to_string()),
        (0u32..16, 0u32..8).prop_map(|(g, m)| format!("{g}:{m}")),
        "[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"
            .prop_map(|u| format!("GPU-{u}")),
        "[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"
            .prop_map(|u| format!("MIG-{u}")),
    ]
}

fn resources() -> impl Strategy<Value = ReplicatedResources> {
    let resource = (
        resource_name(),
        proptest::option::of(resource_name()),
        proptest::option::of(proptest::collection::vec(device(), 1..4)),
        2i32..1025,
    )
        .prop_map(|(name, rename, devices, replicas)| ReplicatedResource {
            name,
            rename,
            devices,
            replicas,
        });
    (
        any::<bool>(),
        proptest::option::of(any::<bool>()),
        proptest::collection::vec(resource, 1..4),
    )
        .prop_map(|(rename_by_default, fail, resources)| ReplicatedResources {
            rename_by_default,
            fail_requests_greater_than_one: fail,
            resources,
        })
}

fn config() -> impl Strategy<Value = DevicePluginConfig> {
    let sharing = prop_oneof![
        Just(None),
        resources().prop_map(|r| Some(Sharing {
            time_slicing: Some(r),
            mps: None
        })),
        resources().prop_map(|r| Some(Sharing {
            time_slicing: None,
            mps: Some(r)
        })),
    ];
    (
        prop_oneof![Just("none"), Just("single"), Just("mixed")],
        sharing,
    )
        .prop_map(|(mig_strategy, sharing)| DevicePluginConfig {
            version: "v1".into(),
            flags: Flags {
                mig_strategy: mig_strategy.into(),
            },
            sharing,
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn random_configs_render_the_same_bytes(c in config()) {
        same_bytes(&c);
    }
}
