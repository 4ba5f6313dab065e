"""Evaluation on every rank; each eval sample (or token) is counted exactly once at any world size."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import torch
from accelerate import Accelerator

from accel_ddp.tasks import EVAL_FIELDS, IGNORE_INDEX, Task, build_task


@torch.no_grad()
def evaluate(accelerator: Accelerator, model: torch.nn.Module, loader, task: Task | None = None) -> dict[str, Any]:
    """The task's metrics over the whole eval set (``eval_loss``, ``eval_accuracy``, ...), identical on every rank.

    The task turns each batch into per-sample statistics (loss sum, items, correct). A prepared
    DataLoader repeats samples to give every rank an equal last batch; ``gather_for_metrics``
    drops them from per-sample tensors, so ``eval_samples`` equals ``len(eval_dataset)`` for any
    world size. A loader that shards without padding (``sums_across_ranks``, the in-memory
    :class:`~accel_ddp.data.device_loader.DeviceEvalLoader`) needs no gather: each rank sums its
    own share and one all-reduce adds the sums. Either way the sums stay on the device until the
    end: one host sync per evaluation, not per batch. The sums are float64: per-sample float32
    values add up exactly, so the result does not depend on how the set was split over ranks.
    User metrics (``task.metrics``) start from fresh copies and see every rank's outputs and batch.
    """
    task = task or build_task("classification")
    was_training = model.training
    model.eval()
    sharded = getattr(loader, "sums_across_ranks", False)
    sums = torch.zeros(len(EVAL_FIELDS), device=accelerator.device, dtype=torch.float64)
    count = 0  # a host-side int: sample counts need no device sync
    metrics = [copy.deepcopy(metric) for metric in task.metrics]
    for batch in loader:
        outputs = task.forward(model, batch)
        stats = task.eval_stats(outputs, batch)
        if not sharded:
            stats = accelerator.gather_for_metrics(stats)
        sums += stats.sum(dim=0)
        count += len(stats)
        if metrics:
            gathered_outputs, gathered_batch = gather_exactly_once(accelerator, (outputs, batch), sharded)
            for metric in metrics:
                metric.update(gathered_outputs, gathered_batch)
    totals = torch.cat([sums, sums.new_tensor([count])])
    if sharded and accelerator.num_processes > 1:
        totals = accelerator.reduce(totals, reduction="sum")
    model.train(was_training)
    *values, count = totals.tolist()
    results = task.summarize(dict(zip(EVAL_FIELDS, values, strict=True)), int(count))
    for metric in metrics:
        for name, value in metric.compute().items():
            value = value.item() if isinstance(value, torch.Tensor) else value
            results[name if name.startswith("eval_") else f"eval_{name}"] = value
    return results


def gather_exactly_once(accelerator: Accelerator, tree: Any, sharded: bool) -> Any:
    """Every rank's per-sample tensors of ``tree`` (outputs, batch), each eval sample once, in one structure.

    Per-sample tensors (first dimension = the batch) are padded to a common length along
    dimension 1 (variable-length sequences: ``labels`` with -100, the rest with 0) and gathered;
    other values (a scalar loss, a cache) become None. From a prepared DataLoader
    ``gather_for_metrics`` drops the last batch's repeated samples; from a loader that shards
    without repeats, shares of different sizes are padded along dimension 0, gathered, and cut.
    """
    batch_size = _batch_size(tree)

    def pad(x: torch.Tensor, key: str | None) -> torch.Tensor:
        if x.ndim >= 2:
            x = accelerator.pad_across_processes(x, dim=1, pad_index=IGNORE_INDEX if key == "labels" else 0)
        return x

    padded = _map_per_sample(tree, batch_size, pad)
    if not sharded:
        return accelerator.gather_for_metrics(padded)
    sizes = accelerator.gather(torch.tensor([batch_size], device=accelerator.device)).tolist()

    def gather_shares(x: torch.Tensor, key: str | None) -> torch.Tensor:
        x = accelerator.gather(accelerator.pad_across_processes(x, dim=0))
        rows = max(sizes)
        return torch.cat([x[rank * rows:rank * rows + size] for rank, size in enumerate(sizes)])

    return _map_per_sample(padded, batch_size, gather_shares)


def _batch_size(tree: Any) -> int:
    _, batch = tree
    values = batch.values() if isinstance(batch, Mapping) else batch
    return next(len(v) for v in values if isinstance(v, torch.Tensor))


def _map_per_sample(tree: Any, batch_size: int, fn, key: str | None = None) -> Any:
    """Apply ``fn(tensor, key)`` to the per-sample tensors in nested tuples, lists, dicts and ModelOutputs."""
    if isinstance(tree, torch.Tensor):
        return fn(tree, key) if tree.ndim >= 1 and len(tree) == batch_size else None
    if isinstance(tree, Mapping):
        mapped = {k: _map_per_sample(v, batch_size, fn, k) for k, v in tree.items()}
        mapped = {k: v for k, v in mapped.items() if v is not None}
        # A Transformers ModelOutput keeps its class (outputs.logits still works); other mappings become dicts.
        return type(tree)(**mapped) if hasattr(tree, "to_tuple") else mapped
    if isinstance(tree, (tuple, list)):
        return type(tree)(_map_per_sample(v, batch_size, fn, key) for v in tree)
    return None
