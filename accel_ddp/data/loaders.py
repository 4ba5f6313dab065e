"""Choosing and building the training and eval loaders (device loader or a prepared DataLoader).

Both kinds give every optimizer step the same samples for the same seed, whatever the world size:
the permutation is :func:`accel_ddp.data.sampler.epoch_order`'s.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch.utils.data import DataLoader, Dataset, RandomSampler

from accel_ddp.config import ConfigError
from accel_ddp.data.device_loader import DeviceEvalLoader, DeviceLoader
from accel_ddp.data.in_memory import as_in_memory, is_in_memory
from accel_ddp.data.sampler import steps_per_epoch


def usable_cpus() -> int:
    """CPU cores this process may run on (its affinity mask where the OS has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def default_num_workers(dataset: Dataset) -> int:
    """0 for tensors in memory (workers would only add copies); else up to 8, sharing the CPUs among local ranks."""
    if is_in_memory(dataset):
        return 0
    cpus = usable_cpus()
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return max(1, min(8, cpus // local_ranks - 1))


def build_train_loader(
    dataset: Dataset, per_device_batch_size: int, global_batch_size: int, num_workers: int | None = None,
    collate_fn: Callable | None = None,
) -> DataLoader:
    """Shuffling DataLoader whose epoch is exactly ``steps_per_epoch * global_batch_size`` samples.

    The sampler draws a fresh permutation of the whole dataset and keeps its first whole global
    batches. Accelerate swaps it for its seedable twin (seed + epoch) and hands rank ``r`` the
    per-device batches ``r, r + world, ...``, so each optimizer step covers the same contiguous
    chunk of the permutation whatever the world size and accumulation. ``num_workers=None``
    picks :func:`default_num_workers`; ``collate_fn=None`` is torch's ``default_collate``.
    """
    n_steps = steps_per_epoch(len(dataset), global_batch_size)
    workers = default_num_workers(dataset) if num_workers is None else num_workers
    sampler = RandomSampler(dataset, num_samples=n_steps * global_batch_size)
    return DataLoader(
        dataset,
        batch_size=per_device_batch_size,
        sampler=sampler,
        drop_last=True,
        collate_fn=collate_fn,
        num_workers=workers,
        persistent_workers=workers > 0,  # no worker start-up cost at every epoch
        pin_memory=torch.cuda.is_available(),  # with Accelerate's non_blocking copies, overlaps H2D with compute
    )


def build_eval_loader(
    dataset: Dataset, batch_size: int, num_workers: int | None = None, collate_fn: Callable | None = None
) -> DataLoader:
    """Ordered DataLoader; ``gather_for_metrics`` later drops the padding of the last batch."""
    workers = default_num_workers(dataset) if num_workers is None else num_workers
    return DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=False,
        collate_fn=collate_fn,
        num_workers=workers,
        persistent_workers=workers > 0,
        pin_memory=torch.cuda.is_available(),
    )


def choose_loader(loader: str, dataset: Dataset, device_loader_max_mb: float) -> str:
    """``"device"`` or ``"dataloader"`` for ``--loader`` auto/device/dataloader and this training set.

    ``auto`` takes the device loader for tensors in memory up to ``device_loader_max_mb`` MiB as stored;
    ``device`` insists on it (a clear error when the dataset is not tensors in memory).
    """
    if loader not in ("auto", "device", "dataloader"):
        raise ConfigError(f"--loader {loader!r} is unknown; choose one of auto, device, dataloader")
    if loader == "dataloader":
        return "dataloader"
    if not is_in_memory(dataset):
        if loader == "device":
            raise ConfigError(
                f"--loader device: the training set is a {type(dataset).__name__}, not tensors in memory; use "
                "--loader dataloader, or return an accel_ddp.data.InMemoryDataset or TensorDataset from --dataset"
            )
        return "dataloader"
    if loader == "auto" and as_in_memory(dataset).nbytes > device_loader_max_mb * 2**20:
        return "dataloader"
    return "device"


class Loaders(NamedTuple):
    train: Any  # a prepared DataLoader, or a DeviceLoader: both yield (inputs, labels) on the device
    eval: Any  # a prepared DataLoader (gather_for_metrics counts each sample once), a DeviceEvalLoader, or None
    kind: str  # "device" or "dataloader"


def build_loaders(
    accelerator,
    train_dataset: Dataset,
    eval_dataset: Dataset | None,
    *,
    per_device_batch_size: int,
    global_batch_size: int,
    eval_batch_size: int | None = None,
    loader: str = "auto",
    num_workers: int | None = None,
    device_loader_max_mb: float = 4096,
    collate_fn: Callable | None = None,
) -> Loaders:
    """Train and eval loaders, ready to iterate: prepared by ``accelerator`` or on its device already.

    The training loader is the in-memory :class:`DeviceLoader` where :func:`choose_loader` says so,
    else a prepared DataLoader; both draw the permutation from the accelerator's ``data_seed``
    and give each optimizer step the same samples. Evaluation runs on a prepared
    DataLoader (``gather_for_metrics`` counts each eval sample exactly once), except next to the
    device training loader, where an in-memory eval set is sliced per rank on the device
    (:class:`DeviceEvalLoader`, summed over ranks).

        train_loader, eval_loader, kind = build_loaders(
            accelerator, train_ds, eval_ds, per_device_batch_size=32, global_batch_size=64)
        model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    """
    kind = choose_loader(loader, train_dataset, device_loader_max_mb)
    if kind == "device":
        train_loader = DeviceLoader(
            train_dataset, per_device_batch_size, global_batch_size, seed=data_seed(accelerator),
            rank=accelerator.process_index, world_size=accelerator.num_processes, device=accelerator.device,
        )
    else:
        train_loader = accelerator.prepare(
            build_train_loader(train_dataset, per_device_batch_size, global_batch_size, num_workers, collate_fn)
        )
    eval_loader = None
    eval_batch_size = eval_batch_size or 2 * per_device_batch_size
    if (eval_dataset is not None and kind == "device" and is_in_memory(eval_dataset)
            and DeviceEvalLoader.can_shard(len(eval_dataset), eval_batch_size, accelerator.num_processes)):
        eval_loader = DeviceEvalLoader(eval_dataset, eval_batch_size, rank=accelerator.process_index,
                                       world_size=accelerator.num_processes, device=accelerator.device)
    elif eval_dataset is not None:
        eval_loader = accelerator.prepare(build_eval_loader(eval_dataset, eval_batch_size, num_workers, collate_fn))
    return Loaders(train_loader, eval_loader, kind)


def data_seed(accelerator) -> int:
    """The seed Accelerate's seedable sampler starts from: ``data_seed``, else torch's initial seed."""
    seed = getattr(getattr(accelerator, "dataloader_config", None), "data_seed", None)
    return int(seed) if seed is not None else torch.random.initial_seed()


def skip_first_batches(accelerator, loader, num_batches: int):
    """The rest of the current epoch after its first ``num_batches`` micro-batches, for either loader.

    Call ``loader.set_epoch(epoch)`` first; iterate the result for that epoch only.
    """
    if isinstance(loader, DeviceLoader):
        return loader.skip_first_batches(num_batches)
    return accelerator.skip_first_batches(loader, num_batches)
