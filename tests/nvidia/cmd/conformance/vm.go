package main

import (
	"gpusharing.io/tests/nvidia/internal/nvconf"
	"gpusharing.io/tests/nvidia/internal/policy"
)

// vmCorpus: valid VM policies (vGPU named and custom, passthrough), each
// rendered with nodes so that the workload labels and the vGPU-devices
// config the nodes get are checked with NVIDIA's vGPU Device Manager types.
func vmCorpus() []corpusFile {
	var files []corpusFile
	add := func(name, nodes string, ps ...policy.Policy) {
		files = append(files, corpusFile{name: name, policies: ps, nodes: nodes})
	}
	vgpu := func(name string, v policy.VGPUSpec) policy.Policy {
		p := newPolicy(name, policy.VGPU)
		p.Spec.VGPU = &v
		return p
	}
	for _, c := range []struct {
		name, t, product string
		memMiB           int
	}{
		{"vgpu-l4-6q", "L4-6Q", "NVIDIA-L4", 23034},
		{"vgpu-a100d-1-10c", "A100D-1-10C", "NVIDIA-A100-SXM4-80GB", 81920},
		{"vgpu-h200-141c", "H200-141C", "NVIDIA-H200", 143771},
	} {
		add(c.name, gpuNode(c.name+"-0", c.name, c.product, c.memMiB, 8), vgpu(c.name, policy.VGPUSpec{Type: c.t}))
	}
	add("vgpu-custom-split", gpuNode("vgpu-custom-split-0", "vgpu-custom-split", "NVIDIA-A100-SXM4-80GB", 81920, 8),
		vgpu("vgpu-custom-split", policy.VGPUSpec{CustomLayout: []policy.VGPUDeviceGroup{
			{Devices: []int{0, 1}, VGPUDevices: map[string]int{"A100D-1-10C": 4, "A100D-3-40C": 1}},
			{Devices: []int{2, 3}, VGPUDevices: map[string]int{"A100D-20C": 4}},
		}}))
	add("vgpu-custom-all", "", vgpu("vgpu-custom-all", policy.VGPUSpec{CustomLayout: []policy.VGPUDeviceGroup{
		{VGPUDevices: map[string]int{"L4-12Q": 2}},
	}}))
	add("passthrough", gpuNode("passthrough-0", "passthrough", "NVIDIA-H100-80GB-HBM3", 81559, 9),
		newPolicy("passthrough", policy.Passthrough))
	// A VM policy beside container ones: one backend per node, sandbox workloads on.
	add("vm-beside-containers", gpuNode("vm-beside-0", "vm-beside-vm", "NVIDIA-L4", 23034, 8)+
		gpuNode("vm-beside-1", "vm-beside-ts", "NVIDIA-L4", 23034, 8),
		vgpu("vm-beside-vm", policy.VGPUSpec{Type: "L4-4Q"}),
		timeSlicing("vm-beside-ts", policy.Sharing{Replicas: ptr(4)}))
	return files
}

// vmInvalidCases: VM policies render must reject; where the rule is the vGPU
// Device Manager's, the naive config is loaded with NVIDIA's own types
// (github.com/NVIDIA/vgpu-device-manager v0.4.2) to show it fails there.
func vmInvalidCases() []invalidCase {
	one := func(name, spec string, fields []string, n *naive) invalidCase {
		return invalidCase{name: name, yaml: pol(name, spec), policies: []string{name}, fields: fields, naive: n}
	}
	// NVIDIA's named entries have the type's name (an L4-7Q does not exist).
	const l4Named = "version: v1\nvgpu-configs:\n  L4-6Q:\n  - devices: all\n    vgpu-devices:\n      L4-6Q: 4\n"
	custom := func(devices string) string {
		return "version: v1\nvgpu-configs:\n  custom:\n  - devices: all\n    vgpu-devices:\n" + indent(devices, "      ")
	}
	return []invalidCase{
		one("vgpu-lowercase-type", `
strategy: vgpu
vgpu:
  customLayout:
  - vgpuDevices:
      l4-6q: 4
`, []string{"spec.vgpu.customLayout[0].vgpuDevices"}, &naive{vgpu: custom("l4-6q: 4"), vgpuName: "custom", rejected: true}),
		one("vgpu-mixed-series", `
strategy: vgpu
vgpu:
  customLayout:
  - vgpuDevices:
      A100D-1-10C: 2
      A100D-20C: 1
`, []string{"cannot mix"}, &naive{vgpu: custom("A100D-1-10C: 2\nA100D-20C: 1"), vgpuName: "custom", rejected: true}),
		one("vgpu-zero-count", `
strategy: vgpu
vgpu:
  customLayout:
  - vgpuDevices:
      L4-6Q: 0
`, []string{"spec.vgpu.customLayout[0].vgpuDevices"}, &naive{vgpu: custom("L4-6Q: 0"), vgpuName: "custom", rejected: true}),
		one("vgpu-unknown-type", `
strategy: vgpu
vgpu:
  type: L4-7Q
`, []string{"spec.vgpu.type"}, &naive{vgpu: l4Named, vgpuName: "L4-7Q", rejected: true}),
		one("vgpu-without-settings", `
strategy: vgpu
`, []string{"spec.vgpu"}, nil),
		one("vgpu-both-type-and-layout", `
strategy: vgpu
vgpu:
  type: L4-6Q
  customLayout:
  - vgpuDevices:
      L4-6Q: 4
`, []string{"exactly one"}, nil),
		one("vgpu-through-dra", `
strategy: vgpu
vgpu:
  type: L4-6Q
backend: dra
dra:
  namespaces: [vms]
`, []string{"spec.backend"}, nil),
		one("passthrough-with-vgpu", `
strategy: passthrough
vgpu:
  type: L4-6Q
`, []string{"spec.vgpu"}, nil),
	}
}

// checkVgpu loads a naive vGPU-devices config with the vGPU Device
// Manager's types and selects the named config.
func (n *naive) checkVgpu() error {
	spec, err := nvconf.LoadVgpuConfig([]byte(n.vgpu))
	if err != nil {
		return err
	}
	_, err = nvconf.SelectVgpuConfig(spec, n.vgpuName)
	return err
}
