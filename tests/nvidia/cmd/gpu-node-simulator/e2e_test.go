package main

// End-to-end test of the simulator against the local control plane of
// tests/cluster (kube-local), started from the binary KUBE_LOCAL names
// (tests/cluster/cluster.sh path prints it; `tests/nvidia/build.sh test`,
// which `make test` runs, sets it). Without KUBE_LOCAL it is skipped, except
// under CI (CI=true), where it fails.

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	resourcev1 "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/dynamic"
	corev1client "k8s.io/client-go/kubernetes/typed/core/v1"
	resourcev1client "k8s.io/client-go/kubernetes/typed/resource/v1"
	"k8s.io/client-go/tools/clientcmd"

	"gpusharing.io/tests/nvidia/internal/sim"
)

func startKubeLocal(t *testing.T) string {
	bin := os.Getenv("KUBE_LOCAL")
	if bin == "" {
		if ci, _ := strconv.ParseBool(os.Getenv("CI")); ci {
			t.Fatal("KUBE_LOCAL (path to tests/cluster's kube-local binary) not set: under CI this test must run (tests/nvidia/build.sh test sets it)")
		}
		t.Skip("KUBE_LOCAL (path to tests/cluster's kube-local binary) not set")
	}
	logPath := filepath.Join(t.TempDir(), "kube-local.log")
	logFile, err := os.Create(logPath)
	if err != nil {
		t.Fatal(err)
	}
	defer logFile.Close() // the child has its own copy
	logTail := func() string {
		b, _ := os.ReadFile(logPath)
		lines := strings.Split(strings.TrimRight(string(b), "\n"), "\n")
		if len(lines) > 40 {
			lines = lines[len(lines)-40:]
		}
		return strings.Join(lines, "\n")
	}
	cmd := exec.Command(bin, "--dir", t.TempDir(), "--watch-parent=false")
	stdin, err := cmd.StdinPipe() // kube-local exits when stdin closes
	if err != nil {
		t.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stderr = logFile
	if err := cmd.Start(); err != nil {
		t.Fatalf("start %s: %v", bin, err)
	}
	ready := make(chan string, 1)
	exited := make(chan struct{})
	go func() {
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			if kc, ok := strings.CutPrefix(sc.Text(), "READY "); ok {
				select {
				case ready <- kc:
				default:
				}
			}
		}
		_ = cmd.Wait() // after stdout is drained, as os/exec requires
		close(exited)
	}()
	t.Cleanup(func() {
		stdin.Close()
		select {
		case <-exited:
		case <-time.After(30 * time.Second):
			_ = cmd.Process.Kill()
			<-exited
		}
		if t.Failed() {
			t.Logf("kube-local stderr (last lines):\n%s", logTail())
		}
	})
	select {
	case kc := <-ready:
		return kc
	case <-exited:
		t.Fatalf("kube-local exited before it was ready: %v", cmd.ProcessState)
	case <-time.After(150 * time.Second):
		t.Fatal("kube-local not ready within 150s")
	}
	return ""
}

