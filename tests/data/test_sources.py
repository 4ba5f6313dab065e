"""Datasets built from files made here (accel_ddp/data/builtin.py, hf.py): IDX, CIFAR pickles, PNG folders, parquet,
CSV, save_to_disk; offline errors name what is missing and how to get it. Nothing is downloaded."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

from accel_ddp.cli.args import parse_args
from accel_ddp.config.views import section_of
from accel_ddp.data import (
    CIFAR10_MEAN,
    CIFAR10_STD,
    MNIST_MEAN,
    MNIST_STD,
    HFSource,
    HostLoader,
    build_datasets,
    choose_loader,
    read_idx,
)
from accel_ddp.util.validation import ConfigError
from tests.helpers.data import hf_image_dataset, write_cifar, write_mnist, write_png_classes
from tests.helpers.files import wait_for_file
from tests.helpers.multiproc import run_ranks
from tests.helpers.runs import main_ranks

# ----------------------------------------------------------------------------- datasets from files


@pytest.mark.parametrize("gz", [False, True])
@pytest.mark.parametrize("name,folder,mean,std", [
    ("mnist", "MNIST", MNIST_MEAN, MNIST_STD), ("fashion_mnist", "FashionMNIST", 0.2860, 0.3530),
])
def test_mnist_format_datasets_from_idx_files(tmp_path, gz, name, folder, mean, std):
    arrays = write_mnist(tmp_path, folder, gz=gz)
    bundle = build_datasets(name, str(tmp_path), download=False)
    assert (len(bundle.train), len(bundle.eval), bundle.num_classes, bundle.input_shape) == (64, 20, 10, (1, 28, 28))
    assert bundle.train.inputs.dtype == torch.uint8  # compact storage: 1 byte per pixel
    x, y = bundle.train[5]
    raw = torch.from_numpy(arrays["train-images-idx3-ubyte"][5]).float().unsqueeze(0)
    assert torch.equal(x, (raw / 255.0 - mean) / std)  # the textbook normalisation, bit for bit
    assert int(y) == arrays["train-labels-idx1-ubyte"][5]
    assert torch.equal(read_idx(str(next((tmp_path / folder / "raw").glob("t10k-labels*")))),
                       torch.from_numpy(arrays["t10k-labels-idx1-ubyte"]))


def test_corrupt_idx_file_is_a_clear_error(tmp_path):
    write_mnist(tmp_path)
    (tmp_path / "MNIST" / "raw" / "train-images-idx3-ubyte").write_bytes(b"\x00\x00\x08\x03" + b"\x00" * 20)
    with pytest.raises(ConfigError, match="re-download"):
        build_datasets("mnist", str(tmp_path), download=False)


@pytest.mark.parametrize("damage", ["truncated", "not_gzip"])
def test_a_damaged_gzipped_idx_file_is_one_line_naming_it(tmp_path, damage):
    write_mnist(tmp_path, gz=True)
    path = tmp_path / "MNIST" / "raw" / "train-images-idx3-ubyte.gz"
    path.write_bytes(path.read_bytes()[:200] if damage == "truncated" else b"not a gzip file at all")
    with pytest.raises(ConfigError) as info:
        build_datasets("mnist", str(tmp_path), download=False)
    assert str(path) in str(info.value) and "re-download" in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("content", [
    [1, 2, 3],  # not a dict
    {"labels": [1, 2]},  # no data
    {"data": np.zeros((2, 100), dtype=np.uint8), "labels": [1, 2]},  # not 3x32x32 images
    {"data": np.zeros((2, 3072), dtype=np.uint8), "labels": [1, 2, 3]},  # a label per image? no
])
def test_a_cifar10_batch_of_the_wrong_shape_is_one_line_naming_it(tmp_path, content):
    write_cifar(tmp_path)
    path = tmp_path / "cifar-10-batches-py" / "data_batch_2"
    path.write_bytes(pickle.dumps(content, protocol=2))
    with pytest.raises(ConfigError) as info:
        build_datasets("cifar10", str(tmp_path), download=False)
    assert str(path) in str(info.value) and "not a CIFAR-10 python batch" in str(info.value)
    assert "re-download" in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("protocol", [2, pickle.HIGHEST_PROTOCOL])
def test_cifar10_from_pickle_batches(tmp_path, protocol):
    batches = write_cifar(tmp_path, protocol=protocol)
    bundle = build_datasets("cifar10", str(tmp_path), download=False)
    assert (len(bundle.train), len(bundle.eval), bundle.num_classes, bundle.input_shape) == (60, 12, 10, (3, 32, 32))
    assert bundle.train.augment == "crop_flip" and bundle.eval.augment is None
    pixels = torch.from_numpy(batches["test_batch"]["data"][3]).view(3, 32, 32).float()
    mean, std = torch.tensor(CIFAR10_MEAN).view(3, 1, 1), torch.tensor(CIFAR10_STD).view(3, 1, 1)
    x, y = bundle.eval[3]
    assert torch.allclose(x, (pixels / 255.0 - mean) / std, atol=1e-6)
    assert int(y) == batches["test_batch"]["labels"][3]
    assert int(bundle.train.labels[12]) == batches["data_batch_2"]["labels"][0]


def test_cifar10_refuses_a_pickle_that_would_run_code(tmp_path):
    write_cifar(tmp_path)
    marker = tmp_path / "pwned"

    class Exploit:
        def __reduce__(self):
            return (Path.touch, (marker,))

    (tmp_path / "cifar-10-batches-py" / "data_batch_3").write_bytes(pickle.dumps({"data": Exploit()}))
    with pytest.raises(ConfigError, match="not a CIFAR-10 python batch"):
        build_datasets("cifar10", str(tmp_path), download=False)
    assert not marker.exists()


@pytest.mark.parametrize("layout", ["train_val", "flat"])
def test_imagefolder_from_class_folders_of_pngs(tmp_path, layout):
    if layout == "train_val":
        write_png_classes(tmp_path / "train", ["cat", "dog", "eel"], per_class=6)
        write_png_classes(tmp_path / "val", ["cat", "eel"], per_class=2)  # an eval folder may lack a class
    else:
        write_png_classes(tmp_path, ["cat", "dog", "eel"], per_class=10, mode="L")
    bundle = build_datasets("imagefolder", str(tmp_path), download=False)
    channels = 3 if layout == "train_val" else 1
    assert bundle.num_classes == 3 and bundle.input_shape == (channels, 10, 12)
    assert (len(bundle.train), len(bundle.eval)) == ((18, 4) if layout == "train_val" else (27, 3))
    if layout == "train_val":  # eval labels use the training folder's class indices
        assert sorted({int(y) for _, y in bundle.eval}) == [0, 2]
    x, _ = bundle.train[0]
    assert x.shape == (channels, 10, 12) and -1.0 <= float(x.min()) and float(x.max()) <= 1.0
    resized = build_datasets("imagefolder", str(tmp_path), download=False, image_size=8)
    assert resized.input_shape == (channels, 8, 8) and resized.train[0][0].shape == (channels, 8, 8)
    batch, labels = next(iter(HostLoader(bundle.train, 4, 8, seed=0, num_workers=0)))
    assert batch.shape == (4, channels, 10, 12) and labels.dtype == torch.long


def test_hf_from_save_to_disk_with_images_and_class_labels(tmp_path):
    import datasets

    datasets.DatasetDict(train=hf_image_dataset(40, 0), test=hf_image_dataset(12, 1)).save_to_disk(tmp_path / "d")
    bundle = build_datasets("hf", str(tmp_path / "d"), download=False)
    assert (len(bundle.train), len(bundle.eval), bundle.num_classes, bundle.input_shape) == (40, 12, 4, (1, 10, 10))
    assert bundle.train.inputs.dtype == torch.uint8
    source = hf_image_dataset(40, 0)
    assert torch.equal(bundle.train.inputs[7, 0], torch.from_numpy(np.array(source[7]["image"])))
    assert bundle.train.labels.tolist() == [i % 4 for i in range(40)]
    x = torch.stack([bundle.train[i][0] for i in range(40)])
    assert abs(float(x.mean())) < 1e-3 and abs(float(x.std()) - 1) < 1e-2  # normalised by its own statistics
    assert choose_loader("auto", bundle.train, 4096) == "device"
    assert int(bundle.train.tensors[1].max()) + 1 == bundle.num_classes  # what train() infers classes from


def test_hf_from_parquet_files_with_rgb_images_and_a_held_out_split(tmp_path):
    hf_image_dataset(30, 0, size=8, mode="RGB").to_parquet(str(tmp_path / "train.parquet"))
    bundle = build_datasets("hf", str(tmp_path), download=False)
    assert bundle.input_shape == (3, 8, 8) and bundle.num_classes == 4
    assert (len(bundle.train), len(bundle.eval)) == (27, 3)  # no eval split: a fixed 10% held out
    source = HFSource(eval_split="nope")
    with pytest.raises(ConfigError, match="--hf_eval_split"):
        build_datasets("hf", str(tmp_path), download=False, hf=source)


def test_hf_from_a_csv_of_pixels_with_string_labels(tmp_path):
    rng = np.random.default_rng(4)
    names = ["cat", "dog", "ant"]
    pixels = rng.integers(0, 256, (30, 6))
    rows = ["animal," + ",".join(f"p{i}" for i in range(6))]
    rows += [names[i % 3] + "," + ",".join(str(v) for v in pixels[i]) for i in range(30)]
    (tmp_path / "pixels.csv").write_text("\n".join(rows) + "\n")
    bundle = build_datasets("hf", str(tmp_path / "pixels.csv"), download=False, hf=HFSource(label_column="animal"))
    assert bundle.input_shape == (6,) and bundle.num_classes == 3
    assert bundle.train.inputs.dtype == torch.uint8
    assert (len(bundle.train), len(bundle.eval)) == (27, 3)
    served = torch.cat([bundle.train.inputs, bundle.eval.inputs]).numpy()
    labels = torch.cat([bundle.train.labels, bundle.eval.labels]).tolist()
    for row, label in zip(served, labels, strict=True):
        i = int(np.flatnonzero((pixels == row).all(axis=1))[0])
        assert label == sorted(names).index(names[i % 3])  # ant, cat, dog: classes in sorted order


def test_hf_float_array_column_is_served_as_stored(tmp_path):
    import datasets

    arrays = np.random.default_rng(5).normal(size=(20, 4, 4)).astype(np.float32)
    features = datasets.Features({"x": datasets.Array2D((4, 4), "float32"), "label": datasets.Value("int64")})
    ds = datasets.Dataset.from_dict({"x": arrays, "label": list(range(20))}, features=features)
    datasets.DatasetDict(train=ds, validation=ds.select(range(5))).save_to_disk(tmp_path / "d")
    bundle = build_datasets("hf", str(tmp_path / "d"), download=False)
    assert bundle.input_shape == (1, 4, 4) and bundle.num_classes == 20 and len(bundle.eval) == 5
    assert torch.equal(bundle.train[3][0], torch.from_numpy(arrays[3]).unsqueeze(0))


# ------------------------------------------------------------------- offline: what is missing and how to get it


@pytest.mark.parametrize("name,expected", [
    ("mnist", "train-images-idx3-ubyte.*--download"),
    ("fashion_mnist", "FashionMNIST.*--download"),
    ("cifar10", "cifar-10-batches-py.*--download"),
    ("imagefolder", "expected .*<class>/<image>"),
    ("hf", "does not exist.*save_to_disk"),
])
def test_missing_data_names_what_is_missing_and_how_to_get_it(tmp_path, name, expected):
    (tmp_path / "empty").mkdir()
    data_dir = tmp_path / ("nothing_here" if name == "hf" else "empty")
    with pytest.raises(ConfigError, match=expected):
        build_datasets(name, str(data_dir), download=False)


@pytest.mark.parametrize("name,cls", [("mnist", "MNIST"), ("fashion_mnist", "FashionMNIST"), ("cifar10", "CIFAR10")])
def test_download_without_network_says_where_to_put_the_files(tmp_path, monkeypatch, name, cls):
    from urllib.error import URLError

    import torchvision.datasets

    def offline(self, *args, **kwargs):
        raise URLError("[Errno -3] Temporary failure in name resolution")

    monkeypatch.setattr(getattr(torchvision.datasets, cls), "download", offline)
    with pytest.raises(ConfigError, match=r"download failed \(URLError.*check the network, or copy the files into"):
        build_datasets(name, str(tmp_path), download=True)


def test_download_runs_on_one_process_when_machines_share_the_data_dir(tmp_path):
    """Two ranks that each act as a machine's first process (LOCAL_RANK 0 on both), one --data_dir: the global
    main process downloads, the other machine's first process finds the files. Each downloading at once would
    write the same files while the other reads them."""
    calls = tmp_path / "downloads"
    waiting = tmp_path / "rank1_waits"

    def run():
        import torchvision.datasets
        from accelerate import Accelerator

        from accel_ddp.data.resolve import DataOptions, resolve_data

        def fake_download(root, train, download):
            with open(calls, "a", encoding="utf-8") as fh:
                fh.write(os.environ["RANK"] + "\n")
            if os.environ["RANK"] == "0":  # done only once rank 1 waits at a barrier: a rank 1 that looked for the
                wait_for_file(waiting)     # files (or downloaded) without waiting would have found none
            write_mnist(Path(root))

        os.environ.update({"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "GROUP_RANK": os.environ["RANK"],
                           "GROUP_WORLD_SIZE": "2"})  # each rank the first process of its own machine
        torchvision.datasets.MNIST = fake_download
        accelerator = Accelerator(cpu=True)
        assert accelerator.is_local_main_process
        if os.environ["RANK"] == "1":
            barrier = accelerator.wait_for_everyone
            accelerator.wait_for_everyone = lambda: (waiting.touch(), barrier())[1]
        cfg = parse_args(["--dataset", "mnist", "--data_dir", str(tmp_path / "data"), "--download"])
        return len(resolve_data(section_of(cfg, DataOptions), accelerator, None, None).train)

    assert run_ranks(run) == [64, 64]
    assert calls.read_text().split() == ["0"]


def test_hf_hub_name_offline_says_how_to_get_it(tmp_path):
    """Offline, as tests/helpers/env.py sets the suite before datasets loads; in a forked rank (not a fresh
    interpreter: ~3 s of CPU importing torch) with empty caches of its own."""
    def load():
        import datasets.config
        import huggingface_hub.constants

        assert datasets.config.HF_HUB_OFFLINE and datasets.config.HF_DATASETS_OFFLINE
        datasets.config.HF_DATASETS_CACHE = tmp_path / "hf_home" / "datasets"
        huggingface_hub.constants.HF_HUB_CACHE = str(tmp_path / "hf_home" / "hub")
        try:
            build_datasets("hf", "data", False, hf=HFSource(name="someone/not-cached-anywhere"))
        except ConfigError as err:
            return str(err)
        return None

    [message] = run_ranks(load, world_size=1)
    assert message is not None, "an uncached Hub name loaded offline"
    assert "network access" in message and "save_to_disk" in message


def test_cli_reports_missing_mnist_in_one_line_with_exit_code_2(tmp_path, capfd):
    args = ["--dataset", "mnist", "--data_dir", str(tmp_path), "--output_dir", str(tmp_path / "o")]
    assert main_ranks(args, world_size=1) == [2]
    lines = [line for line in capfd.readouterr().err.splitlines() if line.startswith("accel_ddp: error:")]
    assert len(lines) == 1 and "--download" in lines[0] and str(tmp_path) in lines[0]


def test_a_rank_waiting_for_the_tokenizing_one_imports_the_text_libraries_meanwhile(tmp_path):
    """Rank 1 waits in local_main_first while rank 0 tokenizes: it imports datasets and the tokenizer classes during
    that wait (import_text_libraries), not after it, where they would add ~1.6 s to the start-up's critical path.
    Rank 0, which imports them inside its own build, does not run it; rank 1 builds only once rank 0 is done."""
    import time

    imported = tmp_path / "rank1_imported"

    def run():
        from accelerate import Accelerator

        import accel_ddp.data.resolve as resolve
        from accel_ddp.data.bundle import DatasetBundle

        events = {}

        def build_text(*_args):
            events["build_start"] = time.monotonic()
            if os.environ["RANK"] == "0":  # the tokenizing: it ends once rank 1 has imported, if it does meanwhile
                events["saw_imports"] = wait_for_file(imported)
            events["build_end"] = time.monotonic()
            data = torch.utils.data.TensorDataset(torch.zeros(4, 8, dtype=torch.long), torch.zeros(4))
            return DatasetBundle(data, data, 10, (8,)), None

        def import_text_libraries(*_args):
            events.setdefault("imports", time.monotonic())
            imported.touch()

        resolve.build_text = build_text
        resolve.import_text_libraries = import_text_libraries
        cfg = parse_args(["--task", "causal_lm", "--dataset", "hf", "--data_dir", str(tmp_path), "--tokenizer",
                          str(tmp_path), "--max_length", "8", "--loader", "dataloader"])
        resolve.resolve_data(section_of(cfg, resolve.DataOptions), Accelerator(cpu=True), None, None)
        return events

    first, waiting = run_ranks(run)
    assert "imports" not in first
    assert first["saw_imports"] and waiting["imports"] < first["build_end"]  # during rank 0's build, not after it
    assert waiting["build_start"] >= first["build_end"]
