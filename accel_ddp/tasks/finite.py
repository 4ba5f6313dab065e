"""Inputs that hold nan or inf, found before training where it costs one pass over data already in memory.

A nan input makes the loss nan at the step that meets it, whatever the learning rate: the run would stop with
exit 3 and the advice to lower --lr (``NonFiniteLoss``). So the training and eval sets held in memory (the device
loader's, a ``TensorDataset``) are checked once at start-up, every floating tensor of their inputs, and the start-up
probe's batch likewise: one line naming the sample, exit 2. Host batches of the DataLoader and streaming paths are
not checked one by one (a full pass over every image batch on the training thread); a nan among them still ends
with exit 3 at its step.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.utils.data import Subset, TensorDataset

from accel_ddp.data.in_memory import InMemoryDataset

FIX = "a nan or inf input makes the loss nan whatever --lr; clean the data or leave that sample out"


def first_non_finite_row(tensor: Any) -> int | None:
    """The first row (sample) of a floating tensor that holds a nan or inf, or None."""
    if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point() or tensor.dim() == 0:
        return None
    bad = ~torch.isfinite(tensor)
    if not bool(bad.any()):
        return None
    return int(bad.reshape(len(tensor), -1).any(dim=1).nonzero()[0])


def batch_problem(batch: Any, where: Callable[[int], str]) -> str | None:
    """The line for the first sample of ``batch`` (a tuple or a dict of tensors) whose floating values are not all
    finite (``where(row)`` names it), or None."""
    fields = batch.items() if isinstance(batch, Mapping) else enumerate(batch) if isinstance(batch, (tuple, list)) \
        else [(0, batch)]
    for key, tensor in fields:
        row = first_non_finite_row(tensor)
        if row is not None:
            field = f"its {key!r}" if isinstance(key, str) else "its input" if key == 0 else f"its field {key}"
            return f"{where(row)} holds nan or inf values ({field}); {FIX}"
    return None


def in_memory_inputs(dataset: Any) -> torch.Tensor | None:
    """The inputs of an in-memory dataset as stored (uint8 images: never nan), or None for any other dataset."""
    if isinstance(dataset, InMemoryDataset):
        return dataset.inputs
    if isinstance(dataset, TensorDataset) and dataset.tensors:
        return dataset.tensors[0]
    if isinstance(dataset, Subset):
        inner = in_memory_inputs(dataset.dataset)
        return None if inner is None else inner[torch.as_tensor(list(dataset.indices), dtype=torch.long)]
    return None


def in_memory_problem(data: Any) -> str | None:
    """The line for the first training or eval sample held in memory with a nan or inf input, or None."""
    for split, dataset in (("training", data.train), ("eval", data.eval)):
        inputs = None if dataset is None else in_memory_inputs(dataset)
        row = first_non_finite_row(inputs)
        if row is not None:
            return f"{split} sample {row} holds nan or inf input values; {FIX}"
    return None
