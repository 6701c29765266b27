// Package sim holds the decision logic of gpu-node-simulator, a test-only
// stand-in for NVIDIA's node components (MIG manager, device-plugin config
// manager, device plugin and GPU Feature Discovery) on nodes that have no
// GPU. Everything here is pure: it maps what the simulator sees (a Node, the
// ClusterPolicy, ConfigMap contents, pods) to the writes it makes.
package sim

import (
	"encoding/json"
	"fmt"
	"strings"
	"time"

	mpv1 "github.com/NVIDIA/mig-parted/api/spec/v1"
	corev1 "k8s.io/api/core/v1"

	"gpusharing.io/tests/nvidia/internal/nvconf"
	"gpusharing.io/tests/nvidia/internal/nvmig"
)

const (
	LabelGPUPresent = "nvidia.com/gpu.present"
	LabelMigConfig  = "nvidia.com/mig.config"
	LabelMigState   = "nvidia.com/mig.config.state"
	LabelDPConfig   = "nvidia.com/device-plugin.config"
	LabelMigCapable = "nvidia.com/mig.capable"
	LabelProduct    = "nvidia.com/gpu.product"
	LabelCount      = "nvidia.com/gpu.count"
	LabelMemory     = "nvidia.com/gpu.memory"

	AnnPrefix = "simulator.gpusharing.io/"
	// AnnHardware: the node's simulated hardware (JSON), recorded from its
	// labels when the simulator first sees it.
	AnnHardware = AnnPrefix + "hardware"
	// AnnAppliedMig: the last nvidia.com/mig.config value the simulated MIG
	// manager acted on (success or failed).
	AnnAppliedMig = AnnPrefix + "applied-mig-config"
	// AnnMigGeometry: the MIG state of each GPU (JSON) after the last
	// reconfiguration that touched the GPUs: "e" MIG mode, "d" devices by
	// profile, "p" each instance's placement (profile, start, size) when the
	// node's model has go-nvml mock data (see GeometryAnnotation).
	AnnMigGeometry = AnnPrefix + "mig-geometry"
	AnnMigError    = AnnPrefix + "mig-manager-error"
	// AnnDPLoaded: what the simulated device plugin last loaded its config
	// for (JSON of the inputs whose change makes the real one reload).
	AnnDPLoaded = AnnPrefix + "device-plugin-loaded"
	// AnnDPResources: what the loaded device plugin advertises (JSON of
	// resource -> count), which the simulated kubelet keeps in the node's
	// status: a status write lost (the API server restarting between the
	// label and the status patch) is made again, as the kubelet's periodic
	// node status sync does.
	AnnDPResources = AnnPrefix + "device-plugin-resources"
	// AnnDPConfig: the device-plugin ConfigMap key in effect ("" = empty config).
	AnnDPConfig = AnnPrefix + "device-plugin-config"
	// AnnDPError: why the simulated device plugin cannot start (the real
	// one crash-loops); labels and resources stay as they were.
	AnnDPError = AnnPrefix + "device-plugin-error"
	// AnnManagedLabels: GFD labels the simulator set, so stale ones (e.g.
	// nvidia.com/mig-1g.10gb.*) can be removed.
	AnnManagedLabels = AnnPrefix + "managed-labels"
	// AnnFault: a fault a test injects on one node. FaultDevicePluginHang:
	// after a reload trigger the device plugin (and GFD) never come back, so
	// the node never confirms its new config.
	AnnFault              = AnnPrefix + "fault"
	FaultDevicePluginHang = "device-plugin-hang"
	// FaultMigApplyFail: the MIG manager fails its next reconfiguration
	// (after pending, before touching the GPUs), e.g. to fail a layout on a
	// GPU model the simulator has no placement data for.
	FaultMigApplyFail = "mig-apply-fail"

	StatePending = "pending"
	StateSuccess = "success"
	StateFailed  = "failed"

	MigAllDisabled = "all-disabled"
)

// Hardware is a simulated node's GPU hardware.
type Hardware struct {
	Product           string `json:"product"`
	Count             int    `json:"count"`
	ComputeCapability string `json:"computeCapability,omitempty"`
	MigCapable        bool   `json:"migCapable"`
	DeviceID          string `json:"deviceID,omitempty"` // PCI device ID used by mig-parted device-filter
	// MemoryMiB: nvidia.com/gpu.memory; with Product it selects the go-nvml
	// mock model whose MIG data the MIG manager uses (nvmig.ModelFor).
	MemoryMiB int `json:"memoryMiB,omitempty"`
	// InstanceType: set when the hardware was taken from the --instance-types
	// table for this node.kubernetes.io/instance-type (not from GFD labels).
	InstanceType string `json:"instanceType,omitempty"`
}

