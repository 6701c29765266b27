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
