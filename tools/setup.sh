#!/usr/bin/env bash
# Set-up on a fresh machine: the pinned CPU torch first (a local wheel here; an unpinned
# torch would download several GB), then ledger with its dev and s3 extras; Java 17 for
# the Spark audit's tests (pyspark in local mode) when no java is on the PATH.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v java >/dev/null 2>&1; then
    SUDO=$([ "$(id -u)" -eq 0 ] || echo sudo)
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq openjdk-17-jre-headless
fi
python -m pip install --quiet --disable-pip-version-check torch==2.13.0
python -m pip install --quiet --disable-pip-version-check -e ".[dev]"
# Byte-compile ledger now: where PYTHONDONTWRITEBYTECODE is set (this machine's image
# sets it), no interpreter would cache it, and each of the test suite's few hundred
# subprocesses (ranks, killed runs, examples) would compile it again (~0.15 s of CPU each).
python -m compileall -q -j 0 ledger examples tests/*.py >/dev/null
