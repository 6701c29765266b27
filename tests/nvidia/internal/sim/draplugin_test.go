package sim

import (
	"strconv"
	"strings"
	"testing"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	resourcev1 "k8s.io/api/resource/v1"

	"gpusharing.io/tests/nvidia/internal/nvconf"
	"gpusharing.io/tests/nvidia/internal/nvmig"
)

// The devices of an A100 80GB node as the DRA driver publishes them: a GPU
// with MIG on as its instances, named by profile ID and placement start, with
// their slices; a whole GPU with the go-nvml mock's facts; shares and
// request policies under each --consumable-shares mode.
func TestDRADevices(t *testing.T) {
	hw := Hardware{Product: "NVIDIA-A100-SXM4-80GB", Count: 2, MigCapable: true, MemoryMiB: 81920}
	if nvmig.ModelFor(hw.Product, hw.MemoryMiB) == nil {
		t.Fatal("no go-nvml model for the A100 80GB")
	}
	geo := Geometry{
		{MigEnabled: true, MigDevices: map[string]int{"1g.10gb": 1, "3g.40gb": 1}},
		nvconf.GPU{},
	}
	places := Placements{{{Profile: "3g.40gb", Start: 4, Size: 4}, {Profile: "1g.10gb", Start: 0, Size: 1}}, nil}
	devs, err := DRADevices("n1", hw, geo, places, "4")
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, d := range devs {
		names = append(names, d.Name)
	}
	want := []string{
		"gpu-0-mig-1g10gb-" + strconv.Itoa(nvml.GPU_INSTANCE_PROFILE_1_SLICE) + "-0",
		"gpu-0-mig-3g40gb-" + strconv.Itoa(nvml.GPU_INSTANCE_PROFILE_3_SLICE) + "-4",
		"gpu-1",
	}
	if strings.Join(names, " ") != strings.Join(want, " ") {
		t.Fatalf("devices %v, want %v", names, want)
	}
	mig := devs[1]
	if *mig.Attributes["type"].StringValue != "mig" || *mig.Attributes["profile"].StringValue != "3g.40gb" ||
		!strings.HasPrefix(*mig.Attributes["uuid"].StringValue, "MIG-") || *mig.Attributes["parentUUID"].StringValue != fakeUUID("GPU", "n1", "0") ||
		*mig.Attributes["uuid"].StringValue == *devs[0].Attributes["uuid"].StringValue {
		t.Fatalf("MIG attributes %v", mig.Attributes)
	}
	for _, s := range []string{"memorySlice4", "memorySlice7"} {
		if c, ok := mig.Capacity[resourcev1.QualifiedName(s)]; !ok || c.Value.Value() != 1 {
			t.Fatalf("MIG capacity %s missing: %v", s, mig.Capacity)
		}
	}
	if _, ok := mig.Capacity["memorySlice3"]; ok {
		t.Fatal("memorySlice3 is not the 3g's")
	}
	if sm := mig.Capacity["multiprocessors"]; sm.Value.Value() == 0 {
		t.Fatal("MIG multiprocessors from the mock's profile info missing")
	}
	gpu := devs[2]
	if *gpu.Attributes["type"].StringValue != "gpu" || *gpu.Attributes["architecture"].StringValue != "Ampere" ||
		*gpu.Attributes["cudaComputeCapability"].VersionValue != "8.0.0" ||
		!strings.HasPrefix(*gpu.Attributes["uuid"].StringValue, "GPU-") {
		t.Fatalf("GPU attributes %v", gpu.Attributes)
	}
	if s := gpu.Capacity["shares"]; s.Value.Value() != 4 || s.RequestPolicy.Default.Value() != 1 || s.RequestPolicy.ValidRange.Max.Value() != 4 {
		t.Fatalf("shares %+v", s)
	}
	if m := gpu.Capacity["memory"]; m.RequestPolicy.Default.Value() != 0 || m.Value.Value() != 81920<<20 {
		t.Fatalf("memory under shares %+v", m)
	}
	// The parent of a MIG device is its GPU's UUID, distinct per node.
	other, _ := DRADevices("n2", hw, geo, places, "4")
	if *mig.Attributes["parentUUID"].StringValue == *other[1].Attributes["parentUUID"].StringValue {
		t.Fatal("UUIDs repeat across nodes")
	}

	// "memory": a claim takes the whole GPU's memory by default; disabled: nothing shared.
	devs, _ = DRADevices("n1", hw, geo, places, "memory")
	if m := devs[2].Capacity["memory"]; m.RequestPolicy.Default.Cmp(m.Value) != 0 || devs[2].Capacity["shares"].RequestPolicy != nil {
		t.Fatalf("memory mode %+v", devs[2].Capacity)
	}
	devs, _ = DRADevices("n1", hw, geo, places, "disabled")
	if devs[2].AllowMultipleAllocations != nil || devs[2].Capacity["memory"].RequestPolicy != nil {
		t.Fatalf("disabled %+v", devs[2])
	}
	if _, err := DRADevices("n1", hw, geo, places, "0"); err == nil {
		t.Fatal("--consumable-shares=0 accepted")
	}
}

