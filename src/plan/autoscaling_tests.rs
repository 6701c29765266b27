//! The Karpenter overlays, tested through the whole pipeline: a file on top of both, so that
//! `autoscaling.rs` stays below the pipeline that calls it.

use serde_json::json;

use crate::api::crd::GpuSharingPolicy;
use crate::api::names::{
    LABEL_GPU_COUNT, LABEL_INSTANCE_TYPE, LABEL_NODEPOOL, LABEL_POLICY, LABEL_WORKLOAD,
};

use super::autoscaling::*;
use super::input::{AutoscalingFacts, NodePool, Overlay, PlanInput, Requirement};
use super::pipeline::plan as plan_all;
use super::testing::{a100_node, policy_spec};

fn pool(name: &str, labels: &[(&str, &str)]) -> NodePool {
    NodePool {
        name: name.into(),
        labels: labels
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
        requirements: vec![],
    }
}

const TABLE: &str = "{gpu-1x: {gpus: 1, product: NVIDIA-L4, memoryMiB: 23034}, gpu-8x: {gpus: 8, product: NVIDIA-L4, memoryMiB: 23034}}";

fn input(policies: Vec<GpuSharingPolicy>, pools: Vec<NodePool>, table: &str) -> PlanInput {
    let mut i = PlanInput::new(policies, vec![]);
    i.cluster.autoscaling = Some(AutoscalingFacts {
        node_pools: pools,
        foreign_overlays: vec![],
        table: Some(table.into()),
        weight: DEFAULT_WEIGHT,
    });
    i
}

const TS4: &str = "  nodeSelector: {matchLabels: {gpusharing.io/profile: ts4}}\n  strategy: timeSlicing\n  timeSlicing: {replicas: 4}\n";

/// The case of Karpenter's issue #729: a time-sliced NodePool's instance types get GPUs x
/// replicas, one overlay per GPU count; a NodePool the policy does not select gets none,
/// and the status says why.
#[test]
fn time_slicing_gives_each_gpu_count_its_replicas() {
    let i = input(
        vec![policy_spec("ts", TS4)],
        vec![
            pool("shared", &[("gpusharing.io/profile", "ts4")]),
            pool("plain", &[]),
        ],
        TABLE,
    );
    let plan = plan_all(&i);
    let names: Vec<&String> = plan.node_overlays.keys().collect();
    assert_eq!(names, ["gpusharing-ts-1gpu", "gpusharing-ts-8gpu"]);
    let o = &plan.node_overlays["gpusharing-ts-8gpu"];
    assert_eq!(o["spec"]["capacity"], json!({"nvidia.com/gpu": "32"}));
    assert_eq!(
        o["spec"]["requirements"],
        json!([
            {"key": LABEL_NODEPOOL, "operator": "In", "values": ["shared"]},
            {"key": LABEL_INSTANCE_TYPE, "operator": "In", "values": ["gpu-8x"]},
        ])
    );
    assert_eq!(o["spec"]["weight"], DEFAULT_WEIGHT);
    assert_eq!(o["metadata"]["labels"][LABEL_POLICY], "ts");
    assert_eq!(
        plan.node_overlays["gpusharing-ts-1gpu"]["spec"]["capacity"]["nvidia.com/gpu"],
        "4"
    );
    let st = plan.statuses["ts"].autoscaling.clone().unwrap();
    assert_eq!(st.node_pools[0].name, "shared");
    assert!(st.node_pools[0].matched);
    assert_eq!(st.node_pools[1].name, "plain");
    assert!(!st.node_pools[1].matched);
    assert_eq!(
        st.node_pools[1].reason,
        "its template labels lack gpusharing.io/profile=ts4"
    );
}

