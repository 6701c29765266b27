//! Pods -> the planner's facts about them: which pods use GPUs on which node (the idle-GPU wait
//! before MIG changes, and drains), with their labels (`disruption.neverEvict`), and which run
//! VMs on a node (pods asking for the sandbox device plugin's resources).
//!
//! This file owns the whole reading of pods: the field selectors the controller's caches and
//! `plan` list them with ([`RUNNING_BOUND_PODS`], [`UNSCHEDULED_PODS`]), what the caches drop
//! of each pod ([`strip_bound`], [`strip_pending`]) and the readers ([`gpu_pods`],
//! [`pending_pod`]). A property test keeps `reader(strip(pod)) == reader(pod)`, so the
//! controller (stripped caches) and `plan` (whole pods) cannot read the same pods differently.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Container, NodeSelectorTerm, Pod, PodStatus};
use kube::ResourceExt;

use crate::plan::input::{GpuPod, PendingPod, Requirement};
use crate::plan::is_device_plugin_resource;
use crate::plan::taint::Toleration;

/// Field selector of the pods that may hold GPUs: bound to a node and not finished.
pub const RUNNING_BOUND_PODS: &str = "spec.nodeName!=,status.phase!=Succeeded,status.phase!=Failed";
/// Field selector of pods no node has been chosen for yet (demand for `spec.mig.dynamic`).
pub const UNSCHEDULED_PODS: &str = "spec.nodeName=,status.phase=Pending";

/// A container as the readers see it: its name and resources, nothing else.
fn strip_container(c: &mut Container) {
    *c = Container {
        name: std::mem::take(&mut c.name),
        resources: c.resources.take(),
        ..Default::default()
    };
}

/// What every pod cache drops: managed fields, annotations, owners, volumes and tolerations,
/// and of each container (init containers too: their requests count) all but its resources.
fn strip_common(p: &mut Pod) {
    p.metadata.managed_fields = None;
    p.metadata.annotations = None;
    p.metadata.owner_references = None;
    if let Some(spec) = p.spec.as_mut() {
        spec.volumes = None;
        spec.tolerations = None;
        spec.ephemeral_containers = None;
        spec.containers.iter_mut().for_each(strip_container);
        spec.init_containers
            .iter_mut()
            .flatten()
            .for_each(strip_container);
    }
}

/// A bound pod as the GPU-pod cache keeps it: what [`gpu_pods`] reads (node, resources,
/// labels for `disruption.neverEvict`, priority, and of its status only `startTime`).
pub fn strip_bound(p: &mut Pod) {
    strip_common(p);
    p.status = p.status.take().map(|s| PodStatus {
        start_time: s.start_time,
        // Which NVIDIA resources the claim serves (see `served_by_dra`), nothing else of them.
        extended_resource_claim_status: s.extended_resource_claim_status.map(|e| {
            k8s_openapi::api::core::v1::PodExtendedResourceClaimStatus {
                resource_claim_name: e.resource_claim_name,
                request_mappings: (e.request_mappings.into_iter())
                    .filter(|m| is_device_plugin_resource(&m.resource_name))
                    .take(MAX_MAPPINGS)
                    .map(
                        |m| k8s_openapi::api::core::v1::ContainerExtendedResourceRequest {
                            resource_name: m.resource_name,
                            ..Default::default()
                        },
                    )
                    .collect(),
            }
        }),
        ..Default::default()
    });
    if let Some(spec) = p.spec.as_mut() {
        spec.affinity = None;
    }
}

/// An unscheduled pod as the pending-pod cache keeps it: what [`pending_pod`] reads (requests,
/// node selector, required node affinity, tolerations, priority, the scheduler's condition).
/// Most pending pods are not demand (no MIG request, or selectors past the bounds): of those
/// only the name is kept, whatever their size.
pub fn strip_pending(p: &mut Pod) {
    if !may_be_demand(p) {
        p.metadata = kube::api::ObjectMeta {
            name: p.metadata.name.take(),
            namespace: p.metadata.namespace.take(),
            resource_version: p.metadata.resource_version.take(),
            uid: p.metadata.uid.take(),
            ..Default::default()
        };
        p.spec = None;
        p.status = None;
        return;
    }
    let tolerations = p.spec.as_mut().and_then(|s| s.tolerations.take());
    strip_common(p);
    if let Some(s) = p.spec.as_mut() {
        s.tolerations = tolerations;
    }
    p.metadata.labels = None;
    if let Some(s) = p.status.as_mut() {
        s.container_statuses = None;
        s.init_container_statuses = None;
        s.message = None;
        for c in s.conditions.iter_mut().flatten() {
            c.message = None;
        }
    }
    if let Some(a) = p.spec.as_mut().and_then(|s| s.affinity.as_mut()) {
        a.pod_affinity = None;
        a.pod_anti_affinity = None;
        if let Some(n) = a.node_affinity.as_mut() {
            n.preferred_during_scheduling_ignored_during_execution = None;
        }
    }
}

