#!/usr/bin/env bash
# Real CRIU images for the store benchmark: dumps a Python process holding mixed memory (300k dicts, 200k
# strings, 4M floats, a 2M-double array, 128 MiB random, 128 MiB zeros, a 32 MiB random bytearray and its
# bytes copy at another offset in its page, 16 Mi 64-bit ints; about 740 MiB of images) with the project's
# CRIU, then changes a little of it (every 1000th dict, one string, one byte per 4 MiB of the zero buffer)
# and dumps it again.
#
# Usage (root): scripts/real-images.sh DIR     writes DIR/d1 and DIR/d2 (replaced if present)
# Then: cargo run --release -p gpu-checkpoint --example store_bench -- --src DIR/d1 --rounds 3
# (docs/store.md, "Latest figures"). Needs python3.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck disable=SC1091
. scripts/env.sh
[ "$(id -u)" = 0 ] || { echo "real-images: needs root (CRIU)" >&2; exit 4; }
[ $# -eq 1 ] || { echo "usage: scripts/real-images.sh DIR" >&2; exit 2; }
command -v python3 >/dev/null || { echo "real-images: needs python3" >&2; exit 5; }
CRIU=${GPU_CHECKPOINT_CRIU:?run scripts/setup.sh first}
DIR=$(mkdir -p "$1" && cd "$1" && pwd)
rm -rf "$DIR/d1" "$DIR/d2" "$DIR/ready" "$DIR/changed"
mkdir -m 0700 "$DIR/d1" "$DIR/d2"

cat > "$DIR/mem.py" <<'PY'
import array, os, random, signal, sys, time
out = sys.argv[1]
random.seed(1)
dicts = [{"id": i, "name": "user%d" % i, "score": i * 0.5} for i in range(300000)]
strings = ["s%08d-%s" % (i, "x" * (i % 50)) for i in range(200000)]
floats = [random.random() for _ in range(4000000)]
arr = array.array("d", (random.random() for _ in range(2000000)))
blob = os.urandom(128 << 20)
zeros = bytearray(128 << 20)
rnd = bytearray(os.urandom(32 << 20))
copy = bytes(rnd)
ints = array.array("q", range(16 << 20))
def change(*_):
    for i in range(0, len(dicts), 1000):
        dicts[i]["score"] += 1
    strings.append("new string")
    for i in range(0, len(zeros), 4 << 20):
        zeros[i] = 1
    open(out + "/changed", "w").write("1")
signal.signal(signal.SIGUSR1, change)
open(out + "/ready", "w").write(str(os.getpid()))
while True:
    time.sleep(1)
PY

# Re-parented (setsid -f), so that nothing of ours holds it, as CRIU wants for a dump.
setsid -f python3 "$DIR/mem.py" "$DIR" </dev/null >/dev/null 2>&1
for _ in $(seq 600); do [ -s "$DIR/ready" ] && break; sleep 0.2; done
PID=$(cat "$DIR/ready")
trap 'kill -9 "$PID" 2>/dev/null || true' EXIT
"$CRIU" dump -t "$PID" -D "$DIR/d1" --leave-running --shell-job -o dump.log
kill -USR1 "$PID"
for _ in $(seq 300); do [ -e "$DIR/changed" ] && break; sleep 0.2; done
"$CRIU" dump -t "$PID" -D "$DIR/d2" --leave-running --shell-job -o dump.log
echo "real-images: $(du -sh "$DIR/d1" | cut -f1) of images in $DIR/d1, and $DIR/d2 after a small change"
