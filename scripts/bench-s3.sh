#!/usr/bin/env bash
# Benchmark: the store on S3 (s3s-fs or garage on 127.0.0.1, started here with a private data folder) against the
# standard way, `criu dump` into a folder followed by `aws s3 cp --recursive` of that folder, and against
# the local store; an idle process holding N MiB of incompressible memory. Checkpoints stop the process
# and restores bring it back, so every contender starts from the same state; the order rotates every
# round (shared machines drift) and the figures are medians. Restores: ours streams from the bucket into
# the process; the standard way downloads the folder (`aws s3 cp --recursive`) and runs `criu restore -d`.
# Last, the bytes an unchanged re-checkpoint stores: new chunks + manifest, of the image's bytes. Peak
# memory: the largest resident set (GNU time's %M: gpu-checkpoint, or the CRIU it ran where that was
# larger) of our checkpoints and restores, against the budget max(64 MiB, 1% of RAM) and the one the store
# plans with, max(64 MiB, 1% of the checkpoint). And restores from S3
# through a warm local read-through cache (`restore --cache-dir`) against restores without one.
#
# Usage (root): scripts/bench-s3.sh [MIB]        default: 256
#   ROUNDS=3            rounds
#   BENCH_DIR=DIR       images, local store and the server's data (default: target/bench-s3)
#   S3_SERVER=s3s-fs    the server: s3s-fs (scripts/install-s3s.sh) or garage (scripts/install-garage.sh,
#                       called here: 8 minutes or more to build, once per machine), one node on loopback
# Builds gpu-checkpoint in release mode; needs CRIU (scripts/setup.sh), the server, the AWS CLI
# (scripts/install-awscli.sh, called here: the benchmark alone needs it) and GNU time (installed here too).
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/lib/bench.sh
. scripts/lib/bench.sh
bench_start "CRIU" bench-s3 ""
scripts/install-awscli.sh >/dev/null
# shellcheck source=scripts/lib/apt-missing.sh
. scripts/lib/apt-missing.sh
# `time` alone is the shell's keyword: the program is asked for by its path.
apt_install_missing /usr/bin/time:time
S3_SERVER=${S3_SERVER:-s3s-fs}
MIB=${1:-256}
mkdir -p "$DIR/data"
chmod 700 "$DIR"

free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
hex() { od -An -tx1 -N"$1" /dev/urandom | tr -d ' \n'; }
PORT=$(free_port)
export AWS_ENDPOINT_URL=http://127.0.0.1:$PORT AWS_REGION=us-east-1
# Test credentials of this private server only.
case $S3_SERVER in
s3s-fs)
    S3S=${GPU_CHECKPOINT_S3S_FS:-${GPU_CHECKPOINT_CACHE:-/var/cache/gpu-checkpoint}/s3s-fs-0.14.1/bin/s3s-fs}
    [ -x "$S3S" ] || { echo "bench: s3s-fs missing: run scripts/install-s3s.sh" >&2; exit 5; }
    SERVER_NAME="s3s-fs 0.14.1"
    export AWS_ACCESS_KEY_ID=gpu-checkpoint-bench AWS_SECRET_ACCESS_KEY=gpu-checkpoint-bench-secret
    mkdir "$DIR/data/bench"
    "$S3S" --host 127.0.0.1 --port "$PORT" --access-key "$AWS_ACCESS_KEY_ID" --secret-key "$AWS_SECRET_ACCESS_KEY" \
        "$DIR/data" >/dev/null 2>&1 &
    ;;
garage)
    GARAGE=${GPU_CHECKPOINT_GARAGE:-$(scripts/install-garage.sh | tail -1)}
    SERVER_NAME="garage $("$GARAGE" --version 2>/dev/null | grep -o '[0-9][0-9.]*' | head -1) (one node, lmdb)"
    # Garage's key format: GK + 12 bytes in hex, a secret of 32 bytes in hex; the bucket and the key are
    # made by --single-node --default-bucket.
    AWS_ACCESS_KEY_ID=GK$(hex 12) AWS_SECRET_ACCESS_KEY=$(hex 32)
    export AWS_ACCESS_KEY_ID AWS_SECRET_ACCESS_KEY
    RPC=$(free_port)
    (umask 077 && cat >"$DIR/garage.toml" <<CONF
metadata_dir = "$DIR/data/meta"
data_dir = "$DIR/data/blocks"
db_engine = "lmdb"
replication_factor = 1
rpc_bind_addr = "127.0.0.1:$RPC"
rpc_public_addr = "127.0.0.1:$RPC"
rpc_secret = "$(hex 32)"
[s3_api]
s3_region = "$AWS_REGION"
api_bind_addr = "127.0.0.1:$PORT"
CONF
    )
    GARAGE_DEFAULT_ACCESS_KEY=$AWS_ACCESS_KEY_ID GARAGE_DEFAULT_SECRET_KEY=$AWS_SECRET_ACCESS_KEY \
        GARAGE_DEFAULT_BUCKET=bench RUST_LOG=garage=warn \
        "$GARAGE" -c "$DIR/garage.toml" server --single-node --default-bucket >"$DIR/garage.log" 2>&1 &
    ;;
