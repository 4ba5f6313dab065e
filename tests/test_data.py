"""Datasets built from files made here, the device loader against the DataLoader path, and offline errors.

Nothing is downloaded: every source (IDX files, CIFAR pickle batches, class folders of PNGs,
parquet, CSV, ``save_to_disk``) is written into a temporary folder first.
"""

from __future__ import annotations

import gzip
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import Subset, TensorDataset

from accel_ddp import TrainConfig, train
from accel_ddp.cli.args import parse_args
from accel_ddp.data import (
    CIFAR10_MEAN,
    CIFAR10_STD,
    MNIST_MEAN,
    MNIST_STD,
    DeviceLoader,
    HFSource,
    HostLoader,
    InMemoryDataset,
    build_datasets,
    build_eval_loader,
    build_train_loader,
    choose_loader,
    default_num_workers,
    read_idx,
)
from accel_ddp.data.device_loader import DeviceEvalLoader
from accel_ddp.data.in_memory import CROP_PADDING, crop_flip
from accel_ddp.data.loaders import data_source
from accel_ddp.data.mapped import MappedDataset
from accel_ddp.data.sampler import epoch_order
from accel_ddp.util.validation import ConfigError
from tests.helpers import data as helpers_data
from tests.helpers import faults
from tests.helpers.data import hf_image_dataset, image_shards, write_png_classes, write_shards
from tests.helpers.multiproc import RankFailed, run_ranks
from tests.helpers.runs import REPO, load_weights, main_ranks, read_metrics, read_summary, train_ranks

TRAIN_SRC = (REPO / "accel_ddp" / "loop.py").read_text()
wired = pytest.mark.skipif(
    "build_loaders" not in TRAIN_SRC, reason="accel_ddp/loop.py does not use data.build_loaders yet"
)


# ----------------------------------------------------------------------------- file writers


def write_idx(path: Path, array: np.ndarray, gz: bool = False) -> None:
    header = bytes([0, 0, 0x08, array.ndim]) + b"".join(int(d).to_bytes(4, "big") for d in array.shape)
    payload = header + np.ascontiguousarray(array, dtype=np.uint8).tobytes()
    path.parent.mkdir(parents=True, exist_ok=True)
    if gz:
        with gzip.open(str(path) + ".gz", "wb") as fh:
            fh.write(payload)
    else:
        path.write_bytes(payload)


def write_mnist(root: Path, folder: str = "MNIST", n_train: int = 64, n_eval: int = 20, gz: bool = False):
    rng = np.random.default_rng(0)
    arrays = {
        "train-images-idx3-ubyte": rng.integers(0, 256, (n_train, 28, 28), dtype=np.uint8),
        "train-labels-idx1-ubyte": rng.integers(0, 10, n_train, dtype=np.uint8),
        "t10k-images-idx3-ubyte": rng.integers(0, 256, (n_eval, 28, 28), dtype=np.uint8),
        "t10k-labels-idx1-ubyte": rng.integers(0, 10, n_eval, dtype=np.uint8),
    }
    for name, array in arrays.items():
        write_idx(root / folder / "raw" / name, array, gz=gz)
    return arrays


def write_cifar(root: Path, per_batch: int = 12, protocol: int = 2) -> dict:
    rng = np.random.default_rng(1)
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    batches = {}
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        entry = {
            "batch_label": name,
            "labels": rng.integers(0, 10, per_batch).tolist(),
            "data": rng.integers(0, 256, (per_batch, 3072), dtype=np.uint8),
            "filenames": [f"{name}_{i}.png" for i in range(per_batch)],
        }
        (folder / name).write_bytes(pickle.dumps(entry, protocol=protocol))
        batches[name] = entry
    (folder / "batches.meta").write_bytes(pickle.dumps({"label_names": [str(i) for i in range(10)]}, protocol=2))
    return batches


