#!/usr/bin/env bash
# The one GPU entry: every check and measurement prepared for a GPU machine, as named stages, each under its own
# `timeout` and all within one budget, one line per stage, one results file under $OUT.
#
#   bash benchmarks/gpu_first_minutes.sh                  # on one GPU: the `first` group; results in outputs/gpu_first/
#   bash benchmarks/gpu_first_minutes.sh --only paths     # another group; or stages: --only setup,doctor,compile
#   OUT=/tmp/first BUDGET=300 bash benchmarks/gpu_first_minutes.sh
#   bash benchmarks/gpu_first_minutes.sh --dry-run        # here, on the CPU: every stage's plumbing, tiny models
#   bash benchmarks/gpu_first_minutes.sh --list           # the stages, their caps and groups
#
# On a lent device machine, where at most 8 files come back from the tool's $OUT: run it into a folder of its own,
# then bring back the lines, the results file and the logs packed:
#   OUT=/tmp/gf bash benchmarks/gpu_first_minutes.sh; cp /tmp/gf/gpu_first_minutes.* "$OUT"
#   tar czf "$OUT/gf.tgz" -C /tmp gf
#
# Groups (--only takes group and stage names; a group opens with carry and setup):
#   first    (default; issue 49) correctness of the GPU levers before their speed: chunked graphs compile_count sync,
#            then mfu tax
#   paths    the GPU paths, benchmarks/gpu_check.py's checks (its docstring says what each checks): doctor
#            bf16_device_loader resume_bitwise nccl_one_rank preempt_resume gpu_guard gloo_two_ranks auto_batch_oom
#            compile fsdp2_one_rank nccl_two_ranks pytest_gpu
#   measure  issue 38's measurements: doctor pytest_gpu tax_full ops_per_step peers
#   recipes  against the textbook DDP script: compare tta
#
# Stages (cap in seconds on the GPU):
#   carry 5          what travels to the GPU machine: this clone's files and wheelhouse/, at most 60 MiB
#   setup 40         a CUDA GPU, and what the GPU image lacks from wheelhouse/ with no network (datasets, pexpect; the
#                    first group needs neither: synthetic data), then benchmarks/env.sh's ensure_installed for the rest;
#                    what stays missing is named on its line (only the stages that import it fail)
#   chunked 60       --chunked_loss against the plain loss, GPT-2 124M, bf16: loss and every gradient
#   graphs 75        eager against --cuda_graphs, 12 steps without dropout: weights within 1e-2, replays > 0
#   compile_count 90 --compile_regions on a 12-layer GPT-2 124M over 2 epochs and evaluations: <= 3 graphs
#   sync 45          torch.cuda.set_sync_debug_mode("error") inside steps 4-8: no device-to-host sync
#   mfu 170          benchmarks/mfu.py: defaults, chunked_loss, cuda_graphs, compile_regions, flash_attention (skipped
#                    where flash_attn does not import), 25 steps each, a fresh compile cache and 75 s each
#   tax 55           tax.py --nproc 1 --workloads cnn --pairs graphs: --cuda_graphs against the eager bare loop
#   doctor ... pytest_gpu   benchmarks/gpu_check.py NAME, one check a stage (caps in CAPS below)
#   tax_full 200     tax.py --nproc 1 on mlp, cnn and the tiny GPT-2, pairs defaults and graphs: the framework tax
#   ops_per_step 50  ops_per_step.py on mlp, cnn and lm: ATen ops per optimizer step against the bare loop
#   peers 130        peers.py --nproc 1: the Trainer and Lightning against accel_ddp, 2 epochs (the first not measured)
#   compare 150      compare.py --procs 1 --variants a,c: the textbook DDP script's samples/s against accel_ddp's
#   tta 200          tta.py --nproc 1 --target 0.98,0.99: time to accuracy, the textbook recipe against accel_ddp's
# benchmarks/gpu_first_checks.py holds the first group's correctness stages. A stage gets its cap, or what the budget
# (BUDGET, 470 s: under 8 minutes) has left after keeping a third of each later stage's cap for it, whichever is
# less; one whose share is below a third of its own cap is a SKIP line. A stage that fails or runs out of time is a
# FAIL line (its log's tail on the console, the whole log in $OUT/<stage>.log), and the next stage runs. The one
# results file, $OUT/gpu_first_minutes.json, holds every stage's line, seconds, share, and the results its script
# wrote (embedded), the machine. Exit 1 if any stage failed. On the CPU (--dry-run) every cap and the budget are
# CAP_SCALE (4) times longer: the dry run checks the plumbing on a loaded machine, not the budget. CAPS="name=seconds
# ..." sets caps. PYTHON picks the interpreter (benchmarks/env.sh).
#
# The wheels: `bash benchmarks/wheelhouse.sh --gpu-image` where pip works (about 1 MB: what the GPU image lacks,
# datasets and its dill and multiprocess, pexpect and ptyprocess, without their dependencies, which the image has;
# pyarrow alone, in the default wheelhouse, is 55 MB of its 75, over the 60 MiB that travel with a run).
set -uo pipefail