*) echo "bench: S3_SERVER must be s3s-fs or garage" >&2; exit 2 ;;
esac
SERVER=$!
PID=
# The server is waited for before its data goes (its status, 143 when killed, is not the script's: set -e).
trap 'rc=$?; [ -n "$PID" ] && kill -9 "$PID" 2>/dev/null; kill "$SERVER" 2>/dev/null; wait "$SERVER" 2>/dev/null || true; rm -rf "$DIR"; exit $rc' EXIT
until (: <"/dev/tcp/127.0.0.1/$PORT") 2>/dev/null; do
    kill -0 "$SERVER" 2>/dev/null || { echo "bench: $S3_SERVER did not start" >&2; cat "$DIR"/*.log >&2 2>/dev/null; exit 5; }
    sleep 0.05
done
AWS=(aws --endpoint-url "$AWS_ENDPOINT_URL" --only-show-errors)

field() { grep -o "\"$1\": *[^,}]*" | head -1 | sed 's/.*: *//; s/"//g'; }

# Runs "$@" under GNU time; the peak resident set in KiB goes to $DIR/rss.
rss() { /usr/bin/time -f %M -o "$DIR/rss" "$@"; }
kib_to_mib() { awk -v k="$(cat "$DIR/rss")" 'BEGIN { printf "%.0f", k / 1024 }'; }

# Ours into $1 (a fresh prefix or folder: no dedup against earlier rounds); appends to ${2}_CK / ${2}_RS,
# and the peaks in MiB to ${2}_CKM / ${2}_RSM.
ours() {
    local store=$1 tag=$2 t0 t1 id
    settle
    t0=$(now)
    id=$(rss "$GC" checkpoint --pid "$PID" --storage "$store" --format json | field id)
    t1=$(now)
    eval "${tag}_CK+=\" $(ms "$t0" "$t1")\" ${tag}_CKM+=\" $(kib_to_mib)\""
    wait_free "$PID"
    settle
    t0=$(now)
    rss "$GC" restore "$id" --storage "$store" >/dev/null
    t1=$(now)
    eval "${tag}_RS+=\" $(ms "$t0" "$t1")\" ${tag}_RSM+=\" $(kib_to_mib)\""
}

# `criu dump` into a folder, then `aws s3 cp --recursive` of it; back: download, `criu restore -d`.
standard() {
    local key=$1 t0 t1
    rm -rf "$DIR/img" "$DIR/down"
    mkdir "$DIR/img" "$DIR/down"
    settle
    t0=$(now)
    "$CRIU" dump -t "$PID" -D "$DIR/img" -o dump.log
    "${AWS[@]}" s3 cp --recursive "$DIR/img" "s3://bench/$key/"
    t1=$(now)
    A_CK+=" $(ms "$t0" "$t1")"
    wait_free "$PID"
    settle
    t0=$(now)
    "${AWS[@]}" s3 cp --recursive "s3://bench/$key/" "$DIR/down"
    "$CRIU" restore -d -D "$DIR/down" -o restore.log
    t1=$(now)
    A_RS+=" $(ms "$t0" "$t1")"
}

S_CK= S_RS= L_CK= L_RS= A_CK= A_RS= S_CKM= S_RSM= L_CKM= L_RSM=
PID=$("$BIN/workload" memory --mib "$MIB" --verify-ms 0 --state "$DIR/state" --detach)
until grep -q 'phase=verifying' "$DIR/state" 2>/dev/null; do sleep 0.1; done
for r in $(seq 1 "$ROUNDS"); do
    case $((r % 3)) in
        1) standard "criu-$r"; ours "s3://bench/ours-$r" S; ours "$DIR/store-$r" L ;;
        2) ours "s3://bench/ours-$r" S; ours "$DIR/store-$r" L; standard "criu-$r" ;;
        0) ours "$DIR/store-$r" L; standard "criu-$r"; ours "s3://bench/ours-$r" S ;;
    esac
    rm -rf "$DIR/store-$r"
