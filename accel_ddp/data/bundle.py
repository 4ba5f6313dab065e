"""What a dataset builder returns."""

from __future__ import annotations

from typing import NamedTuple

from torch.utils.data import Dataset


class DatasetBundle(NamedTuple):
    """Train and eval datasets plus what a model needs to know about them.

    ``input_shape`` is one sample's shape without the batch dimension, e.g. ``(1, 28, 28)``.
    """

    train: Dataset
    eval: Dataset
    num_classes: int
    input_shape: tuple[int, ...]
