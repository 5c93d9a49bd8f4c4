#!/usr/bin/env bash
# Installs CRIU >= 4 from Debian into a prefix owned by the project (default: .deps/criu), without touching
# the system: no apt state, package database or file outside the prefix is changed.
#
# Why: Debian bookworm's criu 3.17 fails on recent kernels (vDSO handling). Trixie's 4.1.1 works, except that
# on kernels >= 6.16 it cannot dump any TCP/UDP socket (the kernel now answers EOPNOTSUPP to SO_PASSCRED on
# them and 4.1.1 treats that as fatal); 4.2.1, in Debian testing ("forky"), handles it. So we take the newest
# CRIU of testing and trixie: testing's when it has one, trixie's otherwise. Its binary needs a newer glibc
# than the system's, so we unpack criu, libcompel1 and every library they need (libc6 included) into the
# prefix and run the binary through the prefix's own dynamic loader (bin/criu is a wrapper).
#
# Usage: scripts/install-criu.sh [PREFIX]
#   GPU_CHECKPOINT_CRIU_SUITE     Debian suites to take CRIU from, newest version wins (default: "forky trixie")
#   GPU_CHECKPOINT_DEBIAN_MIRROR  Debian mirror URI to use (default: the first Debian URI of the system's apt sources)
#   GPU_CHECKPOINT_APT_KEYRING    keyring that signs the suites' Release files (default: the system's debian-archive-keyring)
#   GPU_CHECKPOINT_CRIU_REINSTALL=1  reinstall even when the prefix already holds a working CRIU from these suites
# Prints the wrapper's path on its last line. Idempotent: a second run only checks `criu --version` and the
# suites the prefix was installed from.
set -euo pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
PREFIX=${1:-${GPU_CHECKPOINT_CRIU_PREFIX:-$REPO/.deps/criu}}
SUITES=${GPU_CHECKPOINT_CRIU_SUITE:-forky trixie}
# The packages we need; their library dependencies are resolved from trixie's index below.
ROOTS=(criu libcompel1)

log() { echo "install-criu: $*" >&2; }
die() {
    log "error: $*"
    exit 1
}

STAMP="suites: $SUITES"
wrapper_works() {
    [ -x "$PREFIX/bin/criu" ] && "$PREFIX/bin/criu" --version 2>/dev/null | grep -q '^Version: [4-9]\.' &&
        [ "$(cat "$PREFIX/installed-from" 2>/dev/null)" = "$STAMP" ]
}

if [ "${GPU_CHECKPOINT_CRIU_REINSTALL:-0}" != 1 ] && wrapper_works; then
    log "$("$PREFIX/bin/criu" --version | head -1) already installed in $PREFIX"
    echo "$PREFIX/bin/criu"
    exit 0
fi

command -v apt-get >/dev/null && command -v dpkg >/dev/null ||
    die "apt-get and dpkg are needed (a Debian-like system); otherwise install CRIU >= 4.0 yourself and pass --criu PATH"

# --- A private apt (scripts/lib/debian-apt.sh): the system's mirror, Debian's keyring, own state. ----------
# shellcheck source=scripts/lib/debian-apt.sh
. "$REPO/scripts/lib/debian-apt.sh"
APTDIR="$PREFIX.apt"
debian_apt_init "$APTDIR" "deb $SUITES"
mkdir -p "$APTDIR/debs"

