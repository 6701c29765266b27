package main

import (
	"encoding/json"
	"fmt"
	"reflect"
	"sort"
	"strconv"

	"k8s.io/apimachinery/pkg/api/resource"

	nvapi "sigs.k8s.io/dra-driver-nvidia-gpu/api/nvidia.com/resource/v1beta1"

	"gpusharing.io/tests/nvidia/internal/dra"
	"gpusharing.io/tests/nvidia/internal/policy"
	"gpusharing.io/tests/nvidia/internal/render"
)

const (
	labelGPUMemory    = "nvidia.com/gpu.memory" // MiB, from GPU Feature Discovery
	labelComputeMajor = "nvidia.com/gpu.compute.major"
	voltaMajor        = 7
)

// gatesOf reads spec.dra.driverFeatureGates.
func gatesOf(p *policy.Policy) dra.Gates {
	var g dra.Gates
	if p.Spec.DRA == nil {
		return g
	}
	m := p.Spec.DRA.DriverFeatureGates
	return dra.Gates{
		MPSSupport:          m["MPSSupport"],
		TimeSlicingSettings: m["TimeSlicingSettings"],
		DynamicMIG:          m["DynamicMIG"],
		ConsumableShares:    m["ConsumableShares"],
	}
}

// governedNodes: the --nodes input of the Nodes the render labelled for the
// policy (gpusharing.io/policy=<name>).
func (c *checker) governedNodes(name string) []*render.Object {
	input := map[string]*render.Object{}
	for _, n := range c.nodes {
		input[n.Metadata.Name] = n
	}
	var out []*render.Object
	for _, n := range c.out.Nodes {
		if n.Metadata.Labels[render.PolicyLabel] == name && input[n.Metadata.Name] != nil {
			out = append(out, input[n.Metadata.Name])
		}
	}
	return out
}

// checkDRAPolicy checks a DRA policy's status and ResourceClaimTemplates
// with NVIDIA's DRA driver API.
func (c *checker) checkDRAPolicy(p *policy.Policy) {
	name := p.Metadata.Name
	st := c.out.Policies[name]
	if st == nil {
		c.r.fail("policy %s: no GpuSharingPolicy status document", name)
		return
	}
	if key, has := render.Str(st.Status, "deviceConfigKey"); has {
		c.r.fail("policy %s: DRA policy with status.deviceConfigKey=%q", name, key)
	}
	for k := range c.out.DevicePlugin.Data {
		if m := render.KeyPattern.FindStringSubmatch(k); m != nil && m[1] == name {
			c.r.fail("policy %s: DRA policy has a device-plugin key %s", name, k)
		}
	}
	if ok, msg := render.Accepted(st); !ok {
		// Unlike a device-plugin key, a rendered ResourceClaimTemplate is
		// used as soon as it exists: check it all the same.
		c.r.note("policy %s not accepted by the operator: %s", name, msg)
		if len(c.templatesOf(name)) == 0 {
			return
		}
	}
	if p.Spec.DRA == nil {
		c.r.fail("policy %s: backend dra without spec.dra was accepted", name)
		return
	}
	var want []string
	for _, ns := range p.Spec.DRA.Namespaces {
		want = append(want, ns+"/"+p.TemplateName())
	}
	got, ok := render.Strings(st.Status, "templates")
	if !ok {
		c.r.fail("policy %s: no status.templates", name)
	} else if !reflect.DeepEqual(sorted(got), sorted(want)) {
		c.r.fail("policy %s: status.templates=%v, want %v", name, got, want)
	}
	byID := map[string]*render.Object{}
	for _, t := range c.out.ClaimTemplates {
		byID[render.TemplateID(t)] = t
	}
	for _, id := range want {
		t := byID[id]
		if t == nil {
			c.r.fail("policy %s: no ResourceClaimTemplate %s rendered", name, id)
			continue
		}
		if owner := t.Metadata.Labels[render.PolicyLabel]; owner != name {
			c.r.fail("ResourceClaimTemplate %s: label %s=%q, want %q", id, render.PolicyLabel, owner, name)
		}
		c.checkClaimTemplate(p, id, t)
	}
}

