package main

import (
	"fmt"
	"reflect"
	"sort"
	"strings"

	spec "github.com/NVIDIA/k8s-device-plugin/api/config/v1"
	mpv1 "github.com/NVIDIA/mig-parted/api/spec/v1"
	vgpuv1 "github.com/NVIDIA/vgpu-device-manager/api/spec/v1"
	"sigs.k8s.io/yaml"

	"gpusharing.io/tests/nvidia/internal/nvconf"
	"gpusharing.io/tests/nvidia/internal/policy"
	"gpusharing.io/tests/nvidia/internal/render"
	"gpusharing.io/tests/nvidia/internal/sim"
)

// report collects the problems found in one case.
type report struct {
	errs  []string
	notes []string
}

func (r *report) fail(format string, args ...any) {
	r.errs = append(r.errs, fmt.Sprintf(format, args...))
}
func (r *report) note(format string, args ...any) {
	r.notes = append(r.notes, fmt.Sprintf(format, args...))
}

// checker validates one render output against the policies it was made from.
type checker struct {
	out      *render.Output
	policies []policy.Policy
	defaults *mpv1.Spec // NVIDIA's default mig-parted config, optional
	// vgpuDefaults: NVIDIA's default vGPU-devices config, optional.
	vgpuDefaults *vgpuv1.Spec
	r            *report
	mig          *mpv1.Spec // the config the MIG manager would use
	migSource    string
	cpMigMode    string           // ClusterPolicy spec.mig.strategy from the patch ("" = not patched)
	nodes        []*render.Object // the --nodes input, if any
}

// The JSON keys NVIDIA's config structs know. NVIDIA ignores unknown keys
// silently, so a typo would silently disable sharing: the conformance check
// rejects them.
var (
	dpTopKeys      = jsonKeys(reflect.TypeOf(spec.Config{}))
	dpFlagKeys     = jsonKeys(reflect.TypeOf(spec.Flags{}))
	dpSharingKeys  = jsonKeys(reflect.TypeOf(spec.Sharing{}))
	dpReplicasKeys = jsonKeys(reflect.TypeOf(spec.ReplicatedResources{}))
	dpResourceKeys = jsonKeys(reflect.TypeOf(spec.ReplicatedResource{}))
)

// jsonKeys lists the JSON field names of a struct type (embedded structs
// included), as encoding/json sees them.
func jsonKeys(t reflect.Type) map[string]bool {
	keys := map[string]bool{}
	for i := 0; i < t.NumField(); i++ {
		f := t.Field(i)
		name, _, _ := strings.Cut(f.Tag.Get("json"), ",")
		if f.Anonymous && name == "" {
			for k := range jsonKeys(f.Type) {
				keys[k] = true
			}
			continue
		}
		if name == "-" || !f.IsExported() {
			continue
		}
		if name == "" {
			name = f.Name
		}
		keys[name] = true
	}
	return keys
}

func (c *checker) run() {
	c.cpMigMode, _ = render.Str(c.out.ClusterPolicy.Spec, "mig", "strategy")
	c.checkMigParted()
	c.checkVgpuDevices()
	c.checkClusterPolicy()
	c.checkDeviceConfigs()
	for i := range c.policies {
		if c.policies[i].IsDRA() {
			c.checkDRAPolicy(&c.policies[i])
		} else if c.policies[i].IsVM() {
			c.checkVMPolicy(&c.policies[i])
		} else {
			c.checkPolicy(&c.policies[i])
		}
	}
	c.checkNodes()
	for name := range c.out.Policies {
		if !c.hasPolicy(name) {
			c.r.fail("render emitted status for unknown policy %q", name)
		}
	}
}

func (c *checker) hasPolicy(name string) bool {
	for _, p := range c.policies {
		if p.Metadata.Name == name {
			return true
		}
	}
	return false
}

// accepted: the render's status does not reject the policy (rejected
// policies are not applied to any node, so their configs never load).
func (c *checker) accepted(name string) bool {
	st := c.out.Policies[name]
	if st == nil {
		return true
	}
	ok, _ := render.Accepted(st)
	return ok
}

