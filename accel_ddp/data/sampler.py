"""The global-batch order every training loader shares: a permutation per epoch, a position in global batches.

Optimizer step ``s`` of epoch ``e`` trains on ``epoch_order(N, steps * G, seed, e)[s * G:(s + 1) * G]``
whatever the world size and accumulation, so the position of a run is its optimizer step alone: a
resumed run recomputes where it is, it replays no random draws. Inside a global batch, micro-step
``m`` of rank ``r`` holds the ``per_device`` samples starting at position ``(m * world + r) *
per_device`` of the epoch's order: the same sample sits at the same position for any world size.

:class:`GlobalBatchSampler` serves that order to a ``DataLoader`` (the device loader slices the
same indices on the device). Each batch it yields is a :class:`PlacedBatch`: the sample indices plus
where they sit in the epoch, so that random augmentation can be seeded by ``(seed, epoch,
position)`` (:func:`sample_seed`) instead of by whichever worker process happens to decode it.

Why not Accelerate's sampler sharding and ``skip_first_batches``: its mid-epoch resume replays the
sampler's RNG and has been reported wrong in several ways (huggingface/accelerate#2016, open: a
skipped loader yields another sequence after the first epoch; accelerate#4071: the skipping loader
reset the sampler to epoch 0; accelerate#4233/#4203: a mid-epoch ``save_state`` holds the next
epoch's generator state; accelerate#4244, open: a stateful loader's cached state is stale after
loading). A position that is a plain count of global batches has none of these failure modes.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
from torch.utils.data import Sampler

from accel_ddp.config import accumulation_steps
from accel_ddp.util.validation import ConfigError

_MASK64 = (1 << 64) - 1


def steps_per_epoch(num_train_samples: int, global_batch_size: int) -> int:
    """Optimizer steps in one epoch: the trailing partial global batch is dropped; none at all is an error."""
    steps = num_train_samples // global_batch_size
    if steps == 0:
        raise ConfigError(
            f"the training set has {num_train_samples} samples, fewer than one global batch "
            f"({global_batch_size}); lower --global_batch_size"
        )
    return steps


def epoch_order(num_samples: int, num_used: int, seed: int, epoch: int) -> torch.Tensor:
    """The first ``num_used`` indices of epoch ``epoch``'s permutation.

    The same draws as Accelerate's ``SeedableRandomSampler`` (a fresh generator seeded with
    ``seed + epoch``) under torch's ``RandomSampler`` (``num_samples <= len(dataset)`` keeps the first
    entries of ``torch.randperm(len(dataset))``), so runs of earlier versions, which used those, see
    the same samples in the same steps.
    """
    device = torch.get_default_device() if hasattr(torch, "get_default_device") else "cpu"
    generator = torch.Generator(device=device)
    generator.manual_seed(seed + epoch)
    return torch.randperm(num_samples, generator=generator)[:num_used]


def sample_seed(seed: int, epoch: int, position: int, *stream: int) -> int:
    """A 63-bit seed for the sample at ``position`` of epoch ``epoch``'s order (splitmix64 of the parts).

    Seeding per sample makes random augmentation independent of the worker that decodes the sample,
    of the world size and of where a run was resumed. Extra ``stream`` parts give independent seeds
    for other uses of the same position.
    """
    value = 0
    for part in (seed, epoch, position, *stream):
        value = (value ^ (part & _MASK64)) + 0x9E3779B97F4A7C15 & _MASK64
        value = (value ^ (value >> 30)) * 0xBF58476D1CE4E5B9 & _MASK64
        value = (value ^ (value >> 27)) * 0x94D049BB133111EB & _MASK64
        value ^= value >> 31
    return value >> 1


@contextmanager
def global_rngs_restored():
    """Leave torch's (CPU), NumPy's and Python's global generators as they were (reads in the main process)."""
    torch_state, numpy_state, python_state = torch.random.get_rng_state(), np.random.get_state(), random.getstate()
    try:
        yield
    finally:
        torch.random.set_rng_state(torch_state)
        np.random.set_state(numpy_state)
        random.setstate(python_state)


