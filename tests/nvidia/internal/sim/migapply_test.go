package sim

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"gpusharing.io/tests/nvidia/internal/nvmig"
)

// migLayouts: custom layouts for an A100 80GB node.
const migLayouts = `version: v1
mig-configs:
  all-disabled:
  - devices: all
    mig-enabled: false
  balanced:
  - devices: all
    mig-enabled: true
    mig-devices: {"3g.40gb": 1, "2g.20gb": 1, "1g.10gb": 2}
  two-3g-and-2g:
  - devices: all
    mig-enabled: true
    mig-devices: {"3g.40gb": 2, "2g.20gb": 1}
  gpu0-two-3g-and-2g:
  - devices: [0]
    mig-enabled: true
    mig-devices: {"3g.40gb": 2, "2g.20gb": 1}
  gpu1-all-1g:
  - devices: all
    mig-enabled: true
    mig-devices: {"3g.40gb": 1, "2g.20gb": 1, "1g.10gb": 2}
  - devices: [1]
    mig-enabled: true
    mig-devices: {"1g.10gb": 7}
  %s:
  - devices: all
    mig-enabled: true
    mig-devices: %s
`

// orderDependent: feasible on an A100 80GB only if the 1g.20gb is created
// before the second 1g.10gb (the driver puts the first 1g.10gb at 6, which
// takes one of the two slots left for the 1g.20gb); see
// nvmig.TestOrderDependentLayout.
var orderDependent = map[string]int{"2g.20gb": 2, "1g.20gb": 1, "1g.10gb": 2}

// applyMig labels the node with layout and runs the MIG manager through its
// pending delay.
func applyMig(t *testing.T, n *Node, layout string) {
	t.Helper()
	applyMigBusy(t, n, layout, Busy{})
}

// applyMigBusy is applyMig with GPU pods holding devices.
func applyMigBusy(t *testing.T, n *Node, layout string, busy Busy) {
	t.Helper()
	devs := []string{}
	for p, c := range orderDependent {
		devs = append(devs, fmt.Sprintf("%q: %d", p, c))
	}
	cfg := fmt.Sprintf(migLayouts, "order-dependent", "{"+strings.Join(devs, ", ")+"}")
	n.Labels[LabelMigConfig] = layout
	now := time.Now()
	step(t, n, MigInput{MigConfig: cfg, Now: now, Delay: time.Second}, DPInput{})
	if n.Labels[LabelMigState] != StatePending {
		t.Fatalf("%s: state %q (error %q), want pending", layout, n.Labels[LabelMigState], n.Annotations[AnnMigError])
	}
	due := now.Add(time.Second)
	step(t, n, MigInput{MigConfig: cfg, Now: due, Due: &due, Delay: time.Second, Busy: busy}, DPInput{})
}

// mig-parted on a node with pods: a GPU whose devices do not change is
// skipped whatever runs on it; a changed GPU a pod uses loses the idle
// instances before the pod's and fails "In use by another client", the GPUs
// after it untouched; once the pod is gone the change goes through.
func TestMigBusyGPUsAreSkippedOrFailAsMigParted(t *testing.T) {
	n := a100Node()
	step(t, n, MigInput{}, DPInput{})
	applyMig(t, n, "balanced")
	var busy Busy
	busy.Add("x/a", "0/3g.40gb@4")
	busy.Add("x/b", "1/1g.10gb@3")
	applyMigBusy(t, n, "gpu1-all-1g", busy)
	msg := n.Annotations[AnnMigError]
	if n.Labels[LabelMigState] != StateFailed || !strings.Contains(msg, "GPU 1") || !strings.Contains(msg, "In use by another client") || !strings.Contains(msg, "x/b") {
		t.Fatalf("state %q error %q", n.Labels[LabelMigState], msg)
	}
	places := PlacementsOf(n.Annotations, 8)
	balanced := "[2g.20gb@0:2][1g.10gb@2:1][1g.10gb@3:1][3g.40gb@4:4]"
	if got := nvmig.FormatPlacements(places[1]); got != "[1g.10gb@3:1][3g.40gb@4:4]" {
		t.Fatalf("GPU 1: %s: the idle 2g@0 and 1g@2 go, the busy 1g@3 and what follows stay", got)
	}
	for _, i := range []int{0, 2, 7} {
		if got := nvmig.FormatPlacements(places[i]); got != balanced {
			t.Fatalf("GPU %d: %s, want it untouched", i, got)
		}
	}
	// x/b ended; x/a still runs on GPU 0, which neither layout changes.
	busy = Busy{}
	busy.Add("x/a", "0/3g.40gb@4")
	applyMigBusy(t, n, "balanced", busy)
	applyMigBusy(t, n, "gpu1-all-1g", busy)
	places = PlacementsOf(n.Annotations, 8)
	if n.Labels[LabelMigState] != StateSuccess || len(places[1]) != 7 || nvmig.FormatPlacements(places[0]) != balanced {
		t.Fatalf("state %q error %q GPU 0 %v GPU 1 %v", n.Labels[LabelMigState], n.Annotations[AnnMigError], places[0], places[1])
	}
	// Back to all-disabled is a mode change: refused while x/a runs, nothing touched.
	applyMigBusy(t, n, "all-disabled", busy)
	if n.Labels[LabelMigState] != StateFailed || !strings.Contains(n.Annotations[AnnMigError], "MIG mode") || !GeometryOf(n.Annotations, 8)[3].MigEnabled {
		t.Fatalf("state %q error %q", n.Labels[LabelMigState], n.Annotations[AnnMigError])
	}
}

