package sim

import (
	"encoding/json"
	"fmt"
	"sort"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/validation"
	"sigs.k8s.io/yaml"
)

// LabelInstanceType is the well-known label naming a node's instance type
// (Karpenter and cloud providers set it).
const LabelInstanceType = "node.kubernetes.io/instance-type"

// InstanceTypesKey is the data key of the operator's instance-type table in
// its ConfigMap (gpu-sharing-instance-types).
const InstanceTypesKey = "instance-types.yaml"

// InstanceType is one row of the operator's instance-type table: the GPUs of
// a node of that type.
type InstanceType struct {
	GPUs       *int   `json:"gpus"`
	Product    string `json:"product,omitempty"`
	MemoryMiB  int    `json:"memoryMiB,omitempty"`
	MigCapable bool   `json:"migCapable,omitempty"`
}

// InstanceTypes maps instance-type names to their GPUs.
type InstanceTypes map[string]InstanceType

// ParseInstanceTypes reads the operator's instance-type table: either the
// table itself (YAML or JSON: `name: {gpus, product, memoryMiB, migCapable}`)
// or a ConfigMap manifest holding it under data["instance-types.yaml"]. As
// the operator does, unknown fields are errors and gpus must be at least 1;
// names must also be label values (they are matched against
// node.kubernetes.io/instance-type).
func ParseInstanceTypes(data []byte) (InstanceTypes, error) {
	var cm struct {
		Kind string            `json:"kind"`
		Data map[string]string `json:"data"`
	}
	if err := yaml.Unmarshal(data, &cm); err == nil && cm.Kind == "ConfigMap" {
		s, ok := cm.Data[InstanceTypesKey]
		if !ok {
			return nil, fmt.Errorf("ConfigMap has no data key %s", InstanceTypesKey)
		}
		data = []byte(s)
	}
	var t InstanceTypes
	if err := yaml.UnmarshalStrict(data, &t); err != nil {
		return nil, fmt.Errorf("%s: %w", InstanceTypesKey, err)
	}
	for _, name := range t.Names() {
		row := t[name]
		switch {
		case row.GPUs == nil:
			return nil, fmt.Errorf("%s: %s: missing field gpus", InstanceTypesKey, name)
		case *row.GPUs < 1:
			return nil, fmt.Errorf("%s: %s: gpus must be at least 1", InstanceTypesKey, name)
		case row.MemoryMiB < 0:
			return nil, fmt.Errorf("%s: %s: memoryMiB must not be negative", InstanceTypesKey, name)
		}
		if errs := validation.IsValidLabelValue(name); len(errs) > 0 || name == "" {
			return nil, fmt.Errorf("%s: %q is not a valid %s value: %s", InstanceTypesKey, name, LabelInstanceType, strings.Join(errs, "; "))
		}
	}
	return t, nil
}

