"""Hugging Face ``datasets`` as a training source: decoded into memory, read memory-mapped, or streamed.

Where the data comes from (``--dataset hf``):

- ``--hf_name NAME [--hf_config CONFIG]``: a Hub dataset (downloaded once per machine, or read
  from the local Hugging Face cache when offline);
- else ``--data_dir PATH``: a folder written by ``save_to_disk``, one parquet/csv/arrow/json file,
  a folder of them (split names from file names, e.g. ``train.parquet``, ``test.parquet``), or a
  folder of images (``train/<class>/*.png``, as the ``imagefolder`` builder reads it).

How it is held (:class:`HFSource`): a training set whose decoded size (estimated from the schema,
the first image and the row count) fits ``in_memory_max_mb`` is decoded once into an
:class:`~accel_ddp.data.in_memory.InMemoryDataset` (the device loader can serve it); a larger one
stays in its Arrow files, memory-mapped, and is decoded per batch in the DataLoader's workers
(:class:`~accel_ddp.data.mapped.MappedDataset`); ``streaming`` reads it as it streams
(:mod:`accel_ddp.data.streaming`). Each sample is the same on every path.

Inputs are the image column (decoded with PIL, uint8, ``(C, H, W)``), an array column, or, without
either, every numeric column but the label (a CSV of pixels). uint8 inputs are normalised with
per-channel mean and std measured on a fixed sample of ``STATS_SAMPLE`` training rows, so
that no path needs a full decode; float inputs are served as stored.
"""

from __future__ import annotations

import os
from typing import Any, NamedTuple

import numpy as np
import torch

from accel_ddp.config import ConfigError
from accel_ddp.data.bundle import DatasetBundle
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

EVAL_SPLITS = ("test", "validation", "valid", "val", "eval")
LABEL_COLUMNS = ("label", "labels", "target", "targets", "class", "y", "fine_label", "coarse_label")
INPUT_COLUMNS = ("image", "img", "pixel_values", "pixels", "x", "input", "inputs", "features")
FILE_BUILDERS = {".parquet": "parquet", ".arrow": "arrow", ".csv": "csv", ".json": "json", ".jsonl": "json"}
IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff")
DECODE_CHUNK = 1024  # rows decoded per slice: bounds the PIL images alive at once
STATS_SAMPLE = 1024  # training rows (a fixed random sample) that uint8 normalisation statistics come from
STATS_CHUNK = 128  # images per float64 pass of the statistics (bounds its temporary memory)
STATS_SEED = 0x5EED  # that sample's seed: apart from the data seeds people use (0, 1, 42), whose epoch 0 it would be


class HFSource(NamedTuple):
    """Where ``--dataset hf`` reads from, which columns and splits it uses, and how it holds them."""

    name: str | None = None  # Hub dataset name; None: load --data_dir
    config: str | None = None  # Hub configuration name
    train_split: str = "train"
    eval_split: str | None = None  # None: test or validation, else 10% of train (seed 0)
    image_column: str | None = None  # None: the first Image column, a known input name, else all numbers
    label_column: str | None = None  # None: the first ClassLabel column, else a known label name
    in_memory_max_mb: float | None = None  # decode into memory up to this size (MiB); larger: memory-mapped
    streaming: bool = False  # read the training split as a stream (datasets.IterableDataset)
    shuffle_buffer: int = 10_000  # streaming: examples in the shuffle buffer; 0 reads in file order


def build_hf(data_dir: str, download: bool, source: HFSource | None = None, image_size: int | None = None):
    """A :class:`~accel_ddp.data.DatasetBundle` from a Hugging Face dataset, held as ``source`` says."""
    source = source or HFSource()
    if source.streaming:
        from accel_ddp.data.streaming import build_stream

        return build_stream(data_dir, source, image_size)
    train, eval_split = load_splits(data_dir, source)
    PageTrimmer(arrow_files(train) + (arrow_files(eval_split) if eval_split is not None else []))()  # load's scan
    label_col = _label_column(train, source.label_column)
    input_col = _input_column(train, source.image_column, label_col)
    if source.in_memory_max_mb is not None and \
            decoded_nbytes(train, input_col, label_col, image_size) > source.in_memory_max_mb * 2**20:
        return _mapped_bundle(train, eval_split, input_col, label_col, image_size)

    train_x, layout = _inputs(train, input_col, label_col, image_size, layout=None)
    train_y, eval_y, num_classes = _labels(train, eval_split, label_col)
    if eval_split is not None:
        eval_x, _ = _inputs(eval_split, input_col, label_col, image_size, layout=layout)
    else:  # no eval split: hold out a fixed 10% of train (seed 0), the same on every rank
        train_rows, eval_rows = held_out(len(train_x))
        train_x, eval_x = train_x[train_rows], train_x[eval_rows]
        train_y, eval_y = train_y[train_rows], train_y[eval_rows]
    pixels: dict[str, Any] = {}
    if train_x.dtype == torch.uint8:
        mean, std = _uint8_stats(train_x[stats_rows(len(train_x))])
        pixels = {"scale": 255.0, "mean": mean, "std": std}
    return DatasetBundle(
        InMemoryDataset(train_x, train_y, **pixels),
        InMemoryDataset(eval_x, eval_y, **pixels),
        num_classes=num_classes,
        input_shape=tuple(train_x.shape[1:]),
    )


