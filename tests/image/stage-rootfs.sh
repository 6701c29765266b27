#!/usr/bin/env bash
# Stages the image's root filesystem into DIR: the operator built statically (glibc's static
# libc, `-C target-feature=+crt-static` on the gnu target: no musl target is needed), an
# /etc/passwd and /etc/group naming uid/gid 65532. Used by the Containerfile's build stage and by
# tests/image/build.sh, so both images hold the same files.
#
#   tests/image/stage-rootfs.sh DIR
#
# Environment: TARGETARCH (amd64, arm64; default: this machine), CARGO_TARGET_DIR (default
# <repo>/target/image-build, so the normal release build is not rebuilt with other flags),
# AUDITABLE=1 (the Containerfile's build stage: build with `cargo auditable`, which must be
# installed, and require the dependency list in the binary's .dep-v0 section; tests/image/build.sh
# leaves it unset and builds with plain cargo).
set -euo pipefail

OUT=${1:?usage: stage-rootfs.sh DIR}
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
case ${TARGETARCH:-$(uname -m)} in
amd64 | x86_64) TRIPLE=x86_64-unknown-linux-gnu ;;
arm64 | aarch64) TRIPLE=aarch64-unknown-linux-gnu ;;
*) echo "stage-rootfs.sh: unsupported architecture ${TARGETARCH:-$(uname -m)}" >&2; exit 2 ;;
esac
TARGET_DIR=${CARGO_TARGET_DIR:-$REPO/target/image-build}

BUILD=(cargo build)
if [ "${AUDITABLE:-}" = 1 ]; then
	BUILD=(cargo auditable build)
fi

# --target keeps build scripts and proc macros dynamic; only the operator is linked statically.
RUSTFLAGS="-C target-feature=+crt-static -C strip=symbols" \
	"${BUILD[@]}" --manifest-path "$REPO/Cargo.toml" --release --locked \
	--bin gpu-sharing-operator --target "$TRIPLE" --target-dir "$TARGET_DIR"
BIN=$TARGET_DIR/$TRIPLE/release/gpu-sharing-operator
if readelf -d "$BIN" 2>/dev/null | grep -q NEEDED; then
	echo "stage-rootfs.sh: $BIN is dynamically linked" >&2
	exit 1
fi
# The dependency list must be in the shipped (stripped) binary, not only in an unstripped one.
if [ "${AUDITABLE:-}" = 1 ] && ! readelf -S "$BIN" | grep -qF .dep-v0; then
	echo "stage-rootfs.sh: $BIN has no .dep-v0 section (cargo auditable)" >&2
	exit 1
fi

rm -rf "$OUT"
mkdir -p "$OUT/etc"
install -m 0755 "$BIN" "$OUT/gpu-sharing-operator"
printf 'gpu-sharing-operator:x:65532:65532:gpu-sharing-operator:/nonexistent:/sbin/nologin\n' >"$OUT/etc/passwd"
printf 'gpu-sharing-operator:x:65532:\n' >"$OUT/etc/group"
echo "stage-rootfs.sh: $OUT ($(du -sh "$OUT" | cut -f1), $TRIPLE, static${AUDITABLE:+, auditable})" >&2
