package nvmig

import (
	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/server"
)

// The go-nvml mock's CreateGpuInstance accepts every request and records no
// placement, so two instances may "overlap". On a GPU the driver picks the
// placement of an instance created without one (mig-parted always creates
// them so) and answers NVML_ERROR_INSUFFICIENT_RESOURCES when none is free.
// driverCreate plays that driver over the mock's own placement data
// (GetGpuInstancePossiblePlacements) and records the choice through the
// mock's CreateGpuInstanceWithPlacement, so the instance carries it and its
// Destroy frees it.
//
// The choice rule is not documented by NVIDIA. The one used: among the free
// placements, the one that removes the fewest still-possible placements of
// any profile, lowest start on a tie. It reproduces the outputs NVIDIA
// publishes for recent drivers (MIG user guide, "Creating GPU Instances"
// examples on an A100 40GB, seven 1g instances on an H100 80GB) and is the
// rule the operator's geometry model (src/nvidia/geometry.rs) validates
// itself against, so both sides assume the same driver.
//
// Besides placements, a GPU refuses:
//   - more instances of a profile than its InstanceCount;
//   - a second instance with the media extensions (+me, NVML's
//     *_SLICE_REV1 and *_ALL_ME profiles): each takes the GPU's single OFA
//     (and JPEG) engine. The mock's per-profile InstanceCount says 1 for
//     each such profile but nothing across profiles (A30: 1g.6gb+me and
//     2g.12gb+me); its engine counts cannot be used instead (its H100 7g
//     profile has no OFA while its 1g+me has one).
func driverCreate(m *Model, d *server.Device) func(*nvml.GpuInstanceProfileInfo) (nvml.GpuInstance, nvml.Return) {
	withPlacement := d.CreateGpuInstanceWithPlacementFunc
	return func(info *nvml.GpuInstanceProfileInfo) (nvml.GpuInstance, nvml.Return) {
		pl, ret := choosePlacement(m, d, info)
		if ret != nvml.SUCCESS {
			return nil, ret
		}
		gi, ret := withPlacement(info, &pl)
		if ret == nvml.SUCCESS {
			g := gi.(*server.GpuInstance)
			g.CreateComputeInstanceFunc = computeInstanceCreate(g, int(info.SliceCount), g.CreateComputeInstanceFunc)
		}
		return gi, ret
	}
}

// computeInstanceCreate: the mock's CreateComputeInstance accepts any number
// of compute instances in a GPU instance. mig-parted first tries to create
// the next instance of the same profile as a second compute instance of the
// GPU instance it just made (reuseGI), and only makes a new GPU instance when
// the driver refuses; the driver refuses when the GPU instance's compute
// slices are taken or the compute-instance profile's InstanceCount is reached
// (the mock's ComputeInstanceProfiles data).
func computeInstanceCreate(gi *server.GpuInstance, slices int, create func(*nvml.ComputeInstanceProfileInfo) (nvml.ComputeInstance, nvml.Return)) func(*nvml.ComputeInstanceProfileInfo) (nvml.ComputeInstance, nvml.Return) {
	return func(info *nvml.ComputeInstanceProfileInfo) (nvml.ComputeInstance, nvml.Return) {
		used, same := 0, 0
		gi.RLock()
		for ci := range gi.ComputeInstances {
			p := gi.MIGProfiles.ComputeInstanceProfiles[int(gi.Info.ProfileId)][int(ci.Info.ProfileId)]
			used += int(p.SliceCount)
			if ci.Info.ProfileId == info.Id {
				same++
			}
		}
		gi.RUnlock()
		if used+int(info.SliceCount) > slices || same >= int(info.InstanceCount) {
			return nil, nvml.ERROR_INSUFFICIENT_RESOURCES
		}
		return create(info)
	}
}

func mask(start, size uint32) uint64 { return ((uint64(1) << size) - 1) << start }

func mediaExtensions(profileID uint32) bool {
	switch profileID {
	case nvml.GPU_INSTANCE_PROFILE_1_SLICE_REV1, nvml.GPU_INSTANCE_PROFILE_2_SLICE_REV1,
		nvml.GPU_INSTANCE_PROFILE_1_SLICE_ALL_ME, nvml.GPU_INSTANCE_PROFILE_2_SLICE_ALL_ME:
		return true
	}
	return false
}

func choosePlacement(m *Model, d *server.Device, info *nvml.GpuInstanceProfileInfo) (nvml.GpuInstancePlacement, nvml.Return) {
	var used uint64
	same, media := 0, false
	d.RLock()
	for gi := range d.GpuInstances {
		used |= mask(gi.Info.Placement.Start, gi.Info.Placement.Size)
		if gi.Info.ProfileId == info.Id {
			same++
		}
		media = media || mediaExtensions(gi.Info.ProfileId)
	}
	d.RUnlock()
	if same >= int(info.InstanceCount) || (media && mediaExtensions(info.Id)) {
		return nvml.GpuInstancePlacement{}, nvml.ERROR_INSUFFICIENT_RESOURCES
	}
	candidates, ret := d.GetGpuInstancePossiblePlacements(info)
	if ret != nvml.SUCCESS {
		return nvml.GpuInstancePlacement{}, ret
	}
	best, bestCost := -1, 0
	for i, c := range candidates {
		mine := mask(c.Start, c.Size)
		if used&mine != 0 {
			continue
		}
		cost := 0
		for _, p := range m.Profiles {
			for _, o := range p.Placements {
				if other := mask(o.Start, o.Size); used&other == 0 && other&mine != 0 {
					cost++
				}
			}
		}
		if best < 0 || cost < bestCost || (cost == bestCost && c.Start < candidates[best].Start) {
			best, bestCost = i, cost
		}
	}
	if best < 0 {
		return nvml.GpuInstancePlacement{}, nvml.ERROR_INSUFFICIENT_RESOURCES
	}
	return candidates[best], nvml.SUCCESS
}
