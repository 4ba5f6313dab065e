"""Where ``--dataset hf`` reads from and which of its columns: Hub names, ``save_to_disk`` folders, files.

- ``--hf_name NAME [--hf_config CONFIG]``: a Hub dataset (downloaded once per machine, or read
  from the local Hugging Face cache when offline);
- else ``--data_dir PATH``: a folder written by ``save_to_disk``, one parquet/csv/arrow/json file,
  a folder of them (split names from file names, e.g. ``train.parquet``, ``test.parquet``), or a
  folder of images (``train/<class>/*.png``, as the ``imagefolder`` builder reads it).

Opened as ``datasets.Dataset`` (Arrow files, memory-mapped), or as ``datasets.IterableDataset``
for streaming. A file that does not load is named in one line (:func:`damaged_file`): a damaged
parquet or Arrow file, a CSV or JSON file that is not UTF-8 (its line), a file or split without
rows; so is a split of 0 rows, or one row without an eval split to hold a tenth out of.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple

from accel_ddp.util.messages import first_line
from accel_ddp.util.validation import ConfigError

EVAL_SPLITS = ("test", "validation", "valid", "val", "eval")
LABEL_COLUMNS = ("label", "labels", "target", "targets", "class", "y", "fine_label", "coarse_label")
INPUT_COLUMNS = ("image", "img", "pixel_values", "pixels", "x", "input", "inputs", "features")
FILE_BUILDERS = {".parquet": "parquet", ".arrow": "arrow", ".csv": "csv", ".json": "json", ".jsonl": "json"}
IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff")
METADATA_FILES = ("metadata.csv", "metadata.jsonl", "metadata.parquet")  # an image folder's labels (datasets' names)
TEXT_FILES = (".csv", ".json", ".jsonl")  # read as UTF-8 text by datasets' csv and json builders


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
    memory_limit: Any = None  # a memory_budget.InMemoryLimit: says why a set the flag allows stays memory-mapped


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
    train, eval_split = splits[source.train_split], splits[eval_name] if eval_name else None
    if not streaming:  # a stream's length is unknown: build_stream checks what it reads
        for name, split, flag in ((source.train_split, train, "--hf_train_split"), (eval_name, eval_split,
                                                                                   "--hf_eval_split")):
            if split is not None and len(split) == 0:
                raise ConfigError(empty_split(name, source.name or data_dir, flag))
        if eval_split is None and len(train) < 2:  # a tenth of it is held out for evaluation: at least one row each
            raise ConfigError(f"hf: the {source.train_split!r} split of {source.name or data_dir} has {len(train)} "
                              "row and no eval split to evaluate on (a tenth of train is held out when there is "
                              "none); give it more rows, or an eval split (a test file beside it, or --hf_eval_split)")
    return train, eval_split


def empty_split(name: str, where: str, flag: str) -> str:
    """The one line for a split without rows (an empty file, a filter that kept nothing)."""
    return f"hf: the {name!r} split of {where} has 0 rows; give it rows, or pick another split with {flag}"


def _load_splits(data_dir: str, source: HFSource, streaming: bool = False) -> dict[str, Any]:
    import datasets

    if source.name:
        try:
            loaded = datasets.load_dataset(source.name, source.config, streaming=streaming)
        except (ConnectionError, OSError, ValueError) as err:  # offline, unknown name, missing config
            first = first_line(err)
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
    names = [f.lower() for _, _, files in os.walk(path) for f in files]
    found = {os.path.splitext(name)[1] for name in names}
    # Images with a metadata.csv / .jsonl / .parquet beside them (their labels or texts) are an image folder:
    # read as csv or json, the images would be parsed as text.
    tables = {os.path.splitext(name)[1] for name in names if name not in METADATA_FILES}
    if found & set(IMAGE_EXTENSIONS) and not tables & set(FILE_BUILDERS):
        return datasets.load_dataset("imagefolder", data_dir=path, streaming=streaming)
    for ext, builder in FILE_BUILDERS.items():
        if ext in found:
            return datasets.load_dataset(builder, data_dir=path, streaming=streaming)
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
    """The first data file under ``path`` that does not read, as a one-line problem and fix; else None.

    Parquet: the footer (schema and row groups) must parse. Arrow: every record batch of the IPC
    stream must be whole (read through a memory map: nothing is copied). CSV and JSON: UTF-8 text
    (the line of the first byte that is not). Then, as the likelier cause of a failed load than a
    file without rows, the first file without rows (``datasets`` cannot make a split of it). Called
    once loading failed: ``datasets`` wraps these in several error types that name neither the file
    nor the line.
    """
    files = [path] if os.path.isfile(path) else sorted(
        os.path.join(parent, name) for parent, _, names in os.walk(path) for name in names)
    problems = [(file, *_file_problem(file)) for file in files]
    for wanted in ("damaged", "empty"):
        for file, kind, problem in problems:
            if kind == wanted:
                return f"hf: {os.path.abspath(file)} {problem}"
    return None


def _file_problem(file: str) -> tuple[str | None, str | None]:
    """(kind, problem) of one data file: ("damaged", ...), ("empty", ...) or (None, None)."""
    ext = os.path.splitext(file)[1].lower()
    if os.path.basename(file) == "state.json":
        return _saved_split_problem(file)
    return _text_problem(file) if ext in TEXT_FILES else _table_problem(file, ext)


def _table_problem(file: str, ext: str) -> tuple[str | None, str | None]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = None
    try:
        if ext == ".parquet":
            rows = pq.ParquetFile(file).metadata.num_rows
        elif ext == ".arrow":
            rows = 0
            with pa.memory_map(file) as source:
                reader = pa.ipc.open_stream(source)
                while (batch := reader.read_next_batch()) is not None:
                    rows += batch.num_rows
    except StopIteration:
        pass
    except (pa.ArrowException, OSError) as err:
        first = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
        return "damaged", (f"is not a readable {ext[1:]} file ({first}); re-create or re-download it, or move it out "
                           "of --data_dir")
    if rows == 0:
        return "empty", "has 0 rows; give it rows, or move it out of --data_dir"
    return None, None


def _text_problem(file: str) -> tuple[str | None, str | None]:
    """A CSV or JSON file that is not UTF-8 (the first bad line, counted from 1), or that holds no rows."""
    rows = 0
    try:
        with open(file, "rb") as fh:
            for number, line in enumerate(fh, start=1):
                try:
                    line.decode("utf-8")
                except UnicodeDecodeError as err:
                    return "damaged", (f"line {number} is not UTF-8 text (byte 0x{line[err.start]:02x} at column "
                                       f"{err.start + 1}); save the file as UTF-8 (e.g. iconv -f latin1 -t utf-8), "
                                       "or fix that line")
                rows += bool(line.strip())
    except OSError as err:
        return "damaged", f"cannot be read ({err.strerror}); fix its permissions, or move it out of --data_dir"
    header = 1 if file.lower().endswith(".csv") else 0
    if rows <= header:
        return "empty", f"has {'a header and ' if rows else ''}no rows; give it rows, or move it out of --data_dir"
    return None, None


def _saved_split_problem(state_file: str) -> tuple[str | None, str | None]:
    """A ``save_to_disk`` split saved without rows: datasets 5.2 writes no Arrow file and cannot load it back."""
    try:
        with open(state_file, encoding="utf-8") as fh:
            empty = json.load(fh).get("_data_files") == []
    except (OSError, ValueError, AttributeError):
        return None, None
    if not empty:
        return None, None
    split = os.path.basename(os.path.dirname(os.path.abspath(state_file)))
    return "empty", (f"lists no data file: split {split!r} was saved with 0 rows; save it with rows, or leave it "
                     "out of the save_to_disk folder")


@contextmanager
def bad_text_named(data_dir: str, source: HFSource) -> Iterator[None]:
    """Text that is not UTF-8 and that a reader let through (pyarrow's JSON reader stores the bytes as they are)
    fails where it is first read, as a UnicodeDecodeError (an ArrowException through NumPy): the local file and
    line it came from, in one line."""
    import pyarrow as pa

    try:
        yield
    except (UnicodeDecodeError, pa.ArrowException) as err:
        bad = None if source.name else damaged_file(data_dir)
        if bad is None and not isinstance(err, UnicodeDecodeError):
            raise
        raise ConfigError(bad or f"hf: {source.name or data_dir} holds text that is not UTF-8 ({err}); save it as "
                          "UTF-8") from None


def _existing_column(ds, name: str) -> str:
    if name not in ds.column_names:
        raise ConfigError(f"hf: no column {name!r}; columns are {', '.join(ds.column_names)}")
    return name


def label_column_of(ds, requested: str | None) -> str:
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


def input_column_of(ds, requested: str | None, label_col: str) -> str | None:
    """The input column, or None for 'every numeric column but the label'."""
    import datasets

    if requested is not None:
        _existing_column(ds, requested)
        feature = ds.features[requested]
        if requested == label_col:
            raise ConfigError(f"hf: --image_column {requested!r} is the label column too; name the input column "
                              "with --image_column and the labels with --label_column")
        if isinstance(feature, (datasets.Value, datasets.ClassLabel)):  # one number (or text) per row
            kind = "class labels" if isinstance(feature, datasets.ClassLabel) else f"one {feature.dtype} per row"
            raise ConfigError(f"hf: --image_column {requested!r} holds {kind}, not images or arrays; name an Image "
                              "or array column, or leave --image_column out to use every numeric column but the "
                              "label as the input")
        return requested
    for name, feature in ds.features.items():
        if isinstance(feature, datasets.Image):
            return name
    return next((n for n in INPUT_COLUMNS if n in ds.column_names and n != label_col), None)
