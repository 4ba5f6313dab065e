# Sourced by benchmarks/gpu_first_minutes.sh, the GPU entry: the repository, its Python, and what its stages need,
# installed when missing (its setup stage), so that it runs on a fresh machine with only this repository.
#
#   source benchmarks/env.sh && ensure_installed test
#
# On a machine without network: benchmarks/wheelhouse.sh, run where pip works, fills the clone's wheelhouse/;
# ensure_installed installs from it with --no-index.
#
# PYTHON picks the interpreter (default: python, else python3). The repository goes first on
# PYTHONPATH, so this clone's accel_ddp, benchmarks and tests are the ones imported, installed or not.

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-$(command -v python || command -v python3)}"
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"

WHEELHOUSE="${WHEELHOUSE:-$REPO/wheelhouse}"  # benchmarks/wheelhouse.sh's wheels, for a machine with no network

# ensure_installed [EXTRA]: what is missing of the modules the scripts import, installed: from $WHEELHOUSE with no
# network where it holds wheels (only the missing packages; this clone is on PYTHONPATH already), else with
# pip install -e "REPO[EXTRA]" from the index.
ensure_installed() {
    local extra="${1:-}" modules=(torch torchvision accelerate datasets safetensors sklearn matplotlib yaml tqdm)
    [[ "$extra" == "test" ]] && modules+=(pytest pytest_timeout pexpect)
    local missing
    missing=$("$PY" -c 'import importlib.util as u, sys
names = {"sklearn": "scikit-learn", "yaml": "pyyaml", "pytest_timeout": "pytest-timeout"}
print(" ".join(names.get(m, m) for m in sys.argv[1:] if u.find_spec(m) is None))' "${modules[@]}") || return 1
    [[ -z "$missing" ]] && return 0
    if compgen -G "$WHEELHOUSE/*.whl" >/dev/null; then
        echo "installing what is missing from $WHEELHOUSE (no network): $missing" >&2
        # shellcheck disable=SC2086  # one word per package
        if "$PY" -m pip install -q --no-index --find-links "$WHEELHOUSE" $missing; then
            return 0
        fi
        echo "pip install from $WHEELHOUSE failed: run 'bash benchmarks/wheelhouse.sh $missing' on a machine where" \
             "pip reaches its index, bring wheelhouse/ here, then rerun (torch and torchvision come with the" \
             "image: its CUDA build)" >&2
        return 1
    fi
    echo "installing what is missing ($missing): $PY -m pip install -e $REPO${extra:+[$extra]}" >&2
    if ! "$PY" -m pip install -q -e "$REPO${extra:+[$extra]}"; then
        echo "pip install failed (no network?): run benchmarks/wheelhouse.sh where pip has network and bring" \
             "wheelhouse/ into this clone, or install $missing for $PY, then rerun" >&2
        return 1
    fi
}
