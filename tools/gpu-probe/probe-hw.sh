#!/usr/bin/env bash
# First look at real hardware (run on the GPU machine from the repo root): builds the CUDA workloads, captures
# real /proc trees of CUDA processes for detect's fixtures, and drives the driver checkpoint API directly with
# per-call timings. Output goes to $OUT (log.txt, captures.tgz).
set -u
OUT=${OUT:-/tmp/probe-out}
mkdir -p "$OUT" /tmp/p
exec > >(tee "$OUT/log.txt") 2>&1
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
cap=/tmp/p/captures
mkdir -p $cap
run() { echo "+ $*"; "$@"; }

echo "== machine"; uname -r; nproc; free -g | head -2
run cat /proc/driver/nvidia/version
run nvidia-smi
nvidia-smi -q | grep -iE 'persistence mode|driver version|cuda version|product name|gpu uuid|mig mode' -A0
run ls -l /dev/nvidia* /dev/nvidia-caps 2>&1
echo "cuda-checkpoint: $(command -v cuda-checkpoint || echo not on PATH)"; ls /usr/local/nvidia/bin 2>&1 | head -30

echo "== build"
run nvcc -O2 -arch=sm_90 -o /tmp/p/wl "$here/cuda_workload.cu" || exit 1
run gcc -O2 -o /tmp/p/probe "$here/ckpt_probe.c" -ldl || exit 1

echo "== start workloads"
setsid -f /tmp/p/wl malloc 2048 /tmp/p/malloc.state
setsid -f /tmp/p/wl managed 256 /tmp/p/managed.state
setsid -f /tmp/p/wl host 64 /tmp/p/host.state
setsid -f /tmp/p/wl ipc-parent 256 /tmp/p/ipc.state
setsid -f python3 -c "
import torch, time
x = torch.randn(8192, 8192, device='cuda')
open('/tmp/p/torch.state','w').write('ready')
while True:
    x = (x @ x).clamp(-1, 1); torch.cuda.synchronize(); time.sleep(0.01)
"
setsid -f bash -c 'exec nvidia-smi -l 1 >/dev/null'
for i in $(seq 60); do [ -s /tmp/p/ipc.state.handle ] && break; sleep 0.5; done
setsid -f /tmp/p/wl ipc-child 256 /tmp/p/ipcc.state "$(cat /tmp/p/ipc.state.handle)"
for i in $(seq 60); do [ -s /tmp/p/malloc.state ] && [ -s /tmp/p/torch.state ] && [ -s /tmp/p/ipcc.state ] && break; sleep 0.5; done
sleep 3
pid_of() { pgrep -f "$1" | head -1; }
P_MALLOC=$(pid_of "wl malloc"); P_MANAGED=$(pid_of "wl managed"); P_HOST=$(pid_of "wl host")
P_IPC=$(pid_of "wl ipc-parent"); P_IPCC=$(pid_of "wl ipc-child"); P_TORCH=$(pid_of "import torch"); P_SMI=$(pid_of "nvidia-smi -l")
echo "pids malloc=$P_MALLOC managed=$P_MANAGED host=$P_HOST ipc=$P_IPC ipcc=$P_IPCC torch=$P_TORCH smi=$P_SMI"
for f in malloc managed host ipc ipcc torch; do echo "$f: $(cat /tmp/p/$f.state 2>/dev/null)"; done
run nvidia-smi --query-compute-apps=pid,used_memory,gpu_uuid --format=csv
ls -la /dev/shm

echo "== captures"
for n in MALLOC MANAGED HOST IPC IPCC TORCH SMI; do
  eval p=\$P_$n; [ -n "$p" ] || continue
  "$repo/scripts/capture-proc.sh" "$p" "$cap/$(echo $n | tr A-Z a-z)-$p"
done
cat /proc/$P_MALLOC/maps | grep -E 'nvidia|---p' | head -60

echo "== driver API on cudaMalloc workload (2 GiB)"
/tmp/p/probe "$P_MALLOC" state tid lock:10000 state checkpoint state
echo "-- while CHECKPOINTED:"; nvidia-smi --query-compute-apps=pid,used_memory --format=csv
grep -c nvidia /proc/$P_MALLOC/maps; ls -l /proc/$P_MALLOC/fd | grep -c nvidia
"$repo/scripts/capture-proc.sh" "$P_MALLOC" "$cap/malloc-checkpointed-$P_MALLOC"
grep -E 'nvidia' /proc/$P_MALLOC/maps | head; ls -l /proc/$P_MALLOC/fd | grep nvidia
/tmp/p/probe "$P_MALLOC" restore state unlock state
sleep 2; echo "malloc after: $(cat /tmp/p/malloc.state)"
echo "-- three more full cycles for timings"
for i in 1 2 3; do /tmp/p/probe "$P_MALLOC" lock:10000 checkpoint restore unlock | grep -- '->'; done
sleep 2; echo "malloc after cycles: $(cat /tmp/p/malloc.state)"
echo "-- illegal transitions"
/tmp/p/probe "$P_MALLOC" checkpoint unlock restore state
echo "-- lock with 1 ms timeout"
/tmp/p/probe "$P_MALLOC" lock:1 state unlock state

echo "== torch"
/tmp/p/probe "$P_TORCH" state lock:10000 checkpoint state restore unlock state
echo "== nvidia-smi (NVML only)"
/tmp/p/probe "$P_SMI" state lock:1000
echo "== pinned host"
/tmp/p/probe "$P_HOST" state lock:10000 checkpoint restore unlock state
echo "== ipc pair"
/tmp/p/probe "$P_IPC" state lock:5000 checkpoint state restore unlock state
/tmp/p/probe "$P_IPCC" state
echo "== managed (expected to fail; what state is left?)"
/tmp/p/probe "$P_MANAGED" state lock:5000 checkpoint state restore unlock state
sleep 1
for f in malloc managed host ipc ipcc; do echo "$f: $(cat /tmp/p/$f.state 2>/dev/null)"; done
if command -v cuda-checkpoint >/dev/null; then
  echo "== cuda-checkpoint CLI timings"
  for i in 1 2 3; do /usr/bin/time -f "get-state %e s" cuda-checkpoint --get-state --pid "$P_MALLOC"; done
fi
tar czf "$OUT/captures.tgz" -C "$cap" .
ls -la "$OUT"
