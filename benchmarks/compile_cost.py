"""What `--compile` and `--compile_regions` cost and save on this machine's CPU: the step's CPU time against eager, the
compile's, with a cold and a warm compile cache, and the run length at which the compile pays back (issue 49 item 2).

Workloads, one process each (no DDP: the compile is per rank, the same on each), fp32:

    lm    the tiny GPT-2 of docs/tasks.md (examples/configs/tiny_gpt2.json: 4 layers x 128, 2,048 tokens, dropout
          0.1) on random blocks of 128 tokens, batch 16 (a rank's share of docs/tasks.md's 32 over 2 ranks)
    cnn   --model mnist_cnn on synthetic 1x28x28 digits, global batch 64

Modes: eager, compile (Accelerate's torch.compile of the model, inductor), compile_regions (the LM's 4 blocks; the
CNN has no repeated blocks). Each compiled mode runs twice in fresh processes on one compile cache: first empty
(cold: what a fresh machine pays), then again (warm: inductor's FX graph and AOTAutograd caches hit; dynamo still
traces). TORCHINDUCTOR_COMPILE_THREADS=1 keeps the compile in the measured process (its workers' CPU would not be
counted). Per run: the CPU seconds from the process's start to the end of the first optimizer step (imports, set-up,
the start-up probe's forward and the first step: the compile wherever it happens), the median CPU milliseconds of
the steps after ``--warmup``, and from them

    break-even steps = (compiled CPU to step 1 - eager CPU to step 1) / (eager step - compiled step)

or "never" where the compiled step is not cheaper. CPU time (``time.process_time``), not wall: the development
machine is 2 cores shared by 8 sessions, so walls say little; CPU seconds still rise under load (caches, SMT),
so only ratios within one invocation mean anything.

    python benchmarks/compile_cost.py                    # both workloads, ~10 minutes of CPU on 2 cores
    python benchmarks/compile_cost.py --workloads cnn --steps 40
    python benchmarks/compile_cost.py --dry-run          # the plumbing: eager only, 3 steps
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODES = {"lm": ("eager", "compile", "compile_regions"), "cnn": ("eager", "compile")}


class StepClock:
    """CPU and wall time at each optimizer step's end (torch's global optimizer step hook: nothing in the run
    changes), the first mark counted from the process's start: imports, set-up, the probe and the first step,
    wherever the compile happens."""

    def __init__(self) -> None:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        self.started = time.perf_counter()
        self.marks: list[tuple[float, float]] = [(0.0, 0.0)]
        register_optimizer_step_post_hook(self.mark)

    def mark(self, optimizer, args, kwargs) -> None:
        self.marks.append((time.process_time(), time.perf_counter() - self.started))


def child(workload: str, mode: str, steps: int, warmup: int, out_dir: str) -> dict:
    """One run in this process: train ``steps`` steps, then the per-step CPU and wall figures."""
    sys.path.insert(0, str(REPO))
    clock = StepClock()
    import torch

    from accel_ddp import TrainConfig, train
    from accel_ddp.data.in_memory import TokenBlocks

    flags = {} if mode == "eager" else {mode: True}
    common = dict(max_steps=steps, warmup_steps=0, log_every=steps, output_dir=out_dir, **flags)
    if workload == "lm":
        from transformers import GPT2Config, GPT2LMHeadModel

        config = json.loads((REPO / "examples" / "configs" / "tiny_gpt2.json").read_text())
        config.pop("model_type")
        torch.manual_seed(0)
        model = GPT2LMHeadModel(GPT2Config(**config))
        blocks = torch.randint(0, config["vocab_size"], (16 * 8, 128), generator=torch.Generator().manual_seed(0))
        cfg = TrainConfig(task="causal_lm", global_batch_size=16, lr=1e-3, **common)
        train(cfg, model=model, train_dataset=TokenBlocks(blocks))
    else:
        cfg = TrainConfig(dataset="synthetic", synthetic_samples=64 * 8, model="mnist_cnn", global_batch_size=64,
                          eval_every=0, **common)
        train(cfg)
    cpu = [b[0] - a[0] for a, b in zip(clock.marks, clock.marks[1:], strict=False)]
    wall = [b[1] - a[1] for a, b in zip(clock.marks, clock.marks[1:], strict=False)]
    return {"first_step_cpu_s": cpu[0], "first_step_wall_s": wall[0],
            "step_cpu_ms": 1e3 * statistics.median(cpu[warmup:]),
            "step_wall_ms": 1e3 * statistics.median(wall[warmup:]),
            "steps": len(cpu)}


def run(workload: str, mode: str, cache: str, args: argparse.Namespace, work: str) -> dict:
    out = os.path.join(work, f"{workload}-{mode}-{time.monotonic_ns()}")
    cmd = [sys.executable, "-m", "benchmarks.compile_cost", "--child", f"{workload}:{mode}", "--steps", str(args.steps),
           "--warmup", str(args.warmup), "--work", out]
    env = {**os.environ, "PYTHONPATH": str(REPO), "TORCHINDUCTOR_CACHE_DIR": cache,
           "TRITON_CACHE_DIR": os.path.join(cache, "triton"), "TORCHINDUCTOR_COMPILE_THREADS": "1",
           "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=env, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {args.timeout:g} s"}
    if proc.returncode != 0:
        return {"error": " | ".join((proc.stderr or proc.stdout).strip().splitlines()[-3:])}
    return json.loads(Path(out + ".json").read_text())


def break_even(eager: dict, compiled: dict) -> float | None:
    """Optimizer steps after which the compiled run has spent less CPU than the eager one; None: never."""
    saved = eager["step_cpu_ms"] - compiled["step_cpu_ms"]
    extra = 1e3 * (compiled["first_step_cpu_s"] - eager["first_step_cpu_s"])
    return max(extra, 0.0) / saved if saved > 0 else None


def measure(args: argparse.Namespace) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory(prefix="compile_cost_") as work:
        for workload in args.workloads:
            eager = {"workload": workload, "mode": "eager", "cache": "-",
                     **run(workload, "eager", os.path.join(work, "unused-cache"), args, work)}
            rows.append(eager)
            print(_line(eager, eager), flush=True)
            for mode in MODES[workload][1:] if not args.dry_run else ():
                cache = os.path.join(work, f"{workload}-{mode}-cache")  # one per mode: empty, then warm
                for state in ("cold", "warm"):
                    figures = run(workload, mode, cache, args, work)
                    rows.append({"workload": workload, "mode": mode, "cache": state, **figures})
                    print(_line(rows[-1], eager), flush=True)
    return rows


def _line(row: dict, eager: dict) -> str:
    head = f"{row['workload']:4s} {row['mode']:16s} {row['cache']:5s}"
    if "error" in row:
        return f"{head} failed: {row['error']}"
    if "error" in eager:
        return f"{head} (no eager baseline)"
    if row is eager:
        return (f"{head} to step 1 {row['first_step_cpu_s']:7.2f} s CPU ({row['first_step_wall_s']:.2f} s wall)  "
                f"step {row['step_cpu_ms']:7.2f} ms CPU")
    ratio = row["step_cpu_ms"] / eager["step_cpu_ms"]
    even = break_even(eager, row)
    row.update(step_cpu_vs_eager=ratio, break_even_steps=even)
    return (f"{head} to step 1 {row['first_step_cpu_s']:7.2f} s CPU ({row['first_step_wall_s']:.2f} s wall)  "
            f"step {row['step_cpu_ms']:7.2f} ms CPU  x{ratio:.2f} eager  break-even "
            f"{'never' if even is None else f'{even:.0f} steps'}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="lm,cnn", help="comma-separated: lm, cnn")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps per run (default 30; dry 3)")
    parser.add_argument("--warmup", type=int, default=None, help="steps left out of the median (default 5; dry 1)")
    parser.add_argument("--child", help=argparse.SUPPRESS)  # workload:mode, in the process that trains
    parser.add_argument("--work", help=argparse.SUPPRESS)
    parser.add_argument("--timeout", type=float, default=600, help="seconds per run")
    parser.add_argument("--dry-run", action="store_true", help="eager only, 3 steps: the plumbing")
    parser.add_argument("--out", default=str(REPO / "outputs" / "compile_cost.json"), help="results file (JSON)")
    args = parser.parse_args(argv)
    dry_steps, dry_warmup = (3, 1) if args.dry_run else (30, 5)
    args.steps = args.steps or dry_steps
    args.warmup = dry_warmup if args.warmup is None else args.warmup
    if args.child:
        workload, mode = args.child.split(":")
        figures = child(workload, mode, args.steps, args.warmup, args.work)
        Path(args.work + ".json").write_text(json.dumps(figures))
        return 0
    args.workloads = args.workloads.split(",")
    unknown = [w for w in args.workloads if w not in MODES]
    if unknown:
        parser.error(f"unknown workload {unknown[0]}; choose from {', '.join(MODES)}")
    rows = measure(args)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    Path(args.out).write_text(json.dumps({"steps": args.steps, "warmup": args.warmup, "cpu_count": os.cpu_count(),
                                          "load_avg": os.getloadavg(), "results": rows}, indent=1))
    print(f"wrote {args.out}")
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