// Names returns the table's instance types, sorted.
func (t InstanceTypes) Names() []string {
	out := make([]string, 0, len(t))
	for k := range t {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}

// Hardware is the GPU hardware a node of this type has.
func (it InstanceType) Hardware(name string) Hardware {
	hw := Hardware{Product: it.Product, Count: 1, MemoryMiB: it.MemoryMiB, MigCapable: it.MigCapable,
		DeviceID: deviceIDs[it.Product], InstanceType: name}
	if it.GPUs != nil {
		hw.Count = *it.GPUs
	}
	if cc, ok := computeCapabilityOf(it.Product); ok {
		hw.ComputeCapability = cc
	}
	return hw
}

// computeCapabilities: compute capability by GPU model, the model being the
// first word of the GFD product name after NVIDIA-/Tesla- (NVIDIA-A100-SXM4-80GB
// -> A100, Tesla-T4 -> T4).
var computeCapabilities = map[string]string{
	"V100": "7.0", "T4": "7.5",
	"A100": "8.0", "A30": "8.0", "A10": "8.6", "A10G": "8.6", "A40": "8.6", "A16": "8.6", "A2": "8.6",
	"L4": "8.9", "L40": "8.9", "L40S": "8.9",
	"H100": "9.0", "H200": "9.0", "H800": "9.0", "H20": "9.0", "GH200": "9.0",
	"B200": "10.0", "B100": "10.0", "GB200": "10.0",
}

func computeCapabilityOf(product string) (string, bool) {
	model := product
	for _, p := range []string{"NVIDIA-", "Tesla-"} {
		model = strings.TrimPrefix(model, p)
	}
	model, _, _ = strings.Cut(model, "-")
	cc, ok := computeCapabilities[model]
	return cc, ok
}

// archFamily is GFD's nvidia.com/gpu.family for a compute capability
// (lm/resource.go getArchFamily).
func archFamily(cc string) string {
	var major, minor int
	if _, err := fmt.Sscanf(cc, "%d.%d", &major, &minor); err != nil {
		return ""
	}
	switch {
	case major == 7 && minor < 5:
		return "volta"
	case major == 7:
		return "turing"
	case major == 8 && minor < 9:
		return "ampere"
	case major == 8:
		return "ada-lovelace"
	case major == 9:
		return "hopper"
	case major == 10:
		return "blackwell"
	}
	return ""
}

// Driver and CUDA versions the simulated GFD reports: the seeded nodes'
// (tests/cluster/fixtures/nodes.yaml).
const (
	simDriverVersion = "580.82.07"
	simCudaRuntime   = "13.0"
)

// DiscoveryLabels are the labels a node with this hardware gets before the
// device plugin loads: Node Feature Discovery's NVIDIA PCI label, the GPU
// Operator's nvidia.com/gpu.present, and GPU Feature Discovery's hardware
// labels (product, count, memory, family, compute capability, mode, MIG
// capability, driver and CUDA versions), as the seeded nodes carry them.
// The sharing labels (replicas, sharing-strategy, mig.strategy, mps.capable)
// are the device plugin's step (PlanDevicePlugin).
func DiscoveryLabels(hw Hardware) map[string]string {
	l := map[string]string{
		"feature.node.kubernetes.io/pci-10de.present": "true",
		LabelGPUPresent:                        "true",
		LabelCount:                             fmt.Sprint(hw.Count),
		LabelMigCapable:                        fmt.Sprint(hw.MigCapable),
		"nvidia.com/gpu.mode":                  "compute",
		"nvidia.com/cuda.driver-version.full":  simDriverVersion,
		"nvidia.com/cuda.runtime-version.full": simCudaRuntime,
	}
	for i, part := range strings.Split(simDriverVersion, ".") {
		l["nvidia.com/cuda.driver."+[]string{"major", "minor", "rev"}[i]] = part
	}
	major, minor, _ := strings.Cut(simCudaRuntime, ".")
	l["nvidia.com/cuda.runtime.major"], l["nvidia.com/cuda.runtime.minor"] = major, minor
	if hw.Product != "" {
		l[LabelProduct] = hw.Product
	}
	if hw.MemoryMiB > 0 {
		l[LabelMemory] = fmt.Sprint(hw.MemoryMiB)
	}
	if major, minor, ok := strings.Cut(hw.ComputeCapability, "."); ok {
		l["nvidia.com/gpu.compute.major"], l["nvidia.com/gpu.compute.minor"] = major, minor
		if f := archFamily(hw.ComputeCapability); f != "" {
			l["nvidia.com/gpu.family"] = f
		}
	}
	return l
}

// TableNode reports the instance type of a node whose hardware comes from the
// table: its node.kubernetes.io/instance-type is in the table and it either
// has no GFD product label (not discovered yet) or its recorded hardware was
// taken from that type. Nodes GFD labelled themselves (seeded ones) are not.
func TableNode(labels, annotations map[string]string, table InstanceTypes) (string, bool) {
	name := labels[LabelInstanceType]
	if _, ok := table[name]; !ok || name == "" {
		return "", false
	}
	var hw Hardware
	if s := annotations[AnnHardware]; s != "" && json.Unmarshal([]byte(s), &hw) == nil && hw.Count > 0 {
		return name, hw.InstanceType == name
	}
	return name, labels[LabelProduct] == ""
}

// PlanInstanceType plays GPU Feature Discovery (and the GPU Operator's
// gpu.present) on first sight of a node whose hardware the table gives:
// records the hardware and writes the discovery labels. Once recorded, the
// node is a GPU node like a seeded one and the labels are left to the other
// steps. recorded reports whether the hardware was already recorded.
func PlanInstanceType(n *Node, name string, it InstanceType, p *Patch) (hw Hardware, recorded bool) {
	if hw, recorded = HardwareOf(n.Labels, n.Annotations); recorded {
		return hw, true
	}
	hw = it.Hardware(name)
	b, _ := json.Marshal(hw)
	p.setAnn(n, AnnHardware, string(b))
	labels := DiscoveryLabels(hw)
	keys := make([]string, 0, len(labels))
	for k, v := range labels {
		p.setLabel(n, k, v)
		keys = append(keys, k)
	}
	sort.Strings(keys)
	p.logf("first seen: instance type %s from the --instance-types table: hardware %s; GPU Feature Discovery labels %s", name, b, strings.Join(keys, ","))
	return hw, false
}

// KubeletReady is the Ready condition the simulated kubelet posts on a node
// that has none (one the kwok provider created).
func KubeletReady(now time.Time) corev1.NodeCondition {
	t := metav1.NewTime(now)
	return corev1.NodeCondition{Type: corev1.NodeReady, Status: corev1.ConditionTrue, Reason: "KubeletReady",
		Message: "kubelet is posting ready status (simulated by gpu-node-simulator)", LastHeartbeatTime: t, LastTransitionTime: t}
}

// HasReadyCondition reports whether a node's status has a Ready condition
// (whatever its status: a kubelet that posted one keeps posting it).
func HasReadyCondition(conds []corev1.NodeCondition) bool {
	for _, c := range conds {
		if c.Type == corev1.NodeReady {
			return true
		}
	}
	return false
}
