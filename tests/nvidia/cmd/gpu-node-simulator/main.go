// Command gpu-node-simulator is a TEST-ONLY SIMULATOR of NVIDIA's node
// components for clusters without GPUs. It is not NVIDIA software. On every
// Node labelled nvidia.com/gpu.present=true it plays:
//
//   - the MIG manager: reacts to nvidia.com/mig.config, sets
//     nvidia.com/mig.config.state (pending, then success or failed), looks
//     layouts up in the mig-parted ConfigMap named by the ClusterPolicy and
//     parses them with mig-parted's own parser;
//   - the device plugin with its config-manager, and GPU Feature Discovery:
//     picks the device-plugin ConfigMap key (node label
//     nvidia.com/device-plugin.config, else ClusterPolicy default, else the
//     fallbacks), loads it with the device plugin's config package and sets
//     the GFD sharing labels and status capacity/allocatable.
//
// See tests/nvidia/README.md for what is simulated and how faithfully.
package main

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log"
	"os"
	"os/signal"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"time"

	corev1 "k8s.io/api/core/v1"
	resourcev1 "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/selection"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/dynamic"
	corev1client "k8s.io/client-go/kubernetes/typed/core/v1"
	resourcev1client "k8s.io/client-go/kubernetes/typed/resource/v1"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/client-go/util/workqueue"

	"gpusharing.io/tests/nvidia/internal/nvconf"
	"gpusharing.io/tests/nvidia/internal/sim"
)

const fieldManager = "gpu-node-simulator"

var clusterPolicyGVR = schema.GroupVersionResource{Group: "nvidia.com", Version: "v1", Resource: "clusterpolicies"}

type options struct {
	kubeconfig       string
	consumableShares string
	namespace        string
	clusterPolicy    string
	migDelay         time.Duration
	exitOnStdinEOF   bool
	autoLabelMig     bool
	fallbacks        string
	defaultMigConfig string
	defaultVgpu      string
	instanceTypes    string
	retry            time.Duration
	restartDelay     time.Duration
}

func main() {
	var o options
	flag.StringVar(&o.kubeconfig, "kubeconfig", os.Getenv("KUBECONFIG"), "kubeconfig of the cluster")
	flag.StringVar(&o.namespace, "namespace", "gpu-operator", "the GPU Operator's namespace (where the device-plugin and mig-parted ConfigMaps live)")
	flag.StringVar(&o.clusterPolicy, "cluster-policy", "cluster-policy", "name of the ClusterPolicy to follow")
	flag.DurationVar(&o.migDelay, "mig-delay", 500*time.Millisecond, "how long a MIG reconfiguration stays pending")
	flag.BoolVar(&o.exitOnStdinEOF, "exit-on-stdin-eof", false, "exit when standard input reaches EOF (for test harnesses)")
	flag.BoolVar(&o.autoLabelMig, "auto-label-mig-config", true, "label MIG-capable nodes without nvidia.com/mig.config with all-disabled, as the GPU Operator does")
	flag.StringVar(&o.fallbacks, "fallback-strategies", sim.FallbackEmpty, "config-manager FALLBACK_STRATEGIES when neither label nor default names a config (the GPU Operator uses 'empty'; the plugin's Helm chart 'named,single')")
	flag.StringVar(&o.defaultMigConfig, "default-mig-config", "", "mig-parted config (file: ConfigMap manifest or raw) used when the ClusterPolicy names none and the namespace has no "+sim.DefaultMigConfigMap+" (default: a small built-in config)")
	flag.StringVar(&o.defaultVgpu, "default-vgpu-config", "", "vGPU-devices config (file: ConfigMap manifest or raw) played as the GPU Operator's "+sim.DefaultVgpuConfigMap+" when the namespace has none (default: assets/default-vgpu-devices-config.yaml beside the executable, if present)")
	flag.StringVar(&o.instanceTypes, "instance-types", "", "the operator's instance-type table (file: ConfigMap manifest with data key "+sim.InstanceTypesKey+", or the YAML/JSON map itself): a node without nvidia.com/gpu.product whose "+sim.LabelInstanceType+" is in it gets that hardware, GPU Feature Discovery's labels and, if it has no Ready condition, Ready=True (nodes Karpenter's kwok provider creates)")
	flag.DurationVar(&o.restartDelay, "restart-delay", time.Second, "how long the device plugin and GPU Feature Discovery take to restart after a reload trigger (config label, ClusterPolicy, MIG geometry) before they load the config and GFD relabels with a new nvidia.com/gfd.timestamp")
	flag.DurationVar(&o.retry, "crashloop-retry", 5*time.Second, "how often a node whose simulated device plugin cannot start is re-evaluated")
	flag.StringVar(&o.consumableShares, "dra-consumable-shares", "disabled", "the DRA driver's --consumable-shares (its ConsumableShares feature gate on): disabled, memory, unlimited or a positive integer N (each GPU publishes shares=N, a claim takes 1 by default)")
	flag.Parse()
	log.SetFlags(log.Ltime | log.Lmicroseconds)
	log.SetPrefix("gpu-node-simulator: ")
	log.SetOutput(os.Stderr)

	ctx, cancel := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer cancel()
	if o.exitOnStdinEOF {
		go func() {
			_, _ = io.Copy(io.Discard, bufio.NewReader(os.Stdin))
			log.Print("standard input closed: exiting")
			cancel()
		}()
	}
	if err := run(ctx, &o); err != nil && !errors.Is(err, context.Canceled) {
		log.Printf("error: %v", err)
		os.Exit(1)
	}
}

