#!/usr/bin/env bash
# Builds what ships, the gpu-checkpoint binary and its CRIU plugin (libgpu_checkpoint_devices.so), with the
# release profile, and splits their debug information off into FILE.debug beside each: the files to ship
# are a fraction of the size, and the .debug files (kept, or shipped as a debug package) still give gdb and
# Rust's own backtraces their file:line (found through the GNU debuglink; without them a backtrace still
# names every function, from the symbol table that stays in).
#
# Usage: scripts/release.sh [OUT_DIR]   (default target/dist; rerunning replaces what is there)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-target/dist}
command -v objcopy >/dev/null || { echo "objcopy (binutils) is needed to split the debug information" >&2; exit 1; }
cargo build --release --locked -p gpu-checkpoint-cli -p gpu-checkpoint-criu-devices
mkdir -p "$out"
for f in gpu-checkpoint libgpu_checkpoint_devices.so; do
    rm -f "$out/$f" "$out/$f.debug"
    cp "target/release/$f" "$out/$f"
    objcopy --only-keep-debug "$out/$f" "$out/$f.debug"
    chmod 0644 "$out/$f.debug"
    # The debuglink names the .debug file by its base name and checksum; readers look beside the binary.
    (cd "$out" && objcopy --strip-debug --add-gnu-debuglink="$f.debug" "$f")
    printf '%-30s %10d bytes (built: %d; debug information: %d in %s.debug)\n' "$f" \
        "$(stat -c %s "$out/$f")" "$(stat -c %s "target/release/$f")" "$(stat -c %s "$out/$f.debug")" "$f"
done
