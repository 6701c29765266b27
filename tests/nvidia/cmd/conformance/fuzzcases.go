package main

import (
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strings"

	mpv1 "github.com/NVIDIA/mig-parted/api/spec/v1"
)

// The rendering cases of the fuzz corpora (written by tests/fuzz_corpus.rs): DIR/<target>/<name>.yaml
// with an optional <name>.nodes.yaml. Each is rendered; what render accepts must load with
// NVIDIA's parsers as any valid policy does (checkValidFile), what it refuses must be refused with
// every error line naming the policy and a field, or the YAML line.
func fuzzCases(dir string) ([]validCase, error) {
	var out []validCase
	err := filepath.WalkDir(dir, func(path string, d os.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() || !strings.HasSuffix(path, ".yaml") || strings.HasSuffix(path, ".nodes.yaml") {
			return nil
		}
		rel, _ := filepath.Rel(dir, path)
		vc := validCase{name: "fuzz/" + rel, path: path}
		nodes := strings.TrimSuffix(path, ".yaml") + ".nodes.yaml"
		if _, err := os.Stat(nodes); err == nil {
			vc.nodes = nodes
		}
		out = append(out, vc)
		return nil
	})
	sort.Slice(out, func(i, j int) bool { return out[i].name < out[j].name })
	return out, err
}

// An error line of render that names what is wrong: a policy and a field path, a YAML position,
// the CEL rule's field, or the nodes file.
var namedError = regexp.MustCompile(`^error: (policy "[^"]*": (CEL validation: .*spec|(spec|metadata|apiVersion|kind)\b.*: \S)|.*invalid YAML|.*nodes)`)

// checkFuzzCase renders one fuzz case: accepted -> the checks of a valid file; refused -> every
// error line names its field. Inputs without a policy are skipped (ok=false).
func checkFuzzCase(o *options, vc validCase, defaults *mpv1.Spec) (r *report, ok bool) {
	r = &report{}
	res, err := runRender(o, vc.path, vc.nodes)
	if err != nil {
		r.fail("%v", err)
		return r, true
	}
	switch res.code {
	case 0:
		policies, err := readPolicies(vc.path)
		if err == nil && len(policies) == 0 {
			return r, false
		}
		if err != nil && strings.Contains(err.Error(), "yaml:") {
			// YAML that render's parser reads and Go's yaml.v2-based reader does not: the
			// rendered configs cannot be compared with the policy here.
			if o.verbose {
				fmt.Printf("SKIP %s: %v\n", vc.name, err)
			}
			return r, false
		}
		return checkValidFile(o, vc, defaults), true
	case 1:
		lines := strings.Split(strings.TrimSpace(string(res.stderr)), "\n")
		errs := 0
		for _, l := range lines {
			if !strings.HasPrefix(l, "error: ") {
				continue
			}
			errs++
			if !namedError.MatchString(l) {
				r.fail("a refusal that names no field: %q", l)
			}
		}
		if errs == 0 {
			r.fail("render exited 1 without an error line: %q", strings.TrimSpace(string(res.stderr)))
		}
	default:
		r.fail("render exited %d (stderr: %q)", res.code, strings.TrimSpace(string(res.stderr)))
	}
	return r, true
}
