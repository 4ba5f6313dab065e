"""What the LoRA base's fingerprint of every value costs (accel_ddp.transforms.finetune.base_fingerprint), on a
frozen GPT-2 of 124M parameters built from its config (random weights, nothing downloaded), against the sampled
fingerprint of earlier versions and a bare sha256 of the same bytes in one call (the floor), in the same invocation.

    python -m benchmarks.base_fingerprint --repeats 3

Issue 50 item 7 asked: hash at every start if it costs under 1 s for a 124M model, else only when the base's files
changed size or mtime. The figures (docs/checkpoints.md) decided for every start.
"""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import best_per_call, parser, ratio  # noqa: E402


def gpt2_124m() -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config()).requires_grad_(False)  # GPT-2 small's config: 124,439,808 parameters


def best_of(repeats: int, fn) -> float:
    """Seconds of one call of ``fn()``, the best of ``repeats``."""
    return best_per_call(lambda _: fn(), 1, repeats)


def main() -> None:
    args = parser(__doc__, repeats=(3, "timings of each; the best counts")).parse_args()
    from accel_ddp.transforms.finetune import base_fingerprint, sampled_fingerprint

    model = gpt2_124m()
    params = list(model.parameters())  # each tensor once (lm_head is tied to wte)
    nbytes = sum(p.numel() * p.element_size() for p in params)
    flat = torch.cat([p.detach().reshape(-1) for p in params]).view(torch.uint8).numpy()
    floor = best_of(args.repeats, lambda: hashlib.sha256(flat.data).hexdigest())
    full = best_of(args.repeats, lambda: base_fingerprint(model))
    sampled = best_of(args.repeats, lambda: sampled_fingerprint(model))
    load = os.getloadavg()[0]
    print(f"GPT-2 124M, {sum(p.numel() for p in params):,} parameters, {nbytes / 2**20:,.0f} MiB float32; "
          f"{os.cpu_count()} CPUs, load average {load:.1f}; best of {args.repeats}")
    print(f"  sha256 of the bytes in one call (floor)  {floor:6.3f} s")
    print(f"  base_fingerprint (every value)           {full:6.3f} s  ({ratio(full, floor)}x the floor)")
    print(f"  sampled_fingerprint (earlier versions)   {sampled:6.3f} s")


if __name__ == "__main__":
    main()
