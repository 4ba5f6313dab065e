"""Datasets and DataLoaders.

Every builder returns a :class:`DatasetBundle`: train and eval datasets of ``(input, label)``
pairs plus what a model needs to know about them. Accelerate shards the plain DataLoaders built
here; the train loader's sampler fixes the epoch to a whole number of global batches so that
every world size runs the same optimizer steps on the same samples.

Your own dataset: ``--dataset my_pkg.my_data:build`` where

    def build(data_dir: str, download: bool) -> DatasetBundle: ...

(a plain ``(train, eval, num_classes, input_shape)`` tuple works too).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch.utils.data import DataLoader, Dataset, RandomSampler, TensorDataset

from accel_ddp.config import ConfigError
from accel_ddp.registry import resolve


class DatasetBundle(NamedTuple):
    train: Dataset
    eval: Dataset
    num_classes: int
    input_shape: tuple[int, ...]


MNIST_MEAN, MNIST_STD = 0.1307, 0.3081


def build_digits(data_dir: str, download: bool) -> DatasetBundle:
    """scikit-learn's bundled 8x8 digits (1,797 images): no download, 80/20 split fixed by seed 0."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0  # pixel range 0..16
    images = (images - 0.5) / 0.5
    labels = torch.tensor(digits.target, dtype=torch.long)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(0))
    n_train = int(0.8 * len(labels))
    train_idx, eval_idx = order[:n_train], order[n_train:]
    return DatasetBundle(
        TensorDataset(images[train_idx], labels[train_idx]),
        TensorDataset(images[eval_idx], labels[eval_idx]),
        num_classes=10,
        input_shape=(1, 8, 8),
    )


def build_mnist(data_dir: str, download: bool) -> DatasetBundle:
    """torchvision MNIST, decoded once into normalised tensors (no per-sample PIL work)."""
    from torchvision.datasets import MNIST

    splits = []
    for train in (True, False):
        try:
            raw = MNIST(root=data_dir, train=train, download=download)
        except RuntimeError as err:
            if "not found" not in str(err).lower():
                raise
            raise ConfigError(
                f"mnist: no MNIST files under {os.path.abspath(os.path.join(data_dir, 'MNIST', 'raw'))}; "
                "pass --download to fetch them, or --data_dir pointing at the folder that holds MNIST/raw"
            ) from None
        images = (raw.data.unsqueeze(1).float() / 255.0 - MNIST_MEAN) / MNIST_STD
        splits.append(TensorDataset(images, raw.targets.long()))
    return DatasetBundle(splits[0], splits[1], num_classes=10, input_shape=(1, 28, 28))


def build_synthetic(
    data_dir: str, download: bool, samples: int = 2048, shape: tuple[int, ...] = (1, 28, 28), classes: int = 10
) -> DatasetBundle:
    """Gaussian inputs labelled by a fixed random linear teacher, so a model can learn them."""
    gen = torch.Generator().manual_seed(1234)
    n_eval = max(samples // 4, 1)
    inputs = torch.randn(samples + n_eval, *shape, generator=gen)
    teacher = torch.randn(inputs[0].numel(), classes, generator=gen)
    labels = (inputs.flatten(1) @ teacher).argmax(dim=1)
    return DatasetBundle(
        TensorDataset(inputs[:samples], labels[:samples]),
        TensorDataset(inputs[samples:], labels[samples:]),
        num_classes=classes,
        input_shape=tuple(shape),
    )


DATASETS: dict[str, Callable[..., DatasetBundle]] = {
    "digits": build_digits,
    "mnist": build_mnist,
    "synthetic": build_synthetic,
}


def build_datasets(name: str, data_dir: str, download: bool, **synthetic) -> DatasetBundle:
    """Build a registered dataset or a user's ``pkg.module:function``.

        >>> bundle = build_datasets("digits", data_dir="data", download=False)
        >>> bundle.num_classes, bundle.input_shape
        (10, (1, 8, 8))
    """
    builder = resolve(name, DATASETS, kind="dataset")
    if builder is build_synthetic:
        return build_synthetic(data_dir, download, **synthetic)
    result = builder(data_dir=data_dir, download=download)
    if not isinstance(result, tuple) or len(result) != 4:
        raise ConfigError(
            f"--dataset {name} returned {type(result).__name__}; it must return "
            "(train, eval, num_classes, input_shape), e.g. accel_ddp.data.DatasetBundle"
        )
    train, eval_, num_classes, input_shape = result
    return DatasetBundle(train, eval_, int(num_classes), tuple(int(d) for d in input_shape))


def steps_per_epoch(num_train_samples: int, global_batch_size: int) -> int:
    """Optimizer steps in one epoch: the trailing partial global batch is dropped."""
    return num_train_samples // global_batch_size


def build_train_loader(
    dataset: Dataset, per_device_batch_size: int, global_batch_size: int, num_workers: int
) -> DataLoader:
    """Shuffling DataLoader whose epoch is exactly ``steps_per_epoch * global_batch_size`` samples.

    The sampler draws a fresh permutation of the whole dataset and keeps its first whole global
    batches. Accelerate swaps it for its seedable twin (seed + epoch) and hands rank ``r`` the
    per-device batches ``r, r + world, ...``, so each optimizer step covers the same contiguous
    chunk of the permutation whatever the world size and accumulation.
    """
    n_steps = steps_per_epoch(len(dataset), global_batch_size)
    if n_steps == 0:
        raise ConfigError(
            f"the training set has {len(dataset)} samples, fewer than one global batch "
            f"({global_batch_size}); lower --global_batch_size"
        )
    sampler = RandomSampler(dataset, num_samples=n_steps * global_batch_size)
    return DataLoader(
        dataset,
        batch_size=per_device_batch_size,
        sampler=sampler,
        drop_last=True,
        num_workers=num_workers,
        persistent_workers=num_workers > 0,
        pin_memory=torch.cuda.is_available(),
    )


def build_eval_loader(dataset: Dataset, batch_size: int, num_workers: int) -> DataLoader:
    """Ordered DataLoader; ``gather_for_metrics`` later drops the padding of the last batch."""
    return DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=False,
        num_workers=num_workers,
        pin_memory=torch.cuda.is_available(),
    )
