"""``train()``'s arguments checked at the door: a model and datasets of the right kind, or one line (the config
itself: ``loop.train``).

Without it a wrong kind fails deep inside the run, in words that name our code, not the argument: a string as the
model ("'str' object has no attribute 'to'"), a dict as the config ("'dict' object has no attribute
'with_tracking'"), a list of numbers as a dataset ("'int' object is not subscriptable", from the collate). The
check costs one read of a map-style dataset's first sample; an iterable dataset is not read (its first sample would
be gone).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from accel_ddp.util.validation import ConfigError


class ArgumentError(ConfigError, TypeError):
    """An argument of ``train()`` of the wrong kind: bad input (exit 2, one line), and a ``TypeError`` for callers."""


def check_arguments(model: Any, train_dataset: Any, eval_dataset: Any, *, model_name: str, dataset_name: str) -> None:
    """Raise ``ArgumentError`` naming the first argument of the wrong kind; nothing is built before this.
    ``model_name``, ``dataset_name``: the run's --model and --dataset, what leaving the argument out gives."""
    if model is not None and not isinstance(model, torch.nn.Module):
        raise ArgumentError(f"model= must be a torch.nn.Module, not {a_kind(model)}; or leave it out to build "
                            f"--model {model_name}")
    for name, dataset in (("train_dataset", train_dataset), ("eval_dataset", eval_dataset)):
        if dataset is not None and (problem := dataset_problem(dataset)) is not None:
            raise ArgumentError(f"{name}= must be a {problem}; or leave it out to use --dataset {dataset_name}")


def dataset_problem(dataset: Any) -> str | None:
    """What is wrong with ``dataset`` as a training or eval set (words that follow "must be a"), or None."""
    if isinstance(dataset, torch.utils.data.IterableDataset) or _is_stream(dataset):
        return None  # read as a stream: its samples are checked where they are batched
    if isinstance(dataset, (str, bytes, Mapping)) or not (hasattr(dataset, "__getitem__")
                                                          and hasattr(dataset, "__len__")):
        return f"Dataset (a torch.utils.data.Dataset, a datasets.Dataset), not {a_kind(dataset)}"
    try:
        if len(dataset) == 0:
            return None  # said later, with the batch size it cannot fill
        sample = dataset[0]
    except Exception:  # noqa: BLE001 - the user's own read fails: the run reports it where it reads, on its rank
        return None
    if isinstance(sample, (torch.Tensor, Mapping, tuple, list)) or hasattr(sample, "__array__"):
        return None
    return f"Dataset of tensors, tuples or dicts: its sample 0 is {a_kind(sample)} ({sample!r:.40})"


def _is_stream(dataset: Any) -> bool:
    """A Hugging Face ``datasets.IterableDataset`` (checked by name: datasets is not imported for this)."""
    return type(dataset).__name__ == "IterableDataset" and hasattr(dataset, "__iter__")


def a_kind(value: Any) -> str:
    """What the value is, with its article: "a str", "an int" (for "must be a ..., not an int")."""
    name = type(value).__name__
    return f"an {name}" if name[:1].lower() in "aeiou" else f"a {name}"
