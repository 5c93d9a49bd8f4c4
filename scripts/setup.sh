#!/usr/bin/env bash
# Installs what gpu-checkpoint needs on a fresh machine, without touching the system's packages, and builds it.
# Idempotent: re-running it is fast.
set -euo pipefail
cd "$(dirname "$0")/.."
# CRIU >= 4.0 in the project's own prefix (.deps/criu), unless the user points us at their own
# (GPU_CHECKPOINT_CRIU); scripts/env.sh exports the result. In CI a failure here fails the run (the CRIU
# tests must run there); elsewhere the build goes on and those tests say why they are skipped.
if [ -z "${GPU_CHECKPOINT_CRIU:-}" ]; then
    if ! bash scripts/install-criu.sh >/dev/null; then
        if [ "${CI:-}" = true ]; then
            echo "setup: installing CRIU failed" >&2
            exit 1
        fi
        echo "setup: installing CRIU failed; checkpoint/restore and their tests will not work" >&2
    fi
fi
# The programs tests/real_programs.rs checkpoints (redis, nginx; python3 for it and criu_options.rs),
# from the distribution's packages, installed only when missing: a no-op when they are there. Packages
# apt installs here never start as services: a policy-rc.d forbids it for the install (one already
# there is left alone), and where systemd runs the units are disabled as well.
test_programs() {
    local want=() pkg bin
    for pair in redis-server:redis-server redis-cli:redis-tools nginx:nginx python3:python3; do
        bin=${pair%%:*} pkg=${pair#*:}
        if ! command -v "$bin" >/dev/null && [ ! -x "/usr/sbin/$bin" ]; then
            want+=("$pkg")
        fi
    done
    [ ${#want[@]} -eq 0 ] && return 0
    if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null; then
        echo "setup: cannot install ${want[*]} (needs root and apt-get)" >&2
        return 1
    fi
    local policy=/usr/sbin/policy-rc.d ours=
    if [ ! -e "$policy" ]; then
        printf '#!/bin/sh\nexit 101\n' >"$policy"
        chmod 755 "$policy"
        ours=1
    fi
    local apt=(env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends)
    local ok=1
    # The package lists are fetched only when the install cannot do without them.
    if ! "${apt[@]}" "${want[@]}" >/dev/null; then
        apt-get update -q >/dev/null && "${apt[@]}" "${want[@]}" >/dev/null || ok=
    fi
    if [ -n "$ours" ]; then
        rm -f "$policy"
    fi
    if [ -d /run/systemd/system ] && command -v systemctl >/dev/null; then
        local p
        for p in "${want[@]}"; do
            case $p in redis-server | nginx) systemctl disable --now "$p" >/dev/null 2>&1 || true ;; esac
        done
    fi
    [ -n "$ok" ] || { echo "setup: installing ${want[*]} failed" >&2; return 1; }
}
if ! test_programs; then
    if [ "${CI:-}" = true ]; then
        exit 1
    fi
    echo "setup: the tests of real programs will be skipped" >&2
fi
# CRIU's zdtm test programs (.deps/zdtm), which crates/gpu-checkpoint-cli/tests/zdtm.rs runs through plain
# CRIU and gpu-checkpoint; the same rule: a failure fails CI, elsewhere that test says why it is skipped.
if ! bash scripts/install-zdtm.sh >/dev/null; then
    if [ "${CI:-}" = true ]; then
        echo "setup: building CRIU's zdtm tests failed" >&2
        exit 1
    fi
    echo "setup: building CRIU's zdtm tests failed; the zdtm suite will be skipped" >&2
fi
# s3s-fs, the S3-compatible server the store's object-storage tests run against, built once into a cache
# outside the clone (scripts/install-s3s.sh); the same rule: a failure fails CI, elsewhere the S3 tests say
# why they are skipped.
if ! bash scripts/install-s3s.sh >/dev/null; then
    if [ "${CI:-}" = true ]; then
        echo "setup: building s3s-fs failed" >&2
        exit 1
    fi
    echo "setup: building s3s-fs failed; the S3 tests will be skipped" >&2
fi
cargo build --workspace --all-targets
