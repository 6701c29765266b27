package sim

import (
	"encoding/json"
	"fmt"
	"sort"
	"strconv"
	"strings"

	corev1 "k8s.io/api/core/v1"

	"gpusharing.io/tests/nvidia/internal/nvmig"
)

// AnnDevices on a pod: the devices the simulated kubelet's device manager
// gave it when it started, comma-separated: "<gpu>" for a whole GPU,
// "<gpu>/<profile>@<start>" for a MIG instance (its placement), or
// "<gpu>/<profile>#<k>" on a model without placement data. "*" means none
// could be matched: the pod may hold any GPU of the node. The real kubelet
// keeps this in its device-manager checkpoint; the simulator writes it on the
// pod so that its MIG manager, like the real one, finds exactly which GPU and
// instance a running pod uses.
const AnnDevices = AnnPrefix + "devices"

// AnyDevice is AnnDevices of a pod whose devices are not known.
const AnyDevice = "*"

// Busy is what the unfinished GPU pods of a node hold.
type Busy struct {
	// Devices: device ID (see AnnDevices) -> the pods holding it.
	Devices map[string][]string
	// Anywhere: GPU pods whose devices are not recorded (started before
	// the simulator recorded devices, or none could be matched): they may
	// hold any GPU.
	Anywhere []string
}

// Empty: no GPU pod runs on the node.
func (b Busy) Empty() bool { return len(b.Devices) == 0 && len(b.Anywhere) == 0 }

// Pods lists every pod holding something, sorted.
func (b Busy) Pods() []string {
	return b.podsOn(func(string) bool { return true })
}

// OnGPU lists the pods that hold GPU i or one of its instances (or may).
func (b Busy) OnGPU(i int) []string {
	gpu := strconv.Itoa(i)
	return b.podsOn(func(id string) bool { return id == gpu || strings.HasPrefix(id, gpu+"/") })
}

// podsOn lists, sorted and once each, the pods holding a device keep admits, and those whose
// devices are unknown.
func (b Busy) podsOn(keep func(id string) bool) []string {
	seen := map[string]bool{}
	for id, ps := range b.Devices {
		if keep(id) {
			for _, p := range ps {
				seen[p] = true
			}
		}
	}
	for _, p := range b.Anywhere {
		seen[p] = true
	}
	out := make([]string, 0, len(seen))
	for p := range seen {
		out = append(out, p)
	}
	sort.Strings(out)
	return out
}

// holders lists the pods holding one device (or possibly holding it).
func (b Busy) holders(id string) []string {
	return append(append([]string(nil), b.Devices[id]...), b.Anywhere...)
}

// Add records that pod holds the devices of an AnnDevices value.
func (b *Busy) Add(pod, devices string) {
	if devices == "" || devices == AnyDevice {
		b.Anywhere = append(b.Anywhere, pod)
		return
	}
	if b.Devices == nil {
		b.Devices = map[string][]string{}
	}
	for _, id := range strings.Split(devices, ",") {
		b.Devices[id] = append(b.Devices[id], pod)
	}
}

// BusyOf reads what the started, unfinished GPU pods of a node hold, from
// the devices the simulated kubelet recorded on them. A pod being deleted still
// holds its devices until the kubelet confirms it ended.
func BusyOf(pods []corev1.Pod, node string) Busy {
	var b Busy
	for i := range pods {
		pod := &pods[i]
		if pod.Spec.NodeName != node || pod.Status.Phase == corev1.PodSucceeded || pod.Status.Phase == corev1.PodFailed {
			continue
		}
		// A bound pod the kubelet has not admitted yet holds nothing.
		started := pod.Status.Phase == corev1.PodRunning || pod.Annotations[AnnDevices] != ""
		if started && len(GPURequests(pod)) > 0 {
			b.Add(pod.Namespace+"/"+pod.Name, pod.Annotations[AnnDevices])
		}
	}
	return b
}

