// Package dra checks rendered ResourceClaimTemplates against NVIDIA's DRA
// driver for GPUs (sigs.k8s.io/dra-driver-nvidia-gpu v0.5.0): the GpuConfig
// is decoded with the driver's StrictDecoder, normalized and validated with
// the driver's feature gates set as the policy says, exactly as the kubelet
// plugin does when it prepares a claim (and as its admission webhook does).
package dra

import (
	"bytes"
	"encoding/json"
	"fmt"
	"sync"

	resourcev1 "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/component-base/featuregate"
	"sigs.k8s.io/yaml"

	nvapi "sigs.k8s.io/dra-driver-nvidia-gpu/api/nvidia.com/resource/v1beta1"
	"sigs.k8s.io/dra-driver-nvidia-gpu/pkg/featuregates"
)

const (
	DriverName      = "gpu.nvidia.com" // the driver's DriverName (package main of the kubelet plugin)
	DeviceClassName = "gpu.nvidia.com" // the DeviceClass its Helm chart installs for full GPUs
	GpuConfigAPI    = nvapi.GroupName + "/" + nvapi.Version
)

// Gates are the driver feature gates that decide what it accepts for
// sharing (GpuSharingPolicy spec.dra.driverFeatureGates).
type Gates struct {
	MPSSupport          bool `json:"MPSSupport,omitempty"`
	TimeSlicingSettings bool `json:"TimeSlicingSettings,omitempty"`
	DynamicMIG          bool `json:"DynamicMIG,omitempty"`
	// ConsumableShares: the gate on and --consumable-shares not "disabled".
	ConsumableShares bool `json:"ConsumableShares,omitempty"`
}

// The driver's feature gates are a process-wide singleton; every use of
// them goes through this lock with all four gates set explicitly.
var gateMu sync.Mutex

// WithGates runs f with the driver's feature gates set to g (the other gates
// keep their defaults). It fails like the driver's startup does when the
// combination is invalid (featuregates.ValidateFeatureGates).
func WithGates(g Gates, f func() error) error {
	gateMu.Lock()
	defer gateMu.Unlock()
	if err := featuregates.FeatureGates().SetFromMap(map[string]bool{
		string(featuregates.MPSSupport):          g.MPSSupport,
		string(featuregates.TimeSlicingSettings): g.TimeSlicingSettings,
		string(featuregates.DynamicMIG):          g.DynamicMIG,
		string(featuregates.ConsumableShares):    g.ConsumableShares,
	}); err != nil {
		return fmt.Errorf("setting the driver's feature gates: %w", err)
	}
	for name, want := range map[featuregate.Feature]bool{
		featuregates.MPSSupport: g.MPSSupport, featuregates.TimeSlicingSettings: g.TimeSlicingSettings,
		featuregates.DynamicMIG: g.DynamicMIG, featuregates.ConsumableShares: g.ConsumableShares,
	} {
		if featuregates.Enabled(name) != want {
			return fmt.Errorf("driver feature gate %s did not take the value %v", name, want)
		}
	}
	if err := featuregates.ValidateFeatureGates(); err != nil {
		return fmt.Errorf("the DRA driver would not start: %w", err)
	}
	return f()
}

// DecodeGpuConfig decodes opaque parameters (JSON or YAML) with the driver's
// StrictDecoder, as the kubelet plugin and the webhook do.
func DecodeGpuConfig(raw []byte) (*nvapi.GpuConfig, error) {
	js, err := yaml.YAMLToJSON(raw)
	if err != nil {
		return nil, err
	}
	obj, err := runtime.Decode(nvapi.StrictDecoder, js)
	if err != nil {
		return nil, fmt.Errorf("driver's StrictDecoder: %w", err)
	}
	cfg, ok := obj.(*nvapi.GpuConfig)
	if !ok {
		return nil, fmt.Errorf("driver's StrictDecoder: got %T, want *GpuConfig", obj)
	}
	return cfg, nil
}

// Prepared is what the driver made of a GpuConfig.
type Prepared struct {
	Config *nvapi.GpuConfig // after Normalize
	// MPS pinned memory limit per device UUID, as the driver passes it to
	// the MPS control daemon ("<n>M"), for the claim's devices.
	PinnedLimits map[string]string
}

