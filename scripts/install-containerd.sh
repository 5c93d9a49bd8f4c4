#!/usr/bin/env bash
# Installs containerd 2.x (containerd, its runc shim `containerd-shim-runc-v2`, and `ctr`) from Debian into a
# prefix owned by the project (default: .deps/containerd), without touching the system: no apt state, package
# database or file outside the prefix is changed, and nothing is started or registered as a service.
# crates/gpu-checkpoint-cli/tests/kubernetes_containerd.rs starts it on a private socket, root and state
# folder per test run and drives its CRI API (docs/kubernetes.md).
#
# Why this way: bookworm's containerd is 1.6, without the CRI's container restore (containerd 2.0's). Debian
# testing has 2.1. Unlike CRIU, its binaries need nothing newer than bookworm's glibc (`libc6 >= 2.34`), and
# they must run as themselves: the shim re-executes its own binary, which a loader wrapper would break. So the
# package is unpacked and its programs run from the prefix as they are; an older glibc is refused.
#
# Usage: scripts/install-containerd.sh [PREFIX]
#   GPU_CHECKPOINT_CONTAINERD_SUITE     Debian suite to take it from (default: forky)
#   GPU_CHECKPOINT_CONTAINERD_REINSTALL=1  reinstall even when the prefix already holds it
#   GPU_CHECKPOINT_DEBIAN_MIRROR, GPU_CHECKPOINT_APT_KEYRING: see scripts/lib/debian-apt.sh
# Prints the prefix's bin folder on its last line. Idempotent: a second run only checks `containerd
# --version` and the suite the prefix was installed from.
set -euo pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
# shellcheck source=scripts/lib/prefix.sh
. "$REPO/scripts/lib/prefix.sh"
prefix_init containerd "${1:-}" "${GPU_CHECKPOINT_CONTAINERD_SUITE:-forky}" \
    "${GPU_CHECKPOINT_CONTAINERD_REINSTALL:-0}"
works() {
    [ -x "$1/bin/containerd" ] && [ -x "$1/bin/containerd-shim-runc-v2" ] && [ -x "$1/bin/ctr" ] &&
        "$1/bin/containerd" --version 2>/dev/null | grep -q ' v\?2\.'
}
describe() { "$1/bin/containerd" --version; }
prefix_reuse "$PREFIX/bin"

# shellcheck source=scripts/lib/debian-apt.sh
. "$REPO/scripts/lib/debian-apt.sh"
APTDIR="$PREFIX.apt"
debian_apt_init "$APTDIR" "deb $SUITE"
mkdir -p "$APTDIR/debs"
# Only the package itself: it depends on libc6 and runc (the system's runc is used; the CRI tests name it).
rm -f "$APTDIR"/debs/*.deb
(cd "$APTDIR/debs" && apt-get "${APT_OPTS[@]}" -qq download containerd >&2) || die "apt-get download failed"
NEED=$(dpkg-deb -f "$APTDIR"/debs/containerd_*.deb Depends | sed -n 's/.*libc6 (>= \([0-9.]*\)).*/\1/p' || true)
HAVE=$(ldd --version 2>/dev/null | head -1 | grep -o '[0-9]\+\.[0-9]\+$' || true)
if [ -n "$NEED" ] && [ -n "$HAVE" ] && ! dpkg --compare-versions "$HAVE" ge "$NEED"; then
    die "containerd of $SUITE needs glibc >= $NEED; this system has $HAVE"
fi
NEW="$PREFIX.new"
rm -rf "$NEW"
mkdir -p "$NEW/root" "$NEW/bin"
dpkg-deb -x "$APTDIR"/debs/containerd_*.deb "$NEW/root"
for b in containerd containerd-shim-runc-v2 ctr; do
    [ -x "$NEW/root/usr/bin/$b" ] || die "$b missing from the package"
    # Relative links: the prefix can move (it is shared through a link to another checkout).
    ln -s "../root/usr/bin/$b" "$NEW/bin/$b"
done
works "$NEW" || die "the unpacked containerd does not run: $("$NEW/bin/containerd" --version 2>&1 | head -3)"
dpkg-deb -f "$APTDIR"/debs/containerd_*.deb Version >"$NEW/version"
prefix_finish "$NEW" "$PREFIX/bin"
