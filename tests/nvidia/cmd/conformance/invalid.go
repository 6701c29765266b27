package main

import (
	"fmt"
	"strings"

	"gpusharing.io/tests/nvidia/internal/dra"
	"gpusharing.io/tests/nvidia/internal/nvconf"
)

// invalidCase is a policy file `render` must reject with exit code 1 and
// `error: policy "<name>": <field path>: <message>` on stderr.
type invalidCase struct {
	name     string
	yaml     string
	policies []string // stderr must name one of these
	fields   []string // stderr must mention one of these (case-insensitive)
	naive    *naive   // what NVIDIA does with a naive rendering, if any
	// needsMigBase: render can only know the named layout with the GPU
	// Operator's mig-parted config (--mig-parted-config); skipped without.
	needsMigBase bool
	// statusOK: a policy set that is only invalid together; render may
	// also answer with exit 0 and one of the policies' status
	// Accepted=False (as the controller would).
	statusOK bool
}

// naive is the config a renderer that did not validate would produce.
type naive struct {
	dp       string // device-plugin config, or
	mig      string // mig-parted config (+ layout), optional
	layout   string
	override string // MIG_STRATEGY set by the GPU Operator
	// node evaluation of dp on a node with this MIG geometry (layout of mig)
	evalNode bool
	rejected bool   // NVIDIA's code must reject it (else: accepts silently)
	why      string // for silently accepted configs: what goes wrong
	// gpuConfig: a GpuConfig for NVIDIA's DRA driver, prepared on a
	// one-GPU claim with these driver feature gates (dp is then unused).
	gpuConfig string
	gates     dra.Gates
	// vgpu: a vGPU-devices config, of which the vGPU Device Manager
	// selects vgpuName.
	vgpu     string
	vgpuName string
}

func (n *naive) check() error {
	if n.vgpu != "" {
		return n.checkVgpu()
	}
	if n.gpuConfig != "" {
		_, err := dra.CheckGpuConfig([]byte(n.gpuConfig), n.gates, dra.FakeUUIDs(1))
		return err
	}
	var slice []nvconfLayout
	if n.mig != "" {
		s, err := nvconf.ValidateMigConfig([]byte(n.mig), n.layout)
		if err != nil {
			return err
		}
		for _, hw := range layoutNodes(s) {
			slice = append(slice, nvconfLayout{hw})
		}
	}
	if n.dp == "" {
		return nil
	}
	res, err := nvconf.LoadDevicePluginConfig([]byte(n.dp), nvconf.DevicePluginOptions{MigStrategyOverride: n.override})
	if err != nil {
		return err
	}
	if n.evalNode {
		if len(slice) == 0 {
			slice = []nvconfLayout{{simNode{nvconf.NodeHardware{Product: "NVIDIA-H100-80GB-HBM3", ComputeCapability: "9.0", GPUs: make([]nvconf.GPU, 8)}, "8-GPU node"}}}
		}
		for _, l := range slice {
			if _, err := nvconf.EvaluateNode(res.Effective, l.NodeHardware); err != nil {
				return fmt.Errorf("device plugin on %s: %w", l.desc, err)
			}
		}
	}
	return nil
}

type nvconfLayout struct{ simNode }

func pol(name, spec string) string {
	return fmt.Sprintf(`apiVersion: gpusharing.io/v1alpha1
kind: GpuSharingPolicy
metadata:
  name: %s
spec:
  nodeSelector:
    matchLabels:
      gpusharing.io/pool: %s
%s`, name, name, indent(strings.TrimLeft(spec, "\n"), "  "))
}

func indent(s, pre string) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	for i, l := range lines {
		if l != "" {
			lines[i] = pre + l
		}
	}
	return strings.Join(lines, "\n") + "\n"
}

func dpTS(migStrategy, resources string) string {
	return fmt.Sprintf("version: v1\nflags:\n  migStrategy: %s\nsharing:\n  timeSlicing:\n    resources:\n%s", migStrategy, indent(resources, "    "))
}

