package main

import (
	"context"
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/dynamic"
	corev1client "k8s.io/client-go/kubernetes/typed/core/v1"
	"k8s.io/client-go/tools/clientcmd"

	"gpusharing.io/tests/nvidia/internal/sim"
)

// A Node as Karpenter's kwok provider creates it for an instance type of the
// --instance-types table (no GFD labels, no conditions, capacity = the
// NodeClaim's requests, still tainted unregistered) becomes a GPU node: GFD
// labels, Ready, the device plugin's resources, and sharing once labelled. A
// node of a type not in the table stays as it is.
func TestE2EInstanceTypeNode(t *testing.T) {
	kubeconfig := startKubeLocal(t)
	cfg, err := clientcmd.BuildConfigFromFlags("", kubeconfig)
	if err != nil {
		t.Fatal(err)
	}
	core := corev1client.NewForConfigOrDie(cfg)
	dyn := dynamic.NewForConfigOrDie(cfg)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()

	// The table in the form the operator reads it: its ConfigMap.
	table := filepath.Join(t.TempDir(), "instance-types.yaml")
	if err := os.WriteFile(table, []byte(`apiVersion: v1
kind: ConfigMap
metadata: {name: gpu-sharing-instance-types, namespace: gpu-operator}
data:
  instance-types.yaml: |
    gpu-1x: {gpus: 1, product: NVIDIA-L4, memoryMiB: 23034}
    gpu-8x: {gpus: 8, product: NVIDIA-A100-SXM4-80GB, memoryMiB: 81920, migCapable: true}
`), 0o644); err != nil {
		t.Fatal(err)
	}

	simCtx, stopSim := context.WithCancel(ctx)
	simDone := make(chan error, 1)
	go func() {
		simDone <- run(simCtx, &options{kubeconfig: kubeconfig, namespace: "gpu-operator", clusterPolicy: "cluster-policy",
			migDelay: 300 * time.Millisecond, autoLabelMig: true, fallbacks: sim.FallbackEmpty, retry: time.Second,
			restartDelay: 200 * time.Millisecond, instanceTypes: table})
	}()
	defer func() {
		stopSim()
		if err := <-simDone; err != nil && !errors.Is(err, context.Canceled) {
			t.Errorf("simulator: %v", err)
		}
	}()

	node := func(name string) *corev1.Node {
		t.Helper()
		n, err := core.Nodes().Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		return n
	}
	waitFor := func(what string, cond func() bool) {
		t.Helper()
		deadline := time.Now().Add(30 * time.Second)
		for !cond() {
			if time.Now().After(deadline) {
				t.Fatalf("timed out waiting for %s", what)
			}
			time.Sleep(100 * time.Millisecond)
		}
	}
	quantity := func(rl corev1.ResourceList, res string) string {
		q, ok := rl[corev1.ResourceName(res)]
		if !ok {
			return ""
		}
		return q.String()
	}
	ready := func(n *corev1.Node) *corev1.NodeCondition {
		for i, c := range n.Status.Conditions {
			if c.Type == corev1.NodeReady {
				return &n.Status.Conditions[i]
			}
		}
		return nil
	}
	rl := func(kv ...string) corev1.ResourceList {
		out := corev1.ResourceList{}
		for i := 0; i < len(kv); i += 2 {
			out[corev1.ResourceName(kv[i])] = resource.MustParse(kv[i+1])
		}
		return out
	}
	kwokNode := func(name, instanceType string, capacity, allocatable corev1.ResourceList) {
		t.Helper()
		n := &corev1.Node{
			ObjectMeta: metav1.ObjectMeta{Name: name, Labels: map[string]string{
				sim.LabelInstanceType: instanceType, "kubernetes.io/hostname": name, "kubernetes.io/os": "linux", "kubernetes.io/arch": "amd64",
				"karpenter.sh/nodepool": "gpu-ts4", "karpenter.sh/capacity-type": "on-demand", "topology.kubernetes.io/zone": "zone-a",
				"karpenter.kwok.sh/instance-family": "gpu", "kwok.x-k8s.io/node": "fake", "gpusharing.io/profile": "ts4",
			}},
			Spec: corev1.NodeSpec{ProviderID: "kwok://" + name, Taints: []corev1.Taint{{Key: "karpenter.sh/unregistered", Effect: corev1.TaintEffectNoExecute}}},
			// Nodes keep the status they are created with (the kwok provider's way).
			Status: corev1.NodeStatus{Phase: corev1.NodePending, Capacity: capacity, Allocatable: allocatable},
		}
		if _, err := core.Nodes().Create(ctx, n, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}

	kwokNode("kwok-gpu-8x", "gpu-8x", rl("nvidia.com/gpu", "16", "pods", "1"),
		rl("nvidia.com/gpu", "8", "cpu", "95900m", "memory", "1000Gi", "pods", "110"))
	kwokNode("kwok-cpu", "cpu-4x", rl("cpu", "1", "pods", "1"), rl("cpu", "3900m", "pods", "110"))

	// GFD's labels and the hardware, and the kubelet's Ready.
	waitFor("kwok-gpu-8x labelled and Ready", func() bool {
		n := node("kwok-gpu-8x")
		return n.Labels[sim.LabelGPUPresent] == "true" && ready(n) != nil
	})
	n := node("kwok-gpu-8x")
	for k, v := range map[string]string{
		sim.LabelProduct: "NVIDIA-A100-SXM4-80GB", sim.LabelCount: "8", sim.LabelMemory: "81920", sim.LabelMigCapable: "true",
		"nvidia.com/gpu.compute.major": "8", "nvidia.com/gpu.compute.minor": "0", "nvidia.com/gpu.family": "ampere",
		"nvidia.com/gpu.mode": "compute", "feature.node.kubernetes.io/pci-10de.present": "true",
		"gpusharing.io/profile": "ts4", "karpenter.sh/nodepool": "gpu-ts4",
	} {
		if n.Labels[k] != v {
			t.Errorf("label %s=%q, want %q", k, n.Labels[k], v)
		}
	}
	var hw sim.Hardware
	if err := json.Unmarshal([]byte(n.Annotations[sim.AnnHardware]), &hw); err != nil || hw.InstanceType != "gpu-8x" || hw.Count != 8 || !hw.MigCapable {
		t.Errorf("hardware annotation %q", n.Annotations[sim.AnnHardware])
	}
	if c := ready(n); c.Status != corev1.ConditionTrue || c.Reason != "KubeletReady" {
		t.Errorf("Ready condition %+v", c)
	}
	// The kubelet reports no NVIDIA resource before a device plugin registers
	// one: Karpenter's 16 (the pod's request) is gone. Tainted unregistered,
	// the GPU Operator's DaemonSets do not run yet, so none comes back.
	time.Sleep(time.Second)
	if n := node("kwok-gpu-8x"); quantity(n.Status.Capacity, "nvidia.com/gpu") != "" || quantity(n.Status.Allocatable, "nvidia.com/gpu") != "" || n.Annotations[sim.AnnDPLoaded] != "" {
		t.Fatalf("NVIDIA resources before a device plugin ran (the node is tainted karpenter.sh/unregistered): capacity %v allocatable %v", n.Status.Capacity, n.Status.Allocatable)
	}

	// Karpenter registers the node: the taint goes, the device plugin starts
	// with no config (exclusive) and advertises its 8 GPUs.
	untaint := `{"spec":{"taints":null},"metadata":{"labels":{"karpenter.sh/registered":"true"}}}`
	if _, err := core.Nodes().Patch(ctx, "kwok-gpu-8x", types.MergePatchType, []byte(untaint), metav1.PatchOptions{}); err != nil {
		t.Fatal(err)
	}
	waitFor("kwok-gpu-8x advertising 8 GPUs", func() bool {
		n := node("kwok-gpu-8x")
		return quantity(n.Status.Capacity, "nvidia.com/gpu") == "8" && quantity(n.Status.Allocatable, "nvidia.com/gpu") == "8"
	})
	n = node("kwok-gpu-8x")
	if n.Labels["nvidia.com/gpu.replicas"] != "1" || n.Labels["nvidia.com/gpu.sharing-strategy"] != "none" || n.Labels[sim.LabelMigConfig] != sim.MigAllDisabled {
		t.Errorf("labels %v", n.Labels)
	}
	if quantity(n.Status.Allocatable, "cpu") != "95900m" || quantity(n.Status.Capacity, "pods") != "1" {
		t.Errorf("non-GPU resources changed: capacity %v allocatable %v", n.Status.Capacity, n.Status.Allocatable)
	}
	waitFor("MIG manager success", func() bool { return node("kwok-gpu-8x").Labels[sim.LabelMigState] == sim.StateSuccess })

	// Time-slicing x4 via the device-plugin ConfigMap, as for a seeded node.
	cm := &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Name: "dp-test", Namespace: "gpu-operator"}, Data: map[string]string{
		"ts4": "version: v1\nflags:\n  migStrategy: none\nsharing:\n  timeSlicing:\n    resources:\n    - name: nvidia.com/gpu\n      replicas: 4\n",
	}}
	if _, err := core.ConfigMaps("gpu-operator").Create(ctx, cm, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	cpPatch := `{"spec":{"devicePlugin":{"config":{"name":"dp-test"}}}}`
	if _, err := dyn.Resource(clusterPolicyGVR).Patch(ctx, "cluster-policy", types.MergePatchType, []byte(cpPatch), metav1.PatchOptions{}); err != nil {
		t.Fatal(err)
	}
	body, _ := json.Marshal(map[string]any{"metadata": map[string]any{"labels": map[string]string{sim.LabelDPConfig: "ts4"}}})
	if _, err := core.Nodes().Patch(ctx, "kwok-gpu-8x", types.MergePatchType, body, metav1.PatchOptions{}); err != nil {
		t.Fatal(err)
	}
	waitFor("kwok-gpu-8x time-sliced x4", func() bool {
		return quantity(node("kwok-gpu-8x").Status.Allocatable, "nvidia.com/gpu") == "32"
	})
	if n := node("kwok-gpu-8x"); n.Labels[sim.LabelProduct] != "NVIDIA-A100-SXM4-80GB-SHARED" || n.Labels["nvidia.com/gpu.replicas"] != "4" ||
		n.Labels["nvidia.com/gpu.sharing-strategy"] != "time-slicing" || quantity(n.Status.Capacity, "nvidia.com/gpu") != "32" {
		t.Errorf("after ts4: labels %v capacity %v", n.Labels, n.Status.Capacity)
	}

	// A type not in the table, and the seeded CPU node: untouched.
	for _, name := range []string{"kwok-cpu", "cpu-node-0"} {
		n := node(name)
		if name == "kwok-cpu" && (ready(n) != nil || len(n.Annotations) != 0) {
			t.Errorf("%s: conditions %v annotations %v", name, n.Status.Conditions, n.Annotations)
		}
		for k := range n.Labels {
			if k == sim.LabelGPUPresent || k == sim.LabelProduct || k == "feature.node.kubernetes.io/pci-10de.present" {
				t.Errorf("%s: labelled %s", name, k)
			}
		}
		for k := range n.Annotations {
			if len(k) > len(sim.AnnPrefix) && k[:len(sim.AnnPrefix)] == sim.AnnPrefix {
				t.Errorf("%s: annotated %s", name, k)
			}
		}
	}
}