func (c *checker) templatesOf(name string) []*render.Object {
	var out []*render.Object
	for _, t := range c.out.ClaimTemplates {
		if t.Metadata.Labels[render.PolicyLabel] == name {
			out = append(out, t)
		}
	}
	return out
}

func sorted(xs []string) []string {
	out := append([]string(nil), xs...)
	sort.Strings(out)
	return out
}

func (c *checker) checkClaimTemplate(p *policy.Policy, id string, t *render.Object) {
	where := fmt.Sprintf("policy %s: ResourceClaimTemplate %s", p.Metadata.Name, id)
	tpl, err := dra.DecodeTemplate(t.Raw)
	if err != nil {
		c.r.fail("%s: %v", where, err)
		return
	}
	if tpl.APIVersion != render.ClaimTemplateAPI || tpl.Kind != render.ClaimTemplateKind {
		c.r.fail("%s: %s/%s", where, tpl.APIVersion, tpl.Kind)
	}
	devs := tpl.Spec.Spec.Devices
	if len(devs.Requests) != 1 {
		c.r.fail("%s: %d device requests, want 1", where, len(devs.Requests))
		return
	}
	req := devs.Requests[0]
	if req.Exactly == nil {
		c.r.fail("%s: request %q has no 'exactly'", where, req.Name)
		return
	}
	if req.Exactly.DeviceClassName != dra.DeviceClassName {
		c.r.fail("%s: deviceClassName=%q, want %q", where, req.Exactly.DeviceClassName, dra.DeviceClassName)
	}
	// A claim from this template gets this many GPUs (default: one).
	devices := 1
	if req.Exactly.Count > 0 {
		devices = int(req.Exactly.Count)
	}
	if p.Spec.Strategy == policy.Exclusive || p.Spec.Strategy == "" {
		if len(devs.Config) != 0 {
			c.r.fail("%s: exclusive policy with device config %v", where, devs.Config)
		}
		return
	}
	if len(devs.Config) != 1 {
		c.r.fail("%s: %d device configs, want 1", where, len(devs.Config))
		return
	}
	cfg := devs.Config[0]
	if !reflect.DeepEqual(cfg.Requests, []string{req.Name}) {
		c.r.fail("%s: config requests %v, want [%s]", where, cfg.Requests, req.Name)
	}
	if cfg.Opaque == nil {
		c.r.fail("%s: config without opaque parameters", where)
		return
	}
	if cfg.Opaque.Driver != dra.DriverName {
		c.r.fail("%s: opaque driver %q, want %q", where, cfg.Opaque.Driver, dra.DriverName)
	}
	raw := cfg.Opaque.Parameters.Raw
	decoded, err := dra.DecodeGpuConfig(raw)
	if err != nil {
		c.r.fail("%s: %v", where, err)
		return
	}
	if decoded.APIVersion != dra.GpuConfigAPI || decoded.Kind != nvapi.GpuConfigKind {
		c.r.fail("%s: parameters are %s %s, want %s GpuConfig", where, decoded.APIVersion, decoded.Kind, dra.GpuConfigAPI)
	}
	gates := gatesOf(p)
	var prepared *dra.Prepared
	uuids := dra.FakeUUIDs(devices)
	err = dra.WithGates(gates, func() error {
		var err error
		prepared, err = dra.Prepare(decoded, uuids)
		return err
	})
	if err != nil {
		c.r.fail("%s: the DRA driver (feature gates %+v) would fail to prepare a claim: %v", where, gates, err)
		return
	}
	sh := decoded.Sharing // as rendered, before Normalize
	if sh == nil {
		c.r.fail("%s: GpuConfig without sharing", where)
		return
	}
	switch p.Spec.Strategy {
	case policy.TimeSlicing:
		c.checkTimeSlicing(p, where, sh)
	case policy.MPS:
		c.checkMPS(p, where, sh, prepared, uuids)
	default:
		c.r.fail("%s: strategy %q cannot be rendered for DRA", where, p.Spec.Strategy)
	}
}