def index_dataset(n: int = 103, shape=(1, 3, 3)) -> InMemoryDataset:
    """uint8 inputs, normalised like MNIST; the label of sample i is i, so a batch says which samples it holds."""
    inputs = torch.randint(0, 256, (n, *shape), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    return InMemoryDataset(inputs, torch.arange(n), mean=(MNIST_MEAN,), std=(MNIST_STD,), scale=255.0)


@pytest.fixture
def accelerate_state():
    """prepare_data_loader reads Accelerate's process state; leave none behind for other tests."""
    from accelerate.state import AcceleratorState, GradientState

    yield
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def accelerate_loader(dataset, per_device: int, global_batch: int, world: int, rank: int, seed: int):
    """Rank `rank`'s loader as Accelerate shards a textbook one: its seedable sampler, then BatchSamplerShard.

    This was the DataLoader path before the package had its own sampler; the order must not change.
    """
    from accelerate.data_loader import prepare_data_loader
    from torch.utils.data import DataLoader, RandomSampler

    used = len(dataset) // global_batch * global_batch
    textbook = DataLoader(dataset, batch_size=per_device, sampler=RandomSampler(dataset, num_samples=used),
                          drop_last=True)
    return prepare_data_loader(textbook, num_processes=world, process_index=rank, use_seedable_sampler=True,
                               data_seed=seed)


def classic_batches(dataset, per_device: int, global_batch: int, world: int, rank: int, seed: int, epoch: int):
    """What rank `rank` of `world` got from Accelerate's sharding in epoch `epoch`."""
    loader = accelerate_loader(dataset, per_device, global_batch, world, rank, seed)
    loader.set_epoch(epoch)
    return list(loader)


LAYOUTS = [  # (world size, per-device batch, global batch): accumulation = global / (world * per-device)
    (1, 32, 32), (2, 16, 32), (2, 8, 32), (4, 4, 32), (3, 4, 24),
]


# ----------------------------------------------------------------------------- fast path == DataLoader path


@pytest.mark.parametrize("world,per_device,global_batch", LAYOUTS)
def test_device_and_dataloader_paths_serve_accelerates_order_bit_for_bit(world, per_device, global_batch,
                                                                         accelerate_state):
    dataset = index_dataset()
    for rank in range(world):
        fast = DeviceLoader(dataset, per_device, global_batch, seed=11, rank=rank, world_size=world)
        host = HostLoader(dataset, per_device, global_batch, seed=11, rank=rank, world_size=world, num_workers=0)
        for epoch in (0, 1):
            fast.set_epoch(epoch)
            host.set_epoch(epoch)
            fast_batches, host_batches = list(fast), list(host)
            classic = classic_batches(dataset, per_device, global_batch, world, rank, seed=11, epoch=epoch)
            assert len(fast_batches) == len(host_batches) == len(classic) == len(fast) == len(host)
            for (fx, fy), (hx, hy), (cx, cy) in zip(fast_batches, host_batches, classic, strict=True):
                assert torch.equal(fy, cy) and torch.equal(hy, cy)  # the same samples in the same micro-step
                assert torch.equal(fx, cx) and torch.equal(hx, cx)  # normalised to the same bits
                assert fx.dtype == torch.float32


def test_each_epoch_serves_every_sample_once_in_a_new_order_the_same_for_any_world_size():
    dataset = index_dataset(n=100)  # 100 // 24 = 4 optimizer steps, the last 4 samples dropped
    global_batch = 24

    def per_step_samples(world: int, per_device: int, epoch: int) -> list[list[int]]:
        loaders = [DeviceLoader(dataset, per_device, global_batch, seed=5, rank=r, world_size=world)
                   for r in range(world)]
        for loader in loaders:
            loader.set_epoch(epoch)
        ranks = [[y.tolist() for _, y in loader] for loader in loaders]
        accumulation = len(ranks[0]) // loaders[0].steps_per_epoch
        steps = []
        for step in range(loaders[0].steps_per_epoch):
            micro = range(step * accumulation, (step + 1) * accumulation)
            steps.append(sorted(i for r in ranks for m in micro for i in r[m]))
        return steps

    reference = per_step_samples(1, 24, epoch=0)
    flat = [i for step in reference for i in step]
    assert len(flat) == len(set(flat)) == 96  # each sample at most once, all whole global batches
    order = epoch_order(100, 96, seed=5, epoch=0).tolist()
    assert [sorted(order[s * 24:(s + 1) * 24]) for s in range(4)] == reference
    for world, per_device in [(2, 12), (2, 4), (3, 8), (4, 2), (6, 4)]:
        assert per_step_samples(world, per_device, epoch=0) == reference, (world, per_device)
    assert per_step_samples(1, 24, epoch=1) != reference  # a new order each epoch
    assert per_step_samples(2, 6, epoch=1) == per_step_samples(1, 24, epoch=1)


def test_epochs_advance_after_a_full_pass_and_set_epoch_replays_one():
    loader = DeviceLoader(index_dataset(), 8, 16, seed=0)
    first = [y.tolist() for _, y in loader]
    second = [y.tolist() for _, y in loader]  # the loader moved on to epoch 1 by itself, as a DataLoaderShard does
    assert first != second
    loader.set_epoch(0)
    assert [y.tolist() for _, y in loader] == first


def test_skip_first_batches_resumes_mid_epoch_like_accelerate(accelerate_state):
    from accelerate.data_loader import skip_first_batches

    dataset = index_dataset()
    for loader in (DeviceLoader(dataset, 8, 32, seed=4, rank=1, world_size=2),
                   HostLoader(dataset, 8, 32, seed=4, rank=1, world_size=2, num_workers=0)):
        loader.set_epoch(1)
        full = [y.tolist() for _, y in loader]
        loader.set_epoch(1)
        resumed = loader.skip_first_batches(4)  # after optimizer step 2 of this epoch (accumulation 2)
        assert len(resumed) == len(full) - 4
        assert [y.tolist() for _, y in resumed] == full[4:]
        assert [y.tolist() for _, y in loader] != full  # then the next epoch, whole
        assert len(loader) == len(full)
        with pytest.raises(ValueError):
            loader.skip_first_batches(len(full) + 1)

    classic = accelerate_loader(dataset, 8, 32, world=2, rank=1, seed=4)
    classic.set_epoch(1)
    assert [y.tolist() for _, y in skip_first_batches(classic, 4)] == full[4:]


def test_crop_flip_augmentation_is_per_sample_correct_and_the_same_for_any_world_size():
    images = torch.randint(0, 256, (40, 3, 6, 5), dtype=torch.uint8, generator=torch.Generator().manual_seed(8))
    params = torch.tensor([[0, 0, 0], [8, 8, 1], [4, 4, 0], [3, 5, 1]])
    out = crop_flip(images[:4], params)
    padded = torch.nn.functional.pad(images[:4], (CROP_PADDING,) * 4)
    for i, (dy, dx, flip) in enumerate(params.tolist()):
        expected = padded[i, :, dy:dy + 6, dx:dx + 5]
        assert torch.equal(out[i], expected.flip(-1) if flip else expected)
    assert torch.equal(out[2], images[2])  # centred, not flipped: the image itself

    data = InMemoryDataset(images, torch.arange(40), mean=CIFAR10_MEAN, std=CIFAR10_STD, scale=255.0,
                           augment="crop_flip")
    one = DeviceLoader(data, 8, 8, seed=1)
    two = [DeviceLoader(data, 4, 8, seed=1, rank=r, world_size=2) for r in range(2)]
    one_rank = [x for x, _ in one]
    two_ranks = list(zip(*[[x for x, _ in loader] for loader in two], strict=True))
    for step, (x, (x0, x1)) in enumerate(zip(one_rank, two_ranks, strict=True)):
        assert torch.equal(x, torch.cat([x0, x1])), step  # same crops and flips, whatever the world size
    plain = DeviceLoader(InMemoryDataset(images, torch.arange(40), mean=CIFAR10_MEAN, std=CIFAR10_STD,
                                         scale=255.0), 8, 8, seed=1)
    assert not all(torch.equal(a, b) for (a, _), (b, _) in zip(one, plain, strict=True))
    sample, _ = data[0]  # the DataLoader path augments per read with the global generator
    assert sample.shape == (3, 6, 5) and sample.dtype == torch.float32


@pytest.mark.parametrize("workers", [0, 2])
def test_augmentation_depends_on_seed_epoch_and_position_only(workers):
    """Random reads give each sample the same draw in any worker, at any world size and after a mid-epoch resume."""
    dataset = helpers_data.AugmentedIndexDataset(50)  # noise from torch's global generator on every read

    def noise_by_sample(loaders, epoch=1) -> dict[int, float]:
        seen = {}
        for loader in loaders:
            loader.set_epoch(epoch)
            for x, _ in loader:
                seen.update({int(i): noise for i, noise in x.tolist()})
        return seen

    one = noise_by_sample([HostLoader(dataset, 16, 16, seed=3, num_workers=0)])
    two = noise_by_sample([HostLoader(dataset, 4, 16, seed=3, rank=r, world_size=2, num_workers=workers)
                           for r in range(2)])  # accumulation 2
    assert one == two and len(one) == 48 and len(set(one.values())) == 48
    assert noise_by_sample([HostLoader(dataset, 16, 16, seed=3, num_workers=0)], epoch=2) != one
    resumed = HostLoader(dataset, 4, 16, seed=3, rank=1, world_size=2, num_workers=workers)
    resumed.set_epoch(1)
    tail = {int(i): noise for x, _ in resumed.skip_first_batches(4) for i, noise in x.tolist()}
    assert len(tail) == 8 and all(one[i] == noise for i, noise in tail.items())  # after optimizer step 2 of 3

    images = torch.randint(0, 256, (40, 3, 6, 5), dtype=torch.uint8, generator=torch.Generator().manual_seed(8))
    cifar_like = InMemoryDataset(images, torch.arange(40), mean=CIFAR10_MEAN, std=CIFAR10_STD, scale=255.0,
                                 augment="crop_flip")  # batch-wise crops: the DataLoader path draws as on the device
    device = [x for x, _ in DeviceLoader(cifar_like, 4, 16, seed=1, rank=1, world_size=2)]
    host = [x for x, _ in HostLoader(cifar_like, 4, 16, seed=1, rank=1, world_size=2, num_workers=workers)]
    assert len(device) == len(host) == 4 and all(torch.equal(a, b) for a, b in zip(device, host, strict=True))


@pytest.mark.parametrize("workers", [0, 1])
def test_no_training_loader_moves_the_global_generator(workers):
    """Dropout masks then match between paths, and a resumed epoch needs no RNG correction."""
    dataset = InMemoryDataset(torch.randint(0, 256, (40, 3, 6, 5), dtype=torch.uint8), torch.arange(40),
                              scale=255.0, augment="crop_flip")  # augmentation draws too: from its own seeds
    for loader in (DeviceLoader(dataset, 8, 32, seed=0), HostLoader(dataset, 8, 32, seed=0, num_workers=workers),
                   HostLoader(helpers_data.IndexDataset(40), 8, 32, seed=0, num_workers=workers)):
        torch.manual_seed(0)
        expected = torch.rand(1)
        torch.manual_seed(0)
        list(loader)
        list(loader.skip_first_batches(2))
        assert torch.equal(torch.rand(1), expected), type(loader).__name__


def test_loader_choice_threshold_and_worker_defaults(tmp_path):
    mnist_like = index_dataset(n=64)
    assert choose_loader("auto", mnist_like, device_loader_max_mb=1) == "device"
    assert choose_loader("auto", Subset(mnist_like, range(10)), device_loader_max_mb=1) == "device"
    assert choose_loader("auto", mnist_like, device_loader_max_mb=0) == "dataloader"  # over the threshold
    assert choose_loader("dataloader", mnist_like, device_loader_max_mb=1) == "dataloader"
    assert choose_loader("device", mnist_like, device_loader_max_mb=0) == "device"  # asked for explicitly
    write_png_classes(tmp_path / "imgs", ["a", "b"], per_class=5)
    folder = build_datasets("imagefolder", str(tmp_path / "imgs"), download=False).train
    assert choose_loader("auto", folder, device_loader_max_mb=4096) == "dataloader"
    with pytest.raises(ConfigError, match="--loader dataloader"):
        choose_loader("device", folder, device_loader_max_mb=4096)
    assert default_num_workers(mnist_like) == 0  # tensors in memory: workers would only copy
    assert default_num_workers(folder) >= 1  # per-sample decoding: worker processes
    loader = build_train_loader(folder, 4, 8)
    assert loader.num_workers >= 1 and loader.persistent_workers
    assert build_eval_loader(mnist_like, 16).num_workers == 0


def test_fast_loader_accepts_tensor_datasets_and_subsets_as_stored():
    x, y = torch.randn(50, 3), torch.arange(50)
    for dataset, expected in [(TensorDataset(x, y), x), (Subset(TensorDataset(x, y), range(10, 50)), x[10:])]:
        loader = DeviceLoader(dataset, 5, 10, seed=2)
        for inputs, labels in loader:
            assert torch.equal(inputs, expected[labels - (10 if len(dataset) == 40 else 0)])
    with pytest.raises(ConfigError, match="fewer than one global batch"):
        DeviceLoader(TensorDataset(x, y), 32, 64, seed=0)


@pytest.mark.parametrize("num, batch, world", [(37, 4, 1), (37, 4, 2), (37, 4, 3), (37, 4, 5), (11, 5, 2), (8, 2, 4)])
def test_eval_shards_cover_every_sample_once_in_equal_batch_counts(num, batch, world):
    images, labels = torch.randint(0, 256, (num, 1, 4, 4), dtype=torch.uint8), torch.arange(num)
    data = InMemoryDataset(images, labels, scale=255.0, mean=(0.5,), std=(0.25,))
    seen, counts = [], set()
    for rank in range(world):
        shard = DeviceEvalLoader(data, batch, rank=rank, world_size=world)
        batches = list(shard)
        counts.add(len(batches))
        assert len(batches) == len(shard) and all(1 <= len(y) <= batch for _, y in batches)
        for inputs, y in batches:
            assert torch.allclose(inputs, (images[y].float() / 255.0 - 0.5) / 0.25)
            seen += y.tolist()
    assert sorted(seen) == list(range(num))  # each sample on exactly one rank, none repeated to pad
    assert len(counts) == 1  # the same number of forwards on every rank (DDP and FSDP communicate in them)


def test_eval_sets_too_small_to_shard_go_through_a_dataloader():
    data = TensorDataset(torch.randn(3, 2), torch.arange(3))
    assert not DeviceEvalLoader.can_shard(3, 4, world_size=2) and not DeviceEvalLoader.can_shard(40, 1, 2)
    with pytest.raises(ConfigError, match="evaluate through a DataLoader"):
        DeviceEvalLoader(data, 4, rank=0, world_size=2)


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
    batch, labels = next(iter(build_train_loader(bundle.train, 4, 8, num_workers=0)))
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

    def run():
        import time

        import torchvision.datasets
        from accelerate import Accelerator

        from accel_ddp.data.resolve import resolve_data

        def fake_download(root, train, download):  # slow enough that a second downloader would overlap it
            with open(calls, "a", encoding="utf-8") as fh:
                fh.write(os.environ["RANK"] + "\n")
            time.sleep(1.0)
            write_mnist(Path(root))

        os.environ.update({"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "GROUP_RANK": os.environ["RANK"],
                           "GROUP_WORLD_SIZE": "2"})  # each rank the first process of its own machine
        torchvision.datasets.MNIST = fake_download
        accelerator = Accelerator(cpu=True)
        assert accelerator.is_local_main_process
        cfg = parse_args(["--dataset", "mnist", "--data_dir", str(tmp_path / "data"), "--download"])
        return len(resolve_data(cfg, accelerator, None, None).train)

    assert run_ranks(run) == [64, 64]
    assert calls.read_text().split() == ["0"]


def test_hf_hub_name_offline_says_how_to_get_it(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    script = ("from accel_ddp.data import build_datasets, HFSource\n"
              "build_datasets('hf', 'data', False, hf=HFSource(name='someone/not-cached-anywhere'))\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert result.returncode != 0
    assert "ConfigError" in result.stderr and "network access" in result.stderr and "save_to_disk" in result.stderr


def test_cli_reports_missing_mnist_in_one_line_with_exit_code_2(tmp_path, capfd):
    args = ["--dataset", "mnist", "--data_dir", str(tmp_path), "--output_dir", str(tmp_path / "o")]
    assert main_ranks(args, world_size=1) == [2]
    lines = [line for line in capfd.readouterr().err.splitlines() if line.startswith("accel_ddp: error:")]
    assert len(lines) == 1 and "--download" in lines[0] and str(tmp_path) in lines[0]


# ----------------------------------------------------------------------------- real processes

def loop_with_both_loaders(global_batch: int, per_device: int) -> dict:
    """A hand-written Accelerate loop over both loaders (what a user of build_loaders writes); what each served."""
    from accelerate import Accelerator, DataLoaderConfiguration, PartialState
    from accelerate.utils import set_seed
    from sklearn.datasets import load_digits

    from accel_ddp.data import build_loaders, skip_first_batches
    from accel_ddp.evaluate import evaluate

    world = PartialState(cpu=True).num_processes
    accumulation = global_batch // (world * per_device)
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=accumulation,
                              dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=7))
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    x = torch.cat([x, torch.arange(len(x), dtype=torch.float32)[:, None]], 1)  # column 64: the sample's index
    y = torch.tensor(digits.target)
    train_ds, eval_ds = TensorDataset(x[:1400], y[:1400]), TensorDataset(x[1400:], y[1400:])  # 397: odd

    class Net(torch.nn.Module):  # ignores the index column
        def __init__(self):
            super().__init__()
            self.body = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Dropout(0.3),
                                            torch.nn.Linear(32, 10))

        def forward(self, x):
            return self.body(x[:, :64])

    results = {}
    for kind in ("dataloader", "device"):
        set_seed(0)
        model = Net()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        loaders = build_loaders(accelerator, train_ds, eval_ds, per_device_batch_size=per_device,
                                global_batch_size=global_batch, loader=kind)
        model, optimizer = accelerator.prepare(model, optimizer)
        seen, syncs, evals = [], [], []
        for epoch in range(2):
            loaders.train.set_epoch(epoch)
            for micro_step, (inputs, labels) in enumerate(loaders.train):
                with accelerator.accumulate(model):
                    loss = F.cross_entropy(model(inputs), labels)
                    accelerator.backward(loss)
                    optimizer.step()
                    optimizer.zero_grad()
                seen.append(inputs[:, 64].long().tolist())
                syncs.append(accelerator.sync_gradients)
                if epoch == 0 and micro_step == 2 * accumulation - 1:  # evaluate mid-epoch, after step 2
                    evals.append(evaluate(accelerator, model, loaders.eval)["eval_samples"])
            evals.append(evaluate(accelerator, model, loaders.eval)["eval_samples"])
        loaders.train.set_epoch(1)
        resumed = [i[:, 64].long().tolist() for i, _ in skip_first_batches(accelerator, loaders.train, accumulation)]
        weights = torch.cat([p.detach().flatten() for p in accelerator.unwrap_model(model).parameters()])
        results[kind] = {"kind": loaders.kind, "seen": seen, "syncs": syncs, "evals": evals, "resumed": resumed,
                         "weights": weights.tolist(), "micro_steps": len(loaders.train),
                         "accumulation": accumulation}
    accelerator.end_training()
    return results


