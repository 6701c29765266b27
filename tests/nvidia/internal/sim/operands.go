package sim

import (
	"fmt"
	"sort"
	"strings"
)

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
	withdraw(n, p, fmt.Sprintf("device plugin not deployed (%s!=true)", LabelDeployDevicePlugin))
}

// PlanDevicePluginPaused simulates the node while the MIG manager reconfigures
// its GPUs: the real one labels the device plugin, GFD and DCGM
// paused-for-mig-change (their DaemonSets select "true", so their pods go)
// before it touches a GPU and restores them when done. Running pods keep
// running; the kubelet marks the plugin's devices unhealthy, so no new GPU pod
// is admitted anywhere on the node until the plugin is back, and the plugin
// loads its config afresh after.
func PlanDevicePluginPaused(n *Node, p *Patch) {
	withdraw(n, p, "device plugin paused for the MIG change")
}

func withdraw(n *Node, p *Patch, why string) {
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
		sort.Strings(names)
		p.logf("%s: allocatable %s -> 0, capacity kept", why, strings.Join(names, ","))
	}
	p.delAnn(n, AnnDPLoaded)
	p.delAnn(n, AnnDPResources)
}