type simulator struct {
	o     *options
	core  corev1client.CoreV1Interface
	res   resourcev1client.ResourceV1Interface
	dyn   dynamic.Interface
	queue workqueue.TypedRateLimitingInterface[string]
	nodes cache.Store
	// tableNodes: nodes whose instance type is in the --instance-types
	// table (nil without the flag).
	tableNodes cache.Store
	table      sim.InstanceTypes
	cms        cache.Store
	cps        cache.Store
	builtin    string
	// vgpuDefault: the GPU Operator's default vGPU-devices config.
	vgpuDefault string

	mu       sync.Mutex
	timers   map[string]pendingMig     // node -> MIG reconfiguration in progress
	restarts map[string]pendingRestart // node -> device plugin/GFD restart in progress
	lastLog  map[string]string         // node -> last message of logOnce
	// devices: pod UID -> the devices the kubelet gave it, until the pod
	// cache shows them on the pod (sim.AnnDevices).
	devices sync.Map
}

type pendingRestart struct {
	key string
	due time.Time
}

type pendingMig struct {
	layout string
	due    time.Time
}

func run(ctx context.Context, o *options) error {
	cfg, err := clientcmd.BuildConfigFromFlags("", o.kubeconfig)
	if err != nil {
		return fmt.Errorf("kubeconfig: %w", err)
	}
	cfg.UserAgent = fieldManager
	// The simulator plays every node's components, each of which has its own
	// client in a real cluster: client-go's default 5 QPS for the whole fleet
	// would make 40 nodes confirm one every ~0.6 s.
	cfg.QPS, cfg.Burst = 200, 400
	core, err := corev1client.NewForConfig(cfg)
	if err != nil {
		return err
	}
	dyn, err := dynamic.NewForConfig(cfg)
	if err != nil {
		return err
	}
	res, err := resourcev1client.NewForConfig(cfg)
	if err != nil {
		return err
	}
	if err := sim.ValidConsumableShares(o.consumableShares); err != nil {
		return err
	}
	s := &simulator{
		o: o, core: core, res: res, dyn: dyn,
		// A failed write (e.g. the API server restarting) is retried per node within 2 s, as
		// NVIDIA's components re-evaluate on their own loops; client-go's default limiter adds
		// a fleet-wide 10/s bucket, which after an outage on 200 nodes delays the last retries
		// by minutes.
		queue:    workqueue.NewTypedRateLimitingQueue(workqueue.NewTypedItemExponentialFailureRateLimiter[string](5*time.Millisecond, 2*time.Second)),
		timers:   map[string]pendingMig{},
		restarts: map[string]pendingRestart{},
		lastLog:  map[string]string{},
		builtin:  sim.BuiltinMigConfig,
	}
	if o.defaultMigConfig != "" {
		if s.builtin, err = nvconf.ReadMigConfigFile(o.defaultMigConfig); err != nil {
			return err
		}
	}
	if o.instanceTypes != "" {
		data, err := os.ReadFile(o.instanceTypes)
		if err != nil {
			return fmt.Errorf("--instance-types: %w", err)
		}
		if s.table, err = sim.ParseInstanceTypes(data); err != nil {
			return fmt.Errorf("--instance-types %s: %w", o.instanceTypes, err)
		}
	}
	if o.defaultVgpu == "" {
		if exe, err := os.Executable(); err == nil {
			p := filepath.Join(filepath.Dir(exe), "assets", "default-vgpu-devices-config.yaml")
			if _, err := os.Stat(p); err == nil {
				o.defaultVgpu = p
			}
		}
	}
	if o.defaultVgpu != "" {
		// The same ConfigMap-or-raw reading as the mig-parted config.
		if s.vgpuDefault, err = nvconf.ReadMigConfigFile(o.defaultVgpu); err != nil {
			return err
		}
	}
	defer s.queue.ShutDown()

	enqueueNode := func(obj any) {
		if key, err := cache.DeletionHandlingMetaNamespaceKeyFunc(obj); err == nil {
			s.queue.Add(key)
		}
	}
	enqueueAll := func(any) {
		for _, name := range s.nodes.ListKeys() {
			s.queue.Add(name)
		}
		if s.tableNodes != nil {
			for _, name := range s.tableNodes.ListKeys() {
				s.queue.Add(name)
			}
		}
	}
	handlers := func(f func(any)) cache.ResourceEventHandlerFuncs {
		return cache.ResourceEventHandlerFuncs{
			AddFunc:    f,
			UpdateFunc: func(_, n any) { f(n) },
			DeleteFunc: f,
		}
	}

	nodeLW := cache.NewFilteredListWatchFromClient(core.RESTClient(), "nodes", metav1.NamespaceAll, func(lo *metav1.ListOptions) {
		lo.LabelSelector = sim.LabelGPUPresent + "=true"
	})
	nodeInf := cache.NewSharedIndexInformer(nodeLW, &corev1.Node{}, 0, cache.Indexers{})
	_, _ = nodeInf.AddEventHandler(handlers(enqueueNode))
	s.nodes = nodeInf.GetStore()
	synced := []cache.InformerSynced{nodeInf.HasSynced}
	if len(s.table) > 0 {
		// Nodes of the table's instance types, GPU-labelled or not (a label
		// selector cannot say "gpu.present=true OR instance type in ...").
		req, err := labels.NewRequirement(sim.LabelInstanceType, selection.In, s.table.Names())
		if err != nil {
			return fmt.Errorf("--instance-types: %w", err)
		}
		sel := labels.NewSelector().Add(*req).String()
		tableLW := cache.NewFilteredListWatchFromClient(core.RESTClient(), "nodes", metav1.NamespaceAll, func(lo *metav1.ListOptions) {
			lo.LabelSelector = sel
		})
		tableInf := cache.NewSharedIndexInformer(tableLW, &corev1.Node{}, 0, cache.Indexers{})
		_, _ = tableInf.AddEventHandler(handlers(enqueueNode))
		s.tableNodes = tableInf.GetStore()
		synced = append(synced, tableInf.HasSynced)
		go tableInf.Run(ctx.Done())
		log.Printf("instance types from %s: %s", o.instanceTypes, strings.Join(s.table.Names(), ", "))
	}

	cmLW := cache.NewListWatchFromClient(core.RESTClient(), "configmaps", o.namespace, fields.Everything())
	cmInf := cache.NewSharedIndexInformer(cmLW, &corev1.ConfigMap{}, 0, cache.Indexers{})
	_, _ = cmInf.AddEventHandler(handlers(enqueueAll))
	s.cms = cmInf.GetStore()

	cpRes := dyn.Resource(clusterPolicyGVR)
	cpSel := fields.OneTermEqualSelector("metadata.name", o.clusterPolicy).String()
	cpLW := &cache.ListWatch{
		ListFunc: func(lo metav1.ListOptions) (runtime.Object, error) {
			lo.FieldSelector = cpSel
			return cpRes.List(ctx, lo)
		},
		WatchFunc: func(lo metav1.ListOptions) (watch.Interface, error) {
			lo.FieldSelector = cpSel
			return cpRes.Watch(ctx, lo)
		},
	}
	cpInf := cache.NewSharedIndexInformer(cpLW, &unstructured.Unstructured{}, 0, cache.Indexers{})
	_, _ = cpInf.AddEventHandler(handlers(enqueueAll))
	s.cps = cpInf.GetStore()

	// The kubelet's part for pods bound to simulated GPU nodes (drains in the
	// tests use real Pod objects): pods become Running and Ready, and a pod
	// being deleted (an eviction, a graceful delete) is removed once its
	// grace period would start, as the kubelet confirms a termination.
	podLW := cache.NewFilteredListWatchFromClient(core.RESTClient(), "pods", metav1.NamespaceAll, func(lo *metav1.ListOptions) {
		lo.FieldSelector = "spec.nodeName!="
	})
	podInf := cache.NewSharedIndexInformer(podLW, &corev1.Pod{}, 0, cache.Indexers{})
	podQueue := workqueue.NewTypedRateLimitingQueue(workqueue.DefaultTypedControllerRateLimiter[string]())
	_, _ = podInf.AddEventHandler(handlers(func(obj any) {
		if key, err := cache.DeletionHandlingMetaNamespaceKeyFunc(obj); err == nil {
			podQueue.Add(key)
		}
	}))
	go podInf.Run(ctx.Done())
	go func() {
		<-ctx.Done()
		podQueue.ShutDown()
	}()

	go nodeInf.Run(ctx.Done())
	go cmInf.Run(ctx.Done())
	go cpInf.Run(ctx.Done())
	if !cache.WaitForCacheSync(ctx.Done(), append(synced, cmInf.HasSynced)...) {
		return ctx.Err()
	}
	// Pods are handled once the GPU nodes are known (a pod on a node not yet
	// in the store would be ignored for good).
	go func() {
		for {
			key, shutdown := podQueue.Get()
			if shutdown {
				return
			}
			after, err := s.kubelet(ctx, podInf.GetStore(), key)
			if err != nil && ctx.Err() == nil {
				log.Printf("pod %s: %v (retrying)", key, err)
				podQueue.AddRateLimited(key)
			} else {
				podQueue.Forget(key)
				if after > 0 {
					podQueue.AddAfter(key, after)
				}
			}
			podQueue.Done(key)
		}
	}()

	// Without the ClusterPolicy CRD the list never succeeds: go on without
	// a ClusterPolicy (plugin defaults) rather than wait forever.
	cpCtx, cpCancel := context.WithTimeout(ctx, 10*time.Second)
	if !cache.WaitForCacheSync(cpCtx.Done(), cpInf.HasSynced) {
		log.Printf("warning: ClusterPolicies (%s) not listable yet; acting as if there were none", clusterPolicyGVR.GroupResource())
	}
	cpCancel()
	log.Printf("watching GPU nodes, ConfigMaps in %s and ClusterPolicy %s (mig-delay %v)", o.namespace, o.clusterPolicy, o.migDelay)
	enqueueAll(nil)

	go func() {
		<-ctx.Done()
		s.queue.ShutDown()
	}()
	// Nodes are independent (the queue never hands one node to two workers).
	var wg sync.WaitGroup
	for range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for s.processNext(ctx) {
			}
		}()
	}
	wg.Wait()
	return ctx.Err()
}

