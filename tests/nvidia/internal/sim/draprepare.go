package sim

import (
	"fmt"
	"sort"
	"strings"

	corev1 "k8s.io/api/core/v1"
	resourcev1 "k8s.io/api/resource/v1"
)

// AnnDRAPrepared: the devices NVIDIA's DRA kubelet plugin prepared for a
// pod's claims (`<claim>=<device>,...;...`), written when the simulated
// kubelet starts the pod. The real plugin writes CDI specs for them; a pod
// whose claims cannot be prepared does not start.
const AnnDRAPrepared = AnnPrefix + "dra-prepared"

// PodClaimNames are the ResourceClaims a pod runs with: the claim
// kube-scheduler generated for its extended resources, and the claims of its
// spec.resourceClaims (by name, or generated from a template).
func PodClaimNames(pod *corev1.Pod) []string {
	var out []string
	if st := pod.Status.ExtendedResourceClaimStatus; st != nil && st.ResourceClaimName != "" {
		out = append(out, st.ResourceClaimName)
	}
	for _, rc := range pod.Spec.ResourceClaims {
		if rc.ResourceClaimName != nil {
			out = append(out, *rc.ResourceClaimName)
			continue
		}
		for _, st := range pod.Status.ResourceClaimStatuses {
			if st.Name == rc.Name && st.ResourceClaimName != nil {
				out = append(out, *st.ResourceClaimName)
			}
		}
	}
	return out
}

// PrepareClaim checks a claim as the kubelet and NVIDIA's DRA kubelet plugin
// do before a pod starts (NodePrepareResources), and returns the devices of
// this driver it prepares: the plugin must run on the node (its switch on);
// the claim must be allocated and reserved for the pod; each of the driver's
// results must be on the node's pool and name a device the plugin published
// (`published`). Results of other drivers are not its business.
func PrepareClaim(claim *resourcev1.ResourceClaim, pod *corev1.Pod, n *Node, published []resourcev1.Device) ([]string, error) {
	if !DRAPluginDeployed(n) {
		return nil, fmt.Errorf("DRA driver %s is not registered on node %s", DRADriver, n.Name)
	}
	alloc := claim.Status.Allocation
	if alloc == nil {
		return nil, fmt.Errorf("claim %s is not allocated", claim.Name)
	}
	reserved := false
	for _, r := range claim.Status.ReservedFor {
		reserved = reserved || r.UID == pod.UID
	}
	if !reserved {
		return nil, fmt.Errorf("pod %s is not allowed to use claim %s (not in its reservedFor)", pod.Name, claim.Name)
	}
	have := map[string]bool{}
	for _, d := range published {
		have[d.Name] = true
	}
	var out []string
	for _, r := range alloc.Devices.Results {
		if r.Driver != DRADriver {
			continue
		}
		if r.Pool != n.Name {
			return nil, fmt.Errorf("claim %s: device %s is in pool %s, not this node's", claim.Name, r.Device, r.Pool)
		}
		if !have[r.Device] {
			return nil, fmt.Errorf("claim %s: device %s is not one the plugin publishes on %s", claim.Name, r.Device, n.Name)
		}
		out = append(out, r.Device)
	}
	sort.Strings(out)
	return out, nil
}

// PreparedValue is AnnDRAPrepared's value: claim -> devices, in claim order.
func PreparedValue(prepared map[string][]string) string {
	names := make([]string, 0, len(prepared))
	for c := range prepared {
		names = append(names, c)
	}
	sort.Strings(names)
	parts := make([]string, 0, len(names))
	for _, c := range names {
		parts = append(parts, c+"="+strings.Join(prepared[c], ","))
	}
	return strings.Join(parts, ";")
}
