#!/usr/bin/env bash
# Validates gpu-checkpoint's cuda-driver backend on a real NVIDIA GPU (driver >= 570), and the full
# checkpoint -> kill -> restore flow with CRIU. Run as root from the repository root; its output is what
# docs/gpu-validation.md records.
#
#   BIN=target/release bash scripts/gpu-validate.sh      # where gpu-checkpoint and cuda-counter are
#   MIB=1024 ROUNDS=5 bash scripts/gpu-validate.sh
#
# Needs: the NVIDIA driver (libcuda.so.1, nvidia-smi), the binaries built (`cargo build --release`, or
# copied), and for the flow part a CRIU >= 4.0 (scripts/install-criu.sh's prefix via scripts/env.sh, or
# GPU_CHECKPOINT_CRIU). The CUDA program is crates/workloads/src/bin/cuda-counter.rs (no nvcc needed).
set -uo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-target/release}
[ -x "$BIN/gpu-checkpoint" ] || BIN=target/debug
G="$BIN/gpu-checkpoint"
COUNTER="$BIN/cuda-counter"
MIB=${MIB:-1024}
ROUNDS=${ROUNDS:-5}
WORK=${WORK:-/tmp/gpu-validate}
# shellcheck disable=SC1091
[ -f scripts/env.sh ] && . scripts/env.sh

step() { printf '\n=== %s\n' "$*"; }
run() { printf '$ %s\n' "$*"; "$@"; local rc=$?; [ $rc -ne 0 ] && printf '(exit %d)\n' $rc; return 0; }
apps() { nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader 2>&1 || true; }
wait_gone() { for _ in $(seq 200); do [ -e "/proc/$1" ] || return 0; sleep 0.05; done; echo "pid $1 still exists"; }

rm -rf "$WORK" && mkdir -p "$WORK"
step "machine"
run uname -r
run nvidia-smi --query-gpu=index,name,uuid,memory.total,driver_version,persistence_mode --format=csv
run "$G" --version

step "start the CUDA program ($MIB MiB of device memory)"
setsid -f "$COUNTER" --mib "$MIB" --check-every 20 --pidfile "$WORK/pid" >"$WORK/counter.log" 2>&1
for _ in $(seq 100); do [ -s "$WORK/pid" ] && grep -q verified=ok "$WORK/counter.log" && break; sleep 0.1; done
P=$(cat "$WORK/pid")
echo "pid $P"; tail -n 2 "$WORK/counter.log"
run apps

step "detect"
run "$G" detect --pid "$P"

step "cuda subcommands, cuda-driver backend (JSON: every driver call timed)"
for a in state "lock --timeout 10000" state checkpoint state; do
    # shellcheck disable=SC2086
    run "$G" cuda $a --pid "$P" --gpu-backend cuda-driver --format json
done
echo "--- while checkpointed, nvidia-smi compute apps (pid $P must be absent):"
apps
L1=$(grep -c verified=ok "$WORK/counter.log")
sleep 1
L2=$(grep -c verified=ok "$WORK/counter.log")
echo "--- verified lines while checkpointed: $L1 -> $L2 (must not grow)"
for a in restore state unlock state restore-tid; do
    run "$G" cuda "$a" --pid "$P" --gpu-backend cuda-driver --format json
done
sleep 1; tail -n 2 "$WORK/counter.log"

step "illegal transitions"
run "$G" cuda unlock --pid "$P" --gpu-backend cuda-driver
run "$G" cuda checkpoint --pid "$P" --gpu-backend cuda-driver
run "$G" cuda restore --pid "$P" --gpu-backend cuda-driver

step "toggle timings, $ROUNDS rounds (-v logs every call)"
for i in $(seq "$ROUNDS"); do
    "$G" -v cuda toggle --pid "$P" --gpu-backend cuda-driver 2>&1 | grep -E "lock|checkpoint|restore|unlock|opened"
    "$G" -v cuda toggle --pid "$P" --gpu-backend cuda-driver 2>&1 | grep -E "lock|checkpoint|restore|unlock|opened"
done
if command -v cuda-checkpoint >/dev/null; then
    step "NVIDIA's cuda-checkpoint for comparison"
    for i in $(seq 3); do /usr/bin/time -f "cuda-checkpoint --get-state: %e s" cuda-checkpoint --get-state --pid "$P"; done
    /usr/bin/time -f "gpu-checkpoint cuda state (new process each time): %e s" "$G" cuda state --pid "$P" --gpu-backend cuda-driver
fi
sleep 1; tail -n 2 "$WORK/counter.log"

if [ -x scripts/capture-proc.sh ] || [ -f scripts/capture-proc.sh ]; then
    step "capture /proc of the CUDA process as a detect fixture"
    run bash scripts/capture-proc.sh "$P" "$WORK/proc-capture" 2>&1 | tail -n 3
fi

step "full flow: checkpoint (stop) -> restore, cuda-driver backend, CRIU"
run "$G" doctor
run "$G" checkpoint --pid "$P" --storage "$WORK/store" --gpu-backend cuda-driver --format json
wait_gone "$P"
echo "--- after the checkpoint, nvidia-smi compute apps (pid $P must be absent):"
apps
ID=$("$G" list --storage "$WORK/store" --format json | sed -n 's/.*"id": "\([^"]*\)".*/\1/p' | head -n 1)
echo "checkpoint id: $ID"
run "$G" restore "$ID" --storage "$WORK/store" --gpu-backend cuda-driver --format json
sleep 3
echo "--- the restored program's log (verified=ok lines continue after the restore):"
tail -n 5 "$WORK/counter.log"
run apps

step "full flow with --leave-running"
run "$G" checkpoint --pid "$P" --storage "$WORK/store" --gpu-backend cuda-driver --leave-running --format json
sleep 2; tail -n 2 "$WORK/counter.log"

kill -9 "$P" 2>/dev/null
echo; echo "done"
