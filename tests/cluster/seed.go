package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/util/wait"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"k8s.io/client-go/discovery"
	"k8s.io/client-go/discovery/cached/memory"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/restmapper"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"
)

const fieldManager = "kube-local"

// writeKubeconfig writes a self-contained admin kubeconfig (certificates
// embedded) and returns the rest config for it.
func writeKubeconfig(path, server string, p *pki) (*rest.Config, error) {
	cfg := clientcmdapi.NewConfig()
	cfg.Clusters["kube-local"] = &clientcmdapi.Cluster{
		Server:                   server,
		CertificateAuthorityData: p.caPEM,
	}
	cfg.AuthInfos["kube-local-admin"] = &clientcmdapi.AuthInfo{
		ClientCertificateData: p.adminCertPEM,
		ClientKeyData:         p.adminKeyPEM,
	}
	cfg.Contexts["kube-local"] = &clientcmdapi.Context{
		Cluster:   "kube-local",
		AuthInfo:  "kube-local-admin",
		Namespace: "default",
	}
	cfg.CurrentContext = "kube-local"
	if err := clientcmd.WriteToFile(*cfg, path); err != nil {
		return nil, err
	}
	if err := os.Chmod(path, 0o600); err != nil {
		return nil, err
	}
	return clientcmd.NewDefaultClientConfig(*cfg, nil).ClientConfig()
}

// waitReady polls /readyz until it answers ok, then waits for the default
// namespace (created by a post-start controller shortly after).
func waitReady(ctx context.Context, cfg *rest.Config, timeout time.Duration) error {
	dc, err := discovery.NewDiscoveryClientForConfig(cfg)
	if err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	var last error
	err = wait.PollUntilContextCancel(ctx, 100*time.Millisecond, true, func(ctx context.Context) (bool, error) {
		body, err := dc.RESTClient().Get().AbsPath("/readyz").DoRaw(ctx)
		if err != nil {
			last = fmt.Errorf("/readyz: %v: %s", err, strings.TrimSpace(string(body)))
			return false, nil
		}
		if strings.TrimSpace(string(body)) != "ok" {
			last = fmt.Errorf("/readyz: %s", body)
			return false, nil
		}
		return true, nil
	})
	if err != nil {
		return fmt.Errorf("apiserver not ready: %v (last: %v)", err, last)
	}
	dyn, err := dynamic.NewForConfig(cfg)
	if err != nil {
		return err
	}
	nsGVR := schema.GroupVersionResource{Version: "v1", Resource: "namespaces"}
	err = wait.PollUntilContextCancel(ctx, 100*time.Millisecond, true, func(ctx context.Context) (bool, error) {
		_, err := dyn.Resource(nsGVR).Get(ctx, "default", metav1.GetOptions{})
		last = err
		return err == nil, nil
	})
	if err != nil {
		return fmt.Errorf("namespace default not created: %v (last: %v)", err, last)
	}
	return nil
}

// applier applies manifests with server-side apply through the dynamic client.
type applier struct {
	dyn    dynamic.Interface
	mapper *restmapper.DeferredDiscoveryRESTMapper
}

func newApplier(cfg *rest.Config) (*applier, error) {
	dc, err := discovery.NewDiscoveryClientForConfig(cfg)
	if err != nil {
		return nil, err
	}
	dyn, err := dynamic.NewForConfig(cfg)
	if err != nil {
		return nil, err
	}
	return &applier{dyn: dyn, mapper: restmapper.NewDeferredDiscoveryRESTMapper(memory.NewMemCacheClient(dc))}, nil
}

// decodeManifests splits multi-document YAML (or JSON) into objects; List
// kinds are flattened, empty documents skipped.
func decodeManifests(data []byte) ([]*unstructured.Unstructured, error) {
	dec := utilyaml.NewYAMLOrJSONDecoder(bytes.NewReader(data), 4096)
	var out []*unstructured.Unstructured
	for {
		var m map[string]any
		if err := dec.Decode(&m); err != nil {
			if errors.Is(err, io.EOF) {
				return out, nil
			}
			return nil, err
		}
		if len(m) == 0 {
			continue
		}
		u := &unstructured.Unstructured{Object: m}
		if u.IsList() {
			list, err := u.ToList()
			if err != nil {
				return nil, err
			}
			for i := range list.Items {
				out = append(out, &list.Items[i])
			}
			continue
		}
		out = append(out, u)
	}
}

