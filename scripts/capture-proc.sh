#!/usr/bin/env bash
# capture-proc.sh PID OUT
#
# Copies the /proc files that `gpu-checkpoint detect` reads, for PID and all its descendants, into OUT so
# that `gpu-checkpoint detect --pid PID --tree --proc-root OUT` reproduces the report on another machine.
# This is how users send us a report and how tests pin real layouts.
#
# What leaves the machine must hold no secrets: environment values are redacted except for names that start
# with CUDA_, NCCL_, NVIDIA_, HIP_, ROCR_ or GPU_ and do not look like a credential (KEY, TOKEN, SECRET,
# PASSWORD, ... in the name, or a URL with a user and password in the value); command-line arguments that
# carry a secret (`--password=X`, `--api-key X`, `https://user:pass@host`) are redacted the same way.
#
# OUT must not exist yet, or be an empty folder owned by the caller: root writing into a folder another
# user controls would follow the links they plant there. Files are created, never overwritten (noclobber).
set -euo pipefail
set -o noclobber

usage() { echo "usage: $0 PID OUT" >&2; exit 2; }
[ $# -eq 2 ] || usage
pid=$1 out=$2
case "$pid" in ''|*[!0-9]*) echo "error: PID must be a number, got '$pid'" >&2; exit 2;; esac
[ -d "/proc/$pid" ] || { echo "error: no process $pid" >&2; exit 3; }

if [ -e "$out" ] || [ -L "$out" ]; then
  if [ -L "$out" ] || [ ! -d "$out" ]; then
    echo "error: $out exists and is not a folder" >&2; exit 2
  fi
  if [ "$(stat -c %u "$out")" != "$(id -u)" ]; then
    echo "error: $out is owned by uid $(stat -c %u "$out"), not by you (uid $(id -u)); choose a folder of your own" >&2
    exit 2
  fi
  if [ -n "$(ls -A "$out")" ]; then
    echo "error: $out is not empty; capture into a new folder" >&2; exit 2
  fi
  chmod 0700 "$out"
else
  mkdir -m 0700 "$out"
fi

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

# NUL-separated records in (environ: NAME=VALUE; cmdline: arguments), the same out with secrets replaced.
redact() {
  python3 -c '
import re, sys
keep = ("CUDA_", "NCCL_", "NVIDIA_", "HIP_", "ROCR_", "GPU_")
secret_name = re.compile(rb"(KEY|TOKEN|SECRET|PASSW|PASSPHRASE|CREDENTIAL|AUTH|COOKIE|SESSION|PRIVATE|SIGNATURE)", re.I)
userinfo = re.compile(rb"://[^/@\s]*:[^/@\s]*@")
def secret_value(v):
    return bool(userinfo.search(v))
mode = sys.argv[1]
out = []
recs = sys.stdin.buffer.read().split(b"\0")
if recs and recs[-1] == b"":
    recs.pop()
hide_next = False
for rec in recs:
    if mode == "environ":
        name, sep, value = rec.partition(b"=")
        if sep and (not name.decode("utf-8", "replace").startswith(keep) or secret_name.search(name) or secret_value(value)):
            value = b"<redacted>"
        out.append(name + sep + value)
    else:
        if hide_next:
            out.append(b"<redacted>")
            hide_next = False
            continue
        flag, sep, value = rec.partition(b"=")
        if rec.startswith(b"-") and secret_name.search(flag):
            if sep:
                rec = flag + b"=<redacted>"
            else:
                hide_next = True
        elif secret_value(rec):
            rec = userinfo.sub(b"://<redacted>@", rec)
        out.append(rec)
sys.stdout.buffer.write(b"\0".join(out) + (b"\0" if out else b""))
' "$1"
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
  for f in status comm cgroup; do
    cat "$src/$f" > "$dst/$f" 2>/dev/null || true
  done
  cat "$src/cmdline" 2>/dev/null | redact cmdline > "$dst/cmdline" || true
  cat "$src/environ" 2>/dev/null | redact environ > "$dst/environ" || true
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
