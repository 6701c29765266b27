package main

// End-to-end check of DRA extended resources (KEP-5004) in kube-local with
// --scheduler: kube-scheduler serves an unchanged `nvidia.com/gpu` request
// through a DeviceClass that maps the name, on a node whose allocatable for
// it is 0, creating a claim per pod; a GPU with consumable shares N takes
// exactly N such pods; the resourceclaim controller frees a finished pod's
// share, so a waiting pod is placed. Run as scheduler_test.go says.

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	resourcev1 "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
)

const gpuResource corev1.ResourceName = "nvidia.com/gpu"

func TestExtendedResourcesAreServedThroughDRAAndFreedByTheClaimController(t *testing.T) {
	kube := kubeLocalClient(t, "--scheduler", "--no-nodes", "--no-gpu-operator")
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()

	// A moved node: the device plugin withdrew (allocatable 0, capacity
	// lingers), the DRA driver publishes one GPU with 2 shares.
	const nodeName = "dra-node-0"
	node, err := kube.CoreV1().Nodes().Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{
		Name:   nodeName,
		Labels: map[string]string{"kubernetes.io/hostname": nodeName},
	}}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	capacity := corev1.ResourceList{
		corev1.ResourceCPU: resource.MustParse("16"), corev1.ResourceMemory: resource.MustParse("64Gi"),
		corev1.ResourcePods: resource.MustParse("110"), gpuResource: resource.MustParse("8"),
	}
	allocatable := capacity.DeepCopy()
	allocatable[gpuResource] = resource.MustParse("0")
	now := metav1.Now()
	node.Status = corev1.NodeStatus{Capacity: capacity, Allocatable: allocatable, Conditions: []corev1.NodeCondition{{
		Type: corev1.NodeReady, Status: corev1.ConditionTrue, Reason: "KubeletReady", LastHeartbeatTime: now, LastTransitionTime: now,
	}}}
	if _, err := kube.CoreV1().Nodes().UpdateStatus(ctx, node, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	class := &resourcev1.DeviceClass{
		ObjectMeta: metav1.ObjectMeta{Name: "gpusharing-nvidia.com-gpu"},
		Spec: resourcev1.DeviceClassSpec{
			Selectors: []resourcev1.DeviceSelector{{CEL: &resourcev1.CELDeviceSelector{
				Expression: "device.driver == 'gpu.nvidia.com' && device.attributes['gpu.nvidia.com'].type == 'gpu'",
			}}},
			ExtendedResourceName: ptrTo(string(gpuResource)),
		},
	}
	if _, err := kube.ResourceV1().DeviceClasses().Create(ctx, class, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	one, two := resource.MustParse("1"), resource.MustParse("2")
	slice := &resourcev1.ResourceSlice{
		ObjectMeta: metav1.ObjectMeta{Name: "gpu.nvidia.com-" + nodeName},
		Spec: resourcev1.ResourceSliceSpec{
			Driver:   "gpu.nvidia.com",
			NodeName: ptrTo(nodeName),
			Pool:     resourcev1.ResourcePool{Name: nodeName, Generation: 1, ResourceSliceCount: 1},
			Devices: []resourcev1.Device{{
				Name:                     "gpu-0",
				AllowMultipleAllocations: ptrTo(true),
				Attributes:               map[resourcev1.QualifiedName]resourcev1.DeviceAttribute{"type": {StringValue: ptrTo("gpu")}},
				Capacity: map[resourcev1.QualifiedName]resourcev1.DeviceCapacity{"shares": {
					Value: two,
					RequestPolicy: &resourcev1.CapacityRequestPolicy{
						Default:    ptrTo(one.DeepCopy()),
						ValidRange: &resourcev1.CapacityRequestPolicyRange{Min: ptrTo(one.DeepCopy()), Max: ptrTo(two.DeepCopy()), Step: ptrTo(one.DeepCopy())},
					},
				}},
			}},
		},
	}
	if _, err := kube.ResourceV1().ResourceSlices().Create(ctx, slice, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}

	// Three unchanged pods asking for nvidia.com/gpu: 1; two shares.
	for i := range 3 {
		q := *resource.NewQuantity(1, resource.DecimalSI)
		_, err := kube.CoreV1().Pods("default").Create(ctx, &corev1.Pod{
			ObjectMeta: metav1.ObjectMeta{Name: fmt.Sprintf("cuda-%d", i)},
			Spec: corev1.PodSpec{Containers: []corev1.Container{{
				Name: "cuda", Image: "example.com/cuda:12",
				Resources: corev1.ResourceRequirements{Limits: corev1.ResourceList{gpuResource: q}},
			}}},
		}, metav1.CreateOptions{})
		if err != nil {
			t.Fatal(err)
		}
	}
	bound := func() (map[string]*corev1.Pod, map[string]*corev1.Pod) {
		in, out := map[string]*corev1.Pod{}, map[string]*corev1.Pod{}
		pods, err := kube.CoreV1().Pods("default").List(ctx, metav1.ListOptions{})
		if err != nil {
			t.Fatal(err)
		}
		for i := range pods.Items {
			p := &pods.Items[i]
			if p.Spec.NodeName != "" {
				in[p.Name] = p
			} else {
				out[p.Name] = p
			}
		}
		return in, out
	}
	var in, out map[string]*corev1.Pod
	err = wait.PollUntilContextCancel(ctx, 200*time.Millisecond, true, func(context.Context) (bool, error) {
		in, out = bound()
		if len(out) != 1 {
			return false, nil
		}
		for _, p := range out {
			c := podCondition(p, corev1.PodScheduled)
			return len(in) == 2 && c != nil && c.Status == corev1.ConditionFalse, nil
		}
		return false, nil
	})
	if err != nil {
		t.Fatalf("want 2 pods bound (2 shares) and 1 unschedulable: bound %d, pending %d: %v", len(in), len(out), err)
	}
	// Each bound pod has the claim kube-scheduler generated for it:
	// annotated, owned by the pod, allocated on the GPU and reserved for it.
	var done *corev1.Pod
	for _, p := range in {
		st := p.Status.ExtendedResourceClaimStatus
		if st == nil || len(st.RequestMappings) != 1 || st.RequestMappings[0].ResourceName != string(gpuResource) {
			t.Fatalf("pod %s: extendedResourceClaimStatus %+v", p.Name, st)
		}
		claim, err := kube.ResourceV1().ResourceClaims("default").Get(ctx, st.ResourceClaimName, metav1.GetOptions{})
		if err != nil {
			t.Fatalf("pod %s: claim %s: %v", p.Name, st.ResourceClaimName, err)
		}
		if claim.Annotations["resource.kubernetes.io/extended-resource-claim"] != "true" {
			t.Errorf("claim %s annotations %v", claim.Name, claim.Annotations)
		}
		owner := metav1.GetControllerOf(claim)
		if owner == nil || owner.Kind != "Pod" || owner.UID != p.UID {
			t.Errorf("claim %s owner %+v, want pod %s", claim.Name, owner, p.Name)
		}
		a := claim.Status.Allocation
		if a == nil || len(a.Devices.Results) != 1 || a.Devices.Results[0].Device != "gpu-0" || a.Devices.Results[0].Pool != nodeName {
			t.Fatalf("claim %s allocation %+v", claim.Name, a)
		}
		if len(claim.Status.ReservedFor) != 1 || claim.Status.ReservedFor[0].UID != p.UID {
			t.Errorf("claim %s reservedFor %+v", claim.Name, claim.Status.ReservedFor)
		}
		done = p
	}

	// One pod finishes: the resourceclaim controller deallocates and deletes
	// its claim, and the waiting pod gets the freed share.
	done.Status.Phase = corev1.PodSucceeded
	if _, err := kube.CoreV1().Pods("default").UpdateStatus(ctx, done, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	claimName := done.Status.ExtendedResourceClaimStatus.ResourceClaimName
	err = wait.PollUntilContextCancel(ctx, 200*time.Millisecond, true, func(context.Context) (bool, error) {
		_, err := kube.ResourceV1().ResourceClaims("default").Get(ctx, claimName, metav1.GetOptions{})
		if err != nil && !apierrors.IsNotFound(err) {
			return false, err
		}
		in, out = bound()
		return apierrors.IsNotFound(err) && len(out) == 0, nil
	})
	if err != nil {
		t.Fatalf("claim %s of the finished pod not freed, or the waiting pod not placed (pending %d): %v", claimName, len(out), err)
	}

	// Every pod finishes; then one asks for nvidia.com/gpu: 2 on the node's
	// one GPU of 2 free shares. The generated claim asks for 2 devices of the
	// class: 2 distinct GPUs, one share of each (never 2 shares of one GPU, as
	// time-slicing's 2 replicas may be): unschedulable here.
	for _, p := range in {
		p.Status.Phase = corev1.PodSucceeded
		if _, err := kube.CoreV1().Pods("default").UpdateStatus(ctx, p, metav1.UpdateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	err = wait.PollUntilContextCancel(ctx, 200*time.Millisecond, true, func(context.Context) (bool, error) {
		claims, err := kube.ResourceV1().ResourceClaims("default").List(ctx, metav1.ListOptions{})
		return err == nil && len(claims.Items) == 0, err
	})
	if err != nil {
		t.Fatalf("claims of the finished pods not freed: %v", err)
	}
	_, err = kube.CoreV1().Pods("default").Create(ctx, &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: "cuda-two"},
		Spec: corev1.PodSpec{Containers: []corev1.Container{{
			Name: "cuda", Image: "example.com/cuda:12",
			Resources: corev1.ResourceRequirements{Limits: corev1.ResourceList{gpuResource: two}},
		}}},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	var two2 *corev1.Pod
	err = wait.PollUntilContextCancel(ctx, 200*time.Millisecond, true, func(context.Context) (bool, error) {
		p, err := kube.CoreV1().Pods("default").Get(ctx, "cuda-two", metav1.GetOptions{})
		if err != nil {
			return false, err
		}
		two2 = p
		c := podCondition(p, corev1.PodScheduled)
		return p.Spec.NodeName != "" || c != nil && c.Status == corev1.ConditionFalse, nil
	})
	if err != nil {
		t.Fatal(err)
	}
	c := podCondition(two2, corev1.PodScheduled)
	if two2.Spec.NodeName != "" || c == nil || c.Reason != corev1.PodReasonUnschedulable || !strings.Contains(c.Message, "cannot allocate all claims") {
		t.Fatalf("cuda-two: want unschedulable (2 distinct GPUs needed, 1 exists): node %q, condition %+v", two2.Spec.NodeName, c)
	}
}

func ptrTo[T any](v T) *T { return &v }
