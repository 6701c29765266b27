// Package render parses the output of `gpu-sharing-operator render`.
package render

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io"
	"regexp"
	"strings"

	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"sigs.k8s.io/yaml"
)

const (
	DevicePluginConfigMap = "gpu-sharing-device-plugin-config"
	MigPartedConfigMap    = "gpu-sharing-mig-parted-config"
	VgpuDevicesConfigMap  = "gpu-sharing-vgpu-devices-config"
	ClusterPolicyName     = "cluster-policy"
	ManagedByLabel        = "app.kubernetes.io/managed-by"
	ManagedByValue        = "gpu-sharing-operator"
	ConfigLabel           = "gpusharing.io/config"
	DefaultKey            = "default"
	MigPartedKey          = "config.yaml"
	PolicyLabel           = "gpusharing.io/policy"
	ClaimTemplateAPI      = "resource.k8s.io/v1"
	ClaimTemplateKind     = "ResourceClaimTemplate"
)

// KeyPattern is the form of a policy's device-plugin ConfigMap key.
var KeyPattern = regexp.MustCompile(`^(.+)-([0-9a-f]{8})$`)

type Object struct {
	APIVersion string `json:"apiVersion"`
	Kind       string `json:"kind"`
	Metadata   struct {
		Name      string            `json:"name"`
		Namespace string            `json:"namespace,omitempty"`
		Labels    map[string]string `json:"labels,omitempty"`
	} `json:"metadata"`
	Data   map[string]string `json:"data,omitempty"`
	Spec   map[string]any    `json:"spec,omitempty"`
	Status map[string]any    `json:"status,omitempty"`
	// Raw is the document as printed (YAML), for strict decoding.
	Raw []byte `json:"-"`
}

type Output struct {
	DevicePlugin  *Object
	MigParted     *Object // nil when no policy uses MIG
	VgpuDevices   *Object // nil when no policy has a custom vGPU layout
	ClusterPolicy *Object
	// ClaimTemplates: resource.k8s.io/v1 ResourceClaimTemplates of DRA
	// policies, in output order.
	ClaimTemplates []*Object
	Nodes          []*Object
	Policies       map[string]*Object // by name
	PolicyOrder    []string
}