func (s *simulator) processNext(ctx context.Context) bool {
	name, shutdown := s.queue.Get()
	if shutdown {
		return false
	}
	defer s.queue.Done(name)
	requeue, err := s.sync(ctx, name)
	switch {
	case err != nil && ctx.Err() == nil:
		log.Printf("node %s: %v (retrying)", name, err)
		s.queue.AddRateLimited(name)
	case requeue > 0:
		s.queue.Forget(name)
		s.queue.AddAfter(name, requeue)
	default:
		s.queue.Forget(name)
	}
	return true
}

// sync evaluates one node against the current cluster state and writes the
// difference.
func (s *simulator) sync(ctx context.Context, name string) (time.Duration, error) {
	// Read the node fresh: the informer may not have seen our last write yet.
	node, err := s.core.Nodes().Get(ctx, name, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		s.mu.Lock()
		delete(s.timers, name)
		delete(s.restarts, name)
		s.mu.Unlock()
		return 0, nil
	}
	if err != nil {
		return 0, err
	}
	tableType, fromTable := sim.TableNode(node.Labels, node.Annotations, s.table)
	if node.Labels[sim.LabelGPUPresent] != "true" && !fromTable {
		return 0, nil
	}
	n := &sim.Node{
		Name: name, Labels: node.Labels, Annotations: node.Annotations,
		Capacity: resourceStrings(node.Status.Capacity), Allocatable: resourceStrings(node.Status.Allocatable),
	}
	if n.Labels == nil {
		n.Labels = map[string]string{}
	}
	if n.Annotations == nil {
		n.Annotations = map[string]string{}
	}
	patch := &sim.Patch{}
	if fromTable {
		// A node of a table instance type (Karpenter's kwok provider creates
		// them bare): GFD labels it, and its kubelet posts Ready.
		_, recorded := sim.PlanInstanceType(n, tableType, s.table[tableType], patch)
		if !sim.HasReadyCondition(node.Status.Conditions) {
			c := sim.KubeletReady(time.Now())
			patch.Ready = &c
			patch.Log = append(patch.Log, "kubelet: no Ready condition: posting Ready=True")
			// A kubelet reports extended resources only once a device plugin
			// registers them: drop the NVIDIA ones the node was created with
			// (Karpenter's kwok provider copies the pod's requests there).
			for _, m := range []corev1.ResourceList{node.Status.Capacity, node.Status.Allocatable} {
				for r := range m {
					if strings.HasPrefix(string(r), "nvidia.com/") && !slices.Contains(patch.DropResources, string(r)) {
						patch.DropResources = append(patch.DropResources, string(r))
					}
				}
			}
		}
		if !recorded || patch.Ready != nil {
			// Written on their own (whatever taints or ClusterPolicy say);
			// the next pass plays the node as any GPU node.
			if err := s.write(ctx, node, patch); err != nil {
				return 0, err
			}
			return time.Millisecond, nil
		}
	}
	hw, recorded := sim.HardwareOf(n.Labels, n.Annotations)
	if !recorded {
		b, _ := json.Marshal(hw)
		patch.Annotations = map[string]*string{sim.AnnHardware: ptr(string(b))}
		patch.Log = append(patch.Log, "first seen: hardware "+string(b))
	}
	cp := s.clusterPolicy()
	var taints []sim.Taint
	for _, t := range node.Spec.Taints {
		taints = append(taints, sim.Taint{Key: t.Key, Value: t.Value, Effect: string(t.Effect)})
	}
	if key := sim.Untolerated(taints, cp.Tolerations); key != "" {
		// The GPU Operator's DaemonSets are not scheduled here: no MIG
		// manager, device plugin or GFD acts on the node.
		s.logOnce(name, "GPU Operator DaemonSets do not run: taint "+key+" not tolerated by ClusterPolicy spec.daemonsets.tolerations")
		return 0, nil
	}

	if !cp.Found {
		// No ClusterPolicy (deleted, or the GPU Operator's DRA-only mode): the
		// GPU Operator deploys no container operands, so no MIG manager,
		// device plugin or GFD runs; the kubelet withdraws the plugin's
		// resources.
		s.logOnce(name, "no ClusterPolicy: the GPU Operator deploys no device plugin, GFD or MIG manager")
		sim.PlanDevicePluginGone(n, patch)
		s.mu.Lock()
		delete(s.restarts, name)
		s.mu.Unlock()
		if err := s.draPlugin(ctx, node, n, hw, sim.GeometryOf(n.Annotations, hw.Count), patch); err != nil {
			return 0, err
		}
		return 0, s.write(ctx, node, patch)
	}

	if workload := sim.Workload(n, cp); workload != sim.WorkloadCtr {
		// A VM node: no container stack; the sandbox operands act.
		s.logOnce(name, "workload "+workload+": the GPU Operator runs the sandbox operands, not the device plugin, GFD or MIG manager")
		sim.PlanSandbox(n, hw, workload, s.sandboxInput(cp), patch)
		// The GPUs belong to VFIO or the vGPU manager: the DRA driver's GPU
		// plugin publishes none of them.
		delete(n.Labels, sim.LabelDeployDRADriver)
		if err := s.draPlugin(ctx, node, n, hw, nil, patch); err != nil {
			return 0, err
		}
		s.mu.Lock()
		delete(s.restarts, name)
		delete(s.timers, name)
		s.mu.Unlock()
		return 0, s.write(ctx, node, patch)
	}
	sim.PlanSandboxGone(n, patch)

	// MIG manager.
	migIn := sim.MigInput{Now: time.Now(), Delay: s.o.migDelay, AutoLabelEmpty: s.o.autoLabelMig}
	migIn.MigConfig, migIn.Source, migIn.Err = s.migConfig(cp)
	desired := n.Labels[sim.LabelMigConfig]
	s.mu.Lock()
	if t, ok := s.timers[name]; ok && t.layout == desired {
		migIn.Due = &t.due
	}
	s.mu.Unlock()
	if migIn.Due != nil && !migIn.Now.Before(*migIn.Due) {
		pods, err := s.core.Pods(metav1.NamespaceAll).List(ctx, metav1.ListOptions{FieldSelector: "spec.nodeName=" + name})
		if err != nil {
			return 0, err
		}
		migIn.Busy = sim.BusyOf(pods.Items, name)
	}
	migRes := sim.PlanMig(n, hw, migIn, patch)

	// Device plugin + GFD.
	dpIn := sim.DPInput{CP: cp, Fallbacks: splitList(s.o.fallbacks), Geometry: migRes.Geometry}
	if cp.DPConfigName != "" {
		if obj, ok, _ := s.cms.GetByKey(s.o.namespace + "/" + cp.DPConfigName); ok {
			dpIn.ConfigMap = obj.(*corev1.ConfigMap).Data
			if dpIn.ConfigMap == nil {
				dpIn.ConfigMap = map[string]string{}
			}
		}
	}
	var dpRes sim.DPResult
	var restartWait time.Duration
	sim.PlanOperandLabels(n, patch)
	if !sim.DevicePluginDeployed(n) {
		// No device-plugin pod on the node: nothing loads; the kubelet
		// withdraws the plugin's resources.
		sim.PlanDevicePluginGone(n, patch)
		s.mu.Lock()
		delete(s.restarts, name)
		s.mu.Unlock()
	} else if migRes.InProgress {
		// The MIG manager has paused the device plugin on the whole node.
		sim.PlanDevicePluginPaused(n, patch)
		s.mu.Lock()
		delete(s.restarts, name)
		s.mu.Unlock()
	} else {
		// A reload trigger restarts the plugin and GFD: they load the new
		// config (and GFD stamps its labels) only after restartDelay.
		now := time.Now()
		dpIn.Now = now
		key := sim.DPLoadKey(n, dpIn)
		s.mu.Lock()
		r, ok := s.restarts[name]
		if sim.DPLoaded(n, key) {
			delete(s.restarts, name)
		} else if !ok || r.key != key {
			r = pendingRestart{key: key, due: now.Add(s.o.restartDelay)}
			s.restarts[name] = r
		}
		s.mu.Unlock()
		hung := n.Annotations[sim.AnnFault] == sim.FaultDevicePluginHang
		switch {
		case sim.DPLoaded(n, key):
			dpRes = sim.PlanDevicePlugin(n, hw, dpIn, patch)
		case hung:
			patch.Log = append(patch.Log, "fault injected: the device plugin hangs on restart")
		case !now.Before(r.due):
			dpRes = sim.PlanDevicePlugin(n, hw, dpIn, patch)
		default:
			restartWait = r.due.Sub(now)
		}
	}

	if err := s.draPlugin(ctx, node, n, hw, migRes.Geometry, patch); err != nil {
		return 0, err
	}
	if err := s.write(ctx, node, patch); err != nil {
		return 0, err
	}
	s.mu.Lock()
	switch {
	case migRes.StartTimer:
		s.timers[name] = pendingMig{layout: desired, due: migIn.Now.Add(s.o.migDelay)}
	case migRes.ClearTimer:
		delete(s.timers, name)
	}
	s.mu.Unlock()
	requeue := migRes.Requeue
	if restartWait > 0 && (requeue == 0 || requeue > restartWait) {
		requeue = restartWait
	}
	if dpRes.Failed && (requeue == 0 || requeue > s.o.retry) {
		requeue = s.o.retry
	}
	return requeue, nil
}