source "$(dirname "${BASH_SOURCE[0]}")/env.sh"  # REPO, PY, PYTHONPATH, WHEELHOUSE, ensure_installed
cd "$REPO"

ORDER=(carry setup chunked graphs compile_count sync mfu tax doctor bf16_device_loader resume_bitwise nccl_one_rank
       preempt_resume gpu_guard gloo_two_ranks auto_batch_oom compile fsdp2_one_rank nccl_two_ranks pytest_gpu
       tax_full ops_per_step peers compare tta)
declare -A CAP=([carry]=5 [setup]=40 [chunked]=60 [graphs]=75 [compile_count]=90 [sync]=45 [mfu]=170 [tax]=55
    [doctor]=45 [bf16_device_loader]=60 [resume_bitwise]=90 [nccl_one_rank]=45 [preempt_resume]=90 [gpu_guard]=30
    [gloo_two_ranks]=90 [auto_batch_oom]=60 [compile]=120 [fsdp2_one_rank]=120 [nccl_two_ranks]=60 [pytest_gpu]=120
    [tax_full]=200 [ops_per_step]=50 [peers]=130 [compare]=150 [tta]=200)
declare -A GROUP=([first]="carry setup chunked graphs compile_count sync mfu tax"
    [paths]="carry setup doctor bf16_device_loader resume_bitwise nccl_one_rank preempt_resume gpu_guard gloo_two_ranks
             auto_batch_oom compile fsdp2_one_rank nccl_two_ranks pytest_gpu"
    [measure]="carry setup doctor pytest_gpu tax_full ops_per_step peers"
    [recipes]="carry setup compare tta")
CHECKS=" doctor bf16_device_loader resume_bitwise nccl_one_rank preempt_resume gpu_guard gloo_two_ranks auto_batch_oom
         compile fsdp2_one_rank nccl_two_ranks pytest_gpu "

DRY="" ONLY="first"
while (($#)); do
    case $1 in
        --dry-run) DRY="--dry-run" ;;
        --only) ONLY=${2:?--only takes group or stage names, comma separated}; shift ;;
        --list)
            for name in "${ORDER[@]}"; do
                groups=$(for g in "${!GROUP[@]}"; do [[ " ${GROUP[$g]//$'\n'/ } " == *" $name "* ]] && echo "$g"; done)
                echo "$name ${CAP[$name]} $(echo "$groups" | sort | xargs | tr ' ' ,)"
            done
            exit 0 ;;
        *) echo "gpu_first_minutes: unknown argument $1 (--dry-run, --only NAMES, --list)" >&2; exit 2 ;;
    esac
    shift
