package main

// End-to-end check of --scheduler: the in-process kube-scheduler binds a
// pending pod to a node created through the API (no kubelet) by the node's
// allocatable extended resources, and reports a pod that does not fit with
// the scheduler's own FailedScheduling message.
//
// It runs the kube-local binary named by KUBE_LOCAL
// (`tests/cluster/cluster.sh path` builds and prints it):
//
//	KUBE_LOCAL=$(tests/cluster/cluster.sh path) go -C tests/cluster test -run Scheduler -v
//
// Without KUBE_LOCAL it is skipped, except under CI (CI=true), where it fails.

import (
	"bufio"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"
)

const migResource corev1.ResourceName = "nvidia.com/mig-1g.10gb"

// startKubeLocal starts $KUBE_LOCAL with args and returns its kubeconfig.
// At the end of the test it is stopped with SIGTERM, which goes through
// kube-local's graceful stop (scheduler and controllers, then the
// apiserver, then etcd); the test fails if that does not end with exit
// status 0 within 30 s.
func startKubeLocal(t *testing.T, args ...string) string {
	t.Helper()
	bin := os.Getenv("KUBE_LOCAL")
	if bin == "" {
		if ci, _ := strconv.ParseBool(os.Getenv("CI")); ci {
			t.Fatal("KUBE_LOCAL (path to the kube-local binary, printed by tests/cluster/cluster.sh path) not set: under CI this test must run")
		}
		t.Skip("KUBE_LOCAL not set: build kube-local and run with KUBE_LOCAL=$(tests/cluster/cluster.sh path)")
	}
	logPath := filepath.Join(t.TempDir(), "kube-local.log")
	logFile, err := os.Create(logPath)
	if err != nil {
		t.Fatal(err)
	}
	defer logFile.Close() // the child has its own copy
	logTail := func() string {
		b, _ := os.ReadFile(logPath)
		lines := strings.Split(strings.TrimRight(string(b), "\n"), "\n")
		if len(lines) > 60 {
			lines = lines[len(lines)-60:]
		}
		return strings.Join(lines, "\n")
	}
	cmd := exec.Command(bin, append([]string{"--dir", t.TempDir(), "--watch-parent=false"}, args...)...)
	// Held open until the end: should the test binary die, kube-local sees
	// EOF and exits.
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stderr = logFile
	if err := cmd.Start(); err != nil {
		t.Fatalf("start %s: %v", bin, err)
	}
	ready := make(chan string, 1)
	exited := make(chan struct{})
	go func() {
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			if kc, ok := strings.CutPrefix(sc.Text(), "READY "); ok {
				select {
				case ready <- kc:
				default:
				}
			}
		}
		_ = cmd.Wait() // after stdout is drained, as os/exec requires
		close(exited)
	}()
	t.Cleanup(func() {
		_ = cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-exited:
			if code := cmd.ProcessState.ExitCode(); code != 0 {
				t.Errorf("kube-local exited with status %d after SIGTERM", code)
			}
		case <-time.After(30 * time.Second):
			t.Errorf("kube-local did not stop within 30s of SIGTERM")
			_ = cmd.Process.Kill()
			<-exited
		}
		stdin.Close()
		if b, _ := os.ReadFile(logPath); !strings.Contains(string(b), "kube-apiserver stopped") {
			t.Errorf("kube-local did not stop gracefully")
		}
		if t.Failed() {
			t.Logf("kube-local stderr (last lines):\n%s", logTail())
		}
	})
	select {
	case kc := <-ready:
		return kc
	case <-exited:
		t.Fatalf("kube-local exited before it was ready: %v\n%s", cmd.ProcessState, logTail())
	case <-time.After(2 * time.Minute):
		t.Fatalf("kube-local not ready within 2 min\n%s", logTail())
	}
	return ""
}

// kubeLocalClient starts kube-local with args (see startKubeLocal) and
// returns a client of it.
func kubeLocalClient(t *testing.T, args ...string) kubernetes.Interface {
	t.Helper()
	cfg, err := clientcmd.BuildConfigFromFlags("", startKubeLocal(t, args...))
	if err != nil {
		t.Fatal(err)
	}
	kube, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return kube
}

