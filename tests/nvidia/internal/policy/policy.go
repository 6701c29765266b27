// Package policy mirrors the GpuSharingPolicy custom resource
// (gpusharing.io/v1alpha1) on the Go side of the tests, and derives what the
// rendered NVIDIA configs must say for a policy.
package policy

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io"
	"regexp"
	"sort"
	"strings"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"sigs.k8s.io/yaml"

	"gpusharing.io/tests/nvidia/internal/nvconf"
)

const (
	APIVersion = "gpusharing.io/v1alpha1"
	Kind       = "GpuSharingPolicy"

	Exclusive   = "exclusive"
	TimeSlicing = "timeSlicing"
	MPS         = "mps"
	MIG         = "mig"
	VGPU        = "vgpu"
	Passthrough = "passthrough"
)

type Policy struct {
	APIVersion string   `json:"apiVersion"`
	Kind       string   `json:"kind"`
	Metadata   Metadata `json:"metadata"`
	Spec       Spec     `json:"spec"`
}

type Metadata struct {
	Name   string            `json:"name"`
	Labels map[string]string `json:"labels,omitempty"`
}

type Spec struct {
	NodeSelector *metav1.LabelSelector `json:"nodeSelector,omitempty"`
	Priority     *int                  `json:"priority,omitempty"`
	Strategy     string                `json:"strategy"`
	TimeSlicing  *Sharing              `json:"timeSlicing,omitempty"`
	MPS          *Sharing              `json:"mps,omitempty"`
	MIG          *MIGSpec              `json:"mig,omitempty"`
	Backend      string                `json:"backend,omitempty"` // "", devicePlugin, dra
	DRA          *DRASpec              `json:"dra,omitempty"`
	VGPU         *VGPUSpec             `json:"vgpu,omitempty"`
}

// VGPUSpec is spec.vgpu.
type VGPUSpec struct {
	Type         string            `json:"type,omitempty"`
	CustomLayout []VGPUDeviceGroup `json:"customLayout,omitempty"`
}

// VGPUDeviceGroup is one entry of spec.vgpu.customLayout.
type VGPUDeviceGroup struct {
	Devices     []int          `json:"devices,omitempty"`
	VGPUDevices map[string]int `json:"vgpuDevices"`
}

// IsVM: a strategy for virtual machines (vgpu, passthrough).
func (p *Policy) IsVM() bool { return p.Spec.Strategy == VGPU || p.Spec.Strategy == Passthrough }

// BackendDRA: sharing through NVIDIA's DRA driver (ResourceClaimTemplates).
const BackendDRA = "dra"

// DRASpec is spec.dra.
type DRASpec struct {
	Namespaces          []string        `json:"namespaces,omitempty"`
	TemplateName        string          `json:"templateName,omitempty"`
	TimeSlicingInterval string          `json:"timeSlicingInterval,omitempty"`
	MPS                 *DRAMPS         `json:"mps,omitempty"`
	DriverFeatureGates  map[string]bool `json:"driverFeatureGates,omitempty"`
}

// DRAMPS is spec.dra.mps.
type DRAMPS struct {
	DefaultActiveThreadPercentage  *int              `json:"defaultActiveThreadPercentage,omitempty"`
	DefaultPinnedDeviceMemoryLimit string            `json:"defaultPinnedDeviceMemoryLimit,omitempty"`
	PerDevicePinnedMemoryLimits    map[string]string `json:"perDevicePinnedMemoryLimits,omitempty"`
	MultiUser                      *bool             `json:"multiUser,omitempty"`
}

// IsDRA: the policy uses the DRA backend.
func (p *Policy) IsDRA() bool { return p.Spec.Backend == BackendDRA }

// TemplateName is the name of the policy's ResourceClaimTemplates.
func (p *Policy) TemplateName() string {
	if p.Spec.DRA != nil && p.Spec.DRA.TemplateName != "" {
		return p.Spec.DRA.TemplateName
	}
	return p.Metadata.Name
}

// Replicas is spec.mps.replicas / spec.timeSlicing.replicas (0 if unset).
func (p *Policy) Replicas() int {
	var sh *Sharing
	switch p.Spec.Strategy {
	case MPS:
		sh = p.Spec.MPS
	case TimeSlicing:
		sh = p.Spec.TimeSlicing
	}
	if sh == nil || sh.Replicas == nil {
		return 0
	}
	return *sh.Replicas
}

