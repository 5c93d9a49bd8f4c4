# shellcheck shell=bash
# Sourced by the install scripts that build a tool from crates.io once into a cache outside the clone,
# keyed by its version (scripts/install-s3s.sh, scripts/install-garage.sh).
#
#   cargo_install_cached CRATE VERSION CHECK_ARG [CARGO_INSTALL_ARGS...]
# builds binary CRATE of crate CRATE, version VERSION, with `cargo install --locked` (the crate's own
# Cargo.lock) into CACHE/CRATE-VERSION, unless `CACHE/CRATE-VERSION/bin/CRATE CHECK_ARG` already runs.
# CACHE: GPU_CHECKPOINT_CACHE (default /var/cache/gpu-checkpoint), or ~/.cache/gpu-checkpoint when that
# cannot be written. Prints the binary's path on its last line.
cargo_install_cached() {
    local crate=$1 version=$2 check=$3
    shift 3
    local cache=${GPU_CHECKPOINT_CACHE:-/var/cache/gpu-checkpoint}
    if ! mkdir -p "$cache" 2>/dev/null || [ ! -w "$cache" ]; then
        cache=${XDG_CACHE_HOME:-$HOME/.cache}/gpu-checkpoint
        mkdir -p "$cache"
    fi
    local prefix=$cache/$crate-$version
    local bin=$prefix/bin/$crate
    if [ -x "$bin" ] && "$bin" "$check" >/dev/null 2>&1; then
        echo "install: $crate $version already built in $prefix" >&2
        echo "$bin"
        return 0
    fi
    command -v cargo >/dev/null || { echo "install: error: cargo is needed" >&2; return 1; }
    # Built in a private folder beside the prefix, then moved into place: an interrupted build never leaves
    # a prefix that looks complete.
    local work
    work=$(mktemp -d "$cache/.$crate-build.XXXXXX")
    # shellcheck disable=SC2064 # the folder is known now
    trap "rm -rf '$work'" EXIT
    echo "install: building $crate $version (once per machine)" >&2
    CARGO_TARGET_DIR=$work/target cargo install --quiet --locked "$@" \
        --version "=$version" --root "$work/prefix" "$crate" >&2
    "$work/prefix/bin/$crate" "$check" >/dev/null
    rm -rf "$prefix"
    mv "$work/prefix" "$prefix"
    rm -rf "$work"
    echo "install: $crate $version built in $prefix" >&2
    echo "$bin"
}