done
for pair in ${CAPS:-}; do CAP[${pair%%=*}]=${pair##*=}; done
declare -A WANTED=()
for word in ${ONLY//,/ }; do
    if [[ -n "${GROUP[$word]:-}" ]]; then
        for name in ${GROUP[$word]}; do WANTED[$name]=1; done
    elif [[ -n "${CAP[$word]:-}" ]]; then
        WANTED[$word]=1
    else
        echo "gpu_first_minutes: unknown stage or group '$word'; groups: ${!GROUP[*]}; stages: ${ORDER[*]}" >&2
        exit 2
    fi
done
SELECTED=()
for name in "${ORDER[@]}"; do [[ -n "${WANTED[$name]:-}" ]] && SELECTED+=("$name"); done

CAP_SCALE="${CAP_SCALE:-$([[ -n "$DRY" ]] && echo 4 || echo 1)}"
BUDGET=$((${BUDGET:-470} * CAP_SCALE))
OUT="${OUT:-$REPO/outputs/gpu_first}"
mkdir -p "$OUT"
: >"$OUT/gpu_first_minutes.txt"
: >"$OUT/stages.tsv"
export PY REPO WHEELHOUSE DRY OUT CHECKS PYTHONUNBUFFERED=1
export TORCHINDUCTOR_COMPILE_THREADS="${TORCHINDUCTOR_COMPILE_THREADS:-8}"
failed=0
counts=(0 0 0)  # passed, failed, skipped

line() {  # one result line, on the console and in the summary file
    echo "$*" | tee -a "$OUT/gpu_first_minutes.txt"
}

record() {  # record NAME SHARE SECONDS LINE: the stage's line, and its row for the results file
    line "$4"
    printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" >>"$OUT/stages.tsv"
    case $4 in PASS*) ((counts[0]++)) ;; FAIL*) ((counts[1]++)); failed=1 ;; *) ((counts[2]++)) ;; esac
}

