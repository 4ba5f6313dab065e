"""Your own dataset and model with accel_ddp, used both ways: as import strings and through Python.

The data: 2-D points on three noisy concentric rings, labelled by ring. The model: a small
residual MLP. Both follow the documented signatures, so the command line can load them:

    accelerate launch --config_file accelerate_configs/cpu_2proc.yaml train.py \
        --dataset examples.custom_model_and_data:build_dataset \
        --model examples.custom_model_and_data:build_model --epochs 5

and Python can pass them straight to ``train`` (run this file the same way):

    accelerate launch --config_file accelerate_configs/cpu_2proc.yaml examples/custom_model_and_data.py

Signatures:

    build_dataset(data_dir: str, download: bool) -> DatasetBundle(train, eval, num_classes, input_shape)
    build_model(num_classes: int, input_shape: tuple[int, ...]) -> torch.nn.Module  # (B, *input_shape) -> (B, classes)

A dataset of tensors (``TensorDataset`` or ``accel_ddp.data.InMemoryDataset``) gets the fast
in-memory loader; any other map-style ``Dataset`` of ``(input, label)`` pairs works on the
DataLoader path.
"""

from __future__ import annotations

import argparse
import math

import torch
from accelerate import PartialState
from torch import nn
from torch.utils.data import TensorDataset

from accel_ddp import TrainConfig, exit_process, train
from accel_ddp.data import DatasetBundle

RINGS = 3  # classes
TRAIN_POINTS, EVAL_POINTS = 3072, 600


def _rings(count: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    labels = torch.randint(0, RINGS, (count,), generator=generator)
    angle = torch.rand(count, generator=generator) * 2 * math.pi
    radius = 1.0 + labels.float() + 0.15 * torch.randn(count, generator=generator)
    points = torch.stack([radius * angle.cos(), radius * angle.sin()], dim=1)
    return points, labels


def build_dataset(data_dir: str, download: bool) -> DatasetBundle:
    """Three rings of 2-D points; fixed seed, so every rank builds the same data (nothing to download)."""
    generator = torch.Generator().manual_seed(2024)
    train_x, train_y = _rings(TRAIN_POINTS, generator)
    eval_x, eval_y = _rings(EVAL_POINTS, generator)
    return DatasetBundle(TensorDataset(train_x, train_y), TensorDataset(eval_x, eval_y), RINGS, (2,))


class ResidualMLP(nn.Module):
    def __init__(self, in_features: int, num_classes: int, width: int = 64, blocks: int = 2):
        super().__init__()
        self.stem = nn.Linear(in_features, width)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(width), nn.Linear(width, width), nn.GELU()) for _ in range(blocks)
        )
        self.head = nn.Linear(width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x.flatten(1))
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def build_model(num_classes: int, input_shape: tuple[int, ...]) -> nn.Module:
    """A residual MLP sized from the dataset: any input shape is flattened."""
    return ResidualMLP(math.prod(input_shape), num_classes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output_dir", default="outputs/custom_example")
    parser.add_argument("--epochs", type=int, default=5)
    args = parser.parse_args()

    bundle = build_dataset("data", download=False)
    cfg = TrainConfig(epochs=args.epochs, global_batch_size=64, lr=3e-3, output_dir=args.output_dir)
    torch.manual_seed(cfg.seed)  # same initial weights on every rank (DDP also broadcasts rank 0's)
    model = build_model(bundle.num_classes, bundle.input_shape)
    summary = train(cfg, model=model, train_dataset=bundle.train, eval_dataset=bundle.eval)
    if PartialState().is_main_process:
        print(f"eval accuracy {summary['eval_accuracy']:.3f} on {summary['eval_samples']} points, "
              f"{summary['world_size']} process(es)")


if __name__ == "__main__":
    main()
    exit_process(0)  # rather than falling off the end: a gloo thread may still hold tensors (see its docstring)