/// An instance type's GPUs are what most of its nodes say, not the first node by name (a
/// label anyone with node `patch` can write); a tie goes to fewer GPUs.
#[test]
fn an_instance_types_gpus_are_what_most_of_its_nodes_say() {
    let node = |name: &str, t: &str, count: &str| {
        let mut n = a100_node(&[(LABEL_INSTANCE_TYPE, t), (LABEL_GPU_COUNT, count)]);
        n.name = name.into();
        crate::plan::input::NodeView::idle(n)
    };
    let nodes = vec![
        node("a-forged", "p4de", "64"),
        node("b", "p4de", "8"),
        node("c", "p4de", "8"),
        node("d", "p4de", "8"),
        node("e", "tie", "8"),
        node("f", "tie", "4"),
    ];
    let mut nodes = nodes;
    // A count no node can have is read as unknown: it neither votes nor loops 4e9 times.
    nodes.push(node("g-forged", "huge", "4000000000"));
    // Passthrough hosts vote the same way (their count from the sandbox device plugin).
    let host = |name: &str, count: &str| {
        let mut n = a100_node(&[
            (LABEL_INSTANCE_TYPE, "pass"),
            (LABEL_WORKLOAD, "vm-passthrough"),
        ]);
        n.name = name.into();
        n.allocatable = [(
            "nvidia.com/GA100_A100_SXM4_80GB".to_string(),
            count.to_string(),
        )]
        .into_iter()
        .collect();
        crate::plan::input::NodeView::idle(n)
    };
    nodes.extend([host("h-forged", "64"), host("i", "8"), host("j", "8")]);
    nodes.push(host("k-huge", "9223372036854775807"));
    let (types, errors) = catalogue(&nodes, None);
    assert!(errors.is_empty(), "{errors:?}");
    assert_eq!(types["p4de"].gpus, 8);
    assert_eq!(
        types["p4de"].source,
        "node b (3 of the type's 4 nodes agree)"
    );
    assert_eq!(types["tie"].gpus, 4);
    assert!(!types.contains_key("huge"), "{:?}", types.get("huge"));
    assert_eq!(types["pass"].gpus, 8);
    assert_eq!(types["pass"].source, "node i");
}

/// MIG: per-profile counts from the layout and the GPU model, `nvidia.com/gpu` set to 0 (the
/// GPUs are advertised as MIG devices); a policy selecting on GFD's product learns the
/// model from the instance type. Learnt from a running node, no table needed.
#[test]
fn mig_counts_profiles_from_a_node_of_the_same_type() {
    let mut node = a100_node(&[(LABEL_INSTANCE_TYPE, "p4de")]);
    node.name = "a100-0".into();
    let mut i = input(
        vec![policy_spec(
            "mig",
            "  nodeSelector: {matchLabels: {nvidia.com/gpu.product: NVIDIA-A100-SXM4-80GB}}\n  strategy: mig\n  mig: {migStrategy: mixed, customLayout: [{migEnabled: true, migDevices: {3g.40gb: 1, 2g.20gb: 1, 1g.10gb: 2}}]}\n",
        )],
        vec![pool("a100s", &[])],
        "{}",
    );
    i.nodes.push(crate::plan::input::NodeView::idle(node));
    let plan = plan_all(&i);
    let o = &plan.node_overlays["gpusharing-mig-8gpu"];
    assert_eq!(
        o["spec"]["capacity"],
        json!({"nvidia.com/gpu": "0", "nvidia.com/mig-1g.10gb": "16", "nvidia.com/mig-2g.20gb": "8", "nvidia.com/mig-3g.40gb": "8"})
    );
    let st = plan.statuses["mig"].autoscaling.clone().unwrap();
    assert_eq!(st.overlays[0].instance_types, ["p4de"]);
    // Through DRA extended resources the layout serves the same names and counts (one pod per
    // MIG device), and the status says how launched nodes move.
    let spec = |p: &mut GpuSharingPolicy| {
        p.spec.backend = crate::api::crd::Backend::Dra;
        p.spec.dra = Some(crate::api::crd::Dra {
            extended_resources: true,
            ..Default::default()
        });
    };
    spec(&mut i.policies[0]);
    let plan = plan_all(&i);
    assert_eq!(
        plan.node_overlays["gpusharing-mig-8gpu"]["spec"]["capacity"],
        o["spec"]["capacity"]
    );
    let st = plan.statuses["mig"].autoscaling.clone().unwrap();
    assert!(
        st.launched_nodes
            .expect("said")
            .contains("nvidia.com/mig-3g.40gb")
    );
}

