// Command conformance checks `gpu-sharing-operator render` against NVIDIA's
// own config parsers (k8s-device-plugin v0.19.1 api/config/v1, mig-parted
// v0.13.1 api/spec/v1, and for DRA policies NVIDIA's DRA driver v0.5.0
// api/nvidia.com/resource/v1beta1 with its feature gates): every rendered
// config must load, and load to what the policy asked for; every invalid
// policy must be rejected by render before NVIDIA's code would reject it on
// a node.
//
// Usage:
//
//	conformance --operator-bin target/debug/gpu-sharing-operator --examples examples
package main

import (
	"bytes"
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strings"
	"time"

	mpv1 "github.com/NVIDIA/mig-parted/api/spec/v1"
	vgpuv1 "github.com/NVIDIA/vgpu-device-manager/api/spec/v1"

	"gpusharing.io/tests/nvidia/internal/nvconf"
	"gpusharing.io/tests/nvidia/internal/nvmig"
	"gpusharing.io/tests/nvidia/internal/policy"
	"gpusharing.io/tests/nvidia/internal/render"
)

type options struct {
	bin          string
	examples     string
	namespace    string
	defaultMig   string
	defaultVgpu  string
	run          string
	keep         bool
	verbose      bool
	writeCorpus  string
	timeout      time.Duration
	skipInvalid  bool
	skipCorpus   bool
	skipExamples bool
	// skipMigGeometry: skip the MIG geometry differential test (miggeometry.go).
	skipMigGeometry bool
	nodes           string
	fuzzCases       string
}

func main() {
	var o options
	flag.StringVar(&o.bin, "operator-bin", "", "path to the gpu-sharing-operator binary (required)")
	flag.StringVar(&o.examples, "examples", "", "directory of example GpuSharingPolicy YAML files")
	flag.StringVar(&o.namespace, "namespace", "gpu-operator", "namespace the rendered ConfigMaps must be in")
	flag.StringVar(&o.defaultMig, "mig-parted-config", "", "optional: the GPU Operator's default mig-parted config (ConfigMap YAML or raw config); passed to render, named layouts are checked against it")
	flag.StringVar(&o.defaultVgpu, "vgpu-config", "", "optional: the GPU Operator's default vGPU-devices config (ConfigMap YAML or raw); named vGPU types are checked against it")
	flag.StringVar(&o.run, "run", "", "only run cases whose name matches this regexp")
	flag.BoolVar(&o.keep, "keep", false, "keep the generated corpus directory")
	flag.BoolVar(&o.verbose, "v", false, "print notes (NVIDIA warnings) and passing cases")
	flag.StringVar(&o.writeCorpus, "write-corpus", "", "write the generated valid and invalid policies into this directory and exit")
	flag.DurationVar(&o.timeout, "timeout", 30*time.Second, "timeout of one render run")
	flag.BoolVar(&o.skipInvalid, "skip-invalid", false, "skip the invalid-policy cases")
	flag.BoolVar(&o.skipCorpus, "skip-corpus", false, "skip the generated corpus")
	flag.BoolVar(&o.skipExamples, "skip-examples", false, "skip the examples directory")
	flag.BoolVar(&o.skipMigGeometry, "skip-mig-geometry", false, "skip the MIG geometry differential test (operator's mig-geometry vs mig-parted on the go-nvml mock)")
	flag.StringVar(&o.nodes, "nodes", "", "optional: Nodes manifest; the examples are also rendered with --nodes and the Node label writes checked")
	flag.StringVar(&o.fuzzCases, "fuzz-cases", "", "optional: directory of the fuzz corpora's rendering cases (target/fuzz-cases, written by tests/fuzz_corpus.rs); each must render to what NVIDIA's parsers accept or be refused naming a field")
	flag.Parse()

	if o.writeCorpus != "" {
		if err := writeCorpus(o.writeCorpus); err != nil {
			fmt.Fprintln(os.Stderr, "error:", err)
			os.Exit(2)
		}
		return
	}
	if o.bin == "" {
		fmt.Fprintln(os.Stderr, "error: --operator-bin is required")
		os.Exit(2)
	}
	passed, failed, skipped, err := runAll(&o)
	if err != nil {
		fmt.Fprintln(os.Stderr, "error:", err)
		os.Exit(2)
	}
	if skipped > 0 {
		fmt.Printf("%d passed, %d failed, %d skipped\n", passed, failed, skipped)
	} else {
		fmt.Printf("%d passed, %d failed\n", passed, failed)
	}
	if failed > 0 {
		os.Exit(1)
	}
}