// Sharing is the body of spec.timeSlicing, spec.mps and spec.mig.timeSlicing.
type Sharing struct {
	Replicas                   *int       `json:"replicas,omitempty"`
	RenameByDefault            *bool      `json:"renameByDefault,omitempty"`
	FailRequestsGreaterThanOne *bool      `json:"failRequestsGreaterThanOne,omitempty"`
	Resources                  []Resource `json:"resources,omitempty"`
}

type Resource struct {
	Name     string   `json:"name"`
	Replicas *int     `json:"replicas,omitempty"`
	Rename   string   `json:"rename,omitempty"`
	Devices  []string `json:"devices,omitempty"`
}

type MIGSpec struct {
	MigStrategy  string        `json:"migStrategy,omitempty"`
	Layout       string        `json:"layout,omitempty"`
	CustomLayout []LayoutEntry `json:"customLayout,omitempty"`
	TimeSlicing  *Sharing      `json:"timeSlicing,omitempty"`
}

type LayoutEntry struct {
	Devices    []int          `json:"devices,omitempty"`
	MigEnabled bool           `json:"migEnabled"`
	MigDevices map[string]int `json:"migDevices,omitempty"`
}

// ParseFile reads every GpuSharingPolicy document from a multi-document
// YAML stream; other kinds are skipped.
func ParseFile(data []byte) ([]Policy, error) {
	var out []Policy
	r := utilyaml.NewYAMLReader(bufioReader(data))
	for {
		doc, err := r.Read()
		if errors.Is(err, io.EOF) {
			return out, nil
		}
		if err != nil {
			return nil, err
		}
		if len(bytes.TrimSpace(doc)) == 0 {
			continue
		}
		// Only GpuSharingPolicy documents are read (as render does): others may be anything.
		var head map[string]any
		if err := yaml.Unmarshal(doc, &head); err == nil && head["kind"] != Kind {
			continue
		}
		var p Policy
		if err := yaml.Unmarshal(doc, &p); err != nil {
			return nil, err
		}
		out = append(out, p)
	}
}

// MarshalFile writes policies as one multi-document YAML stream.
func MarshalFile(ps []Policy) ([]byte, error) {
	var buf bytes.Buffer
	for i := range ps {
		b, err := yaml.Marshal(&ps[i])
		if err != nil {
			return nil, err
		}
		buf.WriteString("---\n")
		buf.Write(b)
	}
	return buf.Bytes(), nil
}

// ExpectedResource is one entry expected in sharing.<kind>.resources.
type ExpectedResource struct {
	Name     string   // fully qualified
	Replicas int      //
	Rename   string   // fully qualified, "" = none (before renameByDefault applies)
	Devices  []string // nil = all
}

// ExpectedDP is what the device-plugin config of a policy must parse to.
type ExpectedDP struct {
	MigStrategy                string
	SharingKind                string // "", TimeSlicing, MPS
	RenameByDefault            bool
	FailRequestsGreaterThanOne bool
	Resources                  []ExpectedResource // sorted by Name
}

// LayoutProfilesFunc returns the MIG profiles of a named layout (from the
// rendered mig-parted config).
type LayoutProfilesFunc func(layout string) ([]string, error)