// keyOwner is the policy whose device-plugin key k is ("" for default).
func (c *checker) keyOwner(k string) string {
	for name, st := range c.out.Policies {
		if key, _ := render.Str(st.Status, "deviceConfigKey"); key == k {
			return name
		}
	}
	return ""
}

func (c *checker) anyMIG() bool {
	for _, p := range c.policies {
		if p.Spec.Strategy == policy.MIG {
			return true
		}
	}
	return false
}

// checkMigParted parses the mig-parted config the MIG manager would use:
// the rendered ConfigMap when the ClusterPolicy patch points the MIG manager
// at it, else the GPU Operator's default config (--mig-parted-config).
func (c *checker) checkMigParted() {
	if c.out.MigParted == nil {
		for _, p := range c.policies {
			if p.Spec.Strategy == policy.MIG && p.Spec.MIG != nil && len(p.Spec.MIG.CustomLayout) > 0 {
				c.r.fail("policy %s has a custom MIG layout but no %s ConfigMap was rendered", p.Metadata.Name, render.MigPartedConfigMap)
			}
		}
		if c.anyMIG() {
			if c.defaults != nil {
				c.mig, c.migSource = c.defaults, "the GPU Operator's default mig-parted config"
			} else {
				c.r.note("named MIG layouts not checked: the MIG manager would use the GPU Operator's default config (pass --mig-parted-config)")
			}
		}
		return
	}
	data := c.out.MigParted.Data[render.MigPartedKey]
	s, err := nvconf.LoadMigPartedConfig([]byte(data))
	if err != nil {
		c.r.fail("mig-parted rejects %s/%s: %v", render.MigPartedConfigMap, render.MigPartedKey, err)
		return
	}
	c.mig, c.migSource = s, render.MigPartedConfigMap
	if _, err := nvconf.SelectMigConfig(s, "all-disabled"); err != nil {
		c.r.fail("mig-parted config: %v (all-disabled must always be present)", err)
	}
	if c.defaults != nil {
		for name, want := range c.defaults.MigConfigs {
			got, ok := s.MigConfigs[name]
			if !ok {
				continue
			}
			if !sameLayout(got, want) {
				c.r.fail("mig-parted layout %q differs from NVIDIA's default layout of that name", name)
			}
		}
	}
}

func sameLayout(a, b mpv1.MigConfigSpecSlice) bool {
	norm := func(s mpv1.MigConfigSpecSlice) string {
		var parts []string
		for _, e := range s {
			devs := map[string]int{}
			for k, v := range e.MigDevices {
				if v != 0 {
					devs[k] = v
				}
			}
			b, _ := yaml.Marshal(map[string]any{"f": e.DeviceFilter, "d": nvconf.DevicesOf(e), "e": e.MigEnabled, "m": devs})
			parts = append(parts, string(b))
		}
		return strings.Join(parts, "|")
	}
	return norm(a) == norm(b)
}

