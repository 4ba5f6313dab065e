"""One probing forward before any write: a collate_fn that makes no batch, a loss or metric that does not fit,
labels or token ids the model cannot take are bad input now, not at step 1."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from accelerate import Accelerator
from accelerate.utils import send_to_device

from accel_ddp.data.loaders import first_samples
from accel_ddp.tasks import finite
from accel_ddp.tasks import labels as label_check
from accel_ddp.tasks.protocol import Task
from accel_ddp.util.registry import describe
from accel_ddp.util.validation import ConfigError

if TYPE_CHECKING:
    from accel_ddp.data.resolve import Data



def probe_task(task: Task, accelerator: Accelerator, model, data: Data, evaluates: bool, loaders=None,
               skips_bad_inputs: bool = False) -> None:
    """One forward of two training samples: a collate_fn that makes no batch, a missing or non-scalar loss,
    logits that do not fit the labels, a metric that returns no numbers, labels or token ids the model cannot
    take, is bad input, reported before any write.

    Tuple samples with the default cross-entropy only need their shapes checked: the model runs without
    torch.compile's wrapper, which would otherwise compile an extra graph for it. With ``loaders``, the
    labels the probe found out of range are checked over the in-memory sets now, and over each host
    batch of the other loaders later (:mod:`accel_ddp.tasks.labels`). ``skips_bad_inputs`` (``--on_anomaly
    skip|rollback``): a nan/inf training input is an anomaly of its step (the loaders report it), not refused here.
    """
    collate = data.collate_fn or torch.utils.data.default_collate
    with torch.random.fork_rng(devices=[]):  # a sample's augmentation draws: the run's RNG stream stays as it was
        batch = collate(first_samples(data.train, 2))
    if (problem := not_a_batch(batch)) is not None:
        raise ConfigError(f"the collate_fn {describe(collate)} returned {problem}, not a batch; return a tuple "
                          "(inputs, labels, ...) or a dict of tensors (torch.utils.data.default_collate makes one)")
    forward = label_check.forward_ranges(task, model)
    if (line := label_check.problem(forward, batch, lambda row: f"training sample {row}")) is not None:
        raise ConfigError(line)  # before the forward that it would crash
    line = finite.in_memory_problem(data, training=not skips_bad_inputs) or \
        (None if skips_bad_inputs else finite.batch_problem(batch, lambda row: f"training sample {row}"))
    if line:
        raise ConfigError(line)  # not exit 3 and "lower --lr" at the first step that meets it
    batch = send_to_device(batch, accelerator.device)
    shapes_only = data.input_shape is not None and task.loss_fn is None
    outputs = task.check(getattr(model, "_orig_mod", model) if shapes_only else model, batch, evaluates, shapes_only)
    if loaders is not None:
        figures = label_check.figure_ranges(task, outputs, batch)
        label_check.check_before_training(task, forward, figures, data, loaders)


def not_a_batch(batch: Any) -> str | None:
    """What a collate_fn returned if it is no batch the tasks take (None: it is one): a tuple or list holding a
    tensor, or a mapping (a dict, Transformers' BatchEncoding) holding one."""
    values = batch.values() if isinstance(batch, Mapping) else batch if isinstance(batch, (tuple, list)) else None
    if values is not None and any(isinstance(value, torch.Tensor) for value in values):
        return None
    if batch is None:
        return "None"
    if isinstance(batch, torch.Tensor):
        return f"one tensor of shape {tuple(batch.shape)}"
    if isinstance(batch, (tuple, list, Mapping)):
        inside = {type(value).__name__ for value in values}
        return f"a {type(batch).__name__} of {len(batch)} without a tensor ({', '.join(sorted(inside)) or 'empty'})"
    return f"a {type(batch).__name__}"
