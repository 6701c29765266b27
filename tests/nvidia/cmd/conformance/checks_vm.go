package main

import (
	"fmt"
	"reflect"
	"regexp"

	vgpuv1 "github.com/NVIDIA/vgpu-device-manager/api/spec/v1"

	"gpusharing.io/tests/nvidia/internal/nvconf"
	"gpusharing.io/tests/nvidia/internal/policy"
	"gpusharing.io/tests/nvidia/internal/render"
	"gpusharing.io/tests/nvidia/internal/sim"
)

// customVgpuName is the content-addressed name of a custom vGPU layout.
var customVgpuName = regexp.MustCompile(`^custom-(.+)-([0-9a-f]{8})$`)

// vgpuConfig is the config the vGPU Device Manager would read: the
// rendered ConfigMap when the ClusterPolicy patch points it there, else
// the GPU Operator's default (--vgpu-config).
func (c *checker) vgpuConfig() (*vgpuv1.Spec, string) {
	if c.out.VgpuDevices == nil {
		return c.vgpuDefaults, "the GPU Operator's default-vgpu-devices-config"
	}
	spec, err := nvconf.LoadVgpuConfig([]byte(c.out.VgpuDevices.Data[render.MigPartedKey]))
	if err != nil {
		return nil, ""
	}
	return spec, render.VgpuDevicesConfigMap
}

// checkVgpuDevices parses the rendered vGPU-devices ConfigMap with NVIDIA's
// vGPU Device Manager types (strict: unknown fields, malformed vGPU types,
// zero counts and time-sliced/MIG-backed mixes are errors there), checks
// that NVIDIA's named configs are carried over unchanged, and that the
// ClusterPolicy points the vGPU Device Manager at it.
func (c *checker) checkVgpuDevices() {
	name, _ := render.Str(c.out.ClusterPolicy.Spec, "vgpuDeviceManager", "config", "name")
	if c.out.VgpuDevices == nil {
		for _, p := range c.policies {
			if p.Spec.VGPU != nil && len(p.Spec.VGPU.CustomLayout) > 0 && c.accepted(p.Metadata.Name) {
				c.r.fail("policy %s has a custom vGPU layout but no %s ConfigMap was rendered", p.Metadata.Name, render.VgpuDevicesConfigMap)
			}
		}
		if name != "" {
			c.r.fail("ClusterPolicy spec.vgpuDeviceManager.config.name=%q but no vGPU-devices ConfigMap was rendered", name)
		}
		return
	}
	spec, err := nvconf.LoadVgpuConfig([]byte(c.out.VgpuDevices.Data[render.MigPartedKey]))
	if err != nil {
		c.r.fail("the vGPU Device Manager rejects %s/%s: %v", render.VgpuDevicesConfigMap, render.MigPartedKey, err)
		return
	}
	if name != render.VgpuDevicesConfigMap {
		c.r.fail("ClusterPolicy spec.vgpuDeviceManager.config.name=%q, want %q", name, render.VgpuDevicesConfigMap)
	}
	if def, _ := render.Str(c.out.ClusterPolicy.Spec, "vgpuDeviceManager", "config", "default"); def != "" {
		if _, ok := spec.VGPUConfigs[def]; !ok {
			c.r.fail("ClusterPolicy spec.vgpuDeviceManager.config.default=%q is not a config of %s", def, render.VgpuDevicesConfigMap)
		}
	}
	if c.vgpuDefaults != nil {
		for k, v := range c.vgpuDefaults.VGPUConfigs {
			if got, ok := spec.VGPUConfigs[k]; !ok || !reflect.DeepEqual(got, v) {
				c.r.fail("vGPU config %q differs from NVIDIA's default config of that name (or is missing)", k)
				break
			}
		}
	}
}