// validCase is a file of valid policies.
// vgpuDefaults: NVIDIA's default vGPU-devices config (--vgpu-config), if given.
var vgpuDefaults *vgpuv1.Spec

type validCase struct {
	name  string
	path  string
	nodes string // render with --nodes
}

func runAll(o *options) (passed, failed, skipped int, err error) {
	var filter *regexp.Regexp
	if o.run != "" {
		if filter, err = regexp.Compile(o.run); err != nil {
			return 0, 0, 0, err
		}
	}
	var defaults *mpv1.Spec
	if o.defaultMig != "" {
		if defaults, err = loadDefaultMig(o.defaultMig); err != nil {
			return 0, 0, 0, fmt.Errorf("--mig-parted-config: %w", err)
		}
	}
	if o.defaultVgpu != "" {
		text, err := nvconf.ReadMigConfigFile(o.defaultVgpu)
		if err == nil {
			vgpuDefaults, err = nvconf.LoadVgpuConfig([]byte(text))
		}
		if err != nil {
			return 0, 0, 0, fmt.Errorf("--vgpu-config: %w", err)
		}
	}
	dir, err := os.MkdirTemp("", "gpu-sharing-conformance-")
	if err != nil {
		return 0, 0, 0, err
	}
	if o.keep {
		fmt.Fprintf(os.Stderr, "corpus kept in %s\n", dir)
	} else {
		defer os.RemoveAll(dir)
	}

	var cases []validCase
	if !o.skipExamples && o.examples != "" {
		files, err := exampleFiles(o.examples)
		if err != nil {
			return 0, 0, 0, err
		}
		if len(files) == 0 {
			fmt.Fprintf(os.Stderr, "warning: no YAML files in %s\n", o.examples)
		}
		for _, f := range files {
			cases = append(cases, validCase{name: "example/" + filepath.Base(f), path: f})
		}
		if len(files) > 1 {
			// All examples applied to one cluster together.
			cases = append(cases, validCase{name: "example/(all together)", path: o.examples})
		}
		if o.nodes != "" {
			for _, f := range files {
				cases = append(cases, validCase{name: "example-with-nodes/" + filepath.Base(f), path: f, nodes: o.nodes})
			}
			if len(files) > 1 {
				cases = append(cases, validCase{name: "example-with-nodes/(all together)", path: o.examples, nodes: o.nodes})
			}
		}
	}
	if !o.skipCorpus {
		for _, cf := range corpus() {
			path := filepath.Join(dir, cf.name+".yaml")
			data, err := policy.MarshalFile(cf.policies)
			if err != nil {
				return 0, 0, 0, err
			}
			if err := os.WriteFile(path, data, 0o644); err != nil {
				return 0, 0, 0, err
			}
			vc := validCase{name: "corpus/" + cf.name, path: path}
			if cf.nodes != "" {
				vc.nodes = filepath.Join(dir, cf.name+".nodes")
				if err := os.WriteFile(vc.nodes, []byte(cf.nodes), 0o644); err != nil {
					return 0, 0, 0, err
				}
			}
			cases = append(cases, vc)
		}
	}

	record := func(name string, r *report) {
		if len(r.errs) == 0 {
			passed++
			if o.verbose {
				fmt.Printf("PASS %s\n", name)
			}
		} else {
			failed++
			fmt.Printf("FAIL %s\n", name)
			for _, e := range r.errs {
				fmt.Printf("    %s\n", e)
			}
		}
		if o.verbose {
			for _, n := range r.notes {
				fmt.Printf("    note: %s\n", n)
			}
		}
	}

	for _, c := range cases {
		if filter != nil && !filter.MatchString(c.name) {
			continue
		}
		record(c.name, checkValidFile(o, c, defaults))
	}
	if o.fuzzCases != "" {
		fcs, err := fuzzCases(o.fuzzCases)
		if err != nil {
			return 0, 0, 0, err
		}
		for _, c := range fcs {
			if filter != nil && !filter.MatchString(c.name) {
				continue
			}
			if r, ok := checkFuzzCase(o, c, defaults); ok {
				record(c.name, r)
			} else {
				skipped++
			}
		}
	}
	if !o.skipInvalid {
		for _, ic := range invalidCases() {
			name := "invalid/" + ic.name
			if filter != nil && !filter.MatchString(name) {
				continue
			}
			if ic.needsMigBase && o.defaultMig == "" {
				skipped++
				if o.verbose {
					fmt.Printf("SKIP %s (needs --mig-parted-config)\n", name)
				}
				continue
			}
			path := filepath.Join(dir, "invalid-"+ic.name+".yaml")
			if err := os.WriteFile(path, []byte(ic.yaml), 0o644); err != nil {
				return 0, 0, 0, err
			}
			record(name, checkInvalid(o, path, &ic))
		}
	}
	if !o.skipMigGeometry {
		var names []string
		for _, m := range nvmig.Models {
			names = append(names, "mig-geometry/"+m.Name)
		}
		if filter == nil || slices.ContainsFunc(names, filter.MatchString) {
			summary, reports := checkMigGeometry(o)
			for _, line := range summary {
				fmt.Println(line)
			}
			for i, name := range names {
				if filter == nil || filter.MatchString(name) {
					record(name, reports[i])
				}
			}
		}
	}
	return passed, failed, skipped, nil
}

