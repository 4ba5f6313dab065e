"""Hugging Face ``datasets`` as a training source, decoded once into in-memory tensors.

Where the data comes from (``--dataset hf``):

- ``--hf_name NAME [--hf_config CONFIG]``: a Hub dataset (downloaded once per machine, or read
  from the local Hugging Face cache when offline);
- else ``--data_dir PATH``: a folder written by ``save_to_disk``, one parquet/csv/arrow/json file,
  a folder of them (split names from file names, e.g. ``train.parquet``, ``test.parquet``), or a
  folder of images (``train/<class>/*.png``, as the ``imagefolder`` builder reads it).

Inputs are the image column (decoded with PIL, uint8, ``(C, H, W)``), an array column, or, without
either, every numeric column but the label (a CSV of pixels). uint8 inputs are normalised with
the training split's own per-channel mean and std; float inputs are served as stored.
"""

from __future__ import annotations

import os
from typing import Any, NamedTuple

import numpy as np
import torch

from accel_ddp.config import ConfigError
from accel_ddp.data.bundle import DatasetBundle
from accel_ddp.data.in_memory import InMemoryDataset

EVAL_SPLITS = ("test", "validation", "valid", "val", "eval")
LABEL_COLUMNS = ("label", "labels", "target", "targets", "class", "y", "fine_label", "coarse_label")
INPUT_COLUMNS = ("image", "img", "pixel_values", "pixels", "x", "input", "inputs", "features")
FILE_BUILDERS = {".parquet": "parquet", ".arrow": "arrow", ".csv": "csv", ".json": "json", ".jsonl": "json"}
IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff")
DECODE_CHUNK = 1024  # rows decoded per slice: bounds the PIL images alive at once


class HFSource(NamedTuple):
    """Where ``--dataset hf`` reads from and which columns and splits it uses (the ``--hf_*`` flags)."""

    name: str | None = None  # Hub dataset name; None: load --data_dir
    config: str | None = None  # Hub configuration name
    train_split: str = "train"
    eval_split: str | None = None  # None: test or validation, else 10% of train (seed 0)
    image_column: str | None = None  # None: the first Image column, a known input name, else all numbers
    label_column: str | None = None  # None: the first ClassLabel column, else a known label name


