#!/usr/bin/env bash
# Builds s3s-fs (an S3-compatible server that keeps objects in a folder, from crates.io) once into a cache
# outside the clone, keyed by its version, for the tests that run the store against a real S3 server
# (crates/gpu-checkpoint/tests/common/s3.rs starts it on 127.0.0.1 with a private data folder).
#
# Usage: scripts/install-s3s.sh
#   GPU_CHECKPOINT_CACHE   where built tools are kept (default: /var/cache/gpu-checkpoint, or
#                          ~/.cache/gpu-checkpoint when that cannot be written)
# Prints the binary's path on its last line. Idempotent: a second run only checks that the binary is there.
#
# Why 0.14.1: the newest release that builds with the project's rustc (later ones need a newer one); the
# build takes about 3 minutes on 2 cores, once per machine.
set -euo pipefail

VERSION=0.14.1
log() { echo "install-s3s: $*" >&2; }

CACHE=${GPU_CHECKPOINT_CACHE:-/var/cache/gpu-checkpoint}
if ! mkdir -p "$CACHE" 2>/dev/null || [ ! -w "$CACHE" ]; then
    CACHE=${XDG_CACHE_HOME:-$HOME/.cache}/gpu-checkpoint
    mkdir -p "$CACHE"
fi
PREFIX=$CACHE/s3s-fs-$VERSION
BIN=$PREFIX/bin/s3s-fs

if [ -x "$BIN" ] && "$BIN" --help >/dev/null 2>&1; then
    log "s3s-fs $VERSION already built in $PREFIX"
    echo "$BIN"
    exit 0
fi

command -v cargo >/dev/null || { log "error: cargo is needed"; exit 1; }
# Built in a private folder beside the prefix, then moved into place: an interrupted build never leaves a
# prefix that looks complete.
WORK=$(mktemp -d "$CACHE/.s3s-fs-build.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
log "building s3s-fs $VERSION (a few minutes, once)"
CARGO_TARGET_DIR=$WORK/target cargo install --quiet --locked --features binary \
    --version "=$VERSION" --root "$WORK/prefix" s3s-fs >&2
"$WORK/prefix/bin/s3s-fs" --help >/dev/null
rm -rf "$PREFIX"
mv "$WORK/prefix" "$PREFIX"
log "s3s-fs $VERSION built in $PREFIX"
echo "$BIN"
