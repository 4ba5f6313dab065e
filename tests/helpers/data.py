"""Datasets and models for tests, importable as `tests.helpers.data:NAME` (the user-code path)."""

from __future__ import annotations

import gzip
import pickle
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset, TensorDataset

from accel_ddp.data import DatasetBundle


class IndexDataset(Dataset):
    """Sample i is (tensor([i.]), i % classes): a model can read which samples it was served."""

    def __init__(self, length: int, classes: int = 4):
        self.length, self.classes = length, classes

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int):
        return torch.tensor([float(index)]), index % self.classes


class TensorRows(Dataset):
    """A map-style dataset over (x, y) tensors read sample by sample: the DataLoader path, never handed to the
    device loader as one tensor (TensorDataset would be)."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor):
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, index: int):
        return self.x[index], self.y[index]


class IndexRecorder(nn.Module):
    """Logits from a bias only; records the sample indices of every training forward pass."""

    def __init__(self, classes: int = 4):
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(classes))
        self.seen: list[list[int]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.seen.append(x[:, 0].long().tolist())
        return self.bias.expand(len(x), -1) + 0.0 * x.sum()


def odd_eval(data_dir: str, download: bool) -> DatasetBundle:
    """96 training samples and an odd-sized eval set of 37, for exact eval counting."""
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(96 + 37, 6, generator=gen)
    y = (x[:, 0] > 0).long()
    return DatasetBundle(TensorDataset(x[:96], y[:96]), TensorDataset(x[96:], y[96:]), 2, (6,))


def tiny_linear(num_classes: int, input_shape: tuple[int, ...]) -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(int(torch.tensor(input_shape).prod()), num_classes))


class AugmentedIndexDataset(Dataset):
    """Sample i is (tensor([i, noise]), i % classes): noise drawn from torch's global generator on every read."""

    def __init__(self, length: int, classes: int = 4):
        self.length, self.classes = length, classes

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int):
        return torch.tensor([float(index), float(torch.rand(()))]), index % self.classes


class NoisyReads(Dataset):
    """Another dataset's samples plus noise from torch's, NumPy's and Python's global generators (an augmentation)."""

    def __init__(self, dataset: Dataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int):
        import random

        import numpy as np

        x, y = self.dataset[index]
        shift = 0.1 * float(np.random.normal()) + 0.1 * random.random()
        return x + 0.2 * torch.randn_like(x) + shift, y


def noisy_digits(data_dir: str, download: bool) -> DatasetBundle:
    """scikit-learn's digits read one sample at a time with random noise on every training read."""
    from accel_ddp.data.builtin import build_digits

    bundle = build_digits(data_dir, download)
    return bundle._replace(train=NoisyReads(bundle.train))


BAD_SAMPLE_MESSAGE = "does not decode (an injected bad sample)"


class OneBadSample(Dataset):
    """A map-style dataset (the DataLoader path) whose sample ``bad`` fails to decode: a DataError naming it."""

    def __init__(self, dataset: Dataset, bad: int):
        self.dataset, self.bad = dataset, bad

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int):
        if index == self.bad:
            from accel_ddp.data import DataError

            raise DataError(f"sample {index} {BAD_SAMPLE_MESSAGE}; remove it from the dataset")
        return self.dataset[index]


def reads_at(step: int, rank: int, num_samples: int, global_batch_size: int, world_size: int) -> list[int]:
    """The samples ``rank`` reads at optimizer ``step`` (1-based) of epoch 0, seed 0 (one micro-step per step)."""
    from accel_ddp.data.sampler import GlobalBatchSampler

    sampler = GlobalBatchSampler(num_samples, global_batch_size // world_size, global_batch_size, seed=0, rank=rank,
                                 world_size=world_size)
    return sampler.rank_indices(0)[step - 1].tolist()


def read_at(step: int, rank: int, num_samples: int, global_batch_size: int, world_size: int) -> int:
    """The first sample ``rank`` reads at optimizer ``step`` of epoch 0 (``reads_at``)."""
    return reads_at(step, rank, num_samples, global_batch_size, world_size)[0]


def one_bad_sample(data_dir: str, download: bool) -> DatasetBundle:
    """4096 synthetic samples of shape (6,); the one rank 1 of 2 reads at step 3 (global batch 16, seed 0) does
    not decode."""
    from accel_ddp.data.builtin import build_synthetic

    bundle = build_synthetic(data_dir, download, samples=4096, shape=(6,))
    return bundle._replace(train=OneBadSample(bundle.train, read_at(3, 1, 4096, 16, 2)))


def sequences_one_bad(data_dir: str, download: bool) -> DatasetBundle:
    """tests.helpers.text's token sequences (causal_lm) of which the one rank 1 of 2 reads at step 3 (global batch 8,
    seed 0) does not decode."""
    from tests.helpers.text import build_sequences

    bundle = build_sequences(data_dir, download)
    return bundle._replace(train=OneBadSample(bundle.train, read_at(3, 1, len(bundle.train), 8, 2)))


# ----------------------------------------------------------------------------- files of images