// checkVMPolicy: a vgpu or passthrough policy renders no device-plugin key;
// a vgpu policy's config exists in what the vGPU Device Manager reads and,
// for a custom layout, says exactly what the policy says.
func (c *checker) checkVMPolicy(p *policy.Policy) {
	name := p.Metadata.Name
	st := c.out.Policies[name]
	if st == nil {
		c.r.fail("policy %s: no GpuSharingPolicy status document", name)
		return
	}
	if key, _ := render.Str(st.Status, "deviceConfigKey"); key != "" {
		c.r.fail("policy %s (%s): status.deviceConfigKey=%q: VM nodes run no container device plugin", name, p.Spec.Strategy, key)
	}
	if ok, msg := render.Accepted(st); !ok {
		c.r.note("policy %s not accepted by the operator: %s", name, msg)
		return
	}
	if p.Spec.Strategy != policy.VGPU || p.Spec.VGPU == nil {
		return
	}
	cfgName, _ := render.Str(st.Status, "vgpuConfig")
	spec, source := c.vgpuConfig()
	if spec == nil {
		c.r.note("policy %s: vGPU config %q not checked (no default vGPU-devices config given)", name, cfgName)
		return
	}
	slice, err := nvconf.SelectVgpuConfig(spec, cfgName)
	if err != nil {
		c.r.fail("policy %s: status.vgpuConfig=%q: the vGPU Device Manager would fail with %s: %v", name, cfgName, source, err)
		return
	}
	if len(p.Spec.VGPU.CustomLayout) == 0 {
		if cfgName != p.Spec.VGPU.Type {
			c.r.fail("policy %s: status.vgpuConfig=%q, want the named type %q", name, cfgName, p.Spec.VGPU.Type)
		}
		return
	}
	if m := customVgpuName.FindStringSubmatch(cfgName); m == nil {
		c.r.fail("policy %s: custom vGPU config %q is not custom-<policy>-<8 hex>", name, cfgName)
	}
	if len(slice) != len(p.Spec.VGPU.CustomLayout) {
		c.r.fail("policy %s: %s has %d entries, the policy %d groups", name, cfgName, len(slice), len(p.Spec.VGPU.CustomLayout))
		return
	}
	for i, g := range p.Spec.VGPU.CustomLayout {
		e := slice[i]
		var devices any = "all"
		if len(g.Devices) > 0 {
			devices = g.Devices
		}
		if fmt.Sprint(e.Devices) != fmt.Sprint(devices) || !reflect.DeepEqual(map[string]int(e.VGPUDevices), g.VGPUDevices) {
			c.r.fail("policy %s: %s entry %d is devices=%v vgpu-devices=%v, the policy says devices=%v vgpuDevices=%v", name, cfgName, i, e.Devices, e.VGPUDevices, devices, g.VGPUDevices)
		}
	}
}

// checkVMNode checks a node the render makes a VM host: never a sharing
// device-plugin config or an enabled MIG layout on it, sandbox workloads on
// in the ClusterPolicy, and its vGPU config present in what the vGPU Device
// Manager reads. It reports whether the node is a VM host (the container
// device plugin does not run there).
func (c *checker) checkVMNode(n *render.Object, labels map[string]string) bool {
	wl := labels[sim.LabelWorkload]
	if wl != sim.WorkloadVgpu && wl != sim.WorkloadPass {
		return false
	}
	if on, _ := c.out.ClusterPolicy.Spec["sandboxWorkloads"].(map[string]any); on == nil || on["enabled"] != true {
		c.r.fail("Node %s is labelled %s=%s but the ClusterPolicy patch does not enable sandboxWorkloads", n.Metadata.Name, sim.LabelWorkload, wl)
	}
	if key := labels[sim.LabelDPConfig]; key != "" && key != render.DefaultKey {
		c.r.fail("Node %s: a VM host (%s) with the sharing device-plugin config %q", n.Metadata.Name, wl, key)
	}
	if l := labels[sim.LabelMigConfig]; l != "" && l != sim.MigAllDisabled {
		c.r.fail("Node %s: a VM host (%s) with MIG layout %q", n.Metadata.Name, wl, l)
	}
	if wl == sim.WorkloadVgpu {
		spec, source := c.vgpuConfig()
		if cfg := labels[sim.LabelVgpuConfig]; spec != nil && cfg != "" {
			if _, err := nvconf.SelectVgpuConfig(spec, cfg); err != nil {
				c.r.fail("Node %s: label %s=%q: the vGPU Device Manager would fail with %s: %v", n.Metadata.Name, sim.LabelVgpuConfig, cfg, source, err)
			}
		}
	}
	return true
}
