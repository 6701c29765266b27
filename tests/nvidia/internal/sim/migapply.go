package sim

import (
	"encoding/json"
	"fmt"
	"sort"
	"strings"

	mpv1 "github.com/NVIDIA/mig-parted/api/spec/v1"

	"gpusharing.io/tests/nvidia/internal/nvconf"
	"gpusharing.io/tests/nvidia/internal/nvmig"
)

// Placements holds, per GPU, where its MIG instances sit (nil for a GPU
// whose instances were not placed: MIG off, or a model without mock data).
type Placements [][]nvmig.Placement

// PlacementsOf reads the placements recorded in the geometry annotation.
func PlacementsOf(annotations map[string]string, count int) Placements {
	var in []geoGPU
	out := make(Placements, count)
	if err := json.Unmarshal([]byte(annotations[AnnMigGeometry]), &in); err == nil {
		for i := range out {
			if i < len(in) {
				out[i] = in[i].Placements
			}
		}
	}
	return out
}

// GeometryAnnotation is the value of AnnMigGeometry: per GPU its MIG mode
// ("e"), its devices by profile ("d") and, where known, each instance's
// placement ("p": profile, start, size).
func GeometryAnnotation(g Geometry, places Placements) string {
	out := g.gpus()
	for i := range out {
		if i < len(places) && len(places[i]) > 0 {
			out[i].Placements = places[i]
		}
	}
	b, _ := json.Marshal(out)
	return string(b)
}

// ApplyOnModel is `nvidia-mig-parted apply` of the selected config on a node
// whose GPUs the go-nvml mock describes (model), as the MIG manager runs it:
//
//  1. the MIG mode of every GPU (apply --mode-only: each matching entry in
//     turn, so the last one wins); a GPU whose mode changes loses its
//     instances;
//  2. the devices, walking the entries in order and the GPUs they select in
//     index order (assert.WalkSelectedMigConfigForEachGPU): an entry
//     enabling MIG on a GPU a later entry disables fails; a GPU that already
//     has the entry's devices is skipped (types.MigConfig.Equals); otherwise
//     mig-parted's own SetMigConfig creates them on the mock GPU, whose
//     driver places them (nvmig). The first failure ends the apply: the GPUs
//     done so far keep their new instances, the failing one is left cleared
//     with MIG on (mig-parted clears it after its last ordering), the others
//     keep what they had.
//
// Pods hold GPUs (busy, as the kubelet assigned them): a MIG mode change
// resets GPUs, so with any GPU pod on the node it fails before touching
// anything; a GPU whose devices change has all its instances destroyed
// first, in placement order, and the first one a pod uses fails with "In
// use by another client": the idle ones before it are gone, it and the
// later ones stay, the apply ends there (later GPUs untouched). GPUs whose
// devices do not change are skipped whatever runs on them.
//
// It returns the GPUs afterwards, their placements and the apply error.
func ApplyOnModel(model *nvmig.Model, slice mpv1.MigConfigSpecSlice, hw Hardware, cur Geometry, curPlaces Placements, busy Busy) (Geometry, Placements, error) {
	next := make(Geometry, hw.Count)
	copy(next, cur)
	places := make(Placements, hw.Count)
	copy(places, curPlaces)
	matches := func(e *mpv1.MigConfigSpec, i int) bool {
		return matchesFilter(e.DeviceFilter, hw.DeviceID) && e.MatchesDevices(i)
	}
	node := nvmig.NewNode(model, hw.Count)
	enabled := make([]bool, hw.Count)
	for i := range next {
		enabled[i] = next[i].MigEnabled
		for _, e := range slice {
			if matches(&e, i) {
				enabled[i] = e.MigEnabled
			}
		}
	}
	if err := modeChangeOnBusyNode(cur, enabled, busy); err != nil {
		return next, places, err
	}
	for i := range next {
		if enabled[i] != next[i].MigEnabled {
			next[i], places[i] = nvconf.GPU{MigEnabled: enabled[i]}, nil
		}
		if err := node.SetMigMode(i, enabled[i]); err != nil {
			return next, places, fmt.Errorf("GPU %d: error setting MIG mode: %v", i, err)
		}
	}
	for _, e := range slice {
		for i := range next {
			if !matches(&e, i) {
				continue
			}
			switch {
			case e.MigEnabled && !enabled[i]:
				return next, places, fmt.Errorf("GPU %d: unable to apply MIG config with MIG mode disabled", i)
			case !e.MigEnabled && enabled[i]:
				return next, places, fmt.Errorf("GPU %d: MIG mode is currently enabled, but the configuration specifies it should be disabled", i)
			case !e.MigEnabled:
				continue
			}
			if e.MigDevices.Equals(next[i].MigDevices) {
				continue
			}
			if pods := busy.OnGPU(i); len(pods) > 0 {
				places[i] = destroyUntilBusy(i, places[i], busy)
				next[i] = nvconf.GPU{MigEnabled: true, MigDevices: nvmig.Counts(places[i])}
				return next, places, fmt.Errorf("GPU %d (%s): error destroying MIG devices: In use by another client (GPU pods running on it: %s)",
					i, model.Product, strings.Join(pods, ", "))
			}
			res, err := node.SetMigConfig(i, e.MigDevices)
			next[i] = nvconf.GPU{MigEnabled: true}
			places[i] = res.Placements
			if len(res.Placements) > 0 {
				next[i].MigDevices = nvmig.Counts(res.Placements)
			}
			if err != nil {
				msg := fmt.Sprintf("GPU %d (%s): error setting MIGConfig: %v", i, model.Product, err)
				if res.LastError != "" {
					msg += fmt.Sprintf(" (%d orderings of %s tried; the last: %s)", res.FailedOrderings, devicesString(e.MigDevices), res.LastError)
				}
				return next, places, fmt.Errorf("%s", msg)
			}
		}
	}
	return next, places, nil
}

func devicesString(d map[string]int) string {
	var parts []string
	for _, p := range sortedKeys(d) {
		if d[p] > 0 {
			parts = append(parts, fmt.Sprintf("%dx%s", d[p], p))
		}
	}
	return strings.Join(parts, " + ")
}

func sortedKeys(m map[string]int) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	return keys
}

// modeChangeOnBusyNode refuses a MIG mode change while any GPU pod runs on
// the node: the change resets the GPU (with WITH_REBOOT the MIG manager
// reboots the node), which a running process prevents or would lose.
func modeChangeOnBusyNode(cur Geometry, enabled []bool, busy Busy) error {
	if busy.Empty() {
		return nil
	}
	for i := range enabled {
		if i < len(cur) && cur[i].MigEnabled != enabled[i] {
			return fmt.Errorf("GPU %d: error setting MIG mode: In use by another client (a MIG mode change resets the GPUs; GPU pods running on the node: %s)",
				i, strings.Join(busy.Pods(), ", "))
		}
	}
	return nil
}

// destroyUntilBusy is mig-parted clearing GPU i before creating its new
// devices: it destroys the instances in placement order and stops at the
// first one a pod uses. Returns what is left. Without placements (or with a
// pod whose devices are unknown) nothing is destroyed.
func destroyUntilBusy(i int, current []nvmig.Placement, busy Busy) []nvmig.Placement {
	if len(busy.Anywhere) > 0 {
		return current
	}
	ps := append([]nvmig.Placement(nil), current...)
	sort.Slice(ps, func(a, b int) bool { return ps[a].Start < ps[b].Start })
	for k, p := range ps {
		if len(busy.holders(fmt.Sprintf("%d/%s@%d", i, p.Profile, p.Start))) > 0 {
			return ps[k:]
		}
	}
	return nil
}