func exampleFiles(dir string) ([]string, error) {
	entries, err := os.ReadDir(dir)
	if err != nil {
		return nil, err
	}
	var out []string
	for _, e := range entries {
		if e.IsDir() {
			continue
		}
		if ext := filepath.Ext(e.Name()); ext == ".yaml" || ext == ".yml" {
			out = append(out, filepath.Join(dir, e.Name()))
		}
	}
	sort.Strings(out)
	return out, nil
}

type runResult struct {
	stdout, stderr []byte
	code           int
}

func runRender(o *options, path, nodes string) (*runResult, error) {
	ctx, cancel := context.WithTimeout(context.Background(), o.timeout)
	defer cancel()
	args := []string{"render", "-f", path, "--namespace", o.namespace}
	if o.defaultMig != "" {
		args = append(args, "--mig-parted-config", o.defaultMig)
	}
	if nodes != "" {
		args = append(args, "--nodes", nodes)
	}
	cmd := exec.CommandContext(ctx, o.bin, args...)
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	err := cmd.Run()
	res := &runResult{stdout: out.Bytes(), stderr: errb.Bytes()}
	var ee *exec.ExitError
	switch {
	case err == nil:
	case errors.As(err, &ee):
		res.code = ee.ExitCode()
	default:
		return nil, err
	}
	if ctx.Err() != nil {
		return nil, fmt.Errorf("render timed out after %v", o.timeout)
	}
	return res, nil
}

func checkValidFile(o *options, vc validCase, defaults *mpv1.Spec) *report {
	r := &report{}
	path := vc.path
	policies, err := readPolicies(path)
	if err != nil {
		r.fail("cannot read policies: %v", err)
		return r
	}
	if len(policies) == 0 {
		r.fail("no GpuSharingPolicy in %s", path)
		return r
	}
	var nodes []*render.Object
	if vc.nodes != "" {
		data, err := os.ReadFile(vc.nodes)
		if err == nil {
			nodes, err = render.ParseObjects(data)
		}
		if err != nil {
			r.fail("--nodes: %v", err)
			return r
		}
	}
	res, err := runRender(o, path, vc.nodes)
	if err != nil {
		r.fail("%v", err)
		return r
	}
	if res.code != 0 {
		r.fail("render exited %d on valid input: %s", res.code, strings.TrimSpace(string(res.stderr)))
		return r
	}
	out, err := render.Parse(res.stdout, o.namespace)
	if err != nil {
		r.fail("render output: %v", err)
		return r
	}
	c := &checker{out: out, policies: policies, defaults: defaults, vgpuDefaults: vgpuDefaults, r: r, nodes: nodes}
	c.run()
	return r
}

