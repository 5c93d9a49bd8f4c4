#!/usr/bin/env bash
# Benchmark: a runc container holding N MiB of memory (an idle `workload memory`, incompressible),
# checkpointed and restored by gpu-checkpoint (`checkpoint --container`, `restore --container`: our CRIU
# dumps the container with runc's settings, its images streamed into the store; restore runs `runc restore`
# with its CRIU reading the images streamed from the store, `fetch` 0) and by plain `runc checkpoint` / `runc restore` with a folder on the same disk. Both
# checkpoint with --leave-running (the container runs on between rounds) and restore under a new id next
# to it (deleted afterwards). The order alternates every round; every timed step starts from the same
# state (`settle`: dirty data written back, caches dropped); figures are medians over the rounds.
#
# With runsc installed, the same container under gVisor (`--platform=ptrace --network=none`, all that
# works here) is checkpointed and restored too, by plain `runsc checkpoint` / `runsc restore` and by
# gpu-checkpoint (`--runtime runsc`): each stops the sandbox, deletes it and restores it under the same id.
#
# With podman installed, `podman container checkpoint --leave-running --export` (its default zstd
# archive) and `podman container restore --import --name` of the same workload in a podman container
# (runc, its own root, no network) are timed in the same rounds, as podman users get them.
#
# Usage (root): scripts/bench-containers.sh [MIB...]        default: 1024
#   ROUNDS=3        rounds per size
#   RUNSC=0         leave gVisor out (default: in where runsc is installed)
#   PODMAN=0        leave podman out (default: in where podman is installed)
#   BENCH_DIR=DIR   where the bundle, stores and images go (default: target/bench-containers)
# Builds gpu-checkpoint in release mode; needs CRIU and runc (scripts/setup.sh installs them).
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/lib/bench.sh
. scripts/lib/bench.sh
bench_start "runc, CRIU" bench-containers 1024 "$@"
ROOT=$DIR/runc-root
RUNC=(runc --root "$ROOT" --criu "$CRIU")
ID=bench-$$
SROOT=$DIR/runsc-root
RUNSC_FLAGS=(--platform=ptrace --network=none)
RUNSCC=(runsc --root "$SROOT" "${RUNSC_FLAGS[@]}")
if [ "${RUNSC:-1}" = 1 ] && ! command -v runsc >/dev/null; then RUNSC=0; fi
if [ "${PODMAN:-1}" = 1 ] && ! command -v podman >/dev/null; then PODMAN=0; fi
# podman's run root must be a short path (at most 50 characters): a private folder of its own.
PD=
if [ "${PODMAN:-1}" = 1 ]; then PD=$(mktemp -d /tmp/gc-bench-podman.XXXXXX); fi
# podman finds CRIU by name on PATH, and refuses a link to it: a wrapper script.
PODMANC=(env "PATH=$PD/bin:$PATH" podman --root "$PD/storage" --runroot "$PD/run" --runtime runc
    --cgroup-manager cgroupfs --events-backend file)
