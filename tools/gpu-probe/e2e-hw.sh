#!/usr/bin/env bash
# gpu-checkpoint itself on real hardware (run on the GPU machine from the repo root). Carried: the release
# binary as .carry/bin/gpu-checkpoint and the project's CRIU prefix as .carry/criu. Output in $OUT.
#  1. detect on live CUDA processes (cudaMalloc, PyTorch, managed memory, NVML-only) and --all with NVML
#  2. `cuda` subcommands (cuda-driver backend) through the whole state machine, with per-call timings
#  3. checkpoint -> (killed) -> restore of cudaMalloc and PyTorch processes; device memory verified by the workload
#  4. a managed-memory process is refused before it is touched, and keeps running
#  5. --leave-running, then restore after the original exited
#  6. ours vs the plain baseline (driver API probe + criu dump/restore) on the same process, alternately
#  7. processes without a CUDA context (issue 28): an NVML-only process (nvml_workload.py: NVML polling,
#     libcuda initialised without a context) is `none`, checkpointed with its descriptors reopened and
#     restored, and its NVML calls after the restore are logged (unverified until this runs); nvidia-smi
#     (a page of /dev/nvidiactl mapped) is refused before it is touched (exit 9) and keeps running
#  8. a PyTorch process with a child forked without exec (fork_workload.py): the tree is checkpointed (the
#     parent's GPU state by the driver, the child's inherited /dev/nvidiaN mappings replaced by zeroed
#     shared memory through the devices plugin) and restored; the parent verifies its device memory, the
#     child counts on
set -u
OUT=${OUT:-/tmp/e2e-out}
mkdir -p "$OUT" /tmp/p
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
G=$repo/.carry/bin/gpu-checkpoint
export GPU_CHECKPOINT_CRIU=$repo/.carry/criu/bin/criu
CRIU=$GPU_CHECKPOINT_CRIU
S=/tmp/store
log() { echo "[$(date +%T.%N | cut -c1-12)] $*"; }
ms() { date +%s%3N; }
wait_gone() { for i in $(seq 200); do [ -d /proc/$1 ] || return 0; sleep 0.05; done; log "pid $1 still there"; }
st() { cat "$1" 2>/dev/null; }
log "gpu-checkpoint $($G --version)"; $G doctor 2>&1 | head -20
nvcc -O2 -arch=sm_90 -o /tmp/p/wl "$here/cuda_workload.cu" && gcc -O2 -o /tmp/p/probe "$here/ckpt_probe.c" -ldl || exit 1
start() { setsid -f "$@" </dev/null >/tmp/p/$(basename "$3").out 2>&1; }
start /tmp/p/wl malloc 1024 /tmp/p/a.state
start python3 "$here/torch_workload.py" /tmp/p/b.state 512
start /tmp/p/wl managed 256 /tmp/p/c.state
start /tmp/p/wl malloc 512 /tmp/p/d.state
start /tmp/p/wl malloc 1024 /tmp/p/e.state
setsid -f bash -c 'exec nvidia-smi -l 1' </dev/null >/dev/null 2>&1
for i in $(seq 120); do [ -s /tmp/p/a.state ] && [ -s /tmp/p/b.state ] && [ -s /tmp/p/c.state ] && [ -s /tmp/p/d.state ] && [ -s /tmp/p/e.state ] && break; sleep 0.5; done
A=$(pgrep -f "wl malloc 1024 /tmp/p/a" | head -1); B=$(pgrep -f torch_workload | head -1)
C=$(pgrep -f "wl managed" | head -1); D=$(pgrep -f "wl malloc 512" | head -1); E=$(pgrep -f "wl malloc 1024 /tmp/p/e" | head -1)
SMI=$(pgrep -f "nvidia-smi -l" | head -1)
log "pids A=$A B=$B C=$C D=$D E=$E SMI=$SMI"

log "== 1. detect"
for x in A B C SMI; do eval p=\$$x; $G detect --pid $p --format json > $OUT/detect-$x.json; echo "$x rc=$?"; $G detect --pid $p --verbose 2>&1 | head -30; done
t=$(ms); $G detect --all --format json > $OUT/detect-all.json; log "detect --all rc=$? $(( $(ms) - t )) ms"; $G detect --all 2>&1 | head -30

log "== 2. cuda subcommands on A"
for a in state lock state checkpoint state restore state unlock state; do $G cuda $a --pid $A --gpu-backend cuda-driver --format json 2>&1 | tr -d '\n '; echo; done
$G cuda checkpoint --pid $A --gpu-backend cuda-driver; echo "illegal checkpoint from RUNNING rc=$?"
$G cuda toggle --pid $A --gpu-backend cuda-driver; $G cuda state --pid $A --gpu-backend cuda-driver; $G cuda toggle --pid $A --gpu-backend cuda-driver; $G cuda state --pid $A --gpu-backend cuda-driver
sleep 1; log "A: $(st /tmp/p/a.state)"

log "== 3. checkpoint -> restore"
for x in A B; do
  eval p=\$$x; f=/tmp/p/$(echo $x | tr AB ab).state
  log "$x before: $(st $f)"
  t=$(ms); id=$($G checkpoint --pid $p --storage $S --name hw-$x -v 2>$OUT/ck-$x.err); rc=$?; log "$x checkpoint rc=$rc id=$id $(( $(ms) - t )) ms"; tail -5 $OUT/ck-$x.err
  wait_gone $p
  t=$(ms); np=$($G restore "$id" --storage $S -v 2>$OUT/rs-$x.err); rc=$?; log "$x restore rc=$rc pid=$np $(( $(ms) - t )) ms"; tail -5 $OUT/rs-$x.err
  sleep 4; log "$x after: $(st $f)"
