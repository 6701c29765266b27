package nvconf

import (
	"strconv"
	"strings"
	"testing"
)

func TestLoadDevicePluginConfig(t *testing.T) {
	cases := []struct {
		name, yaml, override, wantErr string
	}{
		{name: "exclusive", yaml: "version: v1\nflags:\n  migStrategy: none\n"},
		{name: "empty version defaults to v1", yaml: "flags:\n  migStrategy: single\n"},
		{name: "bad version", yaml: "version: v2\n", wantErr: "unknown version: v2"},
		{name: "replicas 1", yaml: "version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - name: nvidia.com/gpu\n      replicas: 1\n", wantErr: "number of replicas must be >= 2"},
		{name: "no resources", yaml: "version: v1\nsharing:\n  timeSlicing: {}\n", wantErr: "no resources specified"},
		{name: "null timeSlicing", yaml: "version: v1\nsharing:\n  timeSlicing:\n", wantErr: "no resources specified"},
		{name: "no name", yaml: "version: v1\nsharing:\n  mps:\n    resources:\n    - replicas: 2\n", wantErr: "no resource name specified"},
		{name: "mps mixed", yaml: "version: v1\nflags:\n  migStrategy: mixed\nsharing:\n  mps:\n    resources:\n    - name: nvidia.com/gpu\n      replicas: 2\n", wantErr: "not supported with MPS"},
		{name: "mps none but cluster mixed", yaml: "version: v1\nflags:\n  migStrategy: none\nsharing:\n  mps:\n    resources:\n    - name: nvidia.com/gpu\n      replicas: 2\n", override: "mixed", wantErr: "not supported with MPS"},
		{name: "unknown key ignored", yaml: "version: v1\nsharing:\n  time-slicing:\n    resources: []\n"},
		// sigs.k8s.io/yaml v1.6 accepts duplicate keys (the last one wins).
		{name: "duplicate yaml key", yaml: "version: v1\nflags:\n  migStrategy: bogus\nflags:\n  migStrategy: none\n"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			_, err := LoadDevicePluginConfig([]byte(tc.yaml), DevicePluginOptions{MigStrategyOverride: tc.override})
			if tc.wantErr == "" && err != nil {
				t.Fatalf("unexpected error: %v", err)
			}
			if tc.wantErr != "" && (err == nil || !strings.Contains(err.Error(), tc.wantErr)) {
				t.Fatalf("error %v, want %q", err, tc.wantErr)
			}
		})
	}
}

func TestLoadDevicePluginConfigEffective(t *testing.T) {
	y := `version: v1
flags:
  migStrategy: none
sharing:
  timeSlicing:
    resources:
    - name: gpu
      replicas: 4
      rename: gpu-shared
      devices: ["0", 1]
  mps:
    resources:
    - name: nvidia.com/gpu
      replicas: 3
`
	res, err := LoadDevicePluginConfig([]byte(y), DevicePluginOptions{MigStrategyOverride: "single"})
	if err != nil {
		t.Fatal(err)
	}
	ts := res.Loaded.Sharing.TimeSlicing.Resources[0]
	if ts.Name != "nvidia.com/gpu" || ts.Rename != "nvidia.com/gpu-shared" || len(ts.Devices.List) != 2 || ts.Devices.List[1] != "1" {
		t.Fatalf("loaded resource %+v", ts)
	}
	eff := res.Effective.Sharing.TimeSlicing.Resources[0]
	if eff.Rename != "" || !eff.Devices.All {
		t.Fatalf("effective resource %+v: rename/devices must be dropped", eff)
	}
	if len(res.Warnings) == 0 {
		t.Fatal("expected NVIDIA's 'not yet supported' warnings")
	}
	if *res.Loaded.Flags.MigStrategy != "single" {
		t.Fatalf("MIG_STRATEGY override not applied: %v", *res.Loaded.Flags.MigStrategy)
	}
	// MPS wins silently and gets failRequestsGreaterThanOne forced.
	if res.Loaded.Sharing.SharingStrategy() != "mps" || !res.Loaded.Sharing.MPS.FailRequestsGreaterThanOne {
		t.Fatalf("MPS: %+v", res.Loaded.Sharing.MPS)
	}
}

