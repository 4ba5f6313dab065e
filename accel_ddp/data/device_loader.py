"""The device loader: an in-memory training set kept on the training device, served in micro-batches.

A textbook input pipeline spends a large share of each step turning one sample at a time into
a tensor (PIL decode, ToTensor, Normalize, collate, host-to-device copy). Small datasets need
none of that after the first time: :class:`DeviceLoader` copies an
:class:`~accel_ddp.data.in_memory.InMemoryDataset` to the device once, takes the order of
:class:`~accel_ddp.data.sampler.GlobalBatchSampler` (the DataLoader path's), and gathers, augments
and normalises whole micro-batches there. :class:`DeviceEvalLoader` is its evaluation counterpart.

    >>> data = InMemoryDataset(torch.zeros(64, 1, 8, 8, dtype=torch.uint8), torch.zeros(64), scale=255.0)
    >>> loader = DeviceLoader(data, per_device_batch_size=8, global_batch_size=16, seed=0, rank=1, world_size=2)
    >>> len(loader)  # micro-batches per rank per epoch
    4
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import Dataset

from accel_ddp.data.in_memory import as_in_memory, crop_flip_params
from accel_ddp.data.non_finite import non_finite_samples
from accel_ddp.data.sampler import GlobalBatchLoader
from accel_ddp.util.validation import ConfigError


class DeviceLoader(GlobalBatchLoader):
    """Serves micro-batches from tensors on ``device``, with the DataLoader path's semantics.

    A batch is ``(inputs, labels)``, or ``{"input_ids": ...}`` for
    :class:`~accel_ddp.data.in_memory.TokenBlocks` (each dataset's ``gather`` makes it).

    The order is :class:`~accel_ddp.data.sampler.GlobalBatchSampler`'s: each epoch's permutation
    (seed ``seed + epoch``) keeps its first ``steps_per_epoch * global_batch_size`` indices, cut into
    per-device batches; rank ``r`` of ``world_size`` gets batches ``r, r + world_size, ...``. So
    optimizer step ``s`` trains on samples ``order[s * G:(s + 1) * G]`` whatever the world size and
    accumulation, and every micro-step sees the same samples as on the DataLoader path. Inputs
    come out augmented (``crop_flip`` datasets; the draws depend on the seed, the epoch and the
    position in the epoch only, so they too are the same for any world size) and normalised.

    Surface of a prepared DataLoader: ``len()`` (micro-batches per rank per epoch), ``set_epoch``,
    iteration; plus :meth:`skip_first_batches` to resume mid-epoch. It draws nothing from torch's
    global generator (nor does the DataLoader path), so dropout masks do not depend on the loader.

    Gradient sync: Accelerate's ``accumulate`` syncs on the last micro-batch of a registered
    DataLoader or every ``accumulation`` micro-steps by its own counter. This loader is not
    registered, and an epoch holds a whole number of optimizer steps, so the counter alone puts
    every sync on an optimizer-step boundary (the counter is saved and restored by
    ``save_state``/``load_state``).
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
        normalised_max_mb: float = 0.0,
    ):
        data = as_in_memory(dataset)
        if data is None:
            raise ConfigError(
                f"--loader device: a {type(dataset).__name__} is not tensors in memory; use --loader dataloader, "
                "or give an accel_ddp.data.InMemoryDataset or a TensorDataset"
            )
        super().__init__(len(data), per_device_batch_size, global_batch_size, seed=seed, rank=rank,
                         world_size=world_size, device=device)
        self.data = data.to(self.device)
        # Normalised once, where it fits (float32: 4x uint8): a micro-batch is then one gather, as in a bare loop
        # over a normalised tensor; the per-batch cast and normalisation were 4 device operations per step
        # (benchmarks/ops_per_step.py). The same bits either way.
        if self.data.normalised_nbytes <= normalised_max_mb * 2**20:
            self.data = self.data.normalised()

    def rank_indices(self, epoch: int) -> torch.Tensor:
        """``(micro_steps, per_device_batch)``: the sample indices this rank trains on in ``epoch``, on the CPU."""
        return self.sampler.rank_indices(epoch)

    def report_bad_inputs(self, report) -> None:
        """``--on_anomaly skip|rollback`` (``GlobalBatchLoader.report_bad_inputs``): the samples with a nan or inf input
        are found once, now (one pass over the inputs held on the device, as start-up's check)."""
        super().report_bad_inputs(report)
        self._bad_samples = non_finite_samples(getattr(self.data, "inputs", None))

    _bad_samples: torch.Tensor | None = None

    def _bad_micro_steps(self, epoch: int) -> dict[int, int]:
        """{micro-step: row of its first bad sample} of this rank in ``epoch`` (host arithmetic, once per epoch)."""
        if self.on_bad_input is None or self._bad_samples is None or not len(self._bad_samples):
            return {}
        hits = torch.isin(self.rank_indices(epoch), self._bad_samples)
        return {int(step): int(hits[step].nonzero()[0]) for step in hits.any(dim=1).nonzero().flatten()}

    def _augment_params(self, epoch: int) -> torch.Tensor | None:
        if self.data.augment != "crop_flip":
            return None
        # Drawn for the whole epoch in global order, then sliced like the indices: same draws for any world size.
        used = self.steps_per_epoch * self.global_batch_size
        params = crop_flip_params(self.seed, epoch, 0, used, self.global_batch_size)
        return params.view(-1, self.world_size, self.per_device_batch_size, 3)[:, self.rank]

    def __iter__(self) -> Iterator[Any]:
        epoch = self.sampler.epoch
        indices = self.rank_indices(epoch).to(self.device, non_blocking=True)
        params = self._augment_params(epoch)
        if params is not None:
            params = params.to(self.device, non_blocking=True)
        bad = self._bad_micro_steps(epoch)  # --on_anomaly skip|rollback: {} unless the set holds a nan/inf input
        for micro_step in range(self.sampler.start, len(indices)):
            if micro_step in bad:  # on the host, known since the start: no device sync
                self.on_bad_input(f"{self._sample_name(epoch, micro_step, bad[micro_step])} holds nan or inf input "
                                  "values")
            yield self.data.gather(indices[micro_step], None if params is None else params[micro_step])
        self.sampler.set_epoch(epoch + 1)


