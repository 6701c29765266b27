package nvconf

import (
	"fmt"
	"sort"
	"strings"

	spec "github.com/NVIDIA/k8s-device-plugin/api/config/v1"
	"golang.org/x/mod/semver"
)

// GPU is the MIG state of one physical GPU.
type GPU struct {
	MigEnabled bool
	// MigDevices: profile -> count of MIG devices created on this GPU.
	MigDevices map[string]int
}

// NodeHardware is what a simulated node has.
type NodeHardware struct {
	Product           string // GFD-sanitised model name, e.g. NVIDIA-A100-SXM4-80GB
	ComputeCapability string // e.g. "8.0"
	GPUs              []GPU
}

// NodeOutcome is what the device plugin advertises and GFD labels on a node
// for one loaded config.
type NodeOutcome struct {
	// Resources: extended resource name -> number of (replicated) devices.
	Resources map[string]int
	// Labels: the sharing-related GFD labels (gpu.count, gpu.product,
	// gpu.replicas, gpu.sharing-strategy, mig.strategy, mig-<profile>.*,
	// mps.capable).
	Labels map[string]string
}

// EvaluateNode models what NVIDIA's device plugin (internal/rm device map,
// MPS checks) and GPU Feature Discovery (internal/lm) do with the effective
// config on a node with the given hardware. It returns the error the device
// plugin would fail with. Behaviour reproduced from v0.19.1:
//   - migStrategy none: every GPU is a full nvidia.com/gpu device.
//   - single: MIG devices become nvidia.com/gpu; all GPUs must be MIG-enabled,
//     non-empty, with one profile.
//   - mixed: MIG devices become nvidia.com/mig-<profile> ('+' -> '.').
//   - sharing replicates each listed resource's devices Replicas times under
//     Rename (if set) or Name; unlisted resources stay unreplicated.
//   - MPS: not on MIG devices, at most 48 replicas (16 below CC 7.5).
func EvaluateNode(cfg *spec.Config, hw NodeHardware) (*NodeOutcome, error) {
	strategy := spec.MigStrategyNone
	if cfg.Flags.MigStrategy != nil {
		strategy = *cfg.Flags.MigStrategy
	}

	// device map before replication: resource -> device count
	devices := map[string]int{}
	type migType struct {
		resource string
		count    int
	}
	migTypes := map[string]*migType{} // profile -> info
	var profiles []string
	nonMig, migEnabled, emptyMig := 0, 0, 0
	for _, g := range hw.GPUs {
		if !g.MigEnabled || strategy == spec.MigStrategyNone {
			nonMig++
			continue
		}
		migEnabled++
		n := 0
		for p, c := range g.MigDevices {
			if c <= 0 {
				continue
			}
			n += c
			mt := migTypes[p]
			if mt == nil {
				mt = &migType{}
				migTypes[p] = mt
				profiles = append(profiles, p)
			}
			mt.count += c
		}
		if n == 0 {
			emptyMig++
		}
	}
	sort.Strings(profiles)
	if nonMig > 0 {
		devices["nvidia.com/gpu"] = nonMig
	}

	switch strategy {
	case spec.MigStrategyNone:
	case spec.MigStrategySingle:
		if migEnabled > 0 {
			switch {
			case emptyMig > 0:
				return nil, fmt.Errorf("error building device map from config.resources: invalid MIG configuration: at least one device with migEnabled=true was not configured correctly: device has no MIG devices configured")
			case len(profiles) > 1:
				return nil, fmt.Errorf("error building device map from config.resources: invalid MIG configuration: more than one MIG device type present on node")
			case nonMig > 0:
				return nil, fmt.Errorf("error building device map from config.resources: all devices on the node must be configured with the same migEnabled value")
			}
			for _, p := range profiles {
				devices["nvidia.com/gpu"] += migTypes[p].count
				migTypes[p].resource = "nvidia.com/gpu"
			}
		}
	case spec.MigStrategyMixed:
		for _, p := range profiles {
			name, ok, err := MigResourceName(p)
			if err != nil || !ok {
				return nil, fmt.Errorf("error building device map from config.resources: error building MIG device map: MIG profile '%v' does not match any resource patterns", p)
			}
			migTypes[p].resource = name
			devices[name] += migTypes[p].count
		}
	default:
		return nil, fmt.Errorf("unknown MIG strategy: %v", strategy)
	}

	rrs := cfg.Sharing.ReplicatedResources()
	sharingStrategy := cfg.Sharing.SharingStrategy()
	replicaOf := map[string]*spec.ReplicatedResource{}
	for i := range rrs.Resources {
		r := &rrs.Resources[i]
		if _, dup := replicaOf[string(r.Name)]; !dup {
			replicaOf[string(r.Name)] = r
		}
	}

	// MPS checks (internal/plugin/mps.go, cmd/mps-control-daemon/mps).
	if sharingStrategy == spec.SharingStrategyMPS {
		// The plugin's flag validation (cmd/nvidia-device-plugin validateFlags).
		if strategy == spec.MigStrategyMixed {
			return nil, fmt.Errorf("using --mig-strategy=mixed is not supported with MPS")
		}
		if strategy == spec.MigStrategySingle && migEnabled > 0 {
			return nil, fmt.Errorf("sharing using MPS is not supported for MIG devices")
		}
		for name, n := range devices {
			r := replicaOf[name]
			if n == 0 || r == nil || r.Replicas <= 1 {
				continue
			}
			if max := maxMPSClients(hw.ComputeCapability); r.Replicas > max {
				return nil, fmt.Errorf("invalid MPS configuration: invalid device maximum allowed replicas exceeded: %d > %d", r.Replicas, max)
			}
		}
	}

	out := &NodeOutcome{Resources: map[string]int{}, Labels: map[string]string{}}
	for name, n := range devices {
		r := replicaOf[name]
		if r == nil || n == 0 {
			out.Resources[name] += n
			continue
		}
		target := name
		if r.Rename != "" {
			target = string(r.Rename)
		}
		out.Resources[target] += n * r.Replicas
	}

	// GFD labels.
	label := func(resource, product string, count, replicas int, shared, renamed bool) {
		strategy := string(spec.SharingStrategyNone)
		if replicas > 1 {
			strategy = string(sharingStrategy)
		}
		if shared && !renamed {
			product += "-SHARED"
		}
		out.Labels[resource+".product"] = product
		out.Labels[resource+".count"] = fmt.Sprint(count)
		out.Labels[resource+".replicas"] = fmt.Sprint(replicas)
		out.Labels[resource+".sharing-strategy"] = strategy
	}
	replicasFor := func(resource string) (int, bool, bool) {
		if r := replicaOf[resource]; r != nil && r.Replicas > 0 {
			return r.Replicas, r.Replicas > 1, r.Rename != ""
		}
		return 1, false, false
	}
	product := hw.Product
	if migEnabled > 0 {
		// MIG-enabled GPUs are labelled without sharing (replicas 0).
		label("nvidia.com/gpu", product, len(hw.GPUs), 0, false, false)
	}
	if nonMig > 0 {
		rep, shared, renamed := replicasFor("nvidia.com/gpu")
		label("nvidia.com/gpu", product, len(hw.GPUs), rep, shared, renamed)
	}
	if strategy != spec.MigStrategyNone {
		out.Labels["nvidia.com/mig.strategy"] = strategy
	}
	for _, p := range profiles {
		mt := migTypes[p]
		name, _, _ := MigResourceName(p)
		if strategy == spec.MigStrategySingle {
			name = "nvidia.com/gpu"
		} else {
			// GFD names MIG labels "nvidia.com/mig-" + device name (no '+' mapping).
			name = "nvidia.com/mig-" + p
		}
		rep, shared, renamed := replicasFor(mt.resource)
		label(name, product+"-MIG-"+p, mt.count, rep, shared, renamed)
	}
	out.Labels["nvidia.com/mps.capable"] = "false"
	if sharingStrategy == spec.SharingStrategyMPS {
		if migEnabled > 0 {
			return nil, fmt.Errorf("failed to check MPS-capable: MPS sharing is not supported for mig devices")
		}
		out.Labels["nvidia.com/mps.capable"] = "true"
	}
	return out, nil
}

// maxMPSClients: 48 from compute capability 7.5 on, else 16
// (cmd/mps-control-daemon/mps/device.go). Unknown capability: 48.
func maxMPSClients(cc string) int {
	if cc == "" {
		return 48
	}
	v := "v" + strings.TrimPrefix(cc, "v")
	if semver.Compare(semver.Canonical(v), semver.Canonical("v7.5")) >= 0 {
		return 48
	}
	return 16
}
