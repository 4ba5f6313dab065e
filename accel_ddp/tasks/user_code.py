"""Checks of what a user's code hands a task: a loss (a scalar, or a sum and a count), a metric object.

Each problem is bad input (``ConfigError``): one line naming the function or metric, what it
returned, and what to return instead. The start-up probe (``Task.check``) runs them on two training
samples, so most of them end a run before it writes anything.
"""

from __future__ import annotations

import copy
import numbers
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from accel_ddp.util.messages import first_line
from accel_ddp.util.validation import ConfigError


def check_scalar(value: Any, name: str, what: str) -> None:
    """A loss (or a pair's sum) must be a one-element tensor."""
    if not isinstance(value, torch.Tensor) or value.numel() != 1:
        raise ConfigError(f"the loss function {name} returned {what} {shown(value)}, not a scalar; return a mean "
                          "(e.g. losses.mean()) or a (losses.sum(), num_items) pair".replace("  ", " "))


def check_count(items: Any, name: str) -> None:
    """``num_items`` of a ``(sum, num_items)`` loss: a number or a one-element tensor, not a flag or a list."""
    number = isinstance(items, (int, float)) and not isinstance(items, bool)
    if not (number or isinstance(items, torch.Tensor) and items.numel() == 1 and items.dtype != torch.bool):
        raise ConfigError(f"the loss function {name} returned a (sum, num_items) pair whose num_items is "
                          f"{shown(items)}, not a count; return the number of items the sum adds up, e.g. "
                          "(losses.sum(), mask.sum())")


def shown(value: Any) -> str:
    """A returned value as an error line shows it: a tensor's shape (and dtype), else its type and value."""
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}" + (" (bool)" if value.dtype == torch.bool else "")
    if isinstance(value, (list, tuple)):
        return f"a {type(value).__name__} of {len(value)}"
    return f"{type(value).__name__} {value!r}"[:80] if isinstance(value, (str, int, float)) else type(value).__name__


def fresh_copies(metrics: Sequence[Any]) -> list[Any]:
    """Deep copies of the metric objects (each evaluation starts from fresh ones); one that cannot be copied is
    named."""
    copies = []
    for metric in metrics:
        try:
            copies.append(copy.deepcopy(metric))
        except Exception as err:  # noqa: BLE001 - whatever the object holds (files, locks, sockets)
            raise ConfigError(
                f"metric {type(metric).__name__} cannot be copied (copy.deepcopy raised {type(err).__name__}: "
                f"{first_line(err)}); each evaluation starts from a fresh copy of it: keep open files, locks and "
                "threads out of it (open them in compute()), or give it a __deepcopy__") from None
    return copies


def metric_values(metric: Any) -> dict[str, Any]:
    """``metric.compute()``: a dict of numbers (one-element tensors become numbers, None stays None), else bad input."""
    values, name = metric.compute(), type(metric).__name__
    if not isinstance(values, Mapping):
        raise ConfigError(f"metric {name}: compute() returned {shown(values)}, not a dict of numbers; return "
                          "e.g. {'top5': hits / seen}")
    checked = {}
    for key, value in values.items():
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        if value is not None and not isinstance(value, numbers.Real):
            raise ConfigError(f"metric {name}: compute() returned {key!r} as {shown(value)}, not a number; return "
                              "one number per key (e.g. a tensor's .mean().item(), or one key per class)")
        checked[key] = value
    return checked
