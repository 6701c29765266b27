// Command fault-proxy is a test-only TLS proxy between the operator and the
// local kube-apiserver that injects API errors (tests/e2e_chaos.rs).
//
// It terminates TLS with a certificate of its own (a fresh CA and a serving
// certificate for 127.0.0.1, written to --dir together with a kubeconfig that
// trusts that CA and nothing else), and forwards every request to the API
// server as the local control plane's admin (its client certificate), like
// `kubectl proxy`. A fraction (--rate) of the requests, chosen by a seeded
// random source, get a fault instead:
//
//	429       TooManyRequests with Retry-After: 1, not forwarded
//	500       InternalError, not forwarded
//	409       Conflict, not forwarded (writes only; reads get a 500)
//	drop      the connection is closed before the request is forwarded
//	lost      the request is forwarded and applied, then the connection is
//	          closed before the answer: the client cannot know it was applied
//	          (not for watches)
//
// Watches get only 429, 500 and drop when they start and, while the rate is
// not 0, are cut after 50-100% of --watch-cut, as a restarting API server or a
// load balancer would. POST /fault-proxy/rate?value=F changes the rate at run
// time; POST /fault-proxy/delay?suffix=S&value=D delays every request whose
// path ends with S by D before it goes on (value 0 removes it: a slow answer,
// not an error); GET /fault-proxy/stats returns the counts as JSON. It prints
// "READY <kubeconfig>" on stdout once it listens.
package main

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/base64"
	"encoding/json"
	"encoding/pem"
	"flag"
	"fmt"
	"io"
	"log"
	"math/big"
	mrand "math/rand/v2"
	"net"
	"net/http"
	"net/http/httputil"
	"net/url"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"time"
)

type stats struct {
	Requests      int `json:"requests"`
	Forwarded     int `json:"forwarded"`
	Watches       int `json:"watches"`
	WatchesCut    int `json:"watchesCut"`
	Status429     int `json:"429"`
	Status500     int `json:"500"`
	Status409     int `json:"409"`
	Dropped       int `json:"dropped"`
	Lost          int `json:"lost"`
	WritesApplied int `json:"writesApplied"`
	Delayed       int `json:"delayed"`
}

type proxy struct {
	upstream  *url.URL
	transport *http.Transport
	rp        *httputil.ReverseProxy
	watchCut  time.Duration

	mu   sync.Mutex
	rng  *mrand.Rand
	rate   float64
	st     stats
	delays map[string]time.Duration
}

// delay is how long a request to path waits before it is handled (and counts it).
func (p *proxy) delay(path string) time.Duration {
	p.mu.Lock()
	defer p.mu.Unlock()
	for suffix, d := range p.delays {
		if strings.HasSuffix(path, suffix) {
			p.st.Delayed++
			return d
		}
	}
	return 0
}

func isWrite(m string) bool {
	return m == http.MethodPost || m == http.MethodPut || m == http.MethodPatch || m == http.MethodDelete
}

func isWatch(r *http.Request) bool {
	w := r.URL.Query().Get("watch")
	return w == "true" || w == "1"
}

// pick decides the fault for one request ("" for none) and counts it.
func (p *proxy) pick(r *http.Request) (fault string, cut time.Duration) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.st.Requests++
	watch := isWatch(r)
	if watch {
		p.st.Watches++
		if p.rate > 0 && p.watchCut > 0 {
			cut = time.Duration(float64(p.watchCut) * (0.5 + p.rng.Float64()/2))
		}
	}
	if p.rng.Float64() >= p.rate {
		return "", cut
	}
	kinds := []string{"429", "500", "409", "drop", "lost"}
	if watch {
		kinds = []string{"429", "500", "drop"}
	}
	fault = kinds[p.rng.IntN(len(kinds))]
	if fault == "409" && !isWrite(r.Method) {
		fault = "500"
	}
	switch fault {
	case "429":
		p.st.Status429++
	case "500":
		p.st.Status500++
	case "409":
		p.st.Status409++
	case "drop":
		p.st.Dropped++
	case "lost":
		p.st.Lost++
	}
	return fault, cut
}

func status(w http.ResponseWriter, code int, reason, msg string) {
	w.Header().Set("Content-Type", "application/json")
	if code == http.StatusTooManyRequests {
		w.Header().Set("Retry-After", "1")
	}
	w.WriteHeader(code)
	_ = json.NewEncoder(w).Encode(map[string]any{
		"kind": "Status", "apiVersion": "v1", "metadata": map[string]any{},
		"status": "Failure", "reason": reason, "code": code,
		"message": "injected by fault-proxy: " + msg,
	})
}

