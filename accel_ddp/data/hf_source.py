"""Where ``--dataset hf`` reads from and which of its columns: Hub names, ``save_to_disk`` folders, files.

- ``--hf_name NAME [--hf_config CONFIG]``: a Hub dataset (downloaded once per machine, or read
  from the local Hugging Face cache when offline);
- else ``--data_dir PATH``: a folder written by ``save_to_disk``, one parquet/csv/arrow/json file,
  a folder of them (split names from file names, e.g. ``train.parquet``, ``test.parquet``), or a
  folder of images (``train/<class>/*.png``, as the ``imagefolder`` builder reads it).

Opened as ``datasets.Dataset`` (Arrow files, memory-mapped), or as ``datasets.IterableDataset``
for streaming. A damaged parquet or Arrow file is named in one line (:func:`damaged_file`).
"""

from __future__ import annotations

import os
from typing import Any, NamedTuple

from accel_ddp.validation import ConfigError

EVAL_SPLITS = ("test", "validation", "valid", "val", "eval")
LABEL_COLUMNS = ("label", "labels", "target", "targets", "class", "y", "fine_label", "coarse_label")
INPUT_COLUMNS = ("image", "img", "pixel_values", "pixels", "x", "input", "inputs", "features")
FILE_BUILDERS = {".parquet": "parquet", ".arrow": "arrow", ".csv": "csv", ".json": "json", ".jsonl": "json"}
IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff")


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
