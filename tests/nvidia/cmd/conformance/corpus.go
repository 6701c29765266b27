package main

import (
	"fmt"
	"os"
	"path/filepath"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"gpusharing.io/tests/nvidia/internal/policy"
)

// corpusFile is one generated input file (one render run).
type corpusFile struct {
	name     string
	policies []policy.Policy
	nodes    string // optional Nodes manifest: render with --nodes
}

var ptr = policy.Ptr[int]

func newPolicy(name, strategy string) policy.Policy {
	return policy.Policy{
		APIVersion: policy.APIVersion,
		Kind:       policy.Kind,
		Metadata:   policy.Metadata{Name: name},
		Spec: policy.Spec{
			NodeSelector: &metav1.LabelSelector{MatchLabels: map[string]string{"gpusharing.io/pool": name}},
			Priority:     ptr(0),
			Strategy:     strategy,
		},
	}
}

func timeSlicing(name string, s policy.Sharing) policy.Policy {
	p := newPolicy(name, policy.TimeSlicing)
	p.Spec.TimeSlicing = &s
	return p
}

func mps(name string, s policy.Sharing) policy.Policy {
	p := newPolicy(name, policy.MPS)
	p.Spec.MPS = &s
	return p
}

func mig(name string, m policy.MIGSpec) policy.Policy {
	p := newPolicy(name, policy.MIG)
	p.Spec.MIG = &m
	return p
}

func boolOpt(v int) *bool { // 0: unset, 1: false, 2: true
	switch v {
	case 1:
		return policy.Ptr(false)
	case 2:
		return policy.Ptr(true)
	}
	return nil
}

var optName = []string{"unset", "false", "true"}

func allDevices(n int) []int {
	out := make([]int, n)
	for i := range out {
		out[i] = i
	}
	return out
}