stage() {  # stage NAME LATER...: under `timeout SHARE`, output in $OUT/NAME.log, one line
    local name=$1 cap=$((CAP[$1] * CAP_SCALE)) kept=0 later
    shift
    for later in "$@"; do kept=$((kept + CAP[$later] * CAP_SCALE / 3)); done
    local left=$((BUDGET - SECONDS))
    local share=$((cap < left - kept ? cap : left - kept))
    if ((share < cap / 3)); then
        local why="${left}s left, ${kept}s kept for the later stages, it needs $((cap / 3))s"
        record "$name" "$share" 0 "SKIP $name budget spent: $why (rerun with --only $name)"
        return
    fi
    local began=$SECONDS code result
    STAGE_SECONDS=$share timeout --kill-after=5 "$share" bash -c 'run "$0"' "$name" >"$OUT/$name.log" 2>&1
    code=$?
    local took=$((SECONDS - began))
    result=$(grep -E '^(PASS|FAIL|SKIP) ' "$OUT/$name.log" | tail -1)
    if ((code == 124 || code == 137)); then
        result="FAIL $name timed out after ${share}s (log: $OUT/$name.log)"
    elif [[ -n "$result" ]]; then
        result="$result (${took}s)"
    elif ((code != 0)); then
        result="FAIL $name exit $code in ${took}s: $(grep -v '^\s*$' "$OUT/$name.log" | tail -1 | cut -c1-200)"
    else
        result="PASS $name in ${took}s: $(grep -v '^\s*$' "$OUT/$name.log" | tail -1 | cut -c1-200)"
    fi
    record "$name" "$share" "$took" "$result"
    if [[ "$result" == FAIL* ]]; then
        echo "    the log's end ($OUT/$name.log):"
        tail -15 "$OUT/$name.log" | sed 's/^/    /'
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
    # The rest of what the stages import (benchmarks/env.sh), on the GPU machine only (never into the dry run's
    # environment); what stays missing is named on the line: only the stages that import it fail
    [[ -z "$DRY" ]] && { ensure_installed test || true; }
    local missing
    missing=$("$PY" -c 'import importlib.util as u
print(" ".join(m for m in ("pytest", "pytest_timeout", "pexpect", "sklearn", "matplotlib", "torchvision")
               if u.find_spec(m) is None) or "none")')
    [[ "$has_datasets" == 1 ]] && has_datasets=yes || has_datasets=no
    echo "PASS setup gpu=$has_gpu datasets=$has_datasets missing=${missing// /,} (the first group needs none)"
}

recipes_data() {  # compare and tta (what gpu.sh did): data only from inside the clone, exactly one GPU
    export ACCEL_DDP_BENCH_MNIST="${ACCEL_DDP_BENCH_MNIST:-$REPO/data/mnist}"
    [[ -z "$DRY" ]] && export CUDA_VISIBLE_DEVICES="${CUDA_VISIBLE_DEVICES:-0}"
    echo "data: $("$PY" -c 'from benchmarks.common import data_source; print(data_source())')"
}

run() {  # run NAME: the stage's command, on the GPU or (--dry-run) its plumbing on the CPU
    local dry=$DRY
    if [[ "$CHECKS" == *" $1 "* ]]; then
        "$PY" -m benchmarks.gpu_check "$1" $dry --out "$OUT"
        return
    fi
    case $1 in
        carry) carried ;;
        setup) setup ;;
        chunked | graphs | compile_count | sync) "$PY" -m benchmarks.gpu_first_checks "$1" $dry --out "$OUT" ;;
        # mfu.py records a variant that fails or times out and goes on: the stage's own cap only guards the whole.
        # flash_attention in the dry run: skipped with its note (mfu's own test covers a failing variant)
        mfu) if [[ -n "$dry" ]]; then
                "$PY" -m benchmarks.mfu --dry-run --variants defaults,flash_attention --timeout 75 --out "$OUT/mfu.json"
            else
                "$PY" -m benchmarks.mfu --variants defaults,chunked_loss,cuda_graphs,compile_regions,flash_attention \
                    --steps 25 --warmup 8 --timeout 75 --out "$OUT/mfu.json"
            fi ;;
        # On the CPU --cuda_graphs is refused: the defaults pair on the smallest workload (tax_full's too); 100 s a
        # launch, within the stage's cap scaled by 4 (at a load of 17 on 2 cores one launch took more than 50 s)
        tax | tax_full) if [[ -n "$dry" ]]; then
                "$PY" benchmarks/tax.py --nproc 1 --workloads mlp --pairs defaults --rounds 1 --epochs 2 --timeout 100 \
                    --dry-run --out "$OUT/$1"
            elif [[ $1 == tax ]]; then
                "$PY" benchmarks/tax.py --nproc 1 --workloads cnn --pairs graphs --rounds 1 --timeout 25 \
                    --out "$OUT/tax"
            else
                "$PY" benchmarks/tax.py --nproc 1 --workloads mlp,cnn,lm --pairs defaults,graphs --rounds 1 \
                    --timeout 60 --out "$OUT/tax_full"
            fi ;;
        ops_per_step) "$PY" benchmarks/ops_per_step.py --workloads "$([[ -n "$dry" ]] && echo mlp || echo mlp,cnn,lm)" \
                --steps "$([[ -n "$dry" ]] && echo 3 || echo 10)" --json "$OUT/ops_per_step.json" ;;
        peers) if [[ -n "$dry" ]]; then
                echo "SKIP peers dry run: each side takes minutes on a CPU (tests/test_peers.py checks its plumbing)"
            else
                "$PY" benchmarks/peers.py --nproc 1 --rounds 1 --peers trainer,lightning --epochs 2 --timeout 60 \
                    --out "$OUT/peers"
            fi ;;
        # (a) the textbook script against (c) accel_ddp, one GPU, no DDP wrap on either (benchmarks/README.md)
        compare) recipes_data
            "$PY" benchmarks/compare.py --procs 1 --variants a,c --steps "$([[ -n "$dry" ]] && echo 10 || echo 300)" \
                --repeats "$([[ -n "$dry" ]] && echo 1 || echo 2)" --global_batch_size 64 --num_workers 1 --timeout 60 \
                --out "$OUT/compare" ;;
        # accel_ddp's GPU recipe for 99%: the full-width CNN, AdamW, cosine over 12 epochs, global batch 128 (bf16
        # autocast where the GPU has it; (a) stays fp32)
        tta) recipes_data
            local epochs=12 target=0.98,0.99 max=14
            [[ -n "$dry" ]] && epochs=1 target=0.5 max=1
            "$PY" benchmarks/tta.py --nproc 1 --target "$target" --repeats 1 --max_epochs "$max" --num_workers 1 \
                --recipe "--model mnist_cnn --optimizer adamw --lr 3e-3 --lr_schedule cosine --warmup_steps 20 \
--global_batch_size 128 --epochs $epochs" --timeout 110 --out "$OUT/tta" ;;
    esac
}
export -f run carried setup recipes_data ensure_installed

for ((k = 0; k < ${#SELECTED[@]}; k++)); do
    stage "${SELECTED[@]:k}"
done
"$PY" -m benchmarks.gpu_first_checks collect --out "$OUT" ${DRY} --budget "$BUDGET" >/dev/null \
    || echo "gpu_first_minutes: the results file could not be written (the lines above stand)"
line "gpu_first_minutes: done in ${SECONDS}s${DRY:+ (dry run: the plumbing, not the GPU)}: ${counts[0]} passed," \
    "${counts[1]} failed, ${counts[2]} skipped; results in $OUT/gpu_first_minutes.json"
exit $failed