func (c *checker) checkClusterPolicy() {
	sp := c.out.ClusterPolicy.Spec
	if name, _ := render.Str(sp, "devicePlugin", "config", "name"); name != render.DevicePluginConfigMap {
		c.r.fail("ClusterPolicy spec.devicePlugin.config.name=%q, want %q", name, render.DevicePluginConfigMap)
	}
	def, ok := render.Str(sp, "devicePlugin", "config", "default")
	if !ok {
		c.r.fail("ClusterPolicy spec.devicePlugin.config.default not set (the GPU Operator then falls back to an empty config, FALLBACK_STRATEGIES=empty)")
	} else if _, exists := c.out.DevicePlugin.Data[def]; !exists {
		c.r.fail("ClusterPolicy spec.devicePlugin.config.default=%q is not a key of %s: every unlabelled node's config-manager would exit with 'specified config %s does not exist'", def, render.DevicePluginConfigMap, def)
	}
	migName, hasMigName := render.Str(sp, "migManager", "config", "name")
	switch {
	case c.out.MigParted != nil && migName != render.MigPartedConfigMap:
		c.r.fail("ClusterPolicy spec.migManager.config.name=%q, want %q", migName, render.MigPartedConfigMap)
	case c.out.MigParted == nil && hasMigName && migName != "":
		c.r.fail("ClusterPolicy spec.migManager.config.name=%q but no mig-parted ConfigMap was rendered", migName)
	}
	strategies := map[string][]string{}
	for _, p := range c.policies {
		if p.Spec.Strategy == policy.MIG && p.Spec.MIG != nil && c.accepted(p.Metadata.Name) {
			s := p.Spec.MIG.MigStrategy
			strategies[s] = append(strategies[s], p.Metadata.Name)
		}
	}
	if len(strategies) > 0 {
		for s, names := range strategies {
			if s != c.cpMigMode {
				c.r.fail("ClusterPolicy spec.mig.strategy=%q, but MIG policies %v ask for migStrategy %q: the GPU Operator passes spec.mig.strategy as MIG_STRATEGY to the device plugin and GFD, which overrides flags.migStrategy of the config", c.cpMigMode, names, s)
			}
		}
	}
	switch c.cpMigMode {
	case "", "none", "single", "mixed":
	default:
		c.r.fail("ClusterPolicy spec.mig.strategy=%q is not none|single|mixed", c.cpMigMode)
	}
}

func (c *checker) checkDeviceConfigs() {
	data := c.out.DevicePlugin.Data
	if _, ok := data[render.DefaultKey]; !ok {
		c.r.fail("%s has no key %q", render.DevicePluginConfigMap, render.DefaultKey)
	}
	keys := make([]string, 0, len(data))
	for k := range data {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		v := data[k]
		c.checkRawKeys(k, v)
		res, err := nvconf.LoadDevicePluginConfig([]byte(v), nvconf.DevicePluginOptions{})
		if err != nil {
			c.r.fail("device plugin rejects data[%s]: %v", k, err)
			continue
		}
		if owner := c.keyOwner(k); c.cpMigMode != "" && c.accepted(owner) {
			if _, err := nvconf.LoadDevicePluginConfig([]byte(v), nvconf.DevicePluginOptions{MigStrategyOverride: c.cpMigMode}); err != nil {
				c.r.fail("device plugin rejects data[%s] when run by the GPU Operator with MIG_STRATEGY=%s (ClusterPolicy spec.mig.strategy): %v", k, c.cpMigMode, err)
			}
		}
		if k == render.DefaultKey {
			if res.Loaded.Sharing.SharingStrategy() != spec.SharingStrategyNone || res.Loaded.Sharing.MPS != nil || len(res.Loaded.Sharing.TimeSlicing.Resources) > 0 {
				c.r.fail("data[default] must not share GPUs")
			}
			continue
		}
		m := render.KeyPattern.FindStringSubmatch(k)
		if m == nil || !c.hasPolicy(m[1]) {
			c.r.fail("%s key %q is neither %q nor <policy-name>-<8 hex>", render.DevicePluginConfigMap, k, render.DefaultKey)
		}
	}
}