// kubelet plays the kubelet for one pod bound to a simulated GPU node: it
// runs it, and a pod with the run-seconds annotation Succeeds after that long
// (its resources are free again for the scheduler). Returns when to look at
// the pod again.
func (s *simulator) kubelet(ctx context.Context, pods cache.Store, key string) (time.Duration, error) {
	obj, ok, _ := pods.GetByKey(key)
	if !ok {
		return 0, nil
	}
	pod := obj.(*corev1.Pod)
	if !s.ours(pod.Spec.NodeName) {
		return 0, nil
	}
	if pod.DeletionTimestamp != nil {
		if wait := sim.Stopped(pod, time.Now()); wait > 0 {
			// Its containers are still exiting (AnnStopSeconds, at most
			// the grace period): it runs and holds its GPUs until then.
			return wait, nil
		}
		zero := int64(0)
		err := s.core.Pods(pod.Namespace).Delete(ctx, pod.Name, metav1.DeleteOptions{GracePeriodSeconds: &zero})
		if err == nil {
			log.Printf("pod %s: terminated (kubelet)", key)
		}
		if apierrors.IsNotFound(err) {
			return 0, nil
		}
		return 0, err
	}
	switch run := sim.PodRun(pod, time.Now()); {
	case run.Done:
		return 0, nil
	case run.Finish:
		p := sim.Succeeded(pod, metav1.Now())
		_, err := s.core.Pods(pod.Namespace).UpdateStatus(ctx, p, metav1.UpdateOptions{FieldManager: fieldManager})
		if err == nil {
			log.Printf("pod %s: succeeded after its run time (kubelet)", key)
		}
		if apierrors.IsNotFound(err) {
			return 0, nil
		}
		return 0, err
	case run.Running:
		return run.After, nil
	}
	pod, wait, err := s.prepareDRA(ctx, pod)
	if pod == nil || wait > 0 || err != nil {
		return wait, err
	}
	p, wait, err := s.admitDevices(ctx, pods, pod)
	if p == nil || wait > 0 || err != nil {
		return wait, err
	}
	now := metav1.Now()
	p.Status.Phase = corev1.PodRunning
	p.Status.StartTime = &now
	p.Status.Conditions = nil
	for _, t := range []corev1.PodConditionType{corev1.PodScheduled, corev1.PodInitialized, corev1.ContainersReady, corev1.PodReady} {
		p.Status.Conditions = append(p.Status.Conditions, corev1.PodCondition{Type: t, Status: corev1.ConditionTrue, LastTransitionTime: now})
	}
	_, err = s.core.Pods(pod.Namespace).UpdateStatus(ctx, p, metav1.UpdateOptions{FieldManager: fieldManager})
	if err == nil {
		log.Printf("pod %s: running and ready (kubelet)", key)
	}
	if apierrors.IsNotFound(err) {
		return 0, nil
	}
	return sim.PodRun(p, time.Now()).After, err
}

