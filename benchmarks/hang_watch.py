"""The per-step cost of --hang_timeout's watch (accel_ddp.lifecycle.hang), against --hang_timeout 0 in the same run.

Three figures:

1. ``HangWatch.step_done`` per call (what the loop pays per optimizer step: one attribute store; the watch's thread
   polls it) against an empty call, and the Python allocations of 100,000 calls (tracemalloc: expected none);
2. the alternative the issue named, ``faulthandler.dump_traceback_later`` re-armed per step: each call cancels and
   joins the previous timer thread and starts a new one (CPython's Modules/faulthandler.c);
3. whole training runs on one process (tiny MLP, synthetic data), --hang_timeout 0 and 600 alternated, median step
   time (summary.json's step_time_p50_ms) of each.

    python benchmarks/hang_watch.py --steps 400 --repeats 3
"""

from __future__ import annotations

import faulthandler
import os
import sys
import tempfile
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from accel_ddp.lifecycle.hang import HangWatch  # noqa: E402
from benchmarks.common import best_per_call, median, parser, ratio  # noqa: E402


def calls(folder: str, n: int) -> None:
    watch = HangWatch.start(600, folder, 0, pauses_after=lambda step: False)
    try:
        empty = best_per_call(lambda i: None, n)
        step_done = best_per_call(watch.step_done, n)
        tracemalloc.start()
        before = tracemalloc.take_snapshot()
        for i in range(100_000):
            watch.step_done(i)
        grown = sum(stat.size_diff for stat in tracemalloc.take_snapshot().compare_to(before, "filename")
                    if "hang.py" in str(stat.traceback))
        tracemalloc.stop()
    finally:
        watch.stop()
    with open(os.path.join(folder, "timer.txt"), "w") as out:
        rearm = best_per_call(lambda i: faulthandler.dump_traceback_later(600, file=out), n // 10)
        faulthandler.cancel_dump_traceback_later()
    print(f"per call: empty {empty * 1e9:.0f} ns, step_done {step_done * 1e9:.0f} ns "
          f"(+{(step_done - empty) * 1e9:.0f} ns), bytes allocated by hang.py over 100,000 calls: {grown}; "
          f"dump_traceback_later re-armed {rearm * 1e6:.1f} us ({rearm / step_done:.0f}x step_done)")


def runs(folder: str, steps: int, repeats: int) -> None:
    from accel_ddp.cli.args import parse_args
    from accel_ddp.loop import train

    medians: dict[str, list[float]] = {"0": [], "600": []}
    for repeat in range(repeats):
        for hang in medians:
            out = os.path.join(folder, f"run_{hang}_{repeat}")
            cfg = parse_args(["--dataset", "synthetic", "--synthetic_samples", "1024", "--synthetic_shape", "1", "8",
                              "8", "--model", "mlp", "--hidden_size", "32", "--global_batch_size", "32",
                              "--max_steps", str(steps), "--eval_every", "0", "--hang_timeout", hang,
                              "--output_dir", out])
            medians[hang].append(train(cfg)["step_time_p50_ms"])
    off, on = median(medians["0"]), median(medians["600"])
    print(f"training step p50 over {repeats} runs of {steps} steps: --hang_timeout 0 {off:.3f} ms, 600 {on:.3f} ms "
          f"(ratio {ratio(on, off, '.3f')}; each run's: 0 {medians['0']}, 600 {medians['600']})")


def main() -> None:
    p = parser(__doc__, steps=400, repeats=(3, "training runs per side; the median counts"))
    p.add_argument("--calls", type=int, default=200_000, help="calls per timing of step_done (5 timings, the best)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        calls(folder, args.calls)
        runs(folder, args.steps, args.repeats)


if __name__ == "__main__":
    main()
