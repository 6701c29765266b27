//! Pods -> the planner's facts about them: which pods use GPUs on which node (the idle-GPU wait
//! before MIG changes, and drains), with their labels (`disruption.neverEvict`), and which run
//! VMs on a node (pods asking for the sandbox device plugin's resources).

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{NodeSelectorTerm, Pod};
use kube::ResourceExt;

use crate::plan::input::{GpuPod, PendingPod, Requirement};
use crate::plan::is_device_plugin_resource;
use crate::plan::taint::Toleration;

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
    /// Labels and priorities of the pods in `gpu_pods`, by `namespace/name`.
    pub gpu_pod_details: BTreeMap<String, GpuPod>,
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
        let (gpu, vm) = (uses_gpu(p), uses_vm_gpu(p));
        let Some(node) = p.spec.as_ref().and_then(|s| s.node_name.clone()) else {
            continue;
        };
        if !gpu && !vm {
            continue;
        }
        let id = format!("{}/{}", p.namespace().unwrap_or_default(), p.name_any());
        if vm {
            out.vm_pods
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
            let details = GpuPod {
                labels: p.labels().clone().into(),
                priority: p.spec.as_ref().and_then(|s| s.priority).unwrap_or(0),
            };
            out.gpu_pod_details.insert(id.clone(), details);
            out.gpu_pods.entry(node).or_default().push(id);
        }
    }
    for v in out.gpu_pods.values_mut().chain(out.vm_pods.values_mut()) {
        v.sort();
    }
    out
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
