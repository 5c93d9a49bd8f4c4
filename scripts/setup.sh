#!/usr/bin/env bash
# Installs what gpu-checkpoint needs on a fresh machine, without touching the system's packages, and builds it.
# Idempotent: re-running it is fast.
set -euo pipefail
cd "$(dirname "$0")/.."
# step FAILED SKIPPED COMMAND...: runs COMMAND. When it fails, CI stops here (after "setup: FAILED", unless
# FAILED is empty), because the tests that need what it installs must run there; elsewhere "setup: SKIPPED"
# says what will not work and the setup goes on.
step() {
    local failed=$1 skipped=$2
    shift 2
    if ! "$@"; then
        if [ "${CI:-}" = true ]; then
            [ -z "$failed" ] || echo "setup: $failed" >&2
            exit 1
        fi
        echo "setup: $skipped" >&2
    fi
}
# CRIU >= 4.0 in the project's own prefix (.deps/criu), unless the user points us at their own
# (GPU_CHECKPOINT_CRIU); scripts/env.sh exports the result. In CI a failure here fails the run (the CRIU
# tests must run there); elsewhere the build goes on and those tests say why they are skipped.
if [ -z "${GPU_CHECKPOINT_CRIU:-}" ]; then
    step "installing CRIU failed" "installing CRIU failed; checkpoint/restore and their tests will not work" \
        bash scripts/install-criu.sh >/dev/null
fi
# The programs tests/real_programs*.rs checkpoint (redis, nginx, PostgreSQL, MariaDB, memcached, tmux;
# python3 for them and criu_options.rs), from the distribution's packages, installed only when missing: a
# no-op when they are there (never started as services: scripts/lib/apt-missing.sh).
# shellcheck source=scripts/lib/apt-missing.sh
. scripts/lib/apt-missing.sh
test_programs() {
    # PostgreSQL's server is not on PATH (/usr/lib/postgresql/VERSION/bin): look for it there.
    local pg=postgres:postgresql
    if compgen -G '/usr/lib/postgresql/*/bin/postgres' >/dev/null; then
        pg=
    fi
    APT_MISSING_SERVICES="redis-server nginx mariadb-server:mariadb memcached postgresql" \
        apt_install_missing \
        redis-server:redis-server redis-cli:redis-tools nginx:nginx python3:python3 \
        mariadbd:mariadb-server mariadb:mariadb-client memcached:memcached tmux:tmux ${pg:+"$pg"}
}
step "" "the tests of real programs will be skipped" test_programs
# CRIU's zdtm test programs (.deps/zdtm), which crates/gpu-checkpoint-cli/tests/zdtm.rs runs through plain
# CRIU and gpu-checkpoint; the same rule: a failure fails CI, elsewhere that test says why it is skipped.
step "building CRIU's zdtm tests failed" "building CRIU's zdtm tests failed; the zdtm suite will be skipped" \
    bash scripts/install-zdtm.sh >/dev/null
# The container runtimes tests/containers.rs drives (runc, runsc, iptables, busybox-static), the same way.
step "installing the container runtimes failed" "the container tests will be skipped" \
    bash scripts/install-containers.sh
# checkpointctl (from Debian trixie, into .deps/checkpointctl), which tests/containers_checkpointctl.rs
# reads our podman/CRI-O checkpoint archives with; the same rule.
step "installing checkpointctl failed" "installing checkpointctl failed; the checkpointctl test will be skipped" \
    bash scripts/install-checkpointctl.sh >/dev/null
# containerd 2.x (Debian testing's, into .deps/containerd), whose CRI tests/kubernetes_containerd.rs drives as
# the kubelet does (docs/kubernetes.md); the same rule.
step "installing containerd failed" "installing containerd failed; the containerd CRI tests will be skipped" \
    bash scripts/install-containerd.sh >/dev/null
# etcd and protoc for the cluster flow (the etcd-client crate's build needs protoc, and so does the CRI
# client of the engine tests, crates/cri-client; the cluster tests start etcd on loopback). Needed to build the default features, so a failure stops the setup everywhere.
bash scripts/install-etcd.sh >/dev/null
# s3s-fs, the S3-compatible server the store's object-storage tests run against, built once into a cache
# outside the clone (scripts/install-s3s.sh); the same rule: a failure fails CI, elsewhere the S3 tests say
# why they are skipped.
step "building s3s-fs failed" "building s3s-fs failed; the S3 tests will be skipped" \
    bash scripts/install-s3s.sh >/dev/null
cargo build --workspace --all-targets