func checkInvalid(o *options, path string, ic *invalidCase) *report {
	r := &report{}
	res, err := runRender(o, path, "")
	if err != nil {
		r.fail("%v", err)
		return r
	}
	stderr := string(res.stderr)
	switch {
	case res.code == 0 && ic.statusOK:
		checkRejectedInStatus(r, res.stdout, ic, o.namespace)
	case res.code == 0:
		r.fail("render accepted the invalid policy (exit 0)")
	case res.code != 1:
		r.fail("render exited %d, want 1 (stderr: %q)", res.code, strings.TrimSpace(stderr))
	default:
		checkErrorMessage(r, stderr, ic)
	}
	// Show what NVIDIA does with the naive rendering of this policy.
	if ic.naive != nil {
		nerr := ic.naive.check()
		switch {
		case ic.naive.rejected && nerr == nil:
			r.fail("expected NVIDIA's code to reject the naive config, but it accepted it")
		case !ic.naive.rejected && nerr != nil:
			r.fail("expected NVIDIA's code to accept the naive config silently, but it failed: %v", nerr)
		case nerr != nil:
			r.note("NVIDIA rejects the naive config: %v", nerr)
		default:
			r.note("NVIDIA accepts the naive config silently: %s", ic.naive.why)
		}
	}
	return r
}

// checkRejectedInStatus: one of the policies must have Accepted=False with
// a message naming one of the fields.
func checkRejectedInStatus(r *report, stdout []byte, ic *invalidCase, namespace string) {
	out, err := render.Parse(stdout, namespace)
	if err != nil {
		r.fail("render output: %v", err)
		return
	}
	for _, name := range ic.policies {
		st := out.Policies[name]
		if st == nil {
			continue
		}
		if ok, msg := render.Accepted(st); !ok {
			for _, f := range ic.fields {
				if strings.Contains(strings.ToLower(msg), strings.ToLower(f)) {
					r.note("render rejected policy %s in its status: %s", name, msg)
					return
				}
			}
		}
	}
	r.fail("render exited 0 and accepted all of %s (no status Accepted=False naming %v)", strings.Join(quoteAll(ic.policies), ", "), ic.fields)
}

// checkErrorMessage: `error: policy "<name>": <field path>: <message>`.
func checkErrorMessage(r *report, stderr string, ic *invalidCase) {
	named := false
	for _, p := range ic.policies {
		if strings.Contains(stderr, fmt.Sprintf("error: policy %q", p)) {
			named = true
		}
	}
	if !named {
		r.fail("stderr lacks 'error: policy \"<name>\"' for %s: %q", strings.Join(quoteAll(ic.policies), " or "), strings.TrimSpace(stderr))
	}
	lower := strings.ToLower(stderr)
	for _, f := range ic.fields {
		if strings.Contains(lower, strings.ToLower(f)) {
			return
		}
	}
	r.fail("stderr names none of the fields %v: %q", ic.fields, strings.TrimSpace(stderr))
}

func quoteAll(xs []string) []string {
	out := make([]string, len(xs))
	for i, x := range xs {
		out[i] = fmt.Sprintf("%q", x)
	}
	return out
}

// loadDefaultMig reads the GPU Operator's default mig-parted config.
func loadDefaultMig(path string) (*mpv1.Spec, error) {
	text, err := nvconf.ReadMigConfigFile(path)
	if err != nil {
		return nil, err
	}
	return nvconf.LoadMigPartedConfig([]byte(text))
}

// readPolicies reads a policy file, or every *.yaml/*.yml file of a directory.
func readPolicies(path string) ([]policy.Policy, error) {
	files := []string{path}
	if st, err := os.Stat(path); err != nil {
		return nil, err
	} else if st.IsDir() {
		if files, err = exampleFiles(path); err != nil {
			return nil, err
		}
	}
	var out []policy.Policy
	for _, f := range files {
		data, err := os.ReadFile(f)
		if err != nil {
			return nil, err
		}
		ps, err := policy.ParseFile(data)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", f, err)
		}
		out = append(out, ps...)
	}
	return out, nil
}
