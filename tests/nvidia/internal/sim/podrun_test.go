package sim

import (
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

func TestPodRun(t *testing.T) {
	start := time.Unix(1000, 0)
	running := func(ann string) *corev1.Pod {
		p := &corev1.Pod{Status: corev1.PodStatus{
			Phase:      corev1.PodRunning,
			StartTime:  &metav1.Time{Time: start},
			Conditions: []corev1.PodCondition{{Type: corev1.PodReady, Status: corev1.ConditionTrue}},
		}}
		if ann != "" {
			p.Annotations = map[string]string{AnnRunSeconds: ann}
		}
		return p
	}
	if r := PodRun(&corev1.Pod{}, start); r != (Run{}) {
		t.Errorf("a bound pod not yet run: %+v", r)
	}
	if r := PodRun(running(""), start.Add(time.Hour)); r != (Run{Running: true}) {
		t.Errorf("no run time: runs until deleted: %+v", r)
	}
	if r := PodRun(running("5"), start.Add(2*time.Second)); r != (Run{Running: true, After: 3 * time.Second}) {
		t.Errorf("5 s, 2 s in: %+v", r)
	}
	if r := PodRun(running("5"), start.Add(5*time.Second)); r != (Run{Finish: true}) {
		t.Errorf("5 s, 5 s in: %+v", r)
	}
	done := Succeeded(running("5"), metav1.Time{Time: start.Add(5 * time.Second)})
	if done.Status.Phase != corev1.PodSucceeded || PodRun(done, start.Add(time.Hour)) != (Run{Done: true}) {
		t.Errorf("succeeded: %+v", done.Status)
	}
}

// A deleted pod is gone once its containers exit: at once without
// AnnStopSeconds, else after that long, never later than its grace period.
func TestStopped(t *testing.T) {
	now := time.Now()
	pod := func(grace int64, stop string) *corev1.Pod {
		ts := metav1.NewTime(now.Add(time.Duration(grace) * time.Second))
		p := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{DeletionTimestamp: &ts, DeletionGracePeriodSeconds: &grace, Annotations: map[string]string{}}}
		if stop != "" {
			p.Annotations[AnnStopSeconds] = stop
		}
		return p
	}
	for _, c := range []struct {
		grace int64
		stop  string
		want  time.Duration
	}{{30, "", 0}, {30, "20", 20 * time.Second}, {5, "20", 5 * time.Second}, {0, "20", 0}, {30, "x", 0}} {
		if got := Stopped(pod(c.grace, c.stop), now); got != c.want {
			t.Fatalf("grace %d stop %q: %v, want %v", c.grace, c.stop, got, c.want)
		}
	}
	if got := Stopped(&corev1.Pod{}, now); got != 0 {
		t.Fatalf("not deleted: %v", got)
	}
}
