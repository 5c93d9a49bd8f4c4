#!/usr/bin/env bash
# Before/after benchmark of a change that must not move the figures (a refactor): runs scripts/bench.sh of
# an older revision and of the working tree alternately, ROUNDS times each, on the same machine in the same
# run (timings drift on shared VMs, so only figures taken side by side compare). Each bench.sh already
# prints ours against its own baseline as ratios; compare the ratios of the two trees, not raw times.
#
# Usage (root): scripts/bench-compare.sh OLD_REV [LOG_DIR]
#   ROUNDS=2             alternations (old, new, old, new for 2)
#   STORE_GIB, CRIU_MIB  passed on to bench.sh (defaults here: 1 and "1024" to keep a run near 20 minutes)
# The old revision is checked out as a git worktree under target/bench-compare/old (its own target folder,
# release builds), kept for the next run at the same revision (`git worktree remove --force
# target/bench-compare/old` drops it). Logs: LOG_DIR/{old,new}-N.log (default target/bench-compare/logs).
set -euo pipefail
cd "$(dirname "$0")/.."
[ "$(id -u)" = 0 ] || { echo "bench-compare: needs root (CRIU)" >&2; exit 4; }
OLD_REV=${1:?usage: scripts/bench-compare.sh OLD_REV [LOG_DIR]}
ROOT=$(pwd)
BASE=$ROOT/target/bench-compare
LOGS=${2:-$BASE/logs}
OLD=$BASE/old
mkdir -p "$BASE" "$LOGS"
if [ "$(git -C "$OLD" rev-parse HEAD 2>/dev/null)" != "$(git rev-parse "$OLD_REV^{commit}")" ]; then
    git worktree remove --force "$OLD" 2>/dev/null || rm -rf "$OLD"
    git worktree prune
    git worktree add --detach "$OLD" "$OLD_REV" >/dev/null
fi
# Both trees use the project's CRIU; the old one needs no install of its own.
[ -d "$ROOT/.deps" ] && ln -sfn "$ROOT/.deps" "$OLD/.deps"
export STORE_GIB=${STORE_GIB:-1} CRIU_MIB=${CRIU_MIB:-1024}
for round in $(seq 1 "${ROUNDS:-2}"); do
    for side in old new; do
        dir=$ROOT
        [ "$side" = old ] && dir=$OLD
        echo "== round $round: $side ($(git -C "$dir" rev-parse --short HEAD)$([ "$side" = new ] && ! git diff --quiet && echo ' + uncommitted'))"
        (cd "$dir" && bash scripts/bench.sh) 2>&1 | tee "$LOGS/$side-$round.log" | grep -E 'x$|x \(|x /|ratio|==|per process|--all|faster|ms vs' || true
    done
done
echo "logs: $LOGS"