/// An admin's overlay that already sets the resource on a matched type wins: the policy
/// steps aside for that type and says so; a NodePool whose requirements admit no known GPU
/// type is reported; the higher-precedence policy wins a type two policies select.
#[test]
fn foreign_overlays_requirements_and_precedence() {
    let mut i = input(
        vec![
            policy_spec("ts", TS4),
            policy_spec(
                "ts-low",
                "  nodeSelector: {}\n  priority: -1\n  strategy: timeSlicing\n  timeSlicing: {replicas: 2}\n",
            ),
        ],
        vec![
            pool("shared", &[("gpusharing.io/profile", "ts4")]),
            NodePool {
                requirements: vec![Requirement {
                    key: LABEL_INSTANCE_TYPE.into(),
                    operator: "In".into(),
                    values: vec!["cpu-only".into()],
                }],
                ..pool("cpu", &[("gpusharing.io/profile", "ts4")])
            },
        ],
        TABLE,
    );
    i.cluster.autoscaling.as_mut().unwrap().foreign_overlays = vec![Overlay {
        name: "admin-8x".into(),
        weight: 50,
        requirements: vec![Requirement {
            key: LABEL_INSTANCE_TYPE.into(),
            operator: "In".into(),
            values: vec!["gpu-8x".into()],
        }],
        resources: vec!["nvidia.com/gpu".into()],
    }];
    let plan = plan_all(&i);
    assert!(!plan.node_overlays.contains_key("gpusharing-ts-8gpu"));
    let st = plan.statuses["ts"].autoscaling.clone().unwrap();
    assert_eq!(
        st.conflicts,
        [
            "NodeOverlay admin-8x (weight 50) sets nvidia.com/gpu on gpu-8x in NodePool shared: left to it"
        ]
    );
    assert_eq!(
        st.node_pools[1].reason,
        "its requirements admit none of the known GPU instance types (gpu-1x, gpu-8x)"
    );
    let low = plan.statuses["ts-low"].autoscaling.clone().unwrap();
    assert!(!low.node_pools[0].matched);
    assert_eq!(
        low.node_pools[0].reason,
        "gpu-1x: won by policy ts; gpu-8x: won by policy ts"
    );
}

