package main

import (
	"fmt"
	"strings"

	"gpusharing.io/tests/nvidia/internal/policy"
)

// draPolicy is a policy with backend dra.
func draPolicy(p policy.Policy, d policy.DRASpec) policy.Policy {
	p.Spec.Backend = policy.BackendDRA
	p.Spec.DRA = &d
	return p
}

func gates(names ...string) map[string]bool {
	m := map[string]bool{}
	for _, n := range names {
		m[n] = true
	}
	return m
}

// gpuNodes is a Nodes manifest: name -> (pool, product, GPU memory MiB,
// compute major).
func gpuNode(name, pool, product string, memMiB, major int) string {
	return fmt.Sprintf(`---
apiVersion: v1
kind: Node
metadata:
  name: %s
  labels:
    kubernetes.io/hostname: %s
    nvidia.com/gpu.present: 'true'
    nvidia.com/gpu.product: %s
    nvidia.com/gpu.count: '4'
    nvidia.com/gpu.memory: '%d'
    nvidia.com/gpu.compute.major: '%d'
    nvidia.com/gpu.compute.minor: '0'
    gpusharing.io/pool: %s
status:
  capacity:
    nvidia.com/gpu: '4'
`, name, name, product, memMiB, major, pool)
}

// draCorpus: valid DRA policies (ResourceClaimTemplates with a GpuConfig).
func draCorpus() []corpusFile {
	var files []corpusFile
	add := func(name, nodes string, ps ...policy.Policy) {
		files = append(files, corpusFile{name: name, policies: ps, nodes: nodes})
	}
	mpsDefaults := func(name string) policy.Policy {
		return draPolicy(mps(name, policy.Sharing{Replicas: ptr(4)}), policy.DRASpec{
			Namespaces:         []string{"team-a", "team-b"},
			DriverFeatureGates: gates("MPSSupport"),
		})
	}
	// MPS with the defaults: threads 100/4; no pinned memory without nodes.
	add("dra-mps-defaults", "", mpsDefaults("dra-mps-defaults"))
	// With nodes: pinned memory = the smallest GPU memory / replicas.
	add("dra-mps-defaults-nodes",
		gpuNode("dra-h100-0", "dra-mps-defaults-nodes", "NVIDIA-H100-80GB-HBM3", 81559, 9)+
			gpuNode("dra-l40s-0", "dra-mps-defaults-nodes", "NVIDIA-L40S", 46068, 8),
		mpsDefaults("dra-mps-defaults-nodes"))
	// Three replicas: 100/3 rounds down.
	add("dra-mps-3", gpuNode("dra-a100-0", "dra-mps-3", "NVIDIA-A100-SXM4-80GB", 81920, 8),
		draPolicy(mps("dra-mps-3", policy.Sharing{Replicas: ptr(3)}), policy.DRASpec{
			Namespaces: []string{"ml"}, DriverFeatureGates: gates("MPSSupport", "TimeSlicingSettings"),
		}))
	// Everything explicit (the explicit memory wins over the nodes').
	add("dra-mps-explicit", gpuNode("dra-h100-1", "dra-mps-explicit", "NVIDIA-H100-80GB-HBM3", 81559, 9),
		draPolicy(mps("dra-mps-explicit", policy.Sharing{Replicas: ptr(2)}), policy.DRASpec{
			Namespaces:   []string{"gpu-test6"},
			TemplateName: "single-gpu.mps",
			MPS: &policy.DRAMPS{
				DefaultActiveThreadPercentage:  ptr(30),
				DefaultPinnedDeviceMemoryLimit: "10Gi",
				PerDevicePinnedMemoryLimits:    map[string]string{"0": "4Gi"},
				MultiUser:                      policy.Ptr(true),
			},
			DriverFeatureGates: gates("MPSSupport"),
		}))
	add("dra-mps-explicit-decimal", "",
		draPolicy(mps("dra-mps-explicit-decimal", policy.Sharing{Replicas: ptr(8)}), policy.DRASpec{
			Namespaces: []string{"a", "b", "c"},
			MPS: &policy.DRAMPS{
				DefaultActiveThreadPercentage:  ptr(0),
				DefaultPinnedDeviceMemoryLimit: "2G",
				MultiUser:                      policy.Ptr(false),
			},
			DriverFeatureGates: gates("MPSSupport"),
		}))
	// Time-slicing with each interval, and without one ("Default").
	for _, iv := range []string{"", "Default", "Short", "Medium", "Long"} {
		name := "dra-ts-" + strings.ToLower(iv)
		if iv == "" {
			name = "dra-ts-unset"
		}
		add(name, "", draPolicy(timeSlicing(name, policy.Sharing{Replicas: ptr(4)}), policy.DRASpec{
			Namespaces:          []string{"ts"},
			TimeSlicingInterval: iv,
			DriverFeatureGates:  gates("TimeSlicingSettings"),
		}))
	}
	// Exclusive: a plain claim, no config (no gate needed).
	add("dra-exclusive", "", draPolicy(newPolicy("dra-exclusive", policy.Exclusive), policy.DRASpec{
		Namespaces: []string{"default", "batch"},
	}))
	// DRA and device-plugin policies in one cluster.
	add("dra-mixed-backends",
		gpuNode("dra-mixed-0", "dra-mixed-mps", "NVIDIA-H200", 143771, 9)+
			gpuNode("dp-mixed-0", "dp-mixed-ts", "NVIDIA-L4", 23034, 8),
		draPolicy(mps("dra-mixed-mps", policy.Sharing{Replicas: ptr(2)}), policy.DRASpec{
			Namespaces: []string{"inference"}, DriverFeatureGates: gates("MPSSupport"),
		}),
		draPolicy(timeSlicing("dra-mixed-ts", policy.Sharing{Replicas: ptr(2)}), policy.DRASpec{
			Namespaces: []string{"inference"}, TimeSlicingInterval: "Short",
			DriverFeatureGates: gates("MPSSupport", "TimeSlicingSettings"),
		}),
		timeSlicing("dp-mixed-ts", policy.Sharing{Replicas: ptr(4)}),
		mps("dp-mixed-mps", policy.Sharing{Replicas: ptr(2)}),
	)
	return files
}
