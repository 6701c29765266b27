package sim

import (
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

func a100Node() *Node {
	return &Node{
		Name: "a100-node-0",
		Labels: map[string]string{
			LabelGPUPresent: "true", LabelProduct: "NVIDIA-A100-SXM4-80GB", LabelCount: "8", LabelMigCapable: "true",
			"nvidia.com/gpu.compute.major": "8", "nvidia.com/gpu.compute.minor": "0",
			"nvidia.com/gpu.replicas": "1", "nvidia.com/gpu.sharing-strategy": "none", "nvidia.com/mps.capable": "false",
			LabelMigConfig: "all-disabled", LabelMigState: "success",
		},
		Annotations: map[string]string{},
		Capacity:    map[string]string{"nvidia.com/gpu": "8", "cpu": "96"},
		Allocatable: map[string]string{"nvidia.com/gpu": "8", "cpu": "96"},
	}
}

// apply folds a patch into the node, as the API server would.
func apply(n *Node, p *Patch) {
	for k, v := range p.Labels {
		if v == nil {
			delete(n.Labels, k)
		} else {
			n.Labels[k] = *v
		}
	}
	for k, v := range p.Annotations {
		if v == nil {
			delete(n.Annotations, k)
		} else {
			n.Annotations[k] = *v
		}
	}
	for k, v := range p.Resources {
		n.Capacity[k], n.Allocatable[k] = v, v
	}
	for k, v := range p.Allocatable {
		n.Allocatable[k] = v
	}
}

const dpConfigs = `
default: |
  version: v1
  flags:
    migStrategy: none
ts4: |
  version: v1
  flags:
    migStrategy: none
  sharing:
    timeSlicing:
      resources:
      - name: nvidia.com/gpu
        replicas: 4
mig-ts2: |
  version: v1
  flags:
    migStrategy: single
  sharing:
    timeSlicing:
      resources:
      - name: nvidia.com/gpu
        replicas: 2
mps4: |
  version: v1
  flags:
    migStrategy: none
  sharing:
    mps:
      renameByDefault: true
      resources:
      - name: nvidia.com/gpu
        replicas: 4
broken: |
  version: v1
  sharing:
    timeSlicing:
      resources:
      - name: nvidia.com/gpu
        replicas: 1
`

func configMap(t *testing.T) map[string]string {
	t.Helper()
	m := map[string]string{}
	var cur string
	for _, line := range strings.Split(strings.TrimPrefix(dpConfigs, "\n"), "\n") {
		if !strings.HasPrefix(line, " ") && strings.HasSuffix(line, ": |") {
			cur = strings.TrimSuffix(line, ": |")
			continue
		}
		m[cur] += strings.TrimPrefix(line, "  ") + "\n"
	}
	return m
}

var cp = ClusterPolicy{Found: true, DPConfigName: "dp", DPDefault: "default", MigStrategy: "single"}

// step runs the MIG and device-plugin steps once, applies the patch and
// returns it.
func step(t *testing.T, n *Node, mig MigInput, dp DPInput) (*Patch, MigResult, DPResult) {
	t.Helper()
	hw, recorded := HardwareOf(n.Labels, n.Annotations)
	p := &Patch{}
	if !recorded {
		n.Annotations[AnnHardware] = `{"product":"` + hw.Product + `","count":8,"computeCapability":"8.0","migCapable":true,"deviceID":"0x20B210DE"}`
	}
	if mig.MigConfig == "" && mig.Err == nil {
		mig.MigConfig = BuiltinMigConfig
	}
	mr := PlanMig(n, hw, mig, p)
	if mr.InProgress {
		PlanDevicePluginPaused(n, p)
		apply(n, p)
		return p, mr, DPResult{}
	}
	dp.Geometry = mr.Geometry
	if !dp.CP.Found && dp.CP.DPConfigName == "" {
		dp.CP = cp
	}
	if dp.ConfigMap == nil {
		dp.ConfigMap = configMap(t)
	}
	if dp.Fallbacks == nil {
		dp.Fallbacks = []string{FallbackEmpty}
	}
	dr := PlanDevicePlugin(n, hw, dp, p)
	apply(n, p)
	return p, mr, dr
}

func TestHardwareOf(t *testing.T) {
	hw, rec := HardwareOf(map[string]string{LabelProduct: "NVIDIA-H200-MIG-1g.18gb-SHARED", LabelCount: "8", LabelMigCapable: "true",
		"nvidia.com/gpu.compute.major": "9", "nvidia.com/gpu.compute.minor": "0"}, nil)
	if rec || hw.Product != "NVIDIA-H200" || hw.Count != 8 || !hw.MigCapable || hw.DeviceID != "0x233510DE" || hw.ComputeCapability != "9.0" {
		t.Fatalf("%+v", hw)
	}
}

func TestFirstSightIsIdempotent(t *testing.T) {
	n := a100Node()
	p, _, dr := step(t, n, MigInput{Delay: time.Second}, DPInput{})
	if dr.Failed {
		t.Fatalf("device plugin failed: %v", n.Annotations[AnnDPError])
	}
	if p.Resources != nil || p.Labels[LabelMigState] != nil {
		t.Fatalf("first sight of a node in its seeded state must not change resources or MIG state: %+v", p)
	}
	if n.Annotations[AnnAppliedMig] != "all-disabled" || n.Labels["nvidia.com/mig.strategy"] != "single" {
		t.Fatalf("annotations %v labels %v", n.Annotations, n.Labels)
	}
	p, _, _ = step(t, n, MigInput{Delay: time.Second}, DPInput{})
	if !p.Empty() {
		t.Fatalf("steady state must write nothing, got labels=%v annotations=%v resources=%v", p.Labels, p.Annotations, p.Resources)
	}
}

func TestTimeSlicingLabel(t *testing.T) {
	n := a100Node()
	step(t, n, MigInput{}, DPInput{})
	n.Labels[LabelDPConfig] = "ts4"
	step(t, n, MigInput{}, DPInput{})
	if n.Capacity["nvidia.com/gpu"] != "32" || n.Allocatable["nvidia.com/gpu"] != "32" ||
		n.Labels["nvidia.com/gpu.replicas"] != "4" || n.Labels["nvidia.com/gpu.product"] != "NVIDIA-A100-SXM4-80GB-SHARED" ||
		n.Labels["nvidia.com/gpu.sharing-strategy"] != "time-slicing" || n.Annotations[AnnDPConfig] != "ts4" {
		t.Fatalf("labels %v capacity %v", n.Labels, n.Capacity)
	}
	// Back to exclusive: the -SHARED suffix goes.
	n.Labels[LabelDPConfig] = "default"
	step(t, n, MigInput{}, DPInput{})
	if n.Capacity["nvidia.com/gpu"] != "8" || n.Labels["nvidia.com/gpu.product"] != "NVIDIA-A100-SXM4-80GB" || n.Labels["nvidia.com/gpu.replicas"] != "1" {
		t.Fatalf("labels %v capacity %v", n.Labels, n.Capacity)
	}
}

// The label patch lands, the status patch is lost (the API server restarts in
// between): the kubelet's status sync puts the device plugin's resources back.
func TestKubeletResyncsALostStatusWrite(t *testing.T) {
	n := a100Node()
	n.Labels[LabelDPConfig] = "ts4"
	step(t, n, MigInput{}, DPInput{})
	if n.Allocatable["nvidia.com/gpu"] != "32" {
		t.Fatalf("allocatable %v", n.Allocatable)
	}
	n.Capacity["nvidia.com/gpu"], n.Allocatable["nvidia.com/gpu"] = "8", "8"
	p, _, _ := step(t, n, MigInput{}, DPInput{})
	if p.Resources["nvidia.com/gpu"] != "32" || len(p.Labels) != 0 {
		t.Fatalf("status not resynced (or the plugin reloaded): %+v", p)
	}
	if n.Capacity["nvidia.com/gpu"] != "32" || n.Allocatable["nvidia.com/gpu"] != "32" {
		t.Fatalf("capacity %v allocatable %v", n.Capacity, n.Allocatable)
	}
	if p, _, _ := step(t, n, MigInput{}, DPInput{}); !p.Empty() {
		t.Fatalf("steady state must write nothing: %+v", p)
	}
}

func TestContentChangeDoesNotReload(t *testing.T) {
	n := a100Node()
	n.Labels[LabelDPConfig] = "ts4"
	step(t, n, MigInput{}, DPInput{})
	cm := configMap(t)
	cm["ts4"] = strings.Replace(cm["ts4"], "replicas: 4", "replicas: 8", 1)
	p, _, _ := step(t, n, MigInput{}, DPInput{ConfigMap: cm})
	if !p.Empty() || n.Capacity["nvidia.com/gpu"] != "32" {
		t.Fatalf("ConfigMap content change must not reload: %+v", p)
	}
	// A ClusterPolicy change rolls the DaemonSet: reload with the new content.
	cp2 := cp
	cp2.DPDefault = "ts4"
	step(t, n, MigInput{}, DPInput{ConfigMap: cm, CP: cp2})
	if n.Capacity["nvidia.com/gpu"] != "64" {
		t.Fatalf("capacity %v", n.Capacity)
	}
}

func TestMissingKeyCrashLoops(t *testing.T) {
	n := a100Node()
	n.Labels[LabelDPConfig] = "ts4"
	step(t, n, MigInput{}, DPInput{})
	n.Labels[LabelDPConfig] = "nope"
	p, _, dr := step(t, n, MigInput{}, DPInput{})
	if !dr.Failed || !strings.Contains(n.Annotations[AnnDPError], "specified config nope does not exist") || p.Resources != nil || n.Capacity["nvidia.com/gpu"] != "32" {
		t.Fatalf("failed=%v error=%q capacity=%v", dr.Failed, n.Annotations[AnnDPError], n.Capacity)
	}
	// Invalid content of an existing key: the plugin fails to load it.
	n.Labels[LabelDPConfig] = "broken"
	step(t, n, MigInput{}, DPInput{})
	if !strings.Contains(n.Annotations[AnnDPError], "number of replicas must be >= 2") {
		t.Fatalf("error=%q", n.Annotations[AnnDPError])
	}
	n.Labels[LabelDPConfig] = "default"
	step(t, n, MigInput{}, DPInput{})
	if _, ok := n.Annotations[AnnDPError]; ok || n.Capacity["nvidia.com/gpu"] != "8" {
		t.Fatalf("recovery: %v %v", n.Annotations, n.Capacity)
	}
}

func TestSelectConfig(t *testing.T) {
	cm := map[string]string{"default": "", "a": ""}
	for _, tc := range []struct {
		label, def string
		fallbacks  []string
		cm         map[string]string
		want, err  string
	}{
		{label: "a", cm: cm, want: "a"},
		{label: "b", cm: cm, err: "specified config b does not exist"},
		{def: "a", cm: cm, want: "a"},
		{def: "zz", cm: cm, err: "does not exist"},
		{fallbacks: []string{FallbackEmpty}, cm: cm, want: ""},
		{fallbacks: []string{FallbackNamed, FallbackSingle}, cm: cm, want: "default"},
		{fallbacks: []string{FallbackNamed, FallbackSingle}, cm: map[string]string{"x": ""}, want: "x"},
		{fallbacks: []string{FallbackNamed, FallbackSingle}, cm: map[string]string{"x": "", "y": ""}, err: "all fallbacks failed"},
		{cm: nil, err: "not found"},
	} {
		got, err := SelectConfig(tc.label, DPInput{CP: ClusterPolicy{DPConfigName: "dp", DPDefault: tc.def}, ConfigMap: tc.cm, Fallbacks: tc.fallbacks})
		if tc.err != "" {
			if err == nil || !strings.Contains(err.Error(), tc.err) {
				t.Errorf("%+v: error %v, want %q", tc, err, tc.err)
			}
			continue
		}
		if err != nil || got != tc.want {
			t.Errorf("%+v: got %q, %v", tc, got, err)
		}
	}
}

// A layout change undone before it was applied (the label put back by the operator): the
// MIG manager finds the GPUs already in the layout and reports success.
func TestMigChangeUndoneBeforeApplied(t *testing.T) {
	n := a100Node()
	step(t, n, MigInput{}, DPInput{})
	applied := n.Labels[LabelMigConfig]
	if n.Labels[LabelMigState] != StateSuccess || n.Annotations[AnnAppliedMig] != applied {
		t.Fatalf("start: state %q applied %q", n.Labels[LabelMigState], n.Annotations[AnnAppliedMig])
	}
	n.Labels[LabelMigConfig] = "all-1g.10gb"
	now := time.Now()
	step(t, n, MigInput{Now: now, Delay: time.Second}, DPInput{})
	if n.Labels[LabelMigState] != StatePending {
		t.Fatalf("state %q, want pending", n.Labels[LabelMigState])
	}
	// The operands are paused for the change: the plugin advertises nothing.
	if n.Annotations[AnnDPLoaded] != "" || n.Allocatable["nvidia.com/gpu"] != "0" {
		t.Fatalf("the device plugin runs during the change: allocatable %v", n.Allocatable)
	}
	n.Labels[LabelMigConfig] = applied
	due := now.Add(time.Second)
	_, mr, _ := step(t, n, MigInput{Now: now.Add(100 * time.Millisecond), Due: &due, Delay: time.Second}, DPInput{})
	if n.Labels[LabelMigState] != StateSuccess || !mr.ClearTimer {
		t.Fatalf("state %q result %+v, want success", n.Labels[LabelMigState], mr)
	}
	// ... and back with them, loading its config afresh.
	if n.Annotations[AnnDPLoaded] == "" || n.Allocatable["nvidia.com/gpu"] != "8" {
		t.Fatalf("the device plugin did not come back with the operands: loaded %q, allocatable %v", n.Annotations[AnnDPLoaded], n.Allocatable)
	}
}

func TestMigReconfiguration(t *testing.T) {
	n := a100Node()
	step(t, n, MigInput{}, DPInput{})
	n.Labels[LabelMigConfig] = "all-1g.10gb"
	n.Labels[LabelDPConfig] = "mig-ts2"
	now := time.Now()
	_, mr, _ := step(t, n, MigInput{Now: now, Delay: time.Second}, DPInput{})
	if n.Labels[LabelMigState] != StatePending || !mr.StartTimer || mr.Requeue != time.Second || !mr.InProgress {
		t.Fatalf("state %q result %+v", n.Labels[LabelMigState], mr)
	}
	// The device plugin is paused during the change: the new label is not loaded yet.
	if n.Annotations[AnnDPConfig] != "default" || n.Capacity["nvidia.com/gpu"] != "8" {
		t.Fatalf("device plugin reloaded during a MIG change: %v %v", n.Annotations[AnnDPConfig], n.Capacity)
	}
	// ... and advertises nothing: no new GPU pod is admitted on the node until it is back.
	if n.Allocatable["nvidia.com/gpu"] != "0" || n.Annotations[AnnDPLoaded] != "" {
		t.Fatalf("device plugin still serving during a MIG change: allocatable %v", n.Allocatable)
	}
	due := now.Add(time.Second)
	p, mr, _ := step(t, n, MigInput{Now: now.Add(500 * time.Millisecond), Due: &due, Delay: time.Second}, DPInput{})
	if mr.Requeue != 500*time.Millisecond || !p.Empty() {
		t.Fatalf("before due: %+v %+v", mr, p)
	}
	_, mr, _ = step(t, n, MigInput{Now: due, Due: &due, Delay: time.Second}, DPInput{})
	if n.Labels[LabelMigState] != StateSuccess || !mr.ClearTimer || n.Annotations[AnnAppliedMig] != "all-1g.10gb" {
		t.Fatalf("after due: state %q %+v", n.Labels[LabelMigState], mr)
	}
	// MIG single + time-slicing x2: 8 GPUs x 7 x 2.
	if n.Capacity["nvidia.com/gpu"] != "112" || n.Labels["nvidia.com/gpu.product"] != "NVIDIA-A100-SXM4-80GB-MIG-1g.10gb-SHARED" {
		t.Fatalf("labels %v capacity %v (dp error %q)", n.Labels, n.Capacity, n.Annotations[AnnDPError])
	}
	// Steady.
	if p, _, _ := step(t, n, MigInput{Now: due.Add(time.Minute)}, DPInput{}); !p.Empty() {
		t.Fatalf("steady: %+v", p)
	}
}

func TestMigFailures(t *testing.T) {
	n := a100Node()
	step(t, n, MigInput{}, DPInput{})
	n.Labels[LabelMigConfig] = "no-such-layout"
	step(t, n, MigInput{Delay: time.Second}, DPInput{})
	if n.Labels[LabelMigState] != StateFailed || !strings.Contains(n.Annotations[AnnMigError], "selected mig-config not present: no-such-layout") {
		t.Fatalf("state %q error %q", n.Labels[LabelMigState], n.Annotations[AnnMigError])
	}
	// A pod on GPU 5 and a MIG mode change: pending, then failed before
	// any GPU is touched (a mode change resets the GPUs).
	n.Labels[LabelMigConfig] = "all-3g.40gb"
	now := time.Now()
	step(t, n, MigInput{Now: now, Delay: time.Second}, DPInput{})
	due := now.Add(time.Second)
	var busy Busy
	busy.Add("default/train", "5")
	step(t, n, MigInput{Now: due, Due: &due, Busy: busy}, DPInput{})
	if n.Labels[LabelMigState] != StateFailed || !strings.Contains(n.Annotations[AnnMigError], "In use by another client") ||
		!strings.Contains(n.Annotations[AnnMigError], "MIG mode") || strings.Contains(GeometryOf(n.Annotations, 8).String(), `"e":true`) {
		t.Fatalf("state %q error %q geometry %q", n.Labels[LabelMigState], n.Annotations[AnnMigError], n.Annotations[AnnMigGeometry])
	}
	// No retry until the label changes (as the real MIG manager).
	if p, _, _ := step(t, n, MigInput{Now: due.Add(time.Minute)}, DPInput{}); !p.Empty() {
		t.Fatalf("failed state must be kept: %+v", p)
	}
}

func TestMigSingleTwoProfilesBreaksPlugin(t *testing.T) {
	n := a100Node()
	step(t, n, MigInput{}, DPInput{})
	n.Labels[LabelMigConfig] = "all-balanced"
	now := time.Now()
	step(t, n, MigInput{Now: now}, DPInput{})
	step(t, n, MigInput{Now: now, Due: &now}, DPInput{})
	if n.Labels[LabelMigState] != StateSuccess || !strings.Contains(n.Annotations[AnnDPError], "more than one MIG device type") {
		t.Fatalf("state %q dp error %q", n.Labels[LabelMigState], n.Annotations[AnnDPError])
	}
	// With the cluster strategy mixed the same geometry works.
	cp2 := cp
	cp2.MigStrategy = "mixed"
	step(t, n, MigInput{Now: now}, DPInput{CP: cp2})
	if n.Capacity["nvidia.com/mig-1g.10gb"] != "16" || n.Capacity["nvidia.com/mig-3g.40gb"] != "8" || n.Capacity["nvidia.com/gpu"] != "0" ||
		n.Labels["nvidia.com/mig-2g.20gb.count"] != "8" || n.Labels["nvidia.com/mig.strategy"] != "mixed" {
		t.Fatalf("labels %v capacity %v (dp error %q)", n.Labels, n.Capacity, n.Annotations[AnnDPError])
	}
	// Back to all-disabled: the mig-* labels and resources go away.
	n.Labels[LabelMigConfig] = "all-disabled"
	step(t, n, MigInput{Now: now}, DPInput{CP: cp2})
	step(t, n, MigInput{Now: now, Due: &now}, DPInput{CP: cp2})
	if _, ok := n.Labels["nvidia.com/mig-2g.20gb.count"]; ok || n.Capacity["nvidia.com/mig-1g.10gb"] != "0" || n.Capacity["nvidia.com/gpu"] != "8" {
		t.Fatalf("labels %v capacity %v", n.Labels, n.Capacity)
	}
}

func TestAutoLabel(t *testing.T) {
	n := a100Node()
	delete(n.Labels, LabelMigConfig)
	p, _, _ := step(t, n, MigInput{AutoLabelEmpty: true}, DPInput{})
	if v := p.Labels[LabelMigConfig]; v == nil || *v != "all-disabled" {
		t.Fatalf("%+v", p.Labels)
	}
}

func TestBusyOf(t *testing.T) {
	gpu := corev1.ResourceList{"nvidia.com/mig-1g.10gb": resource.MustParse("1")}
	pod := func(name, node, devices string, phase corev1.PodPhase, res corev1.ResourceList) corev1.Pod {
		p := corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "x", Annotations: map[string]string{}},
			Spec:   corev1.PodSpec{NodeName: node, Containers: []corev1.Container{{Resources: corev1.ResourceRequirements{Limits: res}}}},
			Status: corev1.PodStatus{Phase: phase}}
		if devices != "" {
			p.Annotations[AnnDevices] = devices
		}
		return p
	}
	pods := []corev1.Pod{
		pod("a", "n", "2/1g.10gb@3", corev1.PodRunning, gpu),
		pod("old", "n", "", corev1.PodRunning, gpu),
		pod("done", "n", "0/1g.10gb@0", corev1.PodSucceeded, gpu),
		pod("cpu", "n", "", corev1.PodRunning, nil),
		pod("not-admitted", "n", "", corev1.PodPending, gpu),
		pod("other", "m", "0/1g.10gb@0", corev1.PodRunning, gpu),
	}
	b := BusyOf(pods, "n")
	if got := b.Pods(); len(got) != 2 || got[0] != "x/a" || got[1] != "x/old" {
		t.Fatalf("pods %v", got)
	}
	if got := b.holders("2/1g.10gb@3"); len(got) != 2 {
		t.Fatalf("holders %v (a, and old whose devices are unknown)", got)
	}
	if len(b.Devices["0/1g.10gb@0"]) != 0 || len(b.OnGPU(1)) != 1 {
		t.Fatalf("GPU 0 %v, GPU 1 %v: only the unknown pod may hold GPU 1", b.Devices["0/1g.10gb@0"], b.OnGPU(1))
	}
}

