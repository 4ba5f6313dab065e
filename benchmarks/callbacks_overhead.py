"""What callbacks cost per optimizer step: the same 2-process run with and without a callback that asks for nothing.

With callbacks, the ranks agree on their requests (stop, save, evaluate) after every step: one all-reduce of three
int64 over a CPU gloo group (accel_ddp/callbacks.py), a point where each rank's host waits for the others. Without
callbacks nothing is called. Each round launches both variants (``accelerate launch``, cpu_2proc.yaml, the same
arguments but ``--callbacks``), alternating which goes first; the figures per variant are the median over rounds
of the run's step-time median (summary.json's ``step_time_p50_ms``) and samples/s, and, with the callback, the
agreement's own wall time per step on each rank (timed around it in this script's worker mode); and, launched
once, the all-reduce alone, 2000 times back to back (its floor, with no step to wait for).

    python benchmarks/callbacks_overhead.py                       # mlp on synthetic data, 300 steps, 3 rounds
    python benchmarks/callbacks_overhead.py --model mnist_cnn --steps 100 --rounds 3
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import (  # noqa: E402
    alternated,
    bench_env,
    exit_now,
    launch_cmd,
    machine_info,
    median,
    parser,
    ratio,
    run_launch,
    tail,
)

SCRIPT = Path(__file__).resolve()
CALLBACK = "benchmarks.callbacks_overhead:AskNothing"


class AskNothing:
    """A callback that reads the state after every step and asks for nothing: the agreement runs every step."""

    def on_step_end(self, state):
        state.should_stop = state.step > state.max_steps


def _worker(argv: list[str]) -> None:
    """In each launched rank: ``main(argv)`` with the agreement timed; its per-step seconds into OUTPUT_DIR."""
    from accel_ddp.callbacks import Callbacks
    from accel_ddp.cli.train import main

    spent: list[float] = []
    agree = Callbacks._agree

    def timed(self, step):
        start = time.perf_counter()
        try:
            return agree(self, step)
        finally:
            spent.append(time.perf_counter() - start)

    Callbacks._agree = timed
    code = main(argv)
    out = Path(argv[argv.index("--output_dir") + 1])
    rank = os.environ.get("RANK", "0")
    (out / f"agree_rank{rank}.json").write_text(json.dumps(spent))
    exit_now(code)


def _micro(calls: int) -> None:
    """In each launched rank: ``calls`` all-reduces of the agreement's int64[3] on a CPU tensor over gloo, back to
    back (no training between them: the all-reduce's own floor, without a rank's step to wait for)."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    flags = torch.zeros(3, dtype=torch.int64)
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        times.append(time.perf_counter() - start)
    if dist.get_rank() == 0:
        times = sorted(times[calls // 10:])  # the first tenth warms the connections up
        print(f"MICRO {1e3 * median(times):.4f} {1e3 * times[int(0.9 * len(times))]:.4f}", flush=True)
    exit_now(0)


def _micro_figures(folder: Path, calls: int) -> tuple[float, float]:
    log = folder / "micro.log"
    result = run_launch(launch_cmd(SCRIPT, ["--micro", str(calls)], nproc=2), bench_env(1), log, 300)
    line = next((text for text in log.read_text().splitlines() if text.startswith("MICRO ")), None)
    if result["rc"] != 0 or line is None:
        sys.exit(f"the all-reduce alone failed ({result['rc']}):\n{tail(log, 80)}")
    p50, p90 = map(float, line.split()[1:])
    return p50, p90


def _train_args(model: str, steps: int, out: Path) -> list[str]:
    shape = ["1", "28", "28"] if model == "mnist_cnn" else ["1", "8", "8"]
    return ["--dataset", "synthetic", "--synthetic_samples", "8192", "--synthetic_shape", *shape, "--model", model,
            "--global_batch_size", "64", "--max_steps", str(steps), "--log_every", "50", "--eval_every", "100000",
            "--num_workers", "0", "--output_dir", str(out)]


def _one(model: str, steps: int, folder: Path, callbacks: bool) -> dict:
    out = folder / ("with" if callbacks else "without")
    args = [*_train_args(model, steps, out), *(["--callbacks", CALLBACK] if callbacks else [])]
    result = run_launch(launch_cmd(SCRIPT, ["--worker", *args], nproc=2), bench_env(1), folder / "launch.log", 600)
    if result["rc"] != 0:
        sys.exit(f"launch failed ({result['rc']}); see {folder / 'launch.log'}:\n{tail(folder / 'launch.log', 80)}")
    summary = json.loads((out / "summary.json").read_text())
    agree = [json.loads(p.read_text()) for p in sorted(out.glob("agree_rank*.json"))]
    per_step = [1e3 * sum(times) / max(len(times), 1) for times in agree if times]
    return {"step_ms": summary["step_time_p50_ms"], "samples_per_sec": summary["train_samples_per_sec"],
            "agree_ms": max(per_step) if per_step else 0.0, "agree_last_ms": min(per_step) if per_step else 0.0,
            "agreements": max(map(len, agree)) if agree else 0}


def main() -> None:
    p = parser(__doc__, steps=300, rounds=3)
    p.add_argument("--model", default="mlp", help="accel_ddp model (mlp, mnist_cnn)")
    args = p.parse_args()
    rows, info = {"without": [], "with": []}, machine_info()
    with tempfile.TemporaryDirectory() as tmp:
        micro = _micro_figures(Path(tmp), 2000)
        for round_ in range(args.rounds):
            for callbacks in alternated((False, True), round_):
                folder = Path(tmp) / f"r{round_}-{int(callbacks)}"
                folder.mkdir()
                rows["with" if callbacks else "without"].append(_one(args.model, args.steps, folder, callbacks))
    print(f"{args.model}, 2 processes over gloo, global batch 64, {args.steps} steps, {args.rounds} rounds; "
          f"{info['cpu']}, {info['cpus']} CPUs, load {info['load_avg_at_start'][0]:.1f} at the start, {info['date']}")
    for name, runs in rows.items():
        each = ", ".join(f"{r['step_ms']:.3f}" for r in runs)
        print(f"{name:8s} step p50 {median([r['step_ms'] for r in runs]):7.3f} ms  "
              f"samples/s {median([r['samples_per_sec'] for r in runs]):9.0f}  (rounds: {each} ms)")
    with_, without = rows["with"], rows["without"]
    with_ms, without_ms = median([r["step_ms"] for r in with_]), median([r["step_ms"] for r in without])
    print(f"step time with / without callbacks: {ratio(with_ms, without_ms, '.3f')}x "
          f"({with_ms - without_ms:+.3f} ms per step)")
    print(f"inside the agreement ({with_[0]['agreements']} per run), mean per step: the rank that waits most "
          f"{median([r['agree_ms'] for r in with_]):.3f} ms (waiting for the other to end its step), the other "
          f"{median([r['agree_last_ms'] for r in with_]):.3f} ms")
    print(f"the all-reduce alone, 2000 back to back: median {micro[0]:.3f} ms, p90 {micro[1]:.3f} ms per call")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        _worker(sys.argv[2:])
    elif sys.argv[1:2] == ["--micro"]:
        _micro(int(sys.argv[2]))
    else:
        main()
