package sim

import "strings"

// LabelDeployDevicePlugin is the GPU Operator's per-node switch of the
// device-plugin DaemonSet, which selects only "true".
const LabelDeployDevicePlugin = "nvidia.com/gpu.deploy.device-plugin"

// PlanOperandLabels plays the GPU Operator's node labelling: on a GPU node it
// sets the device-plugin switch to "true" only where the label is absent or
// empty, so a "false" someone set keeps the device plugin off.
func PlanOperandLabels(n *Node, p *Patch) {
	if n.Labels[LabelDeployDevicePlugin] == "" {
		p.setLabel(n, LabelDeployDevicePlugin, "true")
		p.logf("labelled %s=true (as the GPU Operator does where it is absent)", LabelDeployDevicePlugin)
	}
}

// DevicePluginDeployed reports whether the device-plugin DaemonSet runs a
// pod on the node (its node selector wants "true"; an absent label is about
// to be set to "true" by the GPU Operator).
func DevicePluginDeployed(n *Node) bool {
	v := n.Labels[LabelDeployDevicePlugin]
	return v == "" || v == "true"
}

// PlanDevicePluginGone simulates the kubelet once the device-plugin pod is
// gone from the node: the plugin's resources drop to 0 allocatable while
// their capacity lingers, and the next deployment loads its config afresh.
func PlanDevicePluginGone(n *Node, p *Patch) {
	alloc := map[string]string{}
	for r, v := range n.Allocatable {
		if IsGPUResource(r) && v != "0" {
			alloc[r] = "0"
		}
	}
	if len(alloc) > 0 {
		p.Allocatable = alloc
		var names []string
		for r := range alloc {
			names = append(names, r)
		}
		p.logf("device plugin not deployed (%s!=true): allocatable %s -> 0, capacity kept", LabelDeployDevicePlugin, strings.Join(names, ","))
	}
	p.delAnn(n, AnnDPLoaded)
	p.delAnn(n, AnnDPResources)
}