// The kubelet's device manager: exclusive instances go to free ones, lowest
// GPU first; shared ones to the least shared; too few fails admission.
func TestAssignDevices(t *testing.T) {
	geo := Geometry{{MigEnabled: true, MigDevices: map[string]int{"3g.40gb": 2}}, {MigEnabled: true, MigDevices: map[string]int{"3g.40gb": 1, "1g.10gb": 4}}}
	places := Placements{
		{{Profile: "3g.40gb", Start: 4, Size: 4}, {Profile: "3g.40gb", Start: 0, Size: 4}},
		{{Profile: "3g.40gb", Start: 4, Size: 4}, {Profile: "1g.10gb", Start: 0, Size: 1}, {Profile: "1g.10gb", Start: 1, Size: 1}, {Profile: "1g.10gb", Start: 2, Size: 1}, {Profile: "1g.10gb", Start: 3, Size: 1}},
	}
	ask := func(r string, n int64) *corev1.Pod {
		return &corev1.Pod{Spec: corev1.PodSpec{Containers: []corev1.Container{{Resources: corev1.ResourceRequirements{
			Limits: corev1.ResourceList{corev1.ResourceName(r): *resource.NewQuantity(n, resource.DecimalSI)}}}}}}
	}
	var busy Busy
	busy.Add("x/p", "0/3g.40gb@0")
	got, err := AssignDevices(ask("nvidia.com/mig-3g.40gb", 2), geo, places, map[string]int{"nvidia.com/mig-3g.40gb": 3}, busy)
	if err != nil || got != "0/3g.40gb@4,1/3g.40gb@4" {
		t.Fatalf("got %q, %v", got, err)
	}
	if _, err := AssignDevices(ask("nvidia.com/mig-3g.40gb", 3), geo, places, map[string]int{"nvidia.com/mig-3g.40gb": 3}, busy); err == nil || !strings.Contains(err.Error(), "available 2") {
		t.Fatalf("3 of 2 free: %v", err)
	}
	// Time-sliced 1g (replicas 2: 8 advertised over 4 instances): two pods per instance.
	busy.Add("x/q", "1/1g.10gb@0")
	got, err = AssignDevices(ask("nvidia.com/mig-1g.10gb.shared", 2), geo, places, map[string]int{"nvidia.com/mig-1g.10gb.shared": 8}, busy)
	if err != nil || got != "1/1g.10gb@1,1/1g.10gb@2" {
		t.Fatalf("shared: got %q, %v", got, err)
	}
	// Whole GPUs on a node without MIG.
	got, err = AssignDevices(ask("nvidia.com/gpu", 1), Geometry{{}, {}}, nil, map[string]int{"nvidia.com/gpu": 2}, Busy{Devices: map[string][]string{"0": {"x/r"}}})
	if err != nil || got != "1" {
		t.Fatalf("whole GPU: got %q, %v", got, err)
	}
}

