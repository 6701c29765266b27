package nvmig

import (
	"strings"
	"testing"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/server"
)

func model(t *testing.T, name string) *Model {
	t.Helper()
	for _, m := range Models {
		if m.Name == name {
			return m
		}
	}
	t.Fatalf("no mock model %s", name)
	return nil
}

func TestModelsComeFromTheMock(t *testing.T) {
	m := model(t, "A100_SXM4_80GB")
	var names []string
	for _, p := range m.Profiles {
		names = append(names, p.Name)
	}
	if got := strings.Join(names, " "); got != "1g.10gb 2g.20gb 3g.40gb 4g.40gb 7g.80gb 1g.10gb+me 1g.20gb" {
		t.Fatalf("profiles %s", got)
	}
	if m.ComputeSlices != 7 || m.MemorySlices != 8 || m.Product != "NVIDIA-A100-SXM4-80GB" {
		t.Fatalf("%+v", m)
	}
	a30 := model(t, "A30_PCIE_24GB")
	if a30.ComputeSlices != 4 || a30.MemorySlices != 4 {
		t.Fatalf("A30: %d compute, %d memory slices", a30.ComputeSlices, a30.MemorySlices)
	}
	for _, tc := range []struct {
		product string
		mem     int
		want    string
	}{
		{"NVIDIA-A100-SXM4-80GB", 81920, "A100_SXM4_80GB"},
		{"NVIDIA-A100-80GB-PCIe", 0, "A100_PCIE_80GB"},
		{"NVIDIA-A100-SXM4-40GB", 40960, "A100_SXM4_40GB"},
		{"NVIDIA-A30", 24576, "A30_PCIE_24GB"},
		{"NVIDIA-H100-80GB-HBM3", 81559, "H100_SXM5_80GB"},
		{"NVIDIA-H200", 143771, "H200_SXM5_141GB"},
		{"NVIDIA-B200", 183359, "B200_SXM5_180GB"},
		{"NVIDIA-H200", 95830, ""},     // memory of another model
		{"NVIDIA-H100-NVL", 95830, ""}, // not in the mock
		{"NVIDIA-L4", 23034, ""},
	} {
		got := ""
		if m := ModelFor(tc.product, tc.mem); m != nil {
			got = m.Name
		}
		if got != tc.want {
			t.Errorf("ModelFor(%s, %d) = %q, want %q", tc.product, tc.mem, got, tc.want)
		}
	}
}

func TestPlacesAsTheDriver(t *testing.T) {
	m := model(t, "A100_SXM4_80GB")
	res, err := m.Place(nil, []string{"1g.10gb", "3g.40gb", "1g.10gb", "2g.20gb"})
	if err != nil || res.FailedOrderings != 0 {
		t.Fatalf("%v %+v", err, res)
	}
	if got := FormatPlacements(res.Placements); got != "[2g.20gb@0:2][1g.10gb@2:1][1g.10gb@3:1][3g.40gb@4:4]" {
		t.Fatalf("placements %s", got)
	}
	// Seven 1g instances: 6, 4, 5, 0, 1, 2, 3 in creation order (as NVIDIA's
	// published -cgi 19 x7 on an H100 80GB).
	res, err = m.Place(nil, strings.Fields(strings.Repeat("1g.10gb ", 7)))
	if err != nil || len(res.Placements) != 7 {
		t.Fatalf("%v %+v", err, res)
	}
}

func TestInfeasibleLayoutFailsAndClearsTheGPU(t *testing.T) {
	m := model(t, "A100_SXM4_80GB")
	node := NewNode(m, 1)
	res, err := m.Place(node, []string{"3g.40gb", "3g.40gb", "2g.20gb"})
	if err == nil || !strings.Contains(err.Error(), "all orderings failed") {
		t.Fatalf("err %v", err)
	}
	// Distinct orderings of {3g, 3g, 2g}: 3.
	if res.FailedOrderings != 3 || !strings.Contains(res.LastError, "ERROR_INSUFFICIENT_RESOURCES") || len(res.Placements) != 0 {
		t.Fatalf("%+v", res)
	}
	if len(node.Placements(0)) != 0 {
		t.Fatalf("GPU not cleared: %v", node.Placements(0))
	}
	// Instance counts and the single OFA engine are refused too.
	if _, err := m.Place(node, []string{"1g.10gb+me", "1g.10gb+me"}); err == nil {
		t.Fatal("two 1g.10gb+me created")
	}
	a30 := model(t, "A30_PCIE_24GB")
	if _, err := a30.Place(nil, []string{"2g.12gb+me", "1g.6gb+me"}); err == nil {
		t.Fatal("two media-extension instances created on an A30")
	}
	if _, err := a30.Place(nil, []string{"2g.12gb+me", "1g.6gb", "1g.6gb"}); err != nil {
		t.Fatal(err)
	}
}

// {2g.20gb x2, 1g.20gb, 1g.10gb x2} fits an A100 80GB (2g at 0 and 4, 1g.20gb
// at 6, 1g.10gb at 2 and 3), but created 2g, 2g, 1g.10gb, 1g.10gb, 1g.20gb the
// driver puts the first 1g.10gb at 6 and the second at 2: no slot is left for
// the 1g.20gb. mig-parted still creates it: it tries other orderings.
func TestOrderDependentLayout(t *testing.T) {
	m := model(t, "A100_SXM4_80GB")
	node := NewNode(m, 1)
	if err := node.SetMigMode(0, true); err != nil {
		t.Fatal(err)
	}
	dev := node.srv.Devices[0]
	var last nvml.Return
	for _, name := range []string{"2g.20gb", "2g.20gb", "1g.10gb", "1g.10gb", "1g.20gb"} {
		p, _ := m.Profile(name)
		info, _ := dev.GetGpuInstanceProfileInfo(p.ID)
		_, last = dev.CreateGpuInstance(&info)
	}
	if last != nvml.ERROR_INSUFFICIENT_RESOURCES {
		t.Fatalf("that order: %v, placements %v", last, node.Placements(0))
	}
	d := dev.(*server.Device)
	clear(d.GpuInstances)
	res, err := m.Place(node, []string{"2g.20gb", "2g.20gb", "1g.20gb", "1g.10gb", "1g.10gb"})
	if err != nil || len(res.Placements) != 5 {
		t.Fatalf("%v %+v", err, res)
	}
}

// Every mock model can hold its largest profile and seven (or four) of its
// smallest, through mig-parted.
func TestEveryModelCreatesItsNamedLayouts(t *testing.T) {
	for _, m := range Models {
		node := NewNode(m, 1)
		for _, p := range m.Profiles {
			var layout []string
			for k := 0; k < p.Max && (k+1)*p.Compute <= m.ComputeSlices; k++ {
				layout = append(layout, p.Name)
			}
			if res, err := m.Place(node, layout); err != nil || len(res.Placements) != len(layout) {
				t.Errorf("%s %v: %v %+v", m, layout, err, res)
			}
		}
	}
}
