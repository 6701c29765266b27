package main

import (
	"os"
	"strings"
	"testing"

	"gpusharing.io/tests/nvidia/internal/policy"
	"gpusharing.io/tests/nvidia/internal/render"
)

func draFixture(t *testing.T) (string, []policy.Policy, []*render.Object) {
	t.Helper()
	read := func(f string) []byte {
		data, err := os.ReadFile("../../internal/render/testdata/" + f)
		if err != nil {
			t.Fatal(err)
		}
		return data
	}
	policies, err := policy.ParseFile(read("dra-policies.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	nodes, err := render.ParseObjects(read("dra-nodes.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	return string(read("dra.yaml")), policies, nodes
}

func checkDRA(t *testing.T, out string, policies []policy.Policy, nodes []*render.Object) *report {
	t.Helper()
	parsed, err := render.Parse([]byte(out), "gpu-operator")
	if err != nil {
		t.Fatal(err)
	}
	r := &report{}
	(&checker{out: parsed, policies: policies, r: r, nodes: nodes}).run()
	return r
}

func TestDRASampleConforms(t *testing.T) {
	out, policies, nodes := draFixture(t)
	if r := checkDRA(t, out, policies, nodes); len(r.errs) > 0 {
		t.Fatalf("rendered example must conform:\n%s", strings.Join(r.errs, "\n"))
	}
}

func TestDRAMismatchesAreReported(t *testing.T) {
	for name, tc := range map[string]struct {
		old, new, want string
		edit           func(*policy.Policy)
	}{
		"threads":                           {old: "defaultActiveThreadPercentage: 50", new: "defaultActiveThreadPercentage: 40", want: "defaultActiveThreadPercentage=40, want 50"},
		"threads 101":                       {old: "defaultActiveThreadPercentage: 50", new: "defaultActiveThreadPercentage: 101", want: "greater than 100"},
		"memory":                            {old: "defaultPinnedDeviceMemoryLimit: 10Gi", new: "defaultPinnedDeviceMemoryLimit: 9Gi", want: "defaultPinnedDeviceMemoryLimit=9Gi, want 10Gi"},
		"memory 0Mi":                        {old: "defaultPinnedDeviceMemoryLimit: 10Gi", new: "defaultPinnedDeviceMemoryLimit: 0Mi", want: "too low"},
		"unknown field":                     {old: "defaultPinnedDeviceMemoryLimit: 10Gi", new: "pinnedMemory: 10Gi", want: "unknown field"},
		"strategy case":                     {old: "strategy: MPS", new: "strategy: mps", want: "unknown GPU sharing strategy"},
		"device class":                      {old: "deviceClassName: gpu.nvidia.com", new: "deviceClassName: mig.nvidia.com", want: "deviceClassName=\"mig.nvidia.com\""},
		"driver":                            {old: "driver: gpu.nvidia.com", new: "driver: compute-domain.nvidia.com", want: "opaque driver"},
		"config request":                    {old: "        requests:\n        - gpu\n", new: "        requests:\n        - gpus\n", want: "config requests [gpus]"},
		"v1beta1 shape":                     {old: "      - exactly:\n          deviceClassName: gpu.nvidia.com\n        name: gpu", new: "      - deviceClassName: gpu.nvidia.com\n        name: gpu", want: "unknown field"},
		"per-device index beyond the claim": {old: "defaultPinnedDeviceMemoryLimit: 10Gi", new: "defaultPinnedDeviceMemoryLimit: 10Gi\n                defaultPerDevicePinnedMemoryLimit:\n                  \"1\": 2Gi", want: "invalid device index: 1"},
		"gate off":                          {edit: func(p *policy.Policy) { p.Spec.DRA.DriverFeatureGates = nil }, want: "MPSSupport"},
		"derived memory": {old: "defaultPinnedDeviceMemoryLimit: 10Gi", new: "defaultPinnedDeviceMemoryLimit: 10Gi", want: "defaultPinnedDeviceMemoryLimit=10Gi, want 23034Mi",
			edit: func(p *policy.Policy) { p.Spec.DRA.MPS = nil }},
		"namespace": {edit: func(p *policy.Policy) { p.Spec.DRA.Namespaces = []string{"other"} }, want: "status.templates=[gpu-test6/single-gpu], want [other/single-gpu]"},
	} {
		t.Run(name, func(t *testing.T) {
			out, policies, nodes := draFixture(t)
			if tc.old != "" {
				if !strings.Contains(out, tc.old) {
					t.Fatalf("fixture lacks %q", tc.old)
				}
				out = strings.Replace(out, tc.old, tc.new, 1)
			}
			if tc.edit != nil {
				tc.edit(&policies[0])
			}
			r := checkDRA(t, out, policies, nodes)
			all := strings.Join(r.errs, "\n")
			if !strings.Contains(all, tc.want) {
				t.Fatalf("want an error containing %q, got:\n%s", tc.want, all)
			}
		})
	}
}
