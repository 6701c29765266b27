package sim

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"sort"
	"strconv"
	"strings"

	resourcev1 "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/api/resource"

	"gpusharing.io/tests/nvidia/internal/nvmig"
)

// The kubelet plugin of NVIDIA's DRA driver (sigs.k8s.io/dra-driver-nvidia-gpu
// v0.5.0, cmd/gpu-kubelet-plugin) on a simulated node: the ResourceSlice it
// publishes for the node's GPUs. Its device-building code is in package main
// of the driver (not importable), so this mirrors what it publishes: one pool
// named after the node; a GPU without MIG as `gpu-<minor>`, a GPU with MIG
// as its instances `gpu-<minor>-mig-<profile without dots>-<GI profile
// ID>-<placement start>` (the full GPU is not published then); the same
// attribute and capacity names; and, with consumable shares, multiple
// allocations and the `shares`/`memory` request policies.
const (
	// DRADriver is the driver's name (ResourceSlice spec.driver, DeviceClass CEL).
	DRADriver = "gpu.nvidia.com"
	// LabelDeployDRADriver is the GPU Operator's per-node switch of the DRA
	// driver's kubelet plugin; the standalone chart's kubeletPlugin.nodeSelector
	// is set to it for a node-by-node migration.
	LabelDeployDRADriver = "nvidia.com/gpu.deploy.dra-driver"
	// AnnDRASlice: the hash of the devices last published for the node
	// (absent: none published).
	AnnDRASlice = AnnPrefix + "dra-slice"

	// The simulated NVIDIA driver, as NVML would report it.
	draDriverVersion     = "580.95.5"
	draCudaDriverVersion = "13.0.0"
)

// DRAPluginDeployed reports whether the DRA driver's kubelet plugin runs on
// the node.
func DRAPluginDeployed(n *Node) bool {
	return n.Labels[LabelDeployDRADriver] == "true"
}

// ValidConsumableShares checks the driver's --consumable-shares value as the
// plugin does at start: disabled, memory, unlimited or a positive integer.
func ValidConsumableShares(s string) error {
	switch strings.TrimSpace(s) {
	case "", "disabled", "memory", "unlimited":
		return nil
	}
	if n, err := strconv.Atoi(strings.TrimSpace(s)); err == nil && n > 0 {
		return nil
	}
	return fmt.Errorf("invalid --consumable-shares %q: want disabled, memory, unlimited or a positive integer", s)
}

// DRASliceName is the simulator's name of the node's ResourceSlice (the real
// helper uses generateName; match slices by spec.driver and spec.pool).
func DRASliceName(node string) string {
	return DRADriver + "-" + node
}

