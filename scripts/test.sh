#!/usr/bin/env bash
# Sets up a fresh machine (CRIU prefix, build) and runs every test. `.ci/run` calls this and nothing else.
#
# Usage: scripts/test.sh [--long]
#   --long   the longer lane (not CI's): also builds garage (scripts/install-garage.sh, 8 minutes or more,
#            once per machine) and installs moto's server (scripts/install-moto.sh, pip into a virtual
#            environment), and runs the store's object-storage tests against them too
#            (GPU_CHECKPOINT_LONG_TESTS=1; without it those tests are skipped, with it a missing server fails)
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
"") ;;
--long) LONG=1 ;;
*) echo "usage: scripts/test.sh [--long]" >&2; exit 2 ;;
esac
bash scripts/setup.sh
if [ -n "${LONG:-}" ]; then
    bash scripts/install-garage.sh >/dev/null
    bash scripts/install-moto.sh >/dev/null
    export GPU_CHECKPOINT_LONG_TESTS=1
fi
# shellcheck disable=SC1091
. scripts/env.sh
cargo fmt --all -- --check
cargo clippy --workspace --all-targets -- -D warnings
# Broken or private intra-doc links are documentation bugs too.
RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps --quiet
cargo test --workspace --no-fail-fast
