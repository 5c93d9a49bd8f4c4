#!/usr/bin/env bash
# Runs every benchmark and prints its figures: each one measures ours and its baseline alternately in the same
# run and prints ratios. Installs what the baselines need (the zstd command) from the system's own packages.
# Root (CRIU). About 15 minutes on a 2-core machine; the figures and their commands are kept in docs/.
#   STORE_GIB=4   size of the store benchmark's image folder      CRIU_MIB="1024 4096"   sizes for bench-criu.sh
set -euo pipefail
cd "$(dirname "$0")/.."
[ "$(id -u)" = 0 ] || { echo "bench: needs root (CRIU)" >&2; exit 4; }
bash scripts/setup.sh
if ! command -v zstd >/dev/null; then
    apt-get update -qq && apt-get install -y -qq zstd
fi
echo "== detection latency (docs/detect.md)"
cargo bench -q -p gpu-checkpoint --bench detect
echo "== the store vs cp -r and tar | zstd -1 (docs/store.md)"
cargo run -q --release -p gpu-checkpoint --example store_bench -- --size-gib "${STORE_GIB:-4}" --rounds 3
echo "== checkpoint/restore vs plain CRIU (docs/criu.md)"
# shellcheck disable=SC2086
bash scripts/bench-criu.sh ${CRIU_MIB:-1024 4096}
echo "== restore at production size: time to resume, warm and cold, 1 and 2 cores (docs/criu.md)"
CORES="1 2" bash scripts/bench-restore.sh 2048
echo "== GPU freeze: parallel vs sequential, in-process vs a process per call (simulated GPU; docs/gpu.md)"
cargo test -q -p gpu-checkpoint-cli --test gpu_bench -- --ignored --nocapture
