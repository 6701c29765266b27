package sim

import (
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	resourcev1 "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// The kubelet plugin prepares a claim only on its own node, with the plugin
// running, for a pod the claim is reserved for, and for devices it
// published; the pod's claims come from its extended resources and its
// spec.resourceClaims.
func TestPrepareClaimChecksWhatThePluginChecks(t *testing.T) {
	pod := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "cuda", UID: "pod-uid"}}
	pod.Status.ExtendedResourceClaimStatus = &corev1.PodExtendedResourceClaimStatus{ResourceClaimName: "cuda-extended-resources-x"}
	tmpl := "tmpl"
	pod.Spec.ResourceClaims = []corev1.PodResourceClaim{{Name: "gpu", ResourceClaimTemplateName: &tmpl}}
	generated := "cuda-gpu-abc"
	pod.Status.ResourceClaimStatuses = []corev1.PodResourceClaimStatus{{Name: "gpu", ResourceClaimName: &generated}}
	if got := strings.Join(PodClaimNames(pod), " "); got != "cuda-extended-resources-x cuda-gpu-abc" {
		t.Fatalf("claims %q", got)
	}
	claim := func(pool, device string, reserved bool) *resourcev1.ResourceClaim {
		c := &resourcev1.ResourceClaim{ObjectMeta: metav1.ObjectMeta{Name: "c"}}
		c.Status.Allocation = &resourcev1.AllocationResult{Devices: resourcev1.DeviceAllocationResult{
			Results: []resourcev1.DeviceRequestAllocationResult{{Driver: DRADriver, Pool: pool, Device: device, Request: "r"}},
		}}
		if reserved {
			c.Status.ReservedFor = []resourcev1.ResourceClaimConsumerReference{{Resource: "pods", Name: "cuda", UID: "pod-uid"}}
		}
		return c
	}
	on := &Node{Name: "n", Labels: map[string]string{LabelDeployDRADriver: "true"}}
	off := &Node{Name: "n", Labels: map[string]string{}}
	published := []resourcev1.Device{{Name: "gpu-0"}, {Name: "gpu-1"}}
	devices, err := PrepareClaim(claim("n", "gpu-1", true), pod, on, published)
	if err != nil || strings.Join(devices, ",") != "gpu-1" {
		t.Fatalf("prepared %v, %v", devices, err)
	}
	for _, c := range []struct {
		claim *resourcev1.ResourceClaim
		node  *Node
		want  string
	}{
		{claim("n", "gpu-1", true), off, "not registered"},
		{claim("n", "gpu-1", false), on, "not in its reservedFor"},
		{claim("other", "gpu-1", true), on, "not this node's"},
		{claim("n", "gpu-7", true), on, "not one the plugin publishes"},
		{&resourcev1.ResourceClaim{ObjectMeta: metav1.ObjectMeta{Name: "c"}}, on, "not allocated"},
	} {
		if _, err := PrepareClaim(c.claim, pod, c.node, published); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("want %q, got %v", c.want, err)
		}
	}
	if v := PreparedValue(map[string][]string{"b": {"gpu-1"}, "a": {"gpu-0", "gpu-2"}}); v != "a=gpu-0,gpu-2;b=gpu-1" {
		t.Errorf("value %q", v)
	}
}
