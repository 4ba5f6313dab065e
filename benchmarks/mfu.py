"""Model FLOPs utilisation of a GPT-2 124M-class causal LM on one GPU: the defaults, then each lever on its own.

The model: GPT-2 of 12 layers x 768 (12 heads), GPT-2's vocabulary padded to a multiple of 64 (50,304, as
nanoGPT), 1,024 positions; random token blocks of 1,024 (the data path is not what is measured: docs/tasks.md's
run measures start-up), global batch 32 on one process, bf16 autocast, AdamW. Each variant runs ``accel_ddp.train``
in a fresh Python process (no compile cache or allocator state shared) for ``--steps`` optimizer steps:

    defaults          what a user gets (Transformers' default attention, sdpa; no compile; the plain loss)
    eager_attention   --attn_implementation eager (the attention a model without SDPA support gets)
    flash_attention   --attn_implementation flash_attention_2 (skipped with a note where flash_attn is missing)
    compile_regions   --compile_regions (each block compiled in place; its compile time is in first_step)
    compile           --compile (the whole model, through Accelerate)
    chunked_loss      --chunked_loss (no (tokens, vocabulary) float32 logits)
    cuda_graphs       --cuda_graphs (the whole step captured once and replayed; refused without a CUDA device)

Each variant gets a compile cache of its own, empty (TORCHINDUCTOR_CACHE_DIR and TRITON_CACHE_DIR in a temporary
folder: the FX graph, AOTAutograd and Triton caches all live there), so its first_step is a cold compile's, whatever
ran before. A variant that fails or runs past ``--timeout`` is recorded (its error, and its whole output kept in
``<out>.logs/<variant>.log``) and the next one runs; ``flash_attention`` is recorded as skipped, with the reason,
where ``flash_attn`` does not import. Exit code 1 if a variant failed or timed out.

Printed and written (``--out``, JSON): tokens/s and MFU from the median step time (the first ``--warmup`` steps
left out: they hold compilation), the step time p50, the device's peak allocated memory, the start-up phases, and
each variant's tokens/s over the defaults'. MFU is 6N+12LdT model FLOPs (accel_ddp/tracking/flops.py) over the
device's dense bf16 peak.

    python benchmarks/mfu.py                                     # on one GPU: every variant, 60 steps each
    python benchmarks/mfu.py --variants defaults,compile_regions --steps 40
    python benchmarks/mfu.py --dry-run                           # the plumbing on the CPU in seconds: a tiny
                                                                 # GPT-2, fp32, 3 steps, no compile variants
    python benchmarks/mfu.py --dry-run --variants defaults,flash_attention,cuda_graphs   # a skip and a failure
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

VARIANTS = {  # name -> TrainConfig overrides
    "defaults": {},
    "eager_attention": {"attn_implementation": "eager"},
    "flash_attention": {"attn_implementation": "flash_attention_2"},
    "compile_regions": {"compile_regions": True},
    "compile": {"compile": True},
    "chunked_loss": {"chunked_loss": True},
    "cuda_graphs": {"cuda_graphs": True},
}
# No compile on the CPU (minutes, not seconds); flash_attention is skipped there with its note.
DRY_VARIANTS = ("defaults", "eager_attention", "flash_attention", "chunked_loss")
GPT2_124M = {"n_layer": 12, "n_head": 12, "n_embd": 768, "vocab_size": 50304, "n_positions": 1024}
TINY = {"n_layer": 2, "n_head": 2, "n_embd": 32, "vocab_size": 64, "n_positions": 32}


def child(variant: str, dry_run: bool, steps: int, warmup: int, out_dir: str) -> dict:
    """One variant in this process: train, then the figures."""
    sys.path.insert(0, str(REPO))
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from accel_ddp import TrainConfig, train
    from accel_ddp.data.in_memory import TokenBlocks

    shape = TINY if dry_run else GPT2_124M
    length, global_batch = shape["n_positions"], 4 if dry_run else 32
    log_every = 1 if dry_run else 5  # a log step synchronises with the device: one in five, near a user's default
    generator = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, shape["vocab_size"], ((steps + 1) * global_batch, length), generator=generator)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(**shape, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    cfg = TrainConfig(task="causal_lm", global_batch_size=global_batch, max_steps=steps, lr=6e-4, warmup_steps=0,
                      log_every=log_every, output_dir=os.path.join(out_dir, variant),
                      mixed_precision="no" if dry_run else "bf16", **VARIANTS[variant])
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    summary = train(cfg, model=model, train_dataset=TokenBlocks(blocks))
    metrics = [json.loads(line) for line in open(os.path.join(out_dir, variant, "metrics.jsonl"))]
    logged = [m for m in metrics if "step" in m and "loss" in m]
    # Step time from the log steps' wall clock (ms resolution) over the steps between them; the first `warmup` out.
    times = [(m["step"], m["time"]) for m in logged if "time" in m]
    gaps = [(t1 - t0) / (s1 - s0) for (s0, t0), (s1, t1) in zip(times, times[1:], strict=False)
            if s0 >= warmup and s1 > s0]
    step_s = statistics.median(gaps) if gaps else None
    tokens_per_step = global_batch * length
    per_token = summary.get("model_flops_per_token")
    peak = summary.get("peak_flops")
    tokens_per_sec = tokens_per_step / step_s if step_s else summary.get("train_tokens_per_sec")
    return {
        "variant": variant, "steps": steps, "tokens_per_step": tokens_per_step,
        "step_time_p50_ms": None if step_s is None else 1e3 * step_s,
        "tokens_per_sec": tokens_per_sec,
        "mfu": tokens_per_sec * per_token / peak if tokens_per_sec and per_token and peak else None,
        "summary_mfu": summary.get("mfu"),
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None,
        "startup_phases_sec": summary.get("startup_phases_sec"),
        "final_loss": logged[-1]["loss"] if logged else None,
        "device": summary.get("device_name"),
    }


def run_variant(variant: str, args: argparse.Namespace, out_dir: str, log_dir: str) -> dict:
    """One variant in a fresh Python process with a fresh compile cache; its output kept in ``log_dir``. A failure
    or a timeout is a result too (``error``), so that the next variant runs."""
    skipped = skip_reason(variant)
    if skipped:
        return {"variant": variant, "skipped": skipped}
    result = os.path.join(out_dir, f"{variant}.json")
    log = os.path.join(log_dir, f"{variant}.log")
    # -m from the repository: the script's own folder on sys.path would shadow the `kernels` package Transformers
    # imports with benchmarks/kernels.py.
    cmd = [sys.executable, "-m", "benchmarks.mfu", "--child", variant, "--steps", str(args.steps),
           "--warmup", str(args.warmup), "--work", out_dir, *(["--dry-run"] if args.dry_run else [])]
    cache = os.path.join(out_dir, f"{variant}.cache")  # empty: inductor's FX graph and AOTAutograd caches, Triton's
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1", "TORCHINDUCTOR_CACHE_DIR": cache,
           "TRITON_CACHE_DIR": os.path.join(cache, "triton")}
    started = time.perf_counter()
    with open(log, "w") as out:
        # A session of its own: a timeout ends the child and what it started (inductor's compile workers).
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=REPO, env=env, start_new_session=True)
        try:
            code = proc.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return {"variant": variant, "error": f"timed out after {args.timeout:g} s", "log": log,
                    "wall_sec": time.perf_counter() - started}
    if code != 0 or not os.path.isfile(result):
        tail = [line for line in Path(log).read_text(errors="replace").splitlines() if line.strip()][-3:]
        return {"variant": variant, "error": f"exit {code}: " + " | ".join(tail), "log": log,
                "wall_sec": time.perf_counter() - started}
    with open(result) as fh:
        return {**json.load(fh), "log": log, "wall_sec": time.perf_counter() - started}


def skip_reason(variant: str) -> str | None:
    """Why a variant cannot run on this machine at all (recorded as skipped, not failed), or None."""
    if variant != "flash_attention":
        return None
    if importlib.util.find_spec("flash_attn") is None:
        return "flash_attn is not installed (pip install flash-attn): Transformers would look for a kernel online"
    try:
        probe = subprocess.run([sys.executable, "-c", "import flash_attn"], capture_output=True, text=True,
                               timeout=120)
    except subprocess.TimeoutExpired:
        return "flash_attn did not import within 120 s"
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["?"])[-1]
        return f"flash_attn does not import ({last[:200]})"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="a tiny GPT-2 on the CPU, fp32, the plumbing only")
    parser.add_argument("--variants", default=None, help="comma-separated; default all (dry run: no compile)")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps per variant (default 60; dry 3)")
    parser.add_argument("--warmup", type=int, default=None, help="steps left out of the median (default 10; dry 0)")
    parser.add_argument("--out", default=str(REPO / "outputs" / "mfu.json"), help="results file (JSON)")
    parser.add_argument("--timeout", type=float, default=300, help="seconds per variant")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--work", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.steps = args.steps or (3 if args.dry_run else 60)
    args.warmup = args.warmup if args.warmup is not None else (0 if args.dry_run else 10)
    if args.child:
        figures = child(args.child, args.dry_run, args.steps, args.warmup, args.work)
        with open(os.path.join(args.work, f"{args.child}.json"), "w") as fh:
            json.dump(figures, fh)
        return 0
    names = args.variants.split(",") if args.variants else list(DRY_VARIANTS if args.dry_run else VARIANTS)
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        parser.error(f"unknown variant {unknown[0]}; choose from {', '.join(VARIANTS)}")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    results = []
    log_dir = f"{os.path.splitext(os.path.abspath(args.out))[0]}.logs"  # kept: why a variant failed
    os.makedirs(log_dir, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="mfu_") as work:
        for name in names:
            results.append(run_variant(name, args, work, log_dir))
            base = next((r for r in results if "tokens_per_sec" in r), results[-1])
            print(_line(results[-1], base), flush=True)
            with open(args.out, "w") as fh:  # after each variant: a run stopped from outside keeps what finished
                json.dump({"dry_run": args.dry_run, "steps": args.steps, "warmup": args.warmup, "results": results},
                          fh, indent=1)
    print(f"wrote {args.out}")
    return 0 if all("error" not in r for r in results) else 1


def _line(r: dict, base: dict) -> str:
    if "skipped" in r:
        return f"{r['variant']:16s} skipped: {r['skipped']}"
    if "error" in r:
        return f"{r['variant']:16s} failed: {r['error']} (log: {r['log']})"
    ratio = r["tokens_per_sec"] / base["tokens_per_sec"] if base.get("tokens_per_sec") and r["tokens_per_sec"] else 0
    mfu = "n/a" if r["mfu"] is None else f"{r['mfu']:.3f}"
    memory = "n/a" if r["peak_memory_gib"] is None else f"{r['peak_memory_gib']:.1f} GiB"
    step = "n/a" if r["step_time_p50_ms"] is None else f"{r['step_time_p50_ms']:.1f} ms"
    return (f"{r['variant']:16s} tokens/s {r['tokens_per_sec']:>10.0f}  MFU {mfu}  step p50 {step}  peak {memory}  "
            f"/ defaults {ratio:.3f}  first_step {(r['startup_phases_sec'] or {}).get('first_step')} s")


if __name__ == "__main__":
    sys.exit(main())