// corpus generates valid policies covering every strategy and option.
func corpus() []corpusFile {
	var files []corpusFile
	add := func(name string, ps ...policy.Policy) {
		files = append(files, corpusFile{name: name, policies: ps})
	}

	add("exclusive", newPolicy("exclusive", policy.Exclusive))
	files = append(files, draCorpus()...)
	files = append(files, vmCorpus()...)

	// time-slicing: replicas x renameByDefault x failRequestsGreaterThanOne,
	// three policies per file.
	var batch []policy.Policy
	n := 0
	for _, replicas := range []int{2, 4, 10} {
		for rename := 0; rename < 3; rename++ {
			for fail := 0; fail < 3; fail++ {
				name := fmt.Sprintf("ts-r%d-rename-%s-fail-%s", replicas, optName[rename], optName[fail])
				batch = append(batch, timeSlicing(name, policy.Sharing{
					Replicas: ptr(replicas), RenameByDefault: boolOpt(rename), FailRequestsGreaterThanOne: boolOpt(fail),
				}))
				if len(batch) == 3 {
					n++
					add(fmt.Sprintf("time-slicing-matrix-%d", n), batch...)
					batch = nil
				}
			}
		}
	}

	// time-slicing with per-resource entries.
	add("ts-resource-gpu",
		timeSlicing("ts-resource-gpu", policy.Sharing{Resources: []policy.Resource{{Name: "nvidia.com/gpu", Replicas: ptr(4)}}}))
	add("ts-resource-rename",
		timeSlicing("ts-resource-rename", policy.Sharing{Resources: []policy.Resource{{Name: "nvidia.com/gpu", Replicas: ptr(3), Rename: "gpu-shared"}}}))
	add("ts-resource-rename-qualified",
		timeSlicing("ts-resource-rename-qualified", policy.Sharing{Resources: []policy.Resource{{Name: "nvidia.com/gpu", Replicas: ptr(2), Rename: "nvidia.com/gpu-ts"}}}))
	add("ts-resource-devices",
		timeSlicing("ts-resource-devices", policy.Sharing{Resources: []policy.Resource{{Name: "nvidia.com/gpu", Replicas: ptr(2), Devices: []string{"0", "1"}}}}))
	add("ts-resource-devices-uuid",
		timeSlicing("ts-resource-devices-uuid", policy.Sharing{Resources: []policy.Resource{{Name: "nvidia.com/gpu", Replicas: ptr(5), Devices: []string{"GPU-b1028956-cfa2-0990-bf4a-5da9abb51763"}}}}))
	add("ts-resource-rename-by-default-and-rename",
		timeSlicing("ts-resource-rbd-rename", policy.Sharing{RenameByDefault: policy.Ptr(true), FailRequestsGreaterThanOne: policy.Ptr(true),
			Resources: []policy.Resource{{Name: "nvidia.com/gpu", Replicas: ptr(4), Rename: "gpu-four"}}}))
	add("ts-resource-mig-names",
		timeSlicing("ts-resource-mig-names", policy.Sharing{Resources: []policy.Resource{
			{Name: "nvidia.com/gpu", Replicas: ptr(2)},
			{Name: "nvidia.com/mig-1g.10gb", Replicas: ptr(4), Devices: []string{"0:0", "0:1"}},
			{Name: "nvidia.com/mig-3g.40gb", Replicas: ptr(2), Rename: "mig-3g.40gb-shared"},
		}}))

	// MPS.
	for _, replicas := range []int{2, 4, 48} {
		for rename := 0; rename < 3; rename++ {
			name := fmt.Sprintf("mps-r%d-rename-%s", replicas, optName[rename])
			add(name, mps(name, policy.Sharing{Replicas: ptr(replicas), RenameByDefault: boolOpt(rename)}))
		}
	}

	// MIG, named layouts.
	for _, l := range []string{"all-disabled", "all-1g.10gb", "all-2g.20gb", "all-3g.40gb", "all-7g.80gb"} {
		name := "mig-single-" + sanitize(l)
		add(name, mig(name, policy.MIGSpec{MigStrategy: "single", Layout: l}))
	}
	for _, l := range []string{"all-disabled", "all-enabled", "all-1g.10gb", "all-1g.10gb.me", "all-3g.40gb", "all-balanced"} {
		name := "mig-mixed-" + sanitize(l)
		add(name, mig(name, policy.MIGSpec{MigStrategy: "mixed", Layout: l}))
	}

	// MIG with time-slicing of MIG instances.
	add("mig-single-ts", mig("mig-single-ts", policy.MIGSpec{MigStrategy: "single", Layout: "all-1g.10gb",
		TimeSlicing: &policy.Sharing{Replicas: ptr(2)}}))
	add("mig-single-ts-rename", mig("mig-single-ts-rename", policy.MIGSpec{MigStrategy: "single", Layout: "all-3g.40gb",
		TimeSlicing: &policy.Sharing{Replicas: ptr(3), RenameByDefault: policy.Ptr(true), FailRequestsGreaterThanOne: policy.Ptr(true)}}))
	add("mig-mixed-ts-named", mig("mig-mixed-ts-named", policy.MIGSpec{MigStrategy: "mixed", Layout: "all-1g.10gb",
		TimeSlicing: &policy.Sharing{Replicas: ptr(2)}}))
	add("mig-mixed-ts-balanced", mig("mig-mixed-ts-balanced", policy.MIGSpec{MigStrategy: "mixed", Layout: "all-balanced",
		TimeSlicing: &policy.Sharing{Resources: []policy.Resource{
			{Name: "nvidia.com/mig-1g.10gb", Replicas: ptr(3)},
			{Name: "nvidia.com/mig-2g.20gb", Replicas: ptr(2)},
		}}}))
	add("mig-mixed-ts-me", mig("mig-mixed-ts-me", policy.MIGSpec{MigStrategy: "mixed", Layout: "all-1g.10gb.me",
		TimeSlicing: &policy.Sharing{Replicas: ptr(2)}}))
	// 7x 1g.10gb, each time-sliced x2 (14 nvidia.com/mig-1g.10gb per GPU).
	add("mig-custom-7x1g-ts2", mig("mig-custom-7x1g-ts2", policy.MIGSpec{MigStrategy: "mixed",
		CustomLayout: []policy.LayoutEntry{{MigEnabled: true, MigDevices: map[string]int{"1g.10gb": 7}}},
		TimeSlicing:  &policy.Sharing{Replicas: ptr(2)}}))
	add("mig-custom-single-7x1g-ts2", mig("mig-custom-single-7x1g-ts2", policy.MIGSpec{MigStrategy: "single",
		CustomLayout: []policy.LayoutEntry{{MigEnabled: true, MigDevices: map[string]int{"1g.10gb": 7}}},
		TimeSlicing:  &policy.Sharing{Replicas: ptr(2), FailRequestsGreaterThanOne: policy.Ptr(true)}}))
	add("mig-custom-groups", mig("mig-custom-groups", policy.MIGSpec{MigStrategy: "mixed",
		CustomLayout: []policy.LayoutEntry{
			{Devices: []int{0, 1, 2, 3}, MigEnabled: true, MigDevices: map[string]int{"1g.10gb": 3, "2g.20gb": 2}},
			{Devices: []int{4, 5, 6, 7}, MigEnabled: false},
		}}))
	add("mig-custom-groups-ts", mig("mig-custom-groups-ts", policy.MIGSpec{MigStrategy: "mixed",
		CustomLayout: []policy.LayoutEntry{
			{Devices: []int{0, 1}, MigEnabled: true, MigDevices: map[string]int{"3g.40gb": 2}},
			{Devices: []int{2, 3, 4, 5, 6, 7}, MigEnabled: true, MigDevices: map[string]int{"1g.10gb": 7}},
		},
		TimeSlicing: &policy.Sharing{Replicas: ptr(4), RenameByDefault: policy.Ptr(true)}}))
	add("mig-custom-groups-ts-resources", mig("mig-custom-groups-ts-resources", policy.MIGSpec{MigStrategy: "mixed",
		CustomLayout: []policy.LayoutEntry{
			{Devices: []int{0, 1, 2, 3}, MigEnabled: true, MigDevices: map[string]int{"1g.10gb": 3, "2g.20gb": 2}},
			{Devices: []int{4, 5, 6, 7}, MigEnabled: false},
		},
		TimeSlicing: &policy.Sharing{Resources: []policy.Resource{
			{Name: "nvidia.com/mig-1g.10gb", Replicas: ptr(2)},
			{Name: "nvidia.com/mig-2g.20gb", Replicas: ptr(3)},
		}}}))
	add("mig-custom-single-explicit-devices", mig("mig-custom-single-explicit-devices", policy.MIGSpec{MigStrategy: "single",
		CustomLayout: []policy.LayoutEntry{
			{Devices: []int{0, 1, 2, 3}, MigEnabled: true, MigDevices: map[string]int{"3g.40gb": 2}},
			{Devices: []int{4, 5, 6, 7}, MigEnabled: true, MigDevices: map[string]int{"3g.40gb": 2}},
		}}))
	add("mig-custom-h200", mig("mig-custom-h200", policy.MIGSpec{MigStrategy: "mixed",
		CustomLayout: []policy.LayoutEntry{
			{Devices: allDevices(4), MigEnabled: true, MigDevices: map[string]int{"1g.18gb": 7}},
			{Devices: []int{4, 5, 6, 7}, MigEnabled: true, MigDevices: map[string]int{"3g.71gb": 1, "4g.71gb": 1}},
		},
		TimeSlicing: &policy.Sharing{Replicas: ptr(2)}}))

	// several policies per file.
	add("multi-no-mig",
		newPolicy("multi-exclusive", policy.Exclusive),
		timeSlicing("multi-ts", policy.Sharing{Replicas: ptr(4)}),
		timeSlicing("multi-ts-rename", policy.Sharing{Replicas: ptr(8), RenameByDefault: policy.Ptr(true)}),
		mps("multi-mps", policy.Sharing{Replicas: ptr(6)}),
	)
	add("multi-mig-single",
		timeSlicing("multi-single-ts", policy.Sharing{Replicas: ptr(2)}),
		mps("multi-single-mps", policy.Sharing{Replicas: ptr(4)}),
		mig("multi-single-a", policy.MIGSpec{MigStrategy: "single", Layout: "all-1g.10gb"}),
		mig("multi-single-b", policy.MIGSpec{MigStrategy: "single",
			CustomLayout: []policy.LayoutEntry{{MigEnabled: true, MigDevices: map[string]int{"2g.20gb": 3}}},
			TimeSlicing:  &policy.Sharing{Replicas: ptr(2)}}),
	)
	add("multi-mig-mixed",
		newPolicy("multi-mixed-exclusive", policy.Exclusive),
		timeSlicing("multi-mixed-ts", policy.Sharing{Replicas: ptr(3), FailRequestsGreaterThanOne: policy.Ptr(true)}),
		mig("multi-mixed-a", policy.MIGSpec{MigStrategy: "mixed", Layout: "all-balanced"}),
		mig("multi-mixed-b", policy.MIGSpec{MigStrategy: "mixed",
			CustomLayout: []policy.LayoutEntry{
				{Devices: []int{0, 1, 2, 3}, MigEnabled: true, MigDevices: map[string]int{"1g.10gb": 7}},
				{Devices: []int{4, 5, 6, 7}, MigEnabled: false},
			},
			TimeSlicing: &policy.Sharing{Replicas: ptr(2)}}),
		mig("multi-mixed-c", policy.MIGSpec{MigStrategy: "mixed", Layout: "all-3g.40gb",
			TimeSlicing: &policy.Sharing{Resources: []policy.Resource{{Name: "nvidia.com/mig-3g.40gb", Replicas: ptr(2)}}}}),
	)
	return files
}

func sanitize(s string) string {
	out := []byte(s)
	for i, c := range out {
		if c == '.' || c == '+' {
			out[i] = '-'
		}
	}
	return string(out)
}

// writeCorpus writes the corpus and the invalid cases for manual use.
func writeCorpus(dir string) error {
	if err := os.MkdirAll(filepath.Join(dir, "valid"), 0o755); err != nil {
		return err
	}
	if err := os.MkdirAll(filepath.Join(dir, "invalid"), 0o755); err != nil {
		return err
	}
	for _, cf := range corpus() {
		data, err := policy.MarshalFile(cf.policies)
		if err != nil {
			return err
		}
		if err := os.WriteFile(filepath.Join(dir, "valid", cf.name+".yaml"), data, 0o644); err != nil {
			return err
		}
		if cf.nodes != "" {
			if err := os.WriteFile(filepath.Join(dir, "valid", cf.name+".nodes"), []byte(cf.nodes), 0o644); err != nil {
				return err
			}
		}
	}
	for _, ic := range invalidCases() {
		if err := os.WriteFile(filepath.Join(dir, "invalid", ic.name+".yaml"), []byte(ic.yaml), 0o644); err != nil {
			return err
		}
	}
	return nil
}