/// The extended resources a pod's containers ask for (limits and requests).
fn resources(p: &Pod) -> impl Iterator<Item = &String> {
    p.spec.iter().flat_map(|s| &s.containers).flat_map(|c| {
        let r = c.resources.as_ref();
        r.and_then(|r| r.limits.as_ref())
            .into_iter()
            .chain(r.and_then(|r| r.requests.as_ref()))
            .flat_map(|m| m.keys())
    })
}

/// Whether a pod asks for NVIDIA GPU resources (full GPUs, shared replicas or MIG devices).
pub fn uses_gpu(p: &Pod) -> bool {
    resources(p).any(|k| is_device_plugin_resource(k))
}

/// Whether kube-scheduler served every NVIDIA resource the pod asks for through DRA (KEP-5004):
/// `status.extendedResourceClaimStatus` names the claim it created and maps each of them to
/// one of its requests. Such a pod holds no device-plugin GPU: its GPUs are that claim's (see
/// [`super::claims`]). A pod whose claim serves another resource (a NIC through another
/// driver's class) while it asks the device plugin for a GPU holds a device-plugin GPU.
pub fn served_by_dra(p: &Pod) -> bool {
    let Some(x) = (p.status.as_ref()).and_then(|s| s.extended_resource_claim_status.as_ref())
    else {
        return false;
    };
    let mapped = |r: &str| x.request_mappings.iter().any(|m| m.resource_name == r);
    gpu_requests(p).keys().all(|r| mapped(r))
}

/// The most request mappings a bound pod keeps (one per container and NVIDIA resource).
const MAX_MAPPINGS: usize = 64;

/// Whether a pod asks for a resource of NVIDIA's sandbox device plugin (a VM's GPU or vGPU:
/// `nvidia.com/<PCI device name>` or `nvidia.com/<mdev type>`, as KubeVirt's virt-launcher pods
/// do).
pub fn uses_vm_gpu(p: &Pod) -> bool {
    resources(p).any(|k| k.starts_with("nvidia.com/") && !is_device_plugin_resource(k))
}

/// The pods on nodes that use GPUs, as the planner reads them.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct GpuPods {
    /// By node: `namespace/name`, sorted.
    pub gpu_pods: BTreeMap<String, Vec<String>>,
    /// Labels and priorities of the pods in `gpu_pods` and `dra_pods`, by `namespace/name`.
    pub gpu_pod_details: BTreeMap<String, GpuPod>,
    /// By node: pods whose GPU requests kube-scheduler served through DRA (extended resources),
    /// `namespace/name`, sorted.
    pub dra_pods: BTreeMap<String, Vec<String>>,
    /// Pods using the sandbox device plugin's resources (VMs), by node, sorted.
    pub vm_pods: BTreeMap<String, Vec<String>>,
    /// What the GPU pods of each node request of NVIDIA's resources, summed.
    pub requests: BTreeMap<String, BTreeMap<String, i64>>,
}

/// The most of one device-plugin resource a pod's container is believed to ask for: more than
/// any node advertises (64 GPUs x 7 MIG instances x 1,024 replicas is 458,752), so a request
/// above it is unschedulable either way, and sums and products over pods stay far from
/// overflow. A pod author writes the quantity; it is clamped here before any arithmetic.
pub const MAX_DEVICE_REQUEST: i64 = 1 << 20;

