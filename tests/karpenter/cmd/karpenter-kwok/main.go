// Command karpenter-kwok runs Karpenter's own controllers (sigs.k8s.io/karpenter
// v1.8.0: provisioning, disruption, NodeClaim lifecycle, NodeOverlay, ...) with
// Karpenter's kwok cloud provider, against the API server named by KUBECONFIG.
//
// The kwok provider "launches" an instance by creating a Node object (no kubelet,
// no VM); instance types come from INSTANCE_TYPES_FILE_PATH (a JSON list, see
// README.md). Upstream's equivalent is sigs.k8s.io/karpenter/kwok/main.go, a
// package main that cannot be imported; this is our own wiring of the same
// public packages, plus a check of the instance types so that a file in the
// wrong format fails at start instead of silently matching nothing.
//
// All configuration is Karpenter's: environment variables or flags read by
// sigs.k8s.io/karpenter/pkg/operator/options and sigs.k8s.io/karpenter/kwok/options
// (FEATURE_GATES, DISABLE_LEADER_ELECTION, METRICS_PORT, HEALTH_PROBE_PORT, ...).
package main

import (
	"context"
	"fmt"
	"io"
	"os"
	"os/signal"
	"strconv"
	"syscall"

	corev1 "k8s.io/api/core/v1"
	"sigs.k8s.io/controller-runtime/pkg/log"

	kwok "sigs.k8s.io/karpenter/kwok/cloudprovider"
	karpv1 "sigs.k8s.io/karpenter/pkg/apis/v1"
	"sigs.k8s.io/karpenter/pkg/cloudprovider"
	"sigs.k8s.io/karpenter/pkg/cloudprovider/overlay"
	"sigs.k8s.io/karpenter/pkg/controllers"
	"sigs.k8s.io/karpenter/pkg/controllers/state"
	"sigs.k8s.io/karpenter/pkg/operator"
)

func main() {
	// Parses Karpenter's options (flags and environment), sets up logging, the
	// controller-runtime manager (metrics, health probes, leader election) and
	// the store that NodeOverlays are resolved into.
	ctx, op := operator.NewOperator()
	logger := log.FromContext(ctx)

	types, err := kwok.ConstructInstanceTypes(ctx)
	if err == nil {
		err = checkInstanceTypes(types)
	}
	if err != nil {
		// Upstream only logs this and runs on with no instance types: every pod
		// would then be unschedulable for a reason unrelated to the test.
		logger.Error(err, "instance types")
		os.Exit(1)
	}
	for _, it := range types {
		logger.Info("instance type", "name", it.Name, "capacity", it.Capacity, "offerings", len(it.Offerings))
	}

	// Two views of the same provider: the scheduler sees instance types with
	// NodeOverlays applied (when FEATURE_GATES has NodeOverlay=true), while the
	// NodeOverlay controller needs the undecorated ones to compute overlays from.
	base := kwok.NewCloudProvider(ctx, op.GetClient(), types)
	withOverlays := overlay.Decorate(base, op.GetClient(), op.InstanceTypeStore)
	cluster := state.NewCluster(op.Clock, op.GetClient(), withOverlays)

	op.WithControllers(ctx, controllers.NewControllers(ctx, op.Manager, op.Clock, op.GetClient(),
		op.EventRecorder, withOverlays, base, cluster, op.InstanceTypeStore)...)

	// Upstream's operator runs until killed. Stop cleanly on SIGINT/SIGTERM and,
	// with EXIT_ON_STDIN_EOF=true, when stdin closes: a test harness that dies
	// without cleaning up then takes this process with it.
	runCtx, stop := signal.NotifyContext(ctx, os.Interrupt, syscall.SIGTERM)
	defer stop()
	if exit, _ := strconv.ParseBool(os.Getenv("EXIT_ON_STDIN_EOF")); exit {
		var cancel context.CancelFunc
		runCtx, cancel = context.WithCancel(runCtx)
		go func() {
			_, _ = io.Copy(io.Discard, os.Stdin)
			logger.Info("stdin closed: stopping")
			cancel()
		}()
	}
	op.Start(runCtx)
}

// checkInstanceTypes rejects an instance-types file Karpenter would accept but
// could never launch from. The kwok provider decodes offerings as
// {"Price", "Available", "Requirements": [node selector requirements]}; other
// keys (such as the "zone" and "capacityType" of kwok/examples in v1.8.0) are
// dropped without error, leaving offerings that match no zone.
func checkInstanceTypes(types []*cloudprovider.InstanceType) error {
	if len(types) == 0 {
		return fmt.Errorf("no instance types")
	}
	for _, it := range types {
		if len(it.Offerings) == 0 {
			return fmt.Errorf("instance type %q has no offerings", it.Name)
		}
		for i, of := range it.Offerings {
			for _, key := range []string{corev1.LabelTopologyZone, karpv1.CapacityTypeLabelKey} {
				if !of.Requirements.Has(key) || len(of.Requirements.Get(key).Values()) == 0 {
					return fmt.Errorf("instance type %q offering %d: no %q requirement (offerings are {\"Price\": 1.0, \"Requirements\": [{\"key\": %q, \"operator\": \"In\", \"values\": [...]}, ...]})",
						it.Name, i, key, key)
				}
			}
		}
	}
	return nil
}