// deviceIDs maps GFD product names to their PCI device IDs (device, then
// vendor), as NVIDIA's default mig-parted config writes them in device-filter.
var deviceIDs = map[string]string{
	"NVIDIA-A100-SXM4-40GB": "0x20B010DE",
	"NVIDIA-A100-PCIE-40GB": "0x20F110DE",
	"NVIDIA-A100-SXM4-80GB": "0x20B210DE",
	"NVIDIA-A100-80GB-PCIe": "0x20B510DE",
	"NVIDIA-A30":            "0x20B710DE",
	"NVIDIA-H100-80GB-HBM3": "0x233010DE",
	"NVIDIA-H100-PCIe":      "0x233110DE",
	"NVIDIA-H100-NVL":       "0x232110DE",
	"NVIDIA-H200":           "0x233510DE",
	"NVIDIA-H200-NVL":       "0x233B10DE",
	"NVIDIA-B200":           "0x290110DE",
	"NVIDIA-L4":             "0x27B810DE",
	"NVIDIA-A10":            "0x223610DE",
}

// HardwareOf returns the node's recorded hardware, or derives it from the
// GFD labels it carries (first sight). recorded reports whether the
// annotation existed.
func HardwareOf(labels, annotations map[string]string) (hw Hardware, recorded bool) {
	if s := annotations[AnnHardware]; s != "" {
		if err := json.Unmarshal([]byte(s), &hw); err == nil && hw.Count > 0 {
			return hw, true
		}
	}
	product := labels[LabelProduct]
	if i := strings.Index(product, "-MIG-"); i >= 0 {
		product = product[:i]
	}
	product = strings.TrimSuffix(product, "-SHARED")
	hw = Hardware{Product: product, Count: 1, MigCapable: labels[LabelMigCapable] == "true", DeviceID: deviceIDs[product]}
	fmt.Sscan(labels[LabelCount], &hw.Count)
	fmt.Sscan(labels[LabelMemory], &hw.MemoryMiB)
	if hw.Count < 1 {
		hw.Count = 1
	}
	if maj, min := labels["nvidia.com/gpu.compute.major"], labels["nvidia.com/gpu.compute.minor"]; maj != "" {
		hw.ComputeCapability = maj + "." + min
		if min == "" {
			hw.ComputeCapability = maj + ".0"
		}
	}
	return hw, false
}

// Geometry is the MIG state of every GPU of a node.
type Geometry []nvconf.GPU

type geoGPU struct {
	Enabled    bool              `json:"e"`
	Devices    map[string]int    `json:"d,omitempty"`
	Placements []nvmig.Placement `json:"p,omitempty"`
}

// String: each GPU's MIG mode and devices (JSON, without placements): what
// the device plugin sees, and what "already applied" compares.
func (g Geometry) String() string {
	b, _ := json.Marshal(g.gpus())
	return string(b)
}

func (g Geometry) gpus() []geoGPU {
	out := make([]geoGPU, len(g))
	for i, gpu := range g {
		out[i] = geoGPU{Enabled: gpu.MigEnabled}
		for p, n := range gpu.MigDevices {
			if n > 0 {
				if out[i].Devices == nil {
					out[i].Devices = map[string]int{}
				}
				out[i].Devices[p] = n
			}
		}
	}
	return out
}

// GeometryOf reads the geometry annotation; without one, all GPUs have MIG
// disabled.
func GeometryOf(annotations map[string]string, count int) Geometry {
	var in []geoGPU
	g := make(Geometry, count)
	if err := json.Unmarshal([]byte(annotations[AnnMigGeometry]), &in); err == nil {
		for i := range g {
			if i < len(in) {
				g[i] = nvconf.GPU{MigEnabled: in[i].Enabled, MigDevices: in[i].Devices}
			}
		}
	}
	return g
}

// ApplyLayout is what mig-parted apply does to the GPUs: every entry whose
// device-filter matches the GPU's device ID and whose devices include its
// index sets its MIG mode and devices, later entries winning. GPUs no entry
// matches keep their state.
func ApplyLayout(slice mpv1.MigConfigSpecSlice, hw Hardware, current Geometry) Geometry {
	next := make(Geometry, hw.Count)
	copy(next, current)
	for i := range next {
		for _, e := range slice {
			if !matchesFilter(e.DeviceFilter, hw.DeviceID) || !e.MatchesDevices(i) {
				continue
			}
			devs := map[string]int{}
			for p, n := range e.MigDevices {
				if n > 0 {
					devs[p] = n
				}
			}
			if !e.MigEnabled {
				devs = nil
			}
			next[i] = nvconf.GPU{MigEnabled: e.MigEnabled, MigDevices: devs}
		}
	}
	return next
}