def seed_global_rngs(seed: int) -> None:
    torch.random.default_generator.manual_seed(seed)  # the CPU generator only: CUDA's drives dropout
    np.random.seed(seed % 2**32)
    random.seed(seed)


class PlacedBatch(list):
    """A micro-batch's sample indices (a plain list to every consumer) and where they sit in the epoch.

    ``positions()`` are the samples' positions in the epoch's order (optimizer step ``position //
    global_batch_size``); ``seed`` and ``epoch`` are the run's. Datasets that augment read these
    (:class:`~accel_ddp.data.in_memory.InMemoryDataset`,
    :class:`~accel_ddp.data.host_loader.SeededSamples`); any other dataset sees a list of indices.
    """

    def __init__(self, indices: list[int], seed: int, epoch: int, first_position: int, global_batch_size: int):
        super().__init__(indices)
        self.seed, self.epoch, self.first_position = seed, epoch, first_position
        self.global_batch_size = global_batch_size

    def positions(self) -> range:
        return range(self.first_position, self.first_position + len(self))

    def __reduce__(self):  # to DataLoader workers: the attributes travel with the list
        return PlacedBatch, (list(self), self.seed, self.epoch, self.first_position, self.global_batch_size)


class GlobalBatchSampler(Sampler[list[int]]):
    """Rank ``rank``'s micro-batches of every global batch, for a ``DataLoader(batch_sampler=...)``.

    Each epoch keeps the first ``steps_per_epoch * global_batch_size`` indices of
    :func:`epoch_order` and cuts them into per-device batches; rank ``r`` of ``world_size`` takes
    batches ``r, r + world_size, ...``: exactly the samples the device loader serves, and those
    Accelerate's seedable sampler and ``BatchSamplerShard`` served before. ``set_epoch`` picks the
    permutation; ``start`` leaves out the first micro-batches of a pass (:class:`SkippedPass`), without
    drawing or replaying anything.

        >>> sampler = GlobalBatchSampler(100, per_device_batch_size=8, global_batch_size=32, seed=0, rank=1,
        ...                              world_size=2)
        >>> len(sampler)  # 3 optimizer steps x 2 accumulation micro-steps
        6
    """

    def __init__(self, num_samples: int, per_device_batch_size: int, global_batch_size: int, *, seed: int,
                 rank: int = 0, world_size: int = 1):
        self.accumulation = accumulation_steps(per_device_batch_size, global_batch_size, world_size)
        self.steps_per_epoch = steps_per_epoch(num_samples, global_batch_size)
        self.num_samples, self.per_device_batch_size, self.global_batch_size = (
            num_samples, per_device_batch_size, global_batch_size)
        self.seed, self.rank, self.world_size = seed, rank, world_size
        self.epoch = 0
        self.start = 0  # micro-batches of the current epoch to leave out (a resumed epoch)

    @property
    def micro_steps_per_epoch(self) -> int:
        return self.steps_per_epoch * self.accumulation

    def __len__(self) -> int:
        return self.micro_steps_per_epoch - self.start

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def rank_indices(self, epoch: int) -> torch.Tensor:
        """``(micro_steps, per_device_batch)``: the sample indices this rank trains on in ``epoch``, on the CPU."""
        order = epoch_order(self.num_samples, self.steps_per_epoch * self.global_batch_size, self.seed, epoch)
        return order.view(-1, self.world_size, self.per_device_batch_size)[:, self.rank]

    def first_position(self, micro_step: int) -> int:
        """Position in the epoch's order of this rank's first sample at ``micro_step``."""
        return (micro_step * self.world_size + self.rank) * self.per_device_batch_size

    def __iter__(self) -> Iterator[PlacedBatch]:
        epoch = self.epoch
        indices = self.rank_indices(epoch).tolist()
        for micro_step in range(self.start, len(indices)):
            yield PlacedBatch(indices[micro_step], self.seed, epoch, self.first_position(micro_step),
                              self.global_batch_size)


