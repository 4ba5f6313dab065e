"""Inputs that hold nan or inf, found before training where it costs one pass over data already in memory.

A nan input makes the loss nan at the step that meets it, whatever the learning rate: the run would stop with
exit 3 and the advice to lower --lr (``NonFiniteLoss``). So the training and eval sets held in memory (the device
loader's, a ``TensorDataset``) are checked once at start-up, every floating tensor of their inputs, and the start-up
probe's batch likewise: one line naming the sample, exit 2. Host batches of the DataLoader and streaming paths are
checked by the workers that make them (:mod:`accel_ddp.data.non_finite`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import Subset, TensorDataset

from accel_ddp.data.in_memory import InMemoryDataset
from accel_ddp.data.non_finite import FIX, batch_problem, first_non_finite_row

__all__ = ["FIX", "batch_problem", "first_non_finite_row", "in_memory_inputs", "in_memory_problem"]


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


def in_memory_problem(data: Any, training: bool = True) -> str | None:
    """The line for the first training (unless not ``training``) or eval sample held in memory with a nan or inf
    input, or None."""
    for split, dataset in (("training", data.train if training else None), ("eval", data.eval)):
        inputs = None if dataset is None else in_memory_inputs(dataset)
        row = first_non_finite_row(inputs)
        if row is not None:
            return f"{split} sample {row} holds nan or inf input values; {FIX}"
    return None