// checkRawKeys rejects keys NVIDIA's parser would silently ignore.
func (c *checker) checkRawKeys(key, v string) {
	var raw map[string]any
	if err := yaml.Unmarshal([]byte(v), &raw); err != nil {
		c.r.fail("data[%s] is not YAML: %v", key, err)
		return
	}
	if raw["version"] != "v1" {
		c.r.fail("data[%s]: version=%v, want v1", key, raw["version"])
	}
	unknown := func(where string, m map[string]any, allowed map[string]bool) {
		for k := range m {
			if !allowed[k] {
				c.r.fail("data[%s]: unknown key %s%s (NVIDIA ignores it silently)", key, where, k)
			}
		}
	}
	unknown("", raw, dpTopKeys)
	if f, ok := raw["flags"].(map[string]any); ok {
		unknown("flags.", f, dpFlagKeys)
	} else {
		c.r.fail("data[%s]: no flags.migStrategy", key)
	}
	if sh, ok := raw["sharing"].(map[string]any); ok {
		unknown("sharing.", sh, dpSharingKeys)
		for kind, body := range sh {
			rr, ok := body.(map[string]any)
			if !ok {
				continue
			}
			unknown("sharing."+kind+".", rr, dpReplicasKeys)
			list, _ := rr["resources"].([]any)
			for i, item := range list {
				if m, ok := item.(map[string]any); ok {
					unknown(fmt.Sprintf("sharing.%s.resources[%d].", kind, i), m, dpResourceKeys)
				}
			}
		}
		if len(sh) > 1 {
			c.r.fail("data[%s]: sharing has both timeSlicing and mps (NVIDIA silently uses mps)", key)
		}
	}
}

func (c *checker) profilesOf(layout string) ([]string, error) {
	if c.mig == nil {
		return nil, fmt.Errorf("layout %q unknown: no mig-parted config rendered and no --mig-parted-config given", layout)
	}
	slice, err := nvconf.SelectMigConfig(c.mig, layout)
	if err != nil {
		return nil, err
	}
	return nvconf.LayoutProfiles(slice), nil
}

func (c *checker) checkPolicy(p *policy.Policy) {
	name := p.Metadata.Name
	st := c.out.Policies[name]
	if st == nil {
		c.r.fail("policy %s: no GpuSharingPolicy status document", name)
		return
	}
	key, _ := render.Str(st.Status, "deviceConfigKey")
	m := render.KeyPattern.FindStringSubmatch(key)
	if m == nil || m[1] != name {
		c.r.fail("policy %s: status.deviceConfigKey=%q is not %s-<8 hex chars>", name, key, name)
	}
	value, ok := c.out.DevicePlugin.Data[key]
	if !ok {
		c.r.fail("policy %s: status.deviceConfigKey=%q is not a key of %s", name, key, render.DevicePluginConfigMap)
		return
	}
	res, err := nvconf.LoadDevicePluginConfig([]byte(value), nvconf.DevicePluginOptions{})
	if err != nil {
		return // already reported by checkDeviceConfigs
	}
	want, err := policy.ExpectDevicePlugin(p, c.profilesOf)
	if err != nil {
		c.r.fail("policy %s: cannot derive the expected config: %v", name, err)
		return
	}
	c.compareDP(name, key, res.Loaded, want)
	for _, w := range res.Warnings {
		c.r.note("policy %s: NVIDIA warns: %s", name, w)
	}
	if ok, msg := render.Accepted(st); !ok {
		c.r.note("policy %s not accepted by the operator: %s", name, msg)
		return
	}
	if p.Spec.Strategy == policy.MIG {
		c.checkMIGPolicy(p, st, res)
	}
}

