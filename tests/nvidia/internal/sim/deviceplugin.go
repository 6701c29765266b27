package sim

import (
	"encoding/json"
	"fmt"
	"sort"
	"strconv"
	"strings"
	"time"

	"gpusharing.io/tests/nvidia/internal/nvconf"
)

// Fallback strategies of the device plugin's config-manager when neither
// the node label nor a default names a config.
const (
	FallbackEmpty  = "empty"  // the GPU Operator sets FALLBACK_STRATEGIES=empty
	FallbackNamed  = "named"  // a key named "default"
	FallbackSingle = "single" // the only key
)

// DPInput is what the simulated device plugin (with its config-manager
// sidecar and GFD) sees.
type DPInput struct {
	CP ClusterPolicy
	// ConfigMap is the data of the ConfigMap named by
	// spec.devicePlugin.config.name (nil: missing).
	ConfigMap map[string]string
	// Fallbacks: config-manager FALLBACK_STRATEGIES, in order.
	Fallbacks []string
	// Geometry: the node's GPUs after the MIG step.
	Geometry Geometry
	// Now: when GFD labels (its nvidia.com/gfd.timestamp); zero: no timestamp.
	Now time.Time
}

// LabelGFDTimestamp is the unix time (seconds) of GFD's last labelling.
const LabelGFDTimestamp = "nvidia.com/gfd.timestamp"

// DPLoadKey identifies what the device plugin would load now; DPLoaded
// reports whether it already runs with it (no reload trigger changed).
func DPLoadKey(n *Node, in DPInput) string {
	kb, _ := json.Marshal(loadKey{
		Label:       n.Labels[LabelDPConfig],
		ConfigMap:   in.CP.DPConfigName,
		Default:     in.CP.DPDefault,
		MigStrategy: in.CP.MigStrategy,
		Geometry:    in.Geometry.String(),
	})
	return string(kb)
}

// DPLoaded reports whether the node's plugin already loaded key.
func DPLoaded(n *Node, key string) bool {
	return n.Annotations[AnnDPLoaded] == key
}

// loadKey is what makes the real device plugin reload: a change of the
// node label (config-manager watch), a change of the DaemonSet's pod
// template (the GPU Operator rolls it when the ClusterPolicy's config name,
// default or MIG strategy change), and the MIG manager restarting the pods
// after a reconfiguration. ConfigMap content changes alone do not reload.
type loadKey struct {
	Label       string `json:"label"`
	ConfigMap   string `json:"configMap"`
	Default     string `json:"default"`
	MigStrategy string `json:"migStrategy"`
	Geometry    string `json:"geometry"`
}

// SelectConfig picks the ConfigMap key the config-manager links as the
// plugin's config: the node label, else DEFAULT_CONFIG (ClusterPolicy
// spec.devicePlugin.config.default), else the fallbacks. "" is the empty
// config (plugin defaults). Errors are the config-manager's, which then
// exits (the pod crash-loops).
func SelectConfig(label string, in DPInput) (string, error) {
	if in.CP.DPConfigName == "" {
		// No custom config: the GPU Operator deploys the plugin without
		// the config-manager.
		return "", nil
	}
	if in.ConfigMap == nil {
		return "", fmt.Errorf("ConfigMap %q (ClusterPolicy spec.devicePlugin.config.name) not found: the device-plugin pod cannot mount it", in.CP.DPConfigName)
	}
	if len(in.ConfigMap) == 0 {
		return "", fmt.Errorf("no configuration files available")
	}
	if label != "" {
		if _, ok := in.ConfigMap[label]; !ok {
			return "", fmt.Errorf("specified config %v does not exist", label)
		}
		return label, nil
	}
	if in.CP.DPDefault != "" {
		if _, ok := in.ConfigMap[in.CP.DPDefault]; !ok {
			// config-manager prints the (empty) label here, as it does.
			return "", fmt.Errorf("specified config %v does not exist", label)
		}
		return in.CP.DPDefault, nil
	}
	for _, f := range in.Fallbacks {
		switch f {
		case FallbackNamed:
			if _, ok := in.ConfigMap["default"]; ok {
				return "default", nil
			}
		case FallbackSingle:
			if len(in.ConfigMap) == 1 {
				for k := range in.ConfigMap {
					return k, nil
				}
			}
		case FallbackEmpty:
			return "", nil
		default:
			return "", fmt.Errorf("unknown fallback strategy: %v", f)
		}
	}
	return "", fmt.Errorf("no config was set, no default was provided, and all fallbacks failed")
}

// DPResult says what to do besides the patch.
type DPResult struct {
	Failed bool // the plugin would crash-loop: retry later (CrashLoopBackOff)
}

