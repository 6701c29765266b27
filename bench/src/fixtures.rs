//! What a run creates: the policy CRD, N GPU nodes spread over P groups, P policies (one group
//! each, alternating time-slicing and MPS).

use super::*;

pub(crate) async fn install_crd(client: &Client) -> anyhow::Result<()> {
    let crd = GpuSharingPolicy::crd();
    let name = crd.name_any();
    let api: Api<CustomResourceDefinition> = Api::all(client.clone());
    api.patch(
        &name,
        &PatchParams::apply(BENCH_MANAGER).force(),
        &Patch::Apply(&crd),
    )
    .await?;
    let start = Instant::now();
    loop {
        let c = api.get(&name).await?;
        let established = c
            .status
            .as_ref()
            .and_then(|s| s.conditions.as_ref())
            .is_some_and(|cs| {
                cs.iter()
                    .any(|c| c.type_ == "Established" && c.status == "True")
            });
        if established {
            break;
        }
        if start.elapsed() > Duration::from_secs(60) {
            bail!("CRD not established");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // The API is served shortly after Established; wait until a list works.
    let pol: Api<GpuSharingPolicy> = Api::all(client.clone());
    while pol.list(&ListParams::default()).await.is_err() {
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    Ok(())
}

pub(crate) fn node_name(i: usize) -> String {
    format!("gpu-node-{i:05}")
}

pub(crate) fn group_of(i: usize, p: usize) -> usize {
    i % p
}

pub(crate) fn policy_name(g: usize) -> String {
    format!("bench-{g:03}")
}

/// The labels of a GPU node as a real cluster has them: the kubelet's and the cloud provider's,
/// Node Feature Discovery's, GPU Feature Discovery's and the GPU Operator's (56, some unique to
/// the node such as its hostname), plus the benchmark's group. GFD's labels that follow the
/// sharing config (`gpu.replicas`, `gpu.sharing-strategy`, `mps.capable`, `-SHARED` products)
/// are left out: no GFD runs here to update them. For the same reason the nodes look like GFD
/// run with `--no-timestamp` (no `nvidia.com/gfd.timestamp`): with a timestamp the operator
/// waits for GFD to relabel after each config change, which nothing here would do.
pub(crate) fn node_labels(i: usize, p: usize) -> BTreeMap<String, String> {
    let name = node_name(i);
    let zone = format!("us-east-1{}", ["a", "b", "c"][i % 3]);
    let mut l: BTreeMap<String, String> = [
        ("kubernetes.io/hostname", name.as_str()),
        ("kubernetes.io/os", "linux"),
        ("kubernetes.io/arch", "amd64"),
        ("beta.kubernetes.io/os", "linux"),
        ("beta.kubernetes.io/arch", "amd64"),
        ("beta.kubernetes.io/instance-type", "g6.12xlarge"),
        ("node.kubernetes.io/instance-type", "g6.12xlarge"),
        ("topology.kubernetes.io/region", "us-east-1"),
        ("topology.kubernetes.io/zone", zone.as_str()),
        ("failure-domain.beta.kubernetes.io/region", "us-east-1"),
        ("failure-domain.beta.kubernetes.io/zone", zone.as_str()),
        ("node-role.kubernetes.io/gpu", ""),
        ("feature.node.kubernetes.io/cpu-cpuid.AVX", "true"),
        ("feature.node.kubernetes.io/cpu-cpuid.AVX2", "true"),
        ("feature.node.kubernetes.io/cpu-cpuid.AVX512F", "true"),
        ("feature.node.kubernetes.io/cpu-cpuid.AVX512BW", "true"),
        ("feature.node.kubernetes.io/cpu-cpuid.AVX512VNNI", "true"),
        ("feature.node.kubernetes.io/cpu-cpuid.FMA3", "true"),
        ("feature.node.kubernetes.io/cpu-cpuid.SHA", "true"),
        ("feature.node.kubernetes.io/cpu-cpuid.VAES", "true"),
        (
            "feature.node.kubernetes.io/cpu-hardware_multithreading",
            "true",
        ),
        ("feature.node.kubernetes.io/cpu-model.family", "25"),
        ("feature.node.kubernetes.io/cpu-model.id", "1"),
        ("feature.node.kubernetes.io/cpu-model.vendor_id", "AMD"),
        (
            "feature.node.kubernetes.io/kernel-version.full",
            "6.1.0-28-cloud-amd64",
        ),
        ("feature.node.kubernetes.io/kernel-version.major", "6"),
        ("feature.node.kubernetes.io/kernel-version.minor", "1"),
        ("feature.node.kubernetes.io/kernel-version.revision", "0"),
        ("feature.node.kubernetes.io/pci-10de.present", "true"),
        ("feature.node.kubernetes.io/pci-1d0f.present", "true"),
        ("feature.node.kubernetes.io/system-os_release.ID", "debian"),
        (
            "feature.node.kubernetes.io/system-os_release.VERSION_ID",
            "12",
        ),
        (
            "feature.node.kubernetes.io/storage-nonrotationaldisk",
            "true",
        ),
        ("nvidia.com/cuda.driver-version.full", "570.172.08"),
        ("nvidia.com/cuda.driver.major", "570"),
        ("nvidia.com/cuda.driver.minor", "172"),
        ("nvidia.com/cuda.driver.rev", "08"),
        ("nvidia.com/cuda.runtime.major", "12"),
        ("nvidia.com/cuda.runtime.minor", "8"),
        ("nvidia.com/gpu.compute.major", "8"),
        ("nvidia.com/gpu.compute.minor", "9"),
        ("nvidia.com/gpu.count", "4"),
        ("nvidia.com/gpu.family", "ada-lovelace"),
        ("nvidia.com/gpu.machine", "g6.12xlarge"),
        ("nvidia.com/gpu.memory", "23034"),
        ("nvidia.com/gpu.mode", "compute"),
        ("nvidia.com/gpu.present", "true"),
        ("nvidia.com/gpu.product", "NVIDIA-L4"),
        ("nvidia.com/mig.capable", "false"),
        ("nvidia.com/gpu.deploy.container-toolkit", "true"),
        ("nvidia.com/gpu.deploy.dcgm", "true"),
        ("nvidia.com/gpu.deploy.dcgm-exporter", "true"),
        ("nvidia.com/gpu.deploy.device-plugin", "true"),
        ("nvidia.com/gpu.deploy.driver", "true"),
        ("nvidia.com/gpu.deploy.gpu-feature-discovery", "true"),
        ("nvidia.com/gpu.deploy.operator-validator", "true"),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v.to_string()))
    .collect();
    l.insert(GROUP_LABEL.into(), format!("g{}", group_of(i, p)));
    l
}

pub(crate) async fn create_nodes(
    client: &Client,
    n: usize,
    p: usize,
    conc: usize,
) -> anyhow::Result<()> {
    create_nodes_with(client, n, p, conc, &BTreeMap::new()).await
}

/// [`create_nodes`] with extra labels on every node.
pub(crate) async fn create_nodes_with(
    client: &Client,
    n: usize,
    p: usize,
    conc: usize,
    extra: &BTreeMap<String, String>,
) -> anyhow::Result<()> {
    let api: Api<Node> = Api::all(client.clone());
    stream::iter(0..n)
        .map(|i| {
            let api = api.clone();
            async move {
                let name = node_name(i);
                let mut labels = node_labels(i, p);
                labels.extend(extra.clone());
                let node: Node = serde_json::from_value(json!({
                    "apiVersion": "v1",
                    "kind": "Node",
                    "metadata": {"name": name, "labels": labels},
                    "spec": {},
                    "status": {"capacity": ADVERTISED.clone(), "allocatable": ADVERTISED.clone()},
                }))?;
                api.create(&PostParams::default(), &node).await?;
                Ok::<_, anyhow::Error>(())
            }
        })
        .buffer_unordered(conc)
        .try_collect::<Vec<_>>()
        .await?;
    Ok(())
}

/// What the nodes' device plugins advertise (`status.allocatable`): 4 GPUs x replicas 4, what
/// every benchmark policy serves (time-slicing or MPS, replicas 4; the edit keeps the replicas).
/// A node counts as applied only when the device plugin advertises what its policy serves, and
/// no kubelet runs here to follow the config: the nodes advertise it from the start, as they
/// look like GFD run with `--no-timestamp` (see [`node_labels`]).
pub(crate) static ADVERTISED: std::sync::LazyLock<serde_json::Value> =
    std::sync::LazyLock::new(|| json!({"nvidia.com/gpu": "16"}));

/// The benchmark's policy edit (time-slicing, group 0): a new config (so a new key, and its
/// nodes are relabelled) that the device plugin serves with the same resources.
pub(crate) fn edit_patch() -> serde_json::Value {
    json!({"spec": {"timeSlicing": {"failRequestsGreaterThanOne": true}}})
}

pub(crate) fn policy_object(g: usize, replicas: i32) -> GpuSharingPolicy {
    let sharing = if g.is_multiple_of(2) {
        json!({"strategy": "timeSlicing", "timeSlicing": {"replicas": replicas}})
    } else {
        json!({"strategy": "mps", "mps": {"replicas": replicas}})
    };
    // maxUnavailable 100%: every node in one wave, as the minimal-write baseline writes them
    // (the rollout benchmark sets its own budget).
    let mut spec = json!({
        "nodeSelector": {"matchLabels": {GROUP_LABEL: format!("g{g}")}},
        "rollout": {"maxUnavailable": "100%"},
    });
    spec.as_object_mut()
        .unwrap()
        .extend(sharing.as_object().unwrap().clone());
    serde_json::from_value(json!({
        "apiVersion": "gpusharing.io/v1alpha1",
        "kind": "GpuSharingPolicy",
        "metadata": {"name": policy_name(g)},
        "spec": spec,
    }))
    .expect("valid policy")
}

pub(crate) async fn create_policies(client: &Client, p: usize, conc: usize) -> anyhow::Result<()> {
    let api: Api<GpuSharingPolicy> = Api::all(client.clone());
    stream::iter(0..p)
        .map(|g| {
            let api = api.clone();
            async move {
                api.create(&PostParams::default(), &policy_object(g, 4))
                    .await?;
                Ok::<_, anyhow::Error>(())
            }
        })
        .buffer_unordered(conc)
        .try_collect::<Vec<_>>()
        .await?;
    Ok(())
}

pub(crate) fn nodes_per_group(n: usize, p: usize) -> Vec<i32> {
    let mut v = vec![0i32; p];
    for i in 0..n {
        v[group_of(i, p)] += 1;
    }
    v
}