func TestMigPlacesAFeasibleLayout(t *testing.T) {
	n := a100Node()
	step(t, n, MigInput{}, DPInput{})
	applyMig(t, n, "balanced")
	if n.Labels[LabelMigState] != StateSuccess {
		t.Fatalf("state %q error %q", n.Labels[LabelMigState], n.Annotations[AnnMigError])
	}
	places := PlacementsOf(n.Annotations, 8)
	// mig-parted creates 3g, 2g, 1g, 1g; the driver puts the 3g at 4 (it
	// blocks fewer placements than at 0), the 2g at 0, the 1g at 2 and 3.
	want := "[2g.20gb@0:2][1g.10gb@2:1][1g.10gb@3:1][3g.40gb@4:4]"
	for i, gpu := range places {
		if got := nvmig.FormatPlacements(gpu); got != want {
			t.Fatalf("GPU %d: %s, want %s (annotation %s)", i, got, want, n.Annotations[AnnMigGeometry])
		}
	}
	geo := GeometryOf(n.Annotations, 8)
	if d := geo[7].MigDevices; !geo[7].MigEnabled || d["3g.40gb"] != 1 || d["2g.20gb"] != 1 || d["1g.10gb"] != 2 {
		t.Fatalf("the existing fields must stay readable: %+v", geo[7])
	}
	if !strings.Contains(n.Annotations[AnnMigGeometry], `"e":true,"d":{`) {
		t.Fatalf("annotation %s", n.Annotations[AnnMigGeometry])
	}
}

func TestMigInfeasibleLayoutFailsAndLeavesNoInstances(t *testing.T) {
	n := a100Node()
	step(t, n, MigInput{}, DPInput{})
	applyMig(t, n, "two-3g-and-2g")
	if n.Labels[LabelMigState] != StateFailed || n.Annotations[AnnAppliedMig] != "two-3g-and-2g" {
		t.Fatalf("state %q applied %q", n.Labels[LabelMigState], n.Annotations[AnnAppliedMig])
	}
	msg := n.Annotations[AnnMigError]
	for _, want := range []string{"GPU 0", "error attempting multiple config orderings", "ERROR_INSUFFICIENT_RESOURCES", "2g.20gb"} {
		if !strings.Contains(msg, want) {
			t.Fatalf("error %q lacks %q", msg, want)
		}
	}
	// mig-parted enabled MIG on every GPU, failed on GPU 0 and cleared it:
	// no instance anywhere, no placement recorded.
	for i, gpu := range GeometryOf(n.Annotations, 8) {
		if !gpu.MigEnabled || len(gpu.MigDevices) != 0 {
			t.Fatalf("GPU %d: %+v (annotation %s)", i, gpu, n.Annotations[AnnMigGeometry])
		}
	}
	if strings.Contains(n.Annotations[AnnMigGeometry], `"p"`) {
		t.Fatalf("placements left: %s", n.Annotations[AnnMigGeometry])
	}
	// No retry until the label changes; a feasible layout then applies.
	if p, _, _ := step(t, n, MigInput{Now: time.Now()}, DPInput{}); p.Labels[LabelMigState] != nil {
		t.Fatalf("failed state must be kept: %+v", p.Labels)
	}
	applyMig(t, n, "balanced")
	if n.Labels[LabelMigState] != StateSuccess || n.Annotations[AnnMigError] != "" {
		t.Fatalf("state %q error %q", n.Labels[LabelMigState], n.Annotations[AnnMigError])
	}
}

