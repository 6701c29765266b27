package main

import (
	"context"
	"fmt"
	"net"
	"strconv"

	"github.com/spf13/pflag"
	utilerrors "k8s.io/apimachinery/pkg/util/errors"
	"k8s.io/client-go/rest"
	basecompatibility "k8s.io/component-base/compatibility"
	logsapi "k8s.io/component-base/logs/api/v1"
	"k8s.io/kubernetes/cmd/kube-apiserver/app"
	"k8s.io/kubernetes/cmd/kube-apiserver/app/options"
)

// apiserverConfig is what kube-local decides; everything else keeps the
// kube-apiserver defaults.
type apiserverConfig struct {
	listener   net.Listener
	etcdURL    string
	pki        *pki
	certDir    string
	extraArgs  []string
	verbosity  int
	advertise  string
	serviceNet string
}

func apiserverArgs(c apiserverConfig) []string {
	port := c.listener.Addr().(*net.TCPAddr).Port
	args := []string{
		"--etcd-servers=" + c.etcdURL,
		"--bind-address=127.0.0.1",
		"--secure-port=" + strconv.Itoa(port),
		"--advertise-address=" + c.advertise,
		"--endpoint-reconciler-type=none",
		"--service-cluster-ip-range=" + c.serviceNet,
		"--tls-cert-file=" + c.pki.servingCert,
		"--tls-private-key-file=" + c.pki.servKey,
		"--cert-dir=" + c.certDir,
		"--client-ca-file=" + c.pki.caCert,
		"--service-account-issuer=https://kubernetes.default.svc.cluster.local",
		"--service-account-key-file=" + c.pki.saKey,
		"--service-account-signing-key-file=" + c.pki.saKey,
		"--api-audiences=https://kubernetes.default.svc.cluster.local",
		"--authorization-mode=RBAC",
		// ServiceAccount: pods need no token secrets (no controller-manager).
		// TaintNodesByCondition: the simulated GPU nodes are meant to look
		// healthy; it would add node.kubernetes.io/not-ready:NoSchedule.
		"--disable-admission-plugins=ServiceAccount,TaintNodesByCondition",
		"--allow-privileged=true",
		"--profiling=false",
		"--v=" + strconv.Itoa(c.verbosity),
	}
	return append(args, c.extraArgs...)
}

// runAPIServer parses the kube-apiserver flags exactly like the real binary
// does (same options, same validation) and serves until ctx is cancelled.
// The returned channel yields the result of the server's Run.
func runAPIServer(ctx context.Context, c apiserverConfig) (<-chan error, error) {
	s := options.NewServerRunOptions()
	fs := pflag.NewFlagSet("kube-apiserver", pflag.ContinueOnError)
	for _, f := range s.Flags().FlagSets {
		fs.AddFlagSet(f)
	}
	if err := fs.Parse(apiserverArgs(c)); err != nil {
		return nil, fmt.Errorf("kube-apiserver flags: %w", err)
	}
	// Use our already-bound listener: no window in which another process can
	// take the port.
	s.SecureServing.Listener = c.listener
	s.SecureServing.BindPort = c.listener.Addr().(*net.TCPAddr).Port

	if err := s.GenericServerRunOptions.ComponentGlobalsRegistry.Set(); err != nil {
		return nil, err
	}
	featureGate := s.GenericServerRunOptions.ComponentGlobalsRegistry.FeatureGateFor(basecompatibility.DefaultKubeComponent)
	if err := logsapi.ValidateAndApply(s.Logs, featureGate); err != nil {
		return nil, err
	}
	// The loopback client should not log warnings about its own requests.
	rest.SetDefaultWarningHandler(rest.NoWarnings{})

	completed, err := s.Complete(ctx)
	if err != nil {
		return nil, err
	}
	if errs := completed.Validate(); len(errs) != 0 {
		return nil, utilerrors.NewAggregate(errs)
	}
	done := make(chan error, 1)
	go func() {
		done <- app.Run(ctx, completed)
		close(done)
	}()
	return done, nil
}