func TestMPSLabels(t *testing.T) {
	n := a100Node()
	n.Labels[LabelDPConfig] = "mps4"
	step(t, n, MigInput{}, DPInput{})
	// renameByDefault: nvidia.com/gpu.shared, product without -SHARED.
	if n.Capacity["nvidia.com/gpu.shared"] != "32" || n.Capacity["nvidia.com/gpu"] != "0" || n.Labels["nvidia.com/mps.capable"] != "true" ||
		n.Labels["nvidia.com/gpu.product"] != "NVIDIA-A100-SXM4-80GB" || n.Labels["nvidia.com/gpu.sharing-strategy"] != "mps" {
		t.Fatalf("labels %v capacity %v (dp error %q)", n.Labels, n.Capacity, n.Annotations[AnnDPError])
	}
}

func TestGFDStampsEveryLoad(t *testing.T) {
	n := a100Node()
	at := time.Unix(1_800_000_000, 0)
	step(t, n, MigInput{}, DPInput{Now: at})
	if n.Labels[LabelGFDTimestamp] != "1800000000" {
		t.Fatalf("first load: labels %v", n.Labels)
	}
	// No reload trigger: GFD's labels (and timestamp) stay.
	if p, _, _ := step(t, n, MigInput{}, DPInput{Now: at.Add(time.Minute)}); !p.Empty() {
		t.Fatalf("no trigger must write nothing: %+v", p)
	}
	n.Labels[LabelDPConfig] = "ts4"
	key := DPLoadKey(n, DPInput{CP: cp})
	if DPLoaded(n, key) {
		t.Fatal("a new config label is a reload trigger")
	}
	step(t, n, MigInput{}, DPInput{Now: at.Add(2 * time.Minute)})
	if n.Labels[LabelGFDTimestamp] != "1800000120" || n.Labels["nvidia.com/gpu.replicas"] != "4" {
		t.Fatalf("reload: labels %v", n.Labels)
	}
}