// PlanDevicePlugin simulates the device plugin + GFD on one node: when one
// of the reload triggers changed, select and load the config with NVIDIA's
// parser, then set the GFD labels and the node's extended resources.
func PlanDevicePlugin(n *Node, hw Hardware, in DPInput, p *Patch) DPResult {
	kb := DPLoadKey(n, in)
	if DPLoaded(n, kb) {
		kubeletSync(n, p)
		return DPResult{}
	}
	label := n.Labels[LabelDPConfig]
	fail := func(err error) DPResult {
		msg := err.Error()
		if n.Annotations[AnnDPError] != msg {
			p.logf("device plugin cannot start: %s", msg)
		}
		p.setAnn(n, AnnDPError, msg)
		return DPResult{Failed: true}
	}
	cfgKey, err := SelectConfig(label, in)
	if err != nil {
		return fail(err)
	}
	content := ""
	if cfgKey != "" {
		content = in.ConfigMap[cfgKey]
	}
	loaded, err := nvconf.LoadDevicePluginConfig([]byte(content), nvconf.DevicePluginOptions{MigStrategyOverride: in.CP.MigStrategy})
	if err != nil {
		return fail(fmt.Errorf("unable to load config %q: %w", cfgKey, err))
	}
	hwNode := nvconf.NodeHardware{Product: hw.Product, ComputeCapability: hw.ComputeCapability, GPUs: in.Geometry}
	outcome, err := nvconf.EvaluateNode(loaded.Effective, hwNode)
	if err != nil {
		return fail(fmt.Errorf("config %q: %w", cfgKey, err))
	}

	// GFD labels: set the new set, drop labels of the old set not in it.
	managed := map[string]bool{}
	for _, k := range strings.Split(n.Annotations[AnnManagedLabels], ",") {
		if k != "" {
			managed[k] = true
		}
	}
	var names []string
	for k, v := range outcome.Labels {
		p.setLabel(n, k, v)
		names = append(names, k)
		delete(managed, k)
	}
	// mig.strategy is absent with strategy none.
	if _, ok := outcome.Labels["nvidia.com/mig.strategy"]; !ok {
		managed["nvidia.com/mig.strategy"] = true
	}
	for k := range managed {
		p.delLabel(n, k)
	}
	// GFD stamps every labelling; the operator reads it as "GFD saw the
	// config loaded at or after this time".
	if !in.Now.IsZero() {
		p.setLabel(n, LabelGFDTimestamp, strconv.FormatInt(in.Now.Unix(), 10))
	}
	sort.Strings(names)
	p.setAnn(n, AnnManagedLabels, strings.Join(names, ","))

	// Extended resources: the new set; NVIDIA resources no longer
	// advertised go to 0 (kubelet keeps stale device-plugin resources at 0).
	want := map[string]string{}
	for r, c := range outcome.Resources {
		want[r] = fmt.Sprint(c)
	}
	for r := range n.Capacity {
		if _, ok := want[r]; !ok && IsGPUResource(r) {
			want[r] = "0"
		}
	}
	for r := range n.Allocatable {
		if _, ok := want[r]; !ok && IsGPUResource(r) {
			want[r] = "0"
		}
	}
	for r, v := range want {
		if n.Capacity[r] != v || n.Allocatable[r] != v {
			p.Resources = want
			break
		}
	}
	advertised, _ := json.Marshal(want)
	p.setAnn(n, AnnDPResources, string(advertised))
	p.setAnn(n, AnnDPLoaded, kb)
	p.setAnn(n, AnnDPConfig, cfgKey)
	p.delAnn(n, AnnDPError)
	p.logf("device plugin loaded config %q (migStrategy %s): resources %s", cfgKey, deref(loaded.Effective.Flags.MigStrategy), formatResources(outcome.Resources))
	return DPResult{}
}

// kubeletSync plays the kubelet's node status sync while the device plugin
// runs: the node's capacity and allocatable of the plugin's resources are
// what the plugin advertises (AnnDPResources), whatever became of an
// earlier status write.
func kubeletSync(n *Node, p *Patch) {
	var want map[string]string
	if json.Unmarshal([]byte(n.Annotations[AnnDPResources]), &want) != nil {
		return
	}
	for r, v := range want {
		if n.Capacity[r] != v || n.Allocatable[r] != v {
			p.Resources = want
			p.logf("kubelet: node status resynced to the device plugin's resources %v", want)
			return
		}
	}
}

func formatResources(m map[string]int) string {
	var parts []string
	for k, v := range m {
		parts = append(parts, fmt.Sprintf("%s=%d", k, v))
	}
	sort.Strings(parts)
	if len(parts) == 0 {
		return "none"
	}
	return strings.Join(parts, " ")
}

func deref(s *string) string {
	if s == nil {
		return ""
	}
	return *s
}
