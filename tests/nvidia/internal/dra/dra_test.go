package dra

import (
	"strings"
	"testing"
)

const mps50 = `apiVersion: resource.nvidia.com/v1beta1
kind: GpuConfig
sharing:
  strategy: MPS
  mpsConfig:
    defaultActiveThreadPercentage: 50
    defaultPinnedDeviceMemoryLimit: 10Gi
`

func TestMPSNeedsGate(t *testing.T) {
	if _, err := CheckGpuConfig([]byte(mps50), Gates{}, FakeUUIDs(1)); err == nil || !strings.Contains(err.Error(), "MPSSupport") {
		t.Fatalf("want the MPSSupport gate error, got %v", err)
	}
	p, err := CheckGpuConfig([]byte(mps50), Gates{MPSSupport: true}, FakeUUIDs(1))
	if err != nil {
		t.Fatal(err)
	}
	if got := p.PinnedLimits[FakeUUIDs(1)[0]]; got != "10240M" {
		t.Fatalf("pinned limit %q, want 10240M", got)
	}
	// The gates are reset per call: the same config fails again without it.
	if _, err := CheckGpuConfig([]byte(mps50), Gates{TimeSlicingSettings: true}, FakeUUIDs(1)); err == nil {
		t.Fatal("gate MPSSupport leaked from the previous call")
	}
}

func TestDriverRules(t *testing.T) {
	ts := func(extra string) string {
		return "apiVersion: resource.nvidia.com/v1beta1\nkind: GpuConfig\nsharing:\n  strategy: TimeSlicing\n" + extra
	}
	mps := func(body string) string {
		return "apiVersion: resource.nvidia.com/v1beta1\nkind: GpuConfig\nsharing:\n  strategy: MPS\n  mpsConfig:\n" + body
	}
	for _, c := range []struct {
		name, cfg string
		gates     Gates
		uuids     int
		want      string // "" = accepted
	}{
		{"ts-no-gate", ts("  timeSlicingConfig:\n    interval: Long\n"), Gates{}, 1, "TimeSlicingSettings"},
		{"ts-ok", ts("  timeSlicingConfig:\n    interval: Long\n"), Gates{TimeSlicingSettings: true}, 1, ""},
		{"ts-defaulted", ts(""), Gates{TimeSlicingSettings: true}, 1, ""},
		{"ts-empty-config-panics", ts("  timeSlicingConfig: {}\n"), Gates{TimeSlicingSettings: true}, 1, "panics"},
		{"ts-bad-interval", ts("  timeSlicingConfig:\n    interval: Forever\n"), Gates{TimeSlicingSettings: true}, 1, "unknown time-slice interval"},
		{"mps-dynamic-mig", mps("    defaultActiveThreadPercentage: 50\n"), Gates{MPSSupport: true, DynamicMIG: true}, 1, "mutually exclusive"},
		{"mps-consumable-shares", mps("    defaultActiveThreadPercentage: 50\n"), Gates{MPSSupport: true, ConsumableShares: true}, 1, "consumable shares"},
		{"mps-101", mps("    defaultActiveThreadPercentage: 101\n"), Gates{MPSSupport: true}, 1, "greater than 100"},
		{"mps-1Ki", mps("    defaultPinnedDeviceMemoryLimit: 1Ki\n"), Gates{MPSSupport: true}, 1, "too low"},
		{"mps-bad-quantity", mps("    defaultPinnedDeviceMemoryLimit: lots\n"), Gates{MPSSupport: true}, 1, "quantities must match"},
		{"mps-unknown-field", mps("    pinnedMemory: 1Gi\n"), Gates{MPSSupport: true}, 1, "unknown field"},
		{"mps-per-device-0", mps("    defaultPerDevicePinnedMemoryLimit:\n      \"0\": 2Gi\n"), Gates{MPSSupport: true}, 1, ""},
		// A one-device claim (request "exactly", count 1): only index 0 and the
		// allocated GPU's UUID are valid keys.
		{"mps-per-device-1-on-one-gpu", mps("    defaultPerDevicePinnedMemoryLimit:\n      \"1\": 2Gi\n"), Gates{MPSSupport: true}, 1, "invalid device index"},
		{"mps-per-device-other-uuid", mps("    defaultPerDevicePinnedMemoryLimit:\n      GPU-12345678-1234-1234-1234-123456789abc: 2Gi\n"), Gates{MPSSupport: true}, 1, "invalid device"},
		{"mig-strategy", "apiVersion: resource.nvidia.com/v1beta1\nkind: GpuConfig\nsharing:\n  strategy: MIG\n", Gates{MPSSupport: true, TimeSlicingSettings: true}, 1, "unknown GPU sharing strategy"},
	} {
		t.Run(c.name, func(t *testing.T) {
			_, err := CheckGpuConfig([]byte(c.cfg), c.gates, FakeUUIDs(c.uuids))
			switch {
			case c.want == "" && err != nil:
				t.Fatalf("driver rejects: %v", err)
			case c.want != "" && err == nil:
				t.Fatalf("driver accepts, want an error with %q", c.want)
			case c.want != "" && !strings.Contains(err.Error(), c.want):
				t.Fatalf("error %q lacks %q", err, c.want)
			}
		})
	}
}

func TestDecodeTemplateStrict(t *testing.T) {
	good := `apiVersion: resource.k8s.io/v1
kind: ResourceClaimTemplate
metadata:
  name: t
  namespace: ns
spec:
  spec:
    devices:
      requests:
      - name: gpu
        exactly:
          deviceClassName: gpu.nvidia.com
      config:
      - requests: [gpu]
        opaque:
          driver: gpu.nvidia.com
          parameters:
` + indent(mps50, "            ")
	tpl, err := DecodeTemplate([]byte(good))
	if err != nil {
		t.Fatal(err)
	}
	if got := tpl.Spec.Spec.Devices.Requests[0].Exactly.DeviceClassName; got != DeviceClassName {
		t.Fatalf("deviceClassName %q", got)
	}
	if _, err := CheckGpuConfig(tpl.Spec.Spec.Devices.Config[0].Opaque.Parameters.Raw, Gates{MPSSupport: true}, FakeUUIDs(1)); err != nil {
		t.Fatal(err)
	}
	// v1beta1 shape (deviceClassName directly on the request) is not v1.
	bad := strings.Replace(good, "        exactly:\n          deviceClassName", "        deviceClassName", 1)
	if _, err := DecodeTemplate([]byte(bad)); err == nil {
		t.Fatal("want an error for a v1beta1-style request")
	}
}

func indent(s, pre string) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	for i := range lines {
		lines[i] = pre + lines[i]
	}
	return strings.Join(lines, "\n") + "\n"
}
