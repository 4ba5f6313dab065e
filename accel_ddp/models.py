"""Models, optimizers and learning-rate schedules.

Your own model: ``--model my_pkg.my_models:build`` where

    def build(num_classes: int, input_shape: tuple[int, ...]) -> torch.nn.Module: ...

``input_shape`` is one sample's shape without the batch dimension, e.g. ``(1, 28, 28)``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from accel_ddp.config import ConfigError
from accel_ddp.registry import resolve


def build_mlp(num_classes: int, input_shape: tuple[int, ...], hidden_size: int = 256) -> nn.Module:
    """Two hidden ReLU layers on the flattened input; trains any small dataset in seconds."""
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(math.prod(input_shape), hidden_size),
        nn.ReLU(),
        nn.Linear(hidden_size, hidden_size),
        nn.ReLU(),
        nn.Linear(hidden_size, num_classes),
    )


class MnistCNN(nn.Module):
    """The classic two-conv MNIST network (PyTorch's examples/mnist), sized from the input shape."""

    def __init__(self, num_classes: int, input_shape: tuple[int, ...]):
        super().__init__()
        channels, height, width = input_shape
        if height < 6 or width < 6:
            raise ConfigError(f"--model mnist_cnn needs inputs of at least 6x6 pixels, got {height}x{width}")
        self.features = nn.Sequential(
            nn.Conv2d(channels, 32, 3), nn.ReLU(),
            nn.Conv2d(32, 64, 3), nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Dropout(0.25),
            nn.Flatten(),
        )
        flat = 64 * ((height - 4) // 2) * ((width - 4) // 2)
        self.classifier = nn.Sequential(
            nn.Linear(flat, 128), nn.ReLU(), nn.Dropout(0.5), nn.Linear(128, num_classes)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


MODELS: dict[str, Callable[..., nn.Module]] = {"mlp": build_mlp, "mnist_cnn": MnistCNN}


def build_model(name: str, num_classes: int, input_shape: tuple[int, ...], hidden_size: int = 256) -> nn.Module:
    """Build a registered model or a user's ``pkg.module:function``.

        >>> build_model("mlp", num_classes=10, input_shape=(1, 8, 8))[1]
        Linear(in_features=64, out_features=256, bias=True)
    """
    builder = resolve(name, MODELS, kind="model")
    if name == "mnist_cnn" and len(input_shape) != 3:
        raise ConfigError(f"--model mnist_cnn needs image inputs (C, H, W), got shape {input_shape}; try --model mlp")
    if builder is build_mlp:
        model = build_mlp(num_classes, input_shape, hidden_size)
    else:
        model = builder(num_classes=num_classes, input_shape=input_shape)
    if not isinstance(model, nn.Module):
        raise ConfigError(f"--model {name} returned {type(model).__name__}; it must return a torch.nn.Module")
    return model


def build_optimizer(
    name: str, model: nn.Module, lr: float, weight_decay: float, fused: bool = False
) -> torch.optim.Optimizer:
    """``sgd`` (momentum 0.9, Nesterov) or ``adamw``; biases and norms get no weight decay."""
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    if name == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=0.9, nesterov=True)
    if name == "adamw":
        return torch.optim.AdamW(groups, lr=lr, **({"fused": True} if fused else {}))
    raise ConfigError(f"unknown optimizer {name!r}; choose sgd or adamw")


def lr_multiplier(step: int, schedule: str, warmup_steps: int, total_steps: int) -> float:
    """Factor on the peak LR before optimizer step ``step`` (0-based): linear warmup, then decay to 0."""
    if step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    if schedule == "constant":
        return 1.0
    progress = (step - warmup_steps) / max(total_steps - warmup_steps, 1)
    progress = min(progress, 1.0)
    if schedule == "linear":
        return 1.0 - progress
    if schedule == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ConfigError(f"unknown lr schedule {schedule!r}; choose constant, linear or cosine")


def build_lr_scheduler(
    optimizer: torch.optim.Optimizer, schedule: str, warmup_steps: int, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR that must be stepped exactly once per optimizer step (the loop does that)."""
    lr_multiplier(0, schedule, warmup_steps, total_steps)  # reject an unknown name now, not at step 1
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_multiplier(step, schedule, warmup_steps, total_steps)
    )
