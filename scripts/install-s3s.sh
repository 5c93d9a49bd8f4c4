#!/usr/bin/env bash
# Builds s3s-fs (an S3-compatible server that keeps objects in a folder, from crates.io) once into a cache
# outside the clone, keyed by its version, for the tests that run the store against a real S3 server
# (crates/gpu-checkpoint/tests/common/s3.rs starts it on 127.0.0.1 with a private data folder).
#
# Usage: scripts/install-s3s.sh
#   GPU_CHECKPOINT_CACHE   where built tools are kept (default: /var/cache/gpu-checkpoint, or
#                          ~/.cache/gpu-checkpoint when that cannot be written)
# Prints the binary's path on its last line. Idempotent: a second run only checks that the binary is there.
#
# Why 0.14.1: the newest release that builds with the project's rustc (later ones need a newer one); the
# build takes about 3 minutes on 2 cores, once per machine.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/lib/cargo-cached.sh
. scripts/lib/cargo-cached.sh
cargo_install_cached s3s-fs 0.14.1 --help --features binary
