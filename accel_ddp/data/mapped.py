"""Arrow-backed Hugging Face datasets read memory-mapped and decoded one batch at a time.

A ``datasets.Dataset`` (``load_from_disk``, parquet/arrow/csv/json files, ``imagefolder``: all end
up as Arrow files in the dataset's folder or cache) is a memory map: reading a row costs no
memory of its own, and :class:`MappedDataset` decodes only the rows of the batch asked for, in
the DataLoader's worker processes. Memory per rank then depends on the batch, not on the dataset.

One catch, measured: pages of a memory-mapped file that a process has read count in its
resident set (RSS) until the kernel needs them back, and with this kernel's large page-cache
folios a batch of random rows maps tens of MiB. Over an epoch a worker's RSS would grow to the
size of the dataset's files, although none of it is anonymous memory. So after each batch the
reader drops its own mappings of the dataset's pages (``madvise(MADV_DONTNEED)``, Linux): the
pages stay in the page cache, shared and reclaimable, and the next read maps them again.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from accel_ddp.data.bundle import DataError
from accel_ddp.data.in_memory import affine_params, normalise
from accel_ddp.data.sampler import PlacedBatch, global_rngs_restored, sample_seed, seed_global_rngs
from accel_ddp.util.messages import first_line

GRAY_MODES = ("1", "L", "I", "I;16", "F")


class PageTrimmer:
    """Drops this process's resident pages of some memory-mapped files (their page-cache pages stay).

    The mapped address ranges are read from ``/proc/self/maps`` once per process (a forked
    DataLoader worker inherits its parent's mappings at the same addresses). A no-op off Linux.
    """

    def __init__(self, files: Sequence[str]):
        self.files = {os.path.realpath(f) for f in files}
        self._ranges: list[tuple[int, int]] | None = None
        self._pid = -1
        self._madvise = None

    def __getstate__(self) -> dict[str, Any]:  # to a spawned worker: it finds its own mappings
        return {"files": self.files, "_ranges": None, "_pid": -1, "_madvise": None}

    def __call__(self) -> None:
        if not self.files or not sys.platform.startswith("linux"):
            return
        if self._pid != os.getpid():
            self._pid, self._ranges = os.getpid(), self._mapped_ranges()
            libc = ctypes.CDLL(None, use_errno=True)
            libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            self._madvise = libc.madvise
        for start, end in self._ranges:
            self._madvise(start, end - start, mmap.MADV_DONTNEED)

    def _mapped_ranges(self) -> list[tuple[int, int]]:
        ranges = []
        with open("/proc/self/maps", encoding="utf-8") as fh:
            for line in fh:
                fields = line.split(None, 5)
                if len(fields) == 6 and fields[5].rstrip("\n") in self.files:
                    start, end = (int(address, 16) for address in fields[0].split("-"))
                    ranges.append((start, end))
        return ranges


def arrow_files(table) -> list[str]:
    """The Arrow files behind a ``datasets.Dataset`` (none for one held in memory)."""
    return [entry["filename"] for entry in getattr(table, "cache_files", [])]


def is_arrow_dataset(dataset) -> bool:
    """A ``datasets.Dataset`` (checked without importing ``datasets``)."""
    return type(dataset).__name__ == "Dataset" and type(dataset).__module__.startswith("datasets.")


class MappedDataset(Dataset):
    """Samples of a ``datasets.Dataset`` decoded per batch: ``decode(rows, where)`` -> list of samples.

    ``rows`` is the batch as the table returns it (a dict of columns); ``where`` names each row for
    error messages (``row N``; ``rows_of`` maps this dataset's indices to the source's rows, e.g.
    after a held-out split). Without ``decode`` the table's own rows are the samples (a tokenized text
    dataset, a dataset with a transform). Batches the package's sampler places are read with the
    global generators seeded from ``(seed, epoch, position of the batch's first sample)``, for
    transforms that draw random numbers.
    """

    memory_mapped = True  # summary.json's data_source
    handles_placed_batches = True

    def __init__(self, table, decode: Callable[[dict[str, list], Sequence[str]], list] | None = None,
                 rows_of: np.ndarray | None = None):
        self.table, self.decode, self.rows_of = table, decode, rows_of
        self.trim = PageTrimmer(arrow_files(table))

    def __len__(self) -> int:
        return len(self.table)

    def __getitem__(self, index: int):
        return self.__getitems__([index])[0]

    def __getitems__(self, batch) -> list:
        seed = sample_seed(batch.seed, batch.epoch, batch.first_position) if isinstance(batch, PlacedBatch) else None
        indices = [int(i) for i in batch]
        try:
            with global_rngs_restored():
                if seed is not None:
                    seed_global_rngs(seed)
                if self.decode is None:
                    return self.table.__getitems__(indices)
                rows = self.table[indices]
                numbers = indices if self.rows_of is None else self.rows_of[indices].tolist()
                return self.decode(rows, [f"row {n}" for n in numbers])
        finally:
            self.trim()


class ImageRows:
    """Decodes a batch of rows of an image dataset into ``(image, label)`` pairs, normalised like the in-memory path.

    ``mode`` (``L`` or ``RGB``) and ``size`` (width, height) come from the training split's first
    image (``--image_size`` resizes every image to a square). ``label_ids`` maps label names to
    class ids (``None``: the column holds ids). uint8 pixels are normalised with ``(scale, mean,
    std)`` as :class:`~accel_ddp.data.in_memory.InMemoryDataset` does, in float32.
    """

    def __init__(self, image_column: str, label_column: str, mode: str, size: tuple[int, int], resize: bool,
                 label_ids: dict[str, int] | None, mean: Sequence[float], std: Sequence[float], split: str):
        self.image_column, self.label_column = image_column, label_column
        self.mode, self.size, self.resize, self.label_ids, self.split = mode, size, resize, label_ids, split
        self.affine = affine_params(mean, std, 255.0, 3)

    def pixels(self, values: list, where: Sequence[str]) -> torch.Tensor:
        """uint8 ``(B, C, H, W)`` from the image column's raw values (``{"bytes", "path"}`` dicts or PIL images)."""
        return decode_images(values, self.mode, self.size, self.resize, where, self.image_column, self.split)

    def __call__(self, rows: dict[str, list], where: Sequence[str]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        inputs = normalise(self.pixels(rows[self.image_column], where), self.affine)
        labels = batch_labels(rows[self.label_column], self.label_ids)
        return list(zip(inputs.unbind(0), labels.unbind(0), strict=True))


class ArrayRows:
    """Decodes a batch of rows of an array dataset (one array column, or several number columns) into pairs.

    Read in NumPy format. Inputs stored as uint8 (``pixels``, from the schema) are normalised with
    ``mean``/``std`` (given once measured), like the in-memory path's; anything else is served as
    float32, as stored. (The in-memory path also treats integer columns whose values all lie in
    0..255 as pixels; here only the schema decides, since the values are not all read.)
    """

    def __init__(self, columns: Sequence[str], label_column: str, label_ids: dict[str, int] | None, split: str,
                 pixels: bool = False, mean: Sequence[float] | None = None, std: Sequence[float] | None = None):
        self.columns, self.label_column, self.label_ids, self.split = list(columns), label_column, label_ids, split
        self.pixels, self.mean, self.std = pixels, mean, std

    def inputs(self, rows: dict[str, Any]) -> torch.Tensor:
        if len(self.columns) == 1:
            array = np.asarray(rows[self.columns[0]])
            if array.dtype == object:
                raise DataError(f"hf: column {self.columns[0]!r} holds arrays of different shapes in the "
                                f"{self.split!r} split; they must all match")
            if array.ndim == 3:  # (N, H, W): one channel, so conv models see (1, H, W)
                array = array[:, None]
        else:
            array = np.stack([np.asarray(rows[name], dtype=np.float64) for name in self.columns], axis=1)
        return torch.from_numpy(np.ascontiguousarray(array, dtype=np.uint8 if self.pixels else np.float32))

    def __call__(self, rows: dict[str, Any], where: Sequence[str]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        inputs = self.inputs(rows)
        if self.pixels and self.mean is not None:
            inputs = normalise(inputs, affine_params(self.mean, self.std, 255.0, inputs.dim() - 1))
        return list(zip(inputs.unbind(0), batch_labels(rows[self.label_column], self.label_ids).unbind(0),
                        strict=True))


def batch_labels(raw, label_ids: dict[str, int] | None) -> torch.Tensor:
    """int64 class ids of a batch's label column: ids as stored, or names mapped through ``label_ids``."""
    if label_ids is not None:
        return torch.tensor([label_ids[str(v)] for v in raw], dtype=torch.long)
    return torch.as_tensor(np.asarray(raw), dtype=torch.long)


def decode_images(values: list, mode: str, size: tuple[int, int], resize: bool, where: Sequence[str],
                  column: str, split: str) -> torch.Tensor:
    """PIL decode of a list of images to one uint8 ``(B, C, H, W)`` tensor; a bad image is a :class:`DataError`."""
    from PIL import Image

    channels = 1 if mode == "L" else 3
    out = np.empty((len(values), size[1], size[0], channels), dtype=np.uint8)
    for i, (value, row) in enumerate(zip(values, where, strict=True)):
        try:
            image = open_image(value)
            image = image.convert(mode)
        except Exception as err:  # PIL raises several types (UnidentifiedImageError, OSError, SyntaxError, ...)
            path = f" ({value['path']})" if isinstance(value, dict) and value.get("path") else ""
            raise DataError(
                f"hf: {row} of the {split!r} split{path} does not decode as an image in column {column!r} "
                f"({type(err).__name__}: {first_line(err)}); fix or drop that row "
                "(e.g. with datasets' filter) and save the dataset again"
            ) from None
        if image.size != size:
            if not resize:
                raise DataError(
                    f"hf: {row} of the {split!r} split is {image.size[0]}x{image.size[1]}, the first training "
                    f"image {size[0]}x{size[1]}; pass --image_size N to resize every image to NxN"
                )
            image = image.resize(size, Image.BILINEAR)
        out[i] = np.asarray(image).reshape(size[1], size[0], channels)
    return torch.from_numpy(out).permute(0, 3, 1, 2).contiguous()


def open_image(value):
    """A PIL image from a ``datasets.Image`` value: a PIL image already, or ``{"bytes": ..., "path": ...}``."""
    import io

    from PIL import Image

    if isinstance(value, dict):
        data = value.get("bytes")
        image = Image.open(io.BytesIO(data)) if data is not None else Image.open(value["path"])
        image.load()  # decode now, inside the caller's error handling
        return image
    return value


def image_mode(image) -> str:
    """``L`` for grayscale sources (one channel), ``RGB`` for anything else."""
    return "L" if image.mode in GRAY_MODES else "RGB"
