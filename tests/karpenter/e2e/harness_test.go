package e2e

// The harness: kube-local (tests/cluster) with Karpenter's CRDs, and
// karpenter-kwok (../cmd/karpenter-kwok) as a subprocess against it.
//
// kube-local comes from KUBE_LOCAL (tests/cluster/cluster.sh path prints it;
// ../build.sh test sets it); without it the tests skip, except under CI
// (CI=true), where they fail. karpenter-kwok and the CRDs come from
// KARPENTER_KWOK_DIR (what ../build.sh path prints); without it the tests run
// ../build.sh path themselves.

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
)

var (
	crdGVR          = schema.GroupVersionResource{Group: "apiextensions.k8s.io", Version: "v1", Resource: "customresourcedefinitions"}
	nodePoolGVR     = schema.GroupVersionResource{Group: "karpenter.sh", Version: "v1", Resource: "nodepools"}
	nodeClaimGVR    = schema.GroupVersionResource{Group: "karpenter.sh", Version: "v1", Resource: "nodeclaims"}
	nodeOverlayGVR  = schema.GroupVersionResource{Group: "karpenter.sh", Version: "v1alpha1", Resource: "nodeoverlays"}
	kwokNodeClassGV = schema.GroupVersionResource{Group: "karpenter.kwok.sh", Version: "v1alpha1", Resource: "kwoknodeclasses"}
)

// env is one control plane with Karpenter running against it.
type env struct {
	t          *testing.T
	ctx        context.Context
	kubeconfig string
	core       kubernetes.Interface
	dyn        dynamic.Interface
	karpenter  *exec.Cmd
	karpLog    string // karpenter-kwok's stdout and stderr (JSON lines)
}

// instanceType is one entry of the kwok provider's INSTANCE_TYPES_FILE_PATH
// file, in the shape sigs.k8s.io/karpenter/kwok/cloudprovider v1.8.0 decodes
// (InstanceTypeOptions; offerings are cloudprovider.Offering with the
// requirements as node selector requirements).
type instanceType struct {
	Name             string            `json:"name"`
	Architecture     string            `json:"architecture"`
	OperatingSystems []string          `json:"operatingSystems"`
	Resources        map[string]string `json:"resources"`
	Offerings        []offering        `json:"offerings"`
}

type offering struct {
	Price        float64                          `json:"Price"`
	Available    bool                             `json:"Available"`
	Requirements []corev1.NodeSelectorRequirement `json:"Requirements"`
}

func onDemand(zone string, price float64) offering {
	return offering{Price: price, Available: true, Requirements: []corev1.NodeSelectorRequirement{
		{Key: corev1.LabelTopologyZone, Operator: corev1.NodeSelectorOpIn, Values: []string{zone}},
		{Key: "karpenter.sh/capacity-type", Operator: corev1.NodeSelectorOpIn, Values: []string{"on-demand"}},
	}}
}

// gpuInstanceTypes: one 1-GPU and one 8-GPU type. Price per GPU is about the
// same, so price alone never explains a choice.
func gpuInstanceTypes() []instanceType {
	gpu := func(name, cpu, memory, gpus string, price float64) instanceType {
		return instanceType{
			Name: name, Architecture: "amd64", OperatingSystems: []string{"linux"},
			Resources: map[string]string{"cpu": cpu, "memory": memory, "ephemeral-storage": "500Gi", "pods": "110", "nvidia.com/gpu": gpus},
			Offerings: []offering{onDemand("zone-a", price)},
		}
	}
	return []instanceType{
		gpu("gpu-1x", "8", "64Gi", "1", 1.2),
		gpu("gpu-8x", "96", "1024Gi", "8", 9.6),
	}
}