func (p *proxy) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if strings.HasPrefix(r.URL.Path, "/fault-proxy/") {
		p.control(w, r)
		return
	}
	if d := p.delay(r.URL.Path); d > 0 {
		time.Sleep(d)
	}
	fault, cut := p.pick(r)
	switch fault {
	case "429":
		status(w, http.StatusTooManyRequests, "TooManyRequests", "too many requests")
		return
	case "500":
		status(w, http.StatusInternalServerError, "InternalError", "internal error")
		return
	case "409":
		status(w, http.StatusConflict, "Conflict", "the object has been modified")
		return
	case "drop":
		panic(http.ErrAbortHandler)
	case "lost":
		out := r.Clone(r.Context())
		out.URL.Scheme, out.URL.Host, out.Host, out.RequestURI = p.upstream.Scheme, p.upstream.Host, "", ""
		resp, err := p.transport.RoundTrip(out)
		if err == nil {
			_, _ = io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			p.count(r, resp.StatusCode)
		}
		panic(http.ErrAbortHandler)
	}
	if cut > 0 {
		ctx, cancel := context.WithTimeout(r.Context(), cut)
		defer cancel()
		r = r.WithContext(ctx)
		go func() {
			<-ctx.Done()
			if ctx.Err() == context.DeadlineExceeded {
				p.mu.Lock()
				p.st.WatchesCut++
				p.mu.Unlock()
			}
		}()
	}
	p.rp.ServeHTTP(w, r)
}

func (p *proxy) count(r *http.Request, code int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.st.Forwarded++
	if isWrite(r.Method) && code < 300 {
		p.st.WritesApplied++
	}
}

func (p *proxy) control(w http.ResponseWriter, r *http.Request) {
	p.mu.Lock()
	defer p.mu.Unlock()
	switch r.URL.Path {
	case "/fault-proxy/rate":
		v, err := strconv.ParseFloat(r.URL.Query().Get("value"), 64)
		if err != nil || v < 0 || v > 1 {
			http.Error(w, "value: a fraction from 0 to 1", http.StatusBadRequest)
			return
		}
		p.rate = v
		fmt.Fprintf(w, "rate %v\n", v)
	case "/fault-proxy/delay":
		suffix := r.URL.Query().Get("suffix")
		d, err := time.ParseDuration(r.URL.Query().Get("value"))
		if err != nil || d < 0 || suffix == "" {
			http.Error(w, "suffix: a path suffix; value: a duration", http.StatusBadRequest)
			return
		}
		if p.delays == nil {
			p.delays = map[string]time.Duration{}
		}
		if d == 0 {
			delete(p.delays, suffix)
		} else {
			p.delays[suffix] = d
		}
		fmt.Fprintf(w, "delay %s %v\n", suffix, d)
	case "/fault-proxy/stats":
		w.Header().Set("Content-Type", "application/json")
		_ = json.NewEncoder(w).Encode(p.st)
	default:
		http.NotFound(w, r)
	}
}

// serving makes a CA and a serving certificate for 127.0.0.1 signed by it
// (rustls refuses a CA certificate as the server's own).
func serving(dir string) (tls.Certificate, []byte, error) {
	now := time.Now().Add(-time.Hour)
	caKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return tls.Certificate{}, nil, err
	}
	ca := &x509.Certificate{
		SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "fault-proxy-ca"},
		NotBefore: now, NotAfter: now.Add(48 * time.Hour),
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature,
		BasicConstraintsValid: true, IsCA: true,
	}
	caDER, err := x509.CreateCertificate(rand.Reader, ca, ca, caKey.Public(), caKey)
	if err != nil {
		return tls.Certificate{}, nil, err
	}
	ca, err = x509.ParseCertificate(caDER)
	if err != nil {
		return tls.Certificate{}, nil, err
	}
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return tls.Certificate{}, nil, err
	}
	leaf := &x509.Certificate{
		SerialNumber: big.NewInt(2), Subject: pkix.Name{CommonName: "fault-proxy"},
		NotBefore: now, NotAfter: now.Add(48 * time.Hour),
		KeyUsage:              x509.KeyUsageDigitalSignature,
		ExtKeyUsage:           []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
		BasicConstraintsValid: true,
		IPAddresses:           []net.IP{net.ParseIP("127.0.0.1")},
		DNSNames:              []string{"localhost"},
	}
	der, err := x509.CreateCertificate(rand.Reader, leaf, ca, key.Public(), caKey)
	if err != nil {
		return tls.Certificate{}, nil, err
	}
	caPEM := pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: caDER})
	if err := os.WriteFile(filepath.Join(dir, "fault-proxy-ca.crt"), caPEM, 0o644); err != nil {
		return tls.Certificate{}, nil, err
	}
	return tls.Certificate{Certificate: [][]byte{der}, PrivateKey: key}, caPEM, nil
}

