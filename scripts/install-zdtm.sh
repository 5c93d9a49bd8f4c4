#!/usr/bin/env bash
# Fetches CRIU's own zdtm test programs (test/zdtm/{lib,static} of Debian's criu source package) and builds
# the ones crates/gpu-checkpoint-cli/tests/zdtm.rs runs, into .deps/zdtm. Data fetched at setup time like any
# Debian package: none of its code is part of this repository.
#
# How: a private apt (scripts/lib/debian-apt.sh, as scripts/install-criu.sh) with a `deb-src` line for the
# suite CRIU comes from; `apt-get source --download-only criu` fetches the upstream tarball
# (criu_VERSION.orig.tar.xz) and checks its hash against the signed Sources index. Only test/zdtm/ is
# unpacked; lib/ and the listed static tests are built with make and the system's gcc.
#
# Usage: scripts/install-zdtm.sh [PREFIX]
#   GPU_CHECKPOINT_ZDTM_SUITE     Debian suite to take the source from (default: forky, whose CRIU 4.2.1 the project runs)
#   GPU_CHECKPOINT_ZDTM_REINSTALL=1  fetch and build again
#   GPU_CHECKPOINT_DEBIAN_MIRROR, GPU_CHECKPOINT_APT_KEYRING: see scripts/lib/debian-apt.sh
# Prints the prefix on its last line. Idempotent: a second run compares a stamp (suite, test list, this
# script) and exits.
set -euo pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
PREFIX=${1:-$REPO/.deps/zdtm}
SUITE=${GPU_CHECKPOINT_ZDTM_SUITE:-forky}
# The tests to build: the list the test runs (names separated by blanks, `#` comments).
LIST=$REPO/crates/gpu-checkpoint-cli/tests/zdtm.list

log() { echo "install-zdtm: $*" >&2; }
die() {
    log "error: $*"
    exit 1
}

[ -r "$LIST" ] || die "$LIST missing"
TESTS=$(sed 's/#.*//' "$LIST" | tr -s '[:space:]' '\n' | sed '/^$/d' | sort -u)
# What the build depends on: the suite, the list, and this script.
STAMP="suite: $SUITE; tests: $(echo "$TESTS" | sha256sum | cut -c1-16); script: $(sha256sum <"$0" | cut -c1-16)"
if [ "${GPU_CHECKPOINT_ZDTM_REINSTALL:-0}" != 1 ] && [ "$(cat "$PREFIX/installed-from" 2>/dev/null)" = "$STAMP" ]; then
    log "zdtm already built in $PREFIX ($(cat "$PREFIX/version"))"
    echo "$PREFIX"
    exit 0
fi

command -v make >/dev/null && command -v gcc >/dev/null || die "make and gcc are needed to build the zdtm tests"

# shellcheck source=scripts/lib/debian-apt.sh
. "$REPO/scripts/lib/debian-apt.sh"
APTDIR="$PREFIX.apt"
debian_apt_init "$APTDIR" "deb-src $SUITE"
mkdir -p "$APTDIR/src"

# --- The upstream tarball. apt checks each file's hash against the signed Sources index. Debian's
# packaging tarball (criu_*.debian.tar.xz) may fail to download (seen: 404 while the index names it); we
# need only the upstream one, so its arrival is what we check, not apt's exit status.
rm -f "$APTDIR"/src/*
(cd "$APTDIR/src" && apt-get "${APT_OPTS[@]}" -qq source --download-only criu >&2) ||
    log "apt-get source reported a failure; checking for the upstream tarball"
ORIG=$(find "$APTDIR/src" -maxdepth 1 -name 'criu_*.orig.tar.*' | head -1)
[ -n "$ORIG" ] || die "criu's upstream tarball did not arrive from $SUITE"
VERSION=$(basename "$ORIG" | sed -E 's/^criu_(.*)\.orig\.tar\..*$/\1/')
log "criu $VERSION source: $(basename "$ORIG")"

# --- Unpack test/zdtm only, build into a fresh folder, then swap it in. -------------------------------------
NEW="$PREFIX.new"
rm -rf "$NEW"
mkdir -p "$NEW"
# criu-VERSION/test/zdtm/X -> NEW/X: lib/, static/ and the Makefile.inc both include.
tar -xf "$ORIG" -C "$NEW" --strip-components=3 --wildcards "*/test/zdtm/lib" "*/test/zdtm/static" \
    "*/test/zdtm/Makefile.inc" ||
    die "unpacking test/zdtm from $(basename "$ORIG") failed"
[ -f "$NEW/static/Makefile" ] || die "test/zdtm/static missing from $(basename "$ORIG")"

# shellcheck disable=SC2086 # TESTS is a list of names
log "building lib and $(echo $TESTS | wc -w) static tests"
JOBS=$(nproc 2>/dev/null || echo 2)
build() {
    make -C "$@" -j"$JOBS" >>"$NEW/build.log" 2>&1 || {
        tail -n 30 "$NEW/build.log" >&2
        die "building the zdtm tests failed (make -C $*; the whole log: $NEW/build.log)"
    }
}
build "$NEW/lib"
# shellcheck disable=SC2086
build "$NEW/static" $TESTS

# Each test's command line, as the Makefile's `T.pid` rule starts it (the options, and whether it takes a
# --filename or a --dirname): one line per test, `T ARGS...`, relative to the folder the test runs in.
for t in $TESTS; do
    cmd=$(make -s -n -C "$NEW/static" "$t.pid" | tail -1)
    case $cmd in "./$t "*) ;; *) die "unexpected command for $t.pid: $cmd" ;; esac
    echo "$t ${cmd#"./$t "}"
done >"$NEW/commands"

echo "$VERSION" >"$NEW/version"
echo "$STAMP" >"$NEW/installed-from"
debian_apt_swap_in "$NEW" "$PREFIX"
rm -f "$APTDIR"/src/* # unpacked; the source index stays for a quick reinstall
log "zdtm of criu $VERSION built in $PREFIX"
echo "$PREFIX"
