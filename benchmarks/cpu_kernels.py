"""What the CPU kernels accel_ddp picks buy: ``--fused_kernels``, the causal-LM loss's shifted labels, the fused
optimizer; one CPU thread (``--threads``), as each of two ranks on two cores.

Three parts (``--part``, comma separated; all by default):

``step`` and ``loss``: the tiny GPT-2 of docs/tasks.md (examples/configs/tiny_gpt2.json: 4 layers, 128 wide,
2,048-token vocabulary), 16 random blocks of 128 tokens (a rank's micro-batch in tax.py and peers.py), dropout as
configured, fused AdamW, clipping 1.0: forward, loss, backward, clip, step, zero_grad, without DDP (what is
measured is the model's kernels and the loss, not the all-reduce). Variants, alternated in every round in one
interpreter:

    before   the model's own activation modules, the loss of accel_ddp before this change: logits[:, :-1]
             flattened (a copy of the (B, T, vocab) logits; its backward fills and copies another)
    labels   the model's own activation modules, accel_ddp's causal-LM loss (labels shifted, logits as they are)
    fused    accel_ddp's defaults: the loss above and --fused_kernels
             (accel_ddp/transforms/fused_activations.py: torch's one-kernel tanh GELU in place of Transformers'
             Python one)

Printed: CPU ms per step (median and range over rounds, each round the mean of ``--steps`` steps) and each
variant's step time over ``before``'s, paired per round; then the loss alone (forward and backward on fixed
(16, 128, 2048) logits), sliced against shifted, where the whole step's spread would hide its few milliseconds.

``optimizer``: why accel_ddp asks for the fused optimizer kernels on the CPU too (``accel_ddp/optim/build.py``,
``use_fused_optimizer``): the best-of-``--repeats`` milliseconds of one ``step()`` with gradients in place, per
implementation (per tensor, multi-tensor ``foreach``, ``fused``), for AdamW and for SGD (momentum 0.9, Nesterov),
on the mlp, mnist_cnn and the tiny GPT-2.

    python benchmarks/cpu_kernels.py --part step,loss         # 7 rounds of 10 steps
    python benchmarks/cpu_kernels.py --part step,loss --rounds 11 --steps 20
    python benchmarks/cpu_kernels.py --part optimizer --threads 2 --repeats 7
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from accel_ddp.models import build_model  # noqa: E402
from accel_ddp.tasks.protocol import build_task  # noqa: E402
from accel_ddp.transforms.fused_activations import fuse_activations  # noqa: E402
from benchmarks.common import alternated, best_per_call, cpu_ms_per_call, parser, spread, tiny_gpt2  # noqa: E402

PARTS = ("step", "loss", "optimizer")
OPTIMIZER_KERNELS = {"per tensor": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}


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
        for name in alternated(losses, round_):
            times[name].append(cpu_ms_per_call(lambda name=name: _loss_step(losses[name], outputs, logits), steps))
    return times


def _loss_step(loss, outputs, logits) -> None:
    logits.grad = None
    loss(outputs).backward()


def step_part(rounds: int, steps: int) -> None:
    """CPU ms per optimizer step of each variant, alternated, and its ratio to ``before`` paired per round."""
    blocks = torch.randint(0, 2048, (8, 16, 128), generator=torch.Generator().manual_seed(0))
    variants = build_variants(blocks)
    for step in variants.values():  # warm-up: allocator, kernels' first calls
        for _ in range(3):
            step()
    times = {name: [] for name in variants}
    for round_ in range(rounds):
        for name in alternated(variants, round_):
            times[name].append(cpu_ms_per_call(variants[name], steps))
    print(f"tiny GPT-2 step, 16 x 128 tokens, one thread, {rounds} alternated rounds of {steps} steps")
    for name, values in times.items():
        ratios = [v / b for v, b in zip(values, times["before"], strict=True)]
        print(f"{name:7s} CPU ms/step {spread(values, '.1f')}   / before {spread(ratios, '.3f')}")


def loss_part(rounds: int, steps: int) -> None:
    alone = loss_alone(rounds, steps)
    print(f"the loss alone, forward and backward on (16, 128, 2048) logits, {rounds} rounds of {steps}")
    for name, values in alone.items():
        print(f"{name:7s} CPU ms {spread(values, '.2f')}")


def optimizer_models() -> dict[str, torch.nn.Module]:
    found = {"mlp": build_model("mlp", 10, (1, 8, 8)), "mnist_cnn": build_model("mnist_cnn", 10, (1, 28, 28))}
    try:
        found["tiny_gpt2"] = tiny_gpt2()
    except ImportError:  # no transformers
        pass
    return found


def optimizer_step_ms(params: list[torch.Tensor], make, repeats: int, steps: int) -> float:
    optimizer = make(params)
    for _ in range(3):  # state allocated, caches warm
        optimizer.step()
    return best_per_call(lambda _: optimizer.step(), steps, repeats) * 1e3


def optimizer_part(threads: int, repeats: int, steps: int) -> None:
    """ms per ``step()`` per implementation, the best of ``repeats`` timings of ``steps`` steps."""
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {threads} thread(s), best of {repeats} x {steps} steps, ms/step")
    print(f"{'model':10} {'parameters':>10} {'optimizer':9} " + " ".join(f"{k:>10}" for k in OPTIMIZER_KERNELS)
          + f" {'fused vs foreach':>17}")
    for name, model in optimizer_models().items():
        params = [q for q in model.parameters() if q.requires_grad]
        for q in params:
            q.grad = torch.randn_like(q)
        count = sum(q.numel() for q in params)
        for opt_name, build in (("adamw", lambda ps, kw: torch.optim.AdamW(ps, lr=1e-4, **kw)),
                                ("sgd", lambda ps, kw: torch.optim.SGD(ps, lr=1e-4, momentum=0.9, nesterov=True,
                                                                       **kw))):
            times = {k: optimizer_step_ms(params, lambda ps, kw=kw, b=build: b(ps, kw), repeats, steps)
                     for k, kw in OPTIMIZER_KERNELS.items()}
            print(f"{name:10} {count:>10,} {opt_name:9} " + " ".join(f"{t:>10.3f}" for t in times.values())
                  + f" {times['foreach'] / times['fused']:>16.2f}x")


def main() -> None:
    p = parser(__doc__, rounds=(7, "step, loss: alternated rounds"),
               steps=(10, "step: steps timed per variant and round (loss: twice as many)"),
               threads=(1, "torch threads"), repeats=(5, "optimizer: timings of --optimizer_steps steps; the best"))
    p.add_argument("--part", default=",".join(PARTS), help=f"comma separated, from {','.join(PARTS)}")
    p.add_argument("--optimizer_steps", type=int, default=20, help="optimizer: steps per timing")
    args = p.parse_args()
    parts = [x for x in args.part.split(",") if x]
    if bad := [x for x in parts if x not in PARTS]:
        p.error(f"unknown part(s) {bad}; choose from {', '.join(PARTS)}")
    torch.set_num_threads(args.threads)
    if "step" in parts:
        step_part(args.rounds, args.steps)
    if "loss" in parts:
        loss_part(args.rounds, 2 * args.steps)
    if "optimizer" in parts:
        optimizer_part(args.threads, args.repeats, args.optimizer_steps)


if __name__ == "__main__":
    main()