/// What a pod's containers request of each NVIDIA device-plugin resource (limits where no
/// request is given: extended resources are requested as their limit), summed; init
/// containers count by their largest, as the scheduler counts them.
pub fn gpu_requests(p: &Pod) -> BTreeMap<String, i64> {
    let Some(spec) = p.spec.as_ref() else {
        return BTreeMap::new();
    };
    let of = |c: &k8s_openapi::api::core::v1::Container| -> BTreeMap<String, i64> {
        let r = c.resources.as_ref();
        let mut out = BTreeMap::new();
        for m in [
            r.and_then(|r| r.limits.as_ref()),
            r.and_then(|r| r.requests.as_ref()),
        ]
        .into_iter()
        .flatten()
        {
            for (k, q) in m.iter().filter(|(k, _)| is_device_plugin_resource(k)) {
                if let Ok(v) = q.0.parse::<i64>() {
                    out.insert(k.clone(), v.clamp(0, MAX_DEVICE_REQUEST));
                }
            }
        }
        out
    };
    let mut total = BTreeMap::<String, i64>::new();
    for c in &spec.containers {
        for (k, v) in of(c) {
            let e = total.entry(k).or_default();
            *e = e.saturating_add(v);
        }
    }
    for c in spec.init_containers.iter().flatten() {
        for (k, v) in of(c) {
            let e = total.entry(k).or_default();
            *e = (*e).max(v);
        }
    }
    for v in total.values_mut() {
        *v = (*v).min(MAX_DEVICE_REQUEST);
    }
    total
}

/// Reads the pods bound to nodes that use GPUs or run VMs.
pub fn gpu_pods<'a>(pods: impl IntoIterator<Item = &'a Pod>) -> GpuPods {
    let mut out = GpuPods::default();
    for p in pods {
        let dra = uses_gpu(p) && served_by_dra(p);
        let (gpu, vm) = (uses_gpu(p) && !dra, uses_vm_gpu(p));
        let Some(node) = p.spec.as_ref().and_then(|s| s.node_name.clone()) else {
            continue;
        };
        if !gpu && !vm && !dra {
            continue;
        }
        let id = format!("{}/{}", p.namespace().unwrap_or_default(), p.name_any());
        if vm {
            out.vm_pods
                .entry(node.clone())
                .or_default()
                .push(id.clone());
        }
        if dra {
            out.gpu_pod_details.insert(id.clone(), pod_details(p));
            out.dra_pods
                .entry(node.clone())
                .or_default()
                .push(id.clone());
        }
        if gpu {
            let sum = out.requests.entry(node.clone()).or_default();
            for (k, v) in gpu_requests(p) {
                let e = sum.entry(k).or_default();
                *e = e.saturating_add(v);
            }
            out.gpu_pod_details.insert(id.clone(), pod_details(p));
            out.gpu_pods.entry(node).or_default().push(id);
        }
    }
    for v in (out.gpu_pods.values_mut())
        .chain(out.vm_pods.values_mut())
        .chain(out.dra_pods.values_mut())
    {
        v.sort();
    }
    out
}

/// What drains and demand read of a GPU pod.
fn pod_details(p: &Pod) -> GpuPod {
    GpuPod {
        labels: p.labels().clone().into(),
        priority: p.spec.as_ref().and_then(|s| s.priority).unwrap_or(0),
        started: p
            .status
            .as_ref()
            .and_then(|s| s.start_time.as_ref())
            .map_or(0, |t| t.0.as_second()),
    }
}

/// What a pending pod may select nodes by and still count as demand: a pod past these bounds
/// (written by any tenant) is not demand, and the pending-pod cache keeps nothing of it.
pub const MAX_NODE_SELECTOR: usize = 16;
/// Required node-affinity terms, expressions per term, values per expression.
pub const MAX_AFFINITY_TERMS: usize = 8;
pub const MAX_AFFINITY_EXPRESSIONS: usize = 16;
pub const MAX_AFFINITY_VALUES: usize = 64;
pub const MAX_TOLERATIONS: usize = 32;

/// The terms of a pod's required node affinity (a node must satisfy one of them).
fn required_terms(spec: &k8s_openapi::api::core::v1::PodSpec) -> &[NodeSelectorTerm] {
    spec.affinity
        .as_ref()
        .and_then(|a| a.node_affinity.as_ref())
        .and_then(|a| {
            a.required_during_scheduling_ignored_during_execution
                .as_ref()
        })
        .map(|r| r.node_selector_terms.as_slice())
        .unwrap_or_default()
}

