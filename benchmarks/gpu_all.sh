#!/usr/bin/env bash
# Every GPU measurement of issue 38 in one go on one GPU, in under 8 minutes, into one results file:
#
#   bash benchmarks/gpu_all.sh                   # results in outputs/gpu_all/gpu_all.json
#   OUT=/tmp/all bash benchmarks/gpu_all.sh      # results in /tmp/all/gpu_all.json
#   bash benchmarks/gpu_all.sh --dry-run         # on a CPU machine: the plumbing only, short
#
# Installs what is missing first, with no network where the clone holds benchmarks/wheelhouse.sh's wheels
# (benchmarks/env.sh), then runs benchmarks/gpu_all.py (its docstring lists the stages; flags pass through:
# --only, --budget, --out, --dry-run). Exit code 1 if a stage failed or ran out of time, 2 if setup failed.
set -euo pipefail

source "$(dirname "${BASH_SOURCE[0]}")/env.sh"  # REPO, PY, PYTHONPATH, WHEELHOUSE, ensure_installed
cd "$REPO"
ensure_installed test || exit 2
exec "$PY" benchmarks/gpu_all.py "$@"
