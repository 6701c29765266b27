package sim

import (
	"encoding/json"
	"os"
	"reflect"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	"sigs.k8s.io/yaml"
)

const tableYAML = `
gpu-1x: {gpus: 1, product: NVIDIA-L4, memoryMiB: 23034}
gpu-8x: {gpus: 8, product: NVIDIA-A100-SXM4-80GB, memoryMiB: 81920, migCapable: true}
`

func intp(v int) *int { return &v }

func TestParseInstanceTypes(t *testing.T) {
	want := InstanceTypes{
		"gpu-1x": {GPUs: intp(1), Product: "NVIDIA-L4", MemoryMiB: 23034},
		"gpu-8x": {GPUs: intp(8), Product: "NVIDIA-A100-SXM4-80GB", MemoryMiB: 81920, MigCapable: true},
	}
	configMap := "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: gpu-sharing-instance-types, namespace: gpu-operator}\n" +
		"data:\n  instance-types.yaml: |\n" + indent(tableYAML, "    ")
	jsonIn := `{"gpu-1x": {"gpus": 1, "product": "NVIDIA-L4", "memoryMiB": 23034},
	          "gpu-8x": {"gpus": 8, "product": "NVIDIA-A100-SXM4-80GB", "memoryMiB": 81920, "migCapable": true}}`
	for name, in := range map[string]string{"yaml": tableYAML, "json": jsonIn, "configmap": configMap} {
		got, err := ParseInstanceTypes([]byte(in))
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		if !reflect.DeepEqual(got, want) {
			t.Fatalf("%s: got %+v", name, got)
		}
	}
	if got := (InstanceTypes{"b": {}, "a": {}}).Names(); !reflect.DeepEqual(got, []string{"a", "b"}) {
		t.Fatalf("names %v", got)
	}
	// Only gpus is required (as in the operator's table).
	got, err := ParseInstanceTypes([]byte("x: {gpus: 2}"))
	if err != nil || *got["x"].GPUs != 2 || got["x"].Product != "" {
		t.Fatalf("minimal row: %+v %v", got, err)
	}

	for in, msg := range map[string]string{
		"x: {gpus: 1, memory: 3}":           `unknown field "memory"`,
		"x: {product: NVIDIA-L4}":           "x: missing field gpus",
		"x: {gpus: 0}":                      "x: gpus must be at least 1",
		"x: {gpus: 1, memoryMiB: -1}":       "x: memoryMiB must not be negative",
		"x: {gpus: many}":                   "instance-types.yaml: ",
		"a b: {gpus: 1}":                    `"a b" is not a valid node.kubernetes.io/instance-type value`,
		"- {gpus: 1}":                       "instance-types.yaml: ",
		"kind: ConfigMap\ndata: {other: x}": "ConfigMap has no data key instance-types.yaml",
	} {
		if _, err := ParseInstanceTypes([]byte(in)); err == nil || !strings.Contains(err.Error(), msg) {
			t.Errorf("%q: error %v, want %q", in, err, msg)
		}
	}
}

func indent(s, prefix string) string {
	var b strings.Builder
	for _, l := range strings.Split(strings.TrimLeft(s, "\n"), "\n") {
		if l != "" {
			b.WriteString(prefix + l)
		}
		b.WriteString("\n")
	}
	return b.String()
}

func TestInstanceTypeHardware(t *testing.T) {
	table, err := ParseInstanceTypes([]byte(tableYAML + "t4: {gpus: 2, product: Tesla-T4}\nodd: {gpus: 1, product: Foo-X}\nbare: {gpus: 3}\n"))
	if err != nil {
		t.Fatal(err)
	}
	for name, want := range map[string]Hardware{
		"gpu-8x": {Product: "NVIDIA-A100-SXM4-80GB", Count: 8, ComputeCapability: "8.0", MigCapable: true, DeviceID: "0x20B210DE", MemoryMiB: 81920, InstanceType: "gpu-8x"},
		"gpu-1x": {Product: "NVIDIA-L4", Count: 1, ComputeCapability: "8.9", DeviceID: "0x27B810DE", MemoryMiB: 23034, InstanceType: "gpu-1x"},
		"t4":     {Product: "Tesla-T4", Count: 2, ComputeCapability: "7.5", InstanceType: "t4"},
		"odd":    {Product: "Foo-X", Count: 1, InstanceType: "odd"},
		"bare":   {Count: 3, InstanceType: "bare"},
	} {
		if got := table[name].Hardware(name); got != want {
			t.Errorf("%s: %+v, want %+v", name, got, want)
		}
	}
	for cc, fam := range map[string]string{"7.0": "volta", "7.5": "turing", "8.0": "ampere", "8.6": "ampere", "8.9": "ada-lovelace", "9.0": "hopper", "10.0": "blackwell", "": ""} {
		if got := archFamily(cc); got != fam {
			t.Errorf("family of %q: %q, want %q", cc, got, fam)
		}
	}
	l := DiscoveryLabels(table["bare"].Hardware("bare"))
	for _, k := range []string{LabelProduct, LabelMemory, "nvidia.com/gpu.compute.major", "nvidia.com/gpu.family"} {
		if _, ok := l[k]; ok {
			t.Errorf("bare row: label %s written: %v", k, l)
		}
	}
	if l[LabelCount] != "3" || l[LabelMigCapable] != "false" || l[LabelGPUPresent] != "true" {
		t.Errorf("bare row: %v", l)
	}
}