func (c *checker) compareDP(name, key string, cfg *spec.Config, want *policy.ExpectedDP) {
	where := fmt.Sprintf("policy %s (data[%s])", name, key)
	if got := deref(cfg.Flags.MigStrategy); got != want.MigStrategy {
		c.r.fail("%s: flags.migStrategy=%q, want %q", where, got, want.MigStrategy)
	}
	var rr *spec.ReplicatedResources
	switch want.SharingKind {
	case "":
		if cfg.Sharing.MPS != nil || len(cfg.Sharing.TimeSlicing.Resources) > 0 {
			c.r.fail("%s: exclusive policy shares GPUs", where)
		}
		return
	case policy.TimeSlicing:
		if cfg.Sharing.MPS != nil {
			c.r.fail("%s: sharing.mps set, want time-slicing", where)
			return
		}
		rr = &cfg.Sharing.TimeSlicing
	case policy.MPS:
		if cfg.Sharing.MPS == nil {
			c.r.fail("%s: sharing.mps missing", where)
			return
		}
		if len(cfg.Sharing.TimeSlicing.Resources) > 0 {
			c.r.fail("%s: sharing.timeSlicing set beside mps", where)
		}
		rr = cfg.Sharing.MPS
	}
	if rr.RenameByDefault != want.RenameByDefault {
		c.r.fail("%s: renameByDefault=%v, want %v", where, rr.RenameByDefault, want.RenameByDefault)
	}
	if rr.FailRequestsGreaterThanOne != want.FailRequestsGreaterThanOne {
		c.r.fail("%s: failRequestsGreaterThanOne=%v, want %v", where, rr.FailRequestsGreaterThanOne, want.FailRequestsGreaterThanOne)
	}
	got := append([]spec.ReplicatedResource(nil), rr.Resources...)
	sort.SliceStable(got, func(i, j int) bool { return got[i].Name < got[j].Name })
	for i := 1; i < len(got); i++ {
		if got[i].Name == got[i-1].Name {
			c.r.fail("%s: resource %s listed twice", where, got[i].Name)
		}
	}
	if len(got) != len(want.Resources) {
		c.r.fail("%s: resources %v, want %v", where, resNames(got), wantNames(want.Resources))
		return
	}
	for i, g := range got {
		w := want.Resources[i]
		if string(g.Name) != w.Name {
			c.r.fail("%s: resources %v, want %v", where, resNames(got), wantNames(want.Resources))
			return
		}
		if g.Replicas != w.Replicas {
			c.r.fail("%s: resource %s replicas=%d, want %d", where, w.Name, g.Replicas, w.Replicas)
		}
		wantRename := w.Rename
		if wantRename == "" && want.RenameByDefault {
			wantRename = nvconf.SharedRename(w.Name)
		}
		if string(g.Rename) != wantRename {
			c.r.fail("%s: resource %s rename=%q, want %q", where, w.Name, g.Rename, wantRename)
		}
		if w.Devices == nil {
			if !g.Devices.All {
				c.r.fail("%s: resource %s devices not 'all'", where, w.Name)
			}
		} else {
			var gd []string
			for _, d := range g.Devices.List {
				gd = append(gd, string(d))
			}
			if g.Devices.All || !reflect.DeepEqual(gd, w.Devices) {
				c.r.fail("%s: resource %s devices=%v (all=%v), want %v", where, w.Name, gd, g.Devices.All, w.Devices)
			}
		}
	}
}

func (c *checker) checkMIGPolicy(p *policy.Policy, st *render.Object, dp *nvconf.DevicePluginResult) {
	name := p.Metadata.Name
	got, _ := render.Str(st.Status, "migConfig")
	wantLayout, err := policy.MigConfigName(p, got)
	if err != nil {
		c.r.fail("policy %s: %v", name, err)
		return
	}
	if got != wantLayout {
		c.r.fail("policy %s: status.migConfig=%q, want %q", name, got, wantLayout)
	}
	if c.mig == nil {
		return
	}
	slice, err := nvconf.SelectMigConfig(c.mig, wantLayout)
	if err != nil {
		c.r.fail("policy %s: MIG manager would fail with %s: %v", name, c.migSource, err)
		return
	}
	if len(p.Spec.MIG.CustomLayout) > 0 {
		c.compareCustomLayout(name, wantLayout, slice, p.Spec.MIG.CustomLayout)
	}
	// What runs on a node: the effective config (rename/devices dropped),
	// with the cluster-wide MIG strategy the GPU Operator passes as env.
	eff := dp.Effective
	if c.cpMigMode != "" {
		res, err := nvconf.LoadDevicePluginConfig([]byte(c.out.DevicePlugin.Data[stringStatus(st, "deviceConfigKey")]), nvconf.DevicePluginOptions{MigStrategyOverride: c.cpMigMode})
		if err != nil {
			return // reported in checkDeviceConfigs
		}
		eff = res.Effective
	}
	// Every shared resource must exist on at least one node geometry the
	// layout produces (named layouts: one per GPU model they list).
	matched := map[string]bool{}
	nodes := layoutNodes(slice)
	for _, hw := range nodes {
		outcome, err := nvconf.EvaluateNode(eff, hw.NodeHardware)
		if err != nil {
			c.r.fail("policy %s: on %s with layout %s the device plugin would fail: %v", name, hw.desc, wantLayout, err)
			continue
		}
		for _, r := range eff.Sharing.ReplicatedResources().Resources {
			target := string(r.Name)
			if r.Rename != "" {
				target = string(r.Rename)
			}
			if outcome.Resources[target] > 0 {
				matched[string(r.Name)] = true
			}
		}
	}
	for _, r := range eff.Sharing.ReplicatedResources().Resources {
		if !matched[string(r.Name)] {
			c.r.fail("policy %s: with layout %s, shared resource %s matches no device under migStrategy %s: sharing would silently do nothing", name, wantLayout, r.Name, deref(eff.Flags.MigStrategy))
		}
	}
}

