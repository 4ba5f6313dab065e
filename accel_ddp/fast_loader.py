"""The in-memory fast path: decode once, keep the data on the training device, work in batches.

A textbook input pipeline spends a large share of each step turning one sample at a time into
a tensor (PIL decode, ToTensor, Normalize, collate, host-to-device copy). Small datasets need
none of that after the first time: :class:`InMemoryDataset` holds every sample in one compact
tensor (uint8 where the source is uint8) and :class:`DeviceLoader` keeps it on the training
device, draws exactly the permutation Accelerate's seedable sampler draws, and gathers, augments
and normalises whole micro-batches there.

    >>> data = InMemoryDataset(torch.zeros(64, 1, 8, 8, dtype=torch.uint8), torch.zeros(64), scale=255.0)
    >>> loader = DeviceLoader(data, per_device_batch_size=8, global_batch_size=16, seed=0, rank=1, world_size=2)
    >>> len(loader)  # micro-batches per rank per epoch
    4
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Sequence

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset, Subset, TensorDataset

from accel_ddp.config import ConfigError

AUGMENTS = (None, "crop_flip")
CROP_PADDING = 4  # pixels of zero padding around each image before a random crop (the CIFAR-10 recipe)
_AUGMENT_SEED_OFFSET = 1_000_003  # augmentation draws come from their own stream, apart from the permutation's


class InMemoryDataset(Dataset):
    """Every sample in one tensor; uint8 samples are normalised when read, singly or in batches.

    ``inputs`` is ``(N, *sample_shape)``; ``labels`` is ``(N,)``. For uint8 inputs with ``scale``
    (or ``mean``/``std``) set, a sample reads as ``(x.float() / scale - mean) / std`` with one mean
    and std per channel (dimension 0 of a sample) or one for all: the textbook float32 operations,
    elementwise, so the DataLoader path (on the CPU) and the fast path (on the device) give the same
    bits. Other inputs are served as stored. ``augment="crop_flip"`` adds a random 4-pixel-padded
    crop and horizontal flip to training reads of ``(C, H, W)`` images.

        >>> images = torch.randint(0, 256, (100, 1, 28, 28), dtype=torch.uint8)
        >>> ds = InMemoryDataset(images, torch.zeros(100, dtype=torch.long), mean=(0.1307,), std=(0.3081,), scale=255.0)
        >>> ds[0][0].dtype, ds[0][0].shape
        (torch.float32, torch.Size([1, 28, 28]))
    """

    def __init__(
        self,
        inputs: torch.Tensor,
        labels: torch.Tensor,
        mean: Sequence[float] | None = None,
        std: Sequence[float] | None = None,
        scale: float | None = None,
        augment: str | None = None,
    ):
        if len(inputs) != len(labels):
            raise ValueError(f"{len(inputs)} inputs but {len(labels)} labels")
        if augment not in AUGMENTS:
            raise ValueError(f"augment must be one of {AUGMENTS}, got {augment!r}")
        if augment is not None and inputs.dim() != 4:
            raise ValueError(f"augment={augment!r} needs (N, C, H, W) images, got shape {tuple(inputs.shape)}")
        self.inputs, self.labels = inputs, labels
        self.mean, self.std, self.scale, self.augment = mean, std, scale, augment
        self.affine = None  # (scale, mean, std) tensors shaped to broadcast over a batch
        if inputs.dtype == torch.uint8 and (scale is not None or mean is not None):
            self.affine = _affine(mean or (0.0,), std or (1.0,), scale or 1.0, inputs.dim() - 1)
            if len(self.affine[1]) not in (1, inputs.shape[1]):
                raise ValueError(f"{len(self.affine[1])} means/stds for samples of {inputs.shape[1]} channels")

    def __len__(self) -> int:
        return len(self.labels)

    @property
    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(inputs, labels)`` as stored, as on a TensorDataset (what ``train()`` reads the class count from)."""
        return self.inputs, self.labels

    @property
    def nbytes(self) -> int:
        """Bytes the samples and labels take as stored (what the fast path puts on the device)."""
        return sum(t.numel() * t.element_size() for t in (self.inputs, self.labels))

    def __getitem__(self, index):
        return self.__getitems__([index])[0]

    def __getitems__(self, indices) -> list[tuple[torch.Tensor, torch.Tensor]]:
        # The DataLoader calls this once per batch: one gather and one normalisation, not one per sample.
        index = torch.as_tensor(indices, dtype=torch.long)
        params = draw_crop_flip(len(index)) if self.augment else None
        inputs = self.transform(torch.index_select(self.inputs, 0, index), params)
        return list(zip(inputs.unbind(0), torch.index_select(self.labels, 0, index).unbind(0), strict=True))

    def transform(self, batch: torch.Tensor, crop_flip_params: torch.Tensor | None = None) -> torch.Tensor:
        """Stored samples ``(B, *shape)`` to model inputs: augment (given its parameters), then normalise."""
        if crop_flip_params is not None:
            batch = crop_flip(batch, crop_flip_params)
        if self.affine is None:
            return batch
        scale, mean, std = (t.to(batch.device) for t in self.affine)
        # Tensor operands, never Python floats: CUDA turns division by a host scalar into multiplication
        # by its reciprocal, which would differ from the CPU in the last bit.
        return batch.float().div_(scale).sub_(mean).div_(std)

    def subset(self, indices) -> InMemoryDataset:
        index = torch.as_tensor(indices, dtype=torch.long)
        return self._with(self.inputs[index], self.labels[index])

    def to(self, device: torch.device | str) -> InMemoryDataset:
        moved = self._with(self.inputs.to(device), self.labels.to(device))
        if moved.affine is not None:
            moved.affine = tuple(t.to(device) for t in moved.affine)
        return moved

    def _with(self, inputs: torch.Tensor, labels: torch.Tensor) -> InMemoryDataset:
        clone = copy.copy(self)
        clone.inputs, clone.labels = inputs, labels
        return clone


