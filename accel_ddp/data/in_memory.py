"""Datasets held as tensors in memory: decode once, then gather, augment and normalise whole batches.

:class:`InMemoryDataset` keeps every sample in one compact tensor (uint8 where the source is
uint8). Both loaders serve it: the device loader (``device_loader.py``, the data copied once to
the training device) and a plain DataLoader (one gather per batch through ``__getitems__``).

    >>> images = torch.randint(0, 256, (100, 1, 28, 28), dtype=torch.uint8)
    >>> ds = InMemoryDataset(images, torch.zeros(100, dtype=torch.long), scale=255.0)
    >>> ds[0][0].dtype
    torch.float32
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset, Subset, TensorDataset

from accel_ddp.data.sampler import PlacedBatch, sample_seed

AUGMENTS = (None, "crop_flip")
CROP_PADDING = 4  # pixels of zero padding around each image before a random crop (the CIFAR-10 recipe)
_AUGMENT_STREAM = 1_000_003  # augmentation draws come from their own stream, apart from the permutation's


class InMemoryDataset(Dataset):
    """Every sample in one tensor; uint8 samples are normalised when read, singly or in batches.

    ``inputs`` is ``(N, *sample_shape)``; ``labels`` is ``(N,)``. For uint8 inputs with ``scale``
    (or ``mean``/``std``) set, a sample reads as ``(x.float() / scale - mean) / std`` with one mean
    and std per channel (dimension 0 of a sample) or one for all: the textbook float32 operations,
    elementwise, so the DataLoader path (on the CPU) and the device loader give the same
    bits. Other inputs are served as stored. ``augment="crop_flip"`` adds a random 4-pixel-padded
    crop and horizontal flip to training reads of ``(C, H, W)`` images: drawn by
    :func:`crop_flip_params` from the run's seed, the epoch and the sample's position when the
    batch comes from the package's sampler (a :class:`~accel_ddp.data.sampler.PlacedBatch`), so the
    DataLoader path, any number of workers and the device loader augment alike; from torch's global
    generator for reads by anything else.

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
            self.affine = affine_params(mean or (0.0,), std or (1.0,), scale or 1.0, inputs.dim() - 1)
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
        """Bytes the samples and labels take as stored (what the device loader puts on the device)."""
        return sum(t.numel() * t.element_size() for t in (self.inputs, self.labels))

    def __getitem__(self, index):
        return self.__getitems__([index])[0]

    handles_placed_batches = True  # the DataLoader path passes PlacedBatch as is: no per-sample reseeding needed

    def __getitems__(self, indices) -> list[tuple[torch.Tensor, torch.Tensor]]:
        # The DataLoader calls this once per batch: one gather and one normalisation, not one per sample.
        index = torch.as_tensor(list(indices), dtype=torch.long)
        params = None
        if self.augment and isinstance(indices, PlacedBatch):
            params = crop_flip_params(indices.seed, indices.epoch, indices.first_position, len(indices),
                                      indices.global_batch_size)
        elif self.augment:
            params = draw_crop_flip(len(index))
        inputs = self.transform(torch.index_select(self.inputs, 0, index), params)
        return list(zip(inputs.unbind(0), torch.index_select(self.labels, 0, index).unbind(0), strict=True))

    def gather(self, index: torch.Tensor, crop_flip_params: torch.Tensor | None = None):
        """The micro-batch of the samples at ``index`` (on the data's device), as the loaders yield it."""
        # index_select, not inputs[index]: on the CPU it is an order of magnitude faster.
        return self.as_batch(torch.index_select(self.inputs, 0, index), torch.index_select(self.labels, 0, index),
                             crop_flip_params)

    def as_batch(self, inputs: torch.Tensor, labels: torch.Tensor, crop_flip_params: torch.Tensor | None = None):
        """Stored rows to a batch: ``(inputs augmented and normalised, labels)``."""
        return self.transform(inputs, crop_flip_params), labels

    def transform(self, batch: torch.Tensor, crop_flip_params: torch.Tensor | None = None) -> torch.Tensor:
        """Stored samples ``(B, *shape)`` to model inputs: augment (given its parameters), then normalise."""
        if crop_flip_params is not None:
            batch = crop_flip(batch, crop_flip_params)
        return batch if self.affine is None else normalise(batch, self.affine)

    @property
    def normalised_nbytes(self) -> int:
        """Bytes the samples would take normalised (float32) instead of as stored, with the labels."""
        return self.inputs.numel() * 4 + self.labels.numel() * self.labels.element_size()

    def normalised(self) -> InMemoryDataset:
        """The same samples held normalised (float32), so that reading a batch is a gather only. The same bits as
        normalising each batch (elementwise operations); only without augmentation, which comes first."""
        if self.affine is None or self.augment is not None:
            return self
        clone = self._with(normalise(self.inputs, self.affine), self.labels)
        clone.affine = None
        return clone

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