/// Whether a pod not bound to a node could be demand: it asks for a MIG device and what it
/// selects nodes by is within the bounds above (preferred affinity is not read at all).
pub fn may_be_demand(p: &Pod) -> bool {
    let Some(spec) = p.spec.as_ref() else {
        return false;
    };
    let terms = required_terms(spec);
    resources(p).any(|k| k.starts_with("nvidia.com/mig-"))
        && spec.node_selector.as_ref().map_or(0, |s| s.len()) <= MAX_NODE_SELECTOR
        && spec.tolerations.as_ref().map_or(0, |t| t.len()) <= MAX_TOLERATIONS
        && terms.len() <= MAX_AFFINITY_TERMS
        && terms.iter().all(|t| {
            let exprs = t.match_expressions.as_deref().unwrap_or_default();
            exprs.len() <= MAX_AFFINITY_EXPRESSIONS
                && exprs
                    .iter()
                    .all(|e| e.values.as_ref().map_or(0, |v| v.len()) <= MAX_AFFINITY_VALUES)
        })
}

/// The demand among pods not bound to a node (see [`pending_pod`]), by id.
pub fn demand<'a>(pending: impl IntoIterator<Item = &'a Pod>) -> Vec<PendingPod> {
    let mut d: Vec<PendingPod> = pending.into_iter().filter_map(pending_pod).collect();
    d.sort_by(|a, b| a.id.cmp(&b.id));
    d
}

