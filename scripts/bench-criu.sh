#!/usr/bin/env bash
# Benchmark: checkpoint + restore of an idle process holding N MiB of memory (incompressible, or
# CONTENT=mixed: runs of zero, random, recurring and compressible pages, like a real heap), with
# gpu-checkpoint streaming (the default: CRIU's images piped into the store's chunker; restored the default
# way, memory copied from verified chunks into the process through userfaultfd, and with --stream, every
# image piped to CRIU), gpu-checkpoint staged (--staged: CRIU dumps into a staging folder that the
# store then ingests; restore materializes a work folder first), and plain `criu dump` / `criu restore -d`
# into a folder on the same disk. All run on the same process, in an order that rotates every round,
# because memory bandwidth on shared machines drifts; the figures are medians over the rounds.
# Every timed step starts from the same state: the previous contender's output deleted, dirty data
# written back, caches dropped (`settle`). Without that the order decided the figures: ext4 skips inodes
# freed in the last minutes while it allocates new ones, so creating a store's 2,000 chunk files right
# after deleting the previous round's cost ~10% more CPU than after a pause (CRIU's dozen image files do
# not notice), and whoever ran after a 4 GiB write found the page cache full. Restores read cold, as on
# another node or after the cache has moved on.
#
# Usage (root): scripts/bench-criu.sh [MIB...]        default: 1024 4096
#   ROUNDS=3            rounds per size
#   BENCH_DIR=DIR       where stores and images go (default: target/bench-criu, on the repository's disk)
#   COMPRESSION=none    the store setting for our checkpoint (default: the tool's default, zstd level 1)
#   CONTENT=mixed       the workload's memory (default: random, incompressible)
#   LEAVE_RUNNING=1     instead: `--leave-running` checkpoints only, streamed (CRIU leaves the tree stopped,
#                       the tool continues it once the store has read every image) against `--staged`
#                       (CRIU resumes it after writing the files), alternated; the wall time and how long
#                       the tree was held stopped (`timings_ms.paused`), no restore
# Builds gpu-checkpoint in release mode (a debug build's hashing and compression are many times slower)
# and needs CRIU (scripts/setup.sh installs the project's; scripts/env.sh finds it).
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/lib/bench.sh
. scripts/lib/bench.sh
bench_start "CRIU" bench-criu "1024 4096" "$@"

# Ours, streamed (default) or staged ($1 = "" or "--staged"); appends to the arrays named by $2.
ours() {
    rm -rf "$DIR/store" "$DIR/img" # a fresh store each time: no dedup against the previous round
    local mode=$1 tag=$2 t0 t1 out id
    settle
    t0=$(now)
    out=$("$GC" checkpoint --pid "$PID" --storage "$DIR/store" --format json $mode ${COMPRESSION:+--compression "$COMPRESSION"})
    t1=$(now)
    eval "${tag}_CK+=\" $(ms "$t0" "$t1")\""
    id=$(echo "$out" | grep -o '"id": "[^"]*"' | head -1 | cut -d'"' -f4)
    wait_free "$PID"
    settle
    t0=$(now)
    "$GC" restore "$id" --storage "$DIR/store" --format json $mode >/dev/null
    t1=$(now)
    eval "${tag}_RS+=\" $(ms "$t0" "$t1")\""
    if [ -z "$mode" ]; then
        # The default restore copies the memory through userfaultfd; the streamed one pipes it to CRIU.
        kill -9 "$PID"
        wait_free "$PID"
        settle
        t0=$(now)
        "$GC" restore "$id" --storage "$DIR/store" --format json --stream >/dev/null
        t1=$(now)
        T_RS+=" $(ms "$t0" "$t1")"
    fi
}