func harnessDirs(t *testing.T) (kubeLocal, kwokDir string) {
	t.Helper()
	kubeLocal = os.Getenv("KUBE_LOCAL")
	if kubeLocal == "" {
		if ci, _ := strconv.ParseBool(os.Getenv("CI")); ci {
			t.Fatal("KUBE_LOCAL (path to tests/cluster's kube-local binary) not set: under CI this test must run (tests/karpenter/build.sh test sets it)")
		}
		t.Skip("KUBE_LOCAL (path to tests/cluster's kube-local binary, `tests/cluster/cluster.sh path`) not set: skipping the Karpenter tests")
	}
	kwokDir = os.Getenv("KARPENTER_KWOK_DIR")
	if kwokDir == "" {
		out, err := exec.Command("bash", "../build.sh", "path").Output()
		if err != nil {
			var ee *exec.ExitError
			if errors.As(err, &ee) {
				t.Fatalf("../build.sh path: %v\n%s", err, ee.Stderr)
			}
			t.Fatalf("../build.sh path: %v", err)
		}
		kwokDir = strings.TrimSpace(string(out))
	}
	return kubeLocal, kwokDir
}

// startEnv starts kube-local (no seeded nodes, no GPU Operator), applies
// Karpenter's CRDs and starts karpenter-kwok with the given instance types.
func startEnv(t *testing.T, types []instanceType) *env {
	kubeLocal, kwokDir := harnessDirs(t)
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	t.Cleanup(cancel)
	e := &env{t: t, ctx: ctx}
	e.kubeconfig = startKubeLocal(t, kubeLocal)
	cfg, err := clientcmd.BuildConfigFromFlags("", e.kubeconfig)
	if err != nil {
		t.Fatal(err)
	}
	cfg.QPS, cfg.Burst = 100, 200
	e.core = kubernetes.NewForConfigOrDie(cfg)
	e.dyn = dynamic.NewForConfigOrDie(cfg)
	e.applyCRDs(filepath.Join(kwokDir, "crds"))
	e.startKarpenter(filepath.Join(kwokDir, "karpenter-kwok"), types, cfg)
	return e
}

func startKubeLocal(t *testing.T, bin string) string {
	t.Helper()
	dir := t.TempDir()
	logPath := filepath.Join(dir, "kube-local.log")
	logFile, err := os.Create(logPath)
	if err != nil {
		t.Fatal(err)
	}
	defer logFile.Close() // the child has its own copy
	cmd := exec.Command(bin, "--dir", filepath.Join(dir, "cluster"), "--no-nodes", "--no-gpu-operator", "--watch-parent=false")
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
			t.Logf("kube-local stderr (last lines):\n%s", tail(logPath, 30))
		}
	})
	select {
	case kc := <-ready:
		return kc
	case <-exited:
		t.Fatalf("kube-local exited before it was ready: %v\n%s", cmd.ProcessState, tail(logPath, 30))
	case <-time.After(150 * time.Second):
		t.Fatal("kube-local not ready within 150s")
	}
	return ""
}