class SkippedPass:
    """One pass of a loader (``loader.sampler`` a :class:`GlobalBatchSampler`) without its first micro-batches.

    What ``loader.skip_first_batches(n)`` returns: iterate it for the rest of the current epoch
    (resuming after optimizer step ``s`` of the epoch: ``n = s * accumulation``), then go on with the
    loader itself, which has moved to the next epoch like after any full pass.
    """

    def __init__(self, loader: Iterable, num_batches: int):
        total = loader.sampler.micro_steps_per_epoch
        if not 0 <= num_batches <= total:
            raise ValueError(f"cannot skip {num_batches} of {total} micro-batches")
        self.loader, self.num_batches = loader, num_batches

    def __len__(self) -> int:
        return self.loader.sampler.micro_steps_per_epoch - self.num_batches

    def __iter__(self) -> Iterator[Any]:
        sampler = self.loader.sampler
        sampler.start = self.num_batches
        try:
            yield from self.loader
        finally:
            sampler.start = 0


class GlobalBatchLoader:
    """What the device loader and the DataLoader path share: a prepared DataLoader's surface over a sampler.

    ``len()`` (micro-batches per rank left this epoch), ``set_epoch``, ``skip_first_batches`` (a
    :class:`SkippedPass`), ``steps_per_epoch`` and ``accumulation``, and one constructor:
    the sampler over the dataset's ``size`` samples, the layout, and the ``device`` batches go to. A subclass
    iterates ``self.sampler``, calling ``sampler.set_epoch(epoch + 1)`` after a full pass.
    """

    sampler: GlobalBatchSampler

    def __init__(self, size: int, per_device_batch_size: int, global_batch_size: int, *, seed: int, rank: int = 0,
                 world_size: int = 1, device: torch.device | str = "cpu"):
        self.sampler = GlobalBatchSampler(size, per_device_batch_size, global_batch_size, seed=seed, rank=rank,
                                          world_size=world_size)
        self.per_device_batch_size, self.global_batch_size = per_device_batch_size, global_batch_size
        self.seed, self.rank, self.world_size = seed, rank, world_size
        self.device = torch.device(device)

    on_bad_input = None  # --on_anomaly skip|rollback: report(description) of a micro-batch with a nan/inf input

    def report_bad_inputs(self, report) -> None:
        """``--on_anomaly skip|rollback``: a micro-batch holding a nan or inf input is trained on and ``report(what)``
        called as it is served, naming its sample; the anomaly guard leaves its step out on every rank. Without this a
        nan input stops the run (one line naming the sample, exit 2)."""
        self.on_bad_input = report

    def _sample_name(self, epoch: int, micro_step: int, row: int) -> str:
        index = int(self.sampler.rank_indices(epoch)[micro_step, row])
        step = epoch * self.steps_per_epoch + micro_step // self.accumulation + 1
        return f"training sample {index} (epoch {epoch}, optimizer step {step}, rank {self.sampler.rank})"

    @property
    def epoch(self) -> int:
        return self.sampler.epoch

    @property
    def steps_per_epoch(self) -> int:
        return self.sampler.steps_per_epoch

    @property
    def accumulation(self) -> int:
        return self.sampler.accumulation

    def __len__(self) -> int:
        return len(self.sampler)

    def set_epoch(self, epoch: int) -> None:
        """Use epoch ``epoch``'s permutation next; the epoch also advances by one after each full pass."""
        self.sampler.set_epoch(epoch)

    def skip_first_batches(self, num_batches: int) -> SkippedPass:
        """The current epoch after its first ``num_batches`` micro-batches.

        Mirrors ``accelerator.skip_first_batches``: call ``set_epoch(epoch)`` first, iterate the
        result for the rest of that epoch, then go back to this loader. On resume from a checkpoint
        taken after optimizer step ``s`` of an epoch, skip ``s * accumulation``.
        """
        return SkippedPass(self, num_batches)
