"""The optimizer and the learning-rate schedule a run steps: parameter groups, fused or multi-tensor kernels.

Imports torch only (benchmarks/bare_ddp.py builds its optimizer with it, without Accelerate).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from accel_ddp.util.validation import ConfigError

FUSED_DEVICES = ("cuda", "cpu")  # where torch has fused AdamW and SGD kernels (CPU since torch 2.4)


def use_fused_optimizer(name: str, device_type: str, fsdp2: bool = False) -> bool:
    """Whether ``build_optimizer`` should ask for the fused (one-kernel) implementation.

    On CUDA and on the CPU, yes: on the CPU the fused AdamW step is 2.6-4.4x faster than the multi-tensor
    one (tiny GPT-2: 3.84 -> 0.88 ms; mnist_cnn: 2.69 -> 0.65 ms; the mlp: 0.26 -> 0.10 ms, one thread,
    benchmarks/optimizer_kernels.py), fused SGD 2.0-2.6x. The exception is SGD under FSDP2: FSDP2's parameters are
    DTensors, and torch 2.14 has a DTensor rule for the fused Adam/AdamW kernels only
    (``torch/distributed/tensor/_ops/_pointwise_ops.py``), so fused SGD stops with ``NotImplementedError
    ... aten._fused_sgd_.default``. The multi-tensor (``foreach``) SGD it gets instead has DTensor rules
    and the same arithmetic. Elsewhere (MPS, XPU, ...): the multi-tensor kernels.
    """
    return device_type in FUSED_DEVICES and not (fsdp2 and name == "sgd")


def build_optimizer(
    name: str, model: nn.Module, lr: float, weight_decay: float, fused: bool = False, capturable: bool = False
) -> torch.optim.Optimizer:
    """``sgd`` (momentum 0.9, Nesterov) or ``adamw``; biases and norms get no weight decay.

    ``fused`` (the loop sets it from ``use_fused_optimizer``) updates all parameters in one kernel instead of a
    launch per tensor. Otherwise the multi-tensor (``foreach``) implementation, asked for
    explicitly: torch picks it by itself only for CUDA tensors, and on the CPU it nearly halves
    an AdamW step against the per-tensor loop (mnist_cnn: 6.8 -> 3.7 ms; see benchmarks/README.md).

    ``capturable`` (``--cuda_graphs``, AdamW only): the multi-tensor AdamW that a CUDA graph can capture, its step
    count on the device and its LR a tensor (the schedule ``fill_``s it; a float would be baked into the graph).
    torch documents ``capturable=True`` with a tensor LR for Adam/AdamW (``torch.optim.AdamW``'s ``lr``).
    """
    if capturable:
        if name != "adamw":
            raise ConfigError(f"--cuda_graphs needs --optimizer adamw (a capturable optimizer), not {name}")
        return torch.optim.AdamW(_groups(model, weight_decay), lr=torch.tensor(float(lr)), capturable=True,
                                 foreach=True)
    extra = {"fused": True} if fused else {"foreach": True}
    groups = _groups(model, weight_decay)
    if name == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=0.9, nesterov=True, **extra)
    if name == "adamw":
        return torch.optim.AdamW(groups, lr=lr, **extra)
    raise ConfigError(f"unknown optimizer {name!r}; choose sgd or adamw")


def _groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay for matrices and convolution kernels; none for biases and norms."""
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


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
