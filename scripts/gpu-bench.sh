#!/usr/bin/env bash
# The GPU data path at production size (issue 27), on a GPU machine, in one call of at most 8 minutes.
#
#   bash scripts/gpu-bench.sh pack    # here: release binaries stripped + the project's CRIU, compressed into
#                                     # .carry/ (ignored by git; about 20 MiB)
#   bash scripts/gpu-bench.sh run     # there (root, repo root, .carry carried): results in $OUT (default
#                                     # /tmp/gpu-bench): gpu-bench.log, one line of JSON per measurement
#   GPU_BENCH_SIM=1 bash scripts/gpu-bench.sh run   # a dry run here: the SIMULATED GPU stands in for the
#                                     # driver (the same steps, small sizes; says SIMULATED on every line)
#
# What it measures (ours with default options, alternated with the baseline, every figure from this run):
#  1. `doctor`: the THP mode and what a copy costs in 4 KiB and huge pages.
#  2. The H200 case: PyTorch holding 2 x GPU_BENCH_MIB (6144) MiB of random int32 on the GPU; round 1
#     under the machine's THP mode, round 2 under `always`: ours (checkpoint, then restore with the
#     caches dropped) and the baseline (the driver API through tools/gpu-probe/ckpt_probe.c: lock +
#     checkpoint, `criu dump` + sync; `criu restore -d` + driver restore + unlock), in an order that
#     alternates. Ours reports when the process ran again (resumed), when its GPU state was back
#     (gpu_done) and when all of its memory was in (memory_in); the workload checks its tensors on the GPU.
#  3. Restore throughput of a CPU process of GPU_BENCH_CPU_MIB (8192) MiB, warm (store cached) and cold
#     (caches dropped, after a first read), with 1, 4, 16 (or the cores) store threads, and ingest
#     (checkpoint --leave-running) at the same thread counts: the curve with cores.
# Every step runs under `timeout`, so one that hangs costs its share and the rest still runs.
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
CARRY=$REPO/.carry

