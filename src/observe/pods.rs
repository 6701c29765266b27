//! Pods -> the planner's facts about them: which pods use GPUs on which node (the idle-GPU wait
//! before MIG changes, and drains), with their labels (`disruption.neverEvict`), and which run
//! VMs on a node (pods asking for the sandbox device plugin's resources).

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;

use crate::plan::{Labels, is_device_plugin_resource};

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
    /// Labels of the pods in `gpu_pods`, by `namespace/name`.
    pub gpu_pod_labels: BTreeMap<String, Labels>,
    /// Pods using the sandbox device plugin's resources (VMs), by node, sorted.
    pub vm_pods: BTreeMap<String, Vec<String>>,
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
            out.gpu_pod_labels
                .insert(id.clone(), p.labels().clone().into());
            out.gpu_pods.entry(node).or_default().push(id);
        }
    }
    for v in out.gpu_pods.values_mut().chain(out.vm_pods.values_mut()) {
        v.sort();
    }
    out
}
