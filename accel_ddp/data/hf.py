"""Hugging Face ``datasets`` as a training source: decoded into memory, read memory-mapped, or streamed.

Where the data comes from and which columns: :mod:`accel_ddp.data.hf_source`. How it is held
(:class:`HFSource`): a training set whose decoded size (estimated from the schema, the first
image and the row count) fits ``in_memory_max_mb`` is decoded once into an
:class:`~accel_ddp.data.in_memory.InMemoryDataset` (the device loader can serve it); a larger one
stays in its Arrow files, memory-mapped, and is decoded per batch in the DataLoader's workers
(:class:`~accel_ddp.data.mapped.MappedDataset`); ``streaming`` reads it as it streams
(:mod:`accel_ddp.data.hf_stream`, :mod:`accel_ddp.data.streaming`). Each sample is the same on every path.

Inputs are the image column (decoded with PIL, uint8, ``(C, H, W)``), an array column, or, without
either, every numeric column but the label (a CSV of pixels). uint8 inputs are normalised with
per-channel mean and std measured on a fixed sample of ``STATS_SAMPLE`` training rows, so
that no path needs a full decode; float inputs are served as stored.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from accel_ddp.data.bundle import DatasetBundle
from accel_ddp.data.hf_source import HFSource, bad_text_named, input_column_of, label_column_of, load_splits
from accel_ddp.data.in_memory import InMemoryDataset
from accel_ddp.data.mapped import (
    ArrayRows,
    ImageRows,
    MappedDataset,
    PageTrimmer,
    arrow_files,
    decode_images,
    image_mode,
    open_image,
)
from accel_ddp.data.memory_budget import say
from accel_ddp.util.validation import ConfigError

DECODE_CHUNK = 1024  # rows decoded per slice: bounds the PIL images alive at once
STATS_SAMPLE = 1024  # training rows (a fixed random sample) that uint8 normalisation statistics come from
STATS_CHUNK = 128  # images per float64 pass of the statistics (bounds its temporary memory)
STATS_SEED = 0x5EED  # that sample's seed: apart from the data seeds people use (0, 1, 42), whose epoch 0 it would be
# The most classes a label column of ids or names may make (docs/data-and-models.md): ImageNet-21k has 21,841. A
# sparse id (a label of 2,000,000,000) would otherwise size the model's output layer (a MemoryError minutes later).
MAX_CLASSES = 100_000


def build_hf(data_dir: str, download: bool, source: HFSource | None = None, image_size: int | None = None):
    """A :class:`~accel_ddp.data.DatasetBundle` from a Hugging Face dataset, decoded into memory or memory-mapped
    as ``source`` says (``source.streaming``: :func:`accel_ddp.data.hf_stream.build_stream` instead)."""
    source = source or HFSource()
    train, eval_split = load_splits(data_dir, source)
    PageTrimmer(arrow_files(train) + (arrow_files(eval_split) if eval_split is not None else []))()  # load's scan
    with bad_text_named(data_dir, source):  # label names are read here, every row of them
        return _held(train, eval_split, source, image_size)


def _held(train, eval_split, source: HFSource, image_size: int | None) -> DatasetBundle:
    """The loaded splits decoded into memory, or left memory-mapped when larger than ``source.in_memory_max_mb``."""
    label_col = label_column_of(train, source.label_column)
    input_col = input_column_of(train, source.image_column, label_col)
    if source.in_memory_max_mb is not None and \
            (nbytes := decoded_nbytes(train, input_col, label_col, image_size)) > source.in_memory_max_mb * 2**20:
        if source.memory_limit is not None:  # over this machine's memory budget, not the flag: one line says so
            say(source.memory_limit.note("the decoded training set", nbytes, source.in_memory_max_mb))
        return _mapped_bundle(train, eval_split, input_col, label_col, image_size)

    train_x, layout = _inputs(train, input_col, label_col, image_size, layout=None)
    train_y, eval_y, num_classes = split_labels(train, eval_split, label_col)
    if eval_split is not None:
        eval_x, _ = _inputs(eval_split, input_col, label_col, image_size, layout=layout)
    else:  # no eval split: hold out a fixed 10% of train (seed 0), the same on every rank
        train_rows, eval_rows = held_out(len(train_x))
        train_x, eval_x = train_x[train_rows], train_x[eval_rows]
        train_y, eval_y = train_y[train_rows], train_y[eval_rows]
    pixels: dict[str, Any] = {}
    if train_x.dtype == torch.uint8:
        mean, std = uint8_stats(train_x[stats_rows(len(train_x))])
        pixels = {"scale": 255.0, "mean": mean, "std": std}
    return DatasetBundle(
        InMemoryDataset(train_x, train_y, **pixels),
        InMemoryDataset(eval_x, eval_y, **pixels),
        num_classes=num_classes,
        input_shape=tuple(train_x.shape[1:]),
    )


def held_out(num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(train rows, eval rows) when a dataset has no eval split: a fixed 10% (seed 0), the same on every rank."""
    order = torch.randperm(num_rows, generator=torch.Generator().manual_seed(0))
    n_eval = max(num_rows // 10, 1)
    return order[n_eval:], order[:n_eval]


def stats_rows(num_rows: int) -> torch.Tensor:
    """The training rows normalisation statistics come from: ``STATS_SAMPLE`` of them (``STATS_SEED``), sorted."""
    return torch.randperm(num_rows, generator=torch.Generator().manual_seed(STATS_SEED))[:STATS_SAMPLE].sort().values


def decoded_nbytes(ds, input_col: str | None, label_col: str, image_size: int | None) -> int:
    """Bytes the training set would take decoded into memory, from its schema, first row and row count."""
    import datasets

    first = ds[0]
    if input_col is not None and isinstance(ds.features[input_col], datasets.Image):
        image = open_image(_raw_images(ds, input_col)[0][input_col])
        width, height = (image_size, image_size) if image_size else image.size
        per_sample = (1 if image_mode(image) == "L" else 3) * width * height
    elif input_col is not None:
        array = np.asarray(first[input_col])
        per_sample = array.size * (1 if array.dtype == np.uint8 else 4)
    else:
        per_sample = 4 * (len(ds.column_names) - 1)
    return len(ds) * (per_sample + 8)  # + an int64 label


def _raw_images(ds, column: str):
    """The dataset with its image column undecoded: ``{"bytes", "path"}`` values that we decode ourselves."""
    import datasets

    return ds.cast_column(column, datasets.Image(decode=False))


def _mapped_bundle(train, eval_split, input_col: str | None, label_col: str, image_size: int | None) -> DatasetBundle:
    """Train and eval :class:`MappedDataset`: rows stay in the Arrow files, decoded per batch."""
    import datasets

    label_ids, num_classes = _label_ids(train, eval_split, label_col)
    train_rows = eval_rows = None
    if eval_split is None:
        train_rows, eval_rows = (rows.numpy() for rows in held_out(len(train)))
        train, eval_split = train.select(train_rows), train.select(eval_rows)
    if input_col is not None and isinstance(train.features[input_col], datasets.Image):
        train, eval_split = _raw_images(train, input_col), _raw_images(eval_split, input_col)
        image = open_image(train[0][input_col])
        mode, size = image_mode(image), (image_size, image_size) if image_size else image.size
        rows = dict(image_column=input_col, label_column=label_col, mode=mode, size=size,
                    resize=image_size is not None, label_ids=label_ids)
        raw = ImageRows(**rows, mean=(0.0,), std=(1.0,), split="train")
        mean, std = uint8_stats(_read_sample(train, lambda batch, where: raw.pixels(batch[input_col], where)))
        decoders = [ImageRows(**rows, mean=mean, std=std, split=split) for split in ("train", "eval")]
        input_shape = (1 if mode == "L" else 3, size[1], size[0])
    else:
        columns = [input_col] if input_col else [n for n in train.column_names if n != label_col]
        train, eval_split = train.with_format("numpy"), eval_split.with_format("numpy")
        pixels = all(_stored_dtype(train.features[name]) == "uint8" for name in columns)
        raw = ArrayRows(columns, label_col, label_ids, "train", pixels)
        sample = _read_sample(train, lambda batch, where: raw.inputs(batch))
        mean, std = uint8_stats(sample) if pixels else (None, None)
        decoders = [ArrayRows(columns, label_col, label_ids, split, pixels, mean, std) for split in ("train", "eval")]
        input_shape = tuple(sample.shape[1:])
    mapped = [MappedDataset(ds, decode, rows_of) for ds, decode, rows_of in
              zip((train, eval_split), decoders, (train_rows, eval_rows), strict=True)]
    return DatasetBundle(mapped[0], mapped[1], num_classes=num_classes, input_shape=input_shape)


def _read_sample(table, read) -> torch.Tensor:
    """``read(rows, where)`` over the statistics sample of a memory-mapped table, 64 rows at a time.

    After each chunk this process drops the file pages it mapped: read at once, 1,024 random rows
    would map hundreds of MiB of the files into the resident set (more, the larger the dataset).
    """
    trim, rows = PageTrimmer(arrow_files(table)), stats_rows(len(table)).tolist()
    parts = []
    for start in range(0, len(rows), 64):
        chunk = rows[start:start + 64]
        parts.append(read(table[chunk], [f"row {n}" for n in chunk]))
        trim()
    return torch.cat(parts)


@dataclass(frozen=True)
class LabelValues:
    """What the label rule needs of a label column, however a path reads it (Arrow columns, numpy arrays, rows)."""

    numeric: bool  # every value a number
    bounds: Callable[[], tuple[Any, Any, bool]]  # numeric only: (smallest, largest, all whole numbers)
    where: Callable[[Any], str]  # numeric only: where the value given is found, for the error line
    names: Callable[[], list[str]]  # otherwise: the distinct values as text


def class_ids(feature, column: str, values: LabelValues) -> tuple[dict[str, int] | None, int]:
    """The one label rule of every hf path: (names -> ids, or None for a column of ids; number of classes).

    A ClassLabel declares its K classes; numbers must be class ids 0, 1, 2, ... (K = the largest + 1, at most
    ``MAX_CLASSES``); anything else is a class name, numbered in sorted order (the same on every rank).
    """
    import datasets

    if isinstance(feature, datasets.ClassLabel):
        return None, feature.num_classes
    if values.numeric:
        low, high, whole = values.bounds()
        if low < 0 or not whole:
            raise ConfigError(f"hf: labels in {column!r} must be class ids 0, 1, 2, ...; got {low}..")
        if high >= MAX_CLASSES:
            raise ConfigError(too_many_ids(high, column, values.where(high)))
        return None, int(high) + 1
    names = values.names()
    check_class_names(len(names), column)
    return {name: i for i, name in enumerate(names)}, len(names)


def _label_ids(train, eval_split, column: str) -> tuple[dict[str, int] | None, int]:
    """``class_ids`` from the label column's Arrow data alone (no row is decoded)."""
    import pyarrow.compute as pc

    columns = [ds.data.column(column) for ds in (train, eval_split) if ds is not None]

    def bounds() -> tuple[Any, Any, bool]:
        return (min(pc.min(c).as_py() for c in columns), max(pc.max(c).as_py() for c in columns),
                all(pc.all(pc.equal(c, pc.round(c))).as_py() for c in columns))

    def where(high: Any) -> str:
        split, c = next((name, c) for name, c in zip(("train", "eval"), columns, strict=False)
                        if pc.max(c).as_py() == high)
        return f"row {pc.index(c, high).as_py()} of the {split!r} split"

    return class_ids(train.features[column], column, LabelValues(
        all(pa_type_is_number(c.type) for c in columns), bounds, where,
        lambda: sorted({str(v) for c in columns for v in pc.unique(c).to_pylist()})))


def too_many_ids(high: Any, column: str, place: str) -> str:
    """The one line for a class id that would make more than ``MAX_CLASSES`` classes."""
    return (f"hf: label {high} in column {column!r} ({place}) makes {int(high) + 1:,} classes; class ids run from 0 "
            f"to K-1 with K at most {MAX_CLASSES:,}: number the classes from 0, store the labels as text (names are "
            "numbered in sorted order), or as a ClassLabel, which declares K")


def check_class_names(count: int, column: str) -> None:
    if count > MAX_CLASSES:
        raise ConfigError(f"hf: column {column!r} holds {count:,} different labels, more than the {MAX_CLASSES:,} "
                          "classes a label column may make; is it the label column? pick that with --label_column, "
                          "or store the labels as a ClassLabel, which declares the classes")


def _stored_dtype(feature) -> str | None:
    """The element type a column stores (``uint8``, ``float32``, ...) for values, arrays and lists of them."""
    while getattr(feature, "dtype", None) in (None, "list") and hasattr(feature, "feature"):
        feature = feature.feature  # List / Sequence of ...
    return getattr(feature, "dtype", None)


def pa_type_is_number(pa_type) -> bool:
    import pyarrow as pa

    return pa.types.is_integer(pa_type) or pa.types.is_floating(pa_type)


def _inputs(ds, column: str | None, label_col: str, image_size: int | None, layout):
    """(inputs tensor, layout) where layout carries the image mode and size over from train to eval."""
    import datasets

    if column is not None and isinstance(ds.features[column], datasets.Image):
        return _decode_images(ds, column, image_size, layout, split="train" if layout is None else "eval")
    if column is None:
        names = [n for n in ds.column_names if n != label_col]
        table = ds.with_format("numpy", columns=names)[:]
        try:
            array = np.stack([np.asarray(table[n], dtype=np.float64) for n in names], axis=1)
        except (TypeError, ValueError):
            raise ConfigError(
                f"hf: columns {', '.join(names)} are not all numbers; name the input with --image_column"
            ) from None
    else:
        array = ds.with_format("numpy", columns=[column])[:][column]
        if array.dtype == object:
            raise ConfigError(f"hf: column {column!r} holds arrays of different shapes; they must all match")
        if array.ndim == 3:  # (N, H, W): one channel, so conv models see (1, H, W)
            array = array[:, None]
    if np.issubdtype(array.dtype, np.number) and array.size and array.min() >= 0 and array.max() <= 255 and (
        np.issubdtype(array.dtype, np.integer) or np.array_equal(array, np.round(array))
    ):
        return torch.from_numpy(np.ascontiguousarray(array, dtype=np.uint8)), layout
    return torch.from_numpy(np.ascontiguousarray(array, dtype=np.float32)), layout


def _decode_images(ds, column: str, image_size: int | None, layout, split: str = "train"):
    """PIL images to a uint8 ``(N, C, H, W)`` tensor: grayscale stays one channel, anything else becomes RGB.

    The same decoding as the memory-mapped path's (:func:`~accel_ddp.data.mapped.decode_images`), a chunk
    of rows at a time.
    """
    ds = _raw_images(ds, column)
    if layout is None:
        first = open_image(ds[0][column])
        layout = (image_mode(first), (image_size, image_size) if image_size else first.size)
    mode, size = layout
    out = torch.empty((len(ds), 1 if mode == "L" else 3, size[1], size[0]), dtype=torch.uint8)
    trim = PageTrimmer(arrow_files(ds))  # the decoded copy is what this path keeps, not the files' pages
    for start in range(0, len(ds), DECODE_CHUNK):
        stop = min(start + DECODE_CHUNK, len(ds))
        out[start:stop] = decode_images(ds[start:stop][column], mode, size, image_size is not None,
                                        [f"row {n}" for n in range(start, stop)], column, split)
        trim()
    return out, layout


def split_labels(train, eval_, column: str):
    """(train labels, eval labels, number of classes): ``class_ids`` over the decoded columns, names mapped."""
    def column_of(ds):
        return None if ds is None else np.asarray(ds.with_format("numpy", columns=[column])[:][column])

    train_raw, eval_raw = column_of(train), column_of(eval_)
    both = train_raw if eval_raw is None else np.concatenate([train_raw, eval_raw])

    def where(high: Any) -> str:
        row = int(both.argmax())
        split, row = ("train", row) if row < len(train_raw) else ("eval", row - len(train_raw))
        return f"row {row} of the {split!r} split"

    ids, num_classes = class_ids(train.features[column], column, LabelValues(
        np.issubdtype(train_raw.dtype, np.number),
        lambda: (both.min(), both.max().item(), np.array_equal(both, np.round(both))), where,
        lambda: sorted({str(v) for v in both})))
    mapped = [raw if ids is None or raw is None else np.array([ids[str(v)] for v in raw])
              for raw in (train_raw, eval_raw)]
    tensors = [None if m is None else torch.from_numpy(np.asarray(m, dtype=np.int64)) for m in mapped]
    return tensors[0], tensors[1], num_classes


def uint8_stats(inputs: torch.Tensor) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per-channel mean and std in [0, 1] units (one for all values unless inputs are (N, C, H, W) images)."""
    per_channel = inputs.dim() == 4
    channels = inputs.shape[1] if per_channel else 1
    total = torch.zeros(channels, dtype=torch.float64)
    squares = torch.zeros(channels, dtype=torch.float64)
    for start in range(0, len(inputs), STATS_CHUNK):
        chunk = inputs[start:start + STATS_CHUNK].double() / 255.0
        chunk = chunk.transpose(0, 1).reshape(channels, -1) if per_channel else chunk.reshape(1, -1)
        total += chunk.sum(dim=1)
        squares += (chunk * chunk).sum(dim=1)
    count = inputs.numel() / channels
    mean = total / count
    std = (squares / count - mean * mean).clamp_min(0).sqrt()
    std = torch.where(std > 1e-6, std, torch.ones_like(std))  # a constant channel: leave it unscaled
    return tuple(round(float(m), 4) for m in mean), tuple(round(float(s), 4) for s in std)
