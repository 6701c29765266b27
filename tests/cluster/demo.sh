#!/usr/bin/env bash
# Demo of gpu-sharing-operator on a local control plane with simulated GPU
# nodes (no GPU, no container runtime needed).
#
#   tests/cluster/demo.sh [--gpu-operator-namespace NS]
#
# Builds kube-local (cached in target/kube-local/), starts it, and stops
# everything it started on exit or Ctrl-C.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
NAMESPACE=gpu-operator
while (($#)); do
	case $1 in
	--gpu-operator-namespace) NAMESPACE=$2; shift 2 ;;
	--gpu-operator-namespace=*) NAMESPACE=${1#*=}; shift ;;
	*) echo "usage: $0 [--gpu-operator-namespace NS]" >&2; exit 2 ;;
	esac
done

say() { printf '\n\033[1m== %s\033[0m\n' "$*"; }

WORK=$(mktemp -d -t gpu-sharing-demo-XXXXXX)
PIDS=()
cleanup() {
	trap - EXIT INT TERM
	local pid
	for pid in "${PIDS[@]}"; do
		kill -TERM "$pid" 2>/dev/null || true
	done
	for pid in "${PIDS[@]}"; do
		wait "$pid" 2>/dev/null || true
	done
	rm -rf "$WORK"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

say "Building the local control plane (first build takes several minutes)"
BIN=$("$HERE/cluster.sh" path)

say "Starting kube-apiserver + etcd with simulated GPU nodes"
# kube-local watches its stdin: keep a pipe open (fd 3) for as long as this
# script lives, so it stops even if the script is killed with SIGKILL.
mkfifo "$WORK/stdin"
"$BIN" --dir "$WORK" --gpu-operator-namespace "$NAMESPACE" --pdeathsig \
	<"$WORK/stdin" >"$WORK/stdout" 2>"$WORK/kube-local.log" &
PIDS+=($!)
exec 3>"$WORK/stdin"
for _ in $(seq 1 600); do
	grep -q '^READY ' "$WORK/stdout" 2>/dev/null && break
	kill -0 "${PIDS[0]}" 2>/dev/null || { tail -n 30 "$WORK/kube-local.log" >&2; exit 1; }
	sleep 0.2
done
grep -q '^READY ' "$WORK/stdout" || { echo "kube-local not ready" >&2; exit 1; }
export KUBECONFIG=$WORK/kubeconfig
echo "export KUBECONFIG=$KUBECONFIG   # in another shell, while the demo runs"

say "Simulated GPU nodes"
kubectl get nodes -L nvidia.com/gpu.product,nvidia.com/gpu.count,nvidia.com/gpu.replicas,nvidia.com/gpu.sharing-strategy,nvidia.com/mig.capable
say "NVIDIA GPU Operator ClusterPolicy"
kubectl get clusterpolicies.nvidia.com -o custom-columns=NAME:.metadata.name,STATE:.status.state,NAMESPACE:.status.namespace,MIG:.spec.mig.strategy

say "Building the operator and the NVIDIA node simulator"
cargo build --quiet --manifest-path "$REPO/Cargo.toml"
OPERATOR=$REPO/target/debug/gpu-sharing-operator
SIMDIR=$(bash "$REPO/tests/nvidia/build.sh" path)

say "Installing the GpuSharingPolicy CRD"
kubectl apply -f "$REPO/crds/gpusharingpolicies.gpusharing.io.yaml"
kubectl wait --for=condition=Established crd/gpusharingpolicies.gpusharing.io --timeout=60s

say "Starting the node simulator (stands in for the device plugin, GPU Feature Discovery and MIG manager)"
"$SIMDIR/gpu-node-simulator" --kubeconfig "$KUBECONFIG" --namespace "$NAMESPACE" --exit-on-stdin-eof \
	<"$WORK/stdin" >"$WORK/simulator.log" 2>&1 &
PIDS+=($!)

say "Starting gpu-sharing-operator (log: $WORK/operator.log; metrics: curl localhost:8080/metrics)"
# Plain HTTP metrics for local use (the default is HTTPS for callers allowed to get /metrics).
"$OPERATOR" run --metrics-insecure --metrics-addr=127.0.0.1:8080 --health-addr=127.0.0.1:8081 \
	<"$WORK/stdin" >"$WORK/operator.log" 2>&1 &
PIDS+=($!)

say "Admins pick profiles with node labels, then apply examples/"
kubectl label node l4-node-1 gpusharing.io/profile=l4-heavy --overwrite
kubectl label node a100-node-0 gpusharing.io/profile=mig-shared --overwrite
# examples/passthrough.yaml: whole GPUs of this node go to KubeVirt VMs (sandbox workloads).
kubectl label node a100-node-1 gpusharing.io/profile=vm-passthrough --overwrite
# examples/dra-mps.yaml renders its ResourceClaimTemplate into this namespace (the policy is
# not Ready until it exists).
kubectl create namespace gpu-test6 --dry-run=client -o yaml | kubectl apply -f -
kubectl apply -f "$REPO/examples/"

say "Waiting for the policies to converge"
for _ in $(seq 1 60); do
	notready=$(kubectl get gsp -o jsonpath='{range .items[*]}{.status.conditions[?(@.type=="Ready")].status}{"\n"}{end}' | grep -cv True || true)
	[[ $notready == 0 ]] && break
	sleep 1
done

say "kubectl get gsp -o wide"
kubectl get gsp -o wide
say "Node labels"
kubectl get nodes -L gpusharing.io/policy,nvidia.com/device-plugin.config,nvidia.com/mig.config,nvidia.com/mig.config.state,nvidia.com/gpu.replicas,nvidia.com/gpu.sharing-strategy,nvidia.com/gpu.workload.config
say "Allocatable nvidia.com/gpu (simulated device plugin: count x replicas)"
kubectl get nodes -o custom-columns='NAME:.metadata.name,PRODUCT:.metadata.labels.nvidia\.com/gpu\.product,GPU:.status.allocatable.nvidia\.com/gpu'
say "Capacity of h200-mps"
kubectl get gsp h200-mps -o jsonpath='{.status.capacity}{"\n"}'
say "ClusterPolicy, as patched"
kubectl get clusterpolicies.nvidia.com cluster-policy -o jsonpath='{.spec.devicePlugin.config}{"  mig: "}{.spec.mig}{"  sandboxWorkloads: "}{.spec.sandboxWorkloads}{"\n"}'

if [[ ${DEMO_EXIT:-} == 1 ]]; then
	say "DEMO_EXIT=1: stopping"
	exit 0
fi
say "Cluster running; press Ctrl-C to stop"
while kill -0 "${PIDS[0]}" 2>/dev/null; do sleep 1; done
