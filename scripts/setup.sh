#!/usr/bin/env bash
# Installs what gpu-checkpoint needs on a fresh machine, without touching the system's packages, and builds it.
# Idempotent: re-running it is fast.
set -euo pipefail
cd "$(dirname "$0")/.."
# CRIU >= 4.0 in the project's own prefix (.deps/criu), unless the user points us at their own
# (GPU_CHECKPOINT_CRIU); scripts/env.sh exports the result.
if [ -z "${GPU_CHECKPOINT_CRIU:-}" ]; then
    bash scripts/install-criu.sh >/dev/null
fi
cargo build --workspace --all-targets
