package main

// The MIG geometry differential test: for every GPU model of the go-nvml
// v0.13.4-1 mock, every multiset of its GPU-instance profiles that fits by
// slice count on one GPU is created the way the MIG manager creates it
// (mig-parted v0.13.1's SetMigConfig on the mock, the driver placing each
// instance: internal/nvmig) and asked of the operator
// (`gpu-sharing-operator mig-geometry --batch`); the verdicts must agree.

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"os/exec"
	"regexp"
	"slices"
	"sort"
	"strconv"
	"strings"
	"time"

	"gpusharing.io/tests/nvidia/internal/nvmig"
)

// documentedDivergence: for each mock model, the profiles whose placements in
// the go-nvml mock differ from NVIDIA's published `nvidia-smi mig -lgipp`
// tables, which the operator's geometry follows (src/nvidia/geometry.rs,
// module doc): the mock gives its H100, H200 and B200 the double-memory 1g at
// {0..6}:1, 3g at {0,4}:3 and 7g at {0}:7 (published: {0,2,4,6}:2, {0,4}:4,
// {0}:8). Layouts with one of them are set aside, not compared; any other
// difference between the two tables fails.
var documentedDivergence = map[string][]string{
	"H100_SXM5_80GB":  {"1g.20gb", "3g.40gb", "7g.80gb"},
	"H200_SXM5_141GB": {"1g.35gb", "3g.71gb", "7g.141gb"},
	"B200_SXM5_180GB": {"1g.45gb", "3g.90gb", "7g.180gb"},
}

// opProfile is one line of `mig-geometry --product X` (the operator's table).
type opProfile struct {
	compute, memory, max int
	starts               []int
}

var opProfileLine = regexp.MustCompile(`^\s+(\S+)\s+compute (\d+)\s+memory (\d+)\s+starts \{([0-9,]*)\}\s+at most (\d+) per GPU$`)

func operatorTable(o *options, m *nvmig.Model) (map[string]opProfile, error) {
	out, err := runOperator(o, nil, "mig-geometry", "--product", m.Product, "--memory", strconv.FormatUint(m.Config.MemoryMB, 10))
	if err != nil {
		return nil, err
	}
	table := map[string]opProfile{}
	for _, line := range strings.Split(string(out), "\n") {
		f := opProfileLine.FindStringSubmatch(line)
		if f == nil {
			continue
		}
		p := opProfile{}
		p.compute, _ = strconv.Atoi(f[2])
		p.memory, _ = strconv.Atoi(f[3])
		p.max, _ = strconv.Atoi(f[5])
		for _, s := range strings.Split(f[4], ",") {
			if n, err := strconv.Atoi(s); err == nil {
				p.starts = append(p.starts, n)
			}
		}
		sort.Ints(p.starts)
		table[f[1]] = p
	}
	if len(table) == 0 {
		return nil, fmt.Errorf("no profiles in its output:\n%s", out)
	}
	return table, nil
}

func runOperator(o *options, stdin []byte, args ...string) ([]byte, error) {
	ctx, cancel := context.WithTimeout(context.Background(), o.timeout)
	defer cancel()
	cmd := exec.CommandContext(ctx, o.bin, args...)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if stdin != nil {
		cmd.Stdin = bytes.NewReader(stdin)
	}
	if err := cmd.Run(); err != nil {
		return nil, fmt.Errorf("%s %s: %v: %s", o.bin, strings.Join(args, " "), err, strings.TrimSpace(stderr.String()))
	}
	return stdout.Bytes(), nil
}

// divergentProfiles: the profiles whose mock data (compute slices, placement
// size and starts, instance count) differ from the operator's table, or that
// only one side has.
func divergentProfiles(m *nvmig.Model, table map[string]opProfile) map[string]string {
	out := map[string]string{}
	for _, p := range m.Profiles {
		op, ok := table[p.Name]
		if !ok {
			out[p.Name] = "not in the operator's table"
			continue
		}
		mock := opProfile{compute: p.Compute, memory: p.Memory, max: p.Max, starts: p.Starts()}
		if mock.compute != op.compute || mock.memory != op.memory || mock.max != op.max || !slices.Equal(mock.starts, op.starts) {
			out[p.Name] = fmt.Sprintf("mock: compute %d, placements %v:%d, at most %d; operator: compute %d, placements %v:%d, at most %d",
				mock.compute, mock.starts, mock.memory, mock.max, op.compute, op.starts, op.memory, op.max)
		}
	}
	for name := range table {
		if _, ok := m.Profile(name); !ok {
			out[name] = "not in the go-nvml mock"
		}
	}
	return out
}

// fittingLayouts: every non-empty multiset of the model's profiles whose
// compute and memory slices add up to no more than the GPU's, largest
// profiles first in each.
func fittingLayouts(m *nvmig.Model) [][]string {
	profiles := slices.Clone(m.Profiles)
	sort.SliceStable(profiles, func(i, j int) bool { return profiles[i].Compute > profiles[j].Compute })
	var out [][]string
	var walk func(i, compute, memory int, cur []string)
	walk = func(i, compute, memory int, cur []string) {
		if i == len(profiles) {
			if len(cur) > 0 {
				out = append(out, slices.Clone(cur))
			}
			return
		}
		p := profiles[i]
		for n := 0; compute+n*p.Compute <= m.ComputeSlices && memory+n*p.Memory <= m.MemorySlices; n++ {
			next := cur
			for k := 0; k < n; k++ {
				next = append(next, p.Name)
			}
			walk(i+1, compute+n*p.Compute, memory+n*p.Memory, next)
		}
	}
	walk(0, 0, 0, nil)
	return out
}

