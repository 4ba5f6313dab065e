"""Labels and token ids against what the model takes, checked where it costs no device sync.

A class label past the model's outputs, or a token id past its vocabulary, fails inside the
forward or the loss: an IndexError on the rank that met it (its peers then die in a collective
with a gloo traceback), on CUDA a device-side assert that poisons the process's CUDA context. So
the start-up probe learns the ranges (:func:`forward_ranges` before its forward: the embedding
size, a Transformers classifier's ``num_labels``; :func:`figure_ranges` after it: the logits'
last dimension) and they are checked

- on the probe batch before its forward, and once over every label of an in-memory training
  and eval set (:func:`check_before_training`): bad input on every rank at start-up, one line;
- on the host, before the copy to the device, for each batch of the DataLoader, streaming and
  eval DataLoader paths (``loader.batch_check``, :func:`batch_check`): a few elementwise
  operations on a CPU tensor, naming the sample and the step.

Only integer tensors are checked, and ``IGNORE_INDEX`` (-100) counts for nothing. Labels of a
task whose figures do not fit the outputs (a user's loss on other outputs) are the user's business.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import partial
from typing import Any, NamedTuple

import torch
from accelerate.utils import extract_model_from_parallel

from accel_ddp.data.bundle import DataError
from accel_ddp.data.in_memory import in_memory_labels
from accel_ddp.tasks.batches import labels_of
from accel_ddp.tasks.protocol import IGNORE_INDEX, Task, logits_of
from accel_ddp.util.validation import ConfigError


class IdRange(NamedTuple):
    """Where a batch holds ids (a tuple's index or a dict key) and how many the model takes (0 .. limit - 1)."""

    key: int | str
    limit: int
    what: str  # "classes" or "vocabulary": how the line names the range

    def describe(self, value: int) -> str:
        if self.what == "classes":
            fix = f"or give the model {value + 1} outputs or more" if value >= 0 else f"({IGNORE_INDEX} is ignored)"
            return (f"label {value}, outside the model's {self.limit} classes (0 to {self.limit - 1}); "
                    f"fix the label {fix}")
        return (f"token id {value} in {self.key!r}, outside the model's vocabulary of {self.limit} (its embedding "
                "size); tokenize with the model's own tokenizer (--tokenizer), or resize its embeddings")


def forward_ranges(task: Task, model: torch.nn.Module) -> list[IdRange]:
    """What the forward itself needs, from the model object: its input embedding's size (``input_ids``), and a
    Transformers classifier's ``num_labels`` (``labels``, from which it computes its own loss)."""
    module = extract_model_from_parallel(model)
    ranges = []
    embeddings = module.get_input_embeddings() if callable(getattr(module, "get_input_embeddings", None)) else None
    if isinstance(embeddings, torch.nn.Embedding):
        ranges.append(IdRange("input_ids", embeddings.num_embeddings, "vocabulary"))
    # Transformers' classifiers (sequence, token) set self.num_labels and compute their loss from `labels`; a
    # config's num_labels alone says nothing (every config has one, 2 by default).
    num_labels = getattr(module, "num_labels", None)
    if not task.counts_tokens and isinstance(num_labels, int) and num_labels > 1:  # 1: a regression head
        ranges.append(IdRange("labels", num_labels, "classes"))
    return ranges


def figure_ranges(task: Task, outputs: Any, batch: Any) -> list[IdRange]:
    """What the task's default loss and eval figures need, from the probe's logits (when they fit the task): their
    last dimension is the number of classes, or for ``causal_lm`` the vocabulary (``input_ids``, ``labels``)."""
    logits = logits_of(outputs)
    if not isinstance(logits, torch.Tensor) or task.stats_problem(outputs, batch) is not None:
        return []
    if task.counts_tokens:
        return [IdRange(key, logits.shape[-1], "vocabulary") for key in ("input_ids", "labels")
                if isinstance(batch, Mapping) and key in batch]
    if labels_of(batch).is_floating_point():  # class probabilities: nothing to index with
        return []
    return [IdRange("labels" if isinstance(batch, Mapping) else 1, logits.shape[-1], "classes")]


def first_out_of_range(ranges: list[IdRange], batch: Any) -> tuple[IdRange, int, int] | None:
    """``(range, row, value)`` of the first id in ``batch`` outside its range, or None. Elementwise work only; a
    host sync where the batch is on a GPU, so call it on CPU batches (or once, at start-up)."""
    for found in ranges:
        values = _field(batch, found.key)
        if not isinstance(values, torch.Tensor) or values.is_floating_point() or values.dtype == torch.bool:
            continue
        if values.numel() == 0:
            continue
        low, high = (int(v) for v in torch.aminmax(values))  # one pass; the mask below only when one is bad
        if low == IGNORE_INDEX:  # padding and prompts count for nothing: the smallest id that counts
            low = int(values.masked_fill(values == IGNORE_INDEX, 0).min())
        if 0 <= low and high < found.limit:
            continue
        bad = (values >= found.limit) | ((values < 0) & (values != IGNORE_INDEX))
        per_row = (lambda t: t.reshape(len(t), -1)) if values.ndim else (lambda t: t.reshape(1, 1))
        rows, ids = per_row(bad), per_row(values)
        row = int(rows.any(dim=1).nonzero()[0])
        return found, row, int(ids[row][rows[row]][0])
    return None


def problem(ranges: list[IdRange], batch: Any, where: Callable[[int], str]) -> str | None:
    """The line for the first id out of range in ``batch`` (``where(row)`` names its sample), or None."""
    if (bad := first_out_of_range(ranges, batch)) is None:
        return None
    found, row, value = bad
    return f"{where(row)} has {found.describe(value)}"


def check_before_training(task: Task, forward: list[IdRange], figures: list[IdRange], data, loaders) -> None:
    """After the probe: every label of an in-memory training and eval set now (bad input on every rank alike),
    and ``batch_check`` hooks on the loaders that serve host batches (checked before each copy to the device).

    ``forward`` ranges hold for every batch. ``figures`` ranges serve the task's default loss and eval
    figures: with a user loss they do not apply to training batches (that loss says what its labels
    mean), and an in-memory eval set beyond them leaves the task's figures out (one note) instead.
    """
    user_loss = task.loss_fn is not None
    training = forward if user_loss else merged(forward, figures)
    evaluation = merged(forward, figures)
    if (line := _in_memory_problem(training, data.train, "training")) is not None:
        raise ConfigError(line)
    if (line := _in_memory_problem(forward, data.eval, "eval")) is not None:
        raise ConfigError(line)
    if (line := _in_memory_problem(evaluation, data.eval, "eval")) is not None:  # beyond the task's figures
        if not user_loss:
            raise ConfigError(line)
        task.leave_out_stats(line)
        evaluation = forward
    if hasattr(loaders.train, "batch_check"):  # the DataLoader path and streaming; the device loader was checked
        loaders.train.batch_check = batch_check(training)
    if loaders.eval is not None and not getattr(loaders.eval, "sums_across_ranks", False):  # evaluate() calls it
        loaders.eval.batch_check = batch_check(evaluation)


def merged(forward: list[IdRange], figures: list[IdRange]) -> list[IdRange]:
    """Both lists, one range per place in the batch: the smaller limit where both name it."""
    ranges: dict[int | str, IdRange] = {}
    for found in forward + figures:
        if found.key not in ranges or found.limit < ranges[found.key].limit:
            ranges[found.key] = found
    return list(ranges.values())


def _in_memory_problem(ranges: list[IdRange], dataset, split: str) -> str | None:
    labels = None if dataset is None else in_memory_labels(dataset)
    tuple_ranges = [r for r in ranges if r.key == 1]  # in-memory sets are (input, label) pairs
    if labels is None or not tuple_ranges:
        return None
    return problem(tuple_ranges, (None, labels), lambda row: f"{split} sample {row}")


def batch_check(ranges: list[IdRange]) -> Callable[[Any, Callable[[int], str]], None] | None:
    """The ``loader.batch_check`` hook for these ranges (None without any): ``check(batch, where)`` raises
    DataError naming ``where(row)`` for the first id out of range in a host batch."""
    return partial(_check_batch, ranges) if ranges else None


def _check_batch(ranges: list[IdRange], batch: Any, where: Callable[[int], str]) -> None:
    if (line := problem(ranges, batch, where)) is not None:
        raise DataError(line)


def _field(batch: Any, key: int | str) -> Any:
    if isinstance(batch, Mapping):
        return batch.get(key) if isinstance(key, str) else None
    if isinstance(key, int) and isinstance(batch, (tuple, list)) and len(batch) > key:
        return batch[key]
    return None
