package sim

import (
	"strconv"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// AnnRunSeconds on a pod: how long the simulated kubelet runs it before it
// Succeeds (and its GPU resources are free again). Without it a pod runs
// until deleted.
const AnnRunSeconds = AnnPrefix + "run-seconds"

// AnnStopSeconds on a pod: how long its containers take to exit after
// SIGTERM when it is deleted (evicted, drained). The kubelet waits for them
// at most the pod's grace period (terminationGracePeriodSeconds, or the
// delete's own), then kills them; only then is the pod gone and its GPUs
// free. Without it the containers exit at once.
const AnnStopSeconds = AnnPrefix + "stop-seconds"

// Stopped tells, for a pod being deleted, how long until its containers
// have exited at now (0: they have; the kubelet removes the pod).
func Stopped(pod *corev1.Pod, now time.Time) time.Duration {
	if pod.DeletionTimestamp == nil {
		return 0
	}
	grace := int64(0)
	if pod.DeletionGracePeriodSeconds != nil {
		grace = max(0, *pod.DeletionGracePeriodSeconds)
	}
	stop, err := strconv.ParseInt(pod.Annotations[AnnStopSeconds], 10, 64)
	if err != nil || stop < 0 {
		stop = 0
	}
	// The API server sets the deletion timestamp to the delete's time plus
	// the grace period.
	asked := pod.DeletionTimestamp.Add(-time.Duration(grace) * time.Second)
	return max(0, asked.Add(time.Duration(min(stop, grace))*time.Second).Sub(now))
}

// Run is where a bound pod is in its simulated life.
type Run struct {
	// Done: it Succeeded or Failed; nothing more to do.
	Done bool
	// Running: running and ready; After is when its run time is over (0:
	// it runs until deleted).
	Running bool
	After   time.Duration
	// Finish: its run time is over; it Succeeds now.
	Finish bool
}

// PodRun tells what the kubelet does with a bound pod at now.
func PodRun(pod *corev1.Pod, now time.Time) Run {
	switch pod.Status.Phase {
	case corev1.PodSucceeded, corev1.PodFailed:
		return Run{Done: true}
	}
	ready := pod.Status.Phase == corev1.PodRunning && len(pod.Status.Conditions) > 0
	for _, c := range pod.Status.Conditions {
		if c.Type == corev1.PodReady && c.Status != corev1.ConditionTrue {
			ready = false
		}
	}
	if !ready {
		return Run{}
	}
	secs, err := strconv.Atoi(pod.Annotations[AnnRunSeconds])
	if err != nil || secs < 0 || pod.Status.StartTime == nil {
		return Run{Running: true}
	}
	left := pod.Status.StartTime.Add(time.Duration(secs) * time.Second).Sub(now)
	if left <= 0 {
		return Run{Finish: true}
	}
	return Run{Running: true, After: left}
}

// Succeeded is the pod's status once its containers exited 0.
func Succeeded(pod *corev1.Pod, now metav1.Time) *corev1.Pod {
	p := pod.DeepCopy()
	p.Status.Phase = corev1.PodSucceeded
	for i, c := range p.Status.Conditions {
		if c.Type == corev1.PodReady || c.Type == corev1.ContainersReady {
			p.Status.Conditions[i].Status = corev1.ConditionFalse
			p.Status.Conditions[i].Reason = "PodCompleted"
			p.Status.Conditions[i].LastTransitionTime = now
		}
	}
	p.Status.ContainerStatuses = nil
	for _, c := range pod.Spec.Containers {
		p.Status.ContainerStatuses = append(p.Status.ContainerStatuses, corev1.ContainerStatus{
			Name:  c.Name,
			Image: c.Image,
			State: corev1.ContainerState{Terminated: &corev1.ContainerStateTerminated{
				ExitCode: 0, Reason: "Completed", FinishedAt: now,
			}},
		})
	}
	return p
}