type geoLayout struct {
	profiles []string
	strict   bool
	op       string // operator: feasible, infeasible, unknown-model
	opDetail string
}

type geoModel struct {
	model     *nvmig.Model
	r         *report
	layouts   []*geoLayout
	divergent map[string]string
}

// checkMigGeometry runs the differential test; one report per mock model.
func checkMigGeometry(o *options) ([]string, []*report) {
	t0 := time.Now()
	var models []*geoModel
	var batch bytes.Buffer
	var asked []*geoLayout
	for _, m := range nvmig.Models {
		gm := &geoModel{model: m, r: &report{}}
		models = append(models, gm)
		table, err := operatorTable(o, m)
		if err != nil {
			gm.r.fail("the operator has no MIG geometry for the mock's %s (%s, %d MiB): %v", m, m.Product, m.Config.MemoryMB, err)
			continue
		}
		gm.divergent = divergentProfiles(m, table)
		var got []string
		for name := range gm.divergent {
			got = append(got, name)
		}
		sort.Strings(got)
		want := slices.Clone(documentedDivergence[m.Name])
		sort.Strings(want)
		if !slices.Equal(got, want) {
			var why []string
			for _, name := range got {
				why = append(why, name+" ("+gm.divergent[name]+")")
			}
			gm.r.fail("profiles of %s whose mock data differ from the operator's table: %v, documented: %v (update documentedDivergence only for a difference NVIDIA's published tables explain): %s",
				m, got, want, strings.Join(why, "; "))
		}
		for _, l := range fittingLayouts(m) {
			gl := &geoLayout{profiles: l, strict: true}
			for _, p := range l {
				if _, ok := gm.divergent[p]; ok {
					gl.strict = false
				}
			}
			gm.layouts = append(gm.layouts, gl)
			if gl.strict {
				fmt.Fprintf(&batch, "%s\t%d\t%s\n", m.Product, m.Config.MemoryMB, strings.Join(l, ","))
				asked = append(asked, gl)
			}
		}
	}
	var lines []string
	if len(asked) > 0 {
		out, err := runOperator(o, batch.Bytes(), "mig-geometry", "--batch")
		if err == nil {
			sc := bufio.NewScanner(bytes.NewReader(out))
			sc.Buffer(make([]byte, 1<<20), 1<<20)
			for sc.Scan() {
				lines = append(lines, sc.Text())
			}
			if len(lines) != len(asked) {
				err = fmt.Errorf("%d answers to %d questions", len(lines), len(asked))
			}
		}
		if err != nil {
			for _, gm := range models {
				gm.r.fail("mig-geometry --batch: %v", err)
			}
			lines = nil
		}
	}
	for i, line := range lines {
		f := strings.SplitN(line, "\t", 5)
		if len(f) < 4 {
			continue
		}
		asked[i].op = f[3]
		if len(f) == 5 {
			asked[i].opDetail = f[4]
		}
	}
	var summary []string
	for _, gm := range models {
		if lines == nil || gm.divergent == nil {
			continue
		}
		m := gm.model
		node := nvmig.NewNode(m, 1)
		strict, aside, disagree := 0, 0, 0
		for _, l := range gm.layouts {
			if !l.strict {
				aside++
				continue
			}
			strict++
			res, err := m.Place(node, l.profiles)
			nv, nvDetail := "feasible", nvmig.FormatPlacements(res.Placements)
			if err != nil || len(res.Placements) != len(l.profiles) {
				nv, nvDetail = "infeasible", fmt.Sprintf("%v (%d orderings failed; the last: %s)", err, res.FailedOrderings, res.LastError)
			}
			if nv != l.op {
				disagree++
				if disagree <= 25 {
					gm.r.fail("%s %s: the operator says %s (%s), mig-parted on the go-nvml mock says %s (%s)",
						m.Product, strings.Join(l.profiles, ","), l.op, l.opDetail, nv, nvDetail)
				}
			}
		}
		if disagree > 25 {
			gm.r.fail("%s: %d more disagreements", m.Product, disagree-25)
		}
		var div []string
		for name := range gm.divergent {
			div = append(div, name)
		}
		sort.Strings(div)
		line := fmt.Sprintf("mig-geometry: %-16s %-24s %4d layouts compared strictly, %4d set aside, %d disagreements", m.Name, m.Product, strict, aside, disagree)
		if len(div) > 0 {
			line += fmt.Sprintf(" (set aside: layouts with %s, whose mock placements differ from NVIDIA's published tables)", strings.Join(div, ", "))
		}
		summary = append(summary, line)
	}
	summary = append(summary, fmt.Sprintf("mig-geometry: done in %v", time.Since(t0).Round(time.Millisecond)))
	reports := make([]*report, len(models))
	for i, gm := range models {
		reports[i] = gm.r
	}
	return summary, reports
}
