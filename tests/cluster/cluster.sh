#!/usr/bin/env bash
# Local Kubernetes control plane (etcd + kube-apiserver in one process, see
# main.go) for the tests and the demo.
#
#   cluster.sh build              build target/kube-local/kube-local if its sources
#                                 changed, and fetch the GPU Operator assets
#   cluster.sh path               build, then print the binary path
#   cluster.sh start [--dir D] [kube-local flags]
#                                 start in the background, wait for READY and
#                                 print an `export KUBECONFIG=...` line
#   cluster.sh stop               stop the cluster started by `start`
#   cluster.sh status             say whether it runs (exit 1 if not)
#   cluster.sh run [kube-local flags]
#                                 run in the foreground (Ctrl-C stops it)
#   cluster.sh test [go test flags]
#                                 build, then run this module's Go tests
#                                 against the binary (KUBE_LOCAL)
#
# Environment:
#   KUBE_LOCAL_OUT      output directory (default: <repo>/target/kube-local)
#   KUBE_LOCAL_ASSETS   "module" (default: the github.com/NVIDIA/gpu-operator Go
#                       module, falling back to ../shared/fixtures when it cannot
#                       be fetched) or "shared" (only ../shared/fixtures)
#   GOFLAGS, GOCACHE, GOMODCACHE, ... are passed to go as usual.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
OUT=${KUBE_LOCAL_OUT:-$REPO/target/kube-local}
BIN=$OUT/kube-local
RUN_DIR=$OUT/cluster          # state of `start`: kubeconfig, logs, pid

K8S_VERSION=v1.36.3
GPU_OPERATOR_MODULE=github.com/NVIDIA/gpu-operator
GPU_OPERATOR_VERSION=v0.0.0-20250917190837-d73a0086a6ba
SHARED_FIXTURES=$REPO/../shared/fixtures

log() { echo "cluster.sh: $*" >&2; }
die() { log "$*"; exit 1; }