def run_loop(world: int, global_batch: int, per_device: int) -> list[dict]:
    return run_ranks(lambda: loop_with_both_loaders(global_batch, per_device), world_size=world)


def test_both_loaders_train_identically_under_two_processes():
    """Same samples per micro-step, sync only on optimizer steps, exact eval counts, bit-identical weights."""
    two = run_loop(world=2, global_batch=32, per_device=8)  # accumulation 2
    one = run_loop(world=1, global_batch=32, per_device=16)  # accumulation 2
    for ranks in (one, two):
        for rank in ranks:
            fast, classic = rank["device"], rank["dataloader"]
            assert (fast["kind"], classic["kind"]) == ("device", "dataloader")
            assert fast["seen"] == classic["seen"]
            a = fast["accumulation"]
            assert fast["resumed"] == classic["resumed"] == fast["seen"][fast["micro_steps"] + a:]
            for run in (fast, classic):
                assert run["syncs"] == [(i + 1) % a == 0 for i in range(len(run["syncs"]))]
                assert run["evals"] == [397, 397, 397]
            assert fast["weights"] == classic["weights"]  # dropout included: the RNG streams match too
    for kind in ("device", "dataloader"):  # each optimizer step holds the same samples for 1 and 2 processes
        a = 2  # both layouts accumulate 2 micro-steps
        per_step_two = [sorted(two[0][kind]["seen"][i] + two[0][kind]["seen"][i + 1] + two[1][kind]["seen"][i]
                               + two[1][kind]["seen"][i + 1]) for i in range(0, len(two[0][kind]["seen"]), a)]
        per_step_one = [sorted(one[0][kind]["seen"][i] + one[0][kind]["seen"][i + 1])
                        for i in range(0, len(one[0][kind]["seen"]), a)]
        assert per_step_two == per_step_one
        epoch0 = [i for step in per_step_one[:len(per_step_one) // 2] for i in step]
        assert len(epoch0) == len(set(epoch0)) == 1376  # 1400 // 32 steps of 32 samples, each once


def test_own_model_and_dataset_through_import_strings_under_two_processes(tmp_path):
    out = tmp_path / "run"
    train_ranks(["--dataset", "examples.custom_model_and_data:build_dataset",
                 "--model", "examples.custom_model_and_data:build_model",
                 "--epochs", "3", "--global_batch_size", "64", "--output_dir", str(out)])
    summary = read_summary(out)
    assert summary["world_size"] == 2 and summary["eval_samples"] == 600
    assert summary["eval_accuracy"] > 0.9
    assert any(k.startswith("blocks.") for k in load_weights(out))  # the example's own ResidualMLP


def test_own_model_and_dataset_through_the_python_api_under_two_processes(tmp_path, capfd, monkeypatch):
    from examples import custom_model_and_data as example

    out = tmp_path / "api"
    monkeypatch.setattr(sys, "argv", ["custom_model_and_data.py", "--output_dir", str(out), "--epochs", "3"])
    run_ranks(example.main)
    summary = read_summary(out)
    assert summary["world_size"] == 2 and summary["eval_samples"] == 600 and summary["eval_accuracy"] > 0.9
    assert capfd.readouterr().out.count("eval accuracy") == 1  # printed by the main process only


@wired
def test_device_and_dataloader_paths_end_with_the_same_weights(tmp_path):
    common = ["--dataset", "digits", "--model", "mnist_cnn", "--epochs", "1", "--global_batch_size", "64",
              "--per_device_batch_size", "16", "--optimizer", "sgd", "--lr", "0.05"]
    for kind in ("device", "dataloader"):
        train_ranks([*common, "--loader", kind, "--output_dir", str(tmp_path / kind)])
    device, classic = load_weights(tmp_path / "device"), load_weights(tmp_path / "dataloader")
    assert all(torch.equal(device[k], classic[k]) for k in classic)  # mnist_cnn has dropout: RNG streams match
    for kind in ("device", "dataloader"):
        summary = read_summary(tmp_path / kind)
        assert summary["eval_samples"] == 360 and summary["grad_accum_steps"] == 2
        assert summary.get("loader", kind) == kind


@wired
def test_cifar10_files_on_the_device_loader_with_resnet18(tmp_path):
    write_cifar(tmp_path / "data", per_batch=16)
    out = tmp_path / "run"
    train_ranks(["--dataset", "cifar10", "--data_dir", str(tmp_path / "data"), "--model", "resnet18",
                 "--width", "4", "--epochs", "2", "--global_batch_size", "16", "--loader", "device",
                 "--output_dir", str(out)])
    summary = read_summary(out)
    assert summary["optimizer_steps"] == 10 and summary["eval_samples"] == 16
    assert load_weights(out)["conv1.weight"].shape == (4, 3, 3, 3)


@wired
def test_device_loader_resumes_mid_epoch_to_the_same_weights(tmp_path):
    """A rank fails in epoch 1; the resumed run skips what the checkpoint holds and ends where the whole run ends."""
    common = ["--dataset", "digits", "--model", "mnist_cnn", "--epochs", "2", "--global_batch_size", "64",
              "--per_device_batch_size", "16", "--loader", "device", "--checkpointing_steps", "5"]
    train_ranks([*common, "--output_dir", str(tmp_path / "whole")])

    def fail_at_step_27_on_rank_1():
        faults.install(fail_at=(27, 1))
        return train(parse_args([*common, "--output_dir", str(tmp_path / "resumed")]))

    with pytest.raises(RankFailed, match="injected failure on rank 1 at step 27"):
        run_ranks(fail_at_step_27_on_rank_1, grace=1)  # 22 steps per epoch: it died in epoch 1, after step 25's save
    train_ranks([*common, "--output_dir", str(tmp_path / "resumed"), "--resume_from_checkpoint", "auto"])
    summary = read_summary(tmp_path / "resumed")
    assert summary["resumed_from_step"] == 25 and summary["optimizer_steps"] == 44
    whole, resumed = load_weights(tmp_path / "whole"), load_weights(tmp_path / "resumed")
    assert all(torch.equal(whole[k], resumed[k]) for k in whole)


def test_dataloader_workers_with_random_reads_resume_mid_epoch_to_the_same_weights(tmp_path):
    """Augmentation drawn in DataLoader workers: a rank fails mid-epoch, the resumed run ends bit-identical
    (that the worker count changes no draw: test_augmentation_depends_on_seed_epoch_and_position_only)."""
    common = ["--dataset", "tests.helpers.data:noisy_digits", "--model", "mnist_cnn", "--max_steps", "12",
              "--global_batch_size", "64", "--per_device_batch_size", "16", "--loader", "dataloader",
              "--checkpointing_steps", "5"]
    train_ranks([*common, "--num_workers", "1", "--output_dir", str(tmp_path / "whole")])

    def fail_at_step_8_on_rank_1():
        faults.install(fail_at=(8, 1))
        return train(parse_args([*common, "--num_workers", "1", "--output_dir", str(tmp_path / "resumed")]))

    with pytest.raises(RankFailed, match="injected failure on rank 1 at step 8"):
        run_ranks(fail_at_step_8_on_rank_1, grace=1)
    summaries = train_ranks([*common, "--num_workers", "1", "--output_dir", str(tmp_path / "resumed"),
                             "--resume_from_checkpoint", "auto"])
    assert summaries[0]["resumed_from_step"] == 5 and summaries[0]["loader"] == "dataloader"
    assert summaries[0]["data_source"] == "map_style"
    whole, resumed = load_weights(tmp_path / "whole"), load_weights(tmp_path / "resumed")
    assert all(torch.equal(whole[k], resumed[k]) for k in whole)


def test_resume_on_another_world_size_continues_with_the_same_global_batches(tmp_path):
    """Saved by 2 ranks mid-epoch, resumed by 1: every later optimizer step trains on the same samples."""
    from accel_ddp.config import TrainConfig

    def served(world: int, out: str, fail: bool = False, resume: bool = False) -> list[list[int]]:
        def run() -> list[list[int]]:
            if fail:
                faults.install(fail_at=(17, 0))
            model = helpers_data.IndexRecorder()
            cfg = TrainConfig(global_batch_size=8, per_device_batch_size=8 // world, epochs=3, seed=3,
                              optimizer="sgd", lr=0.1, checkpointing_steps="5", output_dir=str(tmp_path / out),
                              resume_from_checkpoint="auto" if resume else None)
            train(cfg, model=model, train_dataset=helpers_data.IndexDataset(100))
            return model.seen

        per_rank = run_ranks(run, world_size=world, grace=1)
        return [sorted(i for rank in per_rank for i in rank[step]) for step in range(len(per_rank[0]))]

    whole = served(2, "whole")  # 12 steps per epoch, 36 in all
    with pytest.raises(RankFailed, match="injected failure on rank 0 at step 17"):
        served(2, "moved", fail=True)  # the newest checkpoint: step 15, in epoch 1
    resumed = served(1, "moved", resume=True)
    assert len(whole) == 36 and resumed == whole[15:]
    assert read_summary(tmp_path / "moved")["world_size"] == 1


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


@pytest.fixture
def quick_orphan_workers(monkeypatch):
    """A DataLoader worker notices its rank died every 5 s (torch's MP_STATUS_CHECK_INTERVAL); until it exits
    it holds the dead rank's gloo sockets, which it inherited, so the other rank's collective fails only then.
    Forked ranks and their workers inherit this 0.2 s: a failed rank's peer stops within a second, not after 5."""
    import torch.utils.data._utils.worker

    monkeypatch.setattr(torch.utils.data._utils.worker, "MP_STATUS_CHECK_INTERVAL", 0.2)


@pytest.mark.parametrize("kind", ["parquet", "arrow"])
def test_a_damaged_data_file_is_named_before_training_and_checkpoints_stay(tmp_path, capfd, kind):
    import datasets

    folder = tmp_path / "d"
    if kind == "parquet":
        folder.mkdir()
        hf_image_dataset(40, 0).to_parquet(str(folder / "train.parquet"))
        hf_image_dataset(12, 1).to_parquet(str(folder / "test.parquet"))
        damaged = folder / "train.parquet"
    else:
        datasets.DatasetDict(train=hf_image_dataset(40, 0), test=hf_image_dataset(12, 1)).save_to_disk(folder)
        damaged = next((folder / "train").glob("*.arrow"))
    out = tmp_path / "run"
    args = ["--dataset", "hf", "--data_dir", str(folder), "--global_batch_size", "8", "--epochs", "1",
            "--checkpointing_steps", "2", "--output_dir", str(out)]
    assert main_ranks(args, world_size=1) == [0]
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    damaged.write_bytes(damaged.read_bytes()[: damaged.stat().st_size // 2])  # cut in half
    capfd.readouterr()
    assert main_ranks([*args, "--resume_from_checkpoint", "auto"]) == [2, 2]
    errors = [line for line in capfd.readouterr().err.splitlines() if line.startswith("accel_ddp: error:")]
    assert len(errors) == 1 and str(damaged) in errors[0] and "re-create or re-download it" in errors[0]
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before


def test_memory_mapped_run_trains_the_weights_of_the_in_memory_run(tmp_path):
    """The same parquet files, over the size threshold: memory-mapped, they train the same weights bit for bit."""
    folder = tmp_path / "d"
    folder.mkdir()
    hf_image_dataset(96, 0, size=8, mode="RGB").to_parquet(str(folder / "train.parquet"))
    hf_image_dataset(20, 1, size=8, mode="RGB").to_parquet(str(folder / "test.parquet"))
    common = ["--dataset", "hf", "--data_dir", str(folder), "--model", "mnist_cnn", "--epochs", "2",
              "--global_batch_size", "16", "--optimizer", "sgd", "--lr", "0.05"]
    mapped = train_ranks([*common, "--device_loader_max_mb", "0", "--output_dir", str(tmp_path / "mapped")])[0]
    in_memory = train_ranks([*common, "--output_dir", str(tmp_path / "memory")])[0]
    assert (mapped["loader"], mapped["data_source"]) == ("dataloader", "memory_mapped")
    assert (in_memory["loader"], in_memory["data_source"]) == ("device", "in_memory")
    assert mapped["eval_samples"] == in_memory["eval_samples"] == 20
    epochs = [r for r in read_metrics(tmp_path / "mapped") if "peak_rss_mb" in r]
    assert len(epochs) == 2 and set(epochs[-1]["peak_rss_mb"]) == {"rank0", "rank1"}  # every rank, every epoch
    assert mapped["peak_rss_mb"] >= max(epochs[-1]["peak_rss_mb"].values()) > 100  # a peak; torch alone takes more
    assert mapped["peak_worker_rss_mb"] > 0 and in_memory["peak_worker_rss_mb"] == 0  # no workers in memory
    ours, theirs = load_weights(tmp_path / "mapped"), load_weights(tmp_path / "memory")
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)


# ----------------------------------------------------------------------------- streaming


def _decode_idx(columns, where):
    return [(torch.tensor([float(i)]), 0) for i in columns["idx"]]


def _stream(files: list[str], world: int, *, max_steps: int, workers: int = 1, buffer: int = 0,
            per_device: int = 2, stop_after: int | None = None, save_to: Path | None = None,
            resume_from: Path | None = None) -> list[list[tuple[int, list[int]]]]:
    """Each rank's (pass, example ids) per micro-batch from a StreamingLoader (accumulation 1)."""
    def run():
        import datasets
        from accelerate import PartialState

        from accel_ddp.data.streaming import StreamingLoader, StreamSource

        state = PartialState(cpu=True)
        stream = datasets.load_dataset("parquet", data_files=files, split="train", streaming=True)
        loader = StreamingLoader(StreamSource(stream, _decode_idx, buffer), per_device, per_device * world,
                                 max_steps=max_steps, seed=0, rank=state.process_index, world_size=world,
                                 num_workers=workers)
        batches = loader
        if resume_from is not None:
            loader._load_hook([], str(resume_from))
            batches = loader.skip_first_batches(int(resume_from.name))
        seen = []
        for x, _ in batches:
            seen.append((loader.data_epoch, x[:, 0].long().tolist()))
            if len(seen) == stop_after:
                loader._save_hook([], [], str(save_to))
                break
        return seen

    return run_ranks(run, world_size=world)


def _passes(ranks: list[list[tuple[int, list[int]]]]) -> dict[int, list[int]]:
    """Example ids per pass, over all ranks."""
    out: dict[int, list[int]] = {}
    for rank in ranks:
        for data_epoch, ids in rank:
            out.setdefault(data_epoch, []).extend(ids)
    return out


@pytest.mark.parametrize("sizes,buffer", [([7, 11, 20], 0), ([5, 30, 5, 6], 0), ([5, 30, 5, 6], 8)])
def test_streaming_ranks_take_the_same_steps_over_uneven_shares(tmp_path, quick_stream_ends, sizes, buffer):
    """3 files over 2 ranks (every rank reads all, keeps every 2nd example) or 4 files of very different sizes:
    every rank yields a batch at every step, each example at most once per pass; the shortest share ends the pass."""
    files = write_shards(tmp_path / "s", sizes)
    ranks = _stream(files, 2, max_steps=12, buffer=buffer, workers=0)  # read in each rank's process: no forks
    assert [len(rank) for rank in ranks] == [12, 12]
    assert [[e for e, _ in rank] for rank in ranks][0] == [[e for e, _ in rank] for rank in ranks][1]  # in step
    passes = _passes(ranks)
    assert len(passes) >= 2
    for ids in passes.values():
        assert len(ids) == len(set(ids)) and set(ids) <= set(range(sum(sizes)))
    if buffer:  # a new shuffle each pass (without a buffer only the file order may change)
        assert passes[0] != passes[1][:len(passes[0])]
    if sizes == [5, 30, 5, 6] and buffer == 0:  # rank 0 reads files 0 and 2 (10 rows): the pass ends after 5 steps
        rank0 = sorted(i for data_epoch, ids in ranks[0] if data_epoch == 0 for i in ids)
        assert len(passes[0]) == 5 * 4 and rank0 == [*range(5), *range(35, 40)]


@pytest.mark.parametrize("workers,buffer", [(1, 0), (2, 0), (2, 16)])
def test_streaming_resumes_from_each_ranks_saved_position(tmp_path, quick_stream_ends, workers, buffer):
    """Saved after 7 steps and resumed: nothing trained before comes again in that pass; without a shuffle buffer
    the resumed stream is the uninterrupted one (with 2 workers the 8th batch is the second worker's: the
    DataLoader's turns continue where they stopped)."""
    files = write_shards(tmp_path / "s", [40, 40, 40, 40])
    whole = _stream(files, 2, max_steps=12, workers=workers, buffer=buffer)
    saved = tmp_path / "7"
    saved.mkdir()
    first = _stream(files, 2, max_steps=12, workers=workers, buffer=buffer, stop_after=7, save_to=saved)
    assert sorted(p.name for p in saved.iterdir()) == ["data_state_rank0.json", "data_state_rank1.json"]
    rest = _stream(files, 2, max_steps=12, workers=workers, buffer=buffer, resume_from=saved)
    assert [len(rank) for rank in rest] == [5, 5]
    if buffer == 0:
        assert [a + b for a, b in zip(first, rest, strict=True)] == whole
    before, after = _passes(first)[0], _passes(rest)[0]
    assert not set(before) & set(after) and len(set(after)) == len(after)


def _batch_and_worker_seed(samples):  # a collate_fn that tells which seed the process collating it has
    return torch.utils.data.default_collate(samples), torch.initial_seed()


@pytest.mark.parametrize("workers", [0, 1])
def test_the_streaming_loader_leaves_the_global_generator_alone(tmp_path, quick_stream_ends, workers):
    """The DataLoader of each pass draws its workers' base seed from a generator seeded by (seed, pass), not from
    torch's global one: dropout after a resume continues where the checkpoint's RNG state left it."""
    import datasets

    from accel_ddp.data.streaming import StreamingLoader, StreamSource

    files = write_shards(tmp_path / "s", [6])  # 3 steps of 2 per pass

    def worker_seeds(global_seed: int) -> list[tuple[int, int]]:
        stream = datasets.load_dataset("parquet", data_files=files, split="train", streaming=True)
        loader = StreamingLoader(StreamSource(stream, _decode_idx, 0), 2, 2, max_steps=7, seed=5,
                                 num_workers=workers, collate_fn=_batch_and_worker_seed)
        torch.manual_seed(global_seed)
        expected = torch.rand(1)
        torch.manual_seed(global_seed)
        seen = [(loader.data_epoch, seed) for _, seed in loader]
        assert len(seen) == 7 and torch.equal(torch.rand(1), expected)
        return seen

    seeds = worker_seeds(0)
    if workers:  # the workers' seeds: one per pass, whatever the global generator holds
        assert seeds == worker_seeds(1) and len({seed for _, seed in seeds}) == 3


def test_a_streaming_checkpoint_counts_the_step_it_was_saved_after(tmp_path, quick_stream_ends):
    """Saved after a pass's only step: the position holds that step, so the resumed run starts the next pass
    instead of calling the pass too short for one optimizer step."""
    files = write_shards(tmp_path / "s", [3])  # one step of 2 per pass (the odd example is dropped)
    saved = tmp_path / "1"
    saved.mkdir()
    _stream(files, 1, max_steps=4, workers=0, stop_after=1, save_to=saved)
    assert json.loads((saved / "data_state_rank0.json").read_text())["steps_in_pass"] == 1
    [rest] = _stream(files, 1, max_steps=4, workers=0, resume_from=saved)
    assert rest == [(1, [0, 1]), (2, [0, 1]), (3, [0, 1])]


def test_streaming_cli_run_on_uneven_files_resumes_and_counts_eval_exactly(tmp_path, quick_stream_ends,
                                                                          quick_orphan_workers):
    """3 files of different sizes over 2 ranks: no hang, the same steps on both; a failed run resumes from its
    checkpoint's stream positions; the eval split (odd-sized) is counted exactly."""
    data = image_shards(tmp_path / "d", [50, 90, 30], n_test=13)
    common = ["--dataset", "hf", "--data_dir", str(data), "--streaming", "--max_steps", "30", "--global_batch_size",
              "8", "--shuffle_buffer", "16", "--num_workers", "1", "--checkpointing_steps", "5", "--eval_every", "10"]

    def fail_at_step_12_on_rank_0():
        faults.install(fail_at=(12, 0))
        return train(parse_args([*common, "--output_dir", str(tmp_path / "run")]))

    with pytest.raises(RankFailed, match="injected failure on rank 0 at step 12"):
        run_ranks(fail_at_step_12_on_rank_0, grace=5)
    saved = tmp_path / "run" / "checkpoints" / "step_00000010"
    assert {"data_state_rank0.json", "data_state_rank1.json"} <= {p.name for p in saved.iterdir()}
    summaries = train_ranks([*common, "--output_dir", str(tmp_path / "run"), "--resume_from_checkpoint", "auto"])
    for summary in summaries:
        assert (summary["loader"], summary["data_source"]) == ("streaming", "streaming")
        assert summary["optimizer_steps"] == 30 and summary["resumed_from_step"] == 10
        assert summary["eval_samples"] == 13
    evals = [r for r in read_metrics(tmp_path / "run") if "eval_samples" in r]
    assert [r["step"] for r in evals] == [10, 20, 30]


def test_a_streaming_run_given_more_steps_continues_where_it_stopped(tmp_path, quick_stream_ends):
    """A finished streaming run relaunched with a higher --max_steps continues from its checkpoint (a stream's
    "epoch" is the whole run, so its steps_per_epoch grows with --max_steps; not a reason to refuse). Without a
    shuffle buffer and with the ranks reading in their own process, it ends with the weights of a run given the
    whole length at once (docs/large-datasets.md: the resumed order is the uninterrupted one)."""
    data = image_shards(tmp_path / "d", [40, 40], n_test=4)  # one file per rank: 10 steps per pass
    common = ["--dataset", "hf", "--data_dir", str(data), "--streaming", "--global_batch_size", "8",
              "--shuffle_buffer", "0", "--num_workers", "0", "--lr_schedule", "constant", "--hidden_size", "16"]
    longer = [*common, "--max_steps", "14", "--output_dir"]
    train_ranks([*common, "--max_steps", "7", "--checkpointing_steps", "7", "--output_dir", str(tmp_path / "run")])
    summaries = train_ranks([*longer, str(tmp_path / "run"), "--resume_from_checkpoint", "auto"])
    assert [(s["resumed_from_step"], s["optimizer_steps"]) for s in summaries] == [(7, 14), (7, 14)]
    train_ranks([*longer, str(tmp_path / "whole")])
    ours, whole = load_weights(tmp_path / "run"), load_weights(tmp_path / "whole")
    assert all(torch.equal(ours[k], whole[k]) for k in whole)


def test_a_stream_that_fails_on_one_rank_stops_every_rank_with_one_line(tmp_path, capfd):
    """Rank 1's second file is cut short: both ranks stop at the same step, exit 2, one line names the file."""
    data = image_shards(tmp_path / "d", [600, 600, 40, 40], n_test=8)  # 1024 start-up rows come from files 0-1
    damaged = data / "train-00003-of-00004.parquet"  # rank 1 reads files 1 and 3
    damaged.write_bytes(damaged.read_bytes()[:200])
    args = ["--dataset", "hf", "--data_dir", str(data), "--streaming", "--max_steps", "200", "--global_batch_size",
            "8", "--shuffle_buffer", "0", "--num_workers", "1", "--output_dir", str(tmp_path / "run")]
    assert main_ranks(args) == [2, 2]
    text = capfd.readouterr().err
    errors = ["accel_ddp: error:" + part.splitlines()[0] for part in text.split("accel_ddp: error:")[1:]]
    assert len(errors) == 1 and str(damaged) in errors[0] and "met by rank 1" in errors[0]


def _collate_with_a_bug(samples):  # a user's collate_fn; forked ranks and their workers inherit RANK
    if os.environ.get("RANK") == "1" and any(int(x) == 24 for x, _ in samples):  # rank 1's third micro-batch
        raise TypeError("_collate_with_a_bug cannot batch these samples")
    return torch.utils.data.default_collate(samples)


@pytest.mark.parametrize("workers", [0, 1])
def test_a_bug_in_a_collate_fn_while_streaming_is_raised_with_its_traceback_and_stops_every_rank(
        tmp_path, quick_stream_ends, workers):
    """Not bad data: rank 1 raises the TypeError itself, traceback and all; rank 0 stops at the same step and
    names rank 1. Neither says "check the source"."""
    files = write_shards(tmp_path / "s", [20, 20, 20, 20])  # rank 1 reads files 1 and 3: examples 20.. first

    def run():
        import traceback

        import datasets
        from accelerate import PartialState

        from accel_ddp.data.streaming import StreamingLoader, StreamSource

        state = PartialState(cpu=True)
        stream = datasets.load_dataset("parquet", data_files=files, split="train", streaming=True)
        loader = StreamingLoader(StreamSource(stream, _decode_idx, 0), 2, 4, max_steps=10, seed=0,
                                 rank=state.process_index, world_size=2, num_workers=workers,
                                 collate_fn=_collate_with_a_bug)
        trained = 0
        try:
            for _ in loader:
                trained += 1
        except Exception as err:  # noqa: BLE001 - what each rank raised goes back to the test
            return trained, type(err).__name__, str(err), traceback.format_exc()
        return trained, None, None, None

    (steps0, kind0, text0, _), (steps1, kind1, text1, trace1) = run_ranks(run, grace=5)
    assert (steps0, steps1) == (2, 2)  # both stopped before the step rank 1 could not batch
    assert kind1 == "TypeError" and "_collate_with_a_bug" in trace1 and "cannot batch these samples" in text1
    assert kind0 == "PeerFailed" and "rank 1" in text0 and "TypeError" in text0  # a RuntimeError: never first
    assert "check the source" not in text0 + text1


@pytest.mark.parametrize("args,expected", [
    (["--streaming", "--max_steps", "5"], "add --dataset hf"),
    (["--dataset", "hf", "--streaming"], "set --max_steps"),
    (["--dataset", "hf", "--streaming", "--max_steps", "5", "--loader", "device"], "drop --loader"),
    (["--dataset", "hf", "--streaming", "--max_steps", "5", "--task", "causal_lm"], "drop --streaming"),
    (["--shuffle_buffer", "-1"], "--shuffle_buffer must be >= 0"),
])
def test_streaming_options_that_cannot_work_are_one_clear_error(args, expected):
    with pytest.raises(ConfigError, match=expected):
        parse_args(args)


def _noisy_rows(batch):  # a datasets transform drawing random numbers, as augmentation pipelines do
    return {"x": [torch.tensor([float(i), float(torch.rand(()))]) for i in batch["i"]], "label": batch["label"]}


@pytest.mark.parametrize("workers", [0, 1])
def test_a_datasets_dataset_with_a_random_transform_reads_memory_mapped_and_seeded(tmp_path, workers):
    """A user's datasets.Dataset (dict rows, set_transform) goes through the DataLoader path memory-mapped, read a
    batch at a time with the generators seeded from the batch's position: the same draws with or without workers."""
    import datasets

    datasets.Dataset.from_dict({"i": list(range(40)), "label": [i % 2 for i in range(40)]}).save_to_disk(tmp_path / "d")
    table = datasets.load_from_disk(str(tmp_path / "d"))
    table.set_transform(_noisy_rows)
    assert data_source(table) == "memory_mapped"

    def draws(num_workers: int) -> dict[int, float]:
        loader = HostLoader(table, 4, 8, seed=2, num_workers=num_workers)
        return {int(i): noise for batch in loader for i, noise in batch["x"].tolist()}

    seen = draws(workers)
    assert len(seen) == 40 and seen == draws(0)


def test_streaming_resumed_on_another_world_size_restarts_the_pass_with_a_warning(tmp_path, quick_stream_ends,
                                                                                 capfd):
    """Reader positions belong to a world size: on another one the pass starts over (said once), nothing is lost."""
    files = write_shards(tmp_path / "s", [20, 20, 20, 20])
    saved = tmp_path / "3"
    saved.mkdir()
    _stream(files, 2, max_steps=12, workers=0, stop_after=3, save_to=saved)  # the 1-rank run reads rank 0's
    capfd.readouterr()
    [rest] = _stream(files, 1, max_steps=12, workers=0, per_device=4, resume_from=saved)
    assert capfd.readouterr().err.count("starts over") == 1
    first_pass = [i for data_epoch, ids in rest if data_epoch == 0 for i in ids]
    assert sorted(first_pass) == list(range(80))[:len(first_pass)] and len(first_pass) == 36  # 9 steps of 4


def test_streaming_resumed_on_more_ranks_puts_every_rank_in_the_saved_pass(tmp_path, quick_stream_ends, capfd):
    """Saved by 2 ranks in their second pass, resumed by 3: every rank, the new one too (it has no saved position),
    restarts that same pass (one shuffle, each example at most once), said once; nobody waits on another."""
    files = write_shards(tmp_path / "s", [20, 20, 20, 20])  # 2 ranks: 2 files each, 20 steps of 2 per pass
    saved = tmp_path / "23"
    saved.mkdir()
    first = _stream(files, 2, max_steps=30, buffer=8, workers=0, stop_after=23, save_to=saved)
    assert {data_epoch for rank in first for data_epoch, _ in rank[20:]} == {1}
    capfd.readouterr()
    rest = _stream(files, 3, max_steps=30, buffer=8, workers=0, resume_from=saved)
    assert [[data_epoch for data_epoch, _ in rank] for rank in rest] == [[1] * 7] * 3
    assert capfd.readouterr().err.count("starts over") == 1
    ids = _passes(rest)[1]
    assert len(ids) == 42 and len(set(ids)) == 42


def test_packed_text_trains_memory_mapped_with_workers_and_the_same_weights_without(tmp_path, monkeypatch):
    """Tokenized, packed text (the text tasks' datasets.Dataset in the datasets cache) takes the memory-mapped
    path; DataLoader workers change nothing, dropout included."""
    pytest.importorskip("transformers")
    import datasets

    from tests.helpers.text import build_word_tokenizer, lm_args

    texts = tmp_path / "corpus" / "texts"
    texts.mkdir(parents=True)
    words = ["the", "food", "was", "good", "bad", "very", "service", "slow"]
    rng = np.random.default_rng(0)
    lines = {split: [" ".join(rng.choice(words, 8)) for _ in range(n)] for split, n in (("train", 160), ("test", 21))}
    for split, rows in lines.items():
        (texts / f"{split}.json").write_text("".join(f'{{"text": "{text}"}}\n' for text in rows))
    build_word_tokenizer(lines["train"], tmp_path / "corpus" / "tokenizer")
    (tmp_path / "corpus" / "gpt2.json").write_text('{"model_type": "gpt2", "n_layer": 1, "n_head": 2, "n_embd": 16, '
                                                   '"n_positions": 64, "vocab_size": 8}')
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))
    runs = {}
    for workers in ("0", "1"):
        out = tmp_path / f"w{workers}"
        runs[workers] = train_ranks(lm_args(tmp_path / "corpus", out, "--packing", "--max_steps", "6",
                                            "--num_workers", workers))[0]
    assert (runs["1"]["loader"], runs["1"]["data_source"]) == ("dataloader", "memory_mapped")
    with_workers, without = load_weights(tmp_path / "w1"), load_weights(tmp_path / "w0")
    assert all(torch.equal(with_workers[k], without[k]) for k in without)


# ----------------------------------------------------------------------------- a user's collate_fn on every path


def doubling_collate(samples):
    """A user's collate_fn: inputs doubled; one line per call (the batch size) in a file per rank."""
    with open(f"{os.environ['COLLATE_LOG']}.{os.environ.get('RANK', '0')}", "a") as log:
        log.write(f"{len(samples)}\n")
    inputs, labels = torch.utils.data.default_collate(samples)
    return inputs * 2, labels


def _collate_run(out: Path, loader: str, collate_fn=None, scale: float = 1.0) -> dict:
    generator = torch.Generator().manual_seed(0)
    x, eval_x = torch.randn(64, 6, generator=generator), torch.randn(37, 6, generator=generator)
    y, eval_y = (x[:, 0] > 0).long(), (eval_x[:, 0] > 0).long()
    config = TrainConfig(model="mlp", hidden_size=8, global_batch_size=16, epochs=2, loader=loader,
                         optimizer="sgd", lr=0.1, output_dir=str(out))
    return train(config, train_dataset=TensorDataset(x * scale, y), eval_dataset=TensorDataset(eval_x * scale, eval_y),
                 collate_fn=collate_fn)


def test_a_collate_fn_on_an_in_memory_set_makes_every_training_and_eval_batch(tmp_path, capfd, monkeypatch):
    """--loader auto would take the device loader, which never calls a collate_fn: the run goes through a
    DataLoader instead (one note), and trains and evaluates exactly like the same data doubled beforehand."""
    monkeypatch.setenv("COLLATE_LOG", str(tmp_path / "calls"))
    collated = run_ranks(lambda: _collate_run(tmp_path / "collated", "auto", doubling_collate))
    reference = run_ranks(lambda: _collate_run(tmp_path / "doubled", "dataloader", scale=2.0))
    plain = run_ranks(lambda: _collate_run(tmp_path / "plain", "auto"))[0]
    assert collated[0]["loader"] == "dataloader" and plain["loader"] == "device"
    notes = [line for line in capfd.readouterr().err.splitlines() if "accel_ddp: note:" in line]
    assert notes == ["accel_ddp: note: the collate_fn tests.test_data:doubling_collate makes the batches, so this "
                     "in-memory training set goes through a DataLoader (--loader dataloader), not the device loader"]
    got, expected = load_weights(tmp_path / "collated"), load_weights(tmp_path / "doubled")
    assert all(torch.equal(got[key], expected[key]) for key in expected)
    assert not all(torch.equal(got[key], load_weights(tmp_path / "plain")[key]) for key in expected)
    for key in ("eval_loss", "eval_accuracy", "eval_samples"):
        assert collated[0][key] == collated[1][key] == reference[0][key], key
    assert collated[0]["eval_loss"] != plain["eval_loss"]
    # Per rank: the start-up probe's 2 samples, 2 epochs x 4 steps of 8, then 2 eval batches of 16 per epoch.
    for rank in (0, 1):
        assert (tmp_path / f"calls.{rank}").read_text().split() == ["2"] + (["8"] * 4 + ["16"] * 2) * 2


def test_a_collate_fn_with_loader_device_is_one_line_and_exit_2(tmp_path, capfd):
    out = tmp_path / "out"
    args = ["--dataset", "synthetic", "--synthetic_samples", "64", "--synthetic_shape", "4", "--global_batch_size",
            "16", "--loader", "device", "--collate_fn", "tests.test_data:doubling_collate", "--output_dir", str(out)]
    assert main_ranks(args) == [2, 2]
    lines = [line for line in capfd.readouterr().err.splitlines() if "accel_ddp:" in line or "Traceback" in line]
    assert lines == ["accel_ddp: error: --loader device batches the in-memory tensors on the device and never calls "
                     "the collate_fn tests.test_data:doubling_collate; use --loader auto or --loader dataloader "
                     "with it, or drop it"]
    assert not out.exists()


def test_a_collate_fn_makes_the_memory_mapped_paths_training_and_eval_batches(tmp_path, monkeypatch):
    folder = tmp_path / "d"
    folder.mkdir()
    hf_image_dataset(48, 0, size=8).to_parquet(str(folder / "train.parquet"))
    hf_image_dataset(20, 1, size=8).to_parquet(str(folder / "test.parquet"))
    common = ["--dataset", "hf", "--data_dir", str(folder), "--device_loader_max_mb", "0", "--num_workers", "1",
              "--global_batch_size", "16", "--epochs", "1"]
    monkeypatch.setenv("COLLATE_LOG", str(tmp_path / "calls"))
    collated = train_ranks([*common, "--collate_fn", "tests.test_data:doubling_collate", "--output_dir",
                            str(tmp_path / "collated")], world_size=1)[0]
    plain = train_ranks([*common, "--output_dir", str(tmp_path / "plain")], world_size=1)[0]
    assert collated["data_source"] == "memory_mapped" and collated["loader"] == "dataloader"
    assert (tmp_path / "calls.0").read_text().split() == ["2", "16", "16", "16", "20"]  # probe, 3 steps, 1 eval batch
    assert collated["eval_loss"] != plain["eval_loss"]