func (c *checker) checkTimeSlicing(p *policy.Policy, where string, sh *nvapi.GpuSharing) {
	if sh.Strategy != nvapi.TimeSlicingStrategy {
		c.r.fail("%s: sharing.strategy=%q, want %q", where, sh.Strategy, nvapi.TimeSlicingStrategy)
	}
	if sh.MpsConfig != nil {
		c.r.fail("%s: mpsConfig on a TimeSlicing config", where)
	}
	want := nvapi.TimeSliceInterval(p.Spec.DRA.TimeSlicingInterval)
	if want == "" {
		want = nvapi.DefaultTimeSlice
	}
	// Always explicit: an empty timeSlicingConfig makes the driver panic
	// (TimeSlicingConfig.Validate dereferences a nil interval).
	if sh.TimeSlicingConfig == nil || sh.TimeSlicingConfig.Interval == nil {
		c.r.fail("%s: timeSlicingConfig.interval missing, want %s", where, want)
		return
	}
	if got := *sh.TimeSlicingConfig.Interval; got != want {
		c.r.fail("%s: timeSlicingConfig.interval=%q, want %q", where, got, want)
	}
}

func (c *checker) checkMPS(p *policy.Policy, where string, sh *nvapi.GpuSharing, prepared *dra.Prepared, uuids []string) {
	if sh.Strategy != nvapi.MpsStrategy {
		c.r.fail("%s: sharing.strategy=%q, want %q", where, sh.Strategy, nvapi.MpsStrategy)
	}
	if sh.TimeSlicingConfig != nil {
		c.r.fail("%s: timeSlicingConfig on an MPS config", where)
	}
	m := sh.MpsConfig
	if m == nil {
		c.r.fail("%s: no mpsConfig", where)
		return
	}
	spec := p.Spec.DRA.MPS
	if spec == nil {
		spec = &policy.DRAMPS{}
	}
	replicas := p.Replicas()
	if replicas < 1 {
		c.r.fail("%s: policy has no spec.mps.replicas", where)
		return
	}
	// Threads: explicit, else 100 / replicas.
	wantThreads := 100 / replicas
	if spec.DefaultActiveThreadPercentage != nil {
		wantThreads = *spec.DefaultActiveThreadPercentage
	}
	if m.DefaultActiveThreadPercentage == nil || *m.DefaultActiveThreadPercentage != wantThreads {
		c.r.fail("%s: defaultActiveThreadPercentage=%v, want %d", where, ptrStr(m.DefaultActiveThreadPercentage), wantThreads)
	}
	// Pinned memory: explicit, else the smallest GPU memory of the governed
	// nodes / replicas (MiB), else none.
	var wantMem *resource.Quantity
	if spec.DefaultPinnedDeviceMemoryLimit != "" {
		q, err := resource.ParseQuantity(spec.DefaultPinnedDeviceMemoryLimit)
		if err != nil {
			c.r.fail("%s: policy's defaultPinnedDeviceMemoryLimit %q is no Quantity: %v", where, spec.DefaultPinnedDeviceMemoryLimit, err)
			return
		}
		wantMem = &q
	} else if minMem := c.minGPUMemory(p.Metadata.Name); minMem > 0 {
		q := resource.MustParse(strconv.FormatInt(minMem/int64(replicas), 10) + "Mi")
		wantMem = &q
	}
	switch {
	case wantMem == nil && m.DefaultPinnedDeviceMemoryLimit != nil:
		c.r.fail("%s: defaultPinnedDeviceMemoryLimit=%s, want none (no node memory known)", where, m.DefaultPinnedDeviceMemoryLimit.String())
	case wantMem != nil && m.DefaultPinnedDeviceMemoryLimit == nil:
		c.r.fail("%s: no defaultPinnedDeviceMemoryLimit, want %s", where, wantMem.String())
	case wantMem != nil && m.DefaultPinnedDeviceMemoryLimit.Cmp(*wantMem) != 0:
		c.r.fail("%s: defaultPinnedDeviceMemoryLimit=%s, want %s", where, m.DefaultPinnedDeviceMemoryLimit.String(), wantMem.String())
	}
	// Per-device limits.
	wantPer := map[string]resource.Quantity{}
	for k, v := range spec.PerDevicePinnedMemoryLimits {
		q, err := resource.ParseQuantity(v)
		if err != nil {
			c.r.fail("%s: policy's perDevicePinnedMemoryLimits[%s]=%q is no Quantity: %v", where, k, v, err)
			return
		}
		wantPer[k] = q
	}
	if len(m.DefaultPerDevicePinnedMemoryLimit) != len(wantPer) {
		c.r.fail("%s: defaultPerDevicePinnedMemoryLimit has %d entries, want %d", where, len(m.DefaultPerDevicePinnedMemoryLimit), len(wantPer))
	}
	for k, w := range wantPer {
		g, ok := m.DefaultPerDevicePinnedMemoryLimit[k]
		if !ok || g.Cmp(w) != 0 {
			c.r.fail("%s: defaultPerDevicePinnedMemoryLimit[%s]=%s, want %s", where, k, g.String(), w.String())
		}
	}
	// What the driver hands the MPS control daemon for the claim's GPU(s).
	for i, u := range uuids {
		lim := wantMem
		for k, q := range wantPer {
			if k == strconv.Itoa(i) || k == u {
				q := q
				lim = &q
			}
		}
		got, has := prepared.PinnedLimits[u]
		switch {
		case lim == nil && has:
			c.r.fail("%s: driver sets pinned memory %s on device %d, want none", where, got, i)
		case lim != nil && got != fmt.Sprintf("%dM", dra.MiB(*lim)):
			c.r.fail("%s: driver sets pinned memory %q on device %d, want %dM", where, got, i, dra.MiB(*lim))
		}
	}
	// multiUser: only when asked; needs Volta or newer on every node.
	wantMU := spec.MultiUser != nil && *spec.MultiUser
	if gotMU := m.MultiUser != nil && *m.MultiUser; gotMU != wantMU {
		c.r.fail("%s: multiUser=%v, want %v", where, gotMU, wantMU)
	}
	if wantMU {
		for _, n := range c.governedNodes(p.Metadata.Name) {
			if major, err := strconv.Atoi(n.Metadata.Labels[labelComputeMajor]); err == nil && major < voltaMajor {
				c.r.fail("%s: multiUser on Node %s (compute capability %d.x): the driver fails 'multiuser mode was requested but is not supported'", where, n.Metadata.Name, major)
			}
		}
	}
	if b, err := json.Marshal(prepared.Config.Sharing); err == nil {
		c.r.note("%s: driver prepares %s, pinned memory per device %v", where, b, prepared.PinnedLimits)
	}
}

// minGPUMemory: the smallest nvidia.com/gpu.memory (MiB) among the nodes the
// policy governs, 0 when none is known.
func (c *checker) minGPUMemory(name string) int64 {
	var min int64
	for _, n := range c.governedNodes(name) {
		v, err := strconv.ParseInt(n.Metadata.Labels[labelGPUMemory], 10, 64)
		if err != nil || v <= 0 {
			continue
		}
		if min == 0 || v < min {
			min = v
		}
	}
	return min
}

func ptrStr[T any](p *T) string {
	if p == nil {
		return "<unset>"
	}
	return fmt.Sprint(*p)
}