// ExpectDevicePlugin derives the expected device-plugin config of a valid
// policy, following the semantics of the GpuSharingPolicy CRD.
func ExpectDevicePlugin(p *Policy, profilesOf LayoutProfilesFunc) (*ExpectedDP, error) {
	e := &ExpectedDP{MigStrategy: "none"}
	var sh *Sharing
	defaultResources := func(replicas int) ([]ExpectedResource, error) {
		return []ExpectedResource{{Name: "nvidia.com/gpu", Replicas: replicas}}, nil
	}
	switch p.Spec.Strategy {
	case Exclusive, "":
		return e, nil
	case VGPU, Passthrough:
		// VM hosts run no container device plugin; should one run, it shares nothing.
		return e, nil
	case TimeSlicing:
		sh = p.Spec.TimeSlicing
		e.SharingKind = TimeSlicing
	case MPS:
		sh = p.Spec.MPS
		e.SharingKind = MPS
	case MIG:
		if p.Spec.MIG == nil {
			return nil, fmt.Errorf("strategy mig without spec.mig")
		}
		e.MigStrategy = p.Spec.MIG.MigStrategy
		if e.MigStrategy == "" {
			e.MigStrategy = "single"
		}
		sh = p.Spec.MIG.TimeSlicing
		if sh == nil {
			return e, nil
		}
		e.SharingKind = TimeSlicing
		if e.MigStrategy == "mixed" {
			defaultResources = func(replicas int) ([]ExpectedResource, error) {
				profiles, err := MIGProfiles(p, profilesOf)
				if err != nil {
					return nil, err
				}
				var out []ExpectedResource
				for _, prof := range profiles {
					name, ok, err := nvconf.MigResourceName(prof)
					if err != nil {
						return nil, err
					}
					if ok {
						out = append(out, ExpectedResource{Name: name, Replicas: replicas})
					}
				}
				return out, nil
			}
		}
	default:
		return nil, fmt.Errorf("unknown strategy %q", p.Spec.Strategy)
	}
	if sh == nil {
		return nil, fmt.Errorf("strategy %s without its settings", p.Spec.Strategy)
	}
	e.RenameByDefault = deref(sh.RenameByDefault)
	e.FailRequestsGreaterThanOne = deref(sh.FailRequestsGreaterThanOne)
	if e.SharingKind == MPS {
		// NVIDIA's NewConfig forces this for MPS whatever the file says.
		e.FailRequestsGreaterThanOne = true
	}
	top := 0
	if sh.Replicas != nil {
		top = *sh.Replicas
	}
	if len(sh.Resources) == 0 {
		rs, err := defaultResources(top)
		if err != nil {
			return nil, err
		}
		e.Resources = rs
	} else {
		for _, r := range sh.Resources {
			name, err := nvconf.NormalizeResourceName(r.Name)
			if err != nil {
				return nil, err
			}
			er := ExpectedResource{Name: name, Replicas: top, Devices: r.Devices}
			if r.Replicas != nil {
				er.Replicas = *r.Replicas
			}
			if r.Rename != "" {
				if er.Rename, err = nvconf.NormalizeResourceName(r.Rename); err != nil {
					return nil, err
				}
			}
			e.Resources = append(e.Resources, er)
		}
	}
	sort.Slice(e.Resources, func(i, j int) bool { return e.Resources[i].Name < e.Resources[j].Name })
	return e, nil
}

// MIGProfiles lists the MIG profiles a MIG policy's layout creates: the
// customLayout's profiles, "<profile>" for a named layout all-<profile>, and
// otherwise the profiles of the named layout as rendered.
func MIGProfiles(p *Policy, profilesOf LayoutProfilesFunc) ([]string, error) {
	m := p.Spec.MIG
	seen := map[string]bool{}
	if len(m.CustomLayout) > 0 {
		for _, e := range m.CustomLayout {
			if !e.MigEnabled {
				continue
			}
			for prof, n := range e.MigDevices {
				if n > 0 {
					seen[prof] = true
				}
			}
		}
	} else if prof, ok := strings.CutPrefix(m.Layout, "all-"); ok && isProfile(prof) {
		seen[prof] = true
	} else {
		profiles, err := profilesOf(m.Layout)
		if err != nil {
			return nil, err
		}
		for _, prof := range profiles {
			seen[prof] = true
		}
	}
	out := make([]string, 0, len(seen))
	for prof := range seen {
		out = append(out, prof)
	}
	sort.Strings(out)
	return out, nil
}

func isProfile(s string) bool {
	return nvconf.ValidMigProfile(s) == nil
}

// MigConfigName is the mig-parted layout a MIG policy's nodes get. Custom
// layouts are content-addressed (custom-<policy>-<8 hex>): the hash is the
// operator's, so given the name the status reports, this checks its form.
func MigConfigName(p *Policy, reported string) (string, error) {
	if p.Spec.MIG == nil {
		return "", nil
	}
	if len(p.Spec.MIG.CustomLayout) > 0 {
		if !customLayoutName.MatchString(reported) || !strings.HasPrefix(reported, "custom-"+p.Metadata.Name[:min(len(p.Metadata.Name), 47)]) {
			return "", fmt.Errorf("custom layout name %q is not custom-<policy>-<8 hex>", reported)
		}
		return reported, nil
	}
	return p.Spec.MIG.Layout, nil
}

var customLayoutName = regexp.MustCompile(`^custom-[a-z0-9-]+-[0-9a-f]{8}$`)

func deref[T any](p *T) T {
	var zero T
	if p == nil {
		return zero
	}
	return *p
}

// Ptr returns a pointer to v.
func Ptr[T any](v T) *T { return &v }

func bufioReader(data []byte) *bufio.Reader { return bufio.NewReader(bytes.NewReader(data)) }
