package main

import (
	"fmt"
	"net"
	"net/url"
	"os"
	"time"

	"go.etcd.io/etcd/server/v3/embed"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
)

// freePort asks the kernel for an unused 127.0.0.1 port. The port is released
// again before etcd binds it, so a start can (rarely) race with another
// process; startEtcd retries in that case.
func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

// etcdLogLevel is etcd's log level; quiet() raises it before a shutdown,
// during which etcd reports every closed listener as an error.
var etcdLogLevel = zap.NewAtomicLevelAt(zapcore.ErrorLevel)

func quietEtcd() { etcdLogLevel.SetLevel(zapcore.FatalLevel) }

func etcdLogger(level string) (*zap.Logger, error) {
	if err := etcdLogLevel.UnmarshalText([]byte(level)); err != nil {
		return nil, fmt.Errorf("etcd log level: %w", err)
	}
	cfg := zap.NewProductionConfig()
	cfg.Level = etcdLogLevel
	cfg.Sampling = nil
	cfg.OutputPaths = []string{"stderr"}
	cfg.ErrorOutputPaths = []string{"stderr"}
	return cfg.Build()
}

// startEtcd runs a single-member etcd inside this process with its data in
// dataDir and returns it with its client URL. fresh: the directory holds no data
// worth keeping, so a failed attempt may wipe it (never on a restart).
func startEtcd(dataDir string, logLevel string, fresh bool) (*embed.Etcd, string, error) {
	var lastErr error
	for attempt := 0; attempt < 5; attempt++ {
		if attempt > 0 && fresh {
			// A failed start may have left a half-initialised member behind.
			_ = os.RemoveAll(dataDir)
		}
		if err := os.MkdirAll(dataDir, 0o700); err != nil {
			return nil, "", err
		}
		e, clientURL, err := startEtcdOnce(dataDir, logLevel)
		if err == nil {
			return e, clientURL, nil
		}
		lastErr = err
		time.Sleep(200 * time.Millisecond)
	}
	return nil, "", lastErr
}

func startEtcdOnce(dataDir string, logLevel string) (*embed.Etcd, string, error) {
	cport, err := freePort()
	if err != nil {
		return nil, "", err
	}
	pport, err := freePort()
	if err != nil {
		return nil, "", err
	}
	curl, _ := url.Parse(fmt.Sprintf("http://127.0.0.1:%d", cport))
	purl, _ := url.Parse(fmt.Sprintf("http://127.0.0.1:%d", pport))

	cfg := embed.NewConfig()
	cfg.Name = "kube-local"
	cfg.Dir = dataDir
	cfg.ListenClientUrls = []url.URL{*curl}
	cfg.AdvertiseClientUrls = []url.URL{*curl}
	cfg.ListenPeerUrls = []url.URL{*purl}
	cfg.AdvertisePeerUrls = []url.URL{*purl}
	cfg.InitialCluster = fmt.Sprintf("%s=%s", cfg.Name, purl.String())
	cfg.ClusterState = embed.ClusterStateFlagNew
	lg, err := etcdLogger(logLevel)
	if err != nil {
		return nil, "", err
	}
	cfg.Logger = "zap"
	cfg.ZapLoggerBuilder = embed.NewZapLoggerBuilder(lg)
	// Throwaway test data: durability is not needed, speed is.
	cfg.UnsafeNoFsync = true
	cfg.QuotaBackendBytes = 2 << 30
	cfg.AutoCompactionMode = embed.CompactorModePeriodic
	cfg.AutoCompactionRetention = "5m"

	e, err := embed.StartEtcd(cfg)
	if err != nil {
		return nil, "", fmt.Errorf("start etcd: %w", err)
	}
	select {
	case <-e.Server.ReadyNotify():
		return e, curl.String(), nil
	case err := <-e.Err():
		e.Close()
		return nil, "", fmt.Errorf("etcd failed: %w", err)
	case <-time.After(60 * time.Second):
		e.Server.Stop()
		e.Close()
		return nil, "", fmt.Errorf("etcd did not become ready within 60s")
	}
}