class DeviceEvalLoader:
    """This rank's contiguous share of an in-memory eval set, in batches on ``device``.

    Rank ``r`` of ``w`` gets samples ``[r * N // w, (r + 1) * N // w)``: every sample lands on
    exactly one rank and nothing is padded, so :func:`accel_ddp.evaluation.evaluate` sums its
    counts over the ranks (``sums_across_ranks``) instead of gathering per-sample results. No
    DataLoader, no sampler, one view per batch, and no ``accelerator.prepare`` (which imports the
    ``datasets`` package, a second of start-up on every rank, for any multi-process loader).

    Every rank yields the same number of non-empty batches (the largest share's count; each share
    is split into that many near-equal batches), because a wrapped model may communicate in any
    forward: DDP syncs buffers in the first one after training, FSDP gathers parameters in each.
    """

    sums_across_ranks = True

    @staticmethod
    def can_shard(num_samples: int, batch_size: int, world_size: int) -> bool:
        """Whether equal batch counts leave no rank an empty batch: true from 2 samples per rank and per batch."""
        return batch_size >= 2 and num_samples >= 2 * world_size

    def __init__(self, dataset: Dataset, batch_size: int, *, rank: int = 0, world_size: int = 1,
                 device: torch.device | str = "cpu"):
        data = as_in_memory(dataset)
        if data is None or not self.can_shard(len(data), batch_size, world_size):
            raise ConfigError(f"cannot shard this eval set ({type(dataset).__name__}, batch {batch_size}, "
                              f"{world_size} ranks) in memory; evaluate through a DataLoader")
        largest_share = -(-len(data) // world_size)
        self.num_batches = -(-largest_share // batch_size)
        start, stop = rank * len(data) // world_size, (rank + 1) * len(data) // world_size
        self.data = data.subset(range(start, stop)).to(device)

    def __len__(self) -> int:
        return self.num_batches

    def __iter__(self) -> Iterator[Any]:
        torch.empty((), dtype=torch.int64).random_()  # the seed draw of a DataLoader pass, as DeviceLoader makes
        inputs = self.data.inputs.tensor_split(self.num_batches)
        labels = self.data.labels.tensor_split(self.num_batches)
        for batch, batch_labels in zip(inputs, labels, strict=True):
            yield self.data.as_batch(batch, batch_labels)
