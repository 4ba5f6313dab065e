#!/usr/bin/env bash
# One GPU, one command: accel_ddp's framework tax against the bare DDP loop (tax.py: steps/s on matched
# work), then MNIST-style time to 98% and 99% eval accuracy and throughput for (a) the textbook DDP
# script and (c) accel_ddp; tables printed at the end. Budget: under 8 minutes (each stage is
# time-limited: TAX_TIMEOUT 150 s + COMPARE_TIMEOUT 150 s + TTA_TIMEOUT 200 s at most).
#
#   bash benchmarks/gpu.sh                  # from anywhere; results under outputs/benchmarks/gpu/
#   OUT=/tmp/gpu TARGET=0.99 bash benchmarks/gpu.sh
#
# Runs on a fresh machine with only this repository: it installs what is missing (benchmarks/env.sh:
# pip install -e .) and needs no data outside the repository. Data (benchmarks/common.py):
# $ACCEL_DDP_BENCH_MNIST, by default data/mnist inside the repository (absent from a clone): with the
# MNIST train-* files there, the standard 60,000/10,000 split; with only the t10k-* files, those
# split 8,000 / 2,000; with neither, 8,000 / 2,000 synthetic MNIST-shaped digits generated on the
# spot. The output's first lines say which. On synthetic digits the accuracies are not MNIST's and
# both variants reach the targets quickly: the figures then compare the two on the same data only.
#
# Like for like: both start the same way (accelerate launch --config_file accelerate_configs/cpu_2proc.yaml
# --num_processes 1, i.e. torchrun; with a GPU visible, (a) forms an NCCL group and accel_ddp trains on
# cuda:0 with its data on the GPU, --loader auto). With one process Accelerate does not wrap the
# model in DDP, and (a) does not either (textbook_ddp.py; --ddp_single_process would restore the
# tutorial's wrap), so neither pays a 1-rank DDP's gradient copies. (a) uses num_workers 1 and
# pin_memory, as examples/mnist does on CUDA.
#
# Status: written on a machine without a GPU and not run on one yet; its plumbing was checked on
# CPU with BENCH_ALLOW_CPU=1 (see benchmarks/README.md). benchmarks/gpu_check.sh runs it last.
#
# Knobs (environment): TAX_ROUNDS (alternated rounds of tax.py, 3), TAX_EPOCHS (epochs per tax.py run;
# default per workload), STEPS (throughput steps per run, 300), REPEATS (2), TARGET (0.98,0.99),
# EPOCHS (accel_ddp recipe epochs, 12), MAX_EPOCHS ((a) at most, 14), OUT, PYTHON, TAX_TIMEOUT (150),
# COMPARE_TIMEOUT (150), TTA_TIMEOUT (200), BENCH_ALLOW_CPU=1 (skip the GPU check: a plumbing test
# only, figures meaningless).
set -euo pipefail

source "$(dirname "${BASH_SOURCE[0]}")/env.sh"  # REPO, PY, PYTHONPATH, ensure_installed
cd "$REPO"
ensure_installed
STEPS="${STEPS:-300}"
REPEATS="${REPEATS:-2}"
TARGET="${TARGET:-0.98,0.99}"
EPOCHS="${EPOCHS:-12}"
MAX_EPOCHS="${MAX_EPOCHS:-14}"
OUT="${OUT:-$REPO/outputs/benchmarks/gpu}"
TAX_ROUNDS="${TAX_ROUNDS:-3}"
TAX_TIMEOUT="${TAX_TIMEOUT:-150}"
COMPARE_TIMEOUT="${COMPARE_TIMEOUT:-150}"
TTA_TIMEOUT="${TTA_TIMEOUT:-200}"
export ACCEL_DDP_BENCH_MNIST="${ACCEL_DDP_BENCH_MNIST:-$REPO/data/mnist}"  # never a folder outside the clone

if [[ "${BENCH_ALLOW_CPU:-0}" != "1" ]] && ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "gpu.sh: torch sees no CUDA GPU; on CPU run benchmarks/compare.py and benchmarks/tta.py instead" >&2
    exit 2
fi
export CUDA_VISIBLE_DEVICES="${CUDA_VISIBLE_DEVICES:-0}"  # exactly one GPU, whatever the machine has

# accel_ddp's GPU recipe for 99%: the full-width CNN (on a GPU width costs little), AdamW with a cosine
# schedule planned for EPOCHS epochs, global batch 128; tta.py launches it with bf16 autocast on a
# bf16-capable GPU (its --mixed_precision auto) while (a) stays fp32.
RECIPE="--model mnist_cnn --optimizer adamw --lr 3e-3 --lr_schedule cosine --warmup_steps 20 \
--global_batch_size 128 --epochs $EPOCHS"

mkdir -p "$OUT"
start=$(date +%s)
echo "== data: $("$PY" -c 'from benchmarks.common import data_source; print(data_source())')"
# The framework tax where it matters: small models on a GPU are launch- and host-bound, so what the
# package does per step is what a user feels. Both sides train the plain model on cuda:0 (one
# process: no DDP wrap on either), the same optimizer (fused AdamW), clipping and samples per step.
echo "== framework tax: accel_ddp defaults vs the bare loop (AdamW, clipping), 1 GPU, $TAX_ROUNDS alternated rounds"
timeout "$TAX_TIMEOUT" "$PY" benchmarks/tax.py --nproc 1 --workloads mlp,cnn --rounds "$TAX_ROUNDS" \
    ${TAX_EPOCHS:+--epochs "$TAX_EPOCHS"} --timeout 60 --out "$OUT/tax" | tee "$OUT/tax.log" \
    || echo "gpu.sh: tax.py failed or timed out (see $OUT/tax.log)"
echo
echo "== throughput: (a) vs (c), 1 GPU, $STEPS steps x batch 64, $REPEATS alternated repeats, no DDP wrap on either"
timeout "$COMPARE_TIMEOUT" "$PY" benchmarks/compare.py --procs 1 --variants a,c --steps "$STEPS" --repeats "$REPEATS" \
    --global_batch_size 64 --num_workers 1 --timeout 60 --out "$OUT/compare" | tee "$OUT/compare.log" \
    || echo "gpu.sh: compare.py failed or timed out (see $OUT/compare.log)"
echo
echo "== time to eval accuracy $TARGET: (a) textbook settings vs accel_ddp recipe, 1 GPU"
timeout "$TTA_TIMEOUT" "$PY" benchmarks/tta.py --nproc 1 --target "$TARGET" --repeats 1 --max_epochs "$MAX_EPOCHS" \
    --num_workers 1 --recipe "$RECIPE" --timeout 110 --out "$OUT/tta" | tee "$OUT/tta.log" \
    || echo "gpu.sh: tta.py failed or timed out (see $OUT/tta.log)"
echo
echo "gpu.sh: done in $(( $(date +%s) - start ))s; JSON and PNG under $OUT"