// DRADevices lists what the plugin publishes for the node's GPUs as NVML
// shows them now (geo, places), with the driver's --consumable-shares value.
func DRADevices(node string, hw Hardware, geo Geometry, places Placements, shares string) ([]resourcev1.Device, error) {
	if err := ValidConsumableShares(shares); err != nil {
		return nil, err
	}
	model := nvmig.ModelFor(hw.Product, hw.MemoryMiB)
	facts := nvmig.Facts{
		Name:              strings.ReplaceAll(hw.Product, "-", " "),
		Brand:             "Nvidia",
		Architecture:      "Unknown",
		ComputeCapability: hw.ComputeCapability,
		MemoryBytes:       uint64(hw.MemoryMiB) << 20,
	}
	if model != nil {
		facts = model.Facts()
		if hw.MemoryMiB > 0 {
			// NVML's total memory as the node reports it (GFD's
			// nvidia.com/gpu.memory), not the mock's nominal size.
			facts.MemoryBytes = uint64(hw.MemoryMiB) << 20
		}
	}
	if facts.ComputeCapability == "" {
		facts.ComputeCapability = "8.0"
	}
	var out []resourcev1.Device
	for i := 0; i < hw.Count; i++ {
		uuid := fakeUUID("GPU", node, strconv.Itoa(i))
		if i >= len(geo) || !geo[i].MigEnabled {
			d := resourcev1.Device{
				Name:       fmt.Sprintf("gpu-%d", i),
				Attributes: commonAttributes(facts, i),
				Capacity: map[resourcev1.QualifiedName]resourcev1.DeviceCapacity{
					"memory": {Value: *resource.NewQuantity(int64(facts.MemoryBytes), resource.BinarySI)},
				},
			}
			d.Attributes["type"] = str("gpu")
			d.Attributes["uuid"] = str(uuid)
			applyShares(&d, shares)
			out = append(out, d)
			continue
		}
		if model == nil {
			return nil, fmt.Errorf("GPU %d has MIG on but %s has no go-nvml MIG data: the simulator cannot name its instances", i, hw.Product)
		}
		var ps []nvmig.Placement
		if i < len(places) {
			ps = append(ps, places[i]...)
		}
		sort.Slice(ps, func(a, b int) bool { return ps[a].Start < ps[b].Start })
		for _, p := range ps {
			prof, ok := model.Profile(p.Profile)
			info, ok2 := model.ProfileInfo(p.Profile)
			if !ok || !ok2 {
				return nil, fmt.Errorf("GPU %d: profile %s unknown to %s", i, p.Profile, model)
			}
			d := resourcev1.Device{
				Name:       fmt.Sprintf("gpu-%d-mig-%s-%d-%d", i, deviceNamePart(p.Profile), prof.ID, p.Start),
				Attributes: commonAttributes(facts, i),
				Capacity: map[resourcev1.QualifiedName]resourcev1.DeviceCapacity{
					"multiprocessors": intCapacity(int64(info.MultiprocessorCount)),
					"copyEngines":     intCapacity(int64(info.CopyEngineCount)),
					"decoders":        intCapacity(int64(info.DecoderCount)),
					"encoders":        intCapacity(int64(info.EncoderCount)),
					"jpegEngines":     intCapacity(int64(info.JpegCount)),
					"ofaEngines":      intCapacity(int64(info.OfaCount)),
					"memory":          {Value: *resource.NewQuantity(int64(info.MemorySizeMB)<<20, resource.BinarySI)},
				},
			}
			for s := p.Start; s < p.Start+p.Size; s++ {
				d.Capacity[resourcev1.QualifiedName(fmt.Sprintf("memorySlice%d", s))] = intCapacity(1)
			}
			d.Attributes["type"] = str("mig")
			d.Attributes["uuid"] = str(fakeUUID("MIG", node, strconv.Itoa(i), p.String()))
			d.Attributes["parentUUID"] = str(uuid)
			d.Attributes["profile"] = str(p.Profile)
			applyShares(&d, shares)
			out = append(out, d)
		}
	}
	return out, nil
}

// DRASliceHash identifies a set of published devices (AnnDRASlice).
func DRASliceHash(devices []resourcev1.Device) string {
	b, _ := json.Marshal(devices)
	sum := sha256.Sum256(b)
	return hex.EncodeToString(sum[:8])
}

// PlanDRASlice says what the node's kubelet plugin does now: publish the
// devices NVML shows when it starts, or withdraw its slice (it published
// one and no longer runs there). A running plugin keeps what it published:
// the driver enumerates GPUs and MIG devices once, at start (nvlib.go:
// "gpuInfo.migEnabled is captured once during enumeration and is never
// re-read"), so a MIG layout changed under it shows only after a restart.
func PlanDRASlice(n *Node, devices []resourcev1.Device, p *Patch) (publish bool, withdraw bool) {
	last, published := n.Annotations[AnnDRASlice]
	if !DRAPluginDeployed(n) {
		if published {
			p.delAnn(n, AnnDRASlice)
			p.logf("DRA kubelet plugin not deployed (%s!=true): its ResourceSlice is withdrawn", LabelDeployDRADriver)
		}
		return false, published
	}
	h := DRASliceHash(devices)
	if last == h {
		return false, false
	}
	if published {
		p.logf("DRA kubelet plugin keeps publishing the devices it found at start (NVML now shows others)")
		return false, false
	}
	p.setAnn(n, AnnDRASlice, h)
	var names []string
	for i, d := range devices {
		if i == 4 {
			names = append(names, "...")
			break
		}
		names = append(names, d.Name)
	}
	p.logf("DRA kubelet plugin publishes %d device(s): %s", len(devices), strings.Join(names, ","))
	return true, false
}

