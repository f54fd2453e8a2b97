#!/usr/bin/env bash
# The test command of the README (and of .ci/run): set up a fresh machine, then run the CPU suite.
set -euo pipefail
cd "$(dirname "$0")/.."
# CPU torch first, or pip pulls several GB of CUDA wheels for the project's torch requirement.
python -m pip install -q torch==2.13.0
python -m pip install -q -e ".[dev]"
# A real single-node Slurm for tests/test_recipes.py's live test (skipped where this cannot install).
if ! command -v slurmctld >/dev/null && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge) >/dev/null 2>&1 \
    || echo "note: slurm-wlm not installed; the live Slurm test will be skipped"
fi
python -m pytest "$@"