// Parse splits and checks the document order described in the render
// contract: device-plugin ConfigMap, [mig-parted ConfigMap], ClusterPolicy,
// [ResourceClaimTemplates of DRA policies], [Nodes], GpuSharingPolicy
// statuses.
func Parse(out []byte, namespace string) (*Output, error) {
	docs, err := ParseObjects(out)
	if err != nil {
		return nil, err
	}
	res := &Output{Policies: map[string]*Object{}}
	i := 0
	next := func() *Object {
		if i < len(docs) {
			return docs[i]
		}
		return nil
	}
	// 1. device-plugin ConfigMap
	d := next()
	if d == nil || d.Kind != "ConfigMap" || d.Metadata.Name != DevicePluginConfigMap {
		return nil, fmt.Errorf("document 1 must be ConfigMap %s, got %s", DevicePluginConfigMap, describe(d))
	}
	if err := checkConfigMap(d, namespace, "device-plugin"); err != nil {
		return nil, err
	}
	res.DevicePlugin = d
	i++
	// 2. optional mig-parted ConfigMap
	if d := next(); d != nil && d.Kind == "ConfigMap" && d.Metadata.Name != VgpuDevicesConfigMap {
		if d.Metadata.Name != MigPartedConfigMap {
			return nil, fmt.Errorf("document 2: unexpected ConfigMap %q", d.Metadata.Name)
		}
		if err := checkConfigMap(d, namespace, "mig-parted"); err != nil {
			return nil, err
		}
		if _, ok := d.Data[MigPartedKey]; !ok || len(d.Data) != 1 {
			return nil, fmt.Errorf("ConfigMap %s: data must hold exactly the key %s", MigPartedConfigMap, MigPartedKey)
		}
		res.MigParted = d
		i++
	}
	// 2b. optional vGPU-devices ConfigMap
	if d := next(); d != nil && d.Kind == "ConfigMap" {
		if d.Metadata.Name != VgpuDevicesConfigMap {
			return nil, fmt.Errorf("document %d: unexpected ConfigMap %q", i+1, d.Metadata.Name)
		}
		if err := checkConfigMap(d, namespace, "vgpu-devices"); err != nil {
			return nil, err
		}
		if _, ok := d.Data[MigPartedKey]; !ok || len(d.Data) != 1 {
			return nil, fmt.Errorf("ConfigMap %s: data must hold exactly the key %s", VgpuDevicesConfigMap, MigPartedKey)
		}
		res.VgpuDevices = d
		i++
	}
	// 3. ClusterPolicy
	d = next()
	if d == nil || d.Kind != "ClusterPolicy" || d.APIVersion != "nvidia.com/v1" || d.Metadata.Name != ClusterPolicyName {
		return nil, fmt.Errorf("document %d must be nvidia.com/v1 ClusterPolicy %s, got %s", i+1, ClusterPolicyName, describe(d))
	}
	res.ClusterPolicy = d
	i++
	// 3b. ResourceClaimTemplates (DRA policies)
	seenTemplate := map[string]bool{}
	for d := next(); d != nil && d.Kind == ClaimTemplateKind; d = next() {
		if d.APIVersion != ClaimTemplateAPI {
			return nil, fmt.Errorf("document %d: ResourceClaimTemplate with apiVersion %q, want %s", i+1, d.APIVersion, ClaimTemplateAPI)
		}
		id := TemplateID(d)
		if d.Metadata.Namespace == "" || d.Metadata.Name == "" {
			return nil, fmt.Errorf("document %d: ResourceClaimTemplate %q without namespace or name", i+1, id)
		}
		if seenTemplate[id] {
			return nil, fmt.Errorf("ResourceClaimTemplate %s twice", id)
		}
		seenTemplate[id] = true
		if d.Metadata.Labels[ManagedByLabel] != ManagedByValue {
			return nil, fmt.Errorf("ResourceClaimTemplate %s: label %s=%q, want %q", id, ManagedByLabel, d.Metadata.Labels[ManagedByLabel], ManagedByValue)
		}
		if d.Metadata.Labels[PolicyLabel] == "" {
			return nil, fmt.Errorf("ResourceClaimTemplate %s: no label %s", id, PolicyLabel)
		}
		res.ClaimTemplates = append(res.ClaimTemplates, d)
		i++
	}
	// 4. Nodes
	for d := next(); d != nil && d.Kind == "Node"; d = next() {
		if d.APIVersion != "v1" {
			return nil, fmt.Errorf("document %d: Node with apiVersion %q", i+1, d.APIVersion)
		}
		res.Nodes = append(res.Nodes, d)
		i++
	}
	// 5. policies
	for d := next(); d != nil; d = next() {
		if d.Kind != "GpuSharingPolicy" || d.APIVersion != "gpusharing.io/v1alpha1" {
			return nil, fmt.Errorf("document %d: expected GpuSharingPolicy, got %s", i+1, describe(d))
		}
		if _, dup := res.Policies[d.Metadata.Name]; dup {
			return nil, fmt.Errorf("GpuSharingPolicy %q twice", d.Metadata.Name)
		}
		res.Policies[d.Metadata.Name] = d
		res.PolicyOrder = append(res.PolicyOrder, d.Metadata.Name)
		i++
	}
	if err := checkTemplateOwners(res); err != nil {
		return nil, err
	}
	return res, nil
}

// IsDRA: the status is a DRA policy's (it lists templates).
func IsDRA(st *Object) bool {
	_, ok := st.Status["templates"]
	return ok
}

// checkTemplateOwners: every ResourceClaimTemplate belongs to a policy of
// the output whose status.templates lists it; a DRA policy's status has
// templates (exactly the ones rendered for it) and no deviceConfigKey.
func checkTemplateOwners(res *Output) error {
	byPolicy := map[string][]string{}
	for _, t := range res.ClaimTemplates {
		owner := t.Metadata.Labels[PolicyLabel]
		if res.Policies[owner] == nil {
			return fmt.Errorf("ResourceClaimTemplate %s: label %s=%q names no GpuSharingPolicy of the output", TemplateID(t), PolicyLabel, owner)
		}
		byPolicy[owner] = append(byPolicy[owner], TemplateID(t))
	}
	for _, name := range res.PolicyOrder {
		st := res.Policies[name]
		if !IsDRA(st) {
			if len(byPolicy[name]) > 0 {
				return fmt.Errorf("GpuSharingPolicy %s: ResourceClaimTemplates %v but no status.templates", name, byPolicy[name])
			}
			continue
		}
		listed, ok := Strings(st.Status, "templates")
		if !ok {
			return fmt.Errorf("GpuSharingPolicy %s: status.templates is not a list of strings", name)
		}
		if _, has := st.Status["deviceConfigKey"]; has {
			return fmt.Errorf("GpuSharingPolicy %s: DRA policy (status.templates) with a status.deviceConfigKey", name)
		}
		if !sameSet(listed, byPolicy[name]) {
			return fmt.Errorf("GpuSharingPolicy %s: status.templates=%v, rendered ResourceClaimTemplates %v", name, listed, byPolicy[name])
		}
	}
	return nil
}