ldflags() {
	local v=${K8S_VERSION#v}
	local major=${v%%.*} rest=${v#*.}
	local minor=${rest%%.*}
	local pkg=k8s.io/component-base/version
	echo "-s -w -X $pkg.gitVersion=$K8S_VERSION -X $pkg.gitMajor=$major -X $pkg.gitMinor=$minor -X $pkg.gitTreeState=clean -X $pkg.buildDate=1970-01-01T00:00:00Z"
}

# Hash of everything the binary depends on (tests are not part of it).
source_hash() {
	(
		cd "$HERE"
		go version
		ldflags
		go env GOFLAGS CGO_ENABLED GOOS GOARCH
		find . -maxdepth 1 -type f \( -name '*.go' -o -name go.mod -o -name go.sum \) ! -name '*_test.go' -print0 |
			LC_ALL=C sort -z | xargs -0 sha256sum
	) | sha256sum | cut -d' ' -f1
}

build_binary() {
	local want have=""
	want=$(source_hash)
	[[ -f $OUT/.stamp ]] && have=$(cat "$OUT/.stamp")
	if [[ -x $BIN && $want == "$have" ]]; then
		return 0
	fi
	log "building kube-local (Kubernetes $K8S_VERSION; a cold build takes several minutes)"
	local t0=$SECONDS
	(cd "$HERE" && go build -trimpath -ldflags "$(ldflags)" -o "$BIN.tmp" .)
	mv -f "$BIN.tmp" "$BIN"
	echo "$want" >"$OUT/.stamp"
	log "built $BIN in $((SECONDS - t0))s"
}

# Copy the ClusterPolicy CRD and the default mig-parted ConfigMap into
# $OUT/assets, from the GPU Operator Go module or else from ../shared/fixtures.
fetch_assets() {
	local mode=${KUBE_LOCAL_ASSETS:-module}
	local want="$mode $GPU_OPERATOR_VERSION"
	if [[ -f $OUT/assets/.source && $(head -n1 "$OUT/assets/.source") == "$want" ]]; then
		return 0
	fi
	local tmp=$OUT/assets.tmp dir="" crd="" mig=""
	rm -rf "$tmp" && mkdir -p "$tmp"
	if [[ $mode == module ]]; then
		# Outside any module: does not touch tests/cluster/go.mod or go.sum.
		if dir=$(cd / && GOFLAGS=-mod=mod go mod download -json "$GPU_OPERATOR_MODULE@$GPU_OPERATOR_VERSION" 2>/dev/null |
			sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p') && [[ -n $dir && -d $dir ]]; then
			for c in deployments/gpu-operator/crds/nvidia.com_clusterpolicies.yaml config/crd/bases/nvidia.com_clusterpolicies.yaml; do
				[[ -f $dir/$c ]] && { crd=$dir/$c; break; }
			done
			[[ -f $dir/assets/state-mig-manager/0400_configmap.yaml ]] && mig=$dir/assets/state-mig-manager/0400_configmap.yaml
		else
			log "cannot download $GPU_OPERATOR_MODULE@$GPU_OPERATOR_VERSION: using $SHARED_FIXTURES"
		fi
	fi
	local source="$GPU_OPERATOR_MODULE@$GPU_OPERATOR_VERSION"
	if [[ -z $crd ]]; then
		crd=$SHARED_FIXTURES/nvidia.com_clusterpolicies.yaml
		mig=$SHARED_FIXTURES/default-mig-parted-config.yaml
		source=$SHARED_FIXTURES
		[[ -f $crd ]] || die "no ClusterPolicy CRD: neither the Go module nor $crd is available"
		# Retry the module next time when it was wanted but not reachable.
		[[ $mode == module ]] && want="fallback $GPU_OPERATOR_VERSION"
	fi
	cp "$crd" "$tmp/nvidia.com_clusterpolicies.yaml"
	[[ -n $mig && -f $mig ]] && cp "$mig" "$tmp/default-mig-parted-config.yaml"
	printf '%s\nfrom %s\n' "$want" "$source" >"$tmp/.source"
	chmod -R u+w "$tmp"
	rm -rf "$OUT/assets" && mv "$tmp" "$OUT/assets"
	log "GPU Operator assets from $source"
}

cmd_build() {
	mkdir -p "$OUT"
	command -v go >/dev/null || die "go is not installed"
	# Several test processes may build at once: serialise.
	exec 9>"$OUT/.lock"
	flock 9
	build_binary
	fetch_assets
	exec 9>&-
}

running_pid() {
	local pid
	[[ -f $RUN_DIR/pid ]] || return 1
	pid=$(cat "$RUN_DIR/pid")
	[[ -n $pid ]] && kill -0 "$pid" 2>/dev/null || return 1
	# Make sure the pid was not reused by something else.
	[[ $(readlink -f "/proc/$pid/exe" 2>/dev/null) == "$(readlink -f "$BIN")" ]] || return 1
	echo "$pid"
}

cmd_start() {
	local dir=$RUN_DIR/data
	local args=()
	while (($#)); do
		case $1 in
		--dir) dir=$2; shift 2 ;;
		--dir=*) dir=${1#--dir=}; shift ;;
		*) args+=("$1"); shift ;;
		esac
	done
	cmd_build
	mkdir -p "$RUN_DIR" "$dir"
	dir=$(cd "$dir" && pwd)
	local pid
	if pid=$(running_pid); then
		log "already running (pid $pid)"
		echo "export KUBECONFIG=$(cat "$RUN_DIR/kubeconfig-path")"
		return 0
	fi
	rm -f "$RUN_DIR/stdout" "$dir/kubeconfig"
	# Detached: no stdin to watch, the parent (this script) exits at once.
	setsid "$BIN" --dir "$dir" --watch-stdin=false --watch-parent=false ${args[@]+"${args[@]}"} \
		</dev/null >"$RUN_DIR/stdout" 2>"$RUN_DIR/kube-local.log" &
	pid=$!
	echo "$pid" >"$RUN_DIR/pid"
	local deadline=$((SECONDS + 120))
	until grep -q '^READY ' "$RUN_DIR/stdout" 2>/dev/null; do
		if ! kill -0 "$pid" 2>/dev/null; then
			tail -n 40 "$RUN_DIR/kube-local.log" >&2 || true
			rm -f "$RUN_DIR/pid"
			die "kube-local exited before it was ready (log: $RUN_DIR/kube-local.log)"
		fi
		if ((SECONDS > deadline)); then
			tail -n 40 "$RUN_DIR/kube-local.log" >&2 || true
			cmd_stop
			die "kube-local not ready within 120s (log: $RUN_DIR/kube-local.log)"
		fi
		sleep 0.2
	done
	local kc
	kc=$(sed -n 's/^READY //p' "$RUN_DIR/stdout" | head -n1)
	echo "$kc" >"$RUN_DIR/kubeconfig-path"
	log "running (pid $pid), log in $RUN_DIR/kube-local.log; stop with: $0 stop"
	echo "export KUBECONFIG=$kc"
}

cmd_stop() {
	local pid
	if ! pid=$(running_pid); then
		rm -f "$RUN_DIR/pid"
		log "not running"
		return 0
	fi
	kill -TERM "$pid" 2>/dev/null || true
	local i
	for ((i = 0; i < 300; i++)); do
		kill -0 "$pid" 2>/dev/null || break
		sleep 0.1
	done
	if kill -0 "$pid" 2>/dev/null; then
		log "pid $pid did not stop within 30s: killing it"
		kill -KILL "$pid" 2>/dev/null || true
	fi
	rm -f "$RUN_DIR/pid"
	log "stopped (pid $pid)"
}

cmd_status() {
	local pid
	if pid=$(running_pid); then
		echo "running (pid $pid): export KUBECONFIG=$(cat "$RUN_DIR/kubeconfig-path")"
	else
		echo "not running"
		return 1
	fi
}

cmd_run() {
	cmd_build
	# Foreground: Ctrl-C (SIGINT) stops it; stdin may be a terminal or absent,
	# so only the parent is watched.
	exec "$BIN" --watch-stdin=false "$@"
}

cmd_test() {
	cmd_build
	# Same -trimpath as the binary: the test build reuses its compiled packages.
	(cd "$HERE" && KUBE_LOCAL=$BIN go test -trimpath -ldflags "$(ldflags)" "$@" .)
}

case ${1:-} in
build) shift; cmd_build "$@" ;;
path) shift; cmd_build; echo "$BIN" ;;
start) shift; cmd_start "$@" ;;
stop) shift; cmd_stop ;;
status) shift; cmd_status ;;
run) shift; cmd_run "$@" ;;
test) shift; cmd_test "$@" ;;
*)
	sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//' >&2
	exit 2
	;;
esac