plain() {
    rm -rf "$DIR/img" "$DIR/store"
    mkdir "$DIR/img"
    local t0 t1
    settle
    t0=$(now)
    "$CRIU" dump -t "$PID" -D "$DIR/img" -v4 -o dump.log
    t1=$(now)
    P_CK+=" $(ms "$t0" "$t1")"
    # What making those images durable costs (our checkpoint is durable when it returns): fsync each file.
    sync -- "$DIR"/img/*
    P_CKS+=" $(ms "$t0" "$(now)")"
    wait_free "$PID"
    settle
    t0=$(now)
    "$CRIU" restore -d -D "$DIR/img" -v4 -o restore.log
    t1=$(now)
    P_RS+=" $(ms "$t0" "$t1")"
}

# One `--leave-running` checkpoint ($1 = "" or "--staged") of the running $PID into a fresh store; appends
# the wall time and the time the tree was held stopped to the arrays named by $2.
leave_running() {
    rm -rf "$DIR/store"
    local mode=$1 tag=$2 t0 t1 out
    settle
    t0=$(now)
    out=$("$GC" checkpoint --pid "$PID" --storage "$DIR/store" --format json --leave-running $mode ${COMPRESSION:+--compression "$COMPRESSION"})
    t1=$(now)
    eval "${tag}_CK+=\" $(ms "$t0" "$t1")\""
    eval "${tag}_PA+=\" $(echo "$out" | grep -o '"paused": [0-9.]*' | awk '{ printf "%.0f", $2 }')\""
}

if [ "${LEAVE_RUNNING:-}" = 1 ]; then
    echo "--leave-running checkpoints: streamed (the default) vs --staged, $ROUNDS rounds alternated, medians in ms (compression: ${COMPRESSION:-default}, memory: ${CONTENT:-random})"
    echo "disk: $(df -h "$DIR" | awk 'NR == 2 { print $1 " (" $2 ")" }'), $(nproc) cores, load average $(cut -d' ' -f1-3 /proc/loadavg)"
    echo "wall: the command; paused: the tree held stopped (timings_ms.paused: CRIU's start until it ran again)"
    printf '%-6s | %-22s | %-22s | %s\n' "size" "streamed: wall paused" "staged: wall paused" "streamed/staged: wall paused"
    for mib in "${SIZES[@]}"; do
        S_CK= S_PA= G_CK= G_PA=
        PID=$("$BIN/workload" memory --mib "$mib" --content "${CONTENT:-random}" --verify-ms 0 --state "$DIR/state" --detach)
        until grep -q 'phase=verifying' "$DIR/state" 2>/dev/null; do sleep 0.1; done
        for r in $(seq 1 "$ROUNDS"); do
            if [ $((r % 2)) = 1 ]; then
                leave_running "" S; leave_running --staged G
            else
                leave_running --staged G; leave_running "" S
            fi
        done
        kill -9 "$PID"
        wait_free "$PID"
        PID=
        sck=$(echo "$S_CK" | median) spa=$(echo "$S_PA" | median)
        gck=$(echo "$G_CK" | median) gpa=$(echo "$G_PA" | median)
        printf '%-6s | %6s %6s        | %6s %6s        | %s %s\n' "${mib}M" "$sck" "$spa" "$gck" "$gpa" \
            "$(ratio "$sck" "$gck")" "$(ratio "$spa" "$gpa")"
        echo "  rounds: streamed wall$S_CK, paused$S_PA; staged wall$G_CK, paused$G_PA"
    done
    echo "load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
    exit 0
fi

echo "gpu-checkpoint (compression: ${COMPRESSION:-default}, memory: ${CONTENT:-random}) vs plain CRIU ($("$CRIU" --version | head -1)), $ROUNDS rounds per size, medians in ms"
echo "disk: $(df -h "$DIR" | awk 'NR == 2 { print $1 " (" $2 ")" }'), $(nproc) cores, load average $(cut -d' ' -f1-3 /proc/loadavg)"
echo "streamed: images piped between CRIU and the store (the default); staged: written to a folder first (--staged)"
echo "restore: default = memory copied into the processes through userfaultfd; --stream = every image piped to CRIU"
printf '%-6s | %-46s | %-40s\n' "size" "checkpoint: criu dump (+fsync) | streamed | staged" "restore: criu | default | --stream | --staged"
for mib in "${SIZES[@]}"; do
    S_CK= S_RS= T_RS= G_CK= G_RS= P_CK= P_CKS= P_RS=
    PID=$("$BIN/workload" memory --mib "$mib" --content "${CONTENT:-random}" --verify-ms 0 --state "$DIR/state" --detach)
    until grep -q 'phase=verifying' "$DIR/state" 2>/dev/null; do sleep 0.1; done
    for r in $(seq 1 "$ROUNDS"); do
        case $((r % 3)) in
            1) plain; ours "" S; ours --staged G ;;
            2) ours "" S; ours --staged G; plain ;;
            0) ours --staged G; plain; ours "" S ;;
        esac
    done
    kill -9 "$PID"
    wait_free "$PID"
    PID=
    pck=$(echo "$P_CK" | median) pcks=$(echo "$P_CKS" | median) prs=$(echo "$P_RS" | median)
    sck=$(echo "$S_CK" | median) srs=$(echo "$S_RS" | median) trs=$(echo "$T_RS" | median)
    gck=$(echo "$G_CK" | median) grs=$(echo "$G_RS" | median)
    printf '%-6s | %5s (%5s) | %5s = %-5s | %5s = %-5s | %5s | %5s = %-5s | %5s = %-5s | %5s = %-5s\n' \
        "${mib}M" "$pck" "$pcks" "$sck" "$(ratio "$sck" "$pcks")" "$gck" "$(ratio "$gck" "$pcks")" \
        "$prs" "$srs" "$(ratio "$srs" "$prs")" "$trs" "$(ratio "$trs" "$prs")" "$grs" "$(ratio "$grs" "$prs")"
done
echo "ratios: ours / (criu dump + fsync) for checkpoints (ours is durable when it returns), ours / criu restore for restores"
echo "load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
