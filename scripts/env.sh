# Sourced by the scripts: points gpu-checkpoint and the tests at the project's own tools.
_gc_repo=$(cd "$(dirname "${BASH_SOURCE[0]:-$0}")/.." && pwd)
# CRIU: the user's own choice wins; otherwise the prefix scripts/install-criu.sh fills.
if [ -z "${GPU_CHECKPOINT_CRIU:-}" ] && [ -x "$_gc_repo/.deps/criu/bin/criu" ]; then
    export GPU_CHECKPOINT_CRIU="$_gc_repo/.deps/criu/bin/criu"
fi
unset _gc_repo