func TestUntoleratedTaintsKeepTheGPUOperatorOff(t *testing.T) {
	gpuOnly := []Toleration{{Key: "nvidia.com/gpu", Operator: "Exists", Effect: "NoSchedule"}}
	ours := Taint{Key: "gpusharing.io/unconfigured", Effect: "NoSchedule"}
	if got := Untolerated([]Taint{ours}, gpuOnly); got != ours.Key {
		t.Fatalf("got %q, want %q", got, ours.Key)
	}
	both := append(gpuOnly, Toleration{Key: ours.Key, Operator: "Exists", Effect: "NoSchedule"})
	if got := Untolerated([]Taint{ours, {Key: "nvidia.com/gpu", Effect: "NoSchedule"}}, both); got != "" {
		t.Fatalf("tolerated taints reported: %q", got)
	}
	// DaemonSets tolerate cordoned nodes, and PreferNoSchedule never blocks.
	soft := []Taint{{Key: "node.kubernetes.io/unschedulable", Effect: "NoSchedule"}, {Key: "x", Effect: "PreferNoSchedule"}}
	if got := Untolerated(soft, nil); got != "" {
		t.Fatalf("got %q", got)
	}
	if got := Untolerated([]Taint{{Key: "k", Value: "v", Effect: "NoExecute"}}, []Toleration{{Key: "k", Value: "w"}}); got != "k" {
		t.Fatalf("a value mismatch tolerates: %q", got)
	}
}