done
nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader

log "== 4. managed memory refused"
$G checkpoint --pid $C --storage $S 2>&1 | head -12; echo "rc=${PIPESTATUS[0]}"
sleep 1; log "C alive: $([ -d /proc/$C ] && echo yes || echo NO) state: $(st /tmp/p/c.state)"; $G cuda state --pid $C --gpu-backend cuda-driver

log "== 5. --leave-running"
id=$($G checkpoint --pid $D --storage $S --leave-running 2>$OUT/ck-D.err); log "leave-running rc=$? id=$id"; tail -3 $OUT/ck-D.err
sleep 2; log "D still running: $(st /tmp/p/d.state)"
kill -9 $D; wait_gone $D
np=$($G restore "$id" --storage $S 2>$OUT/rs-D.err); log "D restore rc=$? pid=$np"; tail -3 $OUT/rs-D.err
sleep 4; log "D after: $(st /tmp/p/d.state)"

log "== 6. ours vs baseline on E (1 GiB device memory), alternately"
for round in 1 2; do
  t0=$(ms); id=$($G checkpoint --pid $E --storage $S 2>>$OUT/ck-E.err); t1=$(ms); wait_gone $E
  np=$($G restore "$id" --storage $S 2>>$OUT/rs-E.err); t2=$(ms); sleep 2
  log "ours round $round: checkpoint $(( t1 - t0 )) ms restore $(( t2 - t1 )) ms -> $(st /tmp/p/e.state)"
  img=/tmp/base-img; rm -rf $img; mkdir -p $img
  t0=$(ms); /tmp/p/probe $E lock:10000 checkpoint >/dev/null; $CRIU dump -t $E -D $img -o dump.log >/dev/null 2>&1; t1=$(ms); wait_gone $E
  $CRIU restore -D $img -d -o restore.log >/dev/null 2>&1; /tmp/p/probe $E restore unlock > /dev/null; t2=$(ms); sleep 2
  log "baseline round $round: checkpoint $(( t1 - t0 )) ms restore $(( t2 - t1 )) ms -> $(st /tmp/p/e.state) (raw images $(du -sh $img | cut -f1))"
done

log "== 7. without a CUDA context: NVML-only, nvidia-smi"
start python3 "$here/nvml_workload.py" /tmp/p/n.log
for i in $(seq 100); do [ -s /tmp/p/n.log ] && break; sleep 0.1; done
N=$(pgrep -f nvml_workload | head -1); log "N=$N $(tail -1 /tmp/p/n.log)"
$G detect --pid $N --verbose 2>&1 | head -30; $G detect --pid $N --format json > $OUT/detect-N.json
grep -E "nvidia|uvm" /proc/$N/maps > $OUT/maps-N.txt; ls -l /proc/$N/fd > $OUT/fds-N.txt
id=$($G checkpoint --pid $N --storage $S --format json 2>$OUT/ck-N.err | tee $OUT/ck-N.json | python3 -c 'import json,sys; print(json.load(sys.stdin)["id"])'); log "N checkpoint id=$id"; tail -5 $OUT/ck-N.err
wait_gone $N; before=$(wc -l < /tmp/p/n.log)
np=$($G restore "$id" --storage $S 2>$OUT/rs-N.err); log "N restore rc=$? pid=$np"; tail -5 $OUT/rs-N.err
sleep 3; log "N after the restore (NVML inside a restored process): $(tail -n +$((before + 1)) /tmp/p/n.log | awk '{print $3, ($3 == "error" ? $4 : "")}' | sort | uniq -c | tr '\n' ';')"
ls -l /proc/$np/fd > $OUT/fds-N-restored.txt 2>&1; kill -9 $np 2>/dev/null
$G checkpoint --pid $SMI --storage $S 2>&1 | head -8; echo "nvidia-smi checkpoint rc=${PIPESTATUS[0]} (9: refused before it was touched)"
sleep 1; log "nvidia-smi alive: $([ -d /proc/$SMI ] && echo yes || echo NO)"

log "== 8. a child forked without exec from a CUDA process"
start python3 "$here/fork_workload.py" /tmp/p/f.state 256
for i in $(seq 120); do [ -s /tmp/p/f.state ] && [ -s /tmp/p/f.state.childpid ] && break; sleep 0.5; done
F=$(pgrep -f fork_workload | head -1); FC=$(cat /tmp/p/f.state.childpid); log "F=$F child=$FC $(st /tmp/p/f.state)"
grep -E "nvidia" /proc/$FC/maps > $OUT/maps-F-child.txt; cat $OUT/maps-F-child.txt
$G detect --pid $F --tree 2>&1 | head -20; $G detect --pid $F --tree --format json > $OUT/detect-F.json
t=$(ms); id=$($G checkpoint --pid $F --storage $S -v 2>$OUT/ck-F.err); rc=$?; log "F checkpoint rc=$rc id=$id $(( $(ms) - t )) ms"; tail -5 $OUT/ck-F.err
wait_gone $F; wait_gone $FC; before=$(wc -l < /tmp/p/f.state.child)
np=$($G restore "$id" --storage $S -v 2>$OUT/rs-F.err); log "F restore rc=$? pid=$np"; tail -5 $OUT/rs-F.err
sleep 4; log "F after: $(st /tmp/p/f.state); child after: $(tail -1 /tmp/p/f.state.child) (was line $before)"
grep -E "^200600000-| /dev/zero" /proc/$FC/maps | head -3 > $OUT/maps-F-child-restored.txt; cat $OUT/maps-F-child-restored.txt

$G list --storage $S; du -sh $S
$G inspect hw-A --storage $S --format json > $OUT/inspect-A.json
