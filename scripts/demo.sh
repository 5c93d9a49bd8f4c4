#!/usr/bin/env bash
# The main job in one command: set up (CRIU in the project's prefix, build), start a sample program that
# keeps evolving state in memory, checkpoint it into a store (which stops it), restore it, and show that
# it carried on from where it was. Run as root on a fresh machine:  bash scripts/demo.sh
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "$(id -u)" != 0 ]; then
    echo "demo: checkpoint and restore need root (CRIU); run: sudo bash scripts/demo.sh" >&2
    exit 4
fi

echo "== set-up (installs CRIU into .deps/criu on the first run, builds gpu-checkpoint)"
bash scripts/setup.sh
# shellcheck disable=SC1091
. scripts/env.sh
BIN=${CARGO_TARGET_DIR:-target}/debug
GC=$BIN/gpu-checkpoint

WORK=$(mktemp -d /tmp/gpu-checkpoint-demo.XXXXXX)
STORE=$WORK/store
STATE=$WORK/sample.state
PID=
cleanup() {
    [ -n "$PID" ] && kill -9 "$PID" 2>/dev/null || true
    rm -rf "$WORK"
}
trap cleanup EXIT

# One line of the sample's state file: pid=... seq=... value=... table_digest=...
state() { tr -s ' ' <"$STATE" | head -1; }
field() { state | tr ' ' '\n' | sed -n "s/^$1=//p"; }

echo
echo "== $("$GC" doctor | sed -n 's/^criu *//p' | head -1)"
echo
echo "== start the sample program (it advances a value chain and rewrites a 16 MiB table in memory, 10 steps/s)"
PID=$("$BIN/workload" sample --state "$STATE" --detach)
sleep 1.5
for _ in 1 2 3; do
    echo "   running:   $(state)"
    sleep 0.5
done

echo
echo "== checkpoint it into $STORE (the process is stopped once the checkpoint is durable)"
"$GC" checkpoint --pid "$PID" --storage "$STORE" --name demo
BEFORE=$(state)
SEQ_BEFORE=$(field seq)
sleep 1
if ps -o stat= -p "$PID" 2>/dev/null | grep -qv Z; then
    echo "demo: the process still runs after the checkpoint" >&2
    exit 1
fi
echo "   stopped:   $(state)   (no longer changing; pid $PID is gone)"

echo
echo "== the store"
"$GC" list --storage "$STORE"

echo
echo "== restore it"
NEW_PID=$("$GC" restore demo --storage "$STORE")
PID=$NEW_PID
sleep 1.5
for _ in 1 2 3; do
    echo "   restored:  $(state)"
    sleep 0.5
done
SEQ_AFTER=$(field seq)

echo
echo "before the checkpoint: $BEFORE"
echo "after the restore:     $(state)"
if [ "$SEQ_AFTER" -gt "$SEQ_BEFORE" ] && [ "$(field pid)" = "$NEW_PID" ]; then
    echo "OK: pid $NEW_PID carried on from step $SEQ_BEFORE (now step $SEQ_AFTER) with the memory it had at the checkpoint"
else
    echo "demo: the restored process did not continue (step $SEQ_BEFORE -> $SEQ_AFTER)" >&2
    exit 1
fi