func dpMPS(migStrategy, resources string) string {
	return fmt.Sprintf("version: v1\nflags:\n  migStrategy: %s\nsharing:\n  mps:\n    resources:\n%s", migStrategy, indent(resources, "    "))
}

func migCfg(name, entries string) string {
	return fmt.Sprintf("version: v1\nmig-configs:\n  all-disabled:\n  - devices: all\n    mig-enabled: false\n  %s:\n%s", name, indent(entries, "  "))
}

const all1g10gb = `- devices: all
  mig-enabled: true
  mig-devices:
    1g.10gb: 7
`

func withBase(c invalidCase) invalidCase {
	c.needsMigBase = true
	return c
}

func invalidCases() []invalidCase {
	one := func(name, spec string, fields []string, n *naive) invalidCase {
		return invalidCase{name: name, yaml: pol(name, spec), policies: []string{name}, fields: fields, naive: n}
	}
	return append([]invalidCase{
		one("ts-replicas-1", `
strategy: timeSlicing
timeSlicing:
  replicas: 1
`, []string{"replicas"}, &naive{dp: dpTS("none", "- name: nvidia.com/gpu\n  replicas: 1\n"), rejected: true}),
		one("ts-replicas-0", `
strategy: timeSlicing
timeSlicing:
  replicas: 0
`, []string{"replicas"}, &naive{dp: dpTS("none", "- name: nvidia.com/gpu\n  replicas: 0\n"), rejected: true}),
		one("ts-replicas-negative", `
strategy: timeSlicing
timeSlicing:
  replicas: -3
`, []string{"replicas"}, &naive{dp: dpTS("none", "- name: nvidia.com/gpu\n  replicas: -3\n"), rejected: true}),
		one("ts-no-replicas", `
strategy: timeSlicing
timeSlicing:
  renameByDefault: true
`, []string{"replicas"}, &naive{dp: dpTS("none", "- name: nvidia.com/gpu\n"), rejected: true}),
		one("ts-resource-replicas-1", `
strategy: timeSlicing
timeSlicing:
  resources:
  - name: nvidia.com/gpu
    replicas: 1
`, []string{"replicas"}, &naive{dp: dpTS("none", "- name: nvidia.com/gpu\n  replicas: 1\n"), rejected: true}),
		one("ts-missing-block", `
strategy: timeSlicing
`, []string{"timeSlicing"}, &naive{dp: "version: v1\nsharing:\n  timeSlicing: {}\n", rejected: true}),
		one("ts-empty-resources-and-no-replicas", `
strategy: timeSlicing
timeSlicing:
  resources: []
`, []string{"replicas", "resources"}, &naive{dp: "version: v1\nsharing:\n  timeSlicing:\n    resources: []\n", rejected: true}),
		one("ts-bad-resource-name", `
strategy: timeSlicing
timeSlicing:
  resources:
  - name: nvidia.com/GPU_Shared
    replicas: 2
`, []string{"name"}, &naive{dp: dpTS("none", "- name: nvidia.com/GPU_Shared\n  replicas: 2\n"), rejected: true}),
		one("ts-foreign-resource-prefix", `
strategy: timeSlicing
timeSlicing:
  resources:
  - name: example.com/gpu
    replicas: 2
`, []string{"name"}, &naive{dp: dpTS("none", "- name: example.com/gpu\n  replicas: 2\n"), rejected: true}),
		one("ts-resource-name-too-long", `
strategy: timeSlicing
timeSlicing:
  resources:
  - name: nvidia.com/`+strings.Repeat("g", 60)+`
    replicas: 2
`, []string{"name"}, &naive{dp: dpTS("none", "- name: nvidia.com/"+strings.Repeat("g", 60)+"\n  replicas: 2\n"), rejected: true}),
		one("ts-bad-rename", `
strategy: timeSlicing
timeSlicing:
  resources:
  - name: nvidia.com/gpu
    replicas: 2
    rename: Shared GPU
`, []string{"rename"}, &naive{dp: dpTS("none", "- name: nvidia.com/gpu\n  replicas: 2\n  rename: Shared GPU\n"), rejected: true}),
		one("ts-duplicate-resource", `
strategy: timeSlicing
timeSlicing:
  resources:
  - name: nvidia.com/gpu
    replicas: 2
  - name: nvidia.com/gpu
    replicas: 4
`, []string{"resources", "name", "duplicate"}, &naive{dp: dpTS("none", "- name: nvidia.com/gpu\n  replicas: 2\n- name: nvidia.com/gpu\n  replicas: 4\n"),
			why: "both entries load; the device map then holds the union of replicas of both (annotated IDs ::0..::3), labels report the first"}),
		one("ts-duplicate-resource-unqualified", `
strategy: timeSlicing
timeSlicing:
  resources:
  - name: gpu
    replicas: 2
  - name: nvidia.com/gpu
    replicas: 4
`, []string{"resources", "name", "duplicate"}, &naive{dp: dpTS("none", "- name: gpu\n  replicas: 2\n- name: nvidia.com/gpu\n  replicas: 4\n"),
			why: "'gpu' is qualified to nvidia.com/gpu, so both entries name the same resource"}),
		one("ts-bad-device", `
strategy: timeSlicing
timeSlicing:
  resources:
  - name: nvidia.com/gpu
    replicas: 2
    devices: ["gpu0"]
`, []string{"devices"}, &naive{dp: dpTS("none", "- name: nvidia.com/gpu\n  replicas: 2\n  devices: [\"gpu0\"]\n"), rejected: true}),
		one("ts-and-mps", `
strategy: timeSlicing
timeSlicing:
  replicas: 4
mps:
  replicas: 4
`, []string{"mps", "timeSlicing"}, &naive{dp: "version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - name: nvidia.com/gpu\n      replicas: 4\n  mps:\n    resources:\n    - name: nvidia.com/gpu\n      replicas: 4\n",
			why: "with both blocks present NVIDIA silently uses MPS"}),
		one("ts-with-mig-block", `
strategy: timeSlicing
timeSlicing:
  replicas: 2
mig:
  migStrategy: single
  layout: all-1g.10gb
`, []string{"mig"}, nil),
		one("exclusive-with-timeslicing", `
strategy: exclusive
timeSlicing:
  replicas: 2
`, []string{"timeSlicing"}, nil),
		one("unknown-strategy", `
strategy: sliced
`, []string{"strategy"}, nil),
		one("mps-49", `
strategy: mps
mps:
  replicas: 49
`, []string{"replicas"}, &naive{dp: dpMPS("none", "- name: nvidia.com/gpu\n  replicas: 49\n"), evalNode: true, rejected: true}),
		one("mps-replicas-1", `
strategy: mps
mps:
  replicas: 1
`, []string{"replicas"}, &naive{dp: dpMPS("none", "- name: nvidia.com/gpu\n  replicas: 1\n"), rejected: true}),
		one("mps-missing-block", `
strategy: mps
`, []string{"mps"}, &naive{dp: "version: v1\nsharing:\n  mps: {}\n", rejected: true}),
		one("mps-with-mig", `
strategy: mps
mps:
  replicas: 4
mig:
  migStrategy: mixed
  layout: all-1g.10gb
`, []string{"mig"}, &naive{dp: dpMPS("mixed", "- name: nvidia.com/gpu\n  replicas: 4\n"), rejected: true}),
		one("mps-with-timeslicing-block", `
strategy: mps
mps:
  replicas: 4
timeSlicing:
  replicas: 2
`, []string{"timeSlicing", "mps"}, nil),
		one("mig-with-mps-block", `
strategy: mig
mig:
  migStrategy: single
  layout: all-1g.10gb
mps:
  replicas: 4
`, []string{"mps"}, &naive{dp: dpMPS("single", "- name: nvidia.com/gpu\n  replicas: 4\n"), mig: migCfg("all-1g.10gb", all1g10gb), layout: "all-1g.10gb", evalNode: true, rejected: true}),
		one("mig-missing-block", `
strategy: mig
`, []string{"mig"}, nil),
		one("mig-no-layout", `
strategy: mig
mig:
  migStrategy: single
`, []string{"layout", "customLayout"}, nil),
		one("mig-layout-and-custom", `
strategy: mig
mig:
  migStrategy: mixed
  layout: all-1g.10gb
  customLayout:
  - migEnabled: true
    migDevices: {"1g.10gb": 7}
`, []string{"layout", "customLayout"}, nil),
		one("mig-bad-strategy", `
strategy: mig
mig:
  migStrategy: double
  layout: all-1g.10gb
`, []string{"migStrategy"}, &naive{dp: "version: v1\nflags:\n  migStrategy: double\n", rejected: true}),
		withBase(one("mig-unknown-layout", `
strategy: mig
mig:
  migStrategy: mixed
  layout: all-9g.999gb
`, []string{"layout"}, &naive{mig: migCfg("all-1g.10gb", all1g10gb), layout: "all-9g.999gb", rejected: true})),
		one("mig-custom-enabled-without-devices-single", `
strategy: mig
mig:
  migStrategy: single
  customLayout:
  - migEnabled: true
`, []string{"migDevices"}, &naive{mig: migCfg("custom-x", "- devices: all\n  mig-enabled: true\n"), layout: "custom-x", rejected: true}),
		one("mig-custom-disabled-with-devices", `
strategy: mig
mig:
  migStrategy: mixed
  customLayout:
  - migEnabled: false
    migDevices: {"1g.10gb": 7}
`, []string{"migDevices", "migEnabled"}, &naive{mig: migCfg("custom-x", "- devices: all\n  mig-enabled: false\n  mig-devices:\n    1g.10gb: 7\n"), layout: "custom-x", rejected: true}),
		one("mig-custom-bad-profile", `
strategy: mig
mig:
  migStrategy: mixed
  customLayout:
  - migEnabled: true
    migDevices: {"1x.10gb": 7}
`, []string{"migDevices", "1x.10gb", "profile"}, &naive{mig: migCfg("custom-x", "- devices: all\n  mig-enabled: true\n  mig-devices:\n    1x.10gb: 7\n"), layout: "custom-x", rejected: true}),
		one("mig-custom-zero-counts", `
strategy: mig
mig:
  migStrategy: mixed
  customLayout:
  - migEnabled: true
    migDevices: {"1g.10gb": 0}
`, []string{"migDevices"}, &naive{mig: migCfg("custom-x", "- devices: all\n  mig-enabled: true\n  mig-devices:\n    1g.10gb: 0\n"), layout: "custom-x", rejected: true}),
		one("mig-custom-negative-count", `
strategy: mig
mig:
  migStrategy: mixed
  customLayout:
  - migEnabled: true
    migDevices: {"1g.10gb": -1, "2g.20gb": 3}
`, []string{"migDevices"}, &naive{mig: migCfg("custom-x", "- devices: all\n  mig-enabled: true\n  mig-devices:\n    1g.10gb: -1\n    2g.20gb: 3\n"), layout: "custom-x", rejected: true}),
		one("mig-single-two-profiles", `
strategy: mig
mig:
  migStrategy: single
  customLayout:
  - migEnabled: true
    migDevices: {"1g.10gb": 3, "2g.20gb": 2}
`, []string{"migStrategy", "customLayout", "migDevices"}, &naive{dp: "version: v1\nflags:\n  migStrategy: single\n",
			mig: migCfg("custom-x", "- devices: all\n  mig-enabled: true\n  mig-devices:\n    1g.10gb: 3\n    2g.20gb: 2\n"), layout: "custom-x", evalNode: true, rejected: true}),
		one("mig-single-partly-disabled", `
strategy: mig
mig:
  migStrategy: single
  customLayout:
  - devices: [0, 1, 2, 3]
    migEnabled: true
    migDevices: {"1g.10gb": 7}
  - devices: [4, 5, 6, 7]
    migEnabled: false
`, []string{"migStrategy", "customLayout", "migEnabled"}, &naive{dp: "version: v1\nflags:\n  migStrategy: single\n",
			mig: migCfg("custom-x", "- devices: [0, 1, 2, 3]\n  mig-enabled: true\n  mig-devices:\n    1g.10gb: 7\n- devices: [4, 5, 6, 7]\n  mig-enabled: false\n"), layout: "custom-x", evalNode: true, rejected: true}),
		withBase(one("mig-single-balanced", `
strategy: mig
mig:
  migStrategy: single
  layout: all-balanced
`, []string{"migStrategy", "layout"}, nil)),
		one("mig-ts-replicas-1", `
strategy: mig
mig:
  migStrategy: mixed
  layout: all-1g.10gb
  timeSlicing:
    replicas: 1
`, []string{"replicas"}, &naive{dp: dpTS("mixed", "- name: nvidia.com/mig-1g.10gb\n  replicas: 1\n"), rejected: true}),
		one("mig-single-ts-mig-resource", `
strategy: mig
mig:
  migStrategy: single
  layout: all-1g.10gb
  timeSlicing:
    resources:
    - name: nvidia.com/mig-1g.10gb
      replicas: 2
`, []string{"resources", "name"}, &naive{dp: dpTS("single", "- name: nvidia.com/mig-1g.10gb\n  replicas: 2\n"),
			mig: migCfg("all-1g.10gb", all1g10gb), layout: "all-1g.10gb", evalNode: true,
			why: "with migStrategy single MIG devices are advertised as nvidia.com/gpu: the entry matches nothing and nothing is shared"}),
		one("mig-mixed-ts-resource-not-in-layout", `
strategy: mig
mig:
  migStrategy: mixed
  layout: all-1g.10gb
  timeSlicing:
    resources:
    - name: nvidia.com/mig-3g.40gb
      replicas: 2
`, []string{"resources", "name"}, &naive{dp: dpTS("mixed", "- name: nvidia.com/mig-3g.40gb\n  replicas: 2\n"),
			mig: migCfg("all-1g.10gb", all1g10gb), layout: "all-1g.10gb", evalNode: true,
			why: "the resource is not created by the layout: nothing is shared"}),
		{
			name: "conflicting-mig-strategies",
			yaml: pol("mig-a", "strategy: mig\nmig:\n  migStrategy: single\n  layout: all-1g.10gb\n") + "---\n" +
				pol("mig-b", "strategy: mig\nmig:\n  migStrategy: mixed\n  layout: all-3g.40gb\n"),
			policies: []string{"mig-a", "mig-b"},
			fields:   []string{"migStrategy"},
			statusOK: true,
			naive: &naive{dp: "version: v1\nflags:\n  migStrategy: single\n", override: "mixed",
				why: "ClusterPolicy spec.mig.strategy is cluster-wide and the GPU Operator passes it as MIG_STRATEGY, overriding flags.migStrategy of every config"},
		},
		{
			name: "mps-with-cluster-mixed",
			yaml: pol("mps-a", "strategy: mps\nmps:\n  replicas: 4\n") + "---\n" +
				pol("mig-mixed-b", "strategy: mig\nmig:\n  migStrategy: mixed\n  layout: all-1g.10gb\n"),
			policies: []string{"mps-a", "mig-mixed-b"},
			fields:   []string{"migStrategy", "mps", "mixed"},
			statusOK: true,
			naive:    &naive{dp: dpMPS("none", "- name: nvidia.com/gpu\n  replicas: 4\n"), override: "mixed", rejected: true},
		},
		{
			name:     "duplicate-policy-name",
			yaml:     pol("twice", "strategy: timeSlicing\ntimeSlicing:\n  replicas: 2\n") + "---\n" + pol("twice", "strategy: mps\nmps:\n  replicas: 2\n"),
			policies: []string{"twice"},
			fields:   []string{"name", "duplicate"},
		},
	}, append(draInvalidCases(), vmInvalidCases()...)...)
}
