"""Bad data files for ``--dataset hf``: each is one line naming the file (the line, the row or the value) and the
fix, on every path that reads it (decoded into memory, memory-mapped, streamed), before training starts.

Every file is written here, in a temporary folder; nothing is downloaded.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from accel_ddp.data import HFSource, build_datasets
from accel_ddp.util.validation import ConfigError
from tests.helpers.checkpoints import load_stream_position, save_stream_position
from tests.helpers.data import batches_until_data_error, hf_image_dataset
from tests.helpers.multiproc import run_ranks
from tests.helpers.runs import main_ranks

# The three ways --dataset hf holds a training set (docs/large-datasets.md).
IN_MEMORY, MAPPED, STREAMING = HFSource(), HFSource(in_memory_max_mb=0), HFSource(streaming=True)
TABLE_PATHS = {"in_memory": IN_MEMORY, "mapped": MAPPED}  # streaming reads image datasets only
IMAGE_PATHS = {**TABLE_PATHS, "streaming": STREAMING}


@pytest.fixture(autouse=True)
def fresh_datasets_cache(tmp_path, monkeypatch):
    """datasets caches what it read from a csv or json file: every test reads its own files afresh."""
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))


def build(data: Path, source: HFSource, **fields):
    return build_datasets("hf", str(data), download=False, hf=source._replace(**fields))


def pixels_csv(path: Path, rows: int = 30, label=lambda i: i % 3) -> Path:
    lines = ["label,p0,p1"] + [f"{label(i)},{i % 256},{(7 * i) % 256}" for i in range(rows)]
    path.write_text("\n".join(lines) + "\n")
    return path


def image_folder(root: Path, rows: int = 12, bad_label: int | None = None, kind: str = "csv") -> Path:
    """``root/{train,test}/*.png`` with a ``metadata.csv`` (or ``.jsonl``) of file names and labels (cat, dog) per
    split, as datasets' imagefolder reads them; ``bad_label``: that training row's label holds a Latin-1 byte."""
    from PIL import Image

    for split in ("train", "test"):
        (root / split).mkdir(parents=True)
        lines = [b"file_name,label\n"] if kind == "csv" else []
        for i in range(rows):
            Image.fromarray(np.full((8, 8), 10 * i, dtype=np.uint8)).save(root / split / f"{i}.png")
            label = b"caf\xe9" if split == "train" and i == bad_label else b"cat dog".split()[i % 2]
            lines.append(b"%d.png,%s\n" % (i, label) if kind == "csv" else
                         b'{"file_name": "%d.png", "label": "%s"}\n' % (i, label))
        (root / split / f"metadata.{kind}").write_bytes(b"".join(lines))
    return root


# ----------------------------------------------------------------------------- text files that are not UTF-8


@pytest.mark.parametrize("path", TABLE_PATHS)
@pytest.mark.parametrize("kind", ["csv", "jsonl", "jsonl of names"])
def test_a_text_file_that_is_not_utf8_is_named_with_its_line(tmp_path, kind, path):
    """datasets raises DatasetGenerationError (csv) or ValueError (json) naming neither the file nor the line; or,
    when every label is text, pyarrow's JSON reader keeps the bytes as they are and reading the labels fails later
    (a UnicodeDecodeError)."""
    if kind == "csv":
        data = pixels_csv(tmp_path / "pixels.csv")
        data.write_bytes(data.read_bytes().replace(b"\n2,2,14\n", b"\n2,2,\xff\xfe\n"))  # line 4: row 2
        line = 4
    else:
        data = tmp_path / "rows.jsonl"
        first = b'"dog"' if kind == "jsonl of names" else b"1"
        data.write_bytes(b'{"label": %s, "x": [1, 2]}\n{"label": "cat", "x": [3, 4]}\n' % first
                         + b'{"label": "caf\xe9", "x": [5, 6]}\n' * 3)
        line = 3
    with pytest.raises(ConfigError) as raised:
        build(data, TABLE_PATHS[path])
    message = str(raised.value)
    assert f"{data} line {line} is not UTF-8 text" in message and "save the file as UTF-8" in message


@pytest.mark.parametrize("kind", ["csv", "jsonl"])
@pytest.mark.parametrize("path", IMAGE_PATHS)
def test_an_image_folder_with_metadata_reads_its_labels_and_names_a_metadata_file_that_is_not_utf8(tmp_path, path,
                                                                                                 kind):
    """Images with a metadata.csv beside them were read by the csv builder, PNG bytes and all (a traceback)."""
    bundle = build(image_folder(tmp_path / "ok", kind=kind), IMAGE_PATHS[path])
    assert (bundle.num_classes, bundle.input_shape) == (2, (1, 8, 8))  # cat, dog: names numbered in sorted order
    bad = image_folder(tmp_path / "bad", bad_label=3, kind=kind)
    line = 5 if kind == "csv" else 4  # after the header
    with pytest.raises(ConfigError, match=f"{bad / 'train' / f'metadata.{kind}'} line {line} is not UTF-8 text"):
        build(bad, IMAGE_PATHS[path])


# ----------------------------------------------------------------------------- splits without rows


def _empty_csv_split(folder: Path, split: str) -> Path:
    folder.mkdir()
    for name in ("train", "test"):
        pixels_csv(folder / f"{name}.csv", rows=0 if name == split else 20)
    return folder / f"{split}.csv"


def _empty_parquet_split(folder: Path, split: str) -> Path:
    folder.mkdir()
    for name in ("train", "test"):
        hf_image_dataset(0 if name == split else 20, 0, size=8).to_parquet(str(folder / f"{name}.parquet"))
    return folder / f"{split}.parquet"


def _empty_saved_split(folder: Path, split: str) -> Path:
    import datasets

    splits = {name: hf_image_dataset(0 if name == split else 20, 0, size=8) for name in ("train", "test")}
    datasets.DatasetDict(splits).save_to_disk(folder)
    return folder / split / "state.json"


# A csv is no image dataset (streaming reads those only); an empty parquet split streams: the next test.
_EMPTY = [(_empty_csv_split, "has a header and no rows; give it rows", TABLE_PATHS),
          (_empty_parquet_split, "has 0 rows; give it rows", TABLE_PATHS),
          (_empty_saved_split, "lists no data file: split '{split}' was saved with 0 rows", IMAGE_PATHS)]


@pytest.mark.parametrize("split", ["train", "test"])
@pytest.mark.parametrize("layout,expected,path", [(layout, expected, path) for layout, expected, paths in _EMPTY
                                                  for path in paths])
def test_a_split_without_rows_is_one_line_naming_its_file(tmp_path, layout, expected, split, path):
    """datasets 5.2 raises 'Instruction "test" corresponds to no data!', a DatasetGenerationError, or an IndexError
    from load_from_disk; the memory-mapped path met an empty eval split as torch.cat() of nothing."""
    empty = layout(tmp_path / "d", split)
    with pytest.raises(ConfigError) as raised:
        build(tmp_path / "d", IMAGE_PATHS[path])
    assert str(raised.value).startswith(f"hf: {empty} ") and expected.format(split=split) in str(raised.value)


@pytest.mark.parametrize("split", ["train", "test"])
def test_a_split_that_loads_without_rows_is_refused_on_every_path(tmp_path, split):
    """Read as a stream, a parquet split of 0 rows loads: an empty eval split then meant no evaluation at all (the
    other paths refuse it), an empty training split 'the training stream is empty' without a fix."""
    _empty_parquet_split(tmp_path / "d", split)
    flag = "--hf_train_split" if split == "train" else "--hf_eval_split"
    with pytest.raises(ConfigError, match=f"the '{split}' split of {tmp_path / 'd'} has 0 rows; give it rows, or "
                                          f"pick another split with {flag}"):
        build(tmp_path / "d", STREAMING)


@pytest.mark.parametrize("path", TABLE_PATHS)
def test_one_row_and_no_eval_split_is_one_line(tmp_path, path):
    """A tenth of train is held out to evaluate on: of 1 row, nothing would be left to train on (an
    index_select() RuntimeError in memory, torch.cat() of nothing memory-mapped)."""
    data = pixels_csv(tmp_path / "one.csv", rows=1)
    with pytest.raises(ConfigError, match=r"the 'train' split of .*one.csv has 1 row and no eval split .* give it "
                                          r"more rows, or an eval split"):
        build(data, TABLE_PATHS[path])
    assert len(build(pixels_csv(tmp_path / "two.csv", rows=2), TABLE_PATHS[path]).train) == 1  # 2 rows: 1 + 1


# ----------------------------------------------------------------------------- columns and labels


@pytest.mark.parametrize("path", TABLE_PATHS)
def test_an_image_column_of_single_numbers_or_the_labels_is_one_line(tmp_path, path):
    """An int column as --image_column was an IndexError in memory and a model input of shape () memory-mapped."""
    data = pixels_csv(tmp_path / "pixels.csv")
    with pytest.raises(ConfigError, match="--image_column 'p0' holds one int64 per row, not images or arrays"):
        build(data, TABLE_PATHS[path], image_column="p0")
    with pytest.raises(ConfigError, match="--image_column 'label' is the label column too"):
        build(data, TABLE_PATHS[path], image_column="label")


def _huge_label_images(folder: Path) -> Path:
    import datasets

    folder.mkdir()
    train = hf_image_dataset(20, 0, size=8).cast_column("label", datasets.Value("int64"))
    train = train.map(lambda row, i: {"label": 2_000_000_000 if i == 7 else row["label"]}, with_indices=True)
    train.to_parquet(str(folder / "train.parquet"))
    test = hf_image_dataset(8, 1, size=8).cast_column("label", datasets.Value("int64"))
    test.to_parquet(str(folder / "test.parquet"))
    return folder


@pytest.mark.parametrize("path", IMAGE_PATHS)
def test_a_sparse_huge_class_id_is_one_line_naming_the_value_and_the_column(tmp_path, path):
    """A label of 2,000,000,000 made 2e9 classes: the model's output layer was a MemoryError after 43 s."""
    where = "among the first training rows" if path == "streaming" else "row 7 of the 'train' split"
    with pytest.raises(ConfigError, match=f"label 2000000000 in column 'label' \\({where}.*makes 2,000,000,001 "
                                          "classes; class ids run from 0 to K-1 with K at most 100,000.*ClassLabel"):
        build(_huge_label_images(tmp_path / "d"), IMAGE_PATHS[path])
    data = pixels_csv(tmp_path / "pixels.csv", label=lambda i: 99_999 if i == 3 else i % 3)  # the bound itself
    assert build(data, TABLE_PATHS.get(path, IN_MEMORY)).num_classes == 100_000


@pytest.mark.parametrize("path", IMAGE_PATHS)
def test_label_names_beyond_the_class_bound_are_one_line(tmp_path, monkeypatch, path):
    """A column of names makes one class per name: a column of ids stored as text, or not the labels at all."""
    import accel_ddp.data.hf

    monkeypatch.setattr(accel_ddp.data.hf, "MAX_CLASSES", 1)  # the image folder's two names, cat and dog, are more
    with pytest.raises(ConfigError, match="column 'label' holds 2 different labels, more than the 1 classes"):
        build(image_folder(tmp_path / "d"), IMAGE_PATHS[path])


# ----------------------------------------------------------------------------- from the command line


@pytest.mark.parametrize("case,expected", [
    ("not utf-8", "pixels.csv line 32 is not UTF-8 text"),
    ("empty eval split", "test.csv has a header and no rows"),
    ("huge label", "label 2000000000 in column 'label' (row 5 of the 'train' split)"),
    ("image column", "--image_column 'p1' holds one int64 per row"),
])
def test_bad_data_is_one_line_and_exit_2_on_every_rank_before_anything_is_written(tmp_path, capfd, case, expected):
    data = pixels_csv(tmp_path / "pixels.csv", label=lambda i: 2_000_000_000 if case == "huge label" and i == 5
                      else i % 3)
    extra = ["--image_column", "p1"] if case == "image column" else []
    if case == "not utf-8":
        data.write_bytes(data.read_bytes() + b"1,caf\xe9,3\n")
    if case == "empty eval split":
        data = tmp_path / "d"
        _empty_csv_split(data, "test")
    out = tmp_path / "run"
    capfd.readouterr()
    assert main_ranks(["--dataset", "hf", "--data_dir", str(data), "--global_batch_size", "8", "--output_dir",
                       str(out), *extra]) == [2, 2]
    err = capfd.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("accel_ddp: error:")]
    assert len(lines) == 1 == err.count("accel_ddp: error:") and "Traceback" not in err, err
    assert expected in lines[0] and "; " in lines[0]  # the problem, then the fix
    assert not os.path.exists(out)


def _decode_idx(columns, where):
    import torch

    return [(torch.tensor([float(i)]), 0) for i in columns["idx"]]


@pytest.mark.parametrize("workers", [0, 1])
def test_text_that_is_not_utf8_met_mid_stream_stops_every_rank_with_one_line_naming_the_file(tmp_path, workers):
    """pyarrow's JSON reader lets the bytes through; reading row 30 raised a UnicodeDecodeError, treated as a bug of
    ours (a traceback), or, from a DataLoader worker, a RuntimeError torch made of it."""
    data = tmp_path / "s"
    data.mkdir()
    (data / "rows.jsonl").write_bytes(b"".join(b'{"idx": %d, "name": "%s"}\n' % (i, b"caf\xe9" if i == 30 else b"ok")
                                               for i in range(80)))

    def run():
        import datasets
        from accelerate import PartialState

        from accel_ddp.data.streaming import StreamingLoader, StreamSource

        state = PartialState(cpu=True)
        stream = datasets.load_dataset("json", data_files=str(data / "rows.jsonl"), split="train", streaming=True)
        loader = StreamingLoader(StreamSource(stream, _decode_idx, 0, files=str(data)), 2, 4, max_steps=20, seed=0,
                                 rank=state.process_index, world_size=2, num_workers=workers)
        return batches_until_data_error(loader)

    (steps0, error0), (steps1, error1) = run_ranks(run, grace=5)
    assert steps0 == steps1 < 20 and error0 == error1  # both stopped at the same step, with the same line
    assert f"{data / 'rows.jsonl'} line 31 is not UTF-8 text" in error0


# ----------------------------------------------------------------------------- a streaming resume on other data


def _read_stream(folder: Path, *, buffer: int, steps: int, save_to: Path | None = None,
                 resume_from: Path | None = None) -> list[int]:
    """The example ids one rank reads from the parquet shards in ``folder`` (micro-batches of 2), saving its
    position after ``steps`` micro-batches, or resuming from a saved one."""
    import datasets

    from accel_ddp.data.streaming import StreamingLoader, StreamSource

    files = sorted(str(p) for p in folder.glob("*.parquet"))
    stream = datasets.load_dataset("parquet", data_files=files, split="train", streaming=True)
    loader = StreamingLoader(StreamSource(stream, _decode_idx, buffer, files=str(folder)), 2, 2, max_steps=40,
                             seed=0, num_workers=0)
    batches = loader
    if resume_from is not None:
        load_stream_position(loader, resume_from)
        batches = loader.skip_first_batches(steps)
    seen = []
    for x, _ in batches:
        if loader.data_epoch > 0:  # the first pass is over
            break
        seen += x[:, 0].long().tolist()
        if save_to is not None and len(seen) == 2 * steps:
            save_stream_position(loader, save_to)
            break
    return seen


def _shards(folder: Path, sizes: list[int]) -> Path:
    import datasets

    folder.mkdir()
    start = 0
    for k, size in enumerate(sizes):
        datasets.Dataset.from_dict({"idx": list(range(start, start + size))}).to_parquet(str(folder / f"{k}.parquet"))
        start += size
    return folder


def test_a_streaming_resume_after_changing_the_buffer_or_the_data_restarts_the_pass_with_a_warning(tmp_path, capfd):
    """The saved reader positions belong to the stream they were made from: on another one datasets'
    load_state_dict raised KeyError 'shard_idx' or 'ex_iterable_idx', or an IndexError (another number of files).
    The checkpoint records what the positions were made from; the pass starts over, said once. One saved position
    serves the three resumes (each only reads it): another shuffle buffer, another data folder, the same stream."""
    data = _shards(tmp_path / "d", [20, 20])
    saved = tmp_path / "checkpoint"
    saved.mkdir()
    _read_stream(data, buffer=8, steps=5, save_to=saved)
    assert json.loads((saved / "data_state_rank0.json").read_text())["made_from"] == {
        "source": os.path.realpath(data), "num_shards": 2, "shuffle_buffer": 8}
    other = _shards(tmp_path / "e", [10, 10, 10])
    for change, stream, buffer, expected, rows in [
            ("shuffle buffer", data, 0, "--shuffle_buffer 8, this run has 0", 40),
            ("data folder", other, 8, f"the data from {os.path.realpath(data)}, this run has "
                                      f"{os.path.realpath(other)}; files (shards) 2, this run has 3", 30)]:
        capfd.readouterr()
        first_pass = _read_stream(stream, buffer=buffer, steps=5, resume_from=saved)
        warnings = [line for line in capfd.readouterr().err.splitlines() if "starts over" in line]
        assert len(warnings) == 1 and expected in warnings[0], (change, warnings)
        assert sorted(first_pass) == list(range(rows)), change  # the whole pass, once each
    capfd.readouterr()
    _read_stream(data, buffer=8, steps=5, resume_from=saved)  # the same stream: no warning, the position holds
    assert "starts over" not in capfd.readouterr().err


def test_a_streaming_run_resumed_with_another_shuffle_buffer_continues_from_the_command_line(tmp_path, capfd):
    from tests.helpers.data import image_shards
    from tests.helpers.runs import train_ranks

    data = image_shards(tmp_path / "d", [40, 40], n_test=4)
    common = ["--dataset", "hf", "--data_dir", str(data), "--streaming", "--global_batch_size", "8",
              "--num_workers", "0", "--output_dir", str(tmp_path / "run")]
    train_ranks([*common, "--max_steps", "4", "--checkpointing_steps", "4", "--shuffle_buffer", "16"])
    capfd.readouterr()
    summaries = train_ranks([*common, "--max_steps", "8", "--shuffle_buffer", "0", "--resume_from_checkpoint", "auto"])
    assert [(s["resumed_from_step"], s["optimizer_steps"]) for s in summaries] == [(4, 8), (4, 8)]
    err = capfd.readouterr().err
    assert err.count("--shuffle_buffer 16, this run has 0: pass 0 of the stream starts over") == 1 and \
        "Traceback" not in err


# ----------------------------------------------------------------------------- the built-in image folders


def test_an_image_folder_with_an_empty_eval_folder_or_one_image_is_one_line(tmp_path):
    """The same rules as --dataset hf's splits: an empty val/ was an evaluation of 0 samples, one image and no
    val/ a training set of none."""
    from tests.helpers.data import write_png_classes

    write_png_classes(tmp_path / "a" / "train", ["cat", "dog"], per_class=3)
    (tmp_path / "a" / "val" / "cat").mkdir(parents=True)
    with pytest.raises(ConfigError, match=f"imagefolder: {tmp_path / 'a' / 'val'} holds no images; put images in its "
                                          "class folders, or remove it"):
        build_datasets("imagefolder", str(tmp_path / "a"), download=False)
    write_png_classes(tmp_path / "b", ["cat"], per_class=1)
    with pytest.raises(ConfigError, match=f"imagefolder: {tmp_path / 'b'} holds 1 image and no eval folder"):
        build_datasets("imagefolder", str(tmp_path / "b"), download=False)


@pytest.mark.parametrize(("labels", "expected"), [
    ([2, 0, 1, 2], (None, 3)),
    (["cat", "ant", "cat", "bee"], ({"ant": 0, "bee": 1, "cat": 2}, 3)),
    ([1, -1, 0, 1], "hf: labels in 'label' must be class ids 0, 1, 2, ...; got -1.."),
    ([0, 100_000, 1, 2], "hf: label 100000 in column 'label' ("),
])
def test_the_in_memory_mapped_and_streamed_paths_share_one_label_rule(labels, expected):
    """Three readers of a label column (decoded into memory, Arrow memory-mapped, the rows a stream looked at) give
    the same classes, or the same refusal, for the same labels: one rule (accel_ddp.data.hf.class_ids)."""
    import datasets

    from accel_ddp.data.hf import _label_ids, split_labels
    from accel_ddp.data.hf_stream import _stream_labels

    train, eval_ = datasets.Dataset.from_dict({"label": labels[:3]}), datasets.Dataset.from_dict({"label": labels[3:]})
    readers = {"mapped": lambda: _label_ids(train, eval_, "label"),
               "stream": lambda: _stream_labels(train.features["label"], [{"label": v} for v in labels], "label"),
               "in_memory": lambda: split_labels(train, eval_, "label")}
    if isinstance(expected, str):
        for name, read in readers.items():
            with pytest.raises(ConfigError) as err:
                read()
            assert str(err.value).startswith(expected), name
        return
    assert readers["mapped"]() == readers["stream"]() == expected
    train_y, eval_y, num_classes = readers["in_memory"]()
    ids = expected[0]
    assert num_classes == expected[1]
    assert train_y.tolist() + eval_y.tolist() == [v if ids is None else ids[v] for v in labels]


def test_a_class_label_declares_the_classes_on_every_path():
    import datasets

    from accel_ddp.data.hf import _label_ids, split_labels
    from accel_ddp.data.hf_stream import _stream_labels

    features = datasets.Features({"label": datasets.ClassLabel(names=["a", "b", "c", "d"])})
    train = datasets.Dataset.from_dict({"label": [0, 2]}, features=features)
    assert _label_ids(train, None, "label") == _stream_labels(features["label"], [], "label") == (None, 4)
    train_y, eval_y, num_classes = split_labels(train, None, "label")
    assert (train_y.tolist(), eval_y, num_classes) == ([0, 2], None, 4)