/// VM hosts: passthrough GPUs under the PCI name the sandbox device plugin advertises (learnt
/// from a passthrough node of the type, or the table's `pciDeviceName`), vGPUs under
/// `NVIDIA_<type>` from the layout; no KubeVirt device plugin in `kata` mode, no vGPUs
/// without the vGPU Manager.
#[test]
fn vm_hosts_get_the_sandbox_device_plugins_resources() {
    let mut host = a100_node(&[
        (LABEL_INSTANCE_TYPE, "p4de"),
        (LABEL_WORKLOAD, "vm-passthrough"),
    ]);
    host.allocatable = [
        ("nvidia.com/GA100_A100_SXM4_80GB", "8"),
        ("nvidia.com/gpu", "0"),
    ]
    .into_iter()
    .collect();
    let mut i = input(
        vec![
            policy_spec(
                "pass",
                "  nodeSelector: {matchLabels: {gpusharing.io/profile: vm}}\n  strategy: passthrough\n",
            ),
            policy_spec(
                "vdi",
                "  nodeSelector: {matchLabels: {gpusharing.io/profile: vdi}}\n  strategy: vgpu\n  vgpu: {customLayout: [{vgpuDevices: {L4-12Q: 2}}]}\n",
            ),
        ],
        vec![
            pool("vms", &[("gpusharing.io/profile", "vm")]),
            pool("vdi", &[("gpusharing.io/profile", "vdi")]),
        ],
        "{gpu-1x: {gpus: 1, product: NVIDIA-L4, pciDeviceName: AD104GL_L4}, l4-4x: {gpus: 4}}",
    );
    i.nodes.push(crate::plan::input::NodeView::idle(host));
    i.cluster.sandbox.vgpu_manager_enabled = true;
    let plan = plan_all(&i);
    let cap = |o: &str| plan.node_overlays[o]["spec"]["capacity"].clone();
    assert_eq!(
        cap("gpusharing-pass-8gpu"),
        json!({"nvidia.com/gpu": "0", "nvidia.com/GA100_A100_SXM4_80GB": "8"})
    );
    assert_eq!(
        cap("gpusharing-pass-1gpu"),
        json!({"nvidia.com/gpu": "0", "nvidia.com/AD104GL_L4": "1"})
    );
    let st = plan.statuses["pass"].autoscaling.clone().unwrap();
    assert_eq!(
        st.node_pools[0].reason,
        "instance types gpu-1x, p4de; l4-4x: the sandbox device plugin's name for its GPUs is unknown: no passthrough node of this type runs, and the instance-type table gives no pciDeviceName"
    );
    assert_eq!(
        cap("gpusharing-vdi-4gpu"),
        json!({"nvidia.com/gpu": "0", "nvidia.com/NVIDIA_L4-12Q": "8"})
    );

    i.cluster.sandbox.vgpu_manager_enabled = false;
    let plan = plan_all(&i);
    assert!(
        !plan
            .node_overlays
            .keys()
            .any(|o| o.starts_with("gpusharing-vdi"))
    );
    let st = plan.statuses["vdi"].autoscaling.clone().unwrap();
    assert!(
        st.node_pools[1]
            .reason
            .contains("l4-4x: the ClusterPolicy's vgpuManager.enabled is false"),
        "{}",
        st.node_pools[1].reason
    );

    i.cluster.sandbox.mode = Some("kata".into());
    let plan = plan_all(&i);
    assert!(
        plan.node_overlays.is_empty(),
        "{:?}",
        plan.node_overlays.keys()
    );
    let st = plan.statuses["pass"].autoscaling.clone().unwrap();
    assert!(
        st.node_pools[0]
            .reason
            .contains("sandboxWorkloads.mode is kata")
    );
}

/// A NodePool that pins a provider's GPU-count label gets the capacity for instance types
/// no node or table showed, matched by that label; MIG needs the GPU model and says so.
#[test]
fn a_pinned_provider_gpu_count_is_a_source_of_capacity() {
    let count = |values: &[&str]| Requirement {
        key: "karpenter.k8s.aws/instance-gpu-count".into(),
        operator: "In".into(),
        values: values.iter().map(|v| v.to_string()).collect(),
    };
    let i = input(
        vec![
            policy_spec("ts", TS4),
            policy_spec(
                "mig",
                "  nodeSelector: {matchLabels: {gpusharing.io/profile: mig}}\n  strategy: mig\n  mig: {migStrategy: mixed, layout: all-1g.10gb}\n",
            ),
        ],
        vec![
            NodePool {
                requirements: vec![count(&["4", "8"])],
                ..pool("aws", &[("gpusharing.io/profile", "ts4")])
            },
            NodePool {
                requirements: vec![count(&["8"])],
                ..pool("aws-mig", &[("gpusharing.io/profile", "mig")])
            },
        ],
        "{}",
    );
    let plan = plan_all(&i);
    let names: Vec<&String> = plan.node_overlays.keys().collect();
    assert_eq!(names, ["gpusharing-ts-4gpu", "gpusharing-ts-8gpu"]);
    let o = &plan.node_overlays["gpusharing-ts-8gpu"];
    assert_eq!(o["spec"]["capacity"], json!({"nvidia.com/gpu": "32"}));
    assert_eq!(
        o["spec"]["requirements"][1],
        json!({"key": "karpenter.k8s.aws/instance-gpu-count", "operator": "In", "values": ["8"]})
    );
    let st = plan.statuses["ts"].autoscaling.clone().unwrap();
    assert_eq!(
        st.overlays[1].gpu_count_label.as_deref(),
        Some("karpenter.k8s.aws/instance-gpu-count=8")
    );
    assert!(st.overlays[1].instance_types.is_empty());
    let st = plan.statuses["mig"].autoscaling.clone().unwrap();
    assert_eq!(
        st.node_pools[1].reason,
        "karpenter.k8s.aws/instance-gpu-count=8: MIG capacity needs the GPU model, which the count label does not give"
    );
}

