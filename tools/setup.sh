#!/usr/bin/env bash
# Set-up on a fresh machine: the pinned CPU torch first (a local wheel here; an unpinned
# torch would download several GB), then ledger with its dev and s3 extras.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install --quiet --disable-pip-version-check torch==2.13.0
python -m pip install --quiet --disable-pip-version-check -e ".[dev]"