func matchesFilter(filter any, id string) bool {
	var list []string
	switch f := filter.(type) {
	case string:
		if f != "" {
			list = []string{f}
		}
	case []string:
		list = f
	}
	if len(list) == 0 {
		return true
	}
	for _, f := range list {
		if strings.EqualFold(f, id) {
			return true
		}
	}
	return false
}

// ClusterPolicy holds the ClusterPolicy fields the node components depend on.
type ClusterPolicy struct {
	Found         bool
	Tolerations   []Toleration // spec.daemonsets.tolerations
	DPConfigName  string       // spec.devicePlugin.config.name
	DPDefault     string       // spec.devicePlugin.config.default
	MigConfigName string       // spec.migManager.config.name
	MigStrategy   string       // spec.mig.strategy (MIG_STRATEGY env of device plugin and GFD)
	// Sandbox workloads: spec.sandboxWorkloads.{enabled,defaultWorkload,mode}.
	SandboxEnabled  bool
	DefaultWorkload string
	SandboxMode     string
	// spec.vgpuManager.enabled; spec.vgpuDeviceManager.config.name.
	VgpuManagerEnabled bool
	VgpuDMConfigName   string
}

// Node is the part of a Node the simulator reads.
type Node struct {
	Name        string
	Labels      map[string]string
	Annotations map[string]string
	Capacity    map[string]string // status.capacity
	Allocatable map[string]string // status.allocatable
}

// Patch is a set of writes to a node: nil values delete keys.
type Patch struct {
	Labels      map[string]*string
	Annotations map[string]*string
	// Resources: extended resources to set in status.capacity and
	// status.allocatable (nil: leave status alone).
	Resources map[string]string
	// Allocatable: extended resources to set in status.allocatable only
	// (a stopped device plugin: capacity lingers).
	Allocatable map[string]string
	// DropResources: extended resources to remove from status.capacity and
	// status.allocatable (what a node reports before any device plugin has
	// registered, e.g. the pod requests Karpenter's kwok provider copies).
	DropResources []string
	// Ready: a node condition the simulated kubelet posts (status
	// subresource, merged by type).
	Ready *corev1.NodeCondition
	Log   []string
}

func (p *Patch) setLabel(n *Node, k, v string) {
	if cur, ok := n.Labels[k]; ok && cur == v {
		return
	}
	if p.Labels == nil {
		p.Labels = map[string]*string{}
	}
	p.Labels[k] = &v
}

func (p *Patch) delLabel(n *Node, k string) {
	if _, ok := n.Labels[k]; !ok {
		return
	}
	if p.Labels == nil {
		p.Labels = map[string]*string{}
	}
	p.Labels[k] = nil
}

func (p *Patch) setAnn(n *Node, k, v string) {
	if cur, ok := n.Annotations[k]; ok && cur == v {
		return
	}
	if p.Annotations == nil {
		p.Annotations = map[string]*string{}
	}
	p.Annotations[k] = &v
}

func (p *Patch) delAnn(n *Node, k string) {
	if _, ok := n.Annotations[k]; !ok {
		return
	}
	if p.Annotations == nil {
		p.Annotations = map[string]*string{}
	}
	p.Annotations[k] = nil
}

func (p *Patch) logf(format string, args ...any) {
	p.Log = append(p.Log, fmt.Sprintf(format, args...))
}

// Empty reports whether the patch writes nothing.
func (p *Patch) Empty() bool {
	return len(p.Labels) == 0 && len(p.Annotations) == 0 && p.Resources == nil && p.Allocatable == nil && p.Ready == nil && len(p.DropResources) == 0
}

// MigInput is what the simulated MIG manager sees.
type MigInput struct {
	// MigConfig is the mig-parted config file content, Source where it
	// came from; Err set if it cannot be had (ConfigMap missing).
	MigConfig string
	Source    string
	Err       error
	// Busy: what the unfinished GPU pods of the node hold.
	Busy Busy
	Now  time.Time
	// Due is when the pending reconfiguration to the current label value
	// may complete (nil: no reconfiguration started for it yet).
	Due            *time.Time
	Delay          time.Duration
	AutoLabelEmpty bool
}

