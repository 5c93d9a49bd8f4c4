#!/usr/bin/env bash
# Benchmark (issue 27): checkpoint and restore of an idle process holding N MiB of incompressible memory,
# ours (default options) against plain `criu dump` (+ an fsync of every image: ours is durable when it
# returns) and plain `criu restore -d` from its image folder, alternated round by round.
#
# Restores are measured two ways, both after a warm-up round that read the store and the images once since
# they were written (on this VM the first read of freshly written data is 2-4x slower than later reads
# from a dropped cache, whoever reads it: `scripts/bench-criu.sh`, which dumps anew before every restore,
# measured plain CRIU at that first read, 4.2 s for 2 GiB, against 1.0-1.8 s for the later ones):
#   warm: the store and the images in the page cache (the node restoring again);
#   cold: the page cache dropped before each (`sync; drop_caches`: another node, both reading the same
#         disk).
# Ours reports the wall time, when the process ran again (`timings_ms.resumed`: the default restore lets
# it run as soon as CRIU has restored it, its memory coming in behind it) and when all of its memory was
# in (`memory_in`); plain CRIU's restore returns once the process runs with all of its memory. The tool's
# peak memory (max RSS, GNU time) is printed beside it.
#
# Usage (root): scripts/bench-restore.sh [MIB]           default 2048
#   ROUNDS=3        rounds (each: ours and plain CRIU, warm and cold, in an order that rotates)
#   CORES="2"       CPU sets to run under, one run each: "1 2" runs everything on 1 core, then on 2
#                   (taskset -c 0 / 0,1; the store's workers follow the cores it may use)
#   BENCH_DIR=DIR   where the store and the images go (default: target/bench-restore)
#   CHECKPOINT=0    skip the checkpoint comparison
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/lib/bench.sh
. scripts/lib/bench.sh
bench_build "CRIU"
MIB=${1:-2048}
ROUNDS=${ROUNDS:-3}
bench_dir bench-restore

# Runs "$@" on the CPU set of this run, recording the wall time (ms) in $T and the peak RSS (KiB) in $RSS.
timed() {
    local t0 t1
    t0=$(now)
    /usr/bin/time -f '%M' -o "$DIR/rss" taskset -c "$CPUS" "$@" >"$DIR/out"
    t1=$(now)
    T=$(ms "$t0" "$t1")
    RSS=$(tail -1 "$DIR/rss")
}

# The process, back from the images CRIU dumped (between checkpoint rounds).
revive() {
    wait_free "$PID"
    "$CRIU" restore -d -D "$DIR/img" -o restore.log
}