func TestSchedulerBindsByExtendedResources(t *testing.T) {
	kube := kubeLocalClient(t, "--scheduler", "--no-nodes", "--no-gpu-operator")
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()

	// A node as a test's node simulator writes it: the object, then its
	// status (allocatable, Ready) through the status subresource, as a
	// kubelet would. Status sent with the create is not relied upon.
	const nodeName = "mig-node-0"
	node, err := kube.CoreV1().Nodes().Create(ctx, &corev1.Node{
		ObjectMeta: metav1.ObjectMeta{
			Name: nodeName,
			Labels: map[string]string{
				"kubernetes.io/hostname": nodeName,
				"kubernetes.io/os":       "linux",
				"kubernetes.io/arch":     "amd64",
			},
		},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	resources := corev1.ResourceList{
		corev1.ResourceCPU:    resource.MustParse("16"),
		corev1.ResourceMemory: resource.MustParse("64Gi"),
		corev1.ResourcePods:   resource.MustParse("110"),
		migResource:           resource.MustParse("7"),
	}
	now := metav1.Now()
	node.Status = corev1.NodeStatus{
		Capacity:    resources,
		Allocatable: resources,
		Conditions: []corev1.NodeCondition{{
			Type:               corev1.NodeReady,
			Status:             corev1.ConditionTrue,
			Reason:             "KubeletReady",
			Message:            "simulated",
			LastHeartbeatTime:  now,
			LastTransitionTime: now,
		}},
	}
	node, err = kube.CoreV1().Nodes().UpdateStatus(ctx, node, metav1.UpdateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if got := node.Status.Allocatable[migResource]; got.Value() != 7 {
		t.Fatalf("node allocatable %s = %s, want 7", migResource, got.String())
	}
	// kube-local disables the TaintNodesByCondition admission plugin and
	// runs no node lifecycle controller: nothing should taint the node
	// not-ready (which would make the scheduler refuse it).
	if len(node.Spec.Taints) != 0 {
		t.Fatalf("node has taints %v: the scheduler would refuse pods without tolerations", node.Spec.Taints)
	}

	fits := createPod(ctx, t, kube, "fits", 1)
	tooBig := createPod(ctx, t, kube, "too-big", 8)

	// The pod that fits is bound to the node by the scheduler.
	var bound *corev1.Pod
	err = wait.PollUntilContextCancel(ctx, 100*time.Millisecond, true, func(ctx context.Context) (bool, error) {
		p, err := kube.CoreV1().Pods(fits.Namespace).Get(ctx, fits.Name, metav1.GetOptions{})
		if err != nil {
			return false, err
		}
		bound = p
		return p.Spec.NodeName != "", nil
	})
	if err != nil {
		t.Fatalf("pod %s not bound: %v (status %+v)", fits.Name, err, bound.Status)
	}
	if bound.Spec.NodeName != nodeName {
		t.Fatalf("pod %s bound to %q, want %q", fits.Name, bound.Spec.NodeName, nodeName)
	}
	if c := podCondition(bound, corev1.PodScheduled); c == nil || c.Status != corev1.ConditionTrue {
		t.Errorf("pod %s: PodScheduled condition %+v, want True", fits.Name, c)
	}
	ev := waitEvent(ctx, t, kube, fits, "Scheduled")
	t.Logf("pod %s: event %s from %s: %s", fits.Name, ev.Reason, eventSource(ev), ev.Message)
	if want := "Successfully assigned default/fits to " + nodeName; ev.Message != want {
		t.Errorf("Scheduled event message %q, want %q", ev.Message, want)
	}

	// The pod asking for more than the node has stays Pending, with the
	// scheduler's reason in its condition and in a FailedScheduling event.
	const insufficient = "Insufficient nvidia.com/mig-1g.10gb"
	var pending *corev1.Pod
	err = wait.PollUntilContextCancel(ctx, 100*time.Millisecond, true, func(ctx context.Context) (bool, error) {
		p, err := kube.CoreV1().Pods(tooBig.Namespace).Get(ctx, tooBig.Name, metav1.GetOptions{})
		if err != nil {
			return false, err
		}
		pending = p
		c := podCondition(p, corev1.PodScheduled)
		return c != nil && c.Status == corev1.ConditionFalse, nil
	})
	if err != nil {
		t.Fatalf("pod %s: no PodScheduled=False condition: %v (status %+v)", tooBig.Name, err, pending.Status)
	}
	c := podCondition(pending, corev1.PodScheduled)
	t.Logf("pod %s: PodScheduled=%s reason %s: %s", tooBig.Name, c.Status, c.Reason, c.Message)
	if c.Reason != corev1.PodReasonUnschedulable {
		t.Errorf("PodScheduled reason %q, want %q", c.Reason, corev1.PodReasonUnschedulable)
	}
	if !strings.Contains(c.Message, insufficient) {
		t.Errorf("PodScheduled message %q does not contain %q", c.Message, insufficient)
	}
	ev = waitEvent(ctx, t, kube, tooBig, "FailedScheduling")
	t.Logf("pod %s: event %s from %s: %s", tooBig.Name, ev.Reason, eventSource(ev), ev.Message)
	if !strings.Contains(ev.Message, insufficient) {
		t.Errorf("FailedScheduling message %q does not contain %q", ev.Message, insufficient)
	}
	if pending.Spec.NodeName != "" || pending.Status.Phase != corev1.PodPending {
		t.Errorf("pod %s: nodeName %q phase %s, want unbound and Pending", tooBig.Name, pending.Spec.NodeName, pending.Status.Phase)
	}
}

func createPod(ctx context.Context, t *testing.T, kube kubernetes.Interface, name string, mig int64) *corev1.Pod {
	t.Helper()
	q := *resource.NewQuantity(mig, resource.DecimalSI)
	p, err := kube.CoreV1().Pods("default").Create(ctx, &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name},
		Spec: corev1.PodSpec{
			Containers: []corev1.Container{{
				Name:  "cuda",
				Image: "nvcr.io/nvidia/cuda:12.9.0-base-ubuntu24.04",
				Resources: corev1.ResourceRequirements{
					Requests: corev1.ResourceList{migResource: q},
					Limits:   corev1.ResourceList{migResource: q},
				},
			}},
		},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if p.Spec.NodeName != "" || p.Spec.SchedulerName != corev1.DefaultSchedulerName {
		t.Fatalf("pod %s: nodeName %q schedulerName %q", name, p.Spec.NodeName, p.Spec.SchedulerName)
	}
	return p
}

func podCondition(p *corev1.Pod, typ corev1.PodConditionType) *corev1.PodCondition {
	for i := range p.Status.Conditions {
		if p.Status.Conditions[i].Type == typ {
			return &p.Status.Conditions[i]
		}
	}
	return nil
}

// waitEvent waits for an event with reason about pod from the default
// scheduler (it records through events.k8s.io/v1; the core/v1 view of the
// same objects is read here).
func waitEvent(ctx context.Context, t *testing.T, kube kubernetes.Interface, pod *corev1.Pod, reason string) *corev1.Event {
	t.Helper()
	sel := fields.Set{
		"involvedObject.kind": "Pod",
		"involvedObject.name": pod.Name,
		"involvedObject.uid":  string(pod.UID),
		"reason":              reason,
	}.AsSelector().String()
	var found *corev1.Event
	err := wait.PollUntilContextCancel(ctx, 100*time.Millisecond, true, func(ctx context.Context) (bool, error) {
		l, err := kube.CoreV1().Events(pod.Namespace).List(ctx, metav1.ListOptions{FieldSelector: sel})
		if err != nil {
			return false, err
		}
		for i := range l.Items {
			if eventSource(&l.Items[i]) == corev1.DefaultSchedulerName {
				found = &l.Items[i]
				return true, nil
			}
		}
		return false, nil
	})
	if err != nil {
		t.Fatalf("no %s event for pod %s from %s: %v", reason, pod.Name, corev1.DefaultSchedulerName, err)
	}
	return found
}

func eventSource(e *corev1.Event) string {
	if e.ReportingController != "" {
		return e.ReportingController
	}
	return fmt.Sprint(e.Source.Component)
}