func TestE2ESimulatorAgainstAPIServer(t *testing.T) {
	kubeconfig := startKubeLocal(t)
	cfg, err := clientcmd.BuildConfigFromFlags("", kubeconfig)
	if err != nil {
		t.Fatal(err)
	}
	core := corev1client.NewForConfigOrDie(cfg)
	dyn := dynamic.NewForConfigOrDie(cfg)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()

	simCtx, stopSim := context.WithCancel(ctx)
	simDone := make(chan error, 1)
	go func() {
		simDone <- run(simCtx, &options{kubeconfig: kubeconfig, namespace: "gpu-operator", clusterPolicy: "cluster-policy",
			migDelay: 300 * time.Millisecond, autoLabelMig: true, fallbacks: sim.FallbackEmpty, retry: time.Second,
			consumableShares: "4"})
	}()
	defer func() {
		stopSim()
		<-simDone
	}()

	node := func(name string) *corev1.Node {
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
	label := func(name, key, value string) {
		t.Helper()
		body, _ := json.Marshal(map[string]any{"metadata": map[string]any{"labels": map[string]any{key: value}}})
		if _, err := core.Nodes().Patch(ctx, name, types.MergePatchType, body, metav1.PatchOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	capacity := func(name, res string) string {
		q := node(name).Status.Allocatable[corev1.ResourceName(res)]
		return q.String()
	}

	// First sight: every GPU node gets its hardware recorded and its plugin loaded.
	for _, n := range []string{"l4-node-0", "a100-node-0", "a100-node-1", "h200-node-0"} {
		waitFor(n+" first sight", func() bool { return node(n).Annotations[sim.AnnDPLoaded] != "" })
	}
	// Steady state writes nothing.
	rv := node("l4-node-0").ResourceVersion
	time.Sleep(1500 * time.Millisecond)
	if got := node("l4-node-0").ResourceVersion; got != rv {
		t.Fatalf("steady state: resourceVersion moved %s -> %s", rv, got)
	}

	// Device-plugin ConfigMap + ClusterPolicy pointing at it.
	cm := &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Name: "dp-test", Namespace: "gpu-operator"}, Data: map[string]string{
		"default": "version: v1\nflags:\n  migStrategy: none\n",
		"ts4":     "version: v1\nflags:\n  migStrategy: none\nsharing:\n  timeSlicing:\n    resources:\n    - name: nvidia.com/gpu\n      replicas: 4\n",
		"mig-ts2": "version: v1\nflags:\n  migStrategy: single\nsharing:\n  timeSlicing:\n    resources:\n    - name: nvidia.com/gpu\n      replicas: 2\n",
	}}
	if _, err := core.ConfigMaps("gpu-operator").Create(ctx, cm, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	cpPatch := `{"spec":{"devicePlugin":{"config":{"name":"dp-test","default":"default"}},"mig":{"strategy":"single"}}}`
	if _, err := dyn.Resource(clusterPolicyGVR).Patch(ctx, "cluster-policy", types.MergePatchType, []byte(cpPatch), metav1.PatchOptions{}); err != nil {
		t.Fatal(err)
	}

	label("l4-node-0", sim.LabelDPConfig, "ts4")
	waitFor("l4-node-0 time-sliced x4", func() bool { return capacity("l4-node-0", "nvidia.com/gpu") == "16" })
	if n := node("l4-node-0"); n.Labels["nvidia.com/gpu.product"] != "NVIDIA-L4-SHARED" || n.Labels["nvidia.com/gpu.replicas"] != "4" ||
		n.Labels["nvidia.com/gpu.sharing-strategy"] != "time-slicing" {
		t.Fatalf("labels %v", n.Labels)
	}

	label("l4-node-0", sim.LabelDPConfig, "missing")
	waitFor("device-plugin error", func() bool {
		return strings.Contains(node("l4-node-0").Annotations[sim.AnnDPError], "specified config missing does not exist")
	})
	if c := capacity("l4-node-0", "nvidia.com/gpu"); c != "16" {
		t.Fatalf("capacity changed on a crash-looping plugin: %s", c)
	}

	// MIG: all-1g.10gb with time-slicing x2 under single: 8 x 7 x 2.
	label("a100-node-0", sim.LabelDPConfig, "mig-ts2")
	label("a100-node-0", sim.LabelMigConfig, "all-1g.10gb")
	sawPending := false
	waitFor("MIG success", func() bool {
		s := node("a100-node-0").Labels[sim.LabelMigState]
		sawPending = sawPending || s == sim.StatePending
		return s == sim.StateSuccess && node("a100-node-0").Annotations[sim.AnnAppliedMig] == "all-1g.10gb"
	})
	if !sawPending {
		t.Log("pending state not observed (polling may have missed it)")
	}
	waitFor("MIG capacity", func() bool { return capacity("a100-node-0", "nvidia.com/gpu") == "112" })
	// Each instance placed by the go-nvml mock's A100 80GB data: seven 1g at 0..6.
	if geo := node("a100-node-0").Annotations[sim.AnnMigGeometry]; !strings.Contains(geo, `"p":[{"profile":"1g.10gb","start":0,"size":1}`) ||
		!strings.Contains(geo, `{"profile":"1g.10gb","start":6,"size":1}]`) {
		t.Fatalf("geometry %s", geo)
	}

	// NVIDIA's DRA kubelet plugin, switched on per node: its ResourceSlice
	// (accepted by the API server's validation) names the node's GPUs as
	// driver v0.5.0 does, with shares=4 under --consumable-shares=4; a GPU
	// with MIG on is published as its instances; switched off, the slice goes.
	res := resourcev1client.NewForConfigOrDie(cfg)
	// By driver and node, as the scheduler reads slices (the name is the simulator's).
	slice := func(name string) (*resourcev1.ResourceSlice, error) {
		list, err := res.ResourceSlices().List(ctx, metav1.ListOptions{FieldSelector: "spec.driver=" + sim.DRADriver + ",spec.nodeName=" + name})
		switch {
		case err != nil:
			return nil, err
		case len(list.Items) != 1:
			return nil, apierrors.NewNotFound(resourcev1.Resource("resourceslices"), name)
		}
		return &list.Items[0], nil
	}
	label("h200-node-0", sim.LabelDeployDRADriver, "true")
	label("a100-node-0", sim.LabelDeployDRADriver, "true")
	waitFor("ResourceSlices published", func() bool {
		_, e1 := slice("h200-node-0")
		_, e2 := slice("a100-node-0")
		return e1 == nil && e2 == nil
	})
	h200, _ := slice("h200-node-0")
	gpus, _ := strconv.Atoi(node("h200-node-0").Labels[sim.LabelCount])
	if h200.Spec.Driver != "gpu.nvidia.com" || h200.Spec.Pool.Name != "h200-node-0" || *h200.Spec.NodeName != "h200-node-0" ||
		len(h200.Spec.Devices) != gpus || gpus == 0 {
		t.Fatalf("h200 slice: driver %s pool %s, %d devices for %d GPUs", h200.Spec.Driver, h200.Spec.Pool.Name, len(h200.Spec.Devices), gpus)
	}
	d0 := h200.Spec.Devices[0]
	shares := d0.Capacity["shares"]
	if d0.Name != "gpu-0" || *d0.Attributes["type"].StringValue != "gpu" || *d0.Attributes["architecture"].StringValue != "Hopper" ||
		d0.AllowMultipleAllocations == nil || !*d0.AllowMultipleAllocations || shares.Value.Value() != 4 ||
		shares.RequestPolicy == nil || shares.RequestPolicy.Default.Value() != 1 {
		t.Fatalf("h200 device 0: %+v", d0)
	}
	a100, _ := slice("a100-node-0")
	if len(a100.Spec.Devices) != 56 || a100.Spec.Devices[0].Name != "gpu-0-mig-1g10gb-0-0" || a100.Spec.Devices[55].Name != "gpu-7-mig-1g10gb-0-6" ||
		a100.OwnerReferences[0].Kind != "Node" || a100.OwnerReferences[0].Name != "a100-node-0" ||
		*a100.Spec.Devices[0].Attributes["profile"].StringValue != "1g.10gb" || *a100.Spec.Devices[0].Attributes["type"].StringValue != "mig" {
		t.Fatalf("a100 slice: %d devices, first %+v", len(a100.Spec.Devices), a100.Spec.Devices[0])
	}
	label("a100-node-0", sim.LabelDeployDRADriver, "false")
	waitFor("ResourceSlice withdrawn", func() bool {
		_, err := slice("a100-node-0")
		return apierrors.IsNotFound(err)
	})

	// A GPU pod on a100-node-1 makes its reconfiguration fail.
	pod := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "busy", Namespace: "default"}, Spec: corev1.PodSpec{
		NodeName: "a100-node-1",
		Containers: []corev1.Container{{Name: "c", Image: "x", Resources: corev1.ResourceRequirements{
			Limits: corev1.ResourceList{"nvidia.com/gpu": resource.MustParse("1")}}}},
	}}
	if _, err := core.Pods("default").Create(ctx, pod, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	label("a100-node-1", sim.LabelMigConfig, "all-3g.40gb")
	waitFor("MIG failed", func() bool { return node("a100-node-1").Labels[sim.LabelMigState] == sim.StateFailed })
	if msg := node("a100-node-1").Annotations[sim.AnnMigError]; !strings.Contains(msg, "In use by another client") {
		t.Fatalf("mig error %q", msg)
	}
	// The kubelet recorded which GPU it gave the pod (a whole one: MIG off).
	if got, err := core.Pods("default").Get(ctx, "busy", metav1.GetOptions{}); err != nil || got.Annotations[sim.AnnDevices] != "0" {
		t.Fatalf("pod devices %v (%v)", got.Annotations, err)
	}

	// A layout no A100 can hold (two 3g.40gb take all 8 memory slices): failed,
	// with mig-parted's error; mig-parted stops at GPU 0 and leaves it
	// cleared, the other GPUs keep their 1g.10gb: nothing of the new layout.
	migCM := &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Name: "mig-test", Namespace: "gpu-operator"}, Data: map[string]string{
		"config.yaml": "version: v1\nmig-configs:\n  all-disabled:\n  - devices: all\n    mig-enabled: false\n" +
			"  all-1g.10gb:\n  - devices: all\n    mig-enabled: true\n    mig-devices: {1g.10gb: 7}\n" +
			"  two-3g-and-2g:\n  - devices: all\n    mig-enabled: true\n    mig-devices: {3g.40gb: 2, 2g.20gb: 1}\n",
	}}
	if _, err := core.ConfigMaps("gpu-operator").Create(ctx, migCM, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	cpPatch = `{"spec":{"migManager":{"config":{"name":"mig-test"}}}}`
	if _, err := dyn.Resource(clusterPolicyGVR).Patch(ctx, "cluster-policy", types.MergePatchType, []byte(cpPatch), metav1.PatchOptions{}); err != nil {
		t.Fatal(err)
	}
	label("a100-node-0", sim.LabelMigConfig, "two-3g-and-2g")
	waitFor("infeasible MIG layout failed", func() bool { return node("a100-node-0").Labels[sim.LabelMigState] == sim.StateFailed })
	n := node("a100-node-0")
	if msg := n.Annotations[sim.AnnMigError]; !strings.Contains(msg, "all orderings failed") || !strings.Contains(msg, "ERROR_INSUFFICIENT_RESOURCES") {
		t.Fatalf("mig error %q", msg)
	}
	for i, gpu := range sim.GeometryOf(n.Annotations, 8) {
		if gpu.MigDevices["3g.40gb"] != 0 || (i == 0) != (len(gpu.MigDevices) == 0) {
			t.Fatalf("GPU %d after the failure: %s", i, n.Annotations[sim.AnnMigGeometry])
		}
	}
	fmt.Fprintln(os.Stderr, "e2e: simulator scenario passed")
}