// A profile with a media-extension suffix keeps a valid device name, as
// the driver's RFC 1123 spelling makes it.
func TestDRADeviceNameOfAMediaExtensionProfile(t *testing.T) {
	if got := deviceNamePart("1g.10gb+me"); got != "1g10gb-me" {
		t.Fatalf("1g.10gb+me -> %q", got)
	}
	if got := deviceNamePart("1g.10gb"); got != "1g10gb" {
		t.Fatalf("1g.10gb -> %q", got)
	}
}

func TestValidConsumableShares(t *testing.T) {
	for _, ok := range []string{"", "disabled", "memory", "unlimited", "1", "8"} {
		if err := ValidConsumableShares(ok); err != nil {
			t.Errorf("%q: %v", ok, err)
		}
	}
	for _, bad := range []string{"0", "-2", "half", "4x"} {
		if ValidConsumableShares(bad) == nil {
			t.Errorf("%q accepted", bad)
		}
	}
}

// The plugin publishes when deployed, not again while it runs (other
// devices included: it enumerates them at start), and withdraws what it
// published once it is gone.
func TestPlanDRASlice(t *testing.T) {
	hw := Hardware{Product: "NVIDIA-A100-SXM4-80GB", Count: 1, MemoryMiB: 81920}
	devs, _ := DRADevices("n", hw, nil, nil, "disabled")
	n := &Node{Name: "n", Labels: map[string]string{LabelDeployDRADriver: "true"}, Annotations: map[string]string{}}
	p := &Patch{}
	if pub, wd := PlanDRASlice(n, devs, p); !pub || wd || p.Annotations[AnnDRASlice] == nil {
		t.Fatalf("first: publish %v withdraw %v", pub, wd)
	}
	n.Annotations[AnnDRASlice] = *p.Annotations[AnnDRASlice]
	if pub, wd := PlanDRASlice(n, devs, &Patch{}); pub || wd {
		t.Fatal("same devices published again")
	}
	mig, err := DRADevices("n", Hardware{Product: hw.Product, Count: 1, MemoryMiB: 81920, MigCapable: true},
		Geometry{{MigEnabled: true, MigDevices: map[string]int{"7g.80gb": 1}}}, Placements{{{Profile: "7g.80gb", Start: 0, Size: 8}}}, "disabled")
	if err != nil || len(mig) != 1 {
		t.Fatalf("MIG devices %v %v", mig, err)
	}
	if pub, wd := PlanDRASlice(n, mig, &Patch{}); pub || wd {
		t.Fatal("a running plugin republished a changed MIG layout")
	}
	n.Labels[LabelDeployDRADriver] = "false"
	p = &Patch{}
	if pub, wd := PlanDRASlice(n, nil, p); pub || !wd {
		t.Fatalf("gone: publish %v withdraw %v", pub, wd)
	}
	if v, ok := p.Annotations[AnnDRASlice]; !ok || v != nil {
		t.Fatal("the slice's annotation is not dropped")
	}
	delete(n.Annotations, AnnDRASlice)
	if pub, wd := PlanDRASlice(n, nil, &Patch{}); pub || wd {
		t.Fatal("nothing to withdraw")
	}
}
