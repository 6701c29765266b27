// Command kube-local runs a throwaway Kubernetes control plane (etcd and
// kube-apiserver, both inside this one process) for the gpu-sharing-operator
// tests and demo, seeds it with what the NVIDIA GPU Operator and GPU Feature
// Discovery would have created, writes an admin kubeconfig and prints
// "READY <kubeconfig>" on stdout.
//
// It stops (apiserver, then etcd) on SIGINT/SIGTERM, when its stdin reaches
// EOF (--watch-stdin, on by default: a parent holding a pipe to stdin takes
// it down by dying) and when its parent process goes away (--watch-parent).
// Everything runs in this process, so nothing can be left behind.
package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/signal"
	"path/filepath"
	"strconv"
	"sync"
	"syscall"
	"time"

	"github.com/spf13/pflag"
	etcdversion "go.etcd.io/etcd/api/v3/version"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc/grpclog"
	"k8s.io/component-base/version"
)

func logf(format string, args ...any) {
	fmt.Fprintf(os.Stderr, "kube-local: "+format+"\n", args...)
}

type kubeLocalOptions struct {
	dir               string
	port              int
	namespace         string
	noNodes           bool
	noGPUOperator     bool
	nodesFile         string
	fixturesDir       string
	assetsDir         string
	crdFile           string
	clusterPolicyFile string
	migConfigFile     string
	manifests         []string
	apiserverArgs     []string
	verbosity         int
	etcdLogLevel      string
	watchStdin        bool
	watchParent       bool
	pdeathsig         bool
	controllers       bool
	scheduler         bool
	keep              bool
	persist           bool
	readyTimeout      time.Duration
}

func parseFlags() (*kubeLocalOptions, error) {
	o := &kubeLocalOptions{}
	fs := pflag.NewFlagSet("kube-local", pflag.ContinueOnError)
	fs.StringVar(&o.dir, "dir", "", "directory for kubeconfig, certificates and the etcd data (a temp dir under it); default: a new temp dir, removed on exit")
	fs.IntVar(&o.port, "port", 0, "kube-apiserver secure port on 127.0.0.1 (0: a free port)")
	fs.StringVar(&o.namespace, "gpu-operator-namespace", "gpu-operator", "namespace the simulated GPU Operator runs in (ClusterPolicy status.namespace)")
	fs.BoolVar(&o.noNodes, "no-nodes", false, "do not seed the simulated nodes")
	fs.BoolVar(&o.noGPUOperator, "no-gpu-operator", false, "do not seed the GPU Operator (namespace, ClusterPolicy CRD and object, default-mig-parted-config)")
	fs.StringVar(&o.nodesFile, "nodes", "", "nodes manifest (default: <fixtures>/nodes.yaml)")
	fs.StringVar(&o.fixturesDir, "fixtures", "", "directory with nodes.yaml and clusterpolicy.yaml (default: <exe dir>/fixtures, else <exe dir>/../../tests/cluster/fixtures)")
	fs.StringVar(&o.assetsDir, "assets", "", "directory with the GPU Operator's nvidia.com_clusterpolicies.yaml and default-mig-parted-config.yaml (default: <exe dir>/assets, filled by cluster.sh build)")
	fs.StringVar(&o.crdFile, "clusterpolicy-crd", "", "ClusterPolicy CRD manifest (default: <assets>/nvidia.com_clusterpolicies.yaml)")
	fs.StringVar(&o.clusterPolicyFile, "clusterpolicy", "", "ClusterPolicy manifest (default: <fixtures>/clusterpolicy.yaml)")
	fs.StringVar(&o.migConfigFile, "mig-parted-config", "", "default-mig-parted-config ConfigMap manifest (default: <assets>/default-mig-parted-config.yaml if present)")
	fs.StringArrayVar(&o.manifests, "manifest", nil, "extra manifest file or directory to apply after seeding (repeatable)")
	fs.StringArrayVar(&o.apiserverArgs, "apiserver-arg", nil, "extra kube-apiserver flag, e.g. --apiserver-arg=--feature-gates=X=true (repeatable)")
	fs.IntVar(&o.verbosity, "v", 0, "kube-apiserver log verbosity")
	fs.StringVar(&o.etcdLogLevel, "etcd-log-level", "error", "etcd log level")
	fs.BoolVar(&o.watchStdin, "watch-stdin", true, "exit when stdin reaches EOF")
	fs.BoolVar(&o.watchParent, "watch-parent", true, "exit when the parent process exits")
	fs.BoolVar(&o.pdeathsig, "pdeathsig", false, "ask the kernel for SIGTERM when the parent dies (PR_SET_PDEATHSIG); beware: it fires when the parent *thread* that started kube-local exits, so not for multi-threaded parents such as test harnesses")
	fs.BoolVar(&o.controllers, "controllers", true, "run the garbage-collector, namespace, disruption and resourceclaim controllers (of kube-controller-manager) in-process")
	fs.BoolVar(&o.scheduler, "scheduler", false, "run kube-scheduler (default profile, no leader election, no serving port) in-process: pods without spec.nodeName are bound to nodes by their allocatable, taints, affinity, ...")
	fs.BoolVar(&o.keep, "keep", false, "keep the etcd data on exit")
	fs.BoolVar(&o.persist, "persist", false, "with --dir: keep the etcd data (<dir>/etcd) and certificates (<dir>/pki) there and, when they exist, start again on them (a restart: same objects, same CA and admin credentials, nothing seeded); pass the same --port to keep the kubeconfig valid")
	fs.DurationVar(&o.readyTimeout, "ready-timeout", 90*time.Second, "how long to wait for the apiserver to become ready")
	showVersion := fs.Bool("version", false, "print the Kubernetes version and exit")
	if err := fs.Parse(os.Args[1:]); err != nil {
		return nil, err
	}
	if *showVersion {
		fmt.Println(version.Get().GitVersion)
		os.Exit(0)
	}
	return o, nil
}

