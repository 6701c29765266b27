// Package nvconf loads NVIDIA device-plugin and mig-parted configs through
// NVIDIA's own Go packages, following the code paths the NVIDIA components
// take when they load a config file:
//
// Device plugin / GPU Feature Discovery v0.19.1 (cmd/nvidia-device-plugin,
// cmd/gpu-feature-discovery):
//  1. spec.NewConfig(c, flags)            exported: YAML -> JSON -> Config with the
//     custom UnmarshalJSON validation (replicas >= 2, resource names, ...),
//     version check, CLI flag / env overrides, MPS failRequestsGreaterThanOne
//     forced to true.
//  2. validateFlags(...)                   unexported in package main: the
//     config-dependent checks are reproduced in validateLoadedConfig below.
//  3. spec.DisableResourceNamingInConfig   exported: drops per-resource rename
//     and devices (with a warning), forces <name>.shared with renameByDefault.
//
// MIG manager / mig-parted v0.13.1: reconfigure runs
// `nvidia-mig-parted assert --valid-config -f <file> -c <selected>`, i.e.
// assert.ParseConfigFile + assert.GetSelectedMigConfig, both exported and
// called directly here.
package nvconf

import (
	"bytes"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"

	spec "github.com/NVIDIA/k8s-device-plugin/api/config/v1"
	cli "github.com/urfave/cli/v2"
	"k8s.io/klog/v2"
)

// MpsRoot is the value the GPU Operator passes to the device plugin as
// MPS_ROOT; with it set, validateFlags accepts MPS.
const MpsRoot = "/run/nvidia/mps"

// DevicePluginOptions describe the environment the device plugin runs in.
type DevicePluginOptions struct {
	// MigStrategyOverride simulates the MIG_STRATEGY environment variable
	// the GPU Operator sets on the device plugin, GFD and MPS daemon
	// containers from ClusterPolicy spec.mig.strategy. urfave/cli then
	// treats --mig-strategy as set, and it wins over flags.migStrategy from
	// the config file. Empty: not set (the config file value counts).
	MigStrategyOverride string
}

// DevicePluginResult holds a successfully loaded config.
type DevicePluginResult struct {
	// Loaded is the config as spec.NewConfig returns it (rename/devices
	// still as written, flags merged with CLI defaults).
	Loaded *spec.Config
	// Effective is Loaded after spec.DisableResourceNamingInConfig: what the
	// plugin and GFD act on.
	Effective *spec.Config
	// Warnings are the klog warnings NVIDIA's code printed while loading
	// (e.g. "Setting the 'rename' field ... Ignoring...").
	Warnings []string
}

// klogMu serialises config loading: klog's output is process-global.
var klogMu sync.Mutex
var klogInit sync.Once

// deviceplugin flags: the subset of the nvidia-device-plugin CLI flags that
// spec.Flags.UpdateFromCLIFlags reads, with the plugin's defaults. No
// EnvVars, so the environment of the test process cannot leak in.
func devicePluginFlags() []cli.Flag {
	return []cli.Flag{
		&cli.StringFlag{Name: "mig-strategy", Value: spec.MigStrategyNone},
		&cli.BoolFlag{Name: "fail-on-init-error", Value: true},
		&cli.StringFlag{Name: "driver-root", Aliases: []string{"nvidia-driver-root"}, Value: "/"},
		&cli.StringFlag{Name: "dev-root", Aliases: []string{"nvidia-dev-root"}},
		&cli.BoolFlag{Name: "pass-device-specs"},
		&cli.StringSliceFlag{Name: "device-list-strategy", Value: cli.NewStringSlice(spec.DeviceListStrategyEnvVar)},
		&cli.StringFlag{Name: "device-id-strategy", Value: spec.DeviceIDStrategyUUID},
		&cli.BoolFlag{Name: "gdrcopy-enabled", Value: true},
		&cli.BoolFlag{Name: "gds-enabled", Value: true},
		&cli.BoolFlag{Name: "mofed-enabled", Value: true},
		&cli.StringFlag{Name: "mps-root"},
		&cli.StringFlag{Name: "device-discovery-strategy", Value: "auto"},
		&cli.StringFlag{Name: "config-file"},
	}
}