func stringStatus(st *render.Object, k string) string {
	s, _ := render.Str(st.Status, k)
	return s
}

func (c *checker) compareCustomLayout(name, layout string, got mpv1.MigConfigSpecSlice, want []policy.LayoutEntry) {
	if len(got) != len(want) {
		c.r.fail("policy %s: layout %s has %d entries, want %d", name, layout, len(got), len(want))
		return
	}
	for i, w := range want {
		g := got[i]
		wantDevices := "all"
		if w.Devices != nil {
			wantDevices = nvconf.DevicesOf(mpv1.MigConfigSpec{Devices: w.Devices})
		}
		if d := nvconf.DevicesOf(g); d != wantDevices {
			c.r.fail("policy %s: layout %s entry %d devices=%s, want %s", name, layout, i, d, wantDevices)
		}
		if g.DeviceFilter != nil {
			c.r.fail("policy %s: layout %s entry %d has a device-filter", name, layout, i)
		}
		if g.MigEnabled != w.MigEnabled {
			c.r.fail("policy %s: layout %s entry %d mig-enabled=%v, want %v", name, layout, i, g.MigEnabled, w.MigEnabled)
		}
		wd := map[string]int{}
		for k, v := range w.MigDevices {
			if v != 0 {
				wd[k] = v
			}
		}
		gd := map[string]int{}
		for k, v := range g.MigDevices {
			if v != 0 {
				gd[k] = v
			}
		}
		if !reflect.DeepEqual(wd, gd) {
			c.r.fail("policy %s: layout %s entry %d mig-devices=%v, want %v", name, layout, i, gd, wd)
		}
	}
}

type simNode struct {
	nvconf.NodeHardware
	desc string
}

// layoutNodes builds the GPU geometry a layout produces on 8-GPU nodes: one
// node per device-filter appearing in the layout (so per-model entries of
// named layouts are evaluated separately), or one generic node.
func layoutNodes(slice mpv1.MigConfigSpecSlice) []simNode {
	gpus := 8
	for _, e := range slice {
		if l, ok := e.Devices.([]int); ok {
			for _, d := range l {
				if d+1 > gpus {
					gpus = d + 1
				}
			}
		}
	}
	var filters []string
	seen := map[string]bool{}
	for _, e := range slice {
		for _, f := range filterList(e.DeviceFilter) {
			if !seen[f] {
				seen[f] = true
				filters = append(filters, f)
			}
		}
	}
	if len(filters) == 0 {
		filters = []string{""}
	}
	var out []simNode
	for _, f := range filters {
		hw := nvconf.NodeHardware{Product: "NVIDIA-SIMULATED", ComputeCapability: "9.0", GPUs: make([]nvconf.GPU, gpus)}
		for i := range hw.GPUs {
			for _, e := range slice {
				fl := filterList(e.DeviceFilter)
				if len(fl) > 0 && !contains(fl, f) {
					continue
				}
				if !e.MatchesDevices(i) {
					continue
				}
				hw.GPUs[i] = nvconf.GPU{MigEnabled: e.MigEnabled, MigDevices: e.MigDevices}
			}
		}
		desc := fmt.Sprintf("a %d-GPU node", gpus)
		if f != "" {
			desc += " with device ID " + f
		}
		out = append(out, simNode{hw, desc})
	}
	return out
}