func (a *applier) resource(ctx context.Context, u *unstructured.Unstructured, namespace string) (dynamic.ResourceInterface, error) {
	gvk := u.GroupVersionKind()
	if gvk.Kind == "" || gvk.Version == "" {
		return nil, fmt.Errorf("object without apiVersion/kind: %v", u.Object)
	}
	mapping, err := a.mapper.RESTMapping(gvk.GroupKind(), gvk.Version)
	// A CRD applied moments ago: discovery can lag behind Established, so refresh and retry
	// for a while (a single retry made cluster starts fail now and then).
	for deadline := time.Now().Add(30 * time.Second); meta.IsNoMatchError(err) && time.Now().Before(deadline); {
		select {
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-time.After(200 * time.Millisecond):
		}
		a.mapper.Reset()
		mapping, err = a.mapper.RESTMapping(gvk.GroupKind(), gvk.Version)
	}
	if err != nil {
		return nil, fmt.Errorf("%s: %w", gvk, err)
	}
	if mapping.Scope.Name() == meta.RESTScopeNameNamespace {
		if namespace != "" {
			u.SetNamespace(namespace)
		}
		if u.GetNamespace() == "" {
			u.SetNamespace("default")
		}
		return a.dyn.Resource(mapping.Resource).Namespace(u.GetNamespace()), nil
	}
	u.SetNamespace("")
	return a.dyn.Resource(mapping.Resource), nil
}

// apply server-side-applies one object and, if it carries a status, applies
// that through the status subresource too. CRDs are waited for until
// Established. namespace, if not empty, overrides the namespace of
// namespaced objects.
func (a *applier) apply(ctx context.Context, u *unstructured.Unstructured, namespace string) error {
	ri, err := a.resource(ctx, u, namespace)
	if err != nil {
		return err
	}
	opts := metav1.ApplyOptions{FieldManager: fieldManager, Force: true}
	status, hasStatus := u.Object["status"]
	obj := u.DeepCopy()
	delete(obj.Object, "status")
	if _, err := ri.Apply(ctx, u.GetName(), obj, opts); err != nil {
		return fmt.Errorf("apply %s %s: %w", u.GetKind(), u.GetName(), err)
	}
	if hasStatus && u.GetKind() != "CustomResourceDefinition" {
		st := &unstructured.Unstructured{Object: map[string]any{
			"apiVersion": u.GetAPIVersion(),
			"kind":       u.GetKind(),
			"metadata":   map[string]any{"name": u.GetName(), "namespace": u.GetNamespace()},
			"status":     status,
		}}
		if _, err := ri.ApplyStatus(ctx, u.GetName(), st, opts); err != nil {
			return fmt.Errorf("apply status of %s %s: %w", u.GetKind(), u.GetName(), err)
		}
	}
	if u.GetKind() == "CustomResourceDefinition" {
		if err := a.waitEstablished(ctx, ri, u.GetName()); err != nil {
			return err
		}
		a.mapper.Reset()
	}
	return nil
}

func (a *applier) waitEstablished(ctx context.Context, ri dynamic.ResourceInterface, name string) error {
	ctx, cancel := context.WithTimeout(ctx, 60*time.Second)
	defer cancel()
	return wait.PollUntilContextCancel(ctx, 100*time.Millisecond, true, func(ctx context.Context) (bool, error) {
		crd, err := ri.Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			return false, nil
		}
		conds, _, _ := unstructured.NestedSlice(crd.Object, "status", "conditions")
		for _, c := range conds {
			cm, _ := c.(map[string]any)
			if cm["type"] == "Established" && cm["status"] == "True" {
				return true, nil
			}
		}
		return false, nil
	})
}

func (a *applier) applyData(ctx context.Context, data []byte, namespace string) (int, error) {
	objs, err := decodeManifests(data)
	if err != nil {
		return 0, err
	}
	for _, u := range objs {
		if err := a.apply(ctx, u, namespace); err != nil {
			return 0, err
		}
	}
	return len(objs), nil
}