func commonAttributes(f nvmig.Facts, i int) map[resourcev1.QualifiedName]resourcev1.DeviceAttribute {
	return map[resourcev1.QualifiedName]resourcev1.DeviceAttribute{
		"productName":                     str(f.Name),
		"brand":                           str(f.Brand),
		"architecture":                    str(f.Architecture),
		"cudaComputeCapability":           version(f.ComputeCapability + ".0"),
		"driverVersion":                   version(draDriverVersion),
		"cudaDriverVersion":               version(draCudaDriverVersion),
		"resource.kubernetes.io/pciBusID": str(fmt.Sprintf("0000:%02x:00.0", 0x10+i)),
	}
}

// applyShares is the driver's consumable-shares treatment of a device with
// a memory capacity: multiple allocations; memory requestable in 1Mi steps
// (default 0, or all of it under "memory"); under an integer N a `shares`
// capacity of N with a default request of 1.
func applyShares(d *resourcev1.Device, shares string) {
	mode := strings.TrimSpace(shares)
	if mode == "" || mode == "disabled" {
		return
	}
	d.AllowMultipleAllocations = ptrTo(true)
	mem, ok := d.Capacity["memory"]
	if !ok {
		return
	}
	step := resource.MustParse("1Mi")
	maxMem := resource.NewQuantity(mem.Value.Value()/step.Value()*step.Value(), resource.BinarySI)
	mem.Value = maxMem.DeepCopy()
	zero := resource.MustParse("0")
	policy := func(def, min resource.Quantity) *resourcev1.CapacityRequestPolicy {
		return &resourcev1.CapacityRequestPolicy{
			Default: &def,
			ValidRange: &resourcev1.CapacityRequestPolicyRange{
				Min: &min, Max: ptrTo(maxMem.DeepCopy()), Step: ptrTo(step.DeepCopy()),
			},
		}
	}
	switch mode {
	case "unlimited":
		mem.RequestPolicy = policy(zero.DeepCopy(), zero.DeepCopy())
	case "memory":
		mem.RequestPolicy = policy(maxMem.DeepCopy(), step.DeepCopy())
	default:
		n, _ := strconv.Atoi(mode)
		mem.RequestPolicy = policy(zero.DeepCopy(), zero.DeepCopy())
		total := *resource.NewQuantity(int64(n), resource.DecimalSI)
		one := *resource.NewQuantity(1, resource.DecimalSI)
		d.Capacity["shares"] = resourcev1.DeviceCapacity{
			Value: total,
			RequestPolicy: &resourcev1.CapacityRequestPolicy{
				Default:    ptrTo(one.DeepCopy()),
				ValidRange: &resourcev1.CapacityRequestPolicyRange{Min: ptrTo(one.DeepCopy()), Max: ptrTo(total.DeepCopy()), Step: ptrTo(one.DeepCopy())},
			},
		}
	}
	d.Capacity["memory"] = mem
}

// deviceNamePart is the driver's spelling of a MIG profile inside a device
// name: lower case, dots dropped, any other character outside [a-z0-9-]
// turned into '-' (so 1g.10gb+me is 1g10gb-me), trimmed of '-'.
func deviceNamePart(profile string) string {
	var b strings.Builder
	for _, r := range strings.ToLower(strings.ReplaceAll(profile, ".", "")) {
		if r >= 'a' && r <= 'z' || r >= '0' && r <= '9' || r == '-' {
			b.WriteRune(r)
		} else {
			b.WriteRune('-')
		}
	}
	return strings.Trim(b.String(), "-")
}

func fakeUUID(kind string, parts ...string) string {
	sum := sha256.Sum256([]byte(strings.Join(parts, "/")))
	h := hex.EncodeToString(sum[:16])
	return fmt.Sprintf("%s-%s-%s-%s-%s-%s", kind, h[0:8], h[8:12], h[12:16], h[16:20], h[20:32])
}

func str(s string) resourcev1.DeviceAttribute { return resourcev1.DeviceAttribute{StringValue: &s} }

func version(s string) resourcev1.DeviceAttribute {
	return resourcev1.DeviceAttribute{VersionValue: &s}
}

func intCapacity(v int64) resourcev1.DeviceCapacity {
	return resourcev1.DeviceCapacity{Value: *resource.NewQuantity(v, resource.DecimalSI)}
}

func ptrTo[T any](v T) *T { return &v }
