package nvconf

import (
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"

	mpv1 "github.com/NVIDIA/mig-parted/api/spec/v1"
	"github.com/NVIDIA/mig-parted/cmd/nvidia-mig-parted/assert"
	"github.com/NVIDIA/mig-parted/pkg/types"
	"sigs.k8s.io/yaml"
)

// LoadMigPartedConfig parses a mig-parted config file content with
// mig-parted's own entry points (assert.ParseConfigFile: sigs.k8s.io/yaml ->
// strict v1.Spec UnmarshalJSON).
func LoadMigPartedConfig(data []byte) (*mpv1.Spec, error) {
	dir, err := os.MkdirTemp("", "mig-parted-")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(dir)
	path := filepath.Join(dir, "config.yaml")
	if err := os.WriteFile(path, data, 0o600); err != nil {
		return nil, err
	}
	spec, err := assert.ParseConfigFile(&assert.Flags{ConfigFile: path})
	if err != nil {
		// Same wrapping as `nvidia-mig-parted assert`.
		return nil, fmt.Errorf("error parsing config file: %v", err)
	}
	return spec, nil
}

// ReadMigConfigFile returns the mig-parted config in a file holding either
// a ConfigMap manifest (its data["config.yaml"]) or the config itself.
func ReadMigConfigFile(path string) (string, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return "", err
	}
	var cm struct {
		Kind string            `json:"kind"`
		Data map[string]string `json:"data"`
	}
	if err := yaml.Unmarshal(data, &cm); err == nil && cm.Kind == "ConfigMap" {
		return cm.Data["config.yaml"], nil
	}
	return string(data), nil
}

// SelectMigConfig is what `nvidia-mig-parted assert --valid-config -c name`
// checks after parsing: the selected layout must be present.
func SelectMigConfig(spec *mpv1.Spec, name string) (mpv1.MigConfigSpecSlice, error) {
	if name == "" {
		// The MIG manager always passes -c with the label value; an empty
		// name would make mig-parted pick the only layout if there is one.
		return nil, fmt.Errorf("error selecting MIG config: empty mig-config name")
	}
	f := &assert.Flags{SelectedConfig: name}
	slice, err := assert.GetSelectedMigConfig(f, spec)
	if err != nil {
		return nil, fmt.Errorf("error selecting MIG config: %v", err)
	}
	return slice, nil
}

// ValidateMigConfig runs both steps of `assert --valid-config`.
func ValidateMigConfig(data []byte, name string) (mpv1.MigConfigSpecSlice, error) {
	spec, err := LoadMigPartedConfig(data)
	if err != nil {
		return nil, err
	}
	return SelectMigConfig(spec, name)
}

// MigResourceName is the resource name the device plugin uses for a MIG
// profile under migStrategy mixed (internal/rm AddDefaultResourcesToConfig:
// "mig-" + profile with '+' replaced by '.'). ok is false for profiles the
// plugin does not expose (compute-instance slices, C != G).
func MigResourceName(profile string) (name string, ok bool, err error) {
	c, g, err := ProfileSlices(profile)
	if err != nil {
		return "", false, err
	}
	if c != g {
		return "", false, nil
	}
	return "nvidia.com/" + strings.ReplaceAll("mig-"+profile, "+", "."), true, nil
}

// ProfileSlices validates a MIG profile string with mig-parted's format
// check and returns its compute (C) and GPU (G) slice counts.
// (types.ParseMigProfile cannot be used: it initialises NVML to match the
// profile against the installed GPUs.)
func ProfileSlices(profile string) (c, g int, err error) {
	if err := types.AssertValidMigProfileFormat(profile); err != nil {
		return 0, 0, err
	}
	base := profile
	if i := strings.IndexAny(base, "+-"); i >= 0 {
		base = base[:i]
	}
	fields := strings.Split(base, ".")
	// [Nc.]Ng.NNgb
	if len(fields) == 3 {
		if _, err := fmt.Sscanf(fields[0], "%dc", &c); err != nil {
			return 0, 0, fmt.Errorf("invalid profile %q", profile)
		}
		fields = fields[1:]
	}
	if _, err := fmt.Sscanf(fields[0], "%dg", &g); err != nil {
		return 0, 0, fmt.Errorf("invalid profile %q", profile)
	}
	if c == 0 {
		c = g
	}
	return c, g, nil
}

// ValidMigProfile checks a profile's format (mig-parted's check).
func ValidMigProfile(profile string) error {
	return types.AssertValidMigProfileFormat(profile)
}

// LayoutProfiles lists the profiles (count > 0) a layout creates on any GPU,
// sorted.
func LayoutProfiles(slice mpv1.MigConfigSpecSlice) []string {
	seen := map[string]bool{}
	for _, e := range slice {
		if !e.MigEnabled {
			continue
		}
		for p, n := range e.MigDevices {
			if n > 0 {
				seen[p] = true
			}
		}
	}
	out := make([]string, 0, len(seen))
	for p := range seen {
		out = append(out, p)
	}
	sort.Strings(out)
	return out
}

// DevicesOf renders a MigConfigSpec.Devices value ("all" or []int) as text.
func DevicesOf(e mpv1.MigConfigSpec) string {
	switch d := e.Devices.(type) {
	case string:
		return d
	case []int:
		parts := make([]string, len(d))
		for i, v := range d {
			parts[i] = fmt.Sprint(v)
		}
		return "[" + strings.Join(parts, ",") + "]"
	}
	return fmt.Sprintf("%v", e.Devices)
}
