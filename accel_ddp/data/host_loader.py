"""The DataLoader path: samples read and decoded on the host (in worker processes), batches copied to the device.

:class:`HostLoader` is a ``torch.utils.data.DataLoader`` over the package's own
:class:`~accel_ddp.data.sampler.GlobalBatchSampler`: every rank draws the same permutation and takes
its own slices of each global batch, exactly as the device loader does, and a resumed run starts
from an optimizer step by arithmetic. It is deliberately not passed through
``accelerator.prepare``: Accelerate would re-shard its batch sampler per rank (``BatchSamplerShard``)
and register it with ``GradientState``, which forces a gradient sync at the end of every pass. We
move batches ourselves (pinned memory and non-blocking copies on CUDA), and gradient sync follows
Accelerate's accumulation counter alone, which lands on optimizer-step boundaries because an
epoch holds a whole number of optimizer steps (as for :class:`~accel_ddp.data.device_loader.DeviceLoader`).

Random augmentation is reproducible with any number of workers and across a resume: a dataset
that reads the :class:`~accel_ddp.data.sampler.PlacedBatch` itself (``handles_placed_batches``)
seeds from it; any other map-style dataset is wrapped in :class:`SeededSamples`, which seeds
torch's, NumPy's and Python's global generators per sample from ``(seed, epoch, position)``.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from accel_ddp.data.bundle import DataError
from accel_ddp.data.in_memory import as_in_memory, is_in_memory
from accel_ddp.data.mapped import MappedDataset, is_arrow_dataset
from accel_ddp.data.non_finite import FiniteCollate, NonFiniteInput, without_fix
from accel_ddp.data.sampler import (
    GlobalBatchLoader,
    PlacedBatch,
    global_rngs_restored,
    sample_seed,
    seed_global_rngs,
)
from accel_ddp.data.workers import WORKER_DEATH_ERRORS, worker_options
from accel_ddp.util.messages import warn
from accel_ddp.util.ranks import local_world_size


def usable_cpus() -> int:
    """CPU cores this process may run on (its affinity mask where the OS has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def pin_memory_for(device: torch.device | str) -> bool:
    """Page-locked host batches for ``device``? Only where they are copied to a CUDA device: the copy
    (``non_blocking=True``) then overlaps compute; elsewhere pinning only costs. The one rule of every DataLoader the
    package builds (training, evaluation, streaming)."""
    return torch.device(device).type == "cuda"


def default_num_workers(dataset: Dataset) -> int:
    """0 for tensors in memory (workers would only add copies); else up to 8, sharing the CPUs among local ranks."""
    if is_in_memory(dataset):
        return 0
    cpus = usable_cpus()
    return max(1, min(8, cpus // local_world_size() - 1))


class SeededSamples(Dataset):
    """A map-style dataset whose reads draw their randomness from ``(seed, epoch, position)``.

    Each sample of a :class:`~accel_ddp.data.sampler.PlacedBatch` is read with torch's, NumPy's and
    Python's global generators seeded from the run's seed, the epoch and the sample's position in
    the epoch's order (torchvision and most augmentation libraries draw from these). So a sample
    gets the same augmentation in any worker, at any world size and after a resume. The generators'
    states are restored afterwards: reads in the main process (``num_workers=0``) leave the
    training stream (dropout) alone.

    A dataset with its own batched ``__getitems__`` (a Hugging Face ``datasets.Dataset`` with a
    transform) is read one batch at a time, seeded by the position of the batch's first sample:
    exact on resume, but its draws depend on the per-device batch layout.
    """

    handles_placed_batches = True

    def __init__(self, dataset: Dataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index):
        return self.dataset[index]

    def __getitems__(self, batch) -> list:
        batched = getattr(self.dataset, "__getitems__", None)
        if not isinstance(batch, PlacedBatch):
            return batched(list(batch)) if batched else [self.dataset[i] for i in batch]
        with global_rngs_restored():
            if batched is not None:
                seed_global_rngs(sample_seed(batch.seed, batch.epoch, batch.first_position))
                return batched(list(batch))
            samples = []
            for index, position in zip(batch, batch.positions(), strict=True):
                seed_global_rngs(sample_seed(batch.seed, batch.epoch, position))
                samples.append(self.dataset[index])
            return samples


def readable(dataset: Dataset) -> Dataset:
    """The dataset as the DataLoader path reads it: in-memory tensors gathered per batch, a ``datasets.Dataset``
    read memory-mapped a batch at a time, anything else through seeded reads."""
    if is_in_memory(dataset):
        return as_in_memory(dataset)
    if getattr(dataset, "handles_placed_batches", False):
        return dataset
    if is_arrow_dataset(dataset):
        return MappedDataset(dataset)
    return SeededSamples(dataset)


WORKER_EXIT_WAIT_S = 2.0  # after a loader error, how long a worker whose connection broke may take to show as ended
MAX_WORKER_RESTARTS = 3  # in one pass: a worker that dies again at once (a sample that crashes its decoder) fails


def quiet_worker_deaths() -> None:
    """Keep torch's SIGCHLD handler out of this process: it raises a dead worker's RuntimeError from wherever the
    main thread is (inside a step, a collective's wait, a save), where nothing can recover. Without it the loader
    finds the death at its next read (within ``MP_STATUS_CHECK_INTERVAL``, 5 s) and ``HostLoader`` restarts the
    workers there (torch/utils/data/_utils/signal_handling.py: one handler per process, set at the first iterator)."""
    from torch.utils.data._utils import signal_handling

    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "SIGCHLD"):
        return
    signal_handling._SIGCHLD_handler_set = True  # torch never installs its handler in this process
    handler = signal.getsignal(signal.SIGCHLD)
    if getattr(handler, "__module__", None) == signal_handling.__name__:  # installed before us (a forked process)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)


class HostLoader(GlobalBatchLoader):
    """Micro-batches of rank ``rank`` from a map-style dataset, read by a DataLoader and copied to ``device``.

    The same surface as :class:`~accel_ddp.data.device_loader.DeviceLoader` (``len``, ``set_epoch``,
    ``skip_first_batches``, iteration) and the same samples in the same micro-steps. Batches may be
    any structure of tensors (tuples, dicts; ``collate_fn`` builds them). Workers (``num_workers``;
    ``None`` picks :func:`default_num_workers`) persist across epochs and ignore the job's preemption
    signals (:mod:`accel_ddp.data.workers`); ``worker_init_fn`` runs in each after that.

        >>> loader = HostLoader(dataset, per_device_batch_size=32, global_batch_size=128, seed=0, rank=r,
        ...                     world_size=2, device=accelerator.device)
        >>> loader.set_epoch(epoch); batches = loader.skip_first_batches(step_in_epoch * loader.accumulation)
    """

    def __init__(
        self,
        dataset: Dataset,
        per_device_batch_size: int,
        global_batch_size: int,
        *,
        seed: int,
        rank: int = 0,
        world_size: int = 1,
        device: torch.device | str = "cpu",
        num_workers: int | None = None,
        collate_fn: Callable[[list], Any] | None = None,
        worker_init_fn: Callable[[int], None] | None = None,
    ):
        super().__init__(len(dataset), per_device_batch_size, global_batch_size, seed=seed, rank=rank,
                         world_size=world_size, device=device)
        workers = default_num_workers(dataset) if num_workers is None else num_workers
        self.loader = DataLoader(
            readable(dataset),
            batch_sampler=self.sampler,
            collate_fn=FiniteCollate(collate_fn),  # nan/inf inputs found in the worker that makes the batch
            num_workers=workers,
            persistent_workers=workers > 0,  # no worker start-up cost at every epoch
            **worker_options(workers, worker_init_fn),  # deaf to the job's SIGTERM, dead with this rank
            pin_memory=pin_memory_for(self.device),  # page-locked host batches: the copy below overlaps compute
            # The DataLoader draws its workers' base seed from this generator, not from torch's global one:
            # the training stream (dropout) must not depend on the loader. Augmentation does not use it.
            generator=torch.Generator().manual_seed(seed),
        )

    batch_check = None  # set after the start-up probe: check(batch, where) on each host batch (accel_ddp.tasks.labels)

    def __iter__(self) -> Iterator[Any]:
        epoch, first = self.sampler.epoch, self.sampler.start
        on_cpu = self.device.type == "cpu"
        if not on_cpu:
            from accelerate.utils import send_to_device
        if self.loader.num_workers:
            quiet_worker_deaths()
        next_micro, restarts = first, 0
        try:
            while True:
                try:
                    for micro_step, batch in enumerate(self.loader, start=next_micro):
                        if isinstance(batch, NonFiniteInput):  # the worker found it; this rank knows its place
                            batch = self._non_finite(batch, self._sample_name(epoch, micro_step, batch.row))
                        if self.batch_check is not None:  # on the host, before the copy: no device sync
                            self.batch_check(batch, lambda row, step=micro_step: self._sample_name(epoch, step, row))
                        yield batch if on_cpu else send_to_device(batch, self.device, non_blocking=True)
                        next_micro = micro_step + 1
                    break
                except WORKER_DEATH_ERRORS:  # a worker killed: found however its death showed here
                    dead = self._dead_workers()
                    if not dead or restarts >= MAX_WORKER_RESTARTS:
                        raise
                    restarts += 1
                    self._restart_workers(dead, epoch, next_micro)
        except DataError as err:
            err.only_this_rank = True  # no other rank reads this batch: this one must say what went wrong
            self._stop_workers()
            raise
        finally:
            self.sampler.start = first
        self.sampler.set_epoch(epoch + 1)

    def _non_finite(self, flagged: NonFiniteInput, name: str) -> Any:
        """A batch with a nan/inf input: one line naming the sample and exit 2, or (``on_bad_input``) reported to the
        anomaly guard, which leaves its step out on every rank; then the batch, trained on as any other."""
        line = flagged.named(name)
        if self.on_bad_input is None:
            raise DataError(line)
        self.on_bad_input(without_fix(line))
        return flagged.batch

    def _dead_workers(self) -> list[tuple[int, int | None]]:
        """(pid, exit code) of the workers of the current pass that have ended: none while training goes well.

        A worker's death shows as torch's RuntimeError ("DataLoader worker (pid N) exited unexpectedly"), or as
        an error of the connection that fetches a tensor the worker shared (``data.workers.WORKER_DEATH_ERRORS``);
        either way the worker's process says it."""
        workers = getattr(self.loader._iterator, "_workers", None) or []
        deadline = time.monotonic() + (WORKER_EXIT_WAIT_S if workers else 0)
        while True:  # a killed worker's socket closes before the kernel has it reaped: wait for its exit a little
            dead = [(worker.pid, worker.exitcode) for worker in workers if not worker.is_alive()]
            if dead or time.monotonic() > deadline:
                return dead
            time.sleep(0.05)

    def _restart_workers(self, dead: list[tuple[int, int | None]], epoch: int, micro_step: int) -> None:
        """A worker died (killed, out of memory): new workers read on from ``micro_step``, the first micro-batch not
        yet trained on. Each sample's reads are seeded by its place in the epoch (:class:`SeededSamples`), so the
        same batches follow, bit for bit, and no rank notices. Through torch's private ``_iterator`` (a persistent
        workers' iterator is kept there: torch/utils/data/dataloader.py ``DataLoader.__iter__``)."""
        self._stop_workers()  # the survivors
        self.sampler.start = micro_step
        how = ", ".join(f"pid {pid}, " + (f"killed by {signal.Signals(-code).name}" if code is not None and code < 0
                                          else f"exit code {code}") for pid, code in dead)
        warn(f"a DataLoader worker of rank {self.sampler.rank} ended ({how}); started its workers again at "
             f"micro-batch {micro_step} of epoch {epoch}: the same batches follow", ranks="every")

    def _stop_workers(self) -> None:
        """The current pass's workers stopped and joined now, their queues closed; the next pass starts new ones.

        After a DataError this is not left to the garbage collector: the error's traceback holds the workers'
        iterator, and its shutdown from inside a later collection was seen to wait out torch's 5 s worker join
        (``MP_STATUS_CHECK_INTERVAL``) in whatever call the collection happened to interrupt."""
        current, self.loader._iterator = self.loader._iterator, None
        if current is not None:
            current._shutdown_workers()

