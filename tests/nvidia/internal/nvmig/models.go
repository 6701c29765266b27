// Package nvmig creates MIG instances the way a node does, with NVIDIA's own
// data and code: the GPU models, MIG profiles and placements of the go-nvml
// v0.13.4-1 mock servers (pkg/nvml/mock/gpus, the data behind dgxa100,
// dgxh100, dgxh200 and dgxb200), mig-parted v0.13.1's apply code
// (pkg/mig/config SetMigConfig: its creation orderings) run against such a
// mock, and a stand-in for the driver's placement choice, which the mock
// lacks (its CreateGpuInstance accepts anything and records no placement).
//
// The simulator (internal/sim) applies layouts with it, and the conformance
// tool compares the operator's MIG geometry with its verdicts.
package nvmig

import (
	"fmt"
	"sort"
	"strings"

	nvdev "github.com/NVIDIA/go-nvlib/pkg/nvlib/device"
	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/gpus"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/server"
)

// Model is one GPU model the go-nvml mock describes.
type Model struct {
	// Name is the mock's Go name (gpus.<Name>), e.g. A100_SXM4_80GB.
	Name   string
	Config gpus.Config
	// Product is the nvidia.com/gpu.product value GFD derives from the
	// mock's device name (spaces to '-', without the mock's "Mock " prefix).
	Product string
	// Aliases are the nvidia.com/gpu.product values of the real boards whose
	// NVML name differs from the mock's (e.g. NVIDIA-A100-80GB-PCIe for the
	// mock's "NVIDIA A100-PCIE-80GB").
	Aliases []string
	// Profiles are the GPU-instance profiles (no compute-instance split:
	// C == G), named by go-nvlib as mig-parted and the device plugin name
	// them, in NVML profile-ID order.
	Profiles []Profile
	// ComputeSlices: the largest GPU-instance profile's slice count;
	// MemorySlices: the end of the furthest placement.
	ComputeSlices, MemorySlices int
	// Corrections: the profile memory sizes of the mock taken as smaller
	// (see correctMemory), e.g. "1g.18gb: 18432 -> 18048 MiB".
	Corrections []string
	// memoryMB: GPU-instance profile ID -> MemorySizeMB, corrected.
	memoryMB map[int]uint64
	// facts: what NVML reports of one GPU (see Facts), read when the model
	// is built.
	facts Facts
}

// Profile is one GPU-instance profile of a model, from the mock's tables.
type Profile struct {
	Name string
	// ID is the NVML GPU-instance profile ID (nvml.GPU_INSTANCE_PROFILE_*).
	ID int
	// Compute slices (SliceCount), memory slices (the size of its
	// placements), at most Max instances per GPU (InstanceCount).
	Compute, Memory, Max int
	// Placements: GetGpuInstancePossiblePlacements.
	Placements []nvml.GpuInstancePlacement
}

// Starts lists the starts of the profile's placements, ascending.
func (p Profile) Starts() []int {
	var out []int
	for _, pl := range p.Placements {
		out = append(out, int(pl.Start))
	}
	sort.Ints(out)
	return out
}

// Profile returns the model's profile of that name.
func (m *Model) Profile(name string) (Profile, bool) {
	for _, p := range m.Profiles {
		if p.Name == name {
			return p, true
		}
	}
	return Profile{}, false
}

func (m *Model) profileByID(id int) (Profile, bool) {
	for _, p := range m.Profiles {
		if p.ID == id {
			return p, true
		}
	}
	return Profile{}, false
}

// TotalGiB is the mock's memory rounded up to whole GiB, as go-nvlib names
// profiles and as nvidia.com/gpu.memory (MiB) rounds.
func (m *Model) TotalGiB() int { return int((m.Config.MemoryMB + 1023) / 1024) }

func (m *Model) String() string { return "gpus." + m.Name }

