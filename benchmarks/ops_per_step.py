"""Host operations per optimizer step: ATen ops dispatched by accel_ddp's defaults against the bare loop's.

On a GPU each ATen op is (at least) one kernel launch from the host's Python thread; a small model's step is
bound by those launches, not by the kernels. So the count of ops dispatched per optimizer step is the CPU's view
of the launch overhead a GPU would pay, and it is exact and noise-free on the CPU (no timing involved).

A ``TorchDispatchMode`` (``OpCounter``) counts every op that reaches the dispatcher on the training thread
(forward, autograd's backward, the clipping, the optimizer, the loop's own tensor work), bucketed per optimizer
step by torch's global optimizer step post-hook. Each side trains one process (no DDP wrap on either side,
as ``tax.py`` runs a GPU), on matched work (``tax.py``'s "defaults" pair: AdamW, fused as both sides decide,
clipping at 1.0, the same model, batch and samples per step):

    accel   train.py's defaults (cosine schedule, logging every 10 steps, the preemption watch, the
            non-finite watch, token-exact loss on the lm), evaluations and epoch ends outside the counted steps
    bare    benchmarks/bare_ddp.py (plain torch: gather, forward, loss, backward, clip_grad_norm_, step, zero_grad)

Workloads: ``mlp`` (digits, 64-256-256-10, batch 64), ``cnn`` (mnist_cnn, batch 128), ``lm`` (the 4-layer GPT-2
of examples/configs/tiny_gpt2.json on packed 128-token blocks of examples/pydoc_text.py lm, batch 16).
Steps 1-2 are left out (first-step allocations, optimizer state); ``--steps`` steps after them are counted,
log steps included (the log line's ops are spread over --log_every steps, as a run pays them).

    python benchmarks/ops_per_step.py                    # mlp, cnn, lm: ops/step per side and the extra ops
    python benchmarks/ops_per_step.py --workloads mlp --steps 20 --json /tmp/ops.json

The last line per workload is ``accel - bare`` as a Counter of op names (per step). Target: within 3 ops per step.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SKIP = 2  # optimizer steps left out: the first step allocates the optimizer state, the second its first reuse
TARGET = 3  # ops per step accel_ddp may add to the bare loop (issue 38)


class OpCounter(TorchDispatchMode):
    """Counts the ATen ops dispatched on this thread, one ``Counter`` of op names per optimizer step.

        with OpCounter() as ops:      # installs torch's optimizer step post-hook too
            train(...)
        ops.per_step(skip=2, steps=20)   # the mean Counter over steps 3-22
    """

    def __init__(self):
        super().__init__()
        self.steps: list[Counter] = []  # one per optimizer step taken under the mode
        self._current: Counter = Counter()
        self._hook = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self._current[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))

    def _step_done(self, *_) -> None:
        self.steps.append(self._current)
        self._current = Counter()

    def __enter__(self):
        from torch.optim.optimizer import register_optimizer_step_post_hook

        self._hook = register_optimizer_step_post_hook(self._step_done)
        return super().__enter__()

    def __exit__(self, *exc):
        self._hook.remove()
        return super().__exit__(*exc)

    def per_step(self, skip: int = SKIP, steps: int | None = None) -> dict[str, float]:
        """Each op's mean count per optimizer step over ``steps`` steps after the first ``skip``."""
        chosen = self.steps[skip:] if steps is None else self.steps[skip:skip + steps]
        assert chosen, f"only {len(self.steps)} optimizer steps were counted"
        total: Counter = Counter()
        for counts in chosen:
            total.update(counts)
        return {name: count / len(chosen) for name, count in sorted(total.items())}


def difference(accel: dict[str, float], bare: dict[str, float]) -> dict[str, float]:
    """accel - bare per op name (per step), the ops with a non-zero difference only."""
    names = sorted(set(accel) | set(bare))
    return {name: round(accel.get(name, 0.0) - bare.get(name, 0.0), 3) for name in names
            if abs(accel.get(name, 0.0) - bare.get(name, 0.0)) > 1e-9}


# ----------------------------------------------------------------------------- one side, in a process of its own

LM_DATA = "{lm_data}"
WORKLOADS = {  # name: (accel_ddp flags, bare_ddp.py flags, global batch); tax.py's workloads
    "mlp": ([], ["--workload", "mlp"], 64),
    "cnn": (["--dataset", "benchmarks.common:mnist_split", "--model", "mnist_cnn"], ["--workload", "cnn"], 128),
    "lm": (["--task", "causal_lm", "--dataset", "hf", "--packing"], ["--workload", "lm"], 16),
}