// applyPath applies one file, or every *.yaml/*.yml/*.json file in a
// directory (sorted by name, not recursive).
func (a *applier) applyPath(ctx context.Context, path string) (int, error) {
	st, err := os.Stat(path)
	if err != nil {
		return 0, err
	}
	files := []string{path}
	if st.IsDir() {
		files = nil
		entries, err := os.ReadDir(path)
		if err != nil {
			return 0, err
		}
		for _, e := range entries {
			switch strings.ToLower(filepath.Ext(e.Name())) {
			case ".yaml", ".yml", ".json":
				if !e.IsDir() {
					files = append(files, filepath.Join(path, e.Name()))
				}
			}
		}
		sort.Strings(files)
	}
	total := 0
	for _, f := range files {
		data, err := os.ReadFile(f)
		if err != nil {
			return total, err
		}
		n, err := a.applyData(ctx, data, "")
		if err != nil {
			return total, fmt.Errorf("%s: %w", f, err)
		}
		total += n
	}
	return total, nil
}

type seedOptions struct {
	namespace         string // GPU Operator namespace
	gpuOperator       bool   // seed CRD, ClusterPolicy, namespace, MIG ConfigMap
	crdFile           string
	clusterPolicyFile string
	migConfigFile     string // may be empty: skipped
	nodesFile         string // empty: no nodes
	extra             []string
}

func seed(ctx context.Context, cfg *rest.Config, o seedOptions) error {
	a, err := newApplier(cfg)
	if err != nil {
		return err
	}
	if o.gpuOperator {
		ns := &unstructured.Unstructured{Object: map[string]any{
			"apiVersion": "v1", "kind": "Namespace",
			"metadata": map[string]any{"name": o.namespace},
		}}
		if err := a.apply(ctx, ns, ""); err != nil {
			return err
		}
		if _, err := a.applyPath(ctx, o.crdFile); err != nil {
			return fmt.Errorf("ClusterPolicy CRD: %w", err)
		}
		if o.migConfigFile != "" {
			data, err := os.ReadFile(o.migConfigFile)
			if err != nil {
				return err
			}
			if _, err := a.applyData(ctx, data, o.namespace); err != nil {
				return fmt.Errorf("%s: %w", o.migConfigFile, err)
			}
		}
		if err := seedClusterPolicy(ctx, a, o.clusterPolicyFile, o.namespace); err != nil {
			return err
		}
	}
	if o.nodesFile != "" {
		n, err := a.applyPath(ctx, o.nodesFile)
		if err != nil {
			return fmt.Errorf("nodes: %w", err)
		}
		logf("seeded %d nodes from %s", n, o.nodesFile)
	}
	for _, p := range o.extra {
		n, err := a.applyPath(ctx, p)
		if err != nil {
			return fmt.Errorf("manifest %s: %w", p, err)
		}
		logf("applied %d objects from %s", n, p)
	}
	return nil
}

// seedClusterPolicy applies the ClusterPolicy and then reports it ready in
// the operator namespace, through the status subresource like the GPU
// Operator does.
func seedClusterPolicy(ctx context.Context, a *applier, file, namespace string) error {
	data, err := os.ReadFile(file)
	if err != nil {
		return err
	}
	objs, err := decodeManifests(data)
	if err != nil {
		return fmt.Errorf("%s: %w", file, err)
	}
	for _, u := range objs {
		if u.GetKind() == "ClusterPolicy" {
			u.Object["status"] = map[string]any{
				"namespace": namespace,
				"state":     "ready",
				"conditions": []any{
					map[string]any{
						"type":               "Ready",
						"status":             "True",
						"reason":             "Reconciled",
						"message":            "ClusterPolicy is ready as all resources have been successfully reconciled",
						"lastTransitionTime": time.Now().UTC().Format(time.RFC3339),
					},
					map[string]any{
						"type":               "Error",
						"status":             "False",
						"reason":             "Ready",
						"message":            "",
						"lastTransitionTime": time.Now().UTC().Format(time.RFC3339),
					},
				},
			}
		}
		if err := a.apply(ctx, u, ""); err != nil {
			if apierrors.IsInvalid(err) {
				return fmt.Errorf("%s (does the ClusterPolicy CRD version match?): %w", file, err)
			}
			return err
		}
	}
	return nil
}