def write_png_classes(root: Path, classes: list[str], per_class: int, mode: str = "RGB", size=(12, 10)) -> None:
    """An image folder: ``root/<class>/<i>.png`` of random pixels."""
    from PIL import Image

    rng = np.random.default_rng(2)
    for c in classes:
        (root / c).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            shape = (size[1], size[0], 3) if mode == "RGB" else (size[1], size[0])
            Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8), mode=mode).save(root / c / f"{i}.png")


def hf_image_dataset(n: int, seed: int, size: int = 10, mode: str = "L"):
    """A ``datasets.Dataset`` of ``n`` random images and 4 class labels (``i % 4``)."""
    import datasets
    from PIL import Image

    rng = np.random.default_rng(seed)
    shape = (size, size) if mode == "L" else (size, size, 3)
    images = [Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8), mode=mode) for _ in range(n)]
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(num_classes=4)})
    return datasets.Dataset.from_dict({"image": images, "label": [i % 4 for i in range(n)]}, features=features)


def _spoiled(dataset, bad_rows: tuple[int, ...]):
    """``dataset`` (8x8 PNGs) with bytes that are no image in ``bad_rows``."""
    import datasets

    dataset = dataset.cast_column("image", datasets.Image(decode=False))
    if bad_rows:
        def spoil(row, index):
            return {"image": {"bytes": b"not an image", "path": None}} if index in bad_rows else row
        dataset = dataset.map(spoil, with_indices=True)
    return dataset


def image_splits(folder: Path, n_train: int, n_test: int, bad_rows: tuple[int, ...] = ()) -> Path:
    """A save_to_disk folder of 8x8 grayscale PNGs (4 classes); ``bad_rows`` of train hold bytes that are no image."""
    import datasets

    train = _spoiled(hf_image_dataset(n_train, 0, size=8), bad_rows)
    datasets.DatasetDict(train=train, test=hf_image_dataset(n_test, 1, size=8)).save_to_disk(folder)
    return folder


def image_shards(folder: Path, sizes: list[int], n_test: int,
                 bad_rows: dict[int, tuple[int, ...]] | None = None) -> Path:
    """train-0000k-of-0000n.parquet files of 8x8 grayscale PNGs (4 classes) and a test.parquet; ``bad_rows``:
    file number -> its rows that hold bytes that are no image."""
    folder.mkdir(parents=True)
    for k, size in enumerate(sizes):
        shard = hf_image_dataset(size, k, size=8)
        if (bad_rows or {}).get(k):
            shard = _spoiled(shard, bad_rows[k])
        shard.to_parquet(str(folder / f"train-{k:05d}-of-{len(sizes):05d}.parquet"))
    hf_image_dataset(n_test, 99, size=8).to_parquet(str(folder / "test.parquet"))
    return folder


def write_shards(folder: Path, sizes: list[int]) -> list[str]:
    """Parquet files of ``sizes`` rows; row ``i`` overall has ``idx`` i."""
    import datasets

    folder.mkdir(parents=True, exist_ok=True)
    files, start = [], 0
    for k, size in enumerate(sizes):
        path = folder / f"shard_{k}.parquet"
        datasets.Dataset.from_dict({"idx": list(range(start, start + size))}).to_parquet(str(path))
        files.append(str(path))
        start += size
    return files


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


def batches_until_data_error(loader) -> tuple[int, str | None]:
    """Iterate ``loader`` in a rank: the batches it served, and the DataError's text if one ended it (else None)."""
    from accel_ddp.data import DataError

    served = 0
    try:
        for _ in loader:
            served += 1
    except DataError as err:
        return served, str(err)
    return served, None


NAN_INPUT_AT = read_at(3, 1, 64, 16, 2)  # the sample rank 1 of 2 reads at optimizer step 3 (64 samples, batch 16)


def _nan_rows(in_memory: bool) -> DatasetBundle:
    gen = torch.Generator().manual_seed(0)
    x, ex = torch.randn(64, 6, generator=gen), torch.randn(16, 6, generator=gen)
    y, ey = (x[:, 0] > 0).long(), (ex[:, 0] > 0).long()
    x[NAN_INPUT_AT, 2] = float("nan")
    kind = TensorDataset if in_memory else TensorRows
    return DatasetBundle(kind(x, y), kind(ex, ey), 2, (6,))


def nan_input_in_memory(data_dir: str, download: bool) -> DatasetBundle:
    """64 samples of shape (6,) held in memory (the device loader's); sample ``NAN_INPUT_AT`` holds a nan."""
    return _nan_rows(in_memory=True)


def nan_input_per_sample(data_dir: str, download: bool) -> DatasetBundle:
    """The same samples read one at a time (the DataLoader path's)."""
    return _nan_rows(in_memory=False)


def mapped_floats_with_inf(folder: Path, row: int = 13):
    """A ``datasets.Dataset`` of 40 rows (``x``: 3 floats, ``label``), saved in ``folder`` and read back memory-mapped
    in torch format; ``x`` of ``row`` holds an inf."""
    import datasets

    from accel_ddp.data.loaders import data_source

    x = torch.randn(40, 3)
    x[row, 1] = float("inf")
    datasets.Dataset.from_dict({"x": x.tolist(), "label": [i % 2 for i in range(40)]}).save_to_disk(folder)
    table = datasets.load_from_disk(str(folder)).with_format("torch")
    assert data_source(table) == "memory_mapped"
    return table
