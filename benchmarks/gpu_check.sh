#!/usr/bin/env bash
# The GPU readiness check, in one go, on a machine with a GPU and only this repository:
#
#   bash benchmarks/gpu_check.sh                    # ~5-8 minutes; results in outputs/gpu_check/
#   OUT=/tmp/check bash benchmarks/gpu_check.sh     # results in /tmp/check/gpu_check.{txt,json}
#   bash benchmarks/gpu_check.sh --dry-run          # on a CPU machine: the plumbing only
#
# Installs what is missing (pip install -e ".[test]", benchmarks/env.sh), then runs
# benchmarks/gpu_check.py (its docstring lists the checks; flags pass through: --only, --budget,
# --out, --dry-run, --bench). One line per check: PASS/FAIL/SKIP, seconds, figure. Without a GPU it
# runs as --dry-run by itself and says so. Exit code 1 if a check failed, 2 if setup failed.
set -euo pipefail

source "$(dirname "${BASH_SOURCE[0]}")/env.sh"  # REPO, PY, PYTHONPATH, ensure_installed
cd "$REPO"
ensure_installed test || exit 2
exec "$PY" benchmarks/gpu_check.py "$@"
