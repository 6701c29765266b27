package main

import (
	"os"
	"strings"
	"testing"

	"gpusharing.io/tests/nvidia/internal/policy"
	"gpusharing.io/tests/nvidia/internal/render"
)

func check(t *testing.T, out string) *report {
	t.Helper()
	pdata, err := os.ReadFile("../../internal/render/testdata/policies.yaml")
	if err != nil {
		t.Fatal(err)
	}
	policies, err := policy.ParseFile(pdata)
	if err != nil {
		t.Fatal(err)
	}
	parsed, err := render.Parse([]byte(out), "gpu-operator")
	if err != nil {
		t.Fatal(err)
	}
	r := &report{}
	(&checker{out: parsed, policies: policies, r: r}).run()
	return r
}

func sample(t *testing.T) string {
	data, err := os.ReadFile("../../internal/render/testdata/sample.yaml")
	if err != nil {
		t.Fatal(err)
	}
	return string(data)
}

func TestSampleConforms(t *testing.T) {
	if r := check(t, sample(t)); len(r.errs) > 0 {
		t.Fatalf("hand-written sample must conform:\n%s", strings.Join(r.errs, "\n"))
	}
}

func TestMismatchesAreReported(t *testing.T) {
	for name, tc := range map[string]struct{ old, new, want string }{
		"replicas":        {"          replicas: 4", "          replicas: 3", "replicas=3, want 4"},
		"fail flag":       {"failRequestsGreaterThanOne: true", "failRequestsGreaterThanOne: false", "failRequestsGreaterThanOne=false"},
		"typo ignored":    {"      timeSlicing:\n        renameByDefault: false", "      time-slicing:\n        renameByDefault: false", "unknown key sharing.time-slicing"},
		"mig strategy":    {"      migStrategy: mixed\n    sharing", "      migStrategy: single\n    sharing", "flags.migStrategy=\"single\""},
		"layout devices":  {"1g.10gb: 7\n      - devices: [4, 5, 6, 7]", "1g.10gb: 6\n      - devices: [4, 5, 6, 7]", "mig-devices=map[1g.10gb:6]"},
		"mig name":        {"nvidia.com/mig-1g.10gb", "nvidia.com/gpu", "resources [nvidia.com/gpu x2], want [nvidia.com/mig-1g.10gb x2]"},
		"cluster mig":     {"    strategy: mixed", "    strategy: single", "ClusterPolicy spec.mig.strategy=\"single\""},
		"default missing": {"      default: default", "      default: nope", "is not a key"},
		"status key":      {"deviceConfigKey: l4-ts-0a1b2c3d", "deviceConfigKey: l4-ts-0a1b2c3e", "is not a key"},
		"rejected by nv":  {"          replicas: 2", "          replicas: 1", "number of replicas must be >= 2"},
	} {
		t.Run(name, func(t *testing.T) {
			s := sample(t)
			if !strings.Contains(s, tc.old) {
				t.Fatalf("sample lacks %q", tc.old)
			}
			r := check(t, strings.Replace(s, tc.old, tc.new, 1))
			if !strings.Contains(strings.Join(r.errs, "\n"), tc.want) {
				t.Fatalf("want an error containing %q, got:\n%s", tc.want, strings.Join(r.errs, "\n"))
			}
		})
	}
}

func TestInvalidCasesAreWellFormed(t *testing.T) {
	seen := map[string]bool{}
	for _, ic := range invalidCases() {
		if seen[ic.name] {
			t.Errorf("duplicate case %s", ic.name)
		}
		seen[ic.name] = true
		ps, err := policy.ParseFile([]byte(ic.yaml))
		if err != nil || len(ps) == 0 {
			t.Errorf("%s: policies do not parse: %v", ic.name, err)
		}
		if ic.naive != nil {
			err := ic.naive.check()
			if ic.naive.rejected != (err != nil) {
				t.Errorf("%s: naive config: rejected=%v, err=%v", ic.name, ic.naive.rejected, err)
			}
		}
	}
}

func TestCorpusRoundTrips(t *testing.T) {
	for _, cf := range corpus() {
		data, err := policy.MarshalFile(cf.policies)
		if err != nil {
			t.Fatal(err)
		}
		back, err := policy.ParseFile(data)
		if err != nil || len(back) != len(cf.policies) {
			t.Fatalf("%s: %v (%d policies)", cf.name, err, len(back))
		}
		for _, p := range back {
			if _, err := policy.ExpectDevicePlugin(&p, func(string) ([]string, error) { return []string{"1g.10gb", "2g.20gb"}, nil }); err != nil {
				t.Errorf("%s/%s: %v", cf.name, p.Metadata.Name, err)
			}
		}
	}
}

func TestJSONKeys(t *testing.T) {
	for k, m := range map[string]map[string]bool{"version": dpTopKeys, "migStrategy": dpFlagKeys, "mps": dpSharingKeys,
		"failRequestsGreaterThanOne": dpReplicasKeys, "devices": dpResourceKeys} {
		if !m[k] {
			t.Errorf("%s missing from %v", k, m)
		}
	}
	if dpSharingKeys["time-slicing"] || len(dpSharingKeys) != 2 {
		t.Errorf("sharing keys %v", dpSharingKeys)
	}
}