// resolveInputs fills in default file locations relative to the executable.
func (o *kubeLocalOptions) resolveInputs() error {
	exe, err := os.Executable()
	if err != nil {
		return err
	}
	if r, err := filepath.EvalSymlinks(exe); err == nil {
		exe = r
	}
	exeDir := filepath.Dir(exe)
	firstDir := func(cands ...string) string {
		for _, c := range cands {
			if st, err := os.Stat(c); err == nil && st.IsDir() {
				return c
			}
		}
		return ""
	}
	if o.fixturesDir == "" {
		o.fixturesDir = firstDir(filepath.Join(exeDir, "fixtures"), filepath.Join(exeDir, "..", "..", "tests", "cluster", "fixtures"))
	}
	if o.assetsDir == "" {
		o.assetsDir = firstDir(filepath.Join(exeDir, "assets"))
	}
	need := func(flag, dir, name string, val *string) error {
		if *val != "" {
			return nil
		}
		if dir == "" {
			return fmt.Errorf("cannot find %s: pass --%s (or build with tests/cluster/cluster.sh build)", name, flag)
		}
		*val = filepath.Join(dir, name)
		if _, err := os.Stat(*val); err != nil {
			return fmt.Errorf("%s: %w", flag, err)
		}
		return nil
	}
	if !o.noNodes {
		if err := need("nodes", o.fixturesDir, "nodes.yaml", &o.nodesFile); err != nil {
			return err
		}
	} else {
		o.nodesFile = ""
	}
	if !o.noGPUOperator {
		if err := need("clusterpolicy", o.fixturesDir, "clusterpolicy.yaml", &o.clusterPolicyFile); err != nil {
			return err
		}
		if err := need("clusterpolicy-crd", o.assetsDir, "nvidia.com_clusterpolicies.yaml", &o.crdFile); err != nil {
			return err
		}
		if o.migConfigFile == "" && o.assetsDir != "" {
			p := filepath.Join(o.assetsDir, "default-mig-parted-config.yaml")
			if _, err := os.Stat(p); err == nil {
				o.migConfigFile = p
			}
		}
	}
	return nil
}

func main() {
	o, err := parseFlags()
	if errors.Is(err, pflag.ErrHelp) {
		os.Exit(0)
	}
	if err != nil {
		logf("%v", err)
		os.Exit(2)
	}
	os.Exit(run(o))
}