// The labels written for an instance type are those GFD, NFD and the GPU
// Operator's gpu.present put on the seeded nodes of the same hardware.
func TestDiscoveryLabelsMirrorSeededNodes(t *testing.T) {
	data, err := os.ReadFile("../../../cluster/fixtures/nodes.yaml")
	if err != nil {
		t.Fatal(err)
	}
	seen := 0
	for _, doc := range strings.Split(string(data), "\n---\n") {
		var node corev1.Node
		if err := yaml.Unmarshal([]byte(doc), &node); err != nil {
			t.Fatal(err)
		}
		l := node.Labels
		if l[LabelGPUPresent] != "true" {
			continue
		}
		seen++
		row := InstanceType{GPUs: intp(0), Product: l[LabelProduct], MigCapable: l[LabelMigCapable] == "true"}
		yaml.Unmarshal([]byte(l[LabelCount]), row.GPUs)
		yaml.Unmarshal([]byte(l[LabelMemory]), &row.MemoryMiB)
		got := DiscoveryLabels(row.Hardware("t"))
		for k, v := range got {
			if l[k] != v {
				t.Errorf("%s: %s=%q, the seeded node has %q", node.Name, k, v, l[k])
			}
		}
		// Every hardware label of the seeded node is written; what is not
		// is the device plugin's, the GPU Operator's or the MIG manager's.
		for k := range l {
			_, written := got[k]
			later := strings.HasPrefix(k, "nvidia.com/gpu.deploy.") || strings.HasPrefix(k, "nvidia.com/mig.config") ||
				k == "nvidia.com/gpu.replicas" || k == "nvidia.com/gpu.sharing-strategy" || k == "nvidia.com/mig.strategy" || k == "nvidia.com/mps.capable"
			if !written && !later && (strings.HasPrefix(k, "nvidia.com/") || strings.HasPrefix(k, "feature.node.kubernetes.io/")) {
				t.Errorf("%s: label %s=%s not written", node.Name, k, l[k])
			}
		}
	}
	if seen < 3 {
		t.Fatalf("only %d GPU nodes in the fixture", seen)
	}
}

// karpenterNode is a Node as Karpenter's kwok provider creates it: the
// instance type, Karpenter's and the NodePool's labels, capacity = the
// NodeClaim's requests, no GFD labels, no conditions.
func karpenterNode() *Node {
	return &Node{
		Name: "angry-feistel-1",
		Labels: map[string]string{
			LabelInstanceType: "gpu-8x", "karpenter.sh/nodepool": "gpu-ts4", "karpenter.sh/registered": "true",
			"gpusharing.io/profile": "ts4", "kubernetes.io/hostname": "angry-feistel-1",
		},
		Annotations: map[string]string{},
		Capacity:    map[string]string{"nvidia.com/gpu": "16", "pods": "1"},
		Allocatable: map[string]string{"nvidia.com/gpu": "8", "cpu": "95900m", "pods": "110"},
	}
}

func TestTableNode(t *testing.T) {
	table, _ := ParseInstanceTypes([]byte(tableYAML))
	n := karpenterNode()
	if typ, ok := TableNode(n.Labels, n.Annotations, table); !ok || typ != "gpu-8x" {
		t.Fatalf("karpenter node: %q %v", typ, ok)
	}
	if _, ok := TableNode(n.Labels, n.Annotations, nil); ok {
		t.Fatal("no table: a table node")
	}
	cpu := map[string]string{LabelInstanceType: "m7i.4xlarge"}
	if _, ok := TableNode(cpu, nil, table); ok {
		t.Fatal("cpu node: a table node")
	}
	if _, ok := TableNode(map[string]string{}, nil, table); ok {
		t.Fatal("no instance type: a table node")
	}
	// A node GFD labelled (seeded), even of a table type, keeps its labels' hardware.
	seeded := a100Node()
	seeded.Labels[LabelInstanceType] = "gpu-8x"
	if _, ok := TableNode(seeded.Labels, seeded.Annotations, table); ok {
		t.Fatal("seeded node: a table node")
	}
	hw, _ := HardwareOf(seeded.Labels, seeded.Annotations)
	seeded.Annotations[AnnHardware] = mustJSON(hw)
	if _, ok := TableNode(seeded.Labels, seeded.Annotations, table); ok {
		t.Fatal("seeded node with recorded hardware: a table node")
	}
}

