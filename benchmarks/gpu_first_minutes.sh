#!/usr/bin/env bash
# The first minutes on a GPU machine (issue 49): correctness of the GPU levers before their speed, in one run of at
# most 9 minutes, each stage under its own `timeout`, one line per stage and the results under $OUT.
#
#   bash benchmarks/gpu_first_minutes.sh              # on one GPU; results in outputs/gpu_first/
#   OUT=/tmp/first bash benchmarks/gpu_first_minutes.sh
#   bash benchmarks/gpu_first_minutes.sh --dry-run    # here, on the CPU: every stage's plumbing, tiny models
#
# Stages, in order (caps in seconds; their sum is 540):
#   carry 5          what travels to the GPU machine: this clone's files and wheelhouse/, at most 60 MiB
#   setup 40         what the GPU image lacks, from wheelhouse/ with no network; no stage needs `datasets` (random
#                    tokens, synthetic digits): it is installed for the GPU tests and gpu_all.sh that may follow
#   chunked 60       --chunked_loss against the plain loss, GPT-2 124M, bf16: loss and every gradient
#   graphs 75        eager against --cuda_graphs, 12 steps without dropout: weights within 1e-2, replays > 0
#   compile_count 90 --compile_regions on a 12-layer GPT-2 124M over 2 epochs and evaluations: <= 3 graphs
#   sync 45          torch.cuda.set_sync_debug_mode("error") inside steps 4-8: no device-to-host sync
#   mfu 170          benchmarks/mfu.py: defaults, chunked_loss, cuda_graphs, compile_regions, flash_attention (skipped
#                    where flash_attn does not import), 25 steps each, a fresh compile cache and 75 s each
#   tax 55           benchmarks/tax.py --nproc 1 --workloads cnn --pairs graphs: --cuda_graphs against the eager bare
#                    loop (the lm workload and the defaults pair are benchmarks/gpu_all.sh's: they do not fit here)
# benchmarks/gpu_first_checks.py holds the correctness stages. A stage that fails or runs out of time is a FAIL line
# with its log in $OUT/<stage>.log, and the next stage runs. Exit 1 if any stage failed. On the CPU (--dry-run) every
# cap is CAP_SCALE (4) times longer: the dry run checks the plumbing on a loaded machine, not the budget.
#
# The wheels: `bash benchmarks/wheelhouse.sh --gpu-image` where pip works (about 1 MB: what the GPU image lacks,
# datasets and its dill and multiprocess, pexpect and ptyprocess, without their dependencies, which the image has;
# pyarrow alone, in the default wheelhouse, is 55 MB of its 75, over the 60 MiB that travel with a run).
set -uo pipefail

source "$(dirname "${BASH_SOURCE[0]}")/env.sh"  # REPO, PY, PYTHONPATH, WHEELHOUSE
cd "$REPO"
DRY=""
[[ "${1:-}" == "--dry-run" ]] && DRY="--dry-run"
CAP_SCALE="${CAP_SCALE:-$([[ -n "$DRY" ]] && echo 4 || echo 1)}"
export PY WHEELHOUSE DRY  # for the stages run as functions
OUT="${OUT:-$REPO/outputs/gpu_first}"
mkdir -p "$OUT"
: >"$OUT/gpu_first_minutes.txt"
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_COMPILE_THREADS="${TORCHINDUCTOR_COMPILE_THREADS:-8}"
start=$(date +%s)
failed=0

line() {  # one result line, on the console and in the summary file
    echo "$*" | tee -a "$OUT/gpu_first_minutes.txt"
}

stage() {  # stage NAME CAP COMMAND...: under `timeout CAP`, output in $OUT/NAME.log, one line
    local name=$1 cap=$(($2 * CAP_SCALE))
    shift 2
    if declare -F "$1" >/dev/null; then  # one of the functions below: `timeout` runs programs, so in a bash of its own
        export -f "$1"
        set -- bash -c "$1"
    fi
    local began=$SECONDS code
    timeout --kill-after=5 "$cap" "$@" >"$OUT/$name.log" 2>&1
    code=$?
    local took=$((SECONDS - began))
    local result
    result=$(grep -E '^(PASS|FAIL|SKIP) ' "$OUT/$name.log" | tail -1)
    if ((code == 124 || code == 137)); then
        line "FAIL $name timed out after ${cap}s (log: $OUT/$name.log)"
        failed=1
    elif [[ -n "$result" ]]; then
        line "$result (${took}s)"
        [[ "$result" == FAIL* ]] && failed=1
    elif ((code != 0)); then
        line "FAIL $name exit $code in ${took}s: $(grep -v '^\s*$' "$OUT/$name.log" | tail -1 | cut -c1-200)"
        failed=1
    else
        line "PASS $name in ${took}s: $(grep -v '^\s*$' "$OUT/$name.log" | tail -1 | cut -c1-200)"
    fi
}