#[test]
fn table_errors_are_reported() {
    let (_, errors) = catalogue(&[], Some("{x: {gpus: 0}, y: {gpu: 1}}"));
    assert_eq!(errors.len(), 1, "{errors:?}");
    assert!(errors[0].starts_with("instance-types.yaml: "), "{errors:?}");
    let (types, errors) = catalogue(&[], Some("{x: {gpus: 0}}"));
    assert!(types.is_empty());
    assert_eq!(errors, ["instance-types.yaml: x: gpus must be at least 1"]);
    // A count no node has would make the vGPU overlay loop over it.
    let (types, errors) = catalogue(&[], Some("{x: {gpus: 4000000000}}"));
    assert!(types.is_empty());
    assert_eq!(errors, ["instance-types.yaml: x: gpus must be at most 64"]);
}

/// Precedence over the whole int32 range: `priority: -2147483648` is the lowest, not (negated,
/// wrapping in release builds and panicking in debug) the highest.
#[test]
fn the_lowest_int32_priority_loses() {
    let mut low = policy_spec(
        "low",
        "  nodeSelector: {}\n  priority: -2147483648\n  strategy: timeSlicing\n  timeSlicing: {replicas: 2}\n",
    );
    let high = policy_spec(
        "high",
        "  nodeSelector: {}\n  priority: 2147483647\n  strategy: timeSlicing\n  timeSlicing: {replicas: 4}\n",
    );
    let zero = policy_spec(
        "zero",
        "  nodeSelector: {}\n  strategy: timeSlicing\n  timeSlicing: {replicas: 8}\n",
    );
    low.metadata.generation = Some(1);
    let mut n = a100_node(&[]);
    n.name = "n".into();
    let mut i = PlanInput::new(vec![low.clone(), zero.clone()], vec![n.clone()]);
    let owner = |i: &PlanInput| {
        plan_all(i).node_labels["n"]
            .get(crate::api::names::LABEL_POLICY)
            .map(|v| v.to_string())
    };
    assert_eq!(owner(&i).as_deref(), Some("zero"));
    i = PlanInput::new(vec![low, high, zero], vec![n]);
    assert_eq!(owner(&i).as_deref(), Some("high"));
}

/// A pool served by the DRA driver through extended resources: its overlay says what
/// kube-scheduler can place through the driver on a moved node (GPUs x shares), and the status
/// says how launched nodes come up (on the device plugin, for Karpenter to initialize them).
#[test]
fn a_dra_extended_pool_gets_its_shares_and_says_how_launched_nodes_move() {
    let dra = format!(
        "{TS4}  backend: dra\n  dra: {{extendedResources: true, driverFeatureGates: {{ConsumableShares: true}}}}\n"
    );
    let i = input(
        vec![policy_spec("ts", &dra)],
        vec![pool("shared", &[("gpusharing.io/profile", "ts4")])],
        TABLE,
    );
    let plan = plan_all(&i);
    let o = &plan.node_overlays["gpusharing-ts-8gpu"];
    assert_eq!(o["spec"]["capacity"], json!({"nvidia.com/gpu": "32"}));
    let st = plan.statuses["ts"].autoscaling.clone().unwrap();
    let why = st.launched_nodes.expect("said");
    assert!(why.contains("karpenter.sh/initialized=true"), "{why}");
    // A device-plugin policy's status says nothing of the kind.
    let i = input(
        vec![policy_spec("ts", TS4)],
        vec![pool("shared", &[("gpusharing.io/profile", "ts4")])],
        TABLE,
    );
    let st = plan_all(&i).statuses["ts"].autoscaling.clone().unwrap();
    assert_eq!(st.launched_nodes, None);
}
