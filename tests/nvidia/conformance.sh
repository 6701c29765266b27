#!/usr/bin/env bash
# Conformance of `gpu-sharing-operator render` with NVIDIA's own config
# parsers: builds the operator (cargo build) and tests/nvidia, then renders
# examples/ and a generated corpus of valid and invalid policies and loads
# every result with k8s-device-plugin v0.19.1 and mig-parted v0.13.1, every
# vGPU-devices config with vgpu-device-manager v0.4.2, and every
# ResourceClaimTemplate with NVIDIA's DRA driver v0.5.0.
#
#   tests/nvidia/conformance.sh [conformance flags, e.g. -v or --run REGEXP]
#
# Prints "N passed, M failed" last; exits non-zero when a case fails.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
TARGET=${CARGO_TARGET_DIR:-$REPO/target}

(cd "$REPO" && cargo build --quiet --bin gpu-sharing-operator)
OUT=$("$HERE/build.sh" path)

# render embeds NVIDIA's default mig-parted config: it must be the copy of
# the GPU Operator module the tests build against, and name that version.
embedded=$REPO/assets/gpu-operator/default-mig-parted-config.yaml
source=$(cat "$OUT/assets/.source" 2>/dev/null || echo none)
if [[ $source == fallback || $source == none ]]; then
	echo "conformance.sh: warning: GPU Operator module unavailable; embedded default not compared" >&2
elif ! cmp -s "$embedded" "$OUT/assets/default-mig-parted-config.yaml"; then
	echo "conformance.sh: $embedded differs from $source (assets/state-mig-manager/0400_configmap.yaml): copy it and update DEFAULT_MIG_PARTED_SOURCE" >&2
	exit 1
elif ! grep -qF "${source#*@}" "$REPO/src/nvidia/mod.rs"; then
	echo "conformance.sh: DEFAULT_MIG_PARTED_SOURCE in src/nvidia/mod.rs does not name ${source#*@}" >&2
	exit 1
fi

# The same for the embedded default vGPU-devices config.
embedded=$REPO/assets/gpu-operator/default-vgpu-devices-config.yaml
if [[ $source != fallback && $source != none ]] && ! cmp -s "$embedded" "$OUT/assets/default-vgpu-devices-config.yaml"; then
	echo "conformance.sh: $embedded differs from $source (assets/state-vgpu-device-manager/0500_configmap.yaml): copy it and update DEFAULT_VGPU_SOURCE" >&2
	exit 1
elif [[ $source != fallback && $source != none ]] && ! grep -qF "${source#*@}" "$REPO/src/nvidia/vgpu.rs"; then
	echo "conformance.sh: DEFAULT_VGPU_SOURCE in src/nvidia/vgpu.rs does not name ${source#*@}" >&2
	exit 1
fi

args=(--operator-bin "$TARGET/debug/gpu-sharing-operator" --examples "$REPO/examples")
if [[ -f $OUT/assets/default-vgpu-devices-config.yaml ]]; then
	args+=(--vgpu-config "$OUT/assets/default-vgpu-devices-config.yaml")
fi
# The GPU Operator's default mig-parted config: render keeps its named
# layouts next to custom ones, and the checks compare against it.
if [[ -f $OUT/assets/default-mig-parted-config.yaml ]]; then
	args+=(--mig-parted-config "$OUT/assets/default-mig-parted-config.yaml")
fi
# Nodes that the example policies select: the Node label writes are checked too.
args+=(--nodes "$HERE/testdata/nodes.yaml")
# The fuzz corpora's rendering cases, written by `cargo test --test fuzz_corpus` (make test runs
# it first): NVIDIA's parsers load what render accepted of them.
if [[ -d $TARGET/fuzz-cases ]]; then
	args+=(--fuzz-cases "$TARGET/fuzz-cases")
fi
exec "$OUT/conformance" "${args[@]}" "$@"