def build_hf(data_dir: str, download: bool, source: HFSource | None = None, image_size: int | None = None):
    """A :class:`~accel_ddp.data.DatasetBundle` of two :class:`InMemoryDataset` from a Hugging Face dataset."""
    source = source or HFSource()
    train, eval_split = load_splits(data_dir, source)
    label_col = _label_column(train, source.label_column)
    input_col = _input_column(train, source.image_column, label_col)

    train_x, layout = _inputs(train, input_col, label_col, image_size, layout=None)
    train_y, eval_y, num_classes = _labels(train, eval_split, label_col)
    if eval_split is not None:
        eval_x, _ = _inputs(eval_split, input_col, label_col, image_size, layout=layout)
    else:  # no eval split: hold out a fixed 10% of train (seed 0), the same on every rank
        order = torch.randperm(len(train_x), generator=torch.Generator().manual_seed(0))
        n_eval = max(len(order) // 10, 1)
        train_x, eval_x = train_x[order[n_eval:]], train_x[order[:n_eval]]
        train_y, eval_y = train_y[order[n_eval:]], train_y[order[:n_eval]]
    pixels: dict[str, Any] = {}
    if train_x.dtype == torch.uint8:
        mean, std = _uint8_stats(train_x)
        pixels = {"scale": 255.0, "mean": mean, "std": std}
    return DatasetBundle(
        InMemoryDataset(train_x, train_y, **pixels),
        InMemoryDataset(eval_x, eval_y, **pixels),
        num_classes=num_classes,
        input_shape=tuple(train_x.shape[1:]),
    )


def load_splits(data_dir: str, source: HFSource) -> tuple[Any, Any]:
    """(train split, eval split or None) as ``datasets.Dataset``: ``--hf_eval_split``, else test or validation."""
    splits = _load_splits(data_dir, source)
    if source.train_split not in splits:
        raise ConfigError(
            f"hf: no split {source.train_split!r}; it has {', '.join(splits)}; pick one with --hf_train_split"
        )
    eval_name = source.eval_split or next((s for s in EVAL_SPLITS if s in splits), None)
    if eval_name is not None and eval_name not in splits:
        raise ConfigError(f"hf: no split {eval_name!r}; it has {', '.join(splits)}; pick one with --hf_eval_split")
    return splits[source.train_split], splits[eval_name] if eval_name else None


def _load_splits(data_dir: str, source: HFSource) -> dict[str, Any]:
    import datasets

    if source.name:
        try:
            loaded = datasets.load_dataset(source.name, source.config)
        except (ConnectionError, OSError, ValueError) as err:  # offline, unknown name, missing config
            first = str(err).splitlines()[0] if str(err) else type(err).__name__
            raise ConfigError(
                f"hf: cannot load {source.name!r} from the Hugging Face Hub or the local cache ({first}); "
                "check the name (and --hf_config), run once with network access to fill the cache, or "
                "save_to_disk it where there is network and pass that folder as --data_dir without --hf_name"
            ) from None
    else:
        loaded = _load_local(data_dir)
    if isinstance(loaded, datasets.Dataset):
        return {"train": loaded}
    return dict(loaded)


def _load_local(path: str):
    import datasets

    if not os.path.exists(path):
        raise ConfigError(
            f"hf: --data_dir {os.path.abspath(path)} does not exist; give a folder written by save_to_disk, "
            "parquet/csv/arrow/json or image files, or a Hub dataset with --hf_name"
        )
    if os.path.isdir(path) and any(
        os.path.isfile(os.path.join(path, f)) for f in ("dataset_dict.json", "state.json")
    ):
        return datasets.load_from_disk(path)
    if os.path.isfile(path):
        builder = FILE_BUILDERS.get(os.path.splitext(path)[1].lower())
        if builder is None:
            raise ConfigError(f"hf: {path}: unknown file type; give a .parquet, .csv, .arrow or .json file")
        return datasets.load_dataset(builder, data_files={"train": path})
    found = {os.path.splitext(f)[1].lower() for _, _, files in os.walk(path) for f in files}
    for ext, builder in FILE_BUILDERS.items():
        if ext in found:
            return datasets.load_dataset(builder, data_dir=path)
    if found & set(IMAGE_EXTENSIONS):
        return datasets.load_dataset("imagefolder", data_dir=path)
    raise ConfigError(
        f"hf: no dataset files in {os.path.abspath(path)}; expected a save_to_disk folder, "
        "parquet/csv/arrow/json files or class folders of images"
    )


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
        return _decode_images(ds, column, image_size, layout)
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


def _decode_images(ds, column: str, image_size: int | None, layout):
    """PIL images to a uint8 ``(N, C, H, W)`` tensor: grayscale stays one channel, anything else becomes RGB."""
    import datasets
    from PIL import Image

    if not ds.features[column].decode:  # stored undecoded (bytes and paths): decode while reading
        ds = ds.cast_column(column, datasets.Image())
    if layout is None:
        first = ds[0][column]
        mode = "L" if first.mode in ("1", "L", "I", "I;16", "F") else "RGB"
        layout = (mode, (image_size, image_size) if image_size else first.size)
    mode, size = layout
    channels = 1 if mode == "L" else 3
    out = np.empty((len(ds), size[1], size[0], channels), dtype=np.uint8)
    for start in range(0, len(ds), DECODE_CHUNK):
        for offset, image in enumerate(ds[start:start + DECODE_CHUNK][column]):
            image = image.convert(mode)
            if image.size != size:
                if image_size is None:
                    raise ConfigError(
                        f"hf: images of different sizes ({size[0]}x{size[1]} and {image.size[0]}x{image.size[1]}); "
                        "pass --image_size N to resize them all to NxN"
                    )
                image = image.resize(size, Image.BILINEAR)
            out[start + offset] = np.asarray(image).reshape(size[1], size[0], channels)
    return torch.from_numpy(out).permute(0, 3, 1, 2).contiguous(), layout


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
    for start in range(0, len(inputs), DECODE_CHUNK):
        chunk = inputs[start:start + DECODE_CHUNK].double() / 255.0
        chunk = chunk.transpose(0, 1).reshape(channels, -1) if per_channel else chunk.reshape(1, -1)
        total += chunk.sum(dim=1)
        squares += (chunk * chunk).sum(dim=1)
    count = inputs.numel() / channels
    mean = total / count
    std = (squares / count - mean * mean).clamp_min(0).sqrt()
    std = torch.where(std > 1e-6, std, torch.ones_like(std))  # a constant channel: leave it unscaled
    return tuple(round(float(m), 4) for m in mean), tuple(round(float(s), 4) for s in std)