// Models: every GPU model of the go-nvml v0.13.4-1 mock.
var Models = []*Model{
	newModel("A100_SXM4_40GB", gpus.A100_SXM4_40GB),
	newModel("A100_PCIE_40GB", gpus.A100_PCIE_40GB),
	newModel("A100_SXM4_80GB", gpus.A100_SXM4_80GB),
	// The real board's NVML name is "NVIDIA A100 80GB PCIe".
	newModel("A100_PCIE_80GB", gpus.A100_PCIE_80GB, "NVIDIA-A100-80GB-PCIe"),
	// The real board's NVML name is "NVIDIA A30".
	newModel("A30_PCIE_24GB", gpus.A30_PCIE_24GB, "NVIDIA-A30"),
	newModel("H100_SXM5_80GB", gpus.H100_SXM5_80GB),
	// The real boards' NVML names are "NVIDIA H200" and "NVIDIA B200".
	newModel("H200_SXM5_141GB", gpus.H200_SXM5_141GB, "NVIDIA-H200"),
	newModel("B200_SXM5_180GB", gpus.B200_SXM5_180GB, "NVIDIA-B200"),
}

// GFDProduct turns an NVML device name into GFD's nvidia.com/gpu.product
// value (spaces to '-'); the mock's "Mock " prefix is dropped.
func GFDProduct(nvmlName string) string {
	return strings.Join(strings.Fields(strings.TrimPrefix(nvmlName, "Mock ")), "-")
}

// ModelFor finds the mock model of a node's GPUs from GFD's
// nvidia.com/gpu.product (without -MIG-... and -SHARED suffixes) and, when
// known (> 0), nvidia.com/gpu.memory in MiB, which must round to the mock's
// size in GiB. nil: the mock does not describe that GPU.
func ModelFor(product string, memoryMiB int) *Model {
	for _, m := range Models {
		names := append([]string{m.Product}, m.Aliases...)
		for _, n := range names {
			if !strings.EqualFold(n, product) {
				continue
			}
			if memoryMiB > 0 && (memoryMiB+1023)/1024 != m.TotalGiB() {
				return nil
			}
			return m
		}
	}
	return nil
}

// correctMemory: a profile's MemorySizeMB as the mock device reports it.
// go-nvlib names a profile (and mig-parted parses names) by the eighths of the
// GPU's memory it holds, rounded up: ceil(8 x size / total) / 8 x total GiB.
// Real GPUs report profile sizes at or a little below their eighths (the
// driver keeps some memory); the mock's H200 and B200 tables give whole GiB
// instead, a little above (H200 1g: 18432 of 144384 MiB, 1.02 eighths), which
// go-nvlib names 1g.35gb and 3g.88gb on an H200, 1g.45gb on a B200, so none of
// NVIDIA's published names (1g.18gb, 3g.71gb, 1g.23gb; the mock's own comments
// say so) would parse. A size less than a quarter of an eighth above a whole
// eighth is taken as that eighth; no A100, A30 or H100 size is changed.
func correctMemory(size, total uint64) uint64 {
	eighths := float64(size) * 8 / float64(total)
	k := uint64(eighths)
	if k >= 1 && eighths > float64(k) && eighths-float64(k) < 0.25 {
		return total * k / 8
	}
	return size
}

// install makes a mock device report the corrected profile memory sizes.
func (m *Model) install(d *server.Device) {
	get := d.GetGpuInstanceProfileInfoFunc
	d.GetGpuInstanceProfileInfoFunc = func(id int) (nvml.GpuInstanceProfileInfo, nvml.Return) {
		info, ret := get(id)
		if mb, ok := m.memoryMB[id]; ok && ret == nvml.SUCCESS {
			info.MemorySizeMB = mb
		}
		return info, ret
	}
}