// prepareDRA is the kubelet asking NVIDIA's DRA kubelet plugin to prepare
// a pod's claims before it starts (NodePrepareResources): each claim is
// checked as the plugin and the kubelet check it (sim.PrepareClaim) against
// the ResourceSlice the plugin published for the node; the prepared devices
// are recorded on the pod (sim.AnnDRAPrepared). A claim that cannot be
// prepared keeps the pod from starting (retried every second, as the
// kubelet's FailedPrepareDynamicResources). Returns the pod to go on with
// (nil: gone), or how long to wait.
func (s *simulator) prepareDRA(ctx context.Context, pod *corev1.Pod) (*corev1.Pod, time.Duration, error) {
	claims := sim.PodClaimNames(pod)
	if len(claims) == 0 || pod.Annotations[sim.AnnDRAPrepared] != "" {
		return pod, 0, nil
	}
	obj, ok, _ := s.nodes.GetByKey(pod.Spec.NodeName)
	if !ok && s.tableNodes != nil {
		obj, ok, _ = s.tableNodes.GetByKey(pod.Spec.NodeName)
	}
	if !ok {
		return pod, 0, nil
	}
	node := obj.(*corev1.Node)
	n := &sim.Node{Name: node.Name, Labels: node.Labels, Annotations: node.Annotations}
	var published []resourcev1.Device
	slice, err := s.res.ResourceSlices().Get(ctx, sim.DRASliceName(node.Name), metav1.GetOptions{})
	if err == nil {
		published = slice.Spec.Devices
	} else if !apierrors.IsNotFound(err) {
		return nil, 0, err
	}
	prepared := map[string][]string{}
	for _, name := range claims {
		claim, err := s.res.ResourceClaims(pod.Namespace).Get(ctx, name, metav1.GetOptions{})
		if err == nil {
			prepared[name], err = sim.PrepareClaim(claim, pod, n, published)
		}
		if err != nil {
			s.logOnce(node.Name, fmt.Sprintf("kubelet: pod %s/%s: FailedPrepareDynamicResources: %v", pod.Namespace, pod.Name, err))
			return nil, time.Second, nil
		}
	}
	value := sim.PreparedValue(prepared)
	patch, _ := json.Marshal(map[string]any{"metadata": map[string]any{"annotations": map[string]string{sim.AnnDRAPrepared: value}}})
	out, err := s.core.Pods(pod.Namespace).Patch(ctx, pod.Name, types.MergePatchType, patch, metav1.PatchOptions{FieldManager: fieldManager})
	if apierrors.IsNotFound(err) {
		return nil, 0, nil
	}
	if err != nil {
		return nil, 0, err
	}
	log.Printf("pod %s/%s: DRA claims prepared: %s (kubelet plugin)", pod.Namespace, pod.Name, value)
	return out, 0, nil
}

