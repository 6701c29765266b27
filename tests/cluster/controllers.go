package main

import (
	"context"
	"fmt"
	"time"

	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/runtime/schema"
	utilfeature "k8s.io/apiserver/pkg/util/feature"
	"k8s.io/client-go/discovery/cached/memory"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/metadata"
	"k8s.io/client-go/metadata/metadatainformer"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/restmapper"
	"k8s.io/client-go/scale"
	"k8s.io/controller-manager/pkg/informerfactory"
	"k8s.io/klog/v2"
	"k8s.io/kubernetes/pkg/controller/disruption"
	"k8s.io/kubernetes/pkg/controller/garbagecollector"
	namespacecontroller "k8s.io/kubernetes/pkg/controller/namespace"
	"k8s.io/kubernetes/pkg/controller/resourceclaim"
	"k8s.io/kubernetes/pkg/features"
)

// gcSyncPeriod is how often the garbage collector re-reads discovery, i.e.
// how soon it watches the resources of a newly created CRD. kube-controller-
// manager uses 30s; tests want owners of new kinds collected quickly.
const gcSyncPeriod = 3 * time.Second

// startControllers runs, in this process, the kube-controller-manager
// controllers an apiserver-only cluster misses most: the garbage collector
// (ownerReferences, foreground/background cascading deletion), the
// namespace controller (deleting a namespace empties and removes it) and
// the disruption controller (PodDisruptionBudget status, without which the
// Eviction API refuses every eviction a budget covers) and the resourceclaim
// controller (claims from ResourceClaimTemplates created for pods, and every
// pod's claims, those kube-scheduler generates for extended resources
// included, deallocated once the pod is done; the garbage collector deletes
// a deleted pod's claims through their ownerReferences).
// They stop when ctx is cancelled.
func startControllers(ctx context.Context, cfg *rest.Config) error {
	cfg = rest.CopyConfig(cfg)
	cfg.QPS, cfg.Burst = 200, 400
	kube, err := kubernetes.NewForConfig(rest.AddUserAgent(cfg, "kube-local-controllers"))
	if err != nil {
		return err
	}
	meta, err := metadata.NewForConfig(cfg)
	if err != nil {
		return err
	}
	mapper := restmapper.NewDeferredDiscoveryRESTMapper(memory.NewMemCacheClient(kube.Discovery()))

	shared := informers.NewSharedInformerFactory(kube, 0)
	metaInformers := metadatainformer.NewSharedInformerFactory(meta, 0)
	started := make(chan struct{})

	// Like kube-controller-manager's default: events are not collected.
	ignored := map[schema.GroupResource]struct{}{{Group: "", Resource: "events"}: {}}
	gc, err := garbagecollector.NewGarbageCollector(ctx, kube, meta, mapper, ignored,
		informerfactory.NewInformerFactory(shared, metaInformers), started)
	if err != nil {
		return fmt.Errorf("garbage collector: %w", err)
	}
	ns := namespacecontroller.NewNamespaceController(ctx, kube, meta,
		kube.Discovery().ServerPreferredNamespacedResources,
		shared.Core().V1().Namespaces(), 5*time.Minute, v1.FinalizerKubernetes)

	scaleClient, err := scale.NewForConfig(cfg, mapper, dynamic.LegacyAPIPathResolverFunc,
		scale.NewDiscoveryScaleKindResolver(kube.Discovery()))
	if err != nil {
		return fmt.Errorf("scale client: %w", err)
	}
	dc := disruption.NewDisruptionController(ctx,
		shared.Core().V1().Pods(), shared.Policy().V1().PodDisruptionBudgets(),
		shared.Core().V1().ReplicationControllers(), shared.Apps().V1().ReplicaSets(),
		shared.Apps().V1().Deployments(), shared.Apps().V1().StatefulSets(),
		kube, mapper, scaleClient, kube.Discovery())

	// Built before the informers start: it adds indexers to the shared pod and
	// claim informers. As kube-controller-manager does, only with DRA on.
	var rc *resourceclaim.Controller
	if utilfeature.DefaultFeatureGate.Enabled(features.DynamicResourceAllocation) {
		gate := utilfeature.DefaultFeatureGate
		rc, err = resourceclaim.NewController(klog.FromContext(ctx),
			resourceclaim.Features{
				AdminAccess:            gate.Enabled(features.DRAAdminAccess),
				PrioritizedList:        gate.Enabled(features.DRAPrioritizedList),
				WorkloadResourceClaims: gate.Enabled(features.DRAWorkloadResourceClaims),
			},
			kube, shared.Core().V1().Pods(), shared.Scheduling().V1alpha2().PodGroups(),
			shared.Resource().V1().ResourceClaims(), shared.Resource().V1().ResourceClaimTemplates())
		if err != nil {
			return fmt.Errorf("resourceclaim controller: %w", err)
		}
	}

	shared.Start(ctx.Done())
	metaInformers.Start(ctx.Done())
	close(started)

	go gc.Run(ctx, 4, gcSyncPeriod)
	go gc.Sync(ctx, kube.Discovery(), gcSyncPeriod)
	go ns.Run(ctx, 4)
	go dc.Run(ctx)
	if rc != nil {
		go rc.Run(ctx, 4)
	}
	return nil
}
