package main

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/spf13/pflag"
	"k8s.io/klog/v2"
	schedulerapp "k8s.io/kubernetes/cmd/kube-scheduler/app"
	scheduleroptions "k8s.io/kubernetes/cmd/kube-scheduler/app/options"
)

// schedulerArgs are the kube-scheduler flags kube-local decides; everything
// else (profile, plugins, backoffs, client QPS) keeps kube-scheduler's
// defaults, so pods are placed as a real cluster's default scheduler would.
//   - the admin kubeconfig kube-local just wrote (system:masters);
//   - no leader election: one scheduler per kube-local, and a Lease would
//     only add API traffic and a 15 s gap after a crash-restart (--persist);
//   - --secure-port=0: no healthz/metrics server, so parallel kube-local
//     processes cannot collide on its port (10259) and no serving
//     certificate is generated.
func schedulerArgs(kubeconfig string) []string {
	return []string{
		"--kubeconfig=" + kubeconfig,
		"--leader-elect=false",
		"--secure-port=0",
	}
}

// runScheduler starts kube-scheduler in this process: its own options and
// flag parsing, then app.Setup and app.Run, the same calls its command
// makes. Logging and feature gates are process-wide and were already set up
// by the apiserver's flags (--v, --apiserver-arg=--feature-gates=...): the
// scheduler shares them, as it uses the same global registries.
//
// It returns once the scheduler's informers have delivered their initial
// lists (a pod created afterwards is seen as soon as it exists). The
// returned channel yields app.Run's result (nil after ctx is cancelled) and
// is closed when Run has returned.
func runScheduler(ctx context.Context, kubeconfig string, syncTimeout time.Duration) (<-chan error, error) {
	opts := scheduleroptions.NewOptions()
	fs := pflag.NewFlagSet("kube-scheduler", pflag.ContinueOnError)
	for _, f := range opts.Flags.FlagSets {
		fs.AddFlagSet(f)
	}
	if err := fs.Parse(schedulerArgs(kubeconfig)); err != nil {
		return nil, fmt.Errorf("kube-scheduler flags: %w", err)
	}
	// Its log lines carry logger="kube-scheduler" among the apiserver's.
	ctx = klog.NewContext(ctx, klog.LoggerWithName(klog.Background(), "kube-scheduler"))

	cc, sched, err := schedulerapp.Setup(ctx, opts)
	if err != nil {
		return nil, err
	}
	done := make(chan error, 1)
	go func() {
		defer close(done)
		err := schedulerapp.Run(ctx, cc, sched)
		if ctx.Err() != nil {
			// Without leader election Run always ends with an error
			// ("finished without leader elect"); after a requested stop
			// that is the normal end.
			err = nil
		} else {
			// The cluster keeps running, but pods stay Pending: say why.
			logf("kube-scheduler exited: %v", err)
		}
		done <- err
	}()

	syncCtx, cancel := context.WithTimeout(ctx, syncTimeout)
	defer cancel()
	if err := sched.WaitForHandlersSync(syncCtx); err != nil {
		select {
		case err := <-done:
			return nil, fmt.Errorf("exited while starting: %v", err)
		default:
		}
		if errors.Is(err, context.DeadlineExceeded) {
			err = fmt.Errorf("informers not synced within %s", syncTimeout)
		}
		return done, err
	}
	return done, nil
}
