"""Choosing and building the training and eval loaders: the device loader, the DataLoader path, streaming.

Every training loader gives every optimizer step the same samples for the same seed, whatever the
world size: the order is :class:`~accel_ddp.data.sampler.GlobalBatchSampler`'s (the streaming
loader, whose source has no random access, keeps every rank in step instead).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any, NamedTuple, Protocol, runtime_checkable

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset

from accel_ddp.data.device_loader import DeviceEvalLoader, DeviceLoader
from accel_ddp.data.host_loader import HostLoader, default_num_workers, pin_memory_for, usable_cpus
from accel_ddp.data.in_memory import as_in_memory, is_in_memory
from accel_ddp.data.mapped import is_arrow_dataset
from accel_ddp.data.memory_budget import say
from accel_ddp.data.workers import worker_options
from accel_ddp.util.messages import note
from accel_ddp.util.registry import describe
from accel_ddp.util.validation import ConfigError

__all__ = ["Loaders", "TrainLoader", "build_eval_loader", "build_loaders", "choose_loader",
           "build_eval_loader_beside", "data_seed", "data_source", "default_num_workers", "first_samples",
           "usable_cpus"]


def build_eval_loader(
    dataset: Dataset, batch_size: int, num_workers: int | None = None, collate_fn: Callable | None = None,
    worker_init_fn: Callable[[int], None] | None = None, *, device: torch.device | str = "cpu",
) -> DataLoader:
    """Ordered DataLoader; ``gather_for_metrics`` later drops the padding of the last batch. ``device``: where its
    batches are copied (page-locked host memory for a CUDA device).

    Its workers are those of :class:`HostLoader`'s DataLoader, also through ``accelerator.prepare``.
    """
    workers = default_num_workers(dataset) if num_workers is None else num_workers
    return DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=False,
        collate_fn=collate_fn,
        num_workers=workers,
        persistent_workers=workers > 0,
        **worker_options(workers, worker_init_fn),
        pin_memory=pin_memory_for(device),
    )


def choose_loader(loader: str, dataset: Dataset, device_loader_max_mb: float, memory_limit=None, *,
                  quiet: bool = False) -> str:
    """``"device"`` or ``"dataloader"`` for ``--loader`` auto/device/dataloader and this training set.

    ``auto`` takes the device loader for tensors in memory up to ``device_loader_max_mb`` MiB as stored,
    and up to ``memory_limit.device_mb`` (a :class:`~accel_ddp.data.memory_budget.InMemoryLimit`: on a GPU
    the device memory left for data; one line says when that, not the flag, sends the set to a DataLoader);
    ``device`` insists on it (a clear error when the dataset is not tensors in memory). ``quiet``: the same
    answer without the note (the micro-batch probe asks first, build_loaders says it).
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
    limit_mb = device_limit_mb(device_loader_max_mb, memory_limit)
    if loader == "auto" and (nbytes := as_in_memory(dataset).nbytes) > limit_mb * 2**20:
        # the budget, not the flag, decided
        if not quiet and memory_limit is not None and nbytes <= device_loader_max_mb * 2**20:
            say(memory_limit.note("the training set", nbytes, limit_mb, instead="reading it through a DataLoader"))
        return "dataloader"
    return "device"


def device_limit_mb(device_loader_max_mb: float, memory_limit=None) -> float:
    """MiB of training data the device loader may hold: the flag's, within the machine's budget if known."""
    return device_loader_max_mb if memory_limit is None else min(device_loader_max_mb, memory_limit.device_mb)


@runtime_checkable
class TrainLoader(Protocol):
    """What the loop asks of every training loader (DeviceLoader, HostLoader, StreamingLoader): a prepared
    DataLoader's surface, micro-batches on the device, each optimizer step's samples the same for any world size.
    (The loaders of host batches also take a ``batch_check`` hook: accel_ddp.tasks.labels.)"""

    steps_per_epoch: int  # optimizer steps per epoch (streaming: the whole run)
    accumulation: int  # micro-batches per optimizer step on each rank

    def __len__(self) -> int: ...  # micro-batches left in this epoch on this rank

    def __iter__(self) -> Iterator[Any]: ...

    def set_epoch(self, epoch: int) -> None: ...

    def skip_first_batches(self, num_batches: int) -> Iterable[Any]: ...  # the epoch after its first micro-batches


