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
#
# After a complete run (no flags but -v, -keep or -timeout; NVIDIA's default
# mig-parted config and the fuzz cases present) it compares the number of
# cases run (passed + failed) and skipped with the figures `conformance-cases`
# and `conformance-skipped` of docs/figures.md and prints the row to paste
# when they differ: a warning locally, a failure under CI=true.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
TARGET=${CARGO_TARGET_DIR:-$REPO/target}

(cd "$REPO" && cargo build --quiet --bin gpu-sharing-operator)
OUT=$("$HERE/build.sh" path)

# A check that cannot run weakens the suite: a warning locally, a failure in
# CI (CI=true), where everything it needs must be there.
weakened() { # weakened MESSAGE
	case ${CI:-} in
	true | TRUE | True | 1)
		echo "conformance.sh: $1 (CI=true: failing)" >&2
		exit 1
		;;
	*) echo "conformance.sh: warning: $1 (fails under CI=true)" >&2 ;;
	esac
}

# render embeds NVIDIA's default mig-parted config: it must be the copy of
# the GPU Operator module the tests build against, and name that version.
embedded=$REPO/assets/gpu-operator/default-mig-parted-config.yaml
source=$(cat "$OUT/assets/.source" 2>/dev/null || echo none)
if [[ $source == fallback || $source == none ]]; then
	weakened "GPU Operator module unavailable: the embedded default is not compared and named layouts are checked against a fixture"
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
else
	weakened "no default vGPU-devices config from the GPU Operator module: vGPU checks become notes"
fi
# The GPU Operator's default mig-parted config: render keeps its named
# layouts next to custom ones, and the checks compare against it.
if [[ -f $OUT/assets/default-mig-parted-config.yaml ]]; then
	args+=(--mig-parted-config "$OUT/assets/default-mig-parted-config.yaml")
else
	weakened "no default mig-parted config from the GPU Operator module: named-layout checks are skipped"
fi
# Nodes that the example policies select: the Node label writes are checked too.
args+=(--nodes "$HERE/testdata/nodes.yaml")
# The fuzz corpora's rendering cases, written by `cargo test --test fuzz_corpus` (make test runs
# it first): NVIDIA's parsers load what render accepted of them.
if [[ -d $TARGET/fuzz-cases ]]; then
	args+=(--fuzz-cases "$TARGET/fuzz-cases")
else
	weakened "no fuzz cases in $TARGET/fuzz-cases (cargo test --test fuzz_corpus writes them)"
fi

# The figures of docs/figures.md this run recounts ("Counted by the conformance suite" there).
FIGURES=$REPO/docs/figures.md
figure_row() { # figure_row KEY: the table row of docs/figures.md whose first cell is `KEY`
	awk -F'|' -v key="\`$1\`" '{ k = $2; gsub(/^ +| +$/, "", k) } k == key { print; exit }' "$FIGURES" 2>/dev/null || true
}
figure_value() { # figure_value ROW: its value cell, without spaces or thousands separators
	awk -F'|' '{ v = $3; gsub(/[ ,]/, "", v); print v }' <<<"$1"
}
complete=yes
for arg in "$@"; do
	case $arg in
	-v | --v | -v=true | --v=true | -keep | --keep | -keep=true | --keep=true | -timeout=* | --timeout=*) ;;
	*) complete="no: flags $*" ;;
	esac
done
if [[ ! -d $TARGET/fuzz-cases ]]; then
	complete="no: no fuzz cases in $TARGET/fuzz-cases (cargo test --test fuzz_corpus writes them)"
elif [[ ! -f $OUT/assets/default-mig-parted-config.yaml ]]; then
	complete="no: without NVIDIA's default mig-parted config some invalid cases are skipped"
fi
# check_figures LOG: compare the run's "N passed, M failed, K skipped" with docs/figures.md.
check_figures() {
	local summary passed failed skipped key value row want stale=0
	summary=$(grep -E '^[0-9]+ passed, [0-9]+ failed(, [0-9]+ skipped)?$' "$1" | tail -n 1 || true)
	if [[ -z $summary ]]; then
		echo "conformance.sh: warning: no \"N passed, M failed\" line: figures not compared" >&2
		return 0
	fi
	read -r passed _ failed _ skipped _ <<<"${summary//,/}"
	for key in conformance-cases conformance-skipped; do
		case $key in
		conformance-cases) value=$((passed + failed)) ;;
		conformance-skipped) value=${skipped:-0} ;;
		esac
		row=$(figure_row "$key")
		want=$(figure_value "$row")
		[[ $want == "$value" ]] && continue
		stale=1
		if [[ -n $row ]]; then
			echo "conformance.sh: docs/figures.md says $key is $want, this run counted $value; replace its row with:" >&2
			awk -F'|' -v OFS='|' -v value="$value" '{ $3 = " " value " "; print }' <<<"$row" >&2
		else
			echo "conformance.sh: docs/figures.md has no row for $key (this run counted $value); add:" >&2
			echo "| \`$key\` | $value | ... | \`tests/nvidia/conformance.sh\` |" >&2
		fi
	done
	if ((stale)); then
		case ${CI:-} in
		true | TRUE | True | 1)
			echo "conformance.sh: docs/figures.md is stale (CI=true: failing)" >&2
			return 1
			;;
		*) echo "conformance.sh: warning: docs/figures.md is stale (fails under CI=true)" >&2 ;;
		esac
	fi
	return 0
}

log=$(mktemp -t gpu-sharing-conformance-XXXXXX)
trap 'rm -f "$log"' EXIT
set +e
"$OUT/conformance" "${args[@]}" "$@" | tee "$log"
status=("${PIPESTATUS[@]}")
set -e
if ((status[0] != 0)); then
	exit "${status[0]}"
fi
if [[ $complete == yes ]]; then
	check_figures "$log"
else
	echo "conformance.sh: figures of docs/figures.md not compared (partial run, $complete)" >&2
fi