func tail(path string, n int) string {
	b, _ := os.ReadFile(path)
	lines := strings.Split(strings.TrimRight(string(b), "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

// applyCRDs creates every CRD in dir and waits until each is Established.
func (e *env) applyCRDs(dir string) {
	t := e.t
	files, err := filepath.Glob(filepath.Join(dir, "*.yaml"))
	if err != nil || len(files) == 0 {
		t.Fatalf("no CRDs in %s (run tests/karpenter/build.sh): %v", dir, err)
	}
	var names []string
	for _, f := range files {
		for _, obj := range readManifests(t, f) {
			if _, err := e.dyn.Resource(crdGVR).Create(e.ctx, obj, metav1.CreateOptions{}); err != nil {
				t.Fatalf("create CRD %s from %s: %v", obj.GetName(), f, err)
			}
			names = append(names, obj.GetName())
		}
	}
	for _, name := range names {
		e.waitFor("CRD "+name+" Established", 30*time.Second, func() (bool, error) {
			crd, err := e.dyn.Resource(crdGVR).Get(e.ctx, name, metav1.GetOptions{})
			if err != nil {
				return false, err
			}
			return conditionStatus(crd, "Established") == "True", nil
		})
	}
}

func readManifests(t *testing.T, path string) []*unstructured.Unstructured {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var out []*unstructured.Unstructured
	dec := utilyaml.NewYAMLOrJSONDecoder(f, 4096)
	for {
		obj := &unstructured.Unstructured{}
		if err := dec.Decode(&obj.Object); err != nil {
			if errors.Is(err, io.EOF) {
				return out
			}
			t.Fatalf("%s: %v", path, err)
		}
		if len(obj.Object) > 0 {
			out = append(out, obj)
		}
	}
}

func freePort(t *testing.T) int {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}

// karpenterEnv is the environment karpenter-kwok needs here; everything else
// is left at Karpenter's defaults.
func karpenterEnv(kubeconfig, instanceTypesFile string, metricsPort, healthPort int) []string {
	return []string{
		"KUBECONFIG=" + kubeconfig,
		"INSTANCE_TYPES_FILE_PATH=" + instanceTypesFile, // kwok/options
		"FEATURE_GATES=NodeOverlay=true",                // the rest keep their defaults (ReservedCapacity=true, others false)
		"DISABLE_LEADER_ELECTION=true",                  // else it needs LEADER_ELECTION_NAMESPACE (a Lease) and waits to lead
		"METRICS_PORT=" + strconv.Itoa(metricsPort),     // default 8080, bound on all interfaces
		"HEALTH_PROBE_PORT=" + strconv.Itoa(healthPort), // default 8081; /readyz waits for the caches and the CRDs
		"LOG_LEVEL=debug",                               // provisioning rounds are logged at debug
		"EXIT_ON_STDIN_EOF=true",                        // ours (cmd/karpenter-kwok): dies with the test
		"PATH=" + os.Getenv("PATH"),
		"HOME=" + os.Getenv("HOME"),
	}
}

func (e *env) startKarpenter(bin string, types []instanceType, cfg *rest.Config) {
	t := e.t
	dir := t.TempDir()
	itFile := filepath.Join(dir, "instance-types.json")
	b, err := json.MarshalIndent(types, "", "  ")
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(itFile, b, 0o644); err != nil {
		t.Fatal(err)
	}
	e.karpLog = filepath.Join(dir, "karpenter.log")
	logFile, err := os.Create(e.karpLog)
	if err != nil {
		t.Fatal(err)
	}
	defer logFile.Close()
	healthPort := freePort(t)
	cmd := exec.Command(bin)
	cmd.Env = karpenterEnv(e.kubeconfig, itFile, freePort(t), healthPort)
	cmd.Stdout, cmd.Stderr = logFile, logFile
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatalf("start %s: %v", bin, err)
	}
	e.karpenter = cmd
	exited := make(chan struct{})
	go func() { _ = cmd.Wait(); close(exited) }()
	t.Cleanup(func() {
		stdin.Close() // EXIT_ON_STDIN_EOF
		select {
		case <-exited:
		case <-time.After(15 * time.Second):
			_ = cmd.Process.Kill()
			<-exited
		}
		if t.Failed() {
			t.Logf("karpenter-kwok log (last lines):\n%s", tail(e.karpLog, 40))
		}
	})
	readyz := fmt.Sprintf("http://127.0.0.1:%d/readyz", healthPort)
	e.waitFor("karpenter-kwok "+readyz, 60*time.Second, func() (bool, error) {
		select {
		case <-exited:
			return false, fmt.Errorf("karpenter-kwok exited: %v\n%s", cmd.ProcessState, tail(e.karpLog, 20))
		default:
		}
		resp, err := http.Get(readyz)
		if err != nil {
			return false, nil
		}
		resp.Body.Close()
		return resp.StatusCode == http.StatusOK, nil
	})
}

// rss returns karpenter-kwok's resident set size now and at its peak (kB),
// from /proc.
func (e *env) rss() (now, peak string) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", e.karpenter.Process.Pid))
	if err != nil {
		return "?", "?"
	}
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, "VmRSS:"); ok {
			now = strings.TrimSpace(v)
		}
		if v, ok := strings.CutPrefix(line, "VmHWM:"); ok {
			peak = strings.TrimSpace(v)
		}
	}
	return now, peak
}