class Loaders(NamedTuple):
    train: TrainLoader  # a DeviceLoader, HostLoader or StreamingLoader: batches on the device
    eval: Any  # a prepared DataLoader (gather_for_metrics counts each sample once), a DeviceEvalLoader, or None
    kind: str  # "device", "dataloader" or "streaming": summary.json's "loader"
    source: str = "in_memory"  # "in_memory", "memory_mapped", "streaming" or "map_style": summary.json's "data_source"
    steps_per_epoch: int = 0  # optimizer steps per epoch (streaming: per pass of the loop, see StreamingLoader)


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
    max_steps: int | None = None,
    memory_limit=None,
) -> Loaders:
    """Train and eval loaders, ready to iterate: batches arrive on ``accelerator.device``.

    The training loader is the in-memory :class:`DeviceLoader` where :func:`choose_loader` says so,
    else a :class:`HostLoader` (a DataLoader over the same global-batch order), or for a streamed
    ``datasets.IterableDataset`` a :class:`~accel_ddp.data.streaming.StreamingLoader` (which needs
    ``max_steps``). All draw their order from the accelerator's ``data_seed``. Evaluation runs on a
    prepared DataLoader (``gather_for_metrics`` counts each eval sample exactly once), except next to
    the device training loader, where an in-memory eval set is sliced per rank on the device
    (:class:`DeviceEvalLoader`, summed over ranks). A ``collate_fn`` makes every batch, for training
    and evaluation: the device loader, which batches tensors itself, is then not used (see
    :func:`collate_route`).

        train_loader, eval_loader, *_ = build_loaders(
            accelerator, train_ds, eval_ds, per_device_batch_size=32, global_batch_size=64)
        model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    """
    seed, rank, world = data_seed(accelerator), accelerator.process_index, accelerator.num_processes
    source = data_source(train_dataset)
    if source == "streaming":
        from accel_ddp.data.streaming import StreamingLoader

        kind = "streaming"
        train_loader = StreamingLoader(
            train_dataset, per_device_batch_size, global_batch_size, max_steps=max_steps, seed=seed, rank=rank,
            world_size=world, device=accelerator.device, num_workers=num_workers, collate_fn=collate_fn)
    else:
        kind = choose_loader(loader, train_dataset, device_loader_max_mb, memory_limit)
        if kind == "device" and collate_fn is not None:
            kind = collate_route(loader, collate_fn, accelerator.is_main_process)
        make = DeviceLoader if kind == "device" else HostLoader
        extra = {"normalised_max_mb": device_limit_mb(device_loader_max_mb, memory_limit)} if kind == "device" \
            else {"num_workers": num_workers, "collate_fn": collate_fn}
        train_loader = make(train_dataset, per_device_batch_size, global_batch_size, seed=seed, rank=rank,
                            world_size=world, device=accelerator.device, **extra)
    eval_loader = None if eval_dataset is None else build_eval_loader_beside(
        accelerator, eval_dataset, kind, eval_batch_size or 2 * per_device_batch_size, num_workers, collate_fn)
    return Loaders(train_loader, eval_loader, kind, source, train_loader.steps_per_epoch)


def build_eval_loader_beside(accelerator, eval_dataset: Dataset, kind: str, batch_size: int,
                             num_workers: int | None = None, collate_fn: Callable | None = None):
    """The eval loader of a run whose training loader is of ``kind`` (``device``, ``dataloader``, ``streaming``).

    Beside the device loader an in-memory eval set is sliced per rank on the device (:class:`DeviceEvalLoader`,
    summed over ranks); anything else is a prepared DataLoader (``gather_for_metrics`` counts each sample once).
    ``evaluate``/``predict`` of a trained run rebuild the eval loader it had with this.
    """
    world = accelerator.num_processes
    if (kind == "device" and is_in_memory(eval_dataset)
            and DeviceEvalLoader.can_shard(len(eval_dataset), batch_size, world)):
        return DeviceEvalLoader(eval_dataset, batch_size, rank=accelerator.process_index, world_size=world,
                                device=accelerator.device)
    # Batches stay on the host: evaluate() checks their labels there (loader.batch_check), then copies them.
    return accelerator.prepare_data_loader(build_eval_loader(eval_dataset, batch_size, num_workers, collate_fn,
                                                             device=accelerator.device),
                                           device_placement=False)


def collate_route(loader: str, collate_fn: Callable, is_main_process: bool) -> str:
    """``"dataloader"`` for a run whose in-memory training set has a ``collate_fn``, or bad input (``--loader device``).

    The device loader gathers whole batches from tensors on the device; calling a user's function
    on each batch's list of samples would put per-sample Python work on every step. So a
    ``collate_fn`` takes the DataLoader path (training, and evaluation through a DataLoader), with
    one note, rather than being left out.
    """
    name = describe(collate_fn)
    if loader == "device":
        raise ConfigError(f"--loader device batches the in-memory tensors on the device and never calls the "
                          f"collate_fn {name}; use --loader auto or --loader dataloader with it, or drop it")
    if is_main_process:
        note(f"the collate_fn {name} makes the batches, so this in-memory training set goes "
             "through a DataLoader (--loader dataloader), not the device loader")
    return "dataloader"


def data_source(dataset) -> str:
    """How the training samples are held: ``in_memory`` tensors, ``memory_mapped`` Arrow files, a
    ``streaming`` iterable, or another ``map_style`` dataset (read per sample)."""
    if is_in_memory(dataset):
        return "in_memory"
    if getattr(dataset, "memory_mapped", False) or (is_arrow_dataset(dataset) and dataset.cache_files):
        return "memory_mapped"
    if isinstance(dataset, IterableDataset):  # a datasets.IterableDataset is one too, once torch is imported
        return "streaming"
    return "map_style"


def first_samples(dataset, count: int) -> list:
    """The dataset's first ``count`` samples (fewer if it has fewer), for a stream too."""
    if hasattr(dataset, "first_samples"):
        return dataset.first_samples(count)
    return [dataset[i] for i in range(min(count, len(dataset)))]


def data_seed(accelerator) -> int:
    """The run's data seed (``DataLoaderConfiguration(data_seed=...)``), else torch's initial seed."""
    seed = getattr(getattr(accelerator, "dataloader_config", None), "data_seed", None)
    return int(seed) if seed is not None else torch.random.initial_seed()
