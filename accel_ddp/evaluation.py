"""Evaluation on every rank; each eval sample (or token) is counted exactly once at any world size."""

from __future__ import annotations

from collections.abc import Mapping, Sized
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import send_to_device

from accel_ddp.data.bundle import DataError
from accel_ddp.tasks.protocol import EVAL_FIELDS, IGNORE_INDEX, Task, build_task, per_item
from accel_ddp.tasks.user_code import metric_values


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
    A figure with nothing to count (no eval item) is None.

    With a user loss (``task.loss_fn``) ``eval_loss`` is that loss, item-weighted: each rank adds
    up ``(sum, num_items)`` (a mean counts as ``mean x samples`` over the batch's samples) over its
    own samples, without the repeats of a prepared DataLoader's last batch (see
    :func:`real_samples`), and one all-reduce adds the ranks' sums. The task's other figures
    (``eval_accuracy``, ...) are reported where the outputs fit them (``Task.eval_fits``).
    User metrics (``task.metrics``) start from fresh copies and see every rank's outputs and batch.
    """
    task = task or build_task("classification")
    was_training = model.training
    model.eval()
    sharded = getattr(loader, "sums_across_ranks", False)
    sums = torch.zeros(len(EVAL_FIELDS), device=accelerator.device, dtype=torch.float64)
    user_sums = torch.zeros(2, device=accelerator.device, dtype=torch.float64)  # this rank's: loss sum, items
    count = 0  # a host-side int: sample counts need no device sync
    metrics = task.fresh_metrics()
    check = getattr(loader, "batch_check", None)  # labels the model cannot take (accel_ddp.tasks.labels)
    for index, batch in enumerate(loader):
        batch = _on_device(accelerator, loader, index, batch, check)
        outputs = task.forward(model, batch)
        size = _batch_size((outputs, batch))
        fits = task.eval_fits(outputs, batch)
        stats = task.eval_stats(outputs, batch) if fits else sums.new_zeros(size, len(EVAL_FIELDS))
        if not sharded:
            stats = accelerator.gather_for_metrics(stats)
        sums += stats.sum(dim=0)
        count += len(stats)
        if task.loss_fn is not None:
            real = size if sharded else real_samples(accelerator, len(stats), size)
            if real:
                user_sums += task.eval_loss_sums(*first_samples((outputs, batch), size, real), real)
        if metrics:
            gathered_outputs, gathered_batch = gather_exactly_once(accelerator, (outputs, batch), sharded)
            for metric in metrics:
                metric.update(gathered_outputs, gathered_batch)
    totals = torch.cat([sums, sums.new_tensor([count]), user_sums])
    if accelerator.num_processes > 1 and (sharded or task.loss_fn is not None):
        summed = accelerator.reduce(totals, reduction="sum")  # each rank's own share, or the user loss only
        totals = summed if sharded else torch.cat([totals[:-2], summed[-2:]])
    model.train(was_training)
    *values, count, user_loss, user_items = totals.tolist()
    if task.stats_left_out:
        results = {"eval_loss": None, "eval_samples": int(count)}
    else:
        results = task.summarize(dict(zip(EVAL_FIELDS, values, strict=True)), int(count))
    if task.loss_fn is not None:
        results["eval_loss"] = per_item(user_loss, user_items)
    for metric in metrics:
        for name, value in metric_values(metric).items():
            results[name if name.startswith("eval_") else f"eval_{name}"] = value
    return results


@torch.no_grad()
def predictions(accelerator: Accelerator, model: torch.nn.Module, loader, task: Task) -> dict[str, torch.Tensor]:
    """Every eval sample's ``task.predictions`` (per-sample tensors on the CPU), each sample once and in the eval
    set's order, the same on every rank; sequences of different lengths padded on the right with -100.

    From a prepared DataLoader rank ``r``'s ``b``-th batch is the set's batch ``b * world + r`` (Accelerate's
    ``BatchSamplerShard``), so ``gather_for_metrics`` of each batch gives the set's batches in order and drops the
    repeats that complete the last one. The in-memory :class:`~accel_ddp.data.device_loader.DeviceEvalLoader` gives
    rank ``r`` one contiguous share: the shares are gathered once, at the end, in rank order.
    """
    was_training = model.training
    model.eval()
    sharded = getattr(loader, "sums_across_ranks", False)
    check = getattr(loader, "batch_check", None)
    parts = []
    for index, batch in enumerate(loader):
        batch = _on_device(accelerator, loader, index, batch, check)
        fields = task.predictions(task.forward(model, batch), batch)
        parts.append(fields if sharded else _gathered(accelerator, fields, sharded=False))
    model.train(was_training)
    fields = _concatenated(parts)
    if sharded:
        fields = _gathered(accelerator, fields, sharded=True)
    return {key: value.cpu() for key, value in fields.items()}


def _gathered(accelerator: Accelerator, fields: dict[str, torch.Tensor], sharded: bool) -> dict[str, torch.Tensor]:
    """``gather_exactly_once`` of per-sample tensors alone (it reads the batch size from a tree's batch: here the
    same tensors; a None in their place would be a value Accelerate's gather refuses)."""
    return gather_exactly_once(accelerator, (fields, fields), sharded)[0]


def _concatenated(parts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The batches' per-sample tensors as one, each key's rows padded on the right to the longest with -100."""
    joined = {}
    for key in parts[0]:
        tensors = [part[key] for part in parts]
        if tensors[0].ndim > 1:
            width = max(t.shape[1] for t in tensors)
            tensors = [torch.nn.functional.pad(t, (0, width - t.shape[1]), value=IGNORE_INDEX) for t in tensors]
        joined[key] = torch.cat(tensors)
    return joined


def _on_device(accelerator: Accelerator, loader, index: int, batch: Any, check) -> Any:
    """An eval batch checked on the host (``check(batch, where)``), then copied to the device."""
    if check is not None:
        def where(row: int) -> str:  # Accelerate's BatchSamplerShard deals batch b * world + rank to this rank
            size, rank = _batch_size((None, batch)), accelerator.process_index
            total = len(loader.dataset) if isinstance(getattr(loader, "dataset", None), Sized) else 0
            if not total:
                return f"sample {row} of eval batch {index} on rank {rank}"
            return f"eval sample {((index * accelerator.num_processes + rank) * size + row) % total}"

        try:
            check(batch, where)
        except DataError as err:
            err.only_this_rank = True  # no other rank holds this batch: this one says what is wrong
            raise
    return batch if accelerator.device.type == "cpu" else send_to_device(batch, accelerator.device, non_blocking=True)


def real_samples(accelerator: Accelerator, gathered: int, size: int) -> int:
    """How many of this rank's ``size`` samples in a prepared DataLoader's batch are not repeats.

    With ``even_batches`` (Accelerate's default, which the loop keeps) every rank gets a batch of the
    same size, and the last global batch is completed at its end with samples from the start of the
    set (``BatchSamplerShard._iter_with_no_split`` in accelerate/data_loader.py);
    ``gather_for_metrics`` keeps the first ``remainder`` rows of the ranks' batches laid end to end in
    rank order (``Accelerator.gather_for_metrics``). So of the ``gathered`` rows it kept, rank ``r``
    holds rows ``r * size ...``: its first ``gathered - r * size`` samples (between 0 and ``size``)
    are real. A batch-level user loss is computed on those only: per-sample results could be cut
    after the gather, a batch's sum cannot.
    """
    return min(max(gathered - accelerator.process_index * size, 0), size)


def first_samples(tree: Any, batch_size: int, count: int) -> Any:
    """``tree`` (outputs, batch) with every per-sample tensor cut to its first ``count`` samples; the rest as is."""
    if count == batch_size:
        return tree
    return _map_per_sample(tree, batch_size, lambda x, key: x[:count], keep_others=True)


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


def _map_per_sample(tree: Any, batch_size: int, fn, key: str | None = None, keep_others: bool = False) -> Any:
    """Apply ``fn(tensor, key)`` to the per-sample tensors in nested tuples, lists, dicts and ModelOutputs.

    Other values become None (dropped from mappings), or with ``keep_others`` stay as they are.
    """
    def other(value: Any) -> Any:
        return value if keep_others else None

    if isinstance(tree, torch.Tensor):
        return fn(tree, key) if tree.ndim >= 1 and len(tree) == batch_size else other(tree)
    if isinstance(tree, Mapping):
        mapped = {k: _map_per_sample(v, batch_size, fn, k, keep_others) for k, v in tree.items()}
        mapped = {k: v for k, v in mapped.items() if v is not None or keep_others}
        # A Transformers ModelOutput keeps its class (outputs.logits still works); other mappings become dicts.
        return type(tree)(**mapped) if hasattr(tree, "to_tuple") else mapped
    if isinstance(tree, (tuple, list)):
        return type(tree)(_map_per_sample(v, batch_size, fn, key, keep_others) for v in tree)
    return other(tree)
