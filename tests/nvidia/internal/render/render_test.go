package render

import (
	"os"
	"strings"
	"testing"
)

func TestParseSample(t *testing.T) {
	data, err := os.ReadFile("testdata/sample.yaml")
	if err != nil {
		t.Fatal(err)
	}
	out, err := Parse(data, "gpu-operator")
	if err != nil {
		t.Fatal(err)
	}
	if out.MigParted == nil || len(out.DevicePlugin.Data) != 3 || len(out.Policies) != 2 {
		t.Fatalf("unexpected parse: %+v", out)
	}
	if s, _ := Str(out.ClusterPolicy.Spec, "mig", "strategy"); s != "mixed" {
		t.Fatalf("mig.strategy = %q", s)
	}
	if s, _ := Str(out.Policies["a100-mig"].Status, "migConfig"); s != "custom-a100-mig-5a1e0c3d" {
		t.Fatalf("migConfig = %q", s)
	}
}

func TestParseRejectsWrongOrder(t *testing.T) {
	data, _ := os.ReadFile("testdata/sample.yaml")
	docs := strings.Split(string(data), "\n---\n")
	// ClusterPolicy first.
	swapped := strings.Join(append([]string{docs[2]}, append(docs[:2], docs[3:]...)...), "\n---\n")
	if _, err := Parse([]byte(swapped), "gpu-operator"); err == nil {
		t.Fatal("expected an error for a misplaced ClusterPolicy")
	}
	if _, err := Parse(data, "other-ns"); err == nil {
		t.Fatal("expected an error for the wrong namespace")
	}
}

// testdata/dra.yaml: `render -f examples/dra-mps.yaml --nodes` (two nodes).
func TestParseDRA(t *testing.T) {
	data, err := os.ReadFile("testdata/dra.yaml")
	if err != nil {
		t.Fatal(err)
	}
	out, err := Parse(data, "gpu-operator")
	if err != nil {
		t.Fatal(err)
	}
	if len(out.ClaimTemplates) != 1 || len(out.Nodes) != 2 || len(out.Policies) != 1 {
		t.Fatalf("unexpected parse: %d templates, %d nodes, %d policies", len(out.ClaimTemplates), len(out.Nodes), len(out.Policies))
	}
	if id := TemplateID(out.ClaimTemplates[0]); id != "gpu-test6/single-gpu" {
		t.Fatalf("template %s", id)
	}
	if !strings.Contains(string(out.ClaimTemplates[0].Raw), "GpuConfig") {
		t.Fatal("Raw does not hold the document")
	}
	st := out.Policies["dra-mps"]
	if !IsDRA(st) {
		t.Fatal("dra-mps not recognised as a DRA policy")
	}
	if got, _ := Strings(st.Status, "templates"); len(got) != 1 || got[0] != "gpu-test6/single-gpu" {
		t.Fatalf("status.templates = %v", got)
	}
}

func TestParseDRARejects(t *testing.T) {
	data, _ := os.ReadFile("testdata/dra.yaml")
	text := string(data)
	for name, bad := range map[string]string{
		"template after the nodes": moveDoc(text, "kind: ResourceClaimTemplate", "name: dra-1"),
		"wrong apiVersion":         strings.Replace(text, "apiVersion: resource.k8s.io/v1\n", "apiVersion: resource.k8s.io/v1beta1\n", 1),
		"unlisted template":        strings.Replace(text, "  - gpu-test6/single-gpu", "  - gpu-test6/other", 1),
		"owner unknown":            strings.Replace(text, "gpusharing.io/policy: dra-mps\n  name: single-gpu", "gpusharing.io/policy: nobody\n  name: single-gpu", 1),
		"deviceConfigKey":          strings.Replace(text, "  templates:\n", "  deviceConfigKey: dra-mps-0123abcd\n  templates:\n", 1),
	} {
		if bad == text {
			t.Fatalf("%s: the edit did not apply", name)
		}
		if _, err := Parse([]byte(bad), "gpu-operator"); err == nil {
			t.Errorf("%s: expected an error", name)
		}
	}
}

// moveDoc moves the document containing `what` after the one containing `after`.
func moveDoc(text, what, after string) string {
	docs := strings.Split(text, "\n---\n")
	var moved string
	var rest []string
	for _, d := range docs {
		if moved == "" && strings.Contains(d, what) {
			moved = d
			continue
		}
		rest = append(rest, d)
	}
	var out []string
	for _, d := range rest {
		out = append(out, d)
		if strings.Contains(d, after) {
			out = append(out, moved)
		}
	}
	return strings.Join(out, "\n---\n")
}