func TestMigParted(t *testing.T) {
	good := "version: v1\nmig-configs:\n  all-disabled:\n  - devices: all\n    mig-enabled: false\n  x:\n  - devices: [0, 1]\n    mig-enabled: true\n    mig-devices: {\"1g.10gb+me\": 1, \"2g.20gb\": 3}\n"
	if _, err := ValidateMigConfig([]byte(good), "x"); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct{ yaml, name, want string }{
		{good, "y", "selected mig-config not present: y"},
		{"version: v1\nmig-configs:\n  x:\n  - devices: all\n    mig-enabled: true\n", "x", "missing required field 'mig-devices'"},
		{"version: v1\nmig-configs:\n  x:\n  - devices: all\n    mig-enabled: false\n    mig-devices: {\"1g.10gb\": 1}\n", "x", "MIG devices included"},
		{"version: v1\nmig-configs:\n  x:\n  - devices: all\n    migEnabled: false\n", "x", "missing required field: mig-enabled"},
		{"version: v1\nmig-configs:\n  x:\n  - devices: all\n    mig-enabled: false\n    extra: 1\n", "x", "unexpected field: extra"},
		{"version: v1\nmig-configs:\n  x:\n  - devices: some\n    mig-enabled: false\n", "x", "invalid string input"},
		{"mig-configs: {}\n", "x", "missing 'version'"},
	} {
		if _, err := ValidateMigConfig([]byte(tc.yaml), tc.name); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%q: error %v, want %q", tc.yaml, err, tc.want)
		}
	}
}

func TestMigResourceName(t *testing.T) {
	for profile, want := range map[string]string{
		"1g.10gb":     "nvidia.com/mig-1g.10gb",
		"1g.10gb+me":  "nvidia.com/mig-1g.10gb.me",
		"1g.24gb-me":  "nvidia.com/mig-1g.24gb-me",
		"1c.3g.40gb":  "",
		"3c.3g.40gb":  "nvidia.com/mig-3c.3g.40gb",
		"7g.141gb":    "nvidia.com/mig-7g.141gb",
		"1g.24gb+gfx": "nvidia.com/mig-1g.24gb.gfx",
	} {
		got, ok, err := MigResourceName(profile)
		if err != nil {
			t.Fatalf("%s: %v", profile, err)
		}
		if (want == "") == ok || got != want {
			t.Errorf("%s: got %q (ok=%v), want %q", profile, got, ok, want)
		}
	}
	if _, _, err := MigResourceName("1x.10gb"); err == nil {
		t.Error("expected an error for 1x.10gb")
	}
}

func load(t *testing.T, y string) *DevicePluginResult {
	t.Helper()
	res, err := LoadDevicePluginConfig([]byte(y), DevicePluginOptions{})
	if err != nil {
		t.Fatal(err)
	}
	return res
}

func gpus(n int, g GPU) []GPU {
	out := make([]GPU, n)
	for i := range out {
		out[i] = g
	}
	return out
}