func TestOperandSwitchAndStoppedDevicePlugin(t *testing.T) {
	n := &Node{Name: "n", Labels: map[string]string{}, Annotations: map[string]string{AnnDPLoaded: "k"},
		Capacity: map[string]string{"nvidia.com/gpu": "8"}, Allocatable: map[string]string{"nvidia.com/gpu": "8", "cpu": "96"}}
	p := &Patch{}
	PlanOperandLabels(n, p)
	if v := p.Labels[LabelDeployDevicePlugin]; v == nil || *v != "true" {
		t.Fatalf("the GPU Operator sets an absent switch to true, got %v", p.Labels)
	}
	n.Labels[LabelDeployDevicePlugin] = "false"
	p = &Patch{}
	PlanOperandLabels(n, p)
	if len(p.Labels) != 0 || DevicePluginDeployed(n) {
		t.Fatalf("a false switch is left alone and keeps the plugin off: %v", p.Labels)
	}
	PlanDevicePluginGone(n, p)
	if p.Allocatable["nvidia.com/gpu"] != "0" || len(p.Allocatable) != 1 || p.Resources != nil {
		t.Fatalf("allocatable of the plugin's resources only goes to 0, capacity stays: %v %v", p.Allocatable, p.Resources)
	}
	if _, ok := p.Annotations[AnnDPLoaded]; !ok {
		t.Fatalf("the next deployment must load afresh")
	}
}