// LoadDevicePluginConfig loads data (the content of one device-plugin
// ConfigMap key) exactly as the device plugin does on start-up.
func LoadDevicePluginConfig(data []byte, opts DevicePluginOptions) (*DevicePluginResult, error) {
	dir, err := os.MkdirTemp("", "dp-config-")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(dir)
	path := filepath.Join(dir, "config.yaml")
	if err := os.WriteFile(path, data, 0o600); err != nil {
		return nil, err
	}

	klogMu.Lock()
	defer klogMu.Unlock()
	klogInit.Do(func() {
		fs := flag.NewFlagSet("klog", flag.ContinueOnError)
		klog.InitFlags(fs)
		_ = fs.Set("logtostderr", "false")
		_ = fs.Set("alsologtostderr", "false")
		_ = fs.Set("stderrthreshold", "FATAL")
		_ = fs.Set("skip_headers", "true")
	})
	var logBuf bytes.Buffer
	klog.SetOutput(&logBuf)
	defer klog.SetOutput(discard{})

	load := func() (*spec.Config, error) {
		var cfg *spec.Config
		app := cli.NewApp()
		app.Name = "nvidia-device-plugin"
		app.Flags = devicePluginFlags()
		app.Writer, app.ErrWriter = discard{}, discard{}
		app.Action = func(c *cli.Context) error {
			var err error
			// The exact function the plugin's loadConfig calls.
			cfg, err = spec.NewConfig(c, app.Flags)
			return err
		}
		args := []string{"nvidia-device-plugin", "--config-file", path, "--mps-root", MpsRoot}
		if opts.MigStrategyOverride != "" {
			args = append(args, "--mig-strategy", opts.MigStrategyOverride)
		}
		if err := app.Run(args); err != nil {
			return nil, err
		}
		if err := validateLoadedConfig(cfg); err != nil {
			return nil, err
		}
		return cfg, nil
	}

	loaded, err := load()
	if err != nil {
		return nil, err
	}
	effective, err := load()
	if err != nil {
		return nil, err
	}
	logBuf.Reset()
	spec.DisableResourceNamingInConfig(effective)

	var warnings []string
	for _, line := range strings.Split(logBuf.String(), "\n") {
		if line = strings.TrimSpace(line); line != "" {
			warnings = append(warnings, line)
		}
	}
	return &DevicePluginResult{Loaded: loaded, Effective: effective, Warnings: warnings}, nil
}

// validateLoadedConfig reproduces the config-dependent part of the device
// plugin's (unexported) validateFlags in cmd/nvidia-device-plugin/main.go,
// with the error messages it returns.
func validateLoadedConfig(config *spec.Config) error {
	if config.Flags.MigStrategy == nil {
		return fmt.Errorf("unknown MIG strategy: <nil>")
	}
	if config.Sharing.SharingStrategy() == spec.SharingStrategyMPS {
		if *config.Flags.MigStrategy == spec.MigStrategyMixed {
			return fmt.Errorf("using --mig-strategy=mixed is not supported with MPS")
		}
		if config.Flags.MpsRoot == nil || *config.Flags.MpsRoot == "" {
			return fmt.Errorf("using MPS requires --mps-root to be specified")
		}
	}
	if config.Flags.DeviceDiscoveryStrategy != nil {
		switch *config.Flags.DeviceDiscoveryStrategy {
		case "auto", "nvml", "tegra":
		default:
			return fmt.Errorf("invalid --device-discovery-strategy option %v", *config.Flags.DeviceDiscoveryStrategy)
		}
	}
	switch *config.Flags.MigStrategy {
	case spec.MigStrategyNone, spec.MigStrategySingle, spec.MigStrategyMixed:
	default:
		return fmt.Errorf("unknown MIG strategy: %v", *config.Flags.MigStrategy)
	}
	if err := spec.AssertChannelIDsValid(config.Imex.ChannelIDs); err != nil {
		return fmt.Errorf("invalid IMEX channel IDs: %w", err)
	}
	return nil
}

type discard struct{}

func (discard) Write(p []byte) (int, error) { return len(p), nil }

// NormalizeResourceName applies the device plugin's resource-name rules
// (nvidia.com/ prefix added when missing, length and DNS-subdomain checks).
func NormalizeResourceName(n string) (string, error) {
	r, err := spec.NewResourceName(n)
	return string(r), err
}

// SharedRename is the name a resource gets with renameByDefault.
func SharedRename(name string) string {
	return string(spec.ResourceName(name).DefaultSharedRename())
}