// Prepare does with a decoded GpuConfig what the kubelet plugin does when
// preparing a claim on devices with these UUIDs (a ResourceClaimTemplate
// request "exactly" with the default count gets one device):
//
//   - Normalize() and Validate() (exported; DeviceState.prepareDevices);
//   - for MPS, the checks of DeviceState.applySharingConfig (package main,
//     not importable; reproduced): not with ConsumableShares enabled, not
//     with DynamicMIG; GetMpsConfig;
//   - MpsPerDevicePinnedMemoryLimit.Normalize (exported; what the MPS
//     control daemon start calls) for the pinned memory limits.
//
// The feature gates must be set (WithGates). A panic in the driver's code
// (e.g. an empty timeSlicingConfig) is returned as an error.
func Prepare(cfg *nvapi.GpuConfig, uuids []string) (p *Prepared, err error) {
	defer func() {
		if r := recover(); r != nil {
			err = fmt.Errorf("the driver panics: %v", r)
		}
	}()
	c := cfg.DeepCopy()
	if err := c.Normalize(); err != nil {
		return nil, fmt.Errorf("error normalizing GPU config: %w", err)
	}
	if err := c.Validate(); err != nil {
		return nil, fmt.Errorf("error validating GPU config: %w", err)
	}
	p = &Prepared{Config: c}
	if c.Sharing == nil {
		return p, nil
	}
	if c.Sharing.IsTimeSlicing() {
		if _, err := c.Sharing.GetTimeSlicingConfig(); err != nil {
			return nil, fmt.Errorf("error getting timeslice config: %w", err)
		}
	}
	if featuregates.Enabled(featuregates.MPSSupport) && c.Sharing.IsMps() {
		if featuregates.Enabled(featuregates.ConsumableShares) {
			return nil, fmt.Errorf("MPS sharing is not supported when consumable shares is enabled")
		}
		if featuregates.Enabled(featuregates.DynamicMIG) {
			return nil, fmt.Errorf("MPS is not yet supported when using featureGates.DynamicMIG=true")
		}
		mpsc, err := c.Sharing.GetMpsConfig()
		if err != nil {
			return nil, fmt.Errorf("error getting MPS configuration: %w", err)
		}
		if mpsc != nil {
			limits, err := mpsc.DefaultPerDevicePinnedMemoryLimit.Normalize(uuids, mpsc.DefaultPinnedDeviceMemoryLimit)
			if err != nil {
				return nil, fmt.Errorf("error transforming DefaultPerDevicePinnedMemoryLimit into string: %w", err)
			}
			p.PinnedLimits = limits
		}
	}
	return p, nil
}

// CheckGpuConfig decodes, then prepares a GpuConfig with the gates set.
func CheckGpuConfig(raw []byte, g Gates, uuids []string) (*Prepared, error) {
	cfg, err := DecodeGpuConfig(raw)
	if err != nil {
		return nil, err
	}
	var p *Prepared
	err = WithGates(g, func() error {
		var err error
		p, err = Prepare(cfg, uuids)
		return err
	})
	return p, err
}

// DecodeTemplate decodes a rendered ResourceClaimTemplate strictly into
// k8s.io/api resource/v1 types (unknown or misplaced fields fail).
func DecodeTemplate(doc []byte) (*resourcev1.ResourceClaimTemplate, error) {
	js, err := yaml.YAMLToJSON(doc)
	if err != nil {
		return nil, err
	}
	dec := json.NewDecoder(bytes.NewReader(js))
	dec.DisallowUnknownFields()
	t := &resourcev1.ResourceClaimTemplate{}
	if err := dec.Decode(t); err != nil {
		return nil, fmt.Errorf("resource.k8s.io/v1 ResourceClaimTemplate: %w", err)
	}
	return t, nil
}

// MiB is the size of a quantity in whole MiB (the driver's "<n>M").
func MiB(q resource.Quantity) int64 { return q.Value() / 1024 / 1024 }

// FakeUUIDs gives n GPU UUIDs for a simulated claim allocation.
func FakeUUIDs(n int) []string {
	out := make([]string, n)
	for i := range out {
		out[i] = fmt.Sprintf("GPU-00000000-0000-0000-0000-%012d", i)
	}
	return out
}