// GPURequests: the NVIDIA resources a pod asks for (limits, else requests,
// summed over its containers; an init container's ask counts when larger),
// but those kube-scheduler served through DRA (status.extendedResourceClaimStatus).
func GPURequests(pod *corev1.Pod) map[string]int {
	out := map[string]int{}
	sum := func(cs []corev1.Container, keepMax bool) {
		for _, c := range cs {
			rl := c.Resources.Limits
			if len(rl) == 0 {
				rl = c.Resources.Requests
			}
			for name, q := range rl {
				if !IsGPUResource(string(name)) || q.Value() <= 0 {
					continue
				}
				if keepMax {
					out[string(name)] = max(out[string(name)], int(q.Value()))
				} else {
					out[string(name)] += int(q.Value())
				}
			}
		}
	}
	sum(pod.Spec.InitContainers, true)
	init := out
	out = map[string]int{}
	sum(pod.Spec.Containers, false)
	for r, n := range init {
		out[r] = max(out[r], n)
	}
	// kube-scheduler served these through DRA (KEP-5004): the kubelet's device
	// manager leaves them to the DRA driver, as the real one does.
	if st := pod.Status.ExtendedResourceClaimStatus; st != nil {
		for _, m := range st.RequestMappings {
			delete(out, m.ResourceName)
		}
	}
	return out
}

// physicalDevices lists the devices that back an advertised resource:
// instances of the profile for nvidia.com/mig-<profile>[.shared]; for
// nvidia.com/gpu[.shared] the GPUs without MIG, or every instance when all
// GPUs have MIG on (the device plugin's single strategy).
func physicalDevices(resource string, geo Geometry, places Placements) []string {
	name := strings.TrimSuffix(strings.TrimPrefix(resource, "nvidia.com/"), ".shared")
	var whole, instances []string
	for i, gpu := range geo {
		if !gpu.MigEnabled {
			whole = append(whole, strconv.Itoa(i))
			continue
		}
		for _, id := range instanceIDs(i, gpu.MigDevices, places) {
			if profile := strings.TrimPrefix(name, "mig-"); name == "gpu" || idProfile(id) == profile {
				instances = append(instances, id)
			}
		}
	}
	switch {
	case strings.HasPrefix(name, "mig-"):
		return instances
	case name == "gpu" && len(whole) == 0:
		return instances
	case name == "gpu":
		return whole
	}
	return nil
}

// instanceIDs names the instances of GPU i: from their placements when
// known, else "<i>/<profile>#<k>".
func instanceIDs(i int, devices map[string]int, places Placements) []string {
	var out []string
	if i < len(places) && len(places[i]) > 0 {
		ps := append([]nvmig.Placement(nil), places[i]...)
		sort.Slice(ps, func(a, b int) bool { return ps[a].Start < ps[b].Start })
		for _, p := range ps {
			out = append(out, fmt.Sprintf("%d/%s@%d", i, p.Profile, p.Start))
		}
		return out
	}
	for _, p := range sortedKeys(devices) {
		for k := 0; k < devices[p]; k++ {
			out = append(out, fmt.Sprintf("%d/%s#%d", i, p, k))
		}
	}
	return out
}

func idProfile(id string) string {
	_, rest, _ := strings.Cut(id, "/")
	if p, _, ok := strings.Cut(rest, "@"); ok {
		return p
	}
	p, _, _ := strings.Cut(rest, "#")
	return p
}

// AssignDevices plays the kubelet's device manager admitting a pod: for each
// NVIDIA resource it asks, that many devices behind the resource. A device
// is shared by at most advertised/physical pods (time-slicing or MPS
// replicas); the least shared device is taken first, then the lowest index.
// advertised is what the device plugin advertises (AnnDPResources). It
// returns the AnnDevices value, or an error when the node has not enough
// free devices (the real kubelet then rejects the pod with
// UnexpectedAdmissionError).
func AssignDevices(pod *corev1.Pod, geo Geometry, places Placements, advertised map[string]int, busy Busy) (string, error) {
	var got []string
	taken := map[string]int{}
	asks := GPURequests(pod)
	for _, r := range sortedKeys(asks) {
		devs := physicalDevices(r, geo, places)
		if len(devs) == 0 {
			return "", fmt.Errorf("requested %d of %s: no device on the node backs it", asks[r], r)
		}
		share := max(1, advertised[r]/len(devs))
		for k := 0; k < asks[r]; k++ {
			best, bestN := "", share
			for _, d := range devs {
				if n := len(busy.Devices[d]) + taken[d]; n < bestN {
					best, bestN = d, n
				}
			}
			if best == "" {
				return "", fmt.Errorf("requested %d of %s, available %d", asks[r], r, k)
			}
			taken[best]++
			got = append(got, best)
		}
	}
	return strings.Join(got, ","), nil
}

// AdvertisedOf reads what the device plugin advertises on a node.
func AdvertisedOf(annotations map[string]string) map[string]int {
	out := map[string]int{}
	_ = json.Unmarshal([]byte(annotations[AnnDPResources]), &out)
	return out
}
