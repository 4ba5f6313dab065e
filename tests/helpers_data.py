"""Datasets and models for tests, importable as `tests.helpers_data:NAME` (the user-code path)."""

from __future__ import annotations

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
