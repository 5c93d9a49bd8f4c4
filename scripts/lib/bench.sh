# shellcheck shell=bash
# Sourced by the benchmark scripts (from the repository's root): their common start, timing, settling the
# caches between timed steps, medians and ratios.

# shellcheck disable=SC1091
. scripts/env.sh

# Root (for $1), a release build of the tool and the workloads, and what every benchmark runs: $BIN, $GC,
# $CRIU (scripts/env.sh must have been sourced).
bench_build() {
    [ "$(id -u)" = 0 ] || { echo "bench: needs root ($1)" >&2; exit 4; }
    cargo build -q --release -p gpu-checkpoint-cli -p gpu-checkpoint-workloads
    BIN=${CARGO_TARGET_DIR:-target}/release
    GC=$BIN/gpu-checkpoint
    CRIU=${GPU_CHECKPOINT_CRIU:?run scripts/setup.sh first}
}

# bench_start WHAT NAME "SIZES_DEFAULT" ARGS...: bench_build WHAT; ROUNDS (default 3); SIZES, an array:
# ARGS, or the words of SIZES_DEFAULT without any; the work folder bench_dir NAME.
bench_start() {
    bench_build "$1"
    ROUNDS=${ROUNDS:-3}
    # shellcheck disable=SC2206 # a list of sizes
    local defaults=($3)
    local name=$2
    shift 3
    SIZES=("$@")
    [ ${#SIZES[@]} -gt 0 ] || SIZES=("${defaults[@]}")
    bench_dir "$name"
}

now() { echo "$EPOCHREALTIME"; }
ms() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.0f", (b - a) * 1000 }'; }
# Before every timed step: dirty data written back, page cache and inode caches dropped.
settle() { sync; echo 3 >/proc/sys/vm/drop_caches; }
# Waits until no process holds the PID (init reaps the killed process, at its own pace).
wait_free() { while [ -e "/proc/$1" ]; do sleep 0.05; done; }
median() { tr ' ' '\n' | grep -v '^$' | sort -n | awk '{ a[NR] = $1 } END { print a[int((NR + 1) / 2)] }'; }
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.2fx", (b > 0 ? a / b : 0) }'; }

# A fresh work folder $DIR (BENCH_DIR, else target/$1), removed at exit with the process $PID the
# benchmark runs (killed) if any.
bench_dir() {
    DIR=${BENCH_DIR:-target/$1}
    rm -rf "$DIR"
    mkdir -p "$DIR"
    DIR=$(cd "$DIR" && pwd)
    PID=
    trap '[ -n "$PID" ] && kill -9 "$PID" 2>/dev/null; rm -rf "$DIR"' EXIT
}