carried() {  # what the device tool sends: tracked and untracked-not-ignored files, plus wheelhouse/ when carried
    local bytes wheels=0
    bytes=$(git ls-files -z --cached --others --exclude-standard | du -cb --files0-from=- 2>/dev/null | tail -1 | cut -f1)
    [[ -d "$WHEELHOUSE" ]] && wheels=$(du -sb "$WHEELHOUSE" | cut -f1)
    local mib=$(((bytes + wheels) / 1048576))
    if ((mib <= 60)); then
        echo "PASS carry ${mib} MiB (files $((bytes / 1048576)) MiB, wheelhouse $((wheels / 1048576)) MiB) <= 60 MiB"
    else
        echo "FAIL carry ${mib} MiB > 60 MiB: run benchmarks/wheelhouse.sh --gpu-image instead of the full wheelhouse"
    fi
}

setup() {
    local has_gpu has_datasets
    # One interpreter answers both (each start imports torch: seconds on a loaded machine); `datasets` imported, not
    # only found, so that a version the image cannot load counts as missing.
    read -r has_gpu has_datasets < <("$PY" -c 'import torch, importlib
try:
    importlib.import_module("datasets"); found = 1
except Exception:
    found = 0
print(int(torch.cuda.is_available()), found)' 2>/dev/null || echo 0 0)
    if [[ -z "$DRY" && "$has_gpu" != 1 ]]; then
        echo "FAIL setup torch sees no CUDA GPU: run with --dry-run on a CPU machine"
        return 1
    fi
    if [[ "$has_datasets" != 1 ]] && compgen -G "$WHEELHOUSE/*.whl" >/dev/null; then
        # --no-deps: the image has the dependencies; a version it lacks shows as `datasets` failing to import
        "$PY" -m pip install -q --no-index --no-deps --find-links "$WHEELHOUSE" datasets dill multiprocess pexpect \
            ptyprocess || true
        "$PY" -c 'import datasets' 2>/dev/null && has_datasets=1
    fi
    if [[ "$has_datasets" == 1 ]]; then
        echo "PASS setup gpu=$has_gpu datasets=yes"
    else
        echo "PASS setup gpu=$has_gpu datasets=no (none of these stages needs it: synthetic data)"
    fi
}

stage carry 5 carried
stage setup 40 setup
for check in chunked:60 graphs:75 compile_count:90 sync:45; do
    stage "${check%%:*}" "${check##*:}" "$PY" -m benchmarks.gpu_first_checks "${check%%:*}" $DRY --out "$OUT"
done

# Speed, after correctness: each variant in a fresh process with a fresh compile cache (mfu.py records a variant
# that fails or times out and goes on, so the stage's own cap only guards the whole).
if [[ -n "$DRY" ]]; then  # flash_attention: skipped here with its note (mfu's own test covers a failing variant)
    stage mfu 170 "$PY" -m benchmarks.mfu --dry-run --variants defaults,flash_attention --timeout 75 \
        --out "$OUT/mfu.json"
else
    stage mfu 170 "$PY" -m benchmarks.mfu --variants defaults,chunked_loss,cuda_graphs,compile_regions,flash_attention \
        --steps 25 --warmup 8 --timeout 75 --out "$OUT/mfu.json"
fi
if [[ -n "$DRY" ]]; then  # on the CPU --cuda_graphs is refused: the defaults pair on the smallest workload
    stage tax 55 "$PY" benchmarks/tax.py --nproc 1 --workloads mlp --pairs defaults --rounds 1 --epochs 2 \
        --timeout 50 --out "$OUT/tax"
else
    stage tax 55 "$PY" benchmarks/tax.py --nproc 1 --workloads cnn --pairs graphs --rounds 1 --timeout 25 \
        --out "$OUT/tax"
fi
line "gpu_first_minutes: done in $(($(date +%s) - start))s${DRY:+ (dry run: the plumbing, not the GPU)}; results in $OUT"
exit $failed