# --- Dependencies: criu, libcompel1 and the libraries they need, recursively. --------------------------------
# Only library packages are followed: criu's non-library dependencies (none today) and the libraries' own
# non-library ones (gcc-14-base...) carry no code the binary loads.
declare -A SEEN=()
QUEUE=("${ROOTS[@]}")
PKGS=()
while [ ${#QUEUE[@]} -gt 0 ]; do
    p=${QUEUE[0]}
    QUEUE=("${QUEUE[@]:1}")
    [ -n "${SEEN[$p]:-}" ] && continue
    SEEN[$p]=1
    PKGS+=("$p")
    # In a group of alternatives ("|Depends: a" then "Depends: b") take the first one only.
    deps=$(apt-cache "${APT_OPTS[@]}" depends --no-recommends --no-suggests --no-conflicts --no-breaks \
        --no-replaces --no-enhances "$p" | awk '
            /^ *\|?(Pre)?Depends:/ {
                alt = ($1 ~ /^\|/); name = $2
                if (!skip && name !~ /^</) print name
                skip = alt
            }') || die "apt-cache depends $p failed"
    for d in $deps; do
        case $d in lib*) [ -z "${SEEN[$d]:-}" ] && QUEUE+=("$d") ;; esac
    done
done
log "packages: ${PKGS[*]}"

# --- Download and unpack into a fresh folder, then swap it in, so an interrupted run leaves no half prefix. --
rm -f "$APTDIR"/debs/*.deb
(cd "$APTDIR/debs" && apt-get "${APT_OPTS[@]}" -qq download "${PKGS[@]}" >&2) || die "apt-get download failed"
NEW="$PREFIX.new"
rm -rf "$NEW"
mkdir -p "$NEW/root" "$NEW/bin" "$NEW/plugins"
for deb in "$APTDIR"/debs/*.deb; do
    dpkg-deb -x "$deb" "$NEW/root"
done

CRIU_BIN=$NEW/root/usr/sbin/criu
[ -x "$CRIU_BIN" ] || die "criu binary missing from the package"
# The dynamic loader and the multiarch library folder of this architecture (x86_64, aarch64, ...).
LOADER=$(find "$NEW/root/usr/lib" -maxdepth 2 -name 'ld-linux*.so*' -path '*-linux-gnu*/*' | head -1)
[ -n "$LOADER" ] || die "dynamic loader missing from libc6"
LIBDIR=$(dirname "$LOADER")
rel() { echo "${1#"$NEW"/}"; }

# The wrapper runs CRIU through the prefix's loader with --library-path rather than LD_LIBRARY_PATH: the
# search path then applies to CRIU alone and is not inherited by what CRIU executes (action scripts,
# iptables, ...), which keep running on the system's own libraries. Restored processes come from their
# images and never see the prefix either. CRIU_LIBS_DIR points CRIU at the prefix's (empty) plugin folder so
# that plugins installed on the system (e.g. CRIU's cuda plugin) never act behind gpu-checkpoint's back.
cat >"$NEW/bin/criu" <<EOF
#!/bin/sh
# Generated by gpu-checkpoint's scripts/install-criu.sh: CRIU from Debian ($SUITES), run through its own loader.
prefix=\$(CDPATH= cd -- "\$(dirname -- "\$0")/.." && pwd) || exit 1
CRIU_LIBS_DIR=\${CRIU_LIBS_DIR:-\$prefix/plugins}
export CRIU_LIBS_DIR
exec "\$prefix/$(rel "$LOADER")" --library-path "\$prefix/$(rel "$LIBDIR")" "\$prefix/$(rel "$CRIU_BIN")" "\$@"
EOF
chmod 0755 "$NEW/bin/criu"

"$NEW/bin/criu" --version | grep -q '^Version: [4-9]\.' || die "the unpacked CRIU does not run: $("$NEW/bin/criu" --version 2>&1 | head -3)"
echo "$STAMP" >"$NEW/installed-from"
rm -rf "$PREFIX.old"
[ -e "$PREFIX" ] && mv "$PREFIX" "$PREFIX.old"
mv "$NEW" "$PREFIX"
rm -rf "$PREFIX.old"
rm -f "$APTDIR"/debs/*.deb # unpacked; the package index stays for a quick reinstall
log "$("$PREFIX/bin/criu" --version | head -1) installed in $PREFIX"
echo "$PREFIX/bin/criu"
