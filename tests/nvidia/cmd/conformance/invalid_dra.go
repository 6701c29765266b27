package main

import (
	"gpusharing.io/tests/nvidia/internal/dra"
)

// gpuConfigYAML is a GpuConfig with a sharing body.
func gpuConfigYAML(sharing string) string {
	return "apiVersion: resource.nvidia.com/v1beta1\nkind: GpuConfig\nsharing:\n" + indent(sharing, "  ")
}

// draInvalidCases: DRA policies render must reject; where the rule is the
// DRA driver's, the naive GpuConfig is prepared with NVIDIA's driver code
// (sigs.k8s.io/dra-driver-nvidia-gpu v0.5.0) to show it fails there, later
// (when a pod's claim is prepared on a node).
func draInvalidCases() []invalidCase {
	one := func(name, spec string, fields []string, n *naive) invalidCase {
		return invalidCase{name: name, yaml: pol(name, spec), policies: []string{name}, fields: fields, naive: n}
	}
	mps50 := gpuConfigYAML("strategy: MPS\nmpsConfig:\n  defaultActiveThreadPercentage: 50\n")
	return []invalidCase{
		one("dra-mps-without-gate", `
strategy: mps
mps:
  replicas: 2
backend: dra
dra:
  namespaces: [ml]
`, []string{"MPSSupport"}, &naive{gpuConfig: mps50, gates: dra.Gates{}, rejected: true}),
		one("dra-ts-without-gate", `
strategy: timeSlicing
timeSlicing:
  replicas: 2
backend: dra
dra:
  namespaces: [ml]
  timeSlicingInterval: Short
  driverFeatureGates:
    MPSSupport: true
`, []string{"TimeSlicingSettings"}, &naive{gpuConfig: gpuConfigYAML("strategy: TimeSlicing\ntimeSlicingConfig:\n  interval: Short\n"),
			gates: dra.Gates{MPSSupport: true}, rejected: true}),
		one("dra-mps-with-dynamic-mig", `
strategy: mps
mps:
  replicas: 2
backend: dra
dra:
  namespaces: [ml]
  driverFeatureGates:
    MPSSupport: true
    DynamicMIG: true
`, []string{"DynamicMIG"}, &naive{gpuConfig: mps50, gates: dra.Gates{MPSSupport: true, DynamicMIG: true}, rejected: true}),
		one("dra-mps-with-consumable-shares", `
strategy: mps
mps:
  replicas: 2
backend: dra
dra:
  namespaces: [ml]
  driverFeatureGates:
    MPSSupport: true
    ConsumableShares: true
`, []string{"ConsumableShares"}, &naive{gpuConfig: mps50, gates: dra.Gates{MPSSupport: true, ConsumableShares: true}, rejected: true}),
		one("dra-mps-threads-101", `
strategy: mps
mps:
  replicas: 2
backend: dra
dra:
  namespaces: [ml]
  mps:
    defaultActiveThreadPercentage: 101
  driverFeatureGates:
    MPSSupport: true
`, []string{"defaultActiveThreadPercentage"}, &naive{gpuConfig: gpuConfigYAML("strategy: MPS\nmpsConfig:\n  defaultActiveThreadPercentage: 101\n"),
			gates: dra.Gates{MPSSupport: true}, rejected: true}),
		one("dra-mps-pinned-1Ki", `
strategy: mps
mps:
  replicas: 2
backend: dra
dra:
  namespaces: [ml]
  mps:
    defaultPinnedDeviceMemoryLimit: 1Ki
  driverFeatureGates:
    MPSSupport: true
`, []string{"defaultPinnedDeviceMemoryLimit"}, &naive{gpuConfig: gpuConfigYAML("strategy: MPS\nmpsConfig:\n  defaultActiveThreadPercentage: 50\n  defaultPinnedDeviceMemoryLimit: 1Ki\n"),
			gates: dra.Gates{MPSSupport: true}, rejected: true}),
		one("dra-mps-per-device-1Ki", `
strategy: mps
mps:
  replicas: 2
backend: dra
dra:
  namespaces: [ml]
  mps:
    perDevicePinnedMemoryLimits:
      "0": 1Ki
  driverFeatureGates:
    MPSSupport: true
`, []string{"perDevicePinnedMemoryLimits"}, &naive{gpuConfig: gpuConfigYAML("strategy: MPS\nmpsConfig:\n  defaultActiveThreadPercentage: 50\n  defaultPerDevicePinnedMemoryLimit:\n    \"0\": 1Ki\n"),
			gates: dra.Gates{MPSSupport: true}, rejected: true}),
		one("dra-mps-bad-quantity", `
strategy: mps
mps:
  replicas: 2
backend: dra
dra:
  namespaces: [ml]
  mps:
    defaultPinnedDeviceMemoryLimit: 10 GB
  driverFeatureGates:
    MPSSupport: true
`, []string{"defaultPinnedDeviceMemoryLimit"}, &naive{gpuConfig: gpuConfigYAML("strategy: MPS\nmpsConfig:\n  defaultActiveThreadPercentage: 50\n  defaultPinnedDeviceMemoryLimit: 10 GB\n"),
			gates: dra.Gates{MPSSupport: true}, rejected: true}),
		// Not a driver rule: the operator routes MIG through the device
		// plugin. A naive "MIG" sharing strategy is unknown to the driver.
		one("dra-strategy-mig", `
strategy: mig
mig:
  migStrategy: single
  layout: all-1g.10gb
backend: dra
dra:
  namespaces: [ml]
  driverFeatureGates:
    MPSSupport: true
    TimeSlicingSettings: true
`, []string{"spec.strategy", "backend"}, &naive{gpuConfig: gpuConfigYAML("strategy: MIG\n"),
			gates: dra.Gates{MPSSupport: true, TimeSlicingSettings: true}, rejected: true}),
		// Operator-level rules (no driver involved).
		one("dra-block-without-backend", `
strategy: mps
mps:
  replicas: 2
dra:
  namespaces: [ml]
  driverFeatureGates:
    MPSSupport: true
`, []string{"spec.dra"}, nil),
		one("dra-backend-without-block", `
strategy: mps
mps:
  replicas: 2
backend: dra
`, []string{"spec.dra"}, nil),
		one("dra-duplicate-namespaces", `
strategy: timeSlicing
timeSlicing:
  replicas: 2
backend: dra
dra:
  namespaces: [ml, batch, ml]
  driverFeatureGates:
    TimeSlicingSettings: true
`, []string{"spec.dra.namespaces"}, nil),
		one("dra-bad-interval", `
strategy: timeSlicing
timeSlicing:
  replicas: 2
backend: dra
dra:
  namespaces: [ml]
  timeSlicingInterval: Forever
  driverFeatureGates:
    TimeSlicingSettings: true
`, []string{"timeSlicingInterval"}, &naive{gpuConfig: gpuConfigYAML("strategy: TimeSlicing\ntimeSlicingConfig:\n  interval: Forever\n"),
			gates: dra.Gates{TimeSlicingSettings: true}, rejected: true}),
	}
}
