#!/usr/bin/env bash
# The AWS CLI, the standard client scripts/bench-s3.sh compares against (`criu dump` + `aws s3 cp`):
# the distribution's package, installed only when `aws` is missing. Only the benchmark calls this; the
# tests and CI do not need it.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/lib/apt-missing.sh
. scripts/lib/apt-missing.sh
apt_install_missing aws:awscli
aws --version
