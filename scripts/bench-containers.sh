#!/usr/bin/env bash
# Benchmark: a runc container holding N MiB of memory (an idle `workload memory`, incompressible),
# checkpointed and restored by gpu-checkpoint (`checkpoint --container`, `restore --container`: runc
# checkpoints into our staging folder, the store ingests the images; restore materializes them and runs
# `runc restore`) and by plain `runc checkpoint` / `runc restore` with a folder on the same disk. Both
# checkpoint with --leave-running (the container runs on between rounds) and restore under a new id next
# to it (deleted afterwards). The order alternates every round; every timed step starts from the same
# state (`settle`: dirty data written back, caches dropped); figures are medians over the rounds.
#
# Usage (root): scripts/bench-containers.sh [MIB...]        default: 1024
#   ROUNDS=3        rounds per size
#   BENCH_DIR=DIR   where the bundle, stores and images go (default: target/bench-containers)
# Builds gpu-checkpoint in release mode; needs CRIU and runc (scripts/setup.sh installs them).
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck disable=SC1091
. scripts/env.sh
# shellcheck source=scripts/lib/bench.sh
. scripts/lib/bench.sh
bench_build "runc, CRIU"
ROUNDS=${ROUNDS:-3}
SIZES=("$@")
[ ${#SIZES[@]} -gt 0 ] || SIZES=(1024)
DIR=${BENCH_DIR:-target/bench-containers}
rm -rf "$DIR"
mkdir -p "$DIR"
DIR=$(cd "$DIR" && pwd)
ROOT=$DIR/runc-root
RUNC=(runc --root "$ROOT" --criu "$CRIU")
ID=bench-$$
cleanup() {
    local c
    for c in $("${RUNC[@]}" list -q 2>/dev/null); do "${RUNC[@]}" delete -f "$c" >/dev/null 2>&1 || true; done
    rm -rf "$DIR"
}
trap cleanup EXIT

# The bundle: static busybox, the workload and the libraries it loads.
B=$DIR/bundle
mkdir -p "$B/rootfs/bin" "$B/rootfs/state" "$ROOT"
cp /bin/busybox "$B/rootfs/bin/" && ln -s busybox "$B/rootfs/bin/sh"
cp "$BIN/workload" "$B/rootfs/bin/"
for lib in $(ldd "$BIN/workload" | grep -o '/[^ ]*'); do
    mkdir -p "$B/rootfs$(dirname "$lib")" && cp "$lib" "$B/rootfs$lib"
done

gone() { "${RUNC[@]}" delete -f "$1" >/dev/null; }

ours() {
    rm -rf "$DIR/store"
    local t0 t1 out id
    settle
    t0=$(now)
    out=$("$GC" checkpoint --container "$ID" --runtime-root "$ROOT" --leave-running --storage "$DIR/store" --format json)
    t1=$(now)
    O_CK+=" $(ms "$t0" "$t1")"
    # The JSON's keys are sorted: the container's own "id" comes before the checkpoint's. Parse it.
    local rt wr
    read -r id rt wr < <(python3 -c 'import json, sys
v = json.load(sys.stdin); t = v["timings_ms"]
print(v["id"], round(t["runtime_checkpoint"]), round(t["write"]))' <<<"$out")
    O_RT+=" $rt"
    O_WR+=" $wr"
    settle
    t0=$(now)
    "$GC" restore "$id" --container "$ID-ours" --storage "$DIR/store" --format json >/dev/null
    t1=$(now)
    O_RS+=" $(ms "$t0" "$t1")"
    gone "$ID-ours"
}

plain() {
    rm -rf "$DIR/img"
    local t0 t1
    settle
    t0=$(now)
    "${RUNC[@]}" checkpoint --leave-running --image-path "$DIR/img" --work-path "$DIR/img" "$ID"
    t1=$(now)
    P_CK+=" $(ms "$t0" "$t1")"
    # What making the images durable costs (ours is durable when it returns): fsync each file.
    sync -- "$DIR"/img/*
    P_CKS+=" $(ms "$t0" "$(now)")"
    settle
    t0=$(now)
    "${RUNC[@]}" restore --detach --image-path "$DIR/img" --work-path "$DIR/img" --bundle "$B" "$ID-plain" \
        </dev/null >/dev/null 2>&1
    t1=$(now)
    P_RS+=" $(ms "$t0" "$t1")"
    gone "$ID-plain"
}

echo "gpu-checkpoint --container vs plain runc ($(runc --version | head -1), CRIU $("$CRIU" --version | head -1)), $ROUNDS rounds per size, medians in ms"
echo "disk: $(df -h "$DIR" | awk 'NR == 2 { print $1 " (" $2 ")" }'), $(nproc) cores, load average $(cut -d' ' -f1-3 /proc/loadavg)"
printf '%-6s | %-52s | %-22s\n' "size" "checkpoint: runc (+fsync) | ours (runc's part + store)" "restore: runc | ours"
for mib in "${SIZES[@]}"; do
    O_CK= O_RT= O_WR= O_RS= P_CK= P_CKS= P_RS=
    cat >"$B/config.json.args" <<<"[\"workload\", \"memory\", \"--mib\", \"$mib\", \"--verify-ms\", \"0\", \"--state\", \"/state/m\"]"
    (cd "$B" && rm -f config.json && runc spec)
    python3 - "$B" <<'PY'
import json, sys
b = sys.argv[1]
c = json.load(open(b + "/config.json"))
c["process"]["terminal"] = False
c["process"]["args"] = json.load(open(b + "/config.json.args"))
c["root"]["readonly"] = False
json.dump(c, open(b + "/config.json", "w"))
PY
    rm -f "$B/rootfs/state/m"
    "${RUNC[@]}" run --detach --bundle "$B" "$ID" </dev/null >/dev/null 2>&1
    until grep -q 'phase=verifying' "$B/rootfs/state/m" 2>/dev/null; do sleep 0.1; done
    for r in $(seq 1 "$ROUNDS"); do
        if [ $((r % 2)) = 1 ]; then plain; ours; else ours; plain; fi
    done
    gone "$ID"
    pck=$(echo "$P_CK" | median) pcks=$(echo "$P_CKS" | median) prs=$(echo "$P_RS" | median)
    ock=$(echo "$O_CK" | median) ort=$(echo "$O_RT" | median) owr=$(echo "$O_WR" | median)
    ors=$(echo "$O_RS" | median)
    printf '%-6s | %5s (%5s) | %5s = %-5s (%5s + %5s)           | %5s | %5s = %-5s\n' \
        "${mib}M" "$pck" "$pcks" "$ock" "$(ratio "$ock" "$pcks")" "$ort" "$owr" "$prs" "$ors" "$(ratio "$ors" "$prs")"
done
echo "ratios: ours / (runc checkpoint + fsync) (ours is durable when it returns), ours / runc restore"
echo "load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
