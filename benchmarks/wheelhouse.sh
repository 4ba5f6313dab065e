#!/usr/bin/env bash
# The wheels an offline GPU machine may lack, downloaded here (where pip reaches its index) into the clone's
# gitignored wheelhouse/, so that benchmarks/gpu_first_minutes.sh's setup stage installs them there with no network
# (benchmarks/env.sh: pip install --no-index --find-links wheelhouse/ ...).
#
#   bash benchmarks/wheelhouse.sh                   # Python 3.12, manylinux x86_64: the GPU image of issue 38
#   bash benchmarks/wheelhouse.sh --gpu-image       # ~1 MB: only the packages that image lacks, no dependencies
#   bash benchmarks/wheelhouse.sh --all             # also what env.sh checks for that the image had
#   bash benchmarks/wheelhouse.sh datasets pexpect  # only these (and what they need)
#   PY_VERSION=3.11 bash benchmarks/wheelhouse.sh   # another Python
#
# The GPU image of issue 38 (torch 2.11 + CUDA 13, accelerate, transformers, lightning, pytest, pytest-xdist,
# hypothesis) lacked `datasets` (its dill, multiprocess, xxhash, pyarrow, pandas) and pexpect (ptyprocess): the
# default list, with pytest-timeout and setuptools/wheel. --all adds the rest of env.sh's modules (scikit-learn,
# matplotlib, safetensors, pyyaml, tqdm). torch and torchvision must match the image's CUDA build: never from here.
# pip resolves each package's requirements for the target Python and platform and downloads those too (binary
# wheels only: nothing is built there); there, what the image already has in a version that fits stays as it is.
# numpy's wheel is dropped (every Transformers needs numpy: the image has it). Size: the default ~75 MB (pyarrow's
# wheel is 55 MB of it), --all ~145 MB. At most 64 MiB of files travel with a run to the lent GPU machines, the clone
# included: --gpu-image downloads datasets, dill, multiprocess, pexpect and ptyprocess without their dependencies (the
# image has pyarrow, pandas, xxhash, fsspec, huggingface-hub, pytest-timeout, ...), and benchmarks/gpu_first_minutes.sh
# installs them with --no-deps. Nothing here is committed (wheelhouse/ is in .gitignore).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-$(command -v python || command -v python3)}"
DEST="${WHEELHOUSE:-$REPO/wheelhouse}"
PY_VERSION="${PY_VERSION:-3.12}"
ABI="cp${PY_VERSION/./}"
PACKAGES=(datasets pexpect ptyprocess pytest-timeout setuptools wheel)
DEPS=()
if [[ "${1:-}" == "--gpu-image" ]]; then
    PACKAGES=(datasets dill multiprocess pexpect ptyprocess)
    DEPS=(--no-deps)
elif [[ "${1:-}" == "--all" ]]; then
    PACKAGES+=(scikit-learn matplotlib safetensors pyyaml tqdm)
elif (( $# )); then
    PACKAGES=("$@")
fi

mkdir -p "$DEST"
echo "wheelhouse: ${PACKAGES[*]} for Python $PY_VERSION, manylinux x86_64 -> $DEST"
# --platform: every manylinux tag a wheel of these packages carries (pip takes the listed tags only).
"$PY" -m pip download --quiet "${DEPS[@]}" --dest "$DEST" --only-binary=:all: --python-version "$PY_VERSION" \
    --implementation cp --abi "$ABI" --abi abi3 --abi none \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 --platform any \
    "${PACKAGES[@]}"
rm -f "$DEST"/numpy-*.whl
echo "wheelhouse: $(find "$DEST" -name '*.whl' | wc -l) wheels, $(du -sh "$DEST" | cut -f1) in $DEST"