// MigResult says what to do besides the patch.
type MigResult struct {
	Geometry   Geometry      // the geometry after this step
	StartTimer bool          // a reconfiguration started: due = now + delay
	ClearTimer bool          // the reconfiguration finished
	Requeue    time.Duration // > 0: look at the node again after this
	// InProgress: a reconfiguration is pending; the real MIG manager has
	// paused the device plugin and GFD (nvidia.com/gpu.deploy.*=
	// paused-for-mig-change), so they do not reload until it is done.
	InProgress bool
}

// PlanMig simulates nvidia-mig-manager on one node: it acts when
// nvidia.com/mig.config differs from the last value it acted on. It
// validates the layout (mig-parted assert --valid-config), reports success
// at once if the GPUs already have it, else sets state=pending, waits
// Delay, then applies the layout as mig-parted does (ApplyOnModel): GPUs
// whose devices do not change are skipped, a changed GPU a pod uses fails
// with "In use by another client", a MIG mode change fails while any GPU pod
// runs on the node.
func PlanMig(n *Node, hw Hardware, in MigInput, p *Patch) MigResult {
	geo := GeometryOf(n.Annotations, hw.Count)
	res := MigResult{Geometry: geo}
	if !hw.MigCapable {
		return res
	}
	desired, labelled := n.Labels[LabelMigConfig]
	if !labelled || desired == "" {
		if in.AutoLabelEmpty {
			// The GPU Operator labels MIG-capable nodes all-disabled.
			p.setLabel(n, LabelMigConfig, MigAllDisabled)
			p.logf("labelled %s=%s (as the GPU Operator does on MIG-capable nodes)", LabelMigConfig, MigAllDisabled)
		}
		return res
	}
	// Done with this layout, unless a change to another one was started and the label came
	// back before it was applied: the real MIG manager had already stopped the GPU operands
	// for that change, so they restart (the device plugin reloads, GFD relabels), and it
	// asserts the layout the GPUs already have and reports success (below); state pending
	// would otherwise stay forever.
	if n.Annotations[AnnAppliedMig] == desired {
		if n.Labels[LabelMigState] != StatePending {
			return res
		}
		p.delAnn(n, AnnDPLoaded)
		p.delAnn(n, AnnDPResources)
		p.logf("MIG config %q: change undone before it was applied; operands restarted", desired)
	}
	finish := func(state, errMsg string) {
		p.setLabel(n, LabelMigState, state)
		p.setAnn(n, AnnAppliedMig, desired)
		if errMsg != "" {
			p.setAnn(n, AnnMigError, errMsg)
		} else {
			p.delAnn(n, AnnMigError)
		}
		res.ClearTimer = true
	}
	if in.Err != nil {
		finish(StateFailed, in.Err.Error())
		p.logf("MIG config %q failed: %v", desired, in.Err)
		return res
	}
	slice, err := nvconf.ValidateMigConfig([]byte(in.MigConfig), desired)
	if err != nil {
		finish(StateFailed, fmt.Sprintf("%s (%s)", err, in.Source))
		p.logf("MIG config %q failed validation: %v", desired, err)
		return res
	}
	next := ApplyLayout(slice, hw, geo)
	if next.String() == geo.String() {
		finish(StateSuccess, "")
		p.logf("MIG config %q already applied", desired)
		return res
	}
	if in.Due == nil {
		p.setLabel(n, LabelMigState, StatePending)
		res.StartTimer, res.InProgress = true, true
		res.Requeue = in.Delay
		p.logf("MIG config %q: %s=%s, applying in %v", desired, LabelMigState, StatePending, in.Delay)
		return res
	}
	if wait := in.Due.Sub(in.Now); wait > 0 {
		p.setLabel(n, LabelMigState, StatePending)
		res.Requeue, res.InProgress = wait, true
		return res
	}
	if n.Annotations[AnnFault] == FaultMigApplyFail {
		msg := "fault injected (" + AnnFault + "=" + FaultMigApplyFail + "): the MIG manager failed before changing the GPUs"
		finish(StateFailed, msg)
		p.logf("MIG config %q failed: %s", desired, msg)
		return res
	}
	model := nvmig.ModelFor(hw.Product, hw.MemoryMiB)
	if model == nil && !in.Busy.Empty() {
		// Without placement data no instance can be told from another:
		// any running GPU pod fails the change.
		msg := fmt.Sprintf("In use by another client: GPU pods still running on the node: %s", strings.Join(in.Busy.Pods(), ", "))
		finish(StateFailed, msg)
		p.logf("MIG config %q failed: %s", desired, msg)
		return res
	}
	if model == nil {
		// No go-nvml mock data for this GPU: nothing to place the instances
		// with. They are created as asked, unchecked.
		finish(StateSuccess, "")
		p.setAnn(n, AnnMigGeometry, GeometryAnnotation(next, nil))
		res.Geometry = next
		p.logf("MIG config %q applied: %s (MIG geometry unverified: the go-nvml mock describes no %s with %d MiB; instances created without placement checks)",
			desired, next.String(), hw.Product, hw.MemoryMiB)
		return res
	}
	applied, places, err := ApplyOnModel(model, slice, hw, geo, PlacementsOf(n.Annotations, hw.Count), in.Busy)
	p.setAnn(n, AnnMigGeometry, GeometryAnnotation(applied, places))
	res.Geometry = applied
	if err != nil {
		finish(StateFailed, err.Error())
		p.logf("MIG config %q failed on %s: %v; GPUs left as %s", desired, model, err, applied.String())
		return res
	}
	finish(StateSuccess, "")
	p.logf("MIG config %q applied with %s: %s", desired, model, formatPlacements(places))
	if applied.String() != next.String() {
		// mig-parted v0.13.1 creates nothing on a GPU whose mig-devices name
		// a profile the GPU does not have (its Flatten drops the whole map)
		// and still reports success.
		p.logf("MIG config %q: the GPUs have %s, not the %s asked for: a profile the %s does not have makes mig-parted create no instance on that GPU",
			desired, applied.String(), next.String(), model.Product)
	}
	return res
}

