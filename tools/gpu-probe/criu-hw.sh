#!/usr/bin/env bash
# Hardware check of the whole idea with NVIDIA's API and plain CRIU, before gpu-checkpoint drives it:
# lock -> GPU checkpoint -> criu dump (process killed) -> criu restore -> GPU restore -> unlock, then check that
# the workload's device memory is intact and it goes on. Needs CRIU (CRIU=path). Output in $OUT.
set -u
OUT=${OUT:-/tmp/criu-hw-out}
CRIU=${CRIU:?set CRIU to the criu wrapper}
mkdir -p "$OUT" /tmp/p
here=$(cd "$(dirname "$0")" && pwd)
log() { echo "[$(date +%T.%N | cut -c1-12)] $*"; }
ms() { date +%s%3N; }
log "criu: $($CRIU --version | head -1)"; $CRIU check 2>&1 | tail -2
nvcc -O2 -arch=sm_90 -o /tmp/p/wl "$here/cuda_workload.cu" && gcc -O2 -o /tmp/p/probe "$here/ckpt_probe.c" -ldl || exit 1

cycle() { # NAME PID STATEFILE
  local name=$1 P=$2 st=$3 img=/tmp/img-$1 t
  rm -rf "$img"; mkdir -p "$img"
  log "$name pid $P before: $(cat $st)"
  /tmp/p/probe "$P" lock:10000 checkpoint state | grep -- '->'
  t=$(ms); timeout 300 $CRIU dump -t "$P" -D "$img" -v4 -o dump.log; log "$name criu dump rc=$? $(( $(ms) - t )) ms, images $(du -sh $img | cut -f1)"
  grep -E 'Error|Warn' "$img/dump.log" | head -5
  for i in $(seq 100); do [ -d /proc/$P ] || break; sleep 0.1; done
  log "$name pid gone: $([ -d /proc/$P ] && echo NO || echo yes)"
  t=$(ms); timeout 300 $CRIU restore -D "$img" -d -v4 -o restore.log; log "$name criu restore rc=$? $(( $(ms) - t )) ms"
  grep -E 'Error' "$img/restore.log" | head -5
  /tmp/p/probe "$P" state restore unlock state | grep -- '->'
  sleep 4
  log "$name after: $(cat $st)"
  nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader
  cp "$img/dump.log" "$OUT/$name-dump.log"; cp "$img/restore.log" "$OUT/$name-restore.log"
}

setsid -f /tmp/p/wl malloc 1024 /tmp/p/m.state </dev/null >/tmp/p/m.out 2>&1
setsid -f python3 "$here/torch_workload.py" /tmp/p/t.state 512 </dev/null >/tmp/p/t.out 2>&1
for i in $(seq 120); do [ -s /tmp/p/m.state ] && [ -s /tmp/p/t.state ] && break; sleep 0.5; done
PM=$(pgrep -f "wl malloc" | head -1); PT=$(pgrep -f torch_workload | head -1)
cycle cudamalloc "$PM" /tmp/p/m.state
cycle torch "$PT" /tmp/p/t.state
cat /tmp/p/m.out /tmp/p/t.out | tail -5
