#!/usr/bin/env bash
# Builds the Go test tools of tests/nvidia into target/nvidia/:
#   conformance          render output vs NVIDIA's own config parsers
#   gpu-node-simulator   test-only simulator of NVIDIA's node components
# and puts the GPU Operator's default mig-parted config in
# target/nvidia/assets/ (from the github.com/NVIDIA/gpu-operator Go module,
# else ../shared/fixtures).
#
#   build.sh          build if the sources changed (prints nothing when up to date)
#   build.sh test     go test ./... (the decision logic and the parsers, and the
#                     simulator end to end against tests/cluster's kube-local)
#   build.sh path     build, then print the output directory
#
# Environment: NVIDIA_TESTS_OUT (default <repo>/target/nvidia); KUBE_LOCAL
# (test: the kube-local binary; default KUBE_LOCAL_BIN, else what
# `tests/cluster/cluster.sh path` builds and prints); GOFLAGS, GOCACHE,
# GOMODCACHE... are passed to go as usual.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
OUT=${NVIDIA_TESTS_OUT:-$REPO/target/nvidia}
BINS=(conformance gpu-node-simulator)
# Same flags as tests/cluster/cluster.sh, so both share compiled
# k8s.io packages in the Go build cache.
BUILD_FLAGS=(-trimpath -ldflags "-s -w")
GPU_OPERATOR_MODULE=github.com/NVIDIA/gpu-operator
GPU_OPERATOR_VERSION=v0.0.0-20250917190837-d73a0086a6ba
SHARED_FIXTURES=$REPO/../shared/fixtures

log() { echo "build.sh: $*" >&2; }

source_hash() {
	(
		cd "$HERE"
		go version
		echo "${BUILD_FLAGS[@]}"
		go env GOFLAGS CGO_ENABLED GOOS GOARCH
		find . -type f \( -name '*.go' -o -name go.mod -o -name go.sum \) -print0 |
			LC_ALL=C sort -z | xargs -0 sha256sum
	) | sha256sum | cut -d' ' -f1
}

build() {
	local want have="" missing=0 b
	want=$(source_hash)
	[[ -f $OUT/.stamp ]] && have=$(cat "$OUT/.stamp")
	for b in "${BINS[@]}"; do [[ -x $OUT/$b ]] || missing=1; done
	if ((missing == 0)) && [[ $want == "$have" ]]; then
		return 0
	fi
	log "building ${BINS[*]} into $OUT"
	local t0=$SECONDS
	(
		cd "$HERE"
		for b in "${BINS[@]}"; do
			go build "${BUILD_FLAGS[@]}" -o "$OUT/$b.tmp" "./cmd/$b"
			mv -f "$OUT/$b.tmp" "$OUT/$b"
		done
	)
	echo "$want" >"$OUT/.stamp"
	log "built in $((SECONDS - t0))s"
}

# target/nvidia/assets/default-mig-parted-config.yaml
assets() {
	local dst=$OUT/assets/default-mig-parted-config.yaml
	local want="$GPU_OPERATOR_MODULE@$GPU_OPERATOR_VERSION" src="" dir=""
	if [[ -f $dst && -f $OUT/assets/default-vgpu-devices-config.yaml && -f $OUT/assets/.source && $(cat "$OUT/assets/.source") == "$want" ]]; then
		return 0
	fi
	mkdir -p "$OUT/assets"
	# Outside any module, so tests/nvidia/go.mod is not touched.
	if dir=$(cd / && GOFLAGS=-mod=mod go mod download -json "$want" 2>/dev/null |
		sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p') && [[ -f $dir/assets/state-mig-manager/0400_configmap.yaml ]]; then
		src=$dir/assets/state-mig-manager/0400_configmap.yaml
	elif [[ -f $SHARED_FIXTURES/default-mig-parted-config.yaml ]]; then
		src=$SHARED_FIXTURES/default-mig-parted-config.yaml
		want="fallback"
		log "cannot download $GPU_OPERATOR_MODULE: using $src"
	else
		log "warning: no default mig-parted config available"
		return 0
	fi
	cp "$src" "$dst.tmp" && chmod u+w "$dst.tmp" && mv -f "$dst.tmp" "$dst"
	# NVIDIA's default vGPU-devices config, beside it (the simulator plays the GPU Operator's
	# default-vgpu-devices-config with it; conformance checks the embedded copy against it).
	local vgpu=${src%/state-mig-manager/0400_configmap.yaml}/state-vgpu-device-manager/0500_configmap.yaml
	if [[ -f $vgpu ]]; then
		cp "$vgpu" "$OUT/assets/default-vgpu-devices-config.yaml.tmp" && chmod u+w "$OUT/assets/default-vgpu-devices-config.yaml.tmp" &&
			mv -f "$OUT/assets/default-vgpu-devices-config.yaml.tmp" "$OUT/assets/default-vgpu-devices-config.yaml"
	fi
	echo "$want" >"$OUT/assets/.source"
}

main() {
	command -v go >/dev/null || { log "go is not installed"; exit 1; }
	mkdir -p "$OUT"
	exec 9>"$OUT/.lock"
	flock 9
	case ${1:-build} in
	build) build; assets ;;
	path) build; assets; echo "$OUT" ;;
	test)
		# cmd/gpu-node-simulator/e2e_test.go starts the local control plane from
		# KUBE_LOCAL (it would skip without it). cluster.sh path only checks the
		# source hash when make test has built it already.
		if [[ -z ${KUBE_LOCAL:-} ]]; then
			KUBE_LOCAL=${KUBE_LOCAL_BIN:-$(bash "$REPO/tests/cluster/cluster.sh" path)}
		fi
		[[ -x $KUBE_LOCAL ]] || { log "KUBE_LOCAL=$KUBE_LOCAL is not an executable"; exit 1; }
		export KUBE_LOCAL
		cd "$HERE" && go test "${BUILD_FLAGS[@]}" ./...
		;;
	*) log "usage: build.sh [build|path|test]"; exit 2 ;;
	esac
}

main "$@"