checkpoints() {
    local r
    for r in $(seq 1 "$ROUNDS"); do
        for who in $([ $((r % 2)) = 1 ] && echo "ours plain" || echo "plain ours"); do
            if [ "$who" = ours ]; then
                rm -rf "$DIR/store"
                settle
                timed "$GC" checkpoint --pid "$PID" --storage "$DIR/store" --format json
                O_CK+=" $T"
                O_CKRSS+=" $RSS"
                wait_free "$PID"
                "$GC" restore "$(grep -o '"id": "[^"]*"' "$DIR/out" | head -1 | cut -d'"' -f4)" \
                    --storage "$DIR/store" >/dev/null
            else
                rm -rf "$DIR/img"
                mkdir "$DIR/img"
                settle
                local t0
                t0=$(now)
                taskset -c "$CPUS" "$CRIU" dump -t "$PID" -D "$DIR/img" -o dump.log
                sync -- "$DIR"/img/*
                P_CK+=" $(ms "$t0" "$(now)")"
                revive
            fi
        done
    done
}

# One restore of ours (id $ID) or of plain CRIU, warm or cold; kills the restored process after.
restore_one() {
    local who=$1 how=$2
    if [ "$how" = cold ]; then
        settle
    elif [ "$who" = ours ]; then
        find "$DIR/store" -type f -exec cat {} + >/dev/null
    else
        cat "$DIR"/img/* >/dev/null
    fi
    if [ "$who" = ours ]; then
        timed "$GC" restore "$ID" --storage "$DIR/store" --format json
        local res mem
        res=$(grep -o '"resumed": [0-9.]*' "$DIR/out" | awk '{ printf "%.0f", $2 }')
        mem=$(grep -o '"memory_in": [0-9.]*' "$DIR/out" | awk '{ printf "%.0f", $2 }')
        eval "O_${how}+=\" $T\"; O_${how}_RES+=\" $res\"; O_${how}_MEM+=\" $mem\"; O_RSS+=\" $RSS\""
    else
        timed "$CRIU" restore -d -D "$DIR/img" -o restore.log
        eval "P_${how}+=\" $T\""
    fi
    kill -9 "$PID"
    wait_free "$PID"
}

run() {
    CPUS=$1
    O_CK= O_CKRSS= P_CK= O_warm= O_warm_RES= O_warm_MEM= O_cold= O_cold_RES= O_cold_MEM= O_RSS= P_warm= P_cold=
    PID=$("$BIN/workload" memory --mib "$MIB" --content random --verify-ms 0 --state "$DIR/state" --detach)
    until grep -q 'phase=verifying' "$DIR/state" 2>/dev/null; do sleep 0.1; done
    [ "${CHECKPOINT:-1}" = 0 ] || checkpoints
    # The store and the images the restores read: one of each, written once.
    rm -rf "$DIR/store"
    "$GC" checkpoint --pid "$PID" --storage "$DIR/store" --format json >"$DIR/out"
    ID=$(grep -o '"id": "[^"]*"' "$DIR/out" | head -1 | cut -d'"' -f4)
    wait_free "$PID"
    "$GC" restore "$ID" --storage "$DIR/store" >/dev/null
    rm -rf "$DIR/img"
    mkdir "$DIR/img"
    "$CRIU" dump -t "$PID" -D "$DIR/img" -o dump.log
    sync
    wait_free "$PID"
    # Warm-up: each read once since it was written.
    restore_one plain cold
    restore_one ours cold
    O_cold= O_cold_RES= O_cold_MEM= O_RSS= P_cold=
    local r order
    for r in $(seq 1 "$ROUNDS"); do
        case $((r % 4)) in
            1) order="ours:cold plain:cold ours:warm plain:warm" ;;
            2) order="plain:warm ours:warm plain:cold ours:cold" ;;
            3) order="plain:cold ours:cold plain:warm ours:warm" ;;
            0) order="ours:warm plain:warm ours:cold plain:cold" ;;
        esac
        for step in $order; do
            restore_one "${step%%:*}" "${step##*:}"
        done
    done
    PID=
    local n
    n=$(echo "$CPUS" | tr ',' '\n' | wc -l)
    echo "-- $n core(s) (taskset -c $CPUS), load average $(cut -d' ' -f1-3 /proc/loadavg) --"
    if [ "${CHECKPOINT:-1}" != 0 ]; then
        local ock pck
        ock=$(echo "$O_CK" | median) pck=$(echo "$P_CK" | median)
        printf 'checkpoint: ours %5s ms (peak RSS %s MiB) | criu dump + fsync %5s ms | %s\n' "$ock" \
            "$(($(echo "$O_CKRSS" | median) / 1024))" "$pck" "$(ratio "$ock" "$pck")"
        echo "  rounds: ours$O_CK; plain$P_CK"
    fi
    local how o res mem p
    for how in warm cold; do
        eval "o=\$(echo \"\$O_${how}\" | median); res=\$(echo \"\$O_${how}_RES\" | median)"
        eval "mem=\$(echo \"\$O_${how}_MEM\" | median); p=\$(echo \"\$P_${how}\" | median)"
        printf 'restore %s: ours %5s ms (ran again after %s ms, all memory in after %s ms) | criu restore %5s ms | %s (resumed %s, memory in %s)\n' \
            "$how" "$o" "$res" "$mem" "$p" "$(ratio "$o" "$p")" "$(ratio "$res" "$p")" "$(ratio "$mem" "$p")"
        eval "echo \"  rounds: ours\$O_${how} (resumed\$O_${how}_RES; memory in\$O_${how}_MEM); plain\$P_${how}\""
    done
    echo "  our restore's peak RSS: $(($(echo "$O_RSS" | median) / 1024)) MiB (median; max $(($(echo "$O_RSS" | tr ' ' '\n' | sort -n | tail -1) / 1024)) MiB)"
}

echo "restore of $MIB MiB of random memory: gpu-checkpoint (default options) vs plain CRIU ($("$CRIU" --version | head -1)), $ROUNDS rounds, medians in ms"
echo "disk: $(df -h "$DIR" | awk 'NR == 2 { print $1 " (" $2 ")" }'), $(nproc) cores, load average $(cut -d' ' -f1-3 /proc/loadavg)"
for cores in ${CORES:-2}; do
    run "$(seq -s, 0 $((cores - 1)))"
done
echo "ratios: ours / plain CRIU; checkpoint: ours / (criu dump + fsync)"
