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
	if s, _ := Str(out.Policies["a100-mig"].Status, "migConfig"); s != "custom-a100-mig" {
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
