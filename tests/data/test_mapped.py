"""The memory-mapped path (accel_ddp/data/mapped.py): the in-memory path's samples, a flat resident set,
damaged files."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch

from accel_ddp.data import (
    HFSource,
    HostLoader,
    InMemoryDataset,
    build_datasets,
    choose_loader,
)
from accel_ddp.data.loaders import data_source
from accel_ddp.data.mapped import MappedDataset
from tests.helpers.data import hf_image_dataset
from tests.helpers.multiproc import run_ranks
from tests.helpers.runs import load_weights, main_ranks, read_metrics, train_ranks_in_turn

# ----------------------------------------------------------------------------- memory-mapped Hugging Face datasets


@pytest.mark.parametrize("layout", ["parquet_rgb_held_out", "save_to_disk_gray"])
def test_memory_mapped_path_serves_the_in_memory_paths_samples(tmp_path, layout):
    """Above the size threshold the rows stay in Arrow files and are decoded per batch: the same samples."""
    import datasets

    if layout == "parquet_rgb_held_out":
        hf_image_dataset(45, 0, size=8, mode="RGB").to_parquet(str(tmp_path / "train.parquet"))
        data_dir = tmp_path
    else:
        datasets.DatasetDict(train=hf_image_dataset(40, 0), test=hf_image_dataset(12, 1)).save_to_disk(tmp_path / "d")
        data_dir = tmp_path / "d"
    in_memory = build_datasets("hf", str(data_dir), download=False, hf=HFSource(in_memory_max_mb=4096))
    mapped = build_datasets("hf", str(data_dir), download=False, hf=HFSource(in_memory_max_mb=0))
    assert isinstance(in_memory.train, InMemoryDataset) and isinstance(mapped.train, MappedDataset)
    assert (mapped.num_classes, mapped.input_shape) == (in_memory.num_classes, in_memory.input_shape)
    for name in ("train", "eval"):
        ours, theirs = getattr(mapped, name), getattr(in_memory, name)
        assert len(ours) == len(theirs)
        every = list(range(len(ours)))
        for (x, y), (x_ref, y_ref) in zip(ours.__getitems__(every), theirs.__getitems__(every), strict=True):
            assert torch.equal(x, x_ref) and int(y) == int(y_ref)  # decoded and normalised to the same bits
    assert data_source(mapped.train) == "memory_mapped" and data_source(in_memory.train) == "in_memory"
    assert choose_loader("auto", mapped.train, 4096) == "dataloader"
    batches = list(HostLoader(mapped.train, 4, 8, seed=0, num_workers=1))
    assert len(batches) == len(mapped.train) // 8 * 2 and batches[0][0].shape == (4, *mapped.input_shape)


def test_memory_mapped_arrays_and_named_labels(tmp_path):
    """Array and number columns on the memory-mapped path: floats as stored, uint8 normalised, names as class ids."""
    import datasets

    rng = np.random.default_rng(5)
    floats = rng.normal(size=(20, 4, 4)).astype(np.float32)
    pixels = rng.integers(0, 256, (20, 2, 3), dtype=np.uint8)
    features = datasets.Features({"x": datasets.Array2D((4, 4), "float32"), "p": datasets.Array2D((2, 3), "uint8"),
                                  "animal": datasets.Value("string")})
    names = ["cat", "dog", "ant", "eel"]
    ds = datasets.Dataset.from_dict({"x": floats, "p": pixels, "animal": [names[i % 4] for i in range(20)]},
                                    features=features)
    datasets.DatasetDict(train=ds, validation=ds.select(range(5))).save_to_disk(tmp_path / "d")
    for column in ("x", "p"):
        source = dict(image_column=column, label_column="animal")
        mapped = build_datasets("hf", str(tmp_path / "d"), False, hf=HFSource(**source, in_memory_max_mb=0))
        in_memory = build_datasets("hf", str(tmp_path / "d"), False, hf=HFSource(**source))
        assert isinstance(mapped.train, MappedDataset) and mapped.num_classes == 4
        assert mapped.input_shape == in_memory.input_shape == ((1, 4, 4) if column == "x" else (1, 2, 3))
        for i in (0, 3, 17):
            (x, y), (x_ref, y_ref) = mapped.train[i], in_memory.train[i]
            assert torch.equal(x, x_ref) and int(y) == int(y_ref) == sorted(names).index(names[i % 4])


def _resident_file_mib() -> float:
    with open("/proc/self/status", encoding="utf-8") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith("RssFile:")) / 1024


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the resident set from /proc")
def test_memory_mapped_reads_leave_the_resident_set_flat(tmp_path):
    """Pages a batch maps stay mapped, counting in RSS, unless the reader drops them: it does, after each batch."""
    import datasets

    rows = 2560  # 30 MiB of incompressible bytes
    payload = np.random.default_rng(0).integers(0, 256, (rows, 12288), dtype=np.uint8)
    datasets.Dataset.from_dict({"x": [bytes(r) for r in payload], "y": list(range(rows))}).save_to_disk(tmp_path / "d")

    def growth(trim: bool) -> float:
        mapped = MappedDataset(datasets.load_from_disk(str(tmp_path / "d")),
                               decode=lambda batch, _: [len(b) for b in batch["x"]])
        if not trim:
            mapped.trim = lambda: None
        base, peak = _resident_file_mib(), 0.0
        for start in range(0, rows, 64):
            assert mapped.__getitems__(range(start, start + 64)) == [12288] * 64
            peak = max(peak, _resident_file_mib() - base)
        return peak

    assert growth(trim=False) > 25  # the whole file ends up in this process's resident set
    assert growth(trim=True) < 12  # at most a batch's pages (and the kernel's read-around) at a time


def test_a_damaged_data_file_is_named_before_training_and_checkpoints_stay(tmp_path, capfd):
    """A parquet file, or a save_to_disk's arrow file, cut in half after a run: the resumed run names it in one line
    before training (exit 2 on both ranks) and leaves the run's files as they were. Both kinds' runs train in turn in
    one forked process; each refused resume in its own forked pair (a failed run is its process's last)."""
    import datasets

    damaged, runs = {}, {}
    for kind in ("parquet", "arrow"):
        folder = tmp_path / kind / "d"
        if kind == "parquet":
            folder.mkdir(parents=True)
            hf_image_dataset(40, 0).to_parquet(str(folder / "train.parquet"))
            hf_image_dataset(12, 1).to_parquet(str(folder / "test.parquet"))
            damaged[kind] = folder / "train.parquet"
        else:
            datasets.DatasetDict(train=hf_image_dataset(40, 0), test=hf_image_dataset(12, 1)).save_to_disk(folder)
            damaged[kind] = next((folder / "train").glob("*.arrow"))
        runs[kind] = ["--dataset", "hf", "--data_dir", str(folder), "--global_batch_size", "8", "--epochs", "1",
                      "--checkpointing_steps", "2", "--output_dir", str(tmp_path / kind / "run")]
    from accel_ddp.cli.train import main

    assert run_ranks(lambda: [main(args) for args in runs.values()], world_size=1) == [[0, 0]]
    before = {p: p.read_bytes() for kind in runs for p in (tmp_path / kind / "run").rglob("*") if p.is_file()}
    for path in damaged.values():
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])  # cut in half
    for kind, args in runs.items():  # a process per refused run: a failed run is a process's last
        capfd.readouterr()
        assert main_ranks([*args, "--resume_from_checkpoint", "auto"]) == [2, 2], kind
        errors = [line for line in capfd.readouterr().err.splitlines() if line.startswith("accel_ddp: error:")]
        assert len(errors) == 1 and str(damaged[kind]) in errors[0] and "re-create or re-download it" in errors[0]
    assert {p: p.read_bytes() for kind in runs for p in (tmp_path / kind / "run").rglob("*") if p.is_file()} == before


