# Sourced by benchmarks/gpu.sh and benchmarks/gpu_check.sh: the repository, its Python, and what
# they need, installed when missing, so that both run on a fresh machine with only this repository.
#
#   source benchmarks/env.sh && ensure_installed test
#
# PYTHON picks the interpreter (default: python, else python3). The repository goes first on
# PYTHONPATH, so this clone's accel_ddp, benchmarks and tests are the ones imported, installed or not.

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-$(command -v python || command -v python3)}"
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"

# ensure_installed [EXTRA]: pip install -e "REPO[EXTRA]" unless the modules it would bring are importable.
ensure_installed() {
    local extra="${1:-}" modules="torch, torchvision, accelerate, datasets, safetensors, sklearn, matplotlib, yaml, tqdm"
    [[ "$extra" == "test" ]] && modules="$modules, pytest, pytest_timeout"
    if "$PY" -c "import $modules" 2>/dev/null; then
        return 0
    fi
    echo "installing what is missing: $PY -m pip install -e $REPO${extra:+[$extra]}" >&2
    if ! "$PY" -m pip install -q -e "$REPO${extra:+[$extra]}"; then
        echo "pip install failed (no network?): install torch, torchvision, accelerate, datasets, safetensors," \
             "scikit-learn, matplotlib, pyyaml and tqdm${extra:+ and the [$extra] extra} for $PY, then rerun" >&2
        return 1
    fi
}