def lm_flags(lm_data: str) -> list[str]:
    from benchmarks.common import TINY_GPT2_CONFIG

    return ["--model_config", str(TINY_GPT2_CONFIG), "--max_length", "128", "--tokenizer", f"{lm_data}/tokenizer",
            "--data_dir", lm_data, "--lr", "2e-3"]


def side_args(workload: str, side: str, steps: int, out: str, lm_data: str) -> list[str]:
    accel_flags, bare_flags, batch = WORKLOADS[workload]
    extra = lm_flags(lm_data) if workload == "lm" else []
    if side == "bare":  # one epoch; its first SKIP + steps steps are counted
        return [*bare_flags, *extra, "--optimizer", "adamw", "--max_grad_norm", "1.0", "--epochs", "1",
                "--global_batch_size", str(batch)]
    # The run ends after the counted steps (its final log line, evaluation and export come after the last one).
    return [*accel_flags, *extra, "--global_batch_size", str(batch), "--max_steps", str(SKIP + steps),
            "--eval_every", str(10 * (SKIP + steps)), "--output_dir", out]


def count_side(workload: str, side: str, steps: int, lm_data: str) -> dict[str, float]:
    """In this process: train one side under an ``OpCounter``; its mean ops per step by name."""
    with tempfile.TemporaryDirectory() as out:
        args = side_args(workload, side, steps, out, lm_data)
        if side == "bare":
            from benchmarks import bare_ddp
            from benchmarks.common import free_port

            os.environ.update({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                               "MASTER_PORT": str(free_port())})
            sys.argv = ["bare_ddp.py", *args]
            with OpCounter() as ops:
                bare_ddp.main()
        else:
            from accel_ddp.cli.args import parse_args
            from accel_ddp.loop import train

            config = parse_args(args)
            with OpCounter() as ops:
                train(config)
    if len(ops.steps) < SKIP + steps:
        raise SystemExit(f"{side} {workload}: {len(ops.steps)} optimizer steps, fewer than {SKIP + steps}")
    return ops.per_step(SKIP, steps)


def run_side(workload: str, side: str, steps: int, lm_data: str) -> dict[str, float]:
    """``count_side`` in a fresh interpreter (one thread, offline): nothing one side imported or cached helps the
    other."""
    from benchmarks.common import run_fresh

    # -m from the repository, as the tests import it
    return run_fresh(["-m", "benchmarks.ops_per_step", "--side", side, "--workloads", workload, "--steps", steps,
                      "--lm_data", lm_data])[0]


def main(argv: list[str] | None = None) -> int:
    from benchmarks.common import parser

    p = parser(__doc__, steps=(20, "optimizer steps counted per side (after the first 2)"),
               json=(None, "write every side's per-op counts here"))
    p.add_argument("--workloads", default="mlp,cnn,lm")
    p.add_argument("--side", choices=("accel", "bare"), help=argparse.SUPPRESS)  # one side, in this process
    p.add_argument("--lm_data", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    workloads = args.workloads.split(",")
    if args.side:
        print(json.dumps(count_side(workloads[0], args.side, args.steps, args.lm_data)))  # run_side reads it
        from benchmarks.common import exit_now

        exit_now()
    results, worst = {}, 0.0
    with tempfile.TemporaryDirectory() as tmp:
        lm_data = ""
        if "lm" in workloads:
            from benchmarks.common import pydoc_lm_folder

            lm_data = pydoc_lm_folder(Path(tmp))
        print(f"ATen ops per optimizer step (steps {SKIP + 1}-{SKIP + args.steps}), torch {torch.__version__}")
        print(f"{'workload':8} {'bare':>8} {'accel':>8} {'extra':>7}")
        for workload in workloads:
            bare = run_side(workload, "bare", args.steps, lm_data)
            accel = run_side(workload, "accel", args.steps, lm_data)
            extra = sum(accel.values()) - sum(bare.values())
            worst = max(worst, extra)
            results[workload] = {"bare": bare, "accel": accel, "extra": extra, "difference": difference(accel, bare)}
            print(f"{workload:8} {sum(bare.values()):8.1f} {sum(accel.values()):8.1f} {extra:+7.1f}")
            print(f"         accel - bare: {Counter(results[workload]['difference'])}")
    if args.json:
        from benchmarks.common import write_json

        write_json(args.json, {"steps": args.steps, "skip": SKIP, "results": results})
    print(f"target: accel within bare + {TARGET} ops per step: {'met' if worst <= TARGET else 'NOT met'}")
    return 0 if worst <= TARGET else 1


if __name__ == "__main__":
    sys.exit(main())
