package nvmig

import (
	"fmt"
	"io"
	"sort"
	"strings"
	"sync"
	_ "unsafe" // go:linkname, see typesNvml

	nvdev "github.com/NVIDIA/go-nvlib/pkg/nvlib/device"
	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/gpus"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/server"
	"github.com/NVIDIA/mig-parted/pkg/mig/config"
	"github.com/NVIDIA/mig-parted/pkg/mig/mode"
	"github.com/NVIDIA/mig-parted/pkg/types"
	"github.com/sirupsen/logrus"
)

// mig-parted v0.13.1 parses profile names (pkg/types ParseMigProfile, which
// SetMigConfig's Flatten calls) against the GPUs of a package-level NVML
// handle, nvml.New() unless its tests call types.SetMockNVdevlib(), which
// installs a fixed A100-40GB. On a node that is the node's own GPUs; here it
// must be the mock node being configured, or no profile of another model
// parses. The package exports no setter, so these two names refer to its
// variables (unexported; same types); they are set only while typesMu is
// held, for the duration of one SetMigConfig.
//
//go:linkname typesNvml github.com/NVIDIA/mig-parted/pkg/types.nvmllib
var typesNvml nvml.Interface

//go:linkname typesNvdev github.com/NVIDIA/mig-parted/pkg/types.nvdevlib
var typesNvdev nvdev.Interface

var typesMu sync.Mutex

// Placement is one GPU instance as created: its profile and the memory
// slices it occupies (start, size), as NVML reports its placement.
type Placement struct {
	Profile string `json:"profile"`
	Start   int    `json:"start"`
	Size    int    `json:"size"`
}

func (p Placement) String() string { return fmt.Sprintf("%s@%d:%d", p.Profile, p.Start, p.Size) }

// Counts: profile -> number of instances.
func Counts(ps []Placement) map[string]int {
	out := map[string]int{}
	for _, p := range ps {
		out[p.Profile]++
	}
	return out
}

// FormatPlacements renders one GPU's instances, e.g.
// [3g.40gb@4:4][2g.20gb@0:2][1g.10gb@2:1][1g.10gb@3:1].
func FormatPlacements(ps []Placement) string {
	var b strings.Builder
	for _, p := range ps {
		b.WriteString("[" + p.String() + "]")
	}
	return b.String()
}

// Node is a node's GPUs of one model as NVML shows them: a go-nvml mock
// server whose devices create GPU instances where the driver would
// (driverCreate).
type Node struct {
	Model  *Model
	srv    *server.Server
	devlib nvdev.Interface
}

// NewNode makes a node with count GPUs of the model, MIG disabled.
func NewNode(m *Model, count int) *Node {
	srv, err := server.New(server.WithGPUs(gpus.Multiple(count, m.Config)...))
	if err != nil {
		panic(fmt.Sprintf("go-nvml mock %s: %v", m.Name, err))
	}
	for _, d := range srv.Devices {
		dev := d.(*server.Device)
		m.install(dev)
		dev.CreateGpuInstanceFunc = driverCreate(m, dev)
	}
	return &Node{Model: m, srv: srv, devlib: nvdev.New(srv)}
}

// SetMigMode sets a GPU's MIG mode with mig-parted's mode manager. A GPU
// whose mode changes has no instances afterwards.
func (n *Node) SetMigMode(gpu int, enabled bool) error {
	want := mode.Disabled
	if enabled {
		want = mode.Enabled
	}
	mm := mode.NewMockNvmlMigModeManager(n.srv)
	cur, err := mm.GetMigMode(gpu)
	if err != nil {
		return err
	}
	if cur == want {
		return nil
	}
	if err := mm.SetMigMode(gpu, want); err != nil {
		return err
	}
	d := n.srv.Devices[gpu].(*server.Device)
	d.Lock()
	clear(d.GpuInstances)
	d.Unlock()
	return nil
}

// Result is what mig-parted's SetMigConfig did on one GPU.
type Result struct {
	// Placements: the instances on the GPU afterwards, by start (none
	// after a failure: mig-parted clears the GPU).
	Placements []Placement
	// FailedOrderings: the creation orderings that failed before the one
	// that succeeded (all of them on failure); LastError: the error
	// mig-parted logged for the last of them.
	FailedOrderings int
	LastError       string
}

// SetMigConfig runs mig-parted v0.13.1's pkg/mig/config SetMigConfig on one
// GPU (MIG mode must be on): it clears the GPU, then tries the distinct
// orderings of the instances (largest first) until one can be created, and
// clears the GPU again when none can.
//
// mig-parted's quirk is kept: a profile name that is not a profile of the
// GPU makes its Flatten return nothing, so it creates no instance at all and
// reports success.
func (n *Node) SetMigConfig(gpu int, devices map[string]int) (Result, error) {
	typesMu.Lock()
	defer typesMu.Unlock()
	prevNvml, prevNvdev := typesNvml, typesNvdev
	typesNvml, typesNvdev = n.srv, n.devlib
	defer func() { typesNvml, typesNvdev = prevNvml, prevNvdev }()

	// SetMigConfig logs every failed ordering with logrus's standard logger:
	// keep them for the result instead of printing them.
	std := logrus.StandardLogger()
	hook := &orderingErrors{}
	prevOut := std.Out
	std.SetOutput(io.Discard)
	prevHooks := std.ReplaceHooks(logrus.LevelHooks{})
	std.AddHook(hook)
	defer func() {
		std.ReplaceHooks(prevHooks)
		std.SetOutput(prevOut)
	}()

	err := config.NewMockNvmlMigConfigManager(n.srv).SetMigConfig(gpu, types.MigConfig(devices))
	res := Result{Placements: n.Placements(gpu), FailedOrderings: len(hook.msgs)}
	if len(hook.msgs) > 0 {
		res.LastError = hook.msgs[len(hook.msgs)-1]
	}
	return res, err
}

// Placements lists a GPU's instances by start.
func (n *Node) Placements(gpu int) []Placement {
	d := n.srv.Devices[gpu].(*server.Device)
	d.RLock()
	defer d.RUnlock()
	out := []Placement{}
	for gi := range d.GpuInstances {
		p, _ := n.Model.profileByID(int(gi.Info.ProfileId))
		out = append(out, Placement{Profile: p.Name, Start: int(gi.Info.Placement.Start), Size: int(gi.Info.Placement.Size)})
	}
	sort.Slice(out, func(i, j int) bool {
		if out[i].Start != out[j].Start {
			return out[i].Start < out[j].Start
		}
		return out[i].Profile < out[j].Profile
	})
	return out
}

// Place creates one GPU's instances (one profile name per instance) on a
// fresh GPU of the model with MIG on, as the MIG manager would.
func (m *Model) Place(n *Node, profiles []string) (Result, error) {
	if n == nil {
		n = NewNode(m, 1)
	}
	if err := n.SetMigMode(0, true); err != nil {
		return Result{}, err
	}
	counts := map[string]int{}
	for _, p := range profiles {
		counts[p]++
	}
	return n.SetMigConfig(0, counts)
}

type orderingErrors struct{ msgs []string }

func (h *orderingErrors) Levels() []logrus.Level {
	return []logrus.Level{logrus.ErrorLevel}
}

func (h *orderingErrors) Fire(e *logrus.Entry) error {
	h.msgs = append(h.msgs, e.Message)
	return nil
}