// waitFor polls cond every 100 ms until it returns true, an error, or the
// timeout passes.
func (e *env) waitFor(what string, timeout time.Duration, cond func() (bool, error)) {
	e.t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		ok, err := cond()
		if err != nil {
			e.t.Fatalf("waiting for %s: %v", what, err)
		}
		if ok {
			return
		}
		if time.Now().After(deadline) {
			e.t.Fatalf("timed out after %s waiting for %s", timeout, what)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// apply creates the objects of a YAML document stream (Karpenter's kinds and
// core kinds) through the dynamic client.
func (e *env) apply(manifest string) {
	e.t.Helper()
	dec := utilyaml.NewYAMLOrJSONDecoder(bytes.NewReader([]byte(manifest)), 4096)
	for {
		obj := &unstructured.Unstructured{}
		if err := dec.Decode(&obj.Object); err != nil {
			if errors.Is(err, io.EOF) {
				return
			}
			e.t.Fatal(err)
		}
		if len(obj.Object) == 0 {
			continue
		}
		gvr, namespaced := e.resourceFor(obj)
		var ri dynamic.ResourceInterface = e.dyn.Resource(gvr)
		if namespaced {
			ri = e.dyn.Resource(gvr).Namespace(obj.GetNamespace())
		}
		if _, err := ri.Create(e.ctx, obj, metav1.CreateOptions{}); err != nil {
			e.t.Fatalf("create %s %s: %v", obj.GetKind(), obj.GetName(), err)
		}
	}
}

func (e *env) resourceFor(obj *unstructured.Unstructured) (schema.GroupVersionResource, bool) {
	switch obj.GetKind() {
	case "NodePool":
		return nodePoolGVR, false
	case "NodeOverlay":
		return nodeOverlayGVR, false
	case "KWOKNodeClass":
		return kwokNodeClassGV, false
	case "Pod":
		return schema.GroupVersionResource{Version: "v1", Resource: "pods"}, true
	}
	e.t.Fatalf("apply: unexpected kind %s", obj.GetKind())
	return schema.GroupVersionResource{}, false
}

func conditionStatus(obj *unstructured.Unstructured, typ string) string {
	conds, _, _ := unstructured.NestedSlice(obj.Object, "status", "conditions")
	for _, c := range conds {
		m, _ := c.(map[string]any)
		if m["type"] == typ {
			s, _ := m["status"].(string)
			return s
		}
	}
	return ""
}

func (e *env) nodeClaims() []unstructured.Unstructured {
	e.t.Helper()
	l, err := e.dyn.Resource(nodeClaimGVR).List(e.ctx, metav1.ListOptions{})
	if err != nil {
		e.t.Fatal(err)
	}
	return l.Items
}

// markUnschedulable does what kube-scheduler does for a pod no node fits:
// PodScheduled=False, reason Unschedulable. Karpenter only considers pods
// marked so (pkg/utils/pod.IsProvisionable); kube-local runs no scheduler.
func (e *env) markUnschedulable(ns, name string) {
	e.t.Helper()
	patch := fmt.Sprintf(`{"status":{"conditions":[{"type":"PodScheduled","status":"False","reason":"Unschedulable","message":"0/%d nodes are available (simulated kube-scheduler)","lastTransitionTime":%q}]}}`,
		0, time.Now().UTC().Format(time.RFC3339))
	if _, err := e.core.CoreV1().Pods(ns).Patch(e.ctx, name, "application/strategic-merge-patch+json", []byte(patch), metav1.PatchOptions{}, "status"); err != nil {
		e.t.Fatalf("mark pod %s/%s unschedulable: %v", ns, name, err)
	}
}

// podEvents returns the events about a pod whose source component is Karpenter.
func (e *env) karpenterPodEvents(ns, name string) []corev1.Event {
	e.t.Helper()
	l, err := e.core.CoreV1().Events(ns).List(e.ctx, metav1.ListOptions{FieldSelector: "involvedObject.kind=Pod,involvedObject.name=" + name})
	if err != nil {
		e.t.Fatal(err)
	}
	var out []corev1.Event
	for _, ev := range l.Items {
		if ev.Source.Component == "karpenter" || ev.ReportingController == "karpenter" {
			out = append(out, ev)
		}
	}
	return out
}

// logLines returns karpenter-kwok's log lines whose message is msg, as
// decoded JSON objects.
func (e *env) logLines(msg string) []map[string]any {
	b, _ := os.ReadFile(e.karpLog)
	var out []map[string]any
	for _, line := range strings.Split(string(b), "\n") {
		if !strings.Contains(line, msg) {
			continue
		}
		var m map[string]any
		if json.Unmarshal([]byte(line), &m) == nil && m["message"] == msg {
			out = append(out, m)
		}
	}
	return out
}

// nodeAgent plays, for every kwok Node, the kubelet (Ready=True) and the NVIDIA
// device plugin with time-slicing (nvidia.com/gpu capacity and allocatable =
// physical GPUs x replicas), which the kwok provider does not. firstSeen gets
// each Node as the kwok provider created it, before the agent touches it.
type nodeAgent struct {
	e        *env
	gpus     map[string]int // instance type -> physical GPUs
	replicas int

	mu        sync.Mutex
	firstSeen map[string]*corev1.Node
	patched   map[string]time.Time
}

func newNodeAgent(e *env, gpus map[string]int, replicas int) *nodeAgent {
	return &nodeAgent{e: e, gpus: gpus, replicas: replicas, firstSeen: map[string]*corev1.Node{}, patched: map[string]time.Time{}}
}

// seen returns the Nodes as first seen and when each was patched.
func (a *nodeAgent) seen() (map[string]*corev1.Node, map[string]time.Time) {
	a.mu.Lock()
	defer a.mu.Unlock()
	first := make(map[string]*corev1.Node, len(a.firstSeen))
	for k, v := range a.firstSeen {
		first[k] = v
	}
	patched := make(map[string]time.Time, len(a.patched))
	for k, v := range a.patched {
		patched[k] = v
	}
	return first, patched
}

func (a *nodeAgent) run(stop <-chan struct{}) {
	for {
		select {
		case <-stop:
			return
		case <-time.After(50 * time.Millisecond):
		}
		nodes, err := a.e.core.CoreV1().Nodes().List(a.e.ctx, metav1.ListOptions{})
		if err != nil {
			continue
		}
		for i := range nodes.Items {
			n := &nodes.Items[i]
			a.mu.Lock()
			done := !a.patched[n.Name].IsZero()
			if _, ok := a.firstSeen[n.Name]; !ok {
				a.firstSeen[n.Name] = n.DeepCopy()
			}
			a.mu.Unlock()
			if done || !strings.HasPrefix(n.Spec.ProviderID, "kwok://") {
				continue
			}
			gpus := a.gpus[n.Labels[corev1.LabelInstanceTypeStable]] * a.replicas
			now := time.Now().UTC().Format(time.RFC3339)
			patch := fmt.Sprintf(`{"status":{"conditions":[{"type":"Ready","status":"True","reason":"KubeletReady","message":"simulated kubelet","lastHeartbeatTime":%q,"lastTransitionTime":%q}],"capacity":{"nvidia.com/gpu":"%d"},"allocatable":{"nvidia.com/gpu":"%d"}}}`,
				now, now, gpus, gpus)
			if _, err := a.e.core.CoreV1().Nodes().Patch(a.e.ctx, n.Name, "application/strategic-merge-patch+json", []byte(patch), metav1.PatchOptions{}, "status"); err != nil {
				if !apierrors.IsNotFound(err) && !apierrors.IsConflict(err) {
					a.e.t.Errorf("node agent: patch %s: %v", n.Name, err)
				}
				continue
			}
			a.mu.Lock()
			a.patched[n.Name] = time.Now()
			a.mu.Unlock()
		}
	}
}

func quantity(l corev1.ResourceList, name corev1.ResourceName) string {
	q, ok := l[name]
	if !ok {
		return "<none>"
	}
	return q.String()
}