func run(o *kubeLocalOptions) int {
	if err := o.resolveInputs(); err != nil {
		logf("%v", err)
		return 2
	}

	if o.verbosity < 2 {
		// The etcd client's gRPC channels warn about every connection torn
		// down while the apiserver probes and closes its storage clients:
		// harmless noise that buries real errors in the log.
		grpclog.SetLoggerV2(grpclog.NewLoggerV2(io.Discard, io.Discard, os.Stderr))
	}

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	stopReason := make(chan string, 4)
	stop := func(why string) {
		select {
		case stopReason <- why:
		default:
		}
		cancel()
	}
	// orphaned: whoever started us is gone, nobody will use the cluster
	// again. Without --keep there is nothing to save: remove our files and
	// exit at once instead of shutting down gracefully (about a second).
	var cleanupMu sync.Mutex
	var cleanupFn func()
	orphaned := func(why string) {
		if o.keep {
			stop(why)
			return
		}
		cleanupMu.Lock()
		f := cleanupFn
		cleanupMu.Unlock()
		logf("%s: exiting", why)
		if f != nil {
			f()
		}
		os.Exit(0)
	}

	// Ask the kernel to SIGTERM us if the thread that started us dies. This
	// fires on the parent *thread*'s exit, which is fine for a shell parent;
	// multi-threaded parents are covered by --watch-stdin/--watch-parent.
	if o.pdeathsig {
		_ = unix.Prctl(unix.PR_SET_PDEATHSIG, uintptr(syscall.SIGTERM), 0, 0, 0)
	}

	sigs := make(chan os.Signal, 2)
	signal.Notify(sigs, syscall.SIGINT, syscall.SIGTERM, syscall.SIGHUP)
	go func() {
		s := <-sigs
		stop("signal " + s.String())
		// A second signal while shutting down: go now.
		s = <-sigs
		logf("second signal %s: exiting immediately", s)
		os.Exit(130)
	}()
	if o.watchStdin {
		go func() {
			_, _ = io.Copy(io.Discard, os.Stdin)
			orphaned("stdin closed")
		}()
	}
	if o.watchParent {
		ppid := os.Getppid()
		go func() {
			for {
				time.Sleep(500 * time.Millisecond)
				if os.Getppid() != ppid {
					orphaned("parent process exited")
					return
				}
			}
		}()
	}

	// Directories.
	base := o.dir
	removeBase := false
	if base == "" {
		d, err := os.MkdirTemp("", "kube-local-")
		if err != nil {
			logf("%v", err)
			return 1
		}
		base, removeBase = d, !o.keep
	} else if err := os.MkdirAll(base, 0o755); err != nil {
		logf("%v", err)
		return 1
	}
	base, _ = filepath.Abs(base)
	var etcdDir string
	restarted := false
	if o.persist {
		if o.dir == "" {
			logf("--persist needs --dir")
			return 1
		}
		etcdDir = filepath.Join(base, "etcd")
		if _, err := os.Stat(filepath.Join(etcdDir, "member")); err == nil {
			restarted = true
		}
	} else {
		d, err := os.MkdirTemp(base, "etcd-")
		if err != nil {
			logf("%v", err)
			return 1
		}
		etcdDir = d
	}
	cleanup := func() {
		if removeBase {
			_ = os.RemoveAll(base)
		} else if !o.keep && !o.persist {
			_ = os.RemoveAll(etcdDir)
		}
	}
	cleanupMu.Lock()
	cleanupFn = cleanup
	cleanupMu.Unlock()
	defer cleanup()

	code := serve(ctx, o, base, etcdDir, restarted, stopReason)
	return code
}