/// A pod the scheduler marked unschedulable (`PodScheduled=False`, reason `Unschedulable`)
/// that asks for MIG instances, as demand planning reads it.
pub fn pending_pod(p: &Pod) -> Option<PendingPod> {
    let spec = p.spec.as_ref()?;
    if spec.node_name.is_some() || !may_be_demand(p) {
        return None;
    }
    let status = p.status.as_ref()?;
    let cond = status.conditions.iter().flatten().find(|c| {
        c.type_ == "PodScheduled"
            && c.status == "False"
            && c.reason.as_deref() == Some("Unschedulable")
    })?;
    let profiles: BTreeMap<String, i64> = gpu_requests(p)
        .into_iter()
        .filter_map(|(r, c)| Some((r.strip_prefix("nvidia.com/mig-")?.to_string(), c)))
        .filter(|(_, c)| *c > 0)
        .collect();
    if profiles.is_empty() {
        return None;
    }
    let affinity = required_terms(spec)
        .iter()
        .map(|t| {
            t.match_expressions
                .iter()
                .flatten()
                .map(|e| Requirement {
                    key: e.key.clone(),
                    operator: e.operator.clone(),
                    values: e.values.clone().unwrap_or_default(),
                })
                .collect()
        })
        .collect();
    Some(PendingPod {
        id: format!("{}/{}", p.namespace().unwrap_or_default(), p.name_any()),
        priority: spec.priority.unwrap_or(0),
        since: cond
            .last_transition_time
            .as_ref()
            .map_or(0, |t| t.0.as_second()),
        profiles,
        node_selector: spec.node_selector.clone().unwrap_or_default(),
        affinity,
        tolerations: spec
            .tolerations
            .iter()
            .flatten()
            .map(|t| Toleration {
                key: t.key.clone().unwrap_or_default(),
                operator: t.operator.clone().unwrap_or_default(),
                value: t.value.clone().unwrap_or_default(),
                effect: t.effect.clone().unwrap_or_default(),
            })
            .collect(),
        namespace_labels: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(node: Option<&str>, gpus: &[&str], init: Option<&str>) -> Pod {
        let container = |q: &str| serde_json::json!({"name": "c", "resources": {"limits": {"nvidia.com/gpu": q}}});
        let mut spec = serde_json::json!({
            "containers": gpus.iter().map(|q| container(q)).collect::<Vec<_>>(),
        });
        if let Some(n) = node {
            spec["nodeName"] = n.into();
        }
        if let Some(q) = init {
            spec["initContainers"] = serde_json::json!([container(q)]);
        }
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": format!("p{}", gpus.len()), "namespace": "t"},
            "spec": spec,
        }))
        .unwrap()
    }

    use proptest::prelude::*;
    use serde_json::{Value, json};

    /// A container asking for some of NVIDIA's resources (limits, requests or both), with the
    /// fields a cache drops filled in.
    fn container_gen() -> impl Strategy<Value = Value> {
        let resource = prop::sample::select(vec![
            "nvidia.com/gpu",
            "nvidia.com/mig-1g.10gb",
            "nvidia.com/mig-3g.40gb",
            "nvidia.com/GA100_A100_SXM4_80GB",
            "cpu",
        ]);
        let quantities = prop::collection::btree_map(resource, 0u8..4, 0..3);
        (quantities.clone(), quantities, "[a-z]{1,6}").prop_map(|(limits, requests, name)| {
            let q = |m: std::collections::BTreeMap<&str, u8>| {
                m.into_iter()
                    .map(|(k, v)| (k.to_string(), json!(v.to_string())))
                    .collect::<serde_json::Map<_, _>>()
            };
            json!({
                "name": name,
                "image": "registry.example/app:1",
                "command": ["run"],
                "env": [{"name": "A", "value": "b"}],
                "resources": {"limits": q(limits), "requests": q(requests)},
            })
        })
    }

    /// Pods of every shape the two caches see: bound or not, with init containers, selectors
    /// (sometimes past the demand bounds), affinity, tolerations, the scheduler's condition,
    /// and what the caches drop (annotations, managed fields, owners, volumes).
    fn pod_gen() -> impl Strategy<Value = Pod> {
        let containers = prop::collection::vec(container_gen(), 1..3);
        let inits = prop::collection::vec(container_gen(), 0..3);
        let node = prop::option::of(prop::sample::select(vec!["n0", "n1"]));
        let selector = prop::collection::btree_map("[a-z]{1,3}", "[a-z]{1,2}", 0..18);
        let terms = prop::collection::vec(
            prop::collection::vec(("[a-z]{1,3}", prop::collection::vec("[a-z]", 0..3)), 0..3),
            0..3,
        );
        let tolerations = prop::collection::vec("[a-z]{1,4}", 0..3);
        let scheduled = prop::option::of(any::<bool>());
        (
            (containers, inits, node),
            (selector, terms, tolerations),
            (scheduled, prop::option::of(-5i32..5), any::<bool>()),
        )
            .prop_map(
                |((containers, inits, node), (selector, terms, tolerations), (cond, prio, labelled))| {
                    let terms: Vec<Value> = terms
                        .into_iter()
                        .map(|exprs| {
                            json!({"matchExpressions": exprs.into_iter().map(|(k, v)| json!({
                                "key": k, "operator": "In", "values": v,
                            })).collect::<Vec<_>>()})
                        })
                        .collect();
                    let mut spec = json!({
                        "containers": containers,
                        "initContainers": inits,
                        "nodeSelector": selector,
                        "tolerations": tolerations.iter().map(|k| json!({"key": k, "operator": "Exists", "effect": "NoSchedule"})).collect::<Vec<_>>(),
                        "volumes": [{"name": "v", "emptyDir": {}}],
                        "affinity": {
                            "nodeAffinity": {
                                "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": terms},
                                "preferredDuringSchedulingIgnoredDuringExecution": [{"weight": 1, "preference": {"matchExpressions": [{"key": "z", "operator": "Exists"}]}}],
                            },
                            "podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [{"topologyKey": "k"}]},
                        },
                    });
                    if let Some(n) = node {
                        spec["nodeName"] = json!(n);
                    }
                    if let Some(p) = prio {
                        spec["priority"] = json!(p);
                    }
                    let mut status = json!({"phase": "Pending", "message": "m", "containerStatuses": []});
                    if node.is_some() && prio.is_some_and(|p| p % 2 == 0) {
                        status["startTime"] = json!("2026-12-06T09:00:00Z");
                    }
                    // kube-scheduler served its extended resources through DRA.
                    if node.is_some() && prio.is_some_and(|p| p % 3 == 0) {
                        status["extendedResourceClaimStatus"] = json!({
                            "resourceClaimName": "p-extended-resources-x7k2q",
                            "requestMappings": [{"containerName": "c", "resourceName": "nvidia.com/gpu", "requestName": "container-0-request-0"}],
                        });
                    }
                    if let Some(unschedulable) = cond {
                        status["conditions"] = json!([{
                            "type": "PodScheduled",
                            "status": if unschedulable { "False" } else { "True" },
                            "reason": "Unschedulable",
                            "message": "0/3 nodes are available",
                            "lastTransitionTime": "2026-12-06T10:00:00Z",
                        }]);
                    }
                    let mut metadata = json!({
                        "name": "p",
                        "namespace": "t",
                        "annotations": {"a": "b"},
                        "ownerReferences": [{"apiVersion": "v1", "kind": "ReplicaSet", "name": "r", "uid": "u"}],
                        "managedFields": [{"manager": "kubectl", "operation": "Apply"}],
                    });
                    if labelled {
                        metadata["labels"] = json!({"app": "x"});
                    }
                    serde_json::from_value(json!({"metadata": metadata, "spec": spec, "status": status}))
                        .unwrap()
                },
            )
    }

    proptest! {
        /// What the controller reads from its stripped caches is what `plan` reads from whole
        /// pods: the same GPU pods, VM pods, requests (init containers included) and demand.
        #[test]
        fn readers_read_the_same_from_stripped_pods(p in pod_gen()) {
            let mut bound = p.clone();
            strip_bound(&mut bound);
            prop_assert_eq!(gpu_pods([&bound]), gpu_pods([&p]));
            let mut pending = p.clone();
            strip_pending(&mut pending);
            prop_assert_eq!(pending_pod(&pending), pending_pod(&p));
        }
    }

    /// The caches keep init containers' requests (the scheduler counts an init container's
    /// request when it is the largest), and nothing else of a container.
    #[test]
    fn a_pod_served_through_dra_holds_no_device_plugin_gpu() {
        let mut p = pod(Some("n"), &["1"], None);
        assert_eq!(gpu_pods([&p]).gpu_pods["n"].len(), 1);
        p.status = Some(serde_json::from_value(serde_json::json!({
            "extendedResourceClaimStatus": {"resourceClaimName": "p-extended-resources-abcde",
                "requestMappings": [{"containerName": "c", "resourceName": "nvidia.com/gpu", "requestName": "container-0-request-0"}]}
        })).unwrap());
        assert!(served_by_dra(&p));
        let read = gpu_pods([&p]);
        assert!(read.gpu_pods.is_empty() && read.requests.is_empty());
        // The claim serves another resource only (a NIC through another driver's class):
        // the GPU is the device plugin's.
        let mut nic = p.clone();
        nic.status
            .as_mut()
            .unwrap()
            .extended_resource_claim_status
            .as_mut()
            .unwrap()
            .request_mappings[0]
            .resource_name = "example.com/nic".into();
        assert!(!served_by_dra(&nic));
        let mut stripped = nic.clone();
        strip_bound(&mut stripped);
        assert!(!served_by_dra(&stripped));
        let mut stripped = p.clone();
        strip_bound(&mut stripped);
        assert!(served_by_dra(&stripped));
        // What a drain of a node leaving the DRA driver evicts, with what neverEvict reads.
        let id = format!("{}/{}", p.namespace().unwrap_or_default(), p.name_any());
        assert_eq!(read.dra_pods["n"], std::slice::from_ref(&id));
        assert!(read.gpu_pod_details.contains_key(&id));
    }

    #[test]
    fn stripping_keeps_init_requests_and_drops_the_rest() {
        let mut p = pod(Some("n"), &["1"], Some("4"));
        p.spec.as_mut().unwrap().containers[0].image = Some("app".into());
        strip_bound(&mut p);
        assert_eq!(gpu_requests(&p)["nvidia.com/gpu"], 4);
        assert_eq!(p.spec.as_ref().unwrap().containers[0].image, None);
    }

    /// A pod author writes the quantities: a request no node can hold is clamped, so the sums
    /// over a node's pods (and the demand's products of them) cannot overflow.
    #[test]
    fn requests_are_clamped_and_summed_without_overflow() {
        let max = "9223372036854775807";
        let huge = pod(Some("n"), &[max, max], None);
        assert_eq!(gpu_requests(&huge)["nvidia.com/gpu"], MAX_DEVICE_REQUEST);
        assert_eq!(gpu_requests(&pod(None, &["-5"], None))["nvidia.com/gpu"], 0);
        // Init containers count by their largest, as the scheduler counts them.
        assert_eq!(
            gpu_requests(&pod(None, &["1", "2"], Some("5")))["nvidia.com/gpu"],
            5
        );
        let many: Vec<Pod> = (0..3)
            .map(|i| {
                let mut p = huge.clone();
                p.metadata.name = Some(format!("p{i}"));
                p
            })
            .collect();
        let read = gpu_pods(&many);
        assert_eq!(read.requests["n"]["nvidia.com/gpu"], 3 * MAX_DEVICE_REQUEST);
        assert_eq!(read.gpu_pods["n"].len(), 3);
    }
}
