"""glibc's malloc thresholds pinned (accel_ddp/util/host_memory.py) against glibc's moving defaults, on one step.

The tiny GPT-2 of docs/tasks.md (examples/configs/tiny_gpt2.json), 8 random blocks of 128 tokens, fused AdamW,
clipping 1.0: forward, backward, clip, step, zero_grad, as a CPU rank runs them, without DDP (what is measured is
the allocator, not the all-reduce). Each side runs in fresh interpreters (the thresholds are per process and move
with what a process has freed), alternated in pairs; ``--processes 2`` runs two copies of a side at once, as two
ranks load both cores. Printed per run: CPU ms per step and page faults per step, after 8 warm-up steps.

    python benchmarks/host_memory.py                     # 3 pairs, one process at a time
    python benchmarks/host_memory.py --processes 2       # both cores busy
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import REPO, alternated, median, parser, run_fresh  # noqa: E402

WARMUP, STEPS = 8, 40


def one_run(side: str) -> dict:
    """In a fresh interpreter: ``side`` "pinned" or "default"; CPU ms and page faults per step."""
    import resource
    import time

    if side == "pinned":
        from accel_ddp.util.host_memory import keep_freed_host_memory

        if keep_freed_host_memory() != "pinned":
            raise SystemExit("glibc's thresholds could not be pinned here (not glibc, or set in the environment)")
    import torch

    from benchmarks.common import tiny_gpt2

    torch.manual_seed(0)
    model = tiny_gpt2()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    blocks = torch.randint(0, model.config.vocab_size, (16, 8, 128))

    def step(i: int) -> None:
        batch = blocks[i % len(blocks)]
        model(input_ids=batch, labels=batch).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for i in range(WARMUP):
        step(i)
    cpu, faults = time.process_time(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for i in range(STEPS):
        step(i)
    return {"side": side, "cpu_ms_per_step": 1e3 * (time.process_time() - cpu) / STEPS,
            "faults_per_step": (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults) / STEPS}


def launch(side: str, processes: int) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    env.update({"OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "PYTHONWARNINGS": "ignore",
                "TRANSFORMERS_VERBOSITY": "error"})  # the tiny config's token-id notes, per run
    return run_fresh([__file__, "--child", side], env, copies=processes)


def main() -> None:
    p = parser(__doc__, processes=(1, "copies of a side run at once (2: both cores)"))
    p.add_argument("--pairs", type=int, default=3, help="alternated pairs (default first in even pairs)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(one_run(args.child)))
        return
    runs = []
    for pair in range(args.pairs):
        for side in alternated(("default", "pinned"), pair):
            for run in launch(side, args.processes):
                runs.append(run)
                print(f"  pair {pair} {side:8} {run['cpu_ms_per_step']:7.1f} CPU ms/step "
                      f"{run['faults_per_step']:8.0f} faults/step", flush=True)
    for side in ("default", "pinned"):
        mine = [r for r in runs if r["side"] == side]
        print(f"{side:8} median {median([r['cpu_ms_per_step'] for r in mine]):7.1f} CPU ms/step "
              f"{median([r['faults_per_step'] for r in mine]):8.0f} faults/step ({len(mine)} runs, "
              f"{args.processes} at a time)")


if __name__ == "__main__":
    main()
