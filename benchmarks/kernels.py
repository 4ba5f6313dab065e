"""What ``--fused_kernels`` and the causal-LM loss's shifted labels buy on the tiny GPT-2's step, one CPU thread.

The tiny GPT-2 of docs/tasks.md (examples/configs/tiny_gpt2.json: 4 layers, 128 wide, 2,048-token vocabulary),
16 random blocks of 128 tokens (a rank's micro-batch in tax.py and peers.py), dropout as configured, fused AdamW,
clipping 1.0: forward, loss, backward, clip, step, zero_grad, without DDP (what is measured is the model's kernels
and the loss, not the all-reduce). Variants, alternated in every round in one interpreter:

    before   the model's own activation modules, the loss of accel_ddp before this change: logits[:, :-1]
             flattened (a copy of the (B, T, vocab) logits; its backward fills and copies another)
    labels   the model's own activation modules, accel_ddp's causal-LM loss (labels shifted, logits as they are)
    fused    accel_ddp's defaults: the loss above and --fused_kernels (accel_ddp/fused_activations.py: torch's
             one-kernel tanh GELU in place of Transformers' Python one)

Printed: CPU ms per step (median and range over rounds, each round the mean of ``--steps`` steps) and each
variant's step time over ``before``'s, paired per round; then the loss alone (forward and backward on fixed
(16, 128, 2048) logits), sliced against shifted, where the whole step's spread would hide its few milliseconds.

    python benchmarks/kernels.py                    # 7 rounds of 10 steps
    python benchmarks/kernels.py --rounds 11 --steps 20
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from accel_ddp.fused_activations import fuse_activations  # noqa: E402
from accel_ddp.tasks.protocol import build_task  # noqa: E402
from benchmarks.common import tiny_gpt2  # noqa: E402


def sliced_logits_loss(outputs, batch) -> torch.Tensor:
    """accel_ddp's causal-LM loss before the labels were shifted instead of the logits."""
    logits, ids = outputs.logits, batch["input_ids"]
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten(), reduction="sum")


def build_variants(blocks: torch.Tensor) -> dict:
    """name -> a function running one optimizer step on the next block."""
    torch.manual_seed(0)
    reference = tiny_gpt2()
    task = build_task("causal_lm")
    variants = {}
    for name in ("before", "labels", "fused"):
        model = copy.deepcopy(reference).train()
        if name == "fused":
            fuse_activations(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
        loss_of = sliced_logits_loss if name == "before" else (lambda out, batch: task.default_loss(out, batch).value)
        variants[name] = _stepper(model, optimizer, loss_of, blocks)
    return variants


def _stepper(model, optimizer, loss_of, blocks):
    position = [0]

    def step() -> None:
        batch = {"input_ids": blocks[position[0] % len(blocks)]}
        position[0] += 1
        loss_of(model(**batch), batch).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def loss_alone(rounds: int, steps: int) -> dict[str, list[float]]:
    """CPU ms of the causal-LM loss's forward and backward on fixed logits: sliced (before) and accel_ddp's."""
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(16, 128, 2048, generator=generator, requires_grad=True)
    batch = {"input_ids": torch.randint(0, 2048, (16, 128), generator=generator)}
    task = build_task("causal_lm")
    losses = {"before": lambda out: sliced_logits_loss(out, batch),
              "labels": lambda out: task.default_loss(out, batch).value}
    outputs = type("Outputs", (), {"logits": logits})()
    times = {name: [] for name in losses}
    for round_ in range(rounds):
        for name in (list(losses) if round_ % 2 == 0 else list(reversed(losses))):
            started = time.process_time()
            for _ in range(steps):
                logits.grad = None
                losses[name](outputs).backward()
            times[name].append(1e3 * (time.process_time() - started) / steps)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=10, help="steps timed per variant and round")
    args = parser.parse_args()
    torch.set_num_threads(1)  # as each of two ranks on two cores
    blocks = torch.randint(0, 2048, (8, 16, 128), generator=torch.Generator().manual_seed(0))
    variants = build_variants(blocks)
    for step in variants.values():  # warm-up: allocator, kernels' first calls
        for _ in range(3):
            step()
    times = {name: [] for name in variants}
    for round_ in range(args.rounds):
        order = list(variants) if round_ % 2 == 0 else list(reversed(variants))
        for name in order:
            started = time.process_time()
            for _ in range(args.steps):
                variants[name]()
            times[name].append(1e3 * (time.process_time() - started) / args.steps)
    print(f"tiny GPT-2 step, 16 x 128 tokens, one thread, {args.rounds} alternated rounds of {args.steps} steps")
    for name, values in times.items():
        ratios = [v / b for v, b in zip(values, times["before"], strict=True)]
        print(f"{name:7s} CPU ms/step {statistics.median(values):7.1f} [{min(values):.1f}-{max(values):.1f}]   "
              f"/ before {statistics.median(ratios):.3f} [{min(ratios):.3f}-{max(ratios):.3f}]")
    alone = loss_alone(args.rounds, 2 * args.steps)
    print(f"the loss alone, forward and backward on (16, 128, 2048) logits, {args.rounds} rounds of {2 * args.steps}")
    for name, values in alone.items():
        print(f"{name:7s} CPU ms {statistics.median(values):7.2f} [{min(values):.2f}-{max(values):.2f}]")


if __name__ == "__main__":
    main()
