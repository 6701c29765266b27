package sim

import (
	"fmt"
	"regexp"
	"sort"
	"strconv"
	"strings"

	"github.com/NVIDIA/go-nvlib/pkg/pciids"

	"gpusharing.io/tests/nvidia/internal/nvconf"
)

// Sandbox (VM) workloads of the GPU Operator.
const (
	LabelWorkload   = "nvidia.com/gpu.workload.config"
	LabelVgpuConfig = "nvidia.com/vgpu.config"
	LabelVgpuState  = "nvidia.com/vgpu.config.state"
	WorkloadVgpu    = "vm-vgpu"
	WorkloadPass    = "vm-passthrough"
	WorkloadCtr     = "container"
	// DefaultVgpuConfigMap is the GPU Operator's vGPU-devices ConfigMap.
	DefaultVgpuConfigMap = "default-vgpu-devices-config"
	// AnnAppliedVgpu: the last nvidia.com/vgpu.config value the simulated
	// vGPU Device Manager acted on.
	AnnAppliedVgpu = AnnPrefix + "applied-vgpu-config"
	AnnVgpuError   = AnnPrefix + "vgpu-device-manager-error"
)

// Workload is what the GPU Operator deploys on the node: its
// nvidia.com/gpu.workload.config when sandbox workloads are enabled and the
// value is valid, else the default workload (container without sandbox
// workloads).
func Workload(n *Node, cp ClusterPolicy) string {
	if !cp.SandboxEnabled {
		return WorkloadCtr
	}
	switch v := n.Labels[LabelWorkload]; v {
	case WorkloadCtr, WorkloadPass, WorkloadVgpu:
		return v
	}
	if cp.DefaultWorkload != "" {
		return cp.DefaultWorkload
	}
	return WorkloadCtr
}

// pciIDs is NVIDIA's copy of the PCI ID database (go-nvlib's pci.ids), where
// the sandbox device plugin looks its GPUs' names up.
var pciIDs = pciids.NewDB()

// PCIName is the resource name the sandbox device plugin uses for a GPU
// handed through whole: the product's PCI device name from pci.ids, upper-cased,
// '/', '.' and runs of whitespace made '_', and anything but letters, digits
// and '_' dropped (NVIDIA/kubevirt-gpu-device-plugin's getDeviceName). A
// product without a known device ID keeps its upper-cased GFD name.
func PCIName(product string) string {
	if id, err := strconv.ParseUint(strings.TrimPrefix(deviceIDs[product], "0x"), 16, 32); err == nil {
		if name, err := pciIDs.GetDeviceName(0x10de, uint16(id>>16)); err == nil {
			return sandboxDeviceName(name)
		}
	}
	return strings.ToUpper(strings.ReplaceAll(strings.TrimPrefix(product, "NVIDIA-"), "-", "_"))
}

var (
	whitespace  = regexp.MustCompile(`\s+`)
	notNameChar = regexp.MustCompile(`[^A-Za-z0-9_]+`)
)

func sandboxDeviceName(pciName string) string {
	n := strings.ToUpper(strings.TrimSpace(pciName))
	n = strings.NewReplacer("/", "_", ".", "_").Replace(n)
	n = whitespace.ReplaceAllString(n, "_")
	return notNameChar.ReplaceAllString(n, "")
}

// SandboxInput is what the simulated sandbox operands read: the vGPU
// Device Manager's config (the ConfigMap named by
// spec.vgpuDeviceManager.config.name), whether the vGPU Manager runs
// (spec.vgpuManager.enabled) and whether the KubeVirt sandbox device plugin
// is deployed (spec.sandboxWorkloads.mode kubevirt).
type SandboxInput struct {
	Config      string
	Source      string
	Err         error
	VgpuManager bool
	KubeVirt    bool
}