func main() {
	var (
		upstream = flag.String("upstream", "", "the API server's URL (https://127.0.0.1:PORT)")
		pki      = flag.String("pki", "", "the local control plane's pki directory (ca.crt, admin.crt, admin.key)")
		dir      = flag.String("dir", "", "where to write fault-proxy-ca.crt and the kubeconfig")
		rate     = flag.Float64("rate", 0, "fraction of requests that get a fault")
		seed     = flag.Uint64("seed", 1, "seed of the fault choice")
		watchCut = flag.Duration("watch-cut", 20*time.Second, "watches are cut after 50-100% of this (0: never)")
	)
	flag.Parse()
	log.SetFlags(0)
	log.SetPrefix("fault-proxy: ")
	if *upstream == "" || *pki == "" || *dir == "" {
		log.Fatal("--upstream, --pki and --dir are required")
	}
	up, err := url.Parse(*upstream)
	if err != nil {
		log.Fatalf("--upstream: %v", err)
	}
	caPEM, err := os.ReadFile(filepath.Join(*pki, "ca.crt"))
	if err != nil {
		log.Fatal(err)
	}
	roots := x509.NewCertPool()
	if !roots.AppendCertsFromPEM(caPEM) {
		log.Fatal("no certificate in ca.crt")
	}
	admin, err := tls.LoadX509KeyPair(filepath.Join(*pki, "admin.crt"), filepath.Join(*pki, "admin.key"))
	if err != nil {
		log.Fatal(err)
	}
	transport := &http.Transport{
		TLSClientConfig:     &tls.Config{RootCAs: roots, Certificates: []tls.Certificate{admin}},
		ForceAttemptHTTP2:   true,
		MaxIdleConnsPerHost: 64,
	}
	p := &proxy{upstream: up, transport: transport, watchCut: *watchCut, rate: *rate,
		rng: mrand.New(mrand.NewPCG(*seed, *seed^0x9e3779b97f4a7c15))}
	p.rp = &httputil.ReverseProxy{
		Rewrite: func(pr *httputil.ProxyRequest) {
			pr.SetURL(up)
			pr.Out.Host = ""
		},
		Transport:     transport,
		FlushInterval: -1,
		ModifyResponse: func(resp *http.Response) error {
			p.count(resp.Request, resp.StatusCode)
			return nil
		},
		ErrorLog: log.New(io.Discard, "", 0),
	}
	if *watchCut <= 0 {
		p.watchCut = 0
	}
	cert, proxyCA, err := serving(*dir)
	if err != nil {
		log.Fatal(err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		log.Fatal(err)
	}
	server := fmt.Sprintf("https://%s", ln.Addr())
	kubeconfig := filepath.Join(*dir, "fault-proxy.kubeconfig")
	// No credentials: the proxy is the admin upstream, as `kubectl proxy` is.
	kc := fmt.Sprintf(`apiVersion: v1
kind: Config
clusters:
- name: fault-proxy
  cluster: {server: %q, certificate-authority-data: %s}
users:
- name: fault-proxy
  user: {}
contexts:
- name: fault-proxy
  context: {cluster: fault-proxy, user: fault-proxy}
current-context: fault-proxy
`, server, base64.StdEncoding.EncodeToString(proxyCA))
	if err := os.WriteFile(kubeconfig, []byte(kc), 0o600); err != nil {
		log.Fatal(err)
	}
	srv := &http.Server{
		Handler:   p,
		TLSConfig: &tls.Config{Certificates: []tls.Certificate{cert}},
		ErrorLog:  log.New(io.Discard, "", 0),
	}
	fmt.Printf("READY %s\n", kubeconfig)
	log.Fatal(srv.ServeTLS(ln, "", ""))
}