cleanup() {
    local c
    if [ "${PODMAN:-1}" = 1 ] && [ -d "$PD" ]; then
        "${PODMANC[@]}" rm --all --force >/dev/null 2>&1 || true
        "${PODMANC[@]}" rmi --all --force >/dev/null 2>&1 || true
        # podman keeps its overlay storage mounted on itself.
        awk -v d="$PD" 'index($5, d) == 1 { print $5 }' /proc/self/mountinfo | sort -r |
            while read -r m; do umount -l "$m" || true; done
        rm -rf "$PD"
    fi
    for c in $("${RUNC[@]}" list -q 2>/dev/null); do "${RUNC[@]}" delete -f "$c" >/dev/null 2>&1 || true; done
    if [ "${RUNSC:-1}" = 1 ]; then
        for c in $("${RUNSCC[@]}" list -q 2>/dev/null); do "${RUNSCC[@]}" delete --force "$c" >/dev/null 2>&1 || true; done
    fi
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

# podman's own checkpoint of the same workload in its container $PID_ (left running), and its restore
# under another name (removed afterwards).
pm() {
    rm -f "$DIR/p.tar.zst"
    local t0
    settle
    t0=$(now)
    "${PODMANC[@]}" container checkpoint --leave-running --export "$DIR/p.tar.zst" "$PNAME" >/dev/null
    M_CK+=" $(ms "$t0" "$(now)")"
    settle
    t0=$(now)
    "${PODMANC[@]}" container restore --import "$DIR/p.tar.zst" --name "$PNAME-copy" >/dev/null
    M_RS+=" $(ms "$t0" "$(now)")"
    "${PODMANC[@]}" rm --force --time 0 "$PNAME-copy" >/dev/null
}

podman_setup() {
    mkdir -p "$PD/bin"
    printf '#!/bin/sh\nexec %q "$@"\n' "$CRIU" >"$PD/bin/criu"
    chmod 755 "$PD/bin/criu"
    tar -C "$B/rootfs" --exclude ./state -cf "$PD/rootfs.tar" .
    "${PODMANC[@]}" import "$PD/rootfs.tar" localhost/gpu-checkpoint-bench:1 >/dev/null 2>&1
    PNAME=bench-$$-podman
}

podman_start() {
    "${PODMANC[@]}" run --detach --name "$PNAME" --network none --ulimit nofile=1024:1024 \
        --ulimit nproc=4096:4096 localhost/gpu-checkpoint-bench:1 \
        workload memory --mib "$1" --verify-ms 0 --state /m >/dev/null
    until "${PODMANC[@]}" exec "$PNAME" /bin/busybox cat /m 2>/dev/null | grep -q 'phase=verifying'; do
        sleep 0.2
    done
}

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
    out=$("$GC" restore "$id" --container "$ID-ours" --storage "$DIR/store" --format json)
    t1=$(now)
    O_RS+=" $(ms "$t0" "$t1")"
    local fe rr
    read -r fe rr < <(python3 -c 'import json, sys
t = json.load(sys.stdin)["timings_ms"]
print(round(t["fetch"]), round(t["runtime_restore"]))' <<<"$out")
    O_FE+=" $fe"
    O_RR+=" $rr"
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

# gVisor: a checkpoint stops the sandbox; each side deletes it and restores it under the same id.
s_ours() {
    rm -rf "$DIR/sstore"
    local t0 t1 out id
    settle
    t0=$(now)
    out=$("$GC" checkpoint --container "$SID" --runtime runsc --runtime-root "$SROOT" \
        "${RUNSC_FLAGS[@]/#/--runtime-arg=}" --storage "$DIR/sstore" --format json)
    t1=$(now)
    SO_CK+=" $(ms "$t0" "$t1")"
    local rt wr st
    read -r id rt wr st < <(python3 -c 'import json, sys
v = json.load(sys.stdin); t = v["timings_ms"]
print(v["id"], round(t["runtime_checkpoint"]), round(t["write"]), round(t["stop"]))' <<<"$out")
    SO_RT+=" $rt"
    SO_WR+=" $wr"
    SO_ST+=" $st"
    settle
    t0=$(now)
    "$GC" restore "$id" --container "$SID" --runtime runsc --storage "$DIR/sstore" --format json >/dev/null
    SO_RS+=" $(ms "$t0" "$(now)")"
}

s_plain() {
    rm -rf "$DIR/simg"
    mkdir -p "$DIR/simg"
    local t0
    settle
    t0=$(now)
    "${RUNSCC[@]}" checkpoint --image-path "$DIR/simg" "$SID"
    SP_CK+=" $(ms "$t0" "$(now)")"
    # Ours deletes the stopped sandbox too (the id is free for the restore): timed apart.
    "${RUNSCC[@]}" delete --force "$SID" >/dev/null
    SP_CKD+=" $(ms "$t0" "$(now)")"
    settle
    t0=$(now)
    "${RUNSCC[@]}" restore --detach --image-path "$DIR/simg" --bundle "$B" "$SID" </dev/null >/dev/null 2>&1
    SP_RS+=" $(ms "$t0" "$(now)")"
}

runsc_rounds() {
    local mib=$1 r
    SO_CK= SO_RT= SO_WR= SO_ST= SO_RS= SP_CK= SP_CKD= SP_RS=
    SID=$ID-gvisor
    rm -f "$B/rootfs/state/m"
    "${RUNSCC[@]}" run --detach --bundle "$B" "$SID" </dev/null >/dev/null 2>&1
    until grep -q 'phase=verifying' "$B/rootfs/state/m" 2>/dev/null; do sleep 0.1; done
    for r in $(seq 1 "$ROUNDS"); do
        if [ $((r % 2)) = 1 ]; then s_plain; s_ours; else s_ours; s_plain; fi
    done
    "${RUNSCC[@]}" delete --force "$SID" >/dev/null
    local pck pckd prs ock ors
    pck=$(echo "$SP_CK" | median) pckd=$(echo "$SP_CKD" | median) prs=$(echo "$SP_RS" | median)
    ock=$(echo "$SO_CK" | median) ors=$(echo "$SO_RS" | median)
    printf '%-6s | gVisor checkpoint: runsc %5s (+delete %5s) | ours %5s = %-5s | restore: runsc %5s | ours %5s = %-5s\n' \
        "${mib}M" "$pck" "$pckd" "$ock" "$(ratio "$ock" "$pckd")" "$prs" "$ors" "$(ratio "$ors" "$prs")"
    echo "  ours' checkpoint = runsc's checkpoint with its image stored as written $(echo "$SO_RT" | median) + commit $(echo "$SO_WR" | median) + delete $(echo "$SO_ST" | median) (medians)"
    echo "  rounds (ms): runsc checkpoint$SP_CK; ours$SO_CK; runsc restore$SP_RS; ours$SO_RS"
}

echo "gpu-checkpoint --container vs plain runc ($(runc --version | head -1), CRIU $("$CRIU" --version | head -1)), $ROUNDS rounds per size, medians in ms"
echo "disk: $(df -h "$DIR" | awk 'NR == 2 { print $1 " (" $2 ")" }'), $(nproc) cores, load average $(cut -d' ' -f1-3 /proc/loadavg)"
if [ "${PODMAN:-1}" = 1 ]; then podman_setup; fi
printf '%-6s | %-55s | %-40s\n' "size" "checkpoint: runc (+fsync) | ours (dump->store + commit)" "restore: runc | ours (fetch + runc restore)"
for mib in "${SIZES[@]}"; do
    O_CK= O_RT= O_WR= O_RS= O_FE= O_RR= P_CK= P_CKS= P_RS= M_CK= M_RS=
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
    if [ "${PODMAN:-1}" = 1 ]; then podman_start "$mib"; fi
    for r in $(seq 1 "$ROUNDS"); do
        if [ $((r % 2)) = 1 ]; then
            plain; ours; if [ "${PODMAN:-1}" = 1 ]; then pm; fi
        else
            if [ "${PODMAN:-1}" = 1 ]; then pm; fi; ours; plain
        fi
    done
    gone "$ID"
    if [ "${PODMAN:-1}" = 1 ]; then "${PODMANC[@]}" rm --force --time 0 "$PNAME" >/dev/null; fi
    pck=$(echo "$P_CK" | median) pcks=$(echo "$P_CKS" | median) prs=$(echo "$P_RS" | median)
    ock=$(echo "$O_CK" | median) ort=$(echo "$O_RT" | median) owr=$(echo "$O_WR" | median)
    ors=$(echo "$O_RS" | median) ofe=$(echo "$O_FE" | median) orr=$(echo "$O_RR" | median)
    printf '%-6s | %5s (%5s) | %5s = %-5s (%5s + %5s)              | %5s | %5s = %-5s (%5s + %5s)\n' \
        "${mib}M" "$pck" "$pcks" "$ock" "$(ratio "$ock" "$pcks")" "$ort" "$owr" \
        "$prs" "$ors" "$(ratio "$ors" "$prs")" "$ofe" "$orr"
    echo "  rounds (ms): runc checkpoint+fsync$P_CKS; ours$O_CK; runc restore$P_RS; ours$O_RS"
    if [ "${PODMAN:-1}" = 1 ]; then
        mck=$(echo "$M_CK" | median) mrs=$(echo "$M_RS" | median)
        printf '%-6s | podman checkpoint --export %5s: ours %5s = %-5s | restore --import %5s: ours %5s = %-5s\n' \
            "${mib}M" "$mck" "$ock" "$(ratio "$ock" "$mck")" "$mrs" "$ors" "$(ratio "$ors" "$mrs")"
        echo "  rounds (ms): podman checkpoint$M_CK; podman restore$M_RS"
    fi
    if [ "${RUNSC:-1}" = 1 ]; then runsc_rounds "$mib"; fi
done
echo "ratios: ours / (runc checkpoint + fsync) (ours is durable when it returns), ours / runc restore;"
echo "  gVisor: ours / (runsc checkpoint + delete) (ours deletes the stopped sandbox), ours / runsc restore"
echo "load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
