package nvconf

import (
	"encoding/json"
	"fmt"
	"sort"

	vgpuv1 "github.com/NVIDIA/vgpu-device-manager/api/spec/v1"
	"sigs.k8s.io/yaml"
)

// LoadVgpuConfig parses a vGPU-devices config with the vGPU Device
// Manager's own types (sigs.k8s.io/yaml -> strict v1.Spec UnmarshalJSON,
// which also validates every vGPU type name and count).
func LoadVgpuConfig(data []byte) (*vgpuv1.Spec, error) {
	js, err := yaml.YAMLToJSON(data)
	if err != nil {
		return nil, fmt.Errorf("error parsing config file: %v", err)
	}
	var spec vgpuv1.Spec
	if err := json.Unmarshal(js, &spec); err != nil {
		return nil, fmt.Errorf("error parsing config file: %v", err)
	}
	return &spec, nil
}

// SelectVgpuConfig is what the vGPU Device Manager does with the node
// label's value: the named config must be present.
func SelectVgpuConfig(spec *vgpuv1.Spec, name string) (vgpuv1.VGPUConfigSpecSlice, error) {
	c, ok := spec.VGPUConfigs[name]
	if !ok {
		return nil, fmt.Errorf("selected vgpu-config not present: %s", name)
	}
	return c, nil
}

// VgpuDevices returns, per vGPU type, the devices a config slice creates on
// a node with gpus GPUs of the given PCI device ID (entries with a device
// filter apply only to matching GPUs; devices: all or listed indices).
func VgpuDevices(slice vgpuv1.VGPUConfigSpecSlice, gpus int, deviceID string) map[string]int {
	out := map[string]int{}
	for _, e := range slice {
		if !matchesFilter(e.DeviceFilter, deviceID) {
			continue
		}
		n := 0
		switch d := e.Devices.(type) {
		case string:
			n = gpus
		case []int:
			for _, i := range d {
				if i < gpus {
					n++
				}
			}
		}
		for t, c := range e.VGPUDevices {
			out[t] += c * n
		}
	}
	return out
}

func matchesFilter(filter interface{}, deviceID string) bool {
	var list []string
	switch f := filter.(type) {
	case string:
		if f != "" {
			list = []string{f}
		}
	case []string:
		list = f
	}
	if len(list) == 0 {
		return true
	}
	for _, f := range list {
		if f == deviceID {
			return true
		}
	}
	return false
}

// SortedTypes lists a devices map's vGPU types in order.
func SortedTypes(m map[string]int) []string {
	var ts []string
	for t := range m {
		ts = append(ts, t)
	}
	sort.Strings(ts)
	return ts
}