// admitDevices is the kubelet's device manager admitting a pod that asks
// for NVIDIA resources: while the MIG manager reshapes the node the device
// plugin is paused and no GPU pod starts (retried in a second); otherwise
// the pod gets devices no running pod holds (sim.AssignDevices), recorded on
// it (sim.AnnDevices). With too few free devices the real kubelet rejects the
// pod (UnexpectedAdmissionError); the simulator logs it and runs the pod on
// unknown devices ("*": it counts as using every GPU of the node). Returns
// the pod to start (nil: gone), or how long to wait.
func (s *simulator) admitDevices(ctx context.Context, pods cache.Store, pod *corev1.Pod) (*corev1.Pod, time.Duration, error) {
	if len(sim.GPURequests(pod)) == 0 || pod.Annotations[sim.AnnDevices] != "" {
		return pod.DeepCopy(), 0, nil
	}
	obj, ok, _ := s.nodes.GetByKey(pod.Spec.NodeName)
	if !ok && s.tableNodes != nil {
		obj, ok, _ = s.tableNodes.GetByKey(pod.Spec.NodeName)
	}
	if !ok {
		return pod.DeepCopy(), 0, nil
	}
	node := obj.(*corev1.Node)
	if node.Labels[sim.LabelMigState] == sim.StatePending {
		s.logOnce(pod.Spec.NodeName, "kubelet: GPU pods wait: the device plugin is paused while the MIG manager reshapes the node")
		return nil, time.Second, nil
	}
	hw, _ := sim.HardwareOf(node.Labels, node.Annotations)
	var onNode []corev1.Pod
	for _, o := range pods.List() {
		if p := o.(*corev1.Pod); p.Spec.NodeName == pod.Spec.NodeName && p.UID != pod.UID {
			if p.Annotations[sim.AnnDevices] != "" {
				s.devices.Delete(string(p.UID))
			} else if d, ok := s.devices.Load(string(p.UID)); ok {
				p = p.DeepCopy()
				p.Annotations = map[string]string{sim.AnnDevices: d.(string)}
			}
			onNode = append(onNode, *p)
		}
	}
	devices, err := sim.AssignDevices(pod, sim.GeometryOf(node.Annotations, hw.Count), sim.PlacementsOf(node.Annotations, hw.Count),
		sim.AdvertisedOf(node.Annotations), sim.BusyOf(onNode, pod.Spec.NodeName))
	if err != nil {
		log.Printf("pod %s/%s: %v: the real kubelet would reject it (UnexpectedAdmissionError); running it on unknown devices", pod.Namespace, pod.Name, err)
		devices = sim.AnyDevice
	}
	patch, _ := json.Marshal(map[string]any{"metadata": map[string]any{"annotations": map[string]string{sim.AnnDevices: devices}}})
	out, err := s.core.Pods(pod.Namespace).Patch(ctx, pod.Name, types.MergePatchType, patch, metav1.PatchOptions{FieldManager: fieldManager})
	if apierrors.IsNotFound(err) {
		return nil, 0, nil
	}
	if err != nil {
		return nil, 0, err
	}
	s.devices.Store(string(pod.UID), devices)
	return out, 0, nil
}

