#!/usr/bin/env bash
# Tools the tests run, installed into target/tools (cached by version): from their Go modules,
# Helm v4 for the chart tests (tests/helm_chart.rs) and actionlint for the workflows
# (tests/workflows.rs); from crates.io, cargo-deny for the dependency checks (deny.toml,
# `make deny`).
#
#   tests/tools/build.sh          build what is missing
#   tests/tools/build.sh path     the same, then print the directory
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
OUT=${TOOLS_OUT:-$REPO/target/tools}

mkdir -p "$OUT"
exec 9>"$OUT/.lock"
flock 9

install() {
	local name=$1 pkg=$2
	if [ -x "$OUT/$name" ] && [ "$(cat "$OUT/$name.version" 2>/dev/null)" = "$pkg" ]; then
		return
	fi
	echo "building $pkg" >&2
	# Outside the repository: no go.mod of ours takes part.
	(cd "${TMPDIR:-/tmp}" && GOBIN=$OUT GOFLAGS=-mod=mod go install -trimpath -ldflags "-s -w" "$pkg")
	echo "$pkg" >"$OUT/$name.version"
}

install helm helm.sh/helm/v4/cmd/helm@v4.3.2
install actionlint github.com/rhysd/actionlint/cmd/actionlint@v1.7.12

# cargo-deny at a fixed version with its own lockfile (about 3 minutes on 2 cores, once).
deny=cargo-deny@0.20.2
if ! [ -x "$OUT/cargo-deny" ] || [ "$(cat "$OUT/cargo-deny.version" 2>/dev/null)" != "$deny" ]; then
	echo "building $deny" >&2
	cargo install --quiet --locked --root "$OUT/crates" "$deny"
	ln -sf crates/bin/cargo-deny "$OUT/cargo-deny"
	echo "$deny" >"$OUT/cargo-deny.version"
fi

case ${1:-} in
path) echo "$OUT" ;;
esac