func newModel(name string, cfg gpus.Config, aliases ...string) *Model {
	m := &Model{Name: name, Config: cfg, Product: GFDProduct(cfg.Name), Aliases: aliases, memoryMB: map[int]uint64{}}
	ids := make([]int, 0, len(cfg.MIGProfiles.GpuInstanceProfiles))
	for id := range cfg.MIGProfiles.GpuInstanceProfiles {
		ids = append(ids, id)
	}
	sort.Ints(ids)
	total := cfg.MemoryMB
	corrected := map[int]bool{}
	for _, id := range ids {
		size := cfg.MIGProfiles.GpuInstanceProfiles[id].MemorySizeMB
		m.memoryMB[id] = correctMemory(size, total)
		corrected[id] = m.memoryMB[id] != size
	}
	// go-nvlib names the profiles from the mock device's memory, as
	// mig-parted's ParseMigProfile and GetMigConfig do on a node.
	srv, err := server.New(server.WithGPUs(cfg))
	if err != nil {
		panic(fmt.Sprintf("go-nvml mock %s: %v", name, err))
	}
	dev := srv.Devices[0].(*server.Device)
	dev.MigMode = nvml.DEVICE_MIG_ENABLE
	m.install(dev)
	if m.facts, err = readFacts(srv); err != nil {
		panic(fmt.Sprintf("go-nvml mock %s: go-nvlib device facts: %v", name, err))
	}
	all, err := nvdev.New(srv).GetMigProfiles()
	if err != nil {
		panic(fmt.Sprintf("go-nvml mock %s: go-nvlib profiles: %v", name, err))
	}
	seen := map[int]bool{}
	for _, p := range all {
		info := p.GetInfo()
		if info.C != info.G || seen[info.GIProfileID] {
			continue
		}
		seen[info.GIProfileID] = true
		gi := cfg.MIGProfiles.GpuInstanceProfiles[info.GIProfileID]
		pls := cfg.MIGProfiles.GpuInstancePlacements[info.GIProfileID]
		prof := Profile{Name: p.String(), ID: info.GIProfileID, Compute: int(gi.SliceCount), Max: int(gi.InstanceCount), Placements: pls}
		for _, pl := range pls {
			prof.Memory = int(pl.Size)
			m.MemorySlices = max(m.MemorySlices, int(pl.Start+pl.Size))
		}
		m.ComputeSlices = max(m.ComputeSlices, prof.Compute)
		m.Profiles = append(m.Profiles, prof)
		if corrected[prof.ID] {
			m.Corrections = append(m.Corrections, fmt.Sprintf("%s: %d -> %d MiB", prof.Name, gi.MemorySizeMB, m.memoryMB[prof.ID]))
		}
	}
	sort.Slice(m.Profiles, func(i, j int) bool { return m.Profiles[i].ID < m.Profiles[j].ID })
	return m
}

// Facts are what NVML reports of one GPU of the model, read through
// go-nvlib as NVIDIA's DRA driver reads them for its device attributes.
type Facts struct {
	Name, Brand, Architecture string
	// ComputeCapability: "<major>.<minor>".
	ComputeCapability string
	MemoryBytes       uint64
}

// Facts is what NVML reports of one GPU of the model (name, brand,
// architecture, compute capability, memory), read through go-nvlib from a
// go-nvml mock device once, when the model is built.
func (m *Model) Facts() Facts { return m.facts }

// readFacts reads them from a mock device of the model.
func readFacts(srv *server.Server) (Facts, error) {
	dev, err := nvdev.New(srv).NewDevice(srv.Devices[0])
	if err != nil {
		return Facts{}, err
	}
	var f Facts
	var ret nvml.Return
	if f.Name, ret = dev.GetName(); ret != nvml.SUCCESS {
		return Facts{}, fmt.Errorf("name: %v", ret)
	}
	f.Name = strings.TrimPrefix(f.Name, "Mock ")
	if f.Brand, err = dev.GetBrandAsString(); err != nil {
		return Facts{}, err
	}
	if f.Architecture, err = dev.GetArchitectureAsString(); err != nil {
		return Facts{}, err
	}
	major, minor, ret := dev.GetCudaComputeCapability()
	if ret != nvml.SUCCESS {
		return Facts{}, fmt.Errorf("compute capability: %v", ret)
	}
	f.ComputeCapability = fmt.Sprintf("%d.%d", major, minor)
	mem, ret := dev.GetMemoryInfo()
	if ret != nvml.SUCCESS {
		return Facts{}, fmt.Errorf("memory: %v", ret)
	}
	f.MemoryBytes = mem.Total
	return f, nil
}

// ProfileInfo is NVML's GPU-instance profile info of the named profile
// (memory size corrected as the node reports it).
func (m *Model) ProfileInfo(name string) (nvml.GpuInstanceProfileInfo, bool) {
	p, ok := m.Profile(name)
	if !ok {
		return nvml.GpuInstanceProfileInfo{}, false
	}
	info, ok := m.Config.MIGProfiles.GpuInstanceProfiles[p.ID]
	if mb, found := m.memoryMB[p.ID]; found {
		info.MemorySizeMB = mb
	}
	return info, ok
}