func TestSandboxOperandsOnVMHosts(t *testing.T) {
	hw := Hardware{Product: "NVIDIA-L4", Count: 4}
	cfg := "version: v1\nvgpu-configs:\n  L4-6Q:\n  - devices: all\n    vgpu-devices:\n      L4-6Q: 4\n"
	in := SandboxInput{Config: cfg, Source: "test", VgpuManager: true, KubeVirt: true}
	n := &Node{Name: "n", Labels: map[string]string{LabelWorkload: WorkloadVgpu, LabelVgpuConfig: "L4-6Q"},
		Annotations: map[string]string{}, Allocatable: map[string]string{"nvidia.com/gpu": "16"}}
	if w := Workload(n, ClusterPolicy{}); w != WorkloadCtr {
		t.Fatalf("without sandboxWorkloads.enabled every node is a container node, got %s", w)
	}
	if w := Workload(n, ClusterPolicy{SandboxEnabled: true}); w != WorkloadVgpu {
		t.Fatalf("got %s", w)
	}
	p := &Patch{}
	PlanSandbox(n, hw, WorkloadVgpu, in, p)
	if *p.Labels[LabelVgpuState] != StateSuccess || p.Allocatable["nvidia.com/NVIDIA_L4-6Q"] != "16" || p.Allocatable["nvidia.com/gpu"] != "0" {
		t.Fatalf("vGPU devices created and advertised, device plugin gone: %v %v", p.Labels, p.Allocatable)
	}
	n.Labels[LabelVgpuConfig] = "L4-7Q"
	p = &Patch{}
	PlanSandbox(n, hw, WorkloadVgpu, in, p)
	if *p.Labels[LabelVgpuState] != StateFailed || !strings.Contains(*p.Annotations[AnnVgpuError], "not present") {
		t.Fatalf("an unknown config fails: %v %v", p.Labels, p.Annotations)
	}
	p = &Patch{}
	PlanSandbox(n, hw, WorkloadPass, in, p)
	if p.Allocatable["nvidia.com/AD104GL_L4"] != "4" {
		t.Fatalf("passthrough GPUs advertised by PCI device name: %v", p.Allocatable)
	}
	n.Allocatable = map[string]string{"nvidia.com/AD104GL_L4": "4"}
	p = &Patch{}
	PlanSandboxGone(n, p)
	if p.Allocatable["nvidia.com/AD104GL_L4"] != "0" {
		t.Fatalf("a container node advertises no VM resources: %v", p.Allocatable)
	}
}

