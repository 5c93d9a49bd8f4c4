#!/usr/bin/env bash
# What the cluster flow (`gpu-checkpoint agent`, `gpu-checkpoint job`) and its tests need, from the
# distribution's packages, installed only when missing: etcd (the coordination service the tests start on
# loopback, never as a system service), etcdctl (the tests enable etcd's authentication, users and roles
# with it, as docs/cluster.md's secure setup does), openssl (the tests make their CA and certificates with
# it, as the docs do) and protoc (the etcd-client crate's build compiles etcd's protocol definitions). Fails when etcd is older than 3.4 (the v3 API with leases and transactions, and the
# `--listen-client-urls` / `--initial-cluster` flags the tests use). Also `ip` (iproute2): the network
# namespace tests put agents in namespaces of their own joined by veth pairs.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/lib/apt-missing.sh
. scripts/lib/apt-missing.sh
APT_MISSING_SERVICES=etcd-server apt_install_missing etcd:etcd-server etcdctl:etcd-client openssl:openssl \
    protoc:protobuf-compiler ip:iproute2
# The well-known types (google/protobuf/*.proto) protoc includes come with libprotobuf-dev.
if [ ! -e /usr/include/google/protobuf/descriptor.proto ]; then
    apt_install_missing __never_a_program__:libprotobuf-dev
fi
etcd=$(command -v etcd || echo /usr/bin/etcd)
version=$("$etcd" --version | sed -n 's/^etcd Version: *//p')
case $version in
3.[4-9]* | 3.[1-9][0-9]* | [4-9].*) ;;
*)
    echo "install-etcd: etcd $version is older than 3.4" >&2
    exit 1
    ;;
esac
echo "etcd $version at $etcd; $(protoc --version)"
