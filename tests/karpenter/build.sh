#!/usr/bin/env bash
# Builds karpenter-kwok (Karpenter v1.8.0's controllers with its kwok cloud
# provider, see cmd/karpenter-kwok) into target/karpenter/ and copies the CRDs
# it needs from the sigs.k8s.io/karpenter Go module into target/karpenter/crds/:
#   karpenter.sh_nodepools.yaml, karpenter.sh_nodeclaims.yaml (karpenter.sh/v1),
#   karpenter.sh_nodeoverlays.yaml (karpenter.sh/v1alpha1),
#   karpenter.kwok.sh_kwoknodeclasses.yaml (karpenter.kwok.sh/v1alpha1).
#
#   build.sh          build if the sources changed (prints nothing when up to date)
#   build.sh path     build, then print the output directory
#   build.sh crds     copy the CRDs only (no build), then print their directory
#   build.sh test     go test ./... (Karpenter against tests/cluster's kube-local)
#
# Environment: KARPENTER_TESTS_OUT (default <repo>/target/karpenter); KUBE_LOCAL
# (test: the kube-local binary; default KUBE_LOCAL_BIN, else what
# `tests/cluster/cluster.sh path` builds and prints); GOFLAGS, GOCACHE,
# GOMODCACHE... are passed to go as usual.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
OUT=${KARPENTER_TESTS_OUT:-$REPO/target/karpenter}
BINS=(karpenter-kwok)
BUILD_FLAGS=(-trimpath -ldflags "-s -w")
KARPENTER_MODULE=sigs.k8s.io/karpenter
# Karpenter's CRDs: <path in the module> (the same files as kwok/charts/crds).
CRDS=(
	pkg/apis/crds/karpenter.sh_nodepools.yaml
	pkg/apis/crds/karpenter.sh_nodeclaims.yaml
	pkg/apis/crds/karpenter.sh_nodeoverlays.yaml
	kwok/apis/crds/karpenter.kwok.sh_kwoknodeclasses.yaml
)

log() { echo "build.sh: $*" >&2; }

source_hash() {
	(
		cd "$HERE"
		go version
		echo "${BUILD_FLAGS[@]}"
		go env GOFLAGS CGO_ENABLED GOOS GOARCH
		find ./cmd go.mod go.sum -type f \( -name '*.go' -o -name go.mod -o -name go.sum \) -print0 |
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
	log "building ${BINS[*]} into $OUT (a cold build takes several minutes)"
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

# target/karpenter/crds/*.yaml, from the version of sigs.k8s.io/karpenter that
# go.mod requires (so the CRDs always match the controllers).
crds() {
	local version dir f
	version=$(cd "$HERE" && go list -m -f '{{.Version}}' "$KARPENTER_MODULE")
	if [[ -f $OUT/crds/.source && $(cat "$OUT/crds/.source") == "$KARPENTER_MODULE@$version" ]]; then
		return 0
	fi
	dir=$(cd "$HERE" && go mod download -json "$KARPENTER_MODULE" | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')
	[[ -n $dir && -d $dir ]] || { log "cannot find $KARPENTER_MODULE@$version in the module cache"; exit 1; }
	rm -rf "$OUT/crds"
	mkdir -p "$OUT/crds"
	for f in "${CRDS[@]}"; do
		[[ -f $dir/$f ]] || { log "$KARPENTER_MODULE@$version has no $f"; exit 1; }
		# The module cache is read-only: the copies must be writable to be replaced.
		cp "$dir/$f" "$OUT/crds/" && chmod u+w "$OUT/crds/${f##*/}"
	done
	echo "$KARPENTER_MODULE@$version" >"$OUT/crds/.source"
}

main() {
	command -v go >/dev/null || { log "go is not installed"; exit 1; }
	mkdir -p "$OUT"
	exec 9>"$OUT/.lock"
	flock 9
	case ${1:-build} in
	build) build; crds ;;
	path) build; crds; echo "$OUT" ;;
	crds) crds; echo "$OUT/crds" ;;
	test)
		build
		crds
		# e2e/kwok_test.go starts kube-local from KUBE_LOCAL (it skips without it)
		# and karpenter-kwok from KARPENTER_KWOK_DIR.
		if [[ -z ${KUBE_LOCAL:-} ]]; then
			KUBE_LOCAL=${KUBE_LOCAL_BIN:-$(bash "$REPO/tests/cluster/cluster.sh" path)}
		fi
		[[ -x $KUBE_LOCAL ]] || { log "KUBE_LOCAL=$KUBE_LOCAL is not an executable"; exit 1; }
		export KUBE_LOCAL KARPENTER_KWOK_DIR=$OUT
		cd "$HERE" && go test "${BUILD_FLAGS[@]}" ./...
		;;
	*) log "usage: build.sh [build|path|test]"; exit 2 ;;
	esac
}

main "$@"
