#!/usr/bin/env bash
# Benchmark: checkpoint + restore of an idle process holding N MiB of incompressible memory, with
# gpu-checkpoint (CRIU dump into the store's staging folder, then the store's ingest: chunk, hash, compress,
# fsync; restore: verified materialize, then CRIU restore) and with plain `criu dump` / `criu restore -d`
# into a folder on the same disk. Both run on the same process, alternating (the order flips every round),
# because memory bandwidth on shared machines drifts; the figures are medians over the rounds.
#
# Usage (root): scripts/bench-criu.sh [MIB...]        default: 1024 4096
#   ROUNDS=3            rounds per size
#   BENCH_DIR=DIR       where stores and images go (default: target/bench-criu, on the repository's disk)
#   COMPRESSION=none    the store setting for our checkpoint (default: the tool's default, zstd level 1)
# Builds gpu-checkpoint in release mode (a debug build's hashing and compression are many times slower)
# and needs CRIU (scripts/setup.sh installs the project's; scripts/env.sh finds it).
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck disable=SC1091
. scripts/env.sh
[ "$(id -u)" = 0 ] || { echo "bench: needs root (CRIU)" >&2; exit 4; }
cargo build -q --release -p gpu-checkpoint-cli -p gpu-checkpoint-workloads
BIN=${CARGO_TARGET_DIR:-target}/release
GC=$BIN/gpu-checkpoint
CRIU=${GPU_CHECKPOINT_CRIU:?run scripts/setup.sh first}
ROUNDS=${ROUNDS:-3}
SIZES=("$@")
[ ${#SIZES[@]} -gt 0 ] || SIZES=(1024 4096)
DIR=${BENCH_DIR:-target/bench-criu}
rm -rf "$DIR"
mkdir -p "$DIR"
DIR=$(cd "$DIR" && pwd)

PID=
trap '[ -n "$PID" ] && kill -9 "$PID" 2>/dev/null; rm -rf "$DIR"' EXIT

now() { echo "$EPOCHREALTIME"; }
ms() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.0f", (b - a) * 1000 }'; }
# Waits until no process holds the PID (init reaps the killed process, at its own pace).
wait_free() { while [ -e "/proc/$1" ]; do sleep 0.05; done; }
json_num() { grep -o "\"$1\": [0-9.]*" | head -1 | awk '{ printf "%.0f", $2 }'; }
median() { tr ' ' '\n' | grep -v '^$' | sort -n | awk '{ a[NR] = $1 } END { print a[int((NR + 1) / 2)] }'; }
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.2fx", (b > 0 ? a / b : 0) }'; }

ours() {
    rm -rf "$DIR/store" # a fresh store each time: no dedup against the previous round
    local t0 t1 out
    t0=$(now)
    out=$("$GC" checkpoint --pid "$PID" --storage "$DIR/store" --format json ${COMPRESSION:+--compression "$COMPRESSION"})
    t1=$(now)
    O_CK+=" $(ms "$t0" "$t1")"
    O_DUMP+=" $(echo "$out" | json_num dump)"
    O_WRITE+=" $(echo "$out" | json_num write)"
    local id
    id=$(echo "$out" | grep -o '"id": "[^"]*"' | head -1 | cut -d'"' -f4)
    wait_free "$PID"
    t0=$(now)
    out=$("$GC" restore "$id" --storage "$DIR/store" --format json)
    t1=$(now)
    O_RS+=" $(ms "$t0" "$t1")"
    O_FETCH+=" $(echo "$out" | json_num fetch)"
}

plain() {
    rm -rf "$DIR/img"
    mkdir "$DIR/img"
    local t0 t1
    t0=$(now)
    "$CRIU" dump -t "$PID" -D "$DIR/img" -v4 -o dump.log
    t1=$(now)
    P_CK+=" $(ms "$t0" "$t1")"
    # What making those images durable costs (our checkpoint is durable when it returns): fsync each file.
    sync -- "$DIR"/img/*
    P_CKS+=" $(ms "$t0" "$(now)")"
    wait_free "$PID"
    t0=$(now)
    "$CRIU" restore -d -D "$DIR/img" -v4 -o restore.log
    t1=$(now)
    P_RS+=" $(ms "$t0" "$t1")"
}

echo "gpu-checkpoint (compression: ${COMPRESSION:-default}) vs plain CRIU ($("$CRIU" --version | head -1)), $ROUNDS rounds per size, medians in ms"
echo "disk: $(df -h "$DIR" | awk 'NR == 2 { print $1 " (" $2 ")" }'), $(nproc) cores, load average $(cut -d' ' -f1-3 /proc/loadavg)"
printf '%-6s | %-28s | %-18s | %-24s | %-28s\n' "size" "checkpoint: ours / criu dump" "criu dump + fsync" "ours: dump (ratio), write" "restore: ours (fetch) / criu restore"
for mib in "${SIZES[@]}"; do
    O_CK= O_DUMP= O_WRITE= O_RS= O_FETCH= P_CK= P_CKS= P_RS=
    PID=$("$BIN/workload" memory --mib "$mib" --verify-ms 0 --state "$DIR/state" --detach)
    until grep -q 'phase=verifying' "$DIR/state" 2>/dev/null; do sleep 0.1; done
    for r in $(seq 1 "$ROUNDS"); do
        if [ $((r % 2)) = 1 ]; then ours; plain; else plain; ours; fi
    done
    kill -9 "$PID"
    wait_free "$PID"
    PID=
    ock=$(echo "$O_CK" | median) pck=$(echo "$P_CK" | median) pcks=$(echo "$P_CKS" | median)
    ors=$(echo "$O_RS" | median) prs=$(echo "$P_RS" | median)
    od=$(echo "$O_DUMP" | median) ow=$(echo "$O_WRITE" | median) of=$(echo "$O_FETCH" | median)
    printf '%-6s | %6s / %6s = %-9s | %6s (ours %s) | %6s (%s), %6s | %6s (%s) / %6s = %s\n' \
        "${mib}M" "$ock" "$pck" "$(ratio "$ock" "$pck")" "$pcks" "$(ratio "$ock" "$pcks")" \
        "$od" "$(ratio "$od" "$pck")" "$ow" "$ors" "$of" "$prs" "$(ratio "$ors" "$prs")"
done
echo "load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
