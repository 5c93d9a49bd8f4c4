#!/usr/bin/env bash
# Benchmark: the job checkpoint protocol at fleet scale. AGENTS agents on this machine (each a real
# `gpu-checkpoint agent` process with its own socket, state folder and etcd lease), one lightweight
# SIMULATED GPU member each (MIB MiB), real etcd with TLS, client certificates and authentication
# (docs/cluster.md's secure setup); job checkpoints (--leave-running) against a plain checkpoint of one
# member, the protocol's time broken down, and the requests etcd answered per job checkpoint (its gRPC
# metrics: each call, each message on a stream). It is the cluster benchmark of
# crates/gpu-checkpoint-cli/tests/cluster_bench.rs run with these settings (not CI's: minutes of work for
# 64 CRIU dumps on a small machine).
#
# Usage (root): scripts/bench-cluster.sh
#   AGENTS=64       agent counts, comma-separated (default: 64)
#   MIB=1           each member's simulated GPU memory (default: 1)
#   MEMBER=ARGS     more gpu-sim-workload arguments per member (default: "--workers 1 --kernel-us 20000":
#                   one worker, 20 ms kernels, so that 64 members leave the cores to the agents and etcd;
#                   the default 2 workers with 200 us kernels made 64 members starve everything else here)
#   RUNS=3          job checkpoints per count (default: 3)
#   RESTORE=0       also time job restores (default: 0)
#   TLS=1           0: plaintext etcd, as before the secure setup (default: 1)
# Needs etcd, etcdctl, openssl and CRIU (scripts/setup.sh installs them).
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck disable=SC1091
. scripts/env.sh
[ "$(id -u)" = 0 ] || { echo "bench-cluster: needs root (CRIU)" >&2; exit 4; }
# 64 agents, each with a tokio runtime, a guardian and a CRIU per dump: more descriptors and processes than
# a login shell's defaults allow.
ulimit -n 65536 2>/dev/null || true
CLUSTER_BENCH_AGENTS=${AGENTS:-64} CLUSTER_BENCH_MIB=${MIB:-1} \
    CLUSTER_BENCH_MEMBER=${MEMBER:---workers 1 --kernel-us 20000} CLUSTER_BENCH_RUNS=${RUNS:-3} \
    CLUSTER_BENCH_RESTORE=${RESTORE:-0} CLUSTER_BENCH_TLS=${TLS:-1} \
    cargo test -q -p gpu-checkpoint-cli --test cluster_bench -- --ignored --nocapture