func filterList(f any) []string {
	switch v := f.(type) {
	case string:
		if v != "" {
			return []string{v}
		}
	case []string:
		return v
	}
	return nil
}

func contains(xs []string, x string) bool {
	for _, v := range xs {
		if strings.EqualFold(v, x) {
			return true
		}
	}
	return false
}

func deref[T any](p *T) T {
	var zero T
	if p == nil {
		return zero
	}
	return *p
}

func resNames(rs []spec.ReplicatedResource) []string {
	var out []string
	for _, r := range rs {
		out = append(out, fmt.Sprintf("%s x%d", r.Name, r.Replicas))
	}
	return out
}

func wantNames(rs []policy.ExpectedResource) []string {
	var out []string
	for _, r := range rs {
		out = append(out, fmt.Sprintf("%s x%d", r.Name, r.Replicas))
	}
	return out
}

// checkNodes checks the Node label writes of a render with --nodes: the
// labels must name an existing device-plugin key and MIG layout (else the
// config-manager / MIG manager fail), and the device plugin must start on
// the node's hardware with the resulting MIG geometry.
func (c *checker) checkNodes() {
	if c.nodes == nil {
		return
	}
	if len(c.out.Nodes) == 0 {
		c.r.fail("render with --nodes printed no Node documents")
	}
	input := map[string]*render.Object{}
	for _, n := range c.nodes {
		input[n.Metadata.Name] = n
	}
	for _, n := range c.out.Nodes {
		in := input[n.Metadata.Name]
		if in == nil {
			c.r.fail("Node %s is not in the --nodes input", n.Metadata.Name)
			continue
		}
		labels := map[string]string{}
		for k, v := range in.Metadata.Labels {
			labels[k] = v
		}
		for k, v := range n.Metadata.Labels {
			labels[k] = v
		}
		if c.checkVMNode(n, labels) {
			continue
		}
		key, hasKey := n.Metadata.Labels[sim.LabelDPConfig]
		if hasKey {
			if _, ok := c.out.DevicePlugin.Data[key]; !ok {
				c.r.fail("Node %s: label %s=%q is not a key of %s: its config-manager would exit ('specified config %s does not exist')", n.Metadata.Name, sim.LabelDPConfig, key, render.DevicePluginConfigMap, key)
				continue
			}
		} else {
			def, _ := render.Str(c.out.ClusterPolicy.Spec, "devicePlugin", "config", "default")
			key = def
		}
		hw, _ := sim.HardwareOf(labels, nil)
		geo := sim.GeometryOf(nil, hw.Count)
		if layout, ok := labels[sim.LabelMigConfig]; ok && hw.MigCapable && c.mig != nil {
			slice, err := nvconf.SelectMigConfig(c.mig, layout)
			if err != nil {
				c.r.fail("Node %s: label %s=%q: the MIG manager would fail with %s: %v", n.Metadata.Name, sim.LabelMigConfig, layout, c.migSource, err)
				continue
			}
			geo = sim.ApplyLayout(slice, hw, geo)
		}
		value, ok := c.out.DevicePlugin.Data[key]
		if !ok {
			continue // reported by checkClusterPolicy
		}
		res, err := nvconf.LoadDevicePluginConfig([]byte(value), nvconf.DevicePluginOptions{MigStrategyOverride: c.cpMigMode})
		if err != nil {
			continue // reported by checkDeviceConfigs
		}
		if _, err := nvconf.EvaluateNode(res.Effective, nvconf.NodeHardware{Product: hw.Product, ComputeCapability: hw.ComputeCapability, GPUs: geo}); err != nil {
			c.r.fail("Node %s (%d x %s) with config %q: the device plugin would fail: %v", n.Metadata.Name, hw.Count, hw.Product, key, err)
		}
	}
}