func sameSet(a, b []string) bool {
	if len(a) != len(b) {
		return false
	}
	seen := map[string]int{}
	for _, x := range a {
		seen[x]++
	}
	for _, x := range b {
		if seen[x] == 0 {
			return false
		}
		seen[x]--
	}
	return true
}

// ParseObjects reads a multi-document YAML stream of Kubernetes objects
// (a List's items are not expanded).
func ParseObjects(data []byte) ([]*Object, error) {
	var docs []*Object
	r := utilyaml.NewYAMLReader(bufio.NewReader(bytes.NewReader(data)))
	for {
		doc, err := r.Read()
		if errors.Is(err, io.EOF) {
			return docs, nil
		}
		if err != nil {
			return nil, fmt.Errorf("reading YAML: %w", err)
		}
		if len(bytes.TrimSpace(stripComments(doc))) == 0 {
			continue
		}
		o := &Object{}
		if err := yaml.Unmarshal(doc, o); err != nil {
			return nil, fmt.Errorf("document %d: %w", len(docs)+1, err)
		}
		o.Raw = append([]byte(nil), doc...)
		docs = append(docs, o)
	}
}

func checkConfigMap(d *Object, namespace, config string) error {
	if d.APIVersion != "v1" {
		return fmt.Errorf("ConfigMap %s: apiVersion %q", d.Metadata.Name, d.APIVersion)
	}
	if d.Metadata.Namespace != namespace {
		return fmt.Errorf("ConfigMap %s: namespace %q, want %q", d.Metadata.Name, d.Metadata.Namespace, namespace)
	}
	if d.Metadata.Labels[ManagedByLabel] != ManagedByValue {
		return fmt.Errorf("ConfigMap %s: label %s=%q, want %q", d.Metadata.Name, ManagedByLabel, d.Metadata.Labels[ManagedByLabel], ManagedByValue)
	}
	if d.Metadata.Labels[ConfigLabel] != config {
		return fmt.Errorf("ConfigMap %s: label %s=%q, want %q", d.Metadata.Name, ConfigLabel, d.Metadata.Labels[ConfigLabel], config)
	}
	return nil
}

func describe(d *Object) string {
	if d == nil {
		return "end of output"
	}
	return fmt.Sprintf("%s %s %q", d.APIVersion, d.Kind, d.Metadata.Name)
}

func stripComments(doc []byte) []byte {
	var b bytes.Buffer
	for _, line := range strings.Split(string(doc), "\n") {
		if t := strings.TrimSpace(line); t == "" || strings.HasPrefix(t, "#") {
			continue
		}
		b.WriteString(line)
		b.WriteByte('\n')
	}
	return b.Bytes()
}

// TemplateID is "<namespace>/<name>" of a ResourceClaimTemplate, the form
// of a DRA policy's status.templates entries.
func TemplateID(d *Object) string {
	return d.Metadata.Namespace + "/" + d.Metadata.Name
}

// Strings reads a list of strings at a path in a nested map (e.g.
// status.templates); ok is false when it is absent or not such a list.
func Strings(m map[string]any, path ...string) ([]string, bool) {
	var cur any = m
	for _, p := range path {
		mm, ok := cur.(map[string]any)
		if !ok {
			return nil, false
		}
		if cur, ok = mm[p]; !ok {
			return nil, false
		}
	}
	list, ok := cur.([]any)
	if !ok {
		return nil, false
	}
	out := make([]string, 0, len(list))
	for _, v := range list {
		s, ok := v.(string)
		if !ok {
			return nil, false
		}
		out = append(out, s)
	}
	return out, true
}

// Str reads a string at a path in a nested map (e.g. spec.devicePlugin.config.name).
func Str(m map[string]any, path ...string) (string, bool) {
	var cur any = m
	for _, p := range path {
		mm, ok := cur.(map[string]any)
		if !ok {
			return "", false
		}
		cur, ok = mm[p]
		if !ok {
			return "", false
		}
	}
	s, ok := cur.(string)
	return s, ok
}

// Accepted reads a GpuSharingPolicy status's Accepted condition: false with
// its message when the operator rejected the policy (a policy without that
// condition counts as accepted).
func Accepted(o *Object) (bool, string) {
	conds, _ := o.Status["conditions"].([]any)
	for _, c := range conds {
		m, ok := c.(map[string]any)
		if !ok || m["type"] != "Accepted" {
			continue
		}
		msg, _ := m["message"].(string)
		return m["status"] != "False", msg
	}
	return true, ""
}