def test_memory_mapped_run_trains_the_weights_of_the_in_memory_run(tmp_path):
    """The same parquet files, over the size threshold: memory-mapped, they train the same weights bit for bit."""
    folder = tmp_path / "d"
    folder.mkdir()
    hf_image_dataset(96, 0, size=8, mode="RGB").to_parquet(str(folder / "train.parquet"))
    hf_image_dataset(20, 1, size=8, mode="RGB").to_parquet(str(folder / "test.parquet"))
    common = ["--dataset", "hf", "--data_dir", str(folder), "--model", "mnist_cnn", "--epochs", "2",
              "--global_batch_size", "16", "--optimizer", "sgd", "--lr", "0.05"]
    # in turn in the same forked ranks; in memory first: the mapped run's DataLoader workers come after it
    in_memory, mapped = (by_rank[0] for by_rank in train_ranks_in_turn([
        [*common, "--output_dir", str(tmp_path / "memory")],
        [*common, "--device_loader_max_mb", "0", "--output_dir", str(tmp_path / "mapped")]]))
    assert (mapped["loader"], mapped["data_source"]) == ("dataloader", "memory_mapped")
    assert (in_memory["loader"], in_memory["data_source"]) == ("device", "in_memory")
    assert mapped["eval_samples"] == in_memory["eval_samples"] == 20
    epochs = [r for r in read_metrics(tmp_path / "mapped") if "peak_rss_mb" in r]
    assert len(epochs) == 2 and set(epochs[-1]["peak_rss_mb"]) == {"rank0", "rank1"}  # every rank, every epoch
    assert mapped["peak_rss_mb"] >= max(epochs[-1]["peak_rss_mb"].values()) > 100  # a peak; torch alone takes more
    assert mapped["peak_worker_rss_mb"] > 0 and in_memory["peak_worker_rss_mb"] == 0  # no workers in memory
    ours, theirs = load_weights(tmp_path / "mapped"), load_weights(tmp_path / "memory")
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)