class TokenBlocks(InMemoryDataset):
    """``causal_lm``'s packed token blocks ``(N, max_length)`` in memory: samples and batches ``{"input_ids": ...}``.

    What the memory-mapped path's batches hold, less the ``attention_mask``: a packed block has no
    padding, so its mask would be all ones, and a Transformers model given none attends causally over
    the whole block, as with an all-ones mask. The labels are the inputs themselves (one tensor, not a
    copy; the task shifts them), so ``nbytes`` counts it once. Both loaders serve it: the device loader
    gathers a batch with one ``index_select``; a DataLoader reads whole batches through ``__getitems__``.

        >>> blocks = TokenBlocks(torch.arange(12).view(3, 4))
        >>> blocks[1]["input_ids"].tolist(), blocks.nbytes
        ([4, 5, 6, 7], 96)
    """

    def __init__(self, input_ids: torch.Tensor):
        if input_ids.dim() != 2:
            raise ValueError(f"token blocks are (blocks, length), got shape {tuple(input_ids.shape)}")
        super().__init__(input_ids, input_ids)

    @property
    def nbytes(self) -> int:
        return self.inputs.numel() * self.inputs.element_size()

    def __getitems__(self, indices) -> list[dict[str, torch.Tensor]]:
        rows = torch.index_select(self.inputs, 0, torch.as_tensor(list(indices), dtype=torch.long))
        return [{"input_ids": row} for row in rows.unbind(0)]

    def gather(self, index: torch.Tensor, crop_flip_params: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        return {"input_ids": torch.index_select(self.inputs, 0, index)}

    def as_batch(self, inputs: torch.Tensor, labels: torch.Tensor, crop_flip_params=None) -> dict[str, torch.Tensor]:
        return {"input_ids": inputs}

    def subset(self, indices) -> TokenBlocks:
        return TokenBlocks(self.inputs[torch.as_tensor(indices, dtype=torch.long)])

    def to(self, device: torch.device | str) -> TokenBlocks:
        return TokenBlocks(self.inputs.to(device))


def affine_params(mean: Sequence[float], std: Sequence[float], scale: float, sample_dims: int):
    """float32 (scale, mean, std) that broadcast over ``(B, C, ...)`` batches: per channel, or one for all."""
    if len(mean) != len(std):
        raise ValueError(f"{len(mean)} means but {len(std)} stds")
    shape = (-1, *([1] * (sample_dims - 1))) if len(mean) > 1 else (1,)
    as_tensor = lambda values: torch.tensor(values, dtype=torch.float32).view(shape)
    return torch.tensor(scale, dtype=torch.float32), as_tensor(mean), as_tensor(std)


def normalise(batch: torch.Tensor, affine: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """``(x.float() / scale - mean) / std`` for a uint8 batch, the same bits on every device."""
    scale, mean, std = (t.to(batch.device) for t in affine)
    # Tensor operands, never Python floats: CUDA turns division by a host scalar into multiplication
    # by its reciprocal, which would differ from the CPU in the last bit.
    return batch.float().div_(scale).sub_(mean).div_(std)


def draw_crop_flip(count: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """``(count, 3)`` int64: a crop offset (row, column) in ``[0, 2 * CROP_PADDING]`` and a flip bit each."""
    offsets = torch.randint(0, 2 * CROP_PADDING + 1, (count, 2), generator=generator)
    flips = torch.randint(0, 2, (count, 1), generator=generator)
    return torch.cat([offsets, flips], dim=1)


def crop_flip_params(seed: int, epoch: int, first_position: int, count: int, global_batch_size: int) -> torch.Tensor:
    """``(count, 3)`` crop-and-flip parameters of positions ``first_position ...`` of epoch ``epoch``'s order.

    One draw of ``global_batch_size`` parameters per optimizer step, from a generator seeded by
    ``(seed, epoch, step)``: a sample's augmentation depends on where it sits in the epoch, not on
    the world size, the worker that reads it or where a run was resumed.
    """
    parts = []
    position, end = first_position, first_position + count
    while position < end:
        step, offset = divmod(position, global_batch_size)
        generator = torch.Generator().manual_seed(sample_seed(seed, epoch, step, _AUGMENT_STREAM))
        take = min(end - position, global_batch_size - offset)
        parts.append(draw_crop_flip(global_batch_size, generator)[offset:offset + take])
        position += take
    return torch.cat(parts) if parts else torch.zeros(0, 3, dtype=torch.long)


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


def without_subsets(dataset: Dataset) -> Dataset:
    """The dataset under any :class:`~torch.utils.data.Subset` wrappers (``--debug``'s, a caller's)."""
    while isinstance(dataset, Subset):
        dataset = dataset.dataset
    return dataset


def is_in_memory(dataset: Dataset) -> bool:
    """Whether :func:`as_in_memory` can take this dataset, without copying anything."""
    dataset = without_subsets(dataset)
    return isinstance(dataset, InMemoryDataset) or (
        isinstance(dataset, TensorDataset) and len(dataset.tensors) == 2
    )


def in_memory_labels(dataset: Dataset) -> torch.Tensor | None:
    """The labels of a dataset :func:`as_in_memory` takes, as stored (without copying its inputs), or None."""
    if isinstance(dataset, InMemoryDataset):
        return dataset.labels
    if isinstance(dataset, TensorDataset) and len(dataset.tensors) == 2:
        return dataset.tensors[1]
    if isinstance(dataset, Subset):
        inner = in_memory_labels(dataset.dataset)
        return None if inner is None else inner[torch.as_tensor(list(dataset.indices), dtype=torch.long)]
    return None