// serve starts etcd and the apiserver, seeds, announces READY and blocks
// until ctx is cancelled, then shuts both down.
func serve(ctx context.Context, o *kubeLocalOptions, base, etcdDir string, restarted bool, stopReason <-chan string) int {
	start := time.Now()
	logf("Kubernetes %s, data in %s", version.Get().GitVersion, base)
	if restarted {
		logf("restarting on the etcd data and certificates in %s", base)
	}

	etcd, etcdURL, err := startEtcd(etcdDir, o.etcdLogLevel, !restarted)
	if err != nil {
		logf("%v", err)
		return 1
	}
	defer func() {
		quietEtcd()
		etcd.Close()
		logf("etcd stopped")
	}()
	logf("etcd %s ready at %s (%.1fs)", etcdversion.Version, etcdURL, time.Since(start).Seconds())

	listener, err := net.Listen("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(o.port)))
	if err != nil {
		logf("listen: %v", err)
		return 1
	}
	port := listener.Addr().(*net.TCPAddr).Port
	p, err := generatePKI(filepath.Join(base, "pki"), restarted,
		[]net.IP{net.ParseIP("127.0.0.1"), net.ParseIP("10.0.0.1")},
		[]string{"localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc", "kubernetes.default.svc.cluster.local"})
	if err != nil {
		listener.Close()
		logf("certificates: %v", err)
		return 1
	}
	apiCtx, apiCancel := context.WithCancel(context.Background())
	defer apiCancel()
	done, err := runAPIServer(apiCtx, apiserverConfig{
		listener:   listener,
		etcdURL:    etcdURL,
		pki:        p,
		certDir:    filepath.Join(base, "pki"),
		extraArgs:  o.apiserverArgs,
		verbosity:  o.verbosity,
		advertise:  "10.0.0.1",
		serviceNet: "10.0.0.0/24",
	})
	if err != nil {
		listener.Close()
		logf("kube-apiserver: %v", err)
		return 1
	}
	// shutdown stops the apiserver and waits for it (bounded).
	shutdown := func() {
		apiCancel()
		select {
		case err := <-done:
			if err != nil {
				logf("kube-apiserver exited: %v", err)
			} else {
				logf("kube-apiserver stopped")
			}
		case <-time.After(20 * time.Second):
			logf("kube-apiserver did not stop within 20s")
		}
	}

	kubeconfig := filepath.Join(base, "kubeconfig")
	server := fmt.Sprintf("https://127.0.0.1:%d", port)
	cfg, err := writeKubeconfig(kubeconfig, server, p)
	if err != nil {
		shutdown()
		logf("kubeconfig: %v", err)
		return 1
	}

	// Wait for readiness, but give up as soon as we are told to stop or the
	// apiserver dies.
	readyCtx, readyCancel := context.WithCancel(ctx)
	defer readyCancel()
	var apiErr error
	apiDied := make(chan struct{})
	go func() {
		select {
		case err, ok := <-done:
			if ok {
				apiErr = err
			}
			close(apiDied)
			readyCancel()
		case <-apiCtx.Done():
		}
	}()
	if err := waitReady(readyCtx, cfg, o.readyTimeout); err != nil {
		select {
		case <-apiDied:
			logf("kube-apiserver exited: %v", apiErr)
			return 1
		default:
		}
		shutdown()
		if ctx.Err() != nil {
			logf("stopped before ready: %s", reason(stopReason))
			return 0
		}
		logf("%v", err)
		return 1
	}
	logf("kube-apiserver ready at %s (%.1fs)", server, time.Since(start).Seconds())

	// Controllers stop before the apiserver does.
	ctrlCtx, ctrlCancel := context.WithCancel(readyCtx)
	defer ctrlCancel()
	if o.controllers {
		if err := startControllers(ctrlCtx, cfg); err != nil {
			ctrlCancel()
			shutdown()
			logf("controllers: %v", err)
			return 1
		}
		logf("garbage-collector, namespace, disruption and resourceclaim controllers running")
	}
	// stopControllers stops the in-process controllers and waits (bounded)
	// for the scheduler, so that it does not outlive the apiserver.
	stopControllers := ctrlCancel
	if o.scheduler {
		schedDone, err := runScheduler(ctrlCtx, kubeconfig, o.readyTimeout)
		stopControllers = func() {
			ctrlCancel()
			if schedDone == nil {
				return
			}
			select {
			case <-schedDone:
			case <-time.After(10 * time.Second):
				logf("kube-scheduler did not stop within 10s")
			}
		}
		if err != nil {
			stopControllers()
			shutdown()
			if ctx.Err() != nil {
				logf("stopped before ready: %s", reason(stopReason))
				return 0
			}
			logf("kube-scheduler: %v", err)
			return 1
		}
		logf("kube-scheduler running")
	}

	if restarted {
		logf("ready in %.1fs (restarted: nothing seeded)", time.Since(start).Seconds())
		fmt.Fprintf(os.Stdout, "READY %s\n", kubeconfig)
		return waitStop(ctx, stopReason, stopControllers, shutdown, apiDied, &apiErr)
	}
	err = seed(readyCtx, cfg, seedOptions{
		namespace:         o.namespace,
		gpuOperator:       !o.noGPUOperator,
		crdFile:           o.crdFile,
		clusterPolicyFile: o.clusterPolicyFile,
		migConfigFile:     o.migConfigFile,
		nodesFile:         o.nodesFile,
		extra:             o.manifests,
	})
	if err != nil {
		stopControllers()
		shutdown()
		if ctx.Err() != nil {
			logf("stopped while seeding: %s", reason(stopReason))
			return 0
		}
		logf("seeding: %v", err)
		return 1
	}
	if !o.noGPUOperator {
		logf("seeded GPU Operator in namespace %s (CRD %s)", o.namespace, o.crdFile)
	}
	logf("ready in %.1fs", time.Since(start).Seconds())
	fmt.Fprintf(os.Stdout, "READY %s\n", kubeconfig)
	return waitStop(ctx, stopReason, stopControllers, shutdown, apiDied, &apiErr)
}

// waitStop blocks until kube-local is told to stop (then stops the controllers and the
// apiserver) or the apiserver dies.
func waitStop(ctx context.Context, stopReason <-chan string, ctrlCancel func(), shutdown func(), apiDied <-chan struct{}, apiErr *error) int {
	select {
	case <-ctx.Done():
		logf("stopping: %s", reason(stopReason))
		ctrlCancel()
		shutdown()
		return 0
	case <-apiDied:
		logf("kube-apiserver exited unexpectedly: %v", *apiErr)
		return 1
	}
}

func reason(c <-chan string) string {
	select {
	case r := <-c:
		return r
	default:
		return "cancelled"
	}
}