done
# Restores from S3 through a warm local read-through cache (--cache-dir: the chunks come from the node's
# disk, no request) against restores without it, alternated; the first restore (untimed) fills the cache.
timed_restore() {
    local t0 t1
    kill -9 "$PID"
    wait_free "$PID"
    settle
    t0=$(now)
    "$GC" restore "$CID" --storage s3://bench/cached "$@" >/dev/null
    t1=$(now)
    ms "$t0" "$t1"
}
CID=$("$GC" checkpoint --pid "$PID" --storage s3://bench/cached --format json | field id)
wait_free "$PID"
"$GC" restore "$CID" --storage s3://bench/cached --cache-dir "$DIR/cache" >/dev/null
C_RS= N_RS=
for r in $(seq 1 "$ROUNDS"); do
    if [ $((r % 2)) = 1 ]; then
        C_RS+=" $(timed_restore --cache-dir "$DIR/cache")" N_RS+=" $(timed_restore)"
    else
        N_RS+=" $(timed_restore)" C_RS+=" $(timed_restore --cache-dir "$DIR/cache")"
    fi
done
# An unchanged re-checkpoint: what it stores (sends) of the image.
"$GC" checkpoint --pid "$PID" --storage s3://bench/again --leave-running --format json >/dev/null
again=$("$GC" checkpoint --pid "$PID" --storage s3://bench/again --leave-running --format json)
logical=$(echo "$again" | field logical_bytes) new=$(echo "$again" | field new_bytes) man=$(echo "$again" | field manifest_bytes)
kill -9 "$PID"
PID=

sck=$(echo "$S_CK" | median) srs=$(echo "$S_RS" | median) lck=$(echo "$L_CK" | median) lrs=$(echo "$L_RS" | median)
ack=$(echo "$A_CK" | median) ars=$(echo "$A_RS" | median)
echo "S3 benchmark: ${MIB} MiB of random memory, $ROUNDS rounds (medians in ms), $SERVER_NAME on 127.0.0.1, $("${AWS[@]}" --version 2>&1 | cut -d' ' -f1), $(nproc) cores"
echo "load average: $(cut -d' ' -f1-3 /proc/loadavg) (after)"
printf '%-34s %8s %8s\n' "" checkpoint restore
printf '%-34s %8s %8s\n' "criu dump + aws s3 cp (baseline)" "$ack" "$ars"
printf '%-34s %8s %8s   ratio %s / %s\n' "gpu-checkpoint -> S3" "$sck" "$srs" "$(ratio "$sck" "$ack")" "$(ratio "$srs" "$ars")"
printf '%-34s %8s %8s   ratio %s / %s\n' "gpu-checkpoint -> local store" "$lck" "$lrs" "$(ratio "$lck" "$ack")" "$(ratio "$lrs" "$ars")"
awk -v n="$new" -v m="$man" -v l="$logical" 'BEGIN { printf "unchanged re-checkpoint: %d new + %d manifest bytes of %d (%.2f%%)\n", n, m, l, 100 * (n + m) / l }'
echo "rounds (ms): S3 ck$S_CK rs$S_RS | local ck$L_CK rs$L_RS | criu+aws ck$A_CK rs$A_RS"
crs=$(echo "$C_RS" | median) nrs=$(echo "$N_RS" | median)
echo "restore from S3 through a warm --cache-dir: $crs ms, without: $nrs ms (ratio $(ratio "$crs" "$nrs")); rounds: cache$C_RS | none$N_RS"
most() { tr ' ' '\n' | grep -v '^$' | sort -n | tail -1; }
# The store plans its buffers with max(64 MiB, 1% of the checkpoint's bytes) (`memory_budget`), the
# issue's target is max(64 MiB, 1% of RAM): both printed.
budget=$(awk '/^MemTotal:/ { m = $2 / 1024 / 100; printf "%.0f", (m > 64 ? m : 64) }' /proc/meminfo)
plan=$((MIB / 100 > 64 ? MIB / 100 : 64))
echo "peak RSS (MiB, the largest of the rounds; gpu-checkpoint or its CRIU): S3 checkpoint $(echo "$S_CKM" | most)," \
    "restore $(echo "$S_RSM" | most); local checkpoint $(echo "$L_CKM" | most), restore $(echo "$L_RSM" | most);" \
    "budget max(64 MiB, 1% of RAM) = $budget MiB; the store plans with max(64 MiB, 1% of the checkpoint) = $plan MiB"
echo "peak RSS rounds (MiB): S3 ck$S_CKM rs$S_RSM | local ck$L_CKM rs$L_RSM"
