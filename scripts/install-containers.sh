#!/usr/bin/env bash
# Installs the container runtimes crates/gpu-checkpoint-cli/tests/containers*.rs drives, from the
# distribution's packages, only when missing: runc (CRIU's network lock needs iptables), runsc (gVisor),
# a static busybox for the minimal root filesystems the tests build, and `ip` (iproute2: a test joins a
# container to a namespace made by `ip netns add`). Then checks the versions the project
# is known to work with (docs/containers.md): an older runc lacks what the tests use; a newer one is
# reported, not refused.
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
# shellcheck source=scripts/lib/apt-missing.sh
. "$REPO/scripts/lib/apt-missing.sh"

log() { echo "install-containers: $*" >&2; }

apt_install_missing runc:runc iptables:iptables busybox:busybox-static runsc:runsc podman:podman ip:iproute2 || exit 1
# busybox-static installs /bin/busybox; a dynamic busybox found first on PATH would not run in a bare
# root filesystem, so the tests ask for a static one by path.
if ! file -L "$(command -v busybox)" 2>/dev/null | grep -q 'statically linked' &&
    ! ldd "$(command -v busybox)" 2>&1 | grep -q 'not a dynamic'; then
    log "warning: $(command -v busybox) is not statically linked; the container tests need busybox-static"
fi
# runc 1.1 is the oldest with `--criu` as a global flag working with CRIU 4 (checked: 1.1.5).
RUNC_VERSION=$(runc --version | sed -n 's/^runc version //p')
case $RUNC_VERSION in
    0.* | 1.0.*)
        log "error: runc $RUNC_VERSION is older than 1.1"
        exit 1
        ;;
esac
log "runc $RUNC_VERSION, $(iptables --version), $(command -v runsc >/dev/null && { runsc --version 2>/dev/null || true; } | head -1)"
