#!/usr/bin/env bash
# Installs what gpu-checkpoint needs on a fresh machine, without touching the system's packages, and builds it.
# Idempotent: re-running it is fast.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --workspace --all-targets
