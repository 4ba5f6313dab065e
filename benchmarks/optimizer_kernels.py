"""One optimizer step per implementation (per tensor, multi-tensor ``foreach``, ``fused``) on the benchmark models.

Why accel_ddp asks for the fused kernels on the CPU too (``accel_ddp/optim.py``, ``use_fused_optimizer``):
this prints the best-of-repeats milliseconds of one ``step()`` with gradients in place, one thread by
default, for AdamW and for SGD (momentum 0.9, Nesterov), on the mlp, mnist_cnn and the tiny GPT-2 of
examples/configs/tiny_gpt2.json (when transformers is installed).

    python benchmarks/optimizer_kernels.py
    python benchmarks/optimizer_kernels.py --threads 2 --repeats 7
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from accel_ddp.models import build_model  # noqa: E402
from benchmarks.common import tiny_gpt2  # noqa: E402

KERNELS = {"per tensor": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}


def models() -> dict[str, torch.nn.Module]:
    found = {"mlp": build_model("mlp", 10, (1, 8, 8)), "mnist_cnn": build_model("mnist_cnn", 10, (1, 28, 28))}
    try:
        found["tiny_gpt2"] = tiny_gpt2()
    except ImportError:  # no transformers
        pass
    return found


def step_ms(params: list[torch.Tensor], make, repeats: int, steps: int) -> float:
    optimizer = make(params)
    for _ in range(3):  # state allocated, caches warm
        optimizer.step()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(steps):
            optimizer.step()
        best = min(best, (time.perf_counter() - start) / steps)
    return best * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--steps", type=int, default=20)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {args.threads} thread(s), best of {args.repeats} x {args.steps} steps, ms/step")
    print(f"{'model':10} {'parameters':>10} {'optimizer':9} " + " ".join(f"{k:>10}" for k in KERNELS)
          + f" {'fused vs foreach':>17}")
    for name, model in models().items():
        params = [q for q in model.parameters() if q.requires_grad]
        for q in params:
            q.grad = torch.randn_like(q)
        count = sum(q.numel() for q in params)
        for opt_name, build in (("adamw", lambda ps, kw: torch.optim.AdamW(ps, lr=1e-4, **kw)),
                                ("sgd", lambda ps, kw: torch.optim.SGD(ps, lr=1e-4, momentum=0.9, nesterov=True,
                                                                       **kw))):
            times = {k: step_ms(params, lambda ps, kw=kw, b=build: b(ps, kw), args.repeats, args.steps)
                     for k, kw in KERNELS.items()}
            print(f"{name:10} {count:>10,} {opt_name:9} " + " ".join(f"{t:>10.3f}" for t in times.values())
                  + f" {times['foreach'] / times['fused']:>16.2f}x")


if __name__ == "__main__":
    main()