// ours reports whether the simulator plays the node's kubelet: a GPU node,
// or one whose hardware the instance-type table gives.
func (s *simulator) ours(name string) bool {
	if _, ok, _ := s.nodes.GetByKey(name); ok {
		return true
	}
	if s.tableNodes == nil {
		return false
	}
	obj, ok, _ := s.tableNodes.GetByKey(name)
	if !ok {
		return false
	}
	node := obj.(*corev1.Node)
	_, fromTable := sim.TableNode(node.Labels, node.Annotations, s.table)
	return fromTable
}

// logOnce logs msg for a node unless it was the last message logged for it.
func (s *simulator) logOnce(node, msg string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.lastLog[node] == msg {
		return
	}
	s.lastLog[node] = msg
	log.Printf("node %s: %s", node, msg)
}

// draPlugin plays the DRA driver's kubelet plugin on the node: while it is
// deployed there (sim.LabelDeployDRADriver) it publishes the node's GPUs as
// NVML shows them (geo) in the node's ResourceSlice, owned by the Node as
// the real plugin's helper does; when it is gone, the slice goes too. The
// slice is written before the node's patch records it (sim.AnnDRASlice), so
// a failed write is retried.
func (s *simulator) draPlugin(ctx context.Context, node *corev1.Node, n *sim.Node, hw sim.Hardware, geo sim.Geometry, patch *sim.Patch) error {
	var devices []resourcev1.Device
	if sim.DRAPluginDeployed(n) {
		var err error
		devices, err = sim.DRADevices(node.Name, hw, geo, sim.PlacementsOf(n.Annotations, hw.Count), s.o.consumableShares)
		if err != nil {
			s.logOnce(node.Name, "DRA kubelet plugin cannot publish: "+err.Error())
			return nil
		}
	}
	publish, withdraw := sim.PlanDRASlice(n, devices, patch)
	name := sim.DRASliceName(node.Name)
	switch {
	case withdraw:
		err := s.res.ResourceSlices().Delete(ctx, name, metav1.DeleteOptions{})
		if err != nil && !apierrors.IsNotFound(err) {
			return fmt.Errorf("deleting ResourceSlice %s: %w", name, err)
		}
	case publish:
		nodeName := node.Name
		want := &resourcev1.ResourceSlice{
			ObjectMeta: metav1.ObjectMeta{
				Name: name,
				OwnerReferences: []metav1.OwnerReference{{
					APIVersion: "v1", Kind: "Node", Name: node.Name, UID: node.UID, Controller: ptr(true),
				}},
			},
			Spec: resourcev1.ResourceSliceSpec{
				Driver:   sim.DRADriver,
				Pool:     resourcev1.ResourcePool{Name: node.Name, Generation: 1, ResourceSliceCount: 1},
				NodeName: &nodeName,
				Devices:  devices,
			},
		}
		cur, err := s.res.ResourceSlices().Get(ctx, name, metav1.GetOptions{})
		switch {
		case apierrors.IsNotFound(err):
			_, err = s.res.ResourceSlices().Create(ctx, want, metav1.CreateOptions{FieldManager: fieldManager})
		case err == nil:
			// A new generation of the pool supersedes the old one.
			want.ResourceVersion = cur.ResourceVersion
			want.Spec.Pool.Generation = cur.Spec.Pool.Generation + 1
			_, err = s.res.ResourceSlices().Update(ctx, want, metav1.UpdateOptions{FieldManager: fieldManager})
		}
		if err != nil {
			return fmt.Errorf("publishing ResourceSlice %s: %w", name, err)
		}
	}
	return nil
}

func (s *simulator) write(ctx context.Context, node *corev1.Node, p *sim.Patch) error {
	for _, l := range p.Log {
		log.Printf("node %s: %s", node.Name, l)
	}
	if len(p.Labels) > 0 || len(p.Annotations) > 0 {
		meta := map[string]any{}
		if len(p.Labels) > 0 {
			meta["labels"] = p.Labels
		}
		if len(p.Annotations) > 0 {
			meta["annotations"] = p.Annotations
		}
		body, _ := json.Marshal(map[string]any{"metadata": meta})
		if _, err := s.core.Nodes().Patch(ctx, node.Name, types.MergePatchType, body, metav1.PatchOptions{FieldManager: fieldManager}); err != nil {
			return fmt.Errorf("patching labels: %w", err)
		}
		log.Printf("node %s: patched %s", node.Name, describePatch(p))
	}
	if p.Ready != nil {
		// Strategic merge: conditions merge by type, others stay.
		body, _ := json.Marshal(map[string]any{"status": map[string]any{"conditions": []corev1.NodeCondition{*p.Ready}}})
		if _, err := s.core.Nodes().Patch(ctx, node.Name, types.StrategicMergePatchType, body, metav1.PatchOptions{FieldManager: fieldManager}, "status"); err != nil {
			return fmt.Errorf("patching conditions: %w", err)
		}
		log.Printf("node %s: condition %s=%s (%s)", node.Name, p.Ready.Type, p.Ready.Status, p.Ready.Reason)
	}
	if len(p.DropResources) > 0 {
		gone := map[string]any{}
		for _, r := range p.DropResources {
			gone[r] = nil
		}
		body, _ := json.Marshal(map[string]any{"status": map[string]any{"capacity": gone, "allocatable": gone}})
		if _, err := s.core.Nodes().Patch(ctx, node.Name, types.MergePatchType, body, metav1.PatchOptions{FieldManager: fieldManager}, "status"); err != nil {
			return fmt.Errorf("patching status: %w", err)
		}
		log.Printf("node %s: kubelet: no device plugin registered yet: dropped %v", node.Name, p.DropResources)
	}
	if p.Resources != nil {
		body, _ := json.Marshal(map[string]any{"status": map[string]any{"capacity": p.Resources, "allocatable": p.Resources}})
		if _, err := s.core.Nodes().Patch(ctx, node.Name, types.MergePatchType, body, metav1.PatchOptions{FieldManager: fieldManager}, "status"); err != nil {
			return fmt.Errorf("patching status: %w", err)
		}
		log.Printf("node %s: capacity/allocatable %v", node.Name, p.Resources)
	} else if p.Allocatable != nil {
		body, _ := json.Marshal(map[string]any{"status": map[string]any{"allocatable": p.Allocatable}})
		if _, err := s.core.Nodes().Patch(ctx, node.Name, types.MergePatchType, body, metav1.PatchOptions{FieldManager: fieldManager}, "status"); err != nil {
			return fmt.Errorf("patching status: %w", err)
		}
		log.Printf("node %s: allocatable %v", node.Name, p.Allocatable)
	}
	return nil
}