// The sandbox device plugin's names come from NVIDIA's pci.ids through its
// own rules (upper case, '_' for spaces, brackets dropped).
func TestPCINameFromPCIIDs(t *testing.T) {
	for product, want := range map[string]string{
		"NVIDIA-A100-SXM4-80GB": "GA100_A100_SXM4_80GB",
		"NVIDIA-A100-80GB-PCIe": "GA100_A100_PCIE_80GB",
		"NVIDIA-H200":           "GH100_H200_SXM_141GB",
		"NVIDIA-L4":             "AD104GL_L4",
		"NVIDIA-A10":            "GA102GL_A10",
		"Foo-X":                 "FOO_X",
	} {
		if got := PCIName(product); got != want {
			t.Errorf("PCIName(%s) = %s, want %s", product, got, want)
		}
	}
}

// A pod whose nvidia.com/gpu kube-scheduler served through DRA (KEP-5004)
// asks the device manager for nothing of it: the DRA driver prepares it.
func TestGPURequestsServedThroughDRA(t *testing.T) {
	pod := &corev1.Pod{Spec: corev1.PodSpec{Containers: []corev1.Container{{Resources: corev1.ResourceRequirements{
		Limits: corev1.ResourceList{
			"nvidia.com/gpu":         *resource.NewQuantity(1, resource.DecimalSI),
			"nvidia.com/mig-1g.10gb": *resource.NewQuantity(2, resource.DecimalSI),
		}}}}}}
	if got := GPURequests(pod); got["nvidia.com/gpu"] != 1 || got["nvidia.com/mig-1g.10gb"] != 2 {
		t.Fatalf("device plugin: %v", got)
	}
	pod.Status.ExtendedResourceClaimStatus = &corev1.PodExtendedResourceClaimStatus{
		ResourceClaimName: "p-extended-resources-x7k2q",
		RequestMappings: []corev1.ContainerExtendedResourceRequest{
			{ContainerName: "c", ResourceName: "nvidia.com/gpu", RequestName: "container-0-request-0"},
		},
	}
	if got := GPURequests(pod); len(got) != 1 || got["nvidia.com/mig-1g.10gb"] != 2 {
		t.Fatalf("nvidia.com/gpu through DRA: %v", got)
	}
}