// The apply stops at the first GPU that fails, as mig-parted's walk over the
// GPUs does: that GPU is cleared, the others keep their instances.
func TestMigFailureClearsTheFailingGPUOnly(t *testing.T) {
	n := a100Node()
	step(t, n, MigInput{}, DPInput{})
	applyMig(t, n, "balanced")
	applyMig(t, n, "gpu0-two-3g-and-2g")
	if n.Labels[LabelMigState] != StateFailed {
		t.Fatalf("state %q", n.Labels[LabelMigState])
	}
	geo, places := GeometryOf(n.Annotations, 8), PlacementsOf(n.Annotations, 8)
	if !geo[0].MigEnabled || len(geo[0].MigDevices) != 0 || len(places[0]) != 0 {
		t.Fatalf("GPU 0 not cleared: %+v %v", geo[0], places[0])
	}
	if geo[1].MigDevices["3g.40gb"] != 1 || len(places[1]) != 4 {
		t.Fatalf("GPU 1 lost its instances: %+v %v", geo[1], places[1])
	}
}

func TestMigLayoutFeasibleInAnotherOrderSucceeds(t *testing.T) {
	n := a100Node()
	step(t, n, MigInput{}, DPInput{})
	applyMig(t, n, "order-dependent")
	if n.Labels[LabelMigState] != StateSuccess {
		t.Fatalf("state %q error %q", n.Labels[LabelMigState], n.Annotations[AnnMigError])
	}
	places := PlacementsOf(n.Annotations, 8)
	if c := nvmig.Counts(places[0]); len(places[0]) != 5 || c["2g.20gb"] != 2 || c["1g.20gb"] != 1 || c["1g.10gb"] != 2 {
		t.Fatalf("GPU 0: %v", places[0])
	}
}

// A GPU the go-nvml mock does not describe: the layout is applied as asked,
// unchecked, and the log says so; the fault annotation fails it on purpose.
func TestMigOnAModelWithoutMockData(t *testing.T) {
	n := a100Node()
	n.Labels[LabelProduct] = "NVIDIA-RTX-PRO-6000-Blackwell-Server-Edition"
	n.Annotations[AnnHardware] = `{"product":"NVIDIA-RTX-PRO-6000-Blackwell-Server-Edition","count":8,"migCapable":true,"memoryMiB":97887}`
	step(t, n, MigInput{}, DPInput{})
	n.Labels[LabelMigConfig] = "custom"
	cfg := "version: v1\nmig-configs:\n  all-disabled:\n  - devices: all\n    mig-enabled: false\n  custom:\n  - devices: all\n    mig-enabled: true\n    mig-devices: {\"2g.48gb\": 3}\n"
	now := time.Now()
	step(t, n, MigInput{MigConfig: cfg, Now: now, Delay: time.Second}, DPInput{})
	p, _, _ := step(t, n, MigInput{MigConfig: cfg, Now: now.Add(time.Second), Due: &now}, DPInput{})
	if n.Labels[LabelMigState] != StateSuccess || !strings.Contains(strings.Join(p.Log, "\n"), "MIG geometry unverified") {
		t.Fatalf("state %q log %q", n.Labels[LabelMigState], p.Log)
	}
	if geo := GeometryOf(n.Annotations, 8); geo[0].MigDevices["2g.48gb"] != 3 {
		t.Fatalf("geometry %s", n.Annotations[AnnMigGeometry])
	}
	n.Annotations[AnnFault] = FaultMigApplyFail
	n.Labels[LabelMigConfig] = "all-disabled"
	step(t, n, MigInput{MigConfig: cfg, Now: now, Delay: time.Second}, DPInput{})
	step(t, n, MigInput{MigConfig: cfg, Now: now.Add(time.Second), Due: &now}, DPInput{})
	if n.Labels[LabelMigState] != StateFailed || !strings.Contains(n.Annotations[AnnMigError], "fault injected") {
		t.Fatalf("state %q error %q", n.Labels[LabelMigState], n.Annotations[AnnMigError])
	}
	if geo := GeometryOf(n.Annotations, 8); geo[0].MigDevices["2g.48gb"] != 3 {
		t.Fatalf("an injected failure leaves the GPUs alone: %s", n.Annotations[AnnMigGeometry])
	}
}

func TestHardwareRecordsMemory(t *testing.T) {
	hw, _ := HardwareOf(map[string]string{LabelProduct: "NVIDIA-H200", LabelMemory: "143771", LabelMigCapable: "true"}, nil)
	if hw.MemoryMiB != 143771 || nvmig.ModelFor(hw.Product, hw.MemoryMiB) == nil {
		t.Fatalf("%+v", hw)
	}
}
