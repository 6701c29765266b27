#!/usr/bin/env bash
# Builds the operator's container image without a container engine (the test machines have no
# daemon): stages the root filesystem with the same script as the Containerfile's build stage,
# then tests/image/cmd/oci-image (go-containerregistry) reads the Containerfile's final stage and
# writes an OCI image layout.
#
#   tests/image/build.sh          build; print the summary (JSON)
#   tests/image/build.sh path     build; print the output directory
#
# Output in target/image/ (IMAGE_OUT): gpu-sharing-operator/ (OCI layout), gpu-sharing-operator.tar,
# rootfs/, summary.json.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
OUT=${IMAGE_OUT:-$REPO/target/image}
VERSION=${VERSION:-$(sed -n 's/^version = "\(.*\)"/\1/p' "$REPO/Cargo.toml" | head -n1)}

mkdir -p "$OUT"
exec 9>"$OUT/.lock"
flock 9
(cd "$HERE" && go build -trimpath -ldflags "-s -w" -o "$OUT/oci-image" ./cmd/oci-image)
bash "$HERE/stage-rootfs.sh" "$OUT/rootfs"
"$OUT/oci-image" -containerfile "$REPO/Containerfile" \
	-stage "build:/out/rootfs=$OUT/rootfs" \
	-build-arg "VERSION=$VERSION" \
	-out "$OUT/gpu-sharing-operator" >"$OUT/summary.json"
case ${1:-} in
path) echo "$OUT" ;;
*) cat "$OUT/summary.json" ;;
esac