func mustJSON(v any) string {
	b, err := json.Marshal(v)
	if err != nil {
		panic(err)
	}
	return string(b)
}

// A Karpenter node of a table type: first sight records the hardware and
// labels it like GFD; after that the MIG manager and the device plugin play
// it as a seeded node, and the plugin's nvidia.com/gpu replaces Karpenter's.
func TestInstanceTypeNodeThenDevicePlugin(t *testing.T) {
	table, _ := ParseInstanceTypes([]byte(tableYAML))
	n := karpenterNode()
	p := &Patch{}
	hw, recorded := PlanInstanceType(n, "gpu-8x", table["gpu-8x"], p)
	if recorded || hw.Count != 8 || hw.InstanceType != "gpu-8x" {
		t.Fatalf("first sight: %+v %v", hw, recorded)
	}
	apply(n, p)
	for k, v := range map[string]string{
		LabelGPUPresent: "true", LabelProduct: "NVIDIA-A100-SXM4-80GB", LabelCount: "8", LabelMemory: "81920",
		LabelMigCapable: "true", "nvidia.com/gpu.compute.major": "8", "nvidia.com/gpu.compute.minor": "0",
		"nvidia.com/gpu.family": "ampere", "feature.node.kubernetes.io/pci-10de.present": "true",
		"karpenter.sh/nodepool": "gpu-ts4",
	} {
		if n.Labels[k] != v {
			t.Errorf("label %s=%q, want %q", k, n.Labels[k], v)
		}
	}
	if typ, ok := TableNode(n.Labels, n.Annotations, table); !ok || typ != "gpu-8x" {
		t.Fatalf("after first sight: not a table node")
	}
	// Second sight: recorded, nothing to write.
	p = &Patch{}
	if hw2, recorded := PlanInstanceType(n, "gpu-8x", table["gpu-8x"], p); !recorded || hw2 != hw || !p.Empty() {
		t.Fatalf("second sight: %+v %v %+v", hw2, recorded, p)
	}
	// HardwareOf (the common path) reads the same hardware back.
	if got, recorded := HardwareOf(n.Labels, n.Annotations); !recorded || got != hw {
		t.Fatalf("HardwareOf: %+v %v", got, recorded)
	}

	// MIG manager: all-disabled, as on any MIG-capable node.
	p = &Patch{}
	PlanMig(n, hw, MigInput{AutoLabelEmpty: true, MigConfig: BuiltinMigConfig}, p)
	if v := p.Labels[LabelMigConfig]; v == nil || *v != MigAllDisabled {
		t.Fatalf("mig.config: %+v", p.Labels)
	}
	apply(n, p)

	// Device plugin without a config (exclusive): 8 GPUs in capacity and
	// allocatable, Karpenter's capacity 16 replaced.
	p = &Patch{}
	PlanDevicePlugin(n, hw, DPInput{CP: ClusterPolicy{Found: true}, Geometry: GeometryOf(n.Annotations, hw.Count), Now: time.Unix(1, 0)}, p)
	if p.Resources["nvidia.com/gpu"] != "8" {
		t.Fatalf("resources %v (log %v)", p.Resources, p.Log)
	}
	apply(n, p)
	if n.Capacity["nvidia.com/gpu"] != "8" || n.Allocatable["nvidia.com/gpu"] != "8" || n.Capacity["pods"] != "1" {
		t.Fatalf("capacity %v allocatable %v", n.Capacity, n.Allocatable)
	}
	if n.Labels["nvidia.com/gpu.replicas"] != "1" || n.Labels["nvidia.com/gpu.sharing-strategy"] != "none" {
		t.Fatalf("labels %v", n.Labels)
	}
}

func TestKubeletReady(t *testing.T) {
	if HasReadyCondition(nil) || HasReadyCondition([]corev1.NodeCondition{{Type: corev1.NodeMemoryPressure}}) {
		t.Fatal("ready without a Ready condition")
	}
	if !HasReadyCondition([]corev1.NodeCondition{{Type: corev1.NodeReady, Status: corev1.ConditionFalse}}) {
		t.Fatal("a Ready=False condition is a Ready condition")
	}
	c := KubeletReady(time.Unix(100, 0))
	if c.Type != corev1.NodeReady || c.Status != corev1.ConditionTrue || c.Reason != "KubeletReady" ||
		!strings.Contains(c.Message, "simulated") || c.LastHeartbeatTime.Unix() != 100 {
		t.Fatalf("%+v", c)
	}
}