pack() {
    # shellcheck disable=SC1091
    . scripts/env.sh
    cargo build -q --release -p gpu-checkpoint-cli -p gpu-checkpoint-workloads || exit 1
    rm -rf "$CARRY" && mkdir -p "$CARRY/bin"
    for b in gpu-checkpoint workload gpu-sim-workload; do
        strip -o "$CARRY/bin/$b" "target/release/$b"
    done
    tar -C "$CARRY" -cf - bin | zstd -q -19 -T0 -o "$CARRY/bin.tar.zst"
    rm -rf "$CARRY/bin"
    tar -C .deps -cf - criu | zstd -q -19 -T0 -o "$CARRY/criu.tar.zst"
    du -sh "$CARRY"/*
}

if [ "${1:-}" = pack ]; then
    pack
    exit 0
fi
[ "${1:-}" = run ] || { echo "usage: $0 pack|run" >&2; exit 2; }

OUT=${OUT:-/tmp/gpu-bench}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/gpu-bench.log") 2>&1
W=$(mktemp -d /tmp/gpu-bench.XXXXXX)
SIM=${GPU_BENCH_SIM:-0}
if [ -f "$CARRY/bin.tar.zst" ]; then
    zstd -dc "$CARRY/bin.tar.zst" | tar -C "$W" -xf -
    zstd -dc "$CARRY/criu.tar.zst" | tar -C "$W" -xf -
    BIN=$W/bin
    export GPU_CHECKPOINT_CRIU=$W/criu/bin/criu
else
    # shellcheck disable=SC1091
    . scripts/env.sh
    BIN=$REPO/target/release
fi
G=$BIN/gpu-checkpoint
CRIU=$GPU_CHECKPOINT_CRIU
S=$W/store
THP=/sys/kernel/mm/transparent_hugepage/enabled
THP0=$(grep -o '\[[a-z]*\]' "$THP" | tr -d '[]')
cleanup() {
    [ -n "${P:-}" ] && kill -9 "$P" 2>/dev/null
    [ "$SIM" = 1 ] || echo "$THP0" >"$THP" 2>/dev/null
    rm -rf "$W"
}
trap cleanup EXIT

now() { date +%s%3N; }
log() { echo "[$(date +%T)] $*"; }
# One measurement as a line of JSON: name, then key=value pairs (numbers or JSON).
rec() {
    local name=$1 kv line
    shift
    line="{\"what\":\"$name\",\"sim\":$([ "$SIM" = 1 ] && echo true || echo false)"
    for kv in "$@"; do line+=",\"${kv%%=*}\":${kv#*=}"; done
    echo "$line}" | tee -a "$OUT/results.jsonl"
}
wait_gone() { for _ in $(seq 600); do [ -e "/proc/$1" ] || return 0; sleep 0.05; done; log "pid $1 still there"; }
drop() { sync; echo 3 >/proc/sys/vm/drop_caches; }
jnum() { grep -o "\"$1\": [0-9.]*" | head -1 | awk '{ printf "%.0f", $2 }'; }

log "gpu-checkpoint $($G --version) $([ "$SIM" = 1 ] && echo '(SIMULATED GPU: a dry run)'), $(nproc) cores"
timeout 60 "$G" doctor
timeout 60 "$G" doctor --format json >"$OUT/doctor.json"

# --- 2. the H200 case ----------------------------------------------------------------------------------
MIB=${GPU_BENCH_MIB:-$([ "$SIM" = 1 ] && echo 256 || echo 6144)}
if [ "$SIM" = 1 ]; then
    BACKEND=(--gpu-backend sim)
    start_gpu() { P=$("$BIN/gpu-sim-workload" --daemon --mib "$MIB"); }
    gpu_ok() { "$G" cuda state --pid "$P" "${BACKEND[@]}" >/dev/null 2>&1; }
    driver() { "$G" cuda "$1" --pid "$P" "${BACKEND[@]}" >/dev/null; }
else
    BACKEND=()
    gcc -O2 -o "$W/probe" tools/gpu-probe/ckpt_probe.c -ldl || exit 1
    start_gpu() {
        setsid -f python3 tools/gpu-probe/torch_workload.py "$W/torch.state" "$MIB" random </dev/null \
            >"$W/torch.out" 2>&1
        for _ in $(seq 600); do grep -q ' ok ' "$W/torch.state" 2>/dev/null && break; sleep 0.5; done
        P=$(pgrep -f torch_workload.py | head -1)
    }
    # The workload checks its tensors on the GPU every 50 steps: a line after `since` that says ok.
    gpu_ok() {
        local s0
        s0=$(awk '{ print $2 }' "$W/torch.state" 2>/dev/null)
        for _ in $(seq 120); do
            sleep 0.5
            local s
            s=$(awk '{ print $2 }' "$W/torch.state" 2>/dev/null)
            [ "${s:-0}" -gt "${s0:-0}" ] && grep -q ' ok ' "$W/torch.state" && return 0
        done
        return 1
    }
    driver() {
        case $1 in
            lock) "$W/probe" "$P" lock:10000 >/dev/null ;;
            *) "$W/probe" "$P" "$1" >/dev/null ;;
        esac
    }
fi

ours() {
    rm -rf "$S"
    drop
    local t0 t1 out id
    t0=$(now)
    out=$(timeout 180 "$G" checkpoint --pid "$P" --storage "$S" --format json "${BACKEND[@]}") || { log "ours: checkpoint failed"; return 1; }
    t1=$(now)
    local ck=$((t1 - t0))
    id=$(echo "$out" | grep -o '"id": "[^"]*"' | head -1 | cut -d'"' -f4)
    wait_gone "$P"
    drop
    local t2
    t1=$(now)
    out=$(timeout 180 "$G" restore "$id" --storage "$S" --format json "${BACKEND[@]}") || { log "ours: restore failed"; return 1; }
    t2=$(now)
    gpu_ok && ok=true || ok=false
    rec ours thp="\"$(grep -o '\[[a-z]*\]' "$THP" | tr -d '[]')\"" checkpoint_ms="$ck" \
        restore_ms=$((t2 - t1)) resumed_ms="$(echo "$out" | jnum resumed)" \
        gpu_done_ms="$(echo "$out" | jnum gpu_done)" memory_in_ms="$(echo "$out" | jnum memory_in)" \
        copied_bytes="$(echo "$out" | jnum copied_bytes)" huge_bytes="$(echo "$out" | jnum huge_bytes)" \
        gpu_verified=$ok
}

baseline() {
    local img=$W/img t0 t1 t2
    rm -rf "$img" && mkdir -p "$img"
    drop
    t0=$(now)
    driver lock && driver checkpoint || { log "baseline: driver checkpoint failed"; return 1; }
    timeout 180 "$CRIU" dump -t "$P" -D "$img" -o dump.log || { log "baseline: criu dump failed"; return 1; }
    sync
    t1=$(now)
    local ck=$((t1 - t0))
    wait_gone "$P"
    drop
    t1=$(now)
    timeout 180 "$CRIU" restore -d -D "$img" -o restore.log || { log "baseline: criu restore failed"; return 1; }
    driver restore && driver unlock
    t2=$(now)
    gpu_ok && ok=true || ok=false
    rec baseline thp="\"$(grep -o '\[[a-z]*\]' "$THP" | tr -d '[]')\"" checkpoint_ms="$ck" \
        restore_ms=$((t2 - t1)) images_mib="$(du -sm "$img" | cut -f1)" gpu_verified=$ok
}

log "== 2. $([ "$SIM" = 1 ] && echo "SIMULATED, $MIB MiB" || echo "PyTorch, 2 x $MIB MiB of random int32") on the GPU, ours vs the baseline"
start_gpu
log "pid $P"
for round in 1 2; do
    # (A dry run leaves the THP mode of a shared machine alone.)
    [ "$round" = 2 ] && [ "$SIM" != 1 ] && echo always >"$THP"
    if [ "$round" = 1 ]; then ours; baseline; else baseline; ours; fi
done
[ "$SIM" = 1 ] || echo "$THP0" >"$THP"
kill -9 "$P" 2>/dev/null
wait_gone "$P"
P=

# --- 3. restore and ingest throughput against store threads --------------------------------------------
CPU_MIB=${GPU_BENCH_CPU_MIB:-$([ "$SIM" = 1 ] && echo 1024 || echo 8192)}
log "== 3. a CPU process of $CPU_MIB MiB: ingest and restore throughput against threads"
P=$("$BIN/workload" memory --mib "$CPU_MIB" --content random --verify-ms 0 --state "$W/mem.state" --detach)
for _ in $(seq 600); do grep -q 'phase=verifying' "$W/mem.state" 2>/dev/null && break; sleep 0.2; done
n=$(nproc)
for threads in 1 4 $n; do
    rm -rf "$S"
    drop
    out=$(GPU_CHECKPOINT_THREADS=$threads timeout 120 "$G" checkpoint --pid "$P" --storage "$S" --leave-running --format json)
    rec ingest threads="$threads" mib="$CPU_MIB" total_ms="$(echo "$out" | jnum total)" \
        paused_ms="$(echo "$out" | jnum paused)"
done
id=$(echo "$out" | grep -o '"id": "[^"]*"' | head -1 | cut -d'"' -f4)
kill -9 "$P"
wait_gone "$P"
"$G" restore "$id" --storage "$S" >/dev/null # the first read since the store was written
kill -9 "$P"
wait_gone "$P"
for threads in 1 4 $n; do
    for how in warm cold; do
        if [ "$how" = cold ]; then drop; else find "$S" -type f -exec cat {} + >/dev/null; fi
        out=$(GPU_CHECKPOINT_THREADS=$threads timeout 120 "$G" restore "$id" --storage "$S" --format json)
        rec restore threads="$threads" cache="\"$how\"" mib="$CPU_MIB" total_ms="$(echo "$out" | jnum total)" \
            resumed_ms="$(echo "$out" | jnum resumed)" memory_in_ms="$(echo "$out" | jnum memory_in)"
        kill -9 "$P"
        wait_gone "$P"
    done
done
P=
log "done: $OUT/results.jsonl"