def load_splits(data_dir: str, source: HFSource, streaming: bool = False) -> tuple[Any, Any]:
    """(train split, eval split or None) as ``datasets.Dataset``: ``--hf_eval_split``, else test or validation."""
    splits = _load_splits(data_dir, source, streaming)
    if source.train_split not in splits:
        raise ConfigError(
            f"hf: no split {source.train_split!r}; it has {', '.join(splits)}; pick one with --hf_train_split"
        )
    eval_name = source.eval_split or next((s for s in EVAL_SPLITS if s in splits), None)
    if eval_name is not None and eval_name not in splits:
        raise ConfigError(f"hf: no split {eval_name!r}; it has {', '.join(splits)}; pick one with --hf_eval_split")
    return splits[source.train_split], splits[eval_name] if eval_name else None


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
        mean, std = _uint8_stats(_read_sample(train, lambda batch, where: raw.pixels(batch[input_col], where)))
        decoders = [ImageRows(**rows, mean=mean, std=std, split=split) for split in ("train", "eval")]
        input_shape = (1 if mode == "L" else 3, size[1], size[0])
    else:
        columns = [input_col] if input_col else [n for n in train.column_names if n != label_col]
        train, eval_split = train.with_format("numpy"), eval_split.with_format("numpy")
        pixels = all(_stored_dtype(train.features[name]) == "uint8" for name in columns)
        raw = ArrayRows(columns, label_col, label_ids, "train", pixels)
        sample = _read_sample(train, lambda batch, where: raw.inputs(batch))
        mean, std = _uint8_stats(sample) if pixels else (None, None)
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


def _label_ids(train, eval_split, column: str) -> tuple[dict[str, int] | None, int]:
    """(names -> ids, or None for a column of ids; number of classes), from the label column alone."""
    import datasets
    import pyarrow.compute as pc

    feature = train.features[column]
    if isinstance(feature, datasets.ClassLabel):
        return None, feature.num_classes
    columns = [ds.data.column(column) for ds in (train, eval_split) if ds is not None]
    if all(pa_type_is_number(c.type) for c in columns):
        low = min(pc.min(c).as_py() for c in columns)
        high = max(pc.max(c).as_py() for c in columns)
        if low < 0 or any(not pc.all(pc.equal(c, pc.round(c))).as_py() for c in columns):
            raise ConfigError(f"hf: labels in {column!r} must be class ids 0, 1, 2, ...; got {low}..")
        return None, int(high) + 1
    names = sorted({str(v) for c in columns for v in pc.unique(c).to_pylist()})
    return {name: i for i, name in enumerate(names)}, len(names)


def _stored_dtype(feature) -> str | None:
    """The element type a column stores (``uint8``, ``float32``, ...) for values, arrays and lists of them."""
    while getattr(feature, "dtype", None) in (None, "list") and hasattr(feature, "feature"):
        feature = feature.feature  # List / Sequence of ...
    return getattr(feature, "dtype", None)


def pa_type_is_number(pa_type) -> bool:
    import pyarrow as pa

    return pa.types.is_integer(pa_type) or pa.types.is_floating(pa_type)


def _load_splits(data_dir: str, source: HFSource, streaming: bool = False) -> dict[str, Any]:
    import datasets

    if source.name:
        try:
            loaded = datasets.load_dataset(source.name, source.config, streaming=streaming)
        except (ConnectionError, OSError, ValueError) as err:  # offline, unknown name, missing config
            first = str(err).splitlines()[0] if str(err) else type(err).__name__
            raise ConfigError(
                f"hf: cannot load {source.name!r} from the Hugging Face Hub or the local cache ({first}); "
                "check the name (and --hf_config), run once with network access to fill the cache, or "
                "save_to_disk it where there is network and pass that folder as --data_dir without --hf_name"
            ) from None
    else:
        try:
            loaded = _load_local(data_dir, streaming)
        except ConfigError:
            raise
        except Exception as err:  # datasets wraps a damaged file in several error types: find it and name it
            bad = damaged_file(data_dir)
            if bad is None:
                raise
            raise ConfigError(bad) from err
    if isinstance(loaded, (datasets.Dataset, datasets.IterableDataset)):
        return {"train": loaded}
    return dict(loaded)


