#!/usr/bin/env bash
# capture-proc.sh PID OUT
#
# Copies the /proc files that `gpu-checkpoint detect` reads, for PID and all its descendants, into OUT so
# that `gpu-checkpoint detect --pid PID --tree --proc-root OUT` reproduces the report on another machine.
# This is how users send us a report and how tests pin real layouts.
#
# Environment values are redacted except for names that start with CUDA_, NCCL_, NVIDIA_, HIP_, ROCR_ or
# GPU_: the rest of a process's environment can hold secrets.
set -euo pipefail

usage() { echo "usage: $0 PID OUT" >&2; exit 2; }
[ $# -eq 2 ] || usage
pid=$1 out=$2
case "$pid" in ''|*[!0-9]*) echo "error: PID must be a number, got '$pid'" >&2; exit 2;; esac
[ -d "/proc/$pid" ] || { echo "error: no process $pid" >&2; exit 3; }

mkdir -p "$out"
chmod 0700 "$out"

# Descendants, breadth first, through the children lists of every thread.
pids=("$pid")
i=0
while [ $i -lt ${#pids[@]} ]; do
  p=${pids[$i]}
  for c in /proc/"$p"/task/*/children; do
    [ -r "$c" ] || continue
    for k in $(cat "$c" 2>/dev/null); do pids+=("$k"); done
  done
  i=$((i + 1))
done

redact_environ() {
  # NUL-separated NAME=VALUE records in, the same out with most values replaced.
  python3 -c '
import sys
keep = ("CUDA_", "NCCL_", "NVIDIA_", "HIP_", "ROCR_", "GPU_")
data = sys.stdin.buffer.read()
out = []
for rec in data.split(b"\0"):
    if not rec:
        continue
    name, sep, value = rec.partition(b"=")
    if sep and not name.decode("utf-8", "replace").startswith(keep):
        value = b"<redacted>"
    out.append(name + sep + value)
sys.stdout.buffer.write(b"\0".join(out) + (b"\0" if out else b""))
'
}

captured=0
for p in "${pids[@]}"; do
  src=/proc/$p
  dst=$out/$p
  [ -d "$src" ] || continue # exited meanwhile
  mkdir -p "$dst/fd" "$dst/task"
  # maps and stat are what detection cannot do without: an unreadable one must not become an empty file
  # that reads as "no GPU state".
  for f in maps stat; do
    if ! cat "$src/$f" > "$dst/$f" 2>/dev/null; then
      [ -d "$src" ] || { rm -rf "$dst"; continue 2; } # exited meanwhile
      echo "error: cannot read $src/$f (run as root or as the process's owner)" >&2
      exit 4
    fi
  done
  for f in status cmdline comm cgroup; do
    cat "$src/$f" > "$dst/$f" 2>/dev/null || true
  done
  cat "$src/environ" 2>/dev/null | redact_environ > "$dst/environ" || true
  for fd in "$src"/fd/*; do
    [ -e "$fd" ] || [ -L "$fd" ] || continue
    target=$(readlink "$fd" 2>/dev/null) || continue
    ln -sfn "$target" "$dst/fd/$(basename "$fd")"
  done
  for t in "$src"/task/*; do
    tid=$(basename "$t")
    mkdir -p "$dst/task/$tid"
    cat "$t/comm" > "$dst/task/$tid/comm" 2>/dev/null || true
    cat "$t/children" > "$dst/task/$tid/children" 2>/dev/null || true
  done
  captured=$((captured + 1))
done

mkdir -p "$out/net" "$out/driver/nvidia"
cat /proc/net/unix > "$out/net/unix" 2>/dev/null || true
if [ -r /proc/driver/nvidia/version ]; then
  cat /proc/driver/nvidia/version > "$out/driver/nvidia/version"
else
  rmdir "$out/driver/nvidia" "$out/driver" 2>/dev/null || true
fi
echo "captured $captured process(es) under $out"