def _affine(mean: Sequence[float], std: Sequence[float], scale: float, sample_dims: int):
    """float32 (scale, mean, std) that broadcast over ``(B, C, ...)`` batches: per channel, or one for all."""
    if len(mean) != len(std):
        raise ValueError(f"{len(mean)} means but {len(std)} stds")
    shape = (-1, *([1] * (sample_dims - 1))) if len(mean) > 1 else (1,)
    as_tensor = lambda values: torch.tensor(values, dtype=torch.float32).view(shape)
    return torch.tensor(scale, dtype=torch.float32), as_tensor(mean), as_tensor(std)


def draw_crop_flip(count: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """``(count, 3)`` int64: a crop offset (row, column) in ``[0, 2 * CROP_PADDING]`` and a flip bit each."""
    offsets = torch.randint(0, 2 * CROP_PADDING + 1, (count, 2), generator=generator)
    flips = torch.randint(0, 2, (count, 1), generator=generator)
    return torch.cat([offsets, flips], dim=1)


def crop_flip(batch: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
    """Random crop of the zero-padded images and horizontal flip, for a whole ``(B, C, H, W)`` batch at once.

    One gather does both: a flipped image reads its crop window's columns in reverse order.
    Padding with zeros matches torchvision's ``RandomCrop(size, padding=4)``.
    """
    n, channels, height, width = batch.shape
    params = params.to(batch.device)
    padded = F.pad(batch, (CROP_PADDING,) * 4)
    rows = params[:, :1] + torch.arange(height, device=batch.device)
    cols = params[:, 1:2] + torch.arange(width, device=batch.device)
    cols = torch.where(params[:, 2:].bool(), cols.flip(1), cols)
    image = torch.arange(n, device=batch.device).view(n, 1, 1, 1)
    channel = torch.arange(channels, device=batch.device).view(1, channels, 1, 1)
    return padded[image, channel, rows[:, None, :, None], cols[:, None, None, :]]


def as_in_memory(dataset: Dataset) -> InMemoryDataset | None:
    """The dataset as one :class:`InMemoryDataset`, or None when it is not tensors already in memory.

    Handles :class:`InMemoryDataset`, a two-tensor :class:`~torch.utils.data.TensorDataset`
    (served as stored) and :class:`~torch.utils.data.Subset` of either.
    """
    if isinstance(dataset, InMemoryDataset):
        return dataset
    if isinstance(dataset, TensorDataset) and len(dataset.tensors) == 2:
        return InMemoryDataset(*dataset.tensors)
    if isinstance(dataset, Subset):
        inner = as_in_memory(dataset.dataset)
        return None if inner is None else inner.subset(list(dataset.indices))
    return None


def is_in_memory(dataset: Dataset) -> bool:
    """Whether :func:`as_in_memory` can take this dataset, without copying anything."""
    while isinstance(dataset, Subset):
        dataset = dataset.dataset
    return isinstance(dataset, InMemoryDataset) or (
        isinstance(dataset, TensorDataset) and len(dataset.tensors) == 2
    )


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
    """The first ``num_used`` indices of epoch ``epoch``'s permutation, drawn exactly as the DataLoader path draws them.

    Accelerate's ``SeedableRandomSampler`` seeds a fresh generator with ``seed + epoch`` and
    torch's ``RandomSampler`` (with ``num_samples <= len(dataset)``) keeps the first
    ``num_samples`` entries of ``torch.randperm(len(dataset))``: the same calls as here.
    """
    device = torch.get_default_device() if hasattr(torch, "get_default_device") else "cpu"
    generator = torch.Generator(device=device)
    generator.manual_seed(seed + epoch)
    return torch.randperm(num_samples, generator=generator)[:num_used]


class DeviceLoader:
    """Serves ``(inputs, labels)`` micro-batches from tensors on ``device``, with the DataLoader path's semantics.

    Each epoch draws the permutation Accelerate's seedable sampler draws (seed ``seed + epoch``),
    keeps its first ``steps_per_epoch * global_batch_size`` indices and cuts them into per-device
    batches; rank ``r`` of ``world_size`` gets batches ``r, r + world_size, ...``. So optimizer step
    ``s`` trains on samples ``order[s * G:(s + 1) * G]`` whatever the world size and accumulation,
    and every micro-step sees the same samples as on the DataLoader path. Inputs come out
    augmented (``crop_flip`` datasets; the draws depend on the seed, the epoch and the position in
    the global batch only, so they too are the same for any world size) and normalised.

    Surface of a prepared DataLoader: ``len()`` (micro-batches per rank per epoch), ``set_epoch``,
    iteration; plus :meth:`skip_first_batches` to resume mid-epoch.

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
    ):
        data = as_in_memory(dataset)
        if data is None:
            raise ConfigError(
                f"--loader fast: a {type(dataset).__name__} is not tensors in memory; use --loader dataloader, "
                "or give an accel_ddp.data.InMemoryDataset or a TensorDataset"
            )
        if per_device_batch_size <= 0 or global_batch_size % (world_size * per_device_batch_size) != 0:
            raise ConfigError(
                f"--global_batch_size {global_batch_size} is not divisible by world size {world_size} "
                f"x --per_device_batch_size {per_device_batch_size}"
            )
        self.steps_per_epoch = steps_per_epoch(len(data), global_batch_size)
        self.per_device_batch_size, self.global_batch_size = per_device_batch_size, global_batch_size
        self.accumulation = global_batch_size // (world_size * per_device_batch_size)
        self.seed, self.rank, self.world_size = seed, rank, world_size
        self.device = torch.device(device)
        self.data = data.to(self.device)
        self.epoch = 0
        self._skip = 0

    @property
    def total_batch_size(self) -> int:
        """Samples per micro-step over all ranks (as Accelerate's DataLoaderShard reports it)."""
        return self.per_device_batch_size * self.world_size

    def __len__(self) -> int:
        return self.steps_per_epoch * self.accumulation - self._skip

    def set_epoch(self, epoch: int) -> None:
        """Use epoch ``epoch``'s permutation next; the epoch also advances by one after each full pass."""
        self.epoch = epoch

    def skip_first_batches(self, num_batches: int) -> DeviceLoader:
        """A loader for the current epoch that starts after its first ``num_batches`` micro-batches.

        Mirrors ``accelerator.skip_first_batches``: call ``set_epoch(epoch)`` first, iterate the
        returned loader for the rest of that epoch, then go back to this one. On resume from a
        checkpoint taken after optimizer step ``s`` of an epoch, skip ``s * accumulation``.
        """
        if not 0 <= num_batches <= self.steps_per_epoch * self.accumulation:
            raise ValueError(f"cannot skip {num_batches} of {self.steps_per_epoch * self.accumulation} micro-batches")
        skipped = copy.copy(self)
        skipped._skip = num_batches
        return skipped

    def rank_indices(self, epoch: int) -> torch.Tensor:
        """``(micro_steps, per_device_batch)``: the sample indices this rank trains on in ``epoch``, on the CPU."""
        order = epoch_order(len(self.data), self.steps_per_epoch * self.global_batch_size, self.seed, epoch)
        return order.view(-1, self.world_size, self.per_device_batch_size)[:, self.rank]

    def _augment_params(self, epoch: int) -> torch.Tensor | None:
        if self.data.augment != "crop_flip":
            return None
        # Drawn for the whole epoch in global order, then sliced like the indices: same draws for any world size.
        generator = torch.Generator().manual_seed(self.seed + epoch + _AUGMENT_SEED_OFFSET)
        params = draw_crop_flip(self.steps_per_epoch * self.global_batch_size, generator)
        return params.view(-1, self.world_size, self.per_device_batch_size, 3)[:, self.rank]

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        epoch = self.epoch
        # The DataLoader path draws one base seed from the global generator per pass; do the same so that
        # whatever else uses that generator (dropout) sees the same stream on both paths.
        torch.empty((), dtype=torch.int64).random_()
        indices = self.rank_indices(epoch).to(self.device, non_blocking=True)
        params = self._augment_params(epoch)
        if params is not None:
            params = params.to(self.device, non_blocking=True)
        inputs, labels = self.data.inputs, self.data.labels
        for micro_step in range(self._skip, len(indices)):
            index = indices[micro_step]
            batch_params = None if params is None else params[micro_step]
            # index_select, not inputs[index]: on the CPU it is an order of magnitude faster.
            batch = torch.index_select(inputs, 0, index)
            yield self.data.transform(batch, batch_params), torch.index_select(labels, 0, index)
        self.epoch = epoch + 1


class DeviceEvalLoader:
    """This rank's contiguous share of an in-memory eval set, in batches on ``device``.

    Rank ``r`` of ``w`` gets samples ``[r * N // w, (r + 1) * N // w)``: every sample lands on
    exactly one rank and nothing is padded, so :func:`accel_ddp.evaluate.evaluate` sums its
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

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        torch.empty((), dtype=torch.int64).random_()  # the seed draw of a DataLoader pass, as DeviceLoader makes
        inputs = self.data.inputs.tensor_split(self.num_batches)
        labels = self.data.labels.tensor_split(self.num_batches)
        for batch, batch_labels in zip(inputs, labels, strict=True):
            yield self.data.transform(batch), batch_labels