def _load_local(path: str, streaming: bool = False):
    import datasets

    if not os.path.exists(path):
        raise ConfigError(
            f"hf: --data_dir {os.path.abspath(path)} does not exist; give a folder written by save_to_disk, "
            "parquet/csv/arrow/json or image files, or a Hub dataset with --hf_name"
        )
    if os.path.isdir(path) and any(
        os.path.isfile(os.path.join(path, f)) for f in ("dataset_dict.json", "state.json")
    ):
        loaded = datasets.load_from_disk(path)
        return _as_stream(loaded) if streaming else loaded
    if os.path.isfile(path):
        builder = FILE_BUILDERS.get(os.path.splitext(path)[1].lower())
        if builder is None:
            raise ConfigError(f"hf: {path}: unknown file type; give a .parquet, .csv, .arrow or .json file")
        return datasets.load_dataset(builder, data_files={"train": path}, streaming=streaming)
    found = {os.path.splitext(f)[1].lower() for _, _, files in os.walk(path) for f in files}
    for ext, builder in FILE_BUILDERS.items():
        if ext in found:
            return datasets.load_dataset(builder, data_dir=path, streaming=streaming)
    if found & set(IMAGE_EXTENSIONS):
        return datasets.load_dataset("imagefolder", data_dir=path, streaming=streaming)
    raise ConfigError(
        f"hf: no dataset files in {os.path.abspath(path)}; expected a save_to_disk folder, "
        "parquet/csv/arrow/json files or class folders of images"
    )


def _as_stream(loaded):
    """A ``save_to_disk`` dataset as a stream: one shard per Arrow file, so that ranks can split the files."""
    def stream(ds):
        return ds.to_iterable_dataset(num_shards=max(len(ds.cache_files), 1))
    return stream(loaded) if hasattr(loaded, "cache_files") and not isinstance(loaded, dict) else \
        {name: stream(split) for name, split in loaded.items()}


def damaged_file(path: str) -> str | None:
    """The first parquet or Arrow file under ``path`` that does not read, as a one-line problem and fix; else None.

    Parquet: the footer (schema and row groups) must parse. Arrow: every record batch of the IPC
    stream must be whole (read through a memory map: nothing is copied).
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    files = [path] if os.path.isfile(path) else sorted(
        os.path.join(parent, name) for parent, _, names in os.walk(path) for name in names)
    for file in files:
        ext = os.path.splitext(file)[1].lower()
        try:
            if ext == ".parquet":
                pq.ParquetFile(file).metadata  # noqa: B018 - reading it is the check
            elif ext == ".arrow":
                with pa.memory_map(file) as source:
                    reader = pa.ipc.open_stream(source)
                    while reader.read_next_batch() is not None:
                        pass
        except StopIteration:
            continue
        except (pa.ArrowException, OSError) as err:
            first = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
            return (f"hf: {os.path.abspath(file)} is not a readable {ext[1:]} file ({first}); re-create or "
                    "re-download it, or move it out of --data_dir")
    return None


def _existing_column(ds, name: str) -> str:
    if name not in ds.column_names:
        raise ConfigError(f"hf: no column {name!r}; columns are {', '.join(ds.column_names)}")
    return name


def _label_column(ds, requested: str | None) -> str:
    import datasets

    if requested is not None:
        return _existing_column(ds, requested)
    for name, feature in ds.features.items():
        if isinstance(feature, datasets.ClassLabel):
            return name
    for name in LABEL_COLUMNS:
        if name in ds.column_names:
            return name
    raise ConfigError(f"hf: cannot tell the label column among {', '.join(ds.column_names)}; pass --label_column")


def _input_column(ds, requested: str | None, label_col: str) -> str | None:
    """The input column, or None for 'every numeric column but the label'."""
    import datasets

    if requested is not None:
        return _existing_column(ds, requested)
    for name, feature in ds.features.items():
        if isinstance(feature, datasets.Image):
            return name
    return next((n for n in INPUT_COLUMNS if n in ds.column_names and n != label_col), None)


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


def _labels(train, eval_, column: str):
    """(train labels, eval labels, number of classes): ClassLabel ids, integers, or sorted names."""
    import datasets

    def column_of(ds):
        return None if ds is None else np.asarray(ds.with_format("numpy", columns=[column])[:][column])

    train_raw, eval_raw = column_of(train), column_of(eval_)
    feature = train.features[column]
    if isinstance(feature, datasets.ClassLabel):
        num_classes = feature.num_classes
        mapped = [train_raw, eval_raw]
    elif np.issubdtype(train_raw.dtype, np.number):
        both = train_raw if eval_raw is None else np.concatenate([train_raw, eval_raw])
        if both.min() < 0 or not np.array_equal(both, np.round(both)):
            raise ConfigError(f"hf: labels in {column!r} must be class ids 0, 1, 2, ...; got {both.min()}..")
        num_classes = int(both.max()) + 1
        mapped = [train_raw, eval_raw]
    else:  # names: classes in sorted order, the same on every rank
        names = sorted({str(v) for v in train_raw} | ({str(v) for v in eval_raw} if eval_raw is not None else set()))
        index = {name: i for i, name in enumerate(names)}
        num_classes = len(names)
        mapped = [None if raw is None else np.array([index[str(v)] for v in raw]) for raw in (train_raw, eval_raw)]
    tensors = [None if m is None else torch.from_numpy(np.asarray(m, dtype=np.int64)) for m in mapped]
    return tensors[0], tensors[1], num_classes


def _uint8_stats(inputs: torch.Tensor) -> tuple[tuple[float, ...], tuple[float, ...]]:
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