// PlanSandbox simulates a VM node: the container stack (device plugin, GFD,
// MIG manager) is not deployed, so the device plugin's allocatable drops;
// the vGPU Device Manager (vm-vgpu) applies nvidia.com/vgpu.config with
// NVIDIA's parser; the sandbox device plugin advertises passthrough GPUs as
// nvidia.com/<PCI device name> and vGPUs as nvidia.com/<mdev type>.
func PlanSandbox(n *Node, hw Hardware, workload string, in SandboxInput, p *Patch) {
	alloc := map[string]string{}
	for r, v := range n.Allocatable {
		if IsGPUResource(r) && v != "0" {
			alloc[r] = "0"
		}
	}
	want := map[string]string{}
	switch {
	case !in.KubeVirt:
		// mode kata: no KubeVirt device plugin advertises anything.
	case workload == WorkloadPass:
		want["nvidia.com/"+PCIName(hw.Product)] = fmt.Sprint(hw.Count)
	case workload == WorkloadVgpu && in.VgpuManager:
		for t, c := range planVgpuManager(n, hw, in, p) {
			want["nvidia.com/NVIDIA_"+t] = fmt.Sprint(c)
		}
	}
	setSandboxResources(n, want, alloc)
	if len(alloc) > 0 {
		p.Allocatable = alloc
		p.logf("sandbox device plugin (%s): allocatable %s", workload, formatStrings(alloc))
	}
	p.delAnn(n, AnnDPLoaded)
	p.delAnn(n, AnnDPResources)
}

// PlanSandboxGone: on a container node the sandbox device plugin does not
// run; its resources drop to 0 allocatable.
func PlanSandboxGone(n *Node, p *Patch) {
	alloc := map[string]string{}
	setSandboxResources(n, nil, alloc)
	if len(alloc) > 0 {
		if p.Allocatable == nil {
			p.Allocatable = map[string]string{}
		}
		for k, v := range alloc {
			p.Allocatable[k] = v
		}
		p.logf("sandbox device plugin gone: allocatable %s", formatStrings(alloc))
	}
	p.delAnn(n, AnnAppliedVgpu)
}

// setSandboxResources puts into alloc the sandbox resources that differ
// from want (absent ones in want go to 0).
func setSandboxResources(n *Node, want map[string]string, alloc map[string]string) {
	for r, v := range n.Allocatable {
		if strings.HasPrefix(r, "nvidia.com/") && !IsGPUResource(r) {
			if _, ok := want[r]; !ok && v != "0" {
				alloc[r] = "0"
			}
		}
	}
	for r, v := range want {
		if n.Allocatable[r] != v {
			alloc[r] = v
		}
	}
}

// planVgpuManager acts when nvidia.com/vgpu.config differs from the last
// value acted on: parse the config with NVIDIA's api/spec/v1, select the
// named entry, report success (with the devices created) or failed. It
// returns the vGPU devices the node has afterwards, by type.
func planVgpuManager(n *Node, hw Hardware, in SandboxInput, p *Patch) map[string]int {
	desired := n.Labels[LabelVgpuConfig]
	if desired == "" {
		desired = "default"
	}
	devices := func() (map[string]int, error) {
		if in.Err != nil {
			return nil, in.Err
		}
		spec, err := nvconf.LoadVgpuConfig([]byte(in.Config))
		if err != nil {
			return nil, fmt.Errorf("%v (%s)", err, in.Source)
		}
		slice, err := nvconf.SelectVgpuConfig(spec, desired)
		if err != nil {
			return nil, err
		}
		return nvconf.VgpuDevices(slice, hw.Count, hw.DeviceID), nil
	}
	got, err := devices()
	if n.Annotations[AnnAppliedVgpu] == desired {
		if err != nil {
			return nil
		}
		return got
	}
	p.setAnn(n, AnnAppliedVgpu, desired)
	if err != nil {
		p.setLabel(n, LabelVgpuState, StateFailed)
		p.setAnn(n, AnnVgpuError, err.Error())
		p.logf("vGPU config %q failed: %v", desired, err)
		return nil
	}
	p.setLabel(n, LabelVgpuState, StateSuccess)
	p.delAnn(n, AnnVgpuError)
	p.logf("vGPU config %q applied: %s", desired, formatInts(got))
	return got
}

func formatStrings(m map[string]string) string {
	var parts []string
	for k, v := range m {
		parts = append(parts, k+"="+v)
	}
	sort.Strings(parts)
	return strings.Join(parts, " ")
}

func formatInts(m map[string]int) string {
	var parts []string
	for _, t := range nvconf.SortedTypes(m) {
		parts = append(parts, fmt.Sprintf("%s=%d", t, m[t]))
	}
	if len(parts) == 0 {
		return "none"
	}
	return strings.Join(parts, " ")
}
