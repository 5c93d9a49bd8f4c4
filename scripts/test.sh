#!/usr/bin/env bash
# Sets up a fresh machine (CRIU prefix, build) and runs every test. `.ci/run` calls this and nothing else.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# shellcheck disable=SC1091
. scripts/env.sh
cargo fmt --all -- --check
cargo clippy --workspace --all-targets -- -D warnings
# Broken or private intra-doc links are documentation bugs too.
RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps --quiet
cargo test --workspace --no-fail-fast
