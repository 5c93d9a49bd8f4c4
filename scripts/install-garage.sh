#!/usr/bin/env bash
# Builds garage (a production S3-compatible object store, from crates.io) once into a cache outside the
# clone, keyed by its version, for the long test lane and the benchmark that run the store against it
# (crates/gpu-checkpoint/tests/common/garage.rs starts it on 127.0.0.1 with a private data/meta folder and
# config).
#
# Usage: scripts/install-garage.sh
#   GPU_CHECKPOINT_CACHE   where built tools are kept (default: /var/cache/gpu-checkpoint, or
#                          ~/.cache/gpu-checkpoint when that cannot be written)
# Prints the binary's path on its last line. Idempotent: a second run only checks that the binary is there.
#
# Why 2.5.0: the newest release, and it builds with the project's rustc from its own Cargo.lock (--locked).
# Default features (lmdb for metadata): the combination garage itself ships. The build takes 8 minutes or
# more on 2 cores, once per machine, which is why only the long test lane (scripts/test.sh --long) and
# S3_SERVER=garage scripts/bench-s3.sh call this.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/lib/cargo-cached.sh
. scripts/lib/cargo-cached.sh
cargo_install_cached garage 2.5.0 --version