func TestEvaluateNode(t *testing.T) {
	ts := func(strategy, name string, replicas int, extra string) string {
		return "version: v1\nflags:\n  migStrategy: " + strategy + "\nsharing:\n  timeSlicing:\n" + extra + "    resources:\n    - name: " + name + "\n      replicas: " + strconv.Itoa(replicas) + "\n"
	}
	full := gpus(8, GPU{})
	mig7 := gpus(8, GPU{MigEnabled: true, MigDevices: map[string]int{"1g.10gb": 7}})

	out, err := EvaluateNode(load(t, ts("none", "nvidia.com/gpu", 4, "")).Effective, NodeHardware{Product: "NVIDIA-L4", GPUs: full})
	if err != nil || out.Resources["nvidia.com/gpu"] != 32 || out.Labels["nvidia.com/gpu.product"] != "NVIDIA-L4-SHARED" ||
		out.Labels["nvidia.com/gpu.replicas"] != "4" || out.Labels["nvidia.com/gpu.sharing-strategy"] != "time-slicing" {
		t.Fatalf("time-slicing: %v %+v", err, out)
	}
	out, err = EvaluateNode(load(t, ts("none", "nvidia.com/gpu", 4, "    renameByDefault: true\n")).Effective, NodeHardware{Product: "NVIDIA-L4", GPUs: full})
	if err != nil || out.Resources["nvidia.com/gpu.shared"] != 32 || out.Resources["nvidia.com/gpu"] != 0 || out.Labels["nvidia.com/gpu.product"] != "NVIDIA-L4" {
		t.Fatalf("renamed: %v %+v", err, out)
	}
	out, err = EvaluateNode(load(t, ts("single", "nvidia.com/gpu", 2, "")).Effective, NodeHardware{Product: "NVIDIA-A100-SXM4-80GB", GPUs: mig7})
	if err != nil || out.Resources["nvidia.com/gpu"] != 112 || out.Labels["nvidia.com/gpu.product"] != "NVIDIA-A100-SXM4-80GB-MIG-1g.10gb-SHARED" ||
		out.Labels["nvidia.com/gpu.count"] != "56" || out.Labels["nvidia.com/mig.strategy"] != "single" {
		t.Fatalf("single: %v %+v", err, out)
	}
	out, err = EvaluateNode(load(t, ts("mixed", "nvidia.com/mig-1g.10gb", 2, "")).Effective, NodeHardware{Product: "NVIDIA-A100-SXM4-80GB", GPUs: mig7})
	if err != nil || out.Resources["nvidia.com/mig-1g.10gb"] != 112 || out.Labels["nvidia.com/mig-1g.10gb.replicas"] != "2" ||
		out.Labels["nvidia.com/gpu.replicas"] != "0" {
		t.Fatalf("mixed: %v %+v", err, out)
	}
	// single with two profiles / partly disabled fails.
	two := gpus(8, GPU{MigEnabled: true, MigDevices: map[string]int{"1g.10gb": 3, "2g.20gb": 2}})
	if _, err := EvaluateNode(load(t, "version: v1\nflags:\n  migStrategy: single\n").Effective, NodeHardware{GPUs: two}); err == nil {
		t.Fatal("single with two profiles must fail")
	}
	part := append(gpus(4, GPU{MigEnabled: true, MigDevices: map[string]int{"1g.10gb": 7}}), gpus(4, GPU{})...)
	if _, err := EvaluateNode(load(t, "version: v1\nflags:\n  migStrategy: single\n").Effective, NodeHardware{GPUs: part}); err == nil {
		t.Fatal("single with partly disabled GPUs must fail")
	}
	// mixed with partly disabled GPUs is fine.
	out, err = EvaluateNode(load(t, "version: v1\nflags:\n  migStrategy: mixed\n").Effective, NodeHardware{GPUs: part})
	if err != nil || out.Resources["nvidia.com/gpu"] != 4 || out.Resources["nvidia.com/mig-1g.10gb"] != 28 {
		t.Fatalf("mixed partly: %v %+v", err, out)
	}
	mps := "version: v1\nflags:\n  migStrategy: none\nsharing:\n  mps:\n    resources:\n    - name: nvidia.com/gpu\n      replicas: 20\n"
	if _, err := EvaluateNode(load(t, mps).Effective, NodeHardware{ComputeCapability: "7.0", GPUs: full}); err == nil {
		t.Fatal("MPS with 20 replicas on a Volta (7.0) must fail")
	}
	out, err = EvaluateNode(load(t, mps).Effective, NodeHardware{ComputeCapability: "9.0", GPUs: full})
	if err != nil || out.Labels["nvidia.com/mps.capable"] != "true" || out.Labels["nvidia.com/gpu.sharing-strategy"] != "mps" {
		t.Fatalf("mps: %v %+v", err, out)
	}
}
