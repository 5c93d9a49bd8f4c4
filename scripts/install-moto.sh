#!/usr/bin/env bash
# Installs moto's S3 server (a mock of AWS, from PyPI, with `pip` into a virtual environment) once into a
# cache outside the clone, keyed by its version, for the long test lane: one more S3 server the backend
# conformance suite runs against (crates/gpu-checkpoint/tests/common/moto.rs starts it on 127.0.0.1), never
# the only one.
#
# Usage: scripts/install-moto.sh
#   GPU_CHECKPOINT_CACHE   where built tools are kept (default: /var/cache/gpu-checkpoint, or
#                          ~/.cache/gpu-checkpoint when that cannot be written)
# Prints the server's path on its last line. Idempotent: a second run only checks that it is there.
#
# A virtual environment cannot be moved once made (its scripts name their interpreter by path), so it is
# made in place and marked complete last: a prefix without the mark (an interrupted install) is made anew.
set -euo pipefail

VERSION=5.2.5
log() { echo "install-moto: $*" >&2; }

CACHE=${GPU_CHECKPOINT_CACHE:-/var/cache/gpu-checkpoint}
if ! mkdir -p "$CACHE" 2>/dev/null || [ ! -w "$CACHE" ]; then
    CACHE=${XDG_CACHE_HOME:-$HOME/.cache}/gpu-checkpoint
    mkdir -p "$CACHE"
fi
PREFIX=$CACHE/moto-$VERSION
BIN=$PREFIX/bin/moto_server

if [ -e "$PREFIX/.complete" ] && "$BIN" --help >/dev/null 2>&1; then
    log "moto $VERSION already installed in $PREFIX"
    echo "$BIN"
    exit 0
fi

command -v python3 >/dev/null || { log "error: python3 is needed"; exit 1; }
rm -rf "$PREFIX"
log "installing moto $VERSION (a minute, once)"
python3 -m venv "$PREFIX"
"$PREFIX/bin/python" -m pip install --quiet --disable-pip-version-check "moto[server]==$VERSION" >&2
"$BIN" --help >/dev/null
touch "$PREFIX/.complete"
log "moto $VERSION installed in $PREFIX"
echo "$BIN"