func describePatch(p *sim.Patch) string {
	var parts []string
	for k, v := range p.Labels {
		if v == nil {
			parts = append(parts, "-"+k)
		} else {
			parts = append(parts, k+"="+*v)
		}
	}
	for k, v := range p.Annotations {
		if v == nil {
			parts = append(parts, "-@"+strings.TrimPrefix(k, sim.AnnPrefix))
		} else {
			parts = append(parts, "@"+strings.TrimPrefix(k, sim.AnnPrefix))
		}
	}
	return strings.Join(parts, " ")
}

func (s *simulator) clusterPolicy() sim.ClusterPolicy {
	obj, ok, _ := s.cps.GetByKey(s.o.clusterPolicy)
	if !ok {
		return sim.ClusterPolicy{}
	}
	u := obj.(*unstructured.Unstructured).Object
	str := func(path ...string) string {
		v, _, _ := unstructured.NestedString(u, append([]string{"spec"}, path...)...)
		return v
	}
	var tolerations []sim.Toleration
	list, _, _ := unstructured.NestedSlice(u, "spec", "daemonsets", "tolerations")
	for _, item := range list {
		m, _ := item.(map[string]any)
		str := func(k string) string { v, _ := m[k].(string); return v }
		tolerations = append(tolerations, sim.Toleration{Key: str("key"), Operator: str("operator"), Value: str("value"), Effect: str("effect")})
	}
	sandbox, _, _ := unstructured.NestedBool(u, "spec", "sandboxWorkloads", "enabled")
	vgpuManager, _, _ := unstructured.NestedBool(u, "spec", "vgpuManager", "enabled")
	return sim.ClusterPolicy{
		Found:              true,
		Tolerations:        tolerations,
		DPConfigName:       str("devicePlugin", "config", "name"),
		DPDefault:          str("devicePlugin", "config", "default"),
		MigConfigName:      str("migManager", "config", "name"),
		MigStrategy:        str("mig", "strategy"),
		SandboxEnabled:     sandbox,
		DefaultWorkload:    str("sandboxWorkloads", "defaultWorkload"),
		SandboxMode:        str("sandboxWorkloads", "mode"),
		VgpuManagerEnabled: vgpuManager,
		VgpuDMConfigName:   str("vgpuDeviceManager", "config", "name"),
	}
}

// sandboxInput is what the sandbox operands of a VM node read: the vGPU
// Device Manager's config from the ConfigMap the ClusterPolicy names (the
// GPU Operator's default-vgpu-devices-config when it names none, played
// from the GPU Operator's asset file when the cluster has no such
// ConfigMap).
func (s *simulator) sandboxInput(cp sim.ClusterPolicy) sim.SandboxInput {
	in := sim.SandboxInput{VgpuManager: cp.VgpuManagerEnabled, KubeVirt: cp.SandboxMode == "" || cp.SandboxMode == "kubevirt"}
	name := cp.VgpuDMConfigName
	if name == "" {
		name = sim.DefaultVgpuConfigMap
	}
	obj, ok, _ := s.cms.GetByKey(s.o.namespace + "/" + name)
	switch {
	case ok:
		in.Config, in.Source = obj.(*corev1.ConfigMap).Data["config.yaml"], "ConfigMap "+name
	case cp.VgpuDMConfigName != "":
		in.Err = fmt.Errorf("ConfigMap %s/%s (ClusterPolicy spec.vgpuDeviceManager.config.name) not found", s.o.namespace, name)
	case s.vgpuDefault != "":
		in.Config, in.Source = s.vgpuDefault, "the GPU Operator's "+sim.DefaultVgpuConfigMap
	default:
		in.Err = fmt.Errorf("no vGPU-devices config: ConfigMap %s missing and no --default-vgpu-config", name)
	}
	return in
}

// migConfig returns the mig-parted config the MIG manager would read: the
// ConfigMap named by spec.migManager.config.name, else the GPU Operator's
// default-mig-parted-config, else the simulator's built-in default.
func (s *simulator) migConfig(cp sim.ClusterPolicy) (string, string, error) {
	name := cp.MigConfigName
	if name == "" {
		name = sim.DefaultMigConfigMap
	}
	obj, ok, _ := s.cms.GetByKey(s.o.namespace + "/" + name)
	switch {
	case ok:
		return obj.(*corev1.ConfigMap).Data["config.yaml"], "ConfigMap " + name, nil
	case cp.MigConfigName != "":
		return "", "", fmt.Errorf("ConfigMap %s/%s (ClusterPolicy spec.migManager.config.name) not found", s.o.namespace, name)
	default:
		return s.builtin, "built-in default mig-parted config", nil
	}
}

func resourceStrings(rl corev1.ResourceList) map[string]string {
	out := map[string]string{}
	for k, v := range rl {
		out[string(k)] = v.String()
	}
	return out
}

func splitList(s string) []string {
	var out []string
	for _, p := range strings.Split(s, ",") {
		if p = strings.TrimSpace(p); p != "" {
			out = append(out, p)
		}
	}
	return out
}

func ptr[T any](v T) *T { return &v }