func formatPlacements(places Placements) string {
	// Runs of GPUs with the same instances in one part: "GPUs 0-7: [...]".
	var parts []string
	for i := 0; i < len(places); {
		j, s := i+1, nvmig.FormatPlacements(places[i])
		for j < len(places) && nvmig.FormatPlacements(places[j]) == s {
			j++
		}
		switch {
		case s == "":
		case j-i == 1:
			parts = append(parts, fmt.Sprintf("GPU %d: %s", i, s))
		default:
			parts = append(parts, fmt.Sprintf("GPUs %d-%d: %s", i, j-1, s))
		}
		i = j
	}
	if len(parts) == 0 {
		return "no MIG instances"
	}
	return strings.Join(parts, ", ")
}

// IsGPUResource reports whether an extended resource is one NVIDIA's device
// plugin advertises.
func IsGPUResource(name string) bool {
	return strings.HasPrefix(name, "nvidia.com/gpu") || strings.HasPrefix(name, "nvidia.com/mig-")
}

// Toleration is a toleration of the GPU Operator's DaemonSets
// (ClusterPolicy spec.daemonsets.tolerations).
type Toleration struct {
	Key, Operator, Value, Effect string
}

// Taint is a node taint.
type Taint struct {
	Key, Value, Effect string
}

// daemonSetTolerated: taints the DaemonSet controller adds tolerations for
// to every DaemonSet pod.
var daemonSetTolerated = map[string]bool{
	"node.kubernetes.io/not-ready":           true,
	"node.kubernetes.io/unreachable":         true,
	"node.kubernetes.io/disk-pressure":       true,
	"node.kubernetes.io/memory-pressure":     true,
	"node.kubernetes.io/pid-pressure":        true,
	"node.kubernetes.io/unschedulable":       true,
	"node.kubernetes.io/network-unavailable": true,
}

func (t Toleration) tolerates(taint Taint) bool {
	if t.Effect != "" && t.Effect != taint.Effect {
		return false
	}
	switch t.Operator {
	case "Exists":
		return t.Key == "" || t.Key == taint.Key
	case "", "Equal":
		return t.Key == taint.Key && t.Value == taint.Value
	}
	return false
}

// Untolerated returns the key of the first NoSchedule or NoExecute taint
// that keeps the GPU Operator's DaemonSets (driver, toolkit, device plugin,
// GFD, MIG manager) off the node, or "" if they can run there.
func Untolerated(taints []Taint, tolerations []Toleration) string {
	for _, taint := range taints {
		if taint.Effect == "PreferNoSchedule" || daemonSetTolerated[taint.Key] {
			continue
		}
		ok := false
		for _, t := range tolerations {
			if t.tolerates(taint) {
				ok = true
				break
			}
		}
		if !ok {
			return taint.Key
		}
	}
	return ""
}
