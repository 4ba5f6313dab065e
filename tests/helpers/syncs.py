"""Counting host syncs (``.item()`` and the like) on a forked rank while it trains."""

from __future__ import annotations

from collections import Counter

import torch

from accel_ddp.cli.args import parse_args

# A run whose steps the overhead tests count: 512 samples of 6 numbers, 16 per step, SGD.
OVERHEAD_RUN = ["--dataset", "synthetic", "--synthetic_samples", "512", "--synthetic_shape", "6", "--model", "mlp",
        "--hidden_size", "16", "--global_batch_size", "16", "--optimizer", "sgd"]


HOST_SYNCS = ("item", "tolist", "__bool__", "__int__", "__float__")  # what makes a device tensor's value a Python one


def count_host_syncs(args: list[str]) -> Counter:
    """In a forked rank: train, counting every call that turns a tensor into a Python value."""
    from accel_ddp.loop import train

    counts: Counter = Counter()
    for name in HOST_SYNCS:
        original = getattr(torch.Tensor, name)

        def counting(self, *a, _original=original, _name=name, **k):
            counts[_name] += 1
            return _original(self, *a, **k)

        setattr(torch.Tensor, name, counting)
    train(parse_args(args))
    return counts
