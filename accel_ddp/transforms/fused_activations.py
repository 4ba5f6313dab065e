"""Faster kernels for the same math in the user's model (``--fused_kernels``, on by default).

Transformers' GPT-2 family (``activation_function`` ``gelu_new`` or ``gelu_fast``: GPT-2, GPT-Neo, GPT-J,
CodeGen, ...) computes the tanh approximation of GELU as a chain of element-wise Python operations
(``pow``, ``mul``, ``add``, ``tanh``: eight kernels forward, more backward). torch has the same function as one
kernel, ``F.gelu(approximate="tanh")``, which Transformers offers as ``gelu_pytorch_tanh`` and describes as
equivalent but not bit-identical. Swapping the module changes no weight, no config and no saved file (the
exported model still says ``gelu_new``); outputs move by float rounding only
(tests/transforms/test_fused_activations.py: a GPT-2's logits within 1e-5 of the module it replaces, gradients within
1e-4 relative). Measured on one CPU core: the activation's forward and backward on a (2048, 512) batch
15.6 -> 8.2 ms, the tiny GPT-2's whole step 0.87-0.89x
the CPU time (benchmarks/cpu_kernels.py). On a GPU it is one kernel launch instead of eight.

Imports no Transformers of its own: a model that holds Transformers' modules has already imported them.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from accel_ddp.config.views import config_section
from accel_ddp.util.converters import ModelBuild, ModelConverter

# Transformers' classes (in transformers.activations) that compute 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)))
# in Python; FastGELUActivation writes the same polynomial as x (1 + 0.044715 x^2) with sqrt(2 / pi) rounded to
# 0.7978845608.
PYTHON_TANH_GELUS = ("NewGELUActivation", "FastGELUActivation")


class TanhGELU(nn.Module):
    """GELU's tanh approximation in torch's single kernel."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(x, approximate="tanh")


def fuse_activations(model: nn.Module) -> int:
    """Replace every Transformers Python tanh-GELU module in ``model`` by :class:`TanhGELU`; returns how many.

        >>> fuse_activations(nn.Sequential(nn.Linear(2, 2), nn.ReLU()))
        0
    """
    slow = _python_tanh_gelu_classes()
    if not slow:
        return 0
    replaced = 0
    for parent in model.modules():
        for name, child in list(parent.named_children()):
            if type(child) in slow:  # exact type: a user's subclass may compute something else
                setattr(parent, name, TanhGELU())
                replaced += 1
    return replaced


@config_section
@dataclass(frozen=True)
class FusedKernelsOptions:
    """What ``FUSED_KERNELS`` reads (config/views.py)."""

    fused_kernels: bool


def _fuse(model: nn.Module, options: FusedKernelsOptions, build: ModelBuild) -> tuple[nn.Module, str | None]:
    fused = fuse_activations(model)  # before DDP wraps it: same math, fewer kernels
    return model, (f"{fused} tanh-GELU module{'s' if fused > 1 else ''} on torch's one kernel (--fused_kernels)"
                   if fused else None)


FUSED_KERNELS = ModelConverter("fused_kernels", FusedKernelsOptions, applies=lambda o: o.fused_kernels, apply=_fuse,
                               training_only=True)  # assemble.MODEL_CONVERTERS applies it (util/converters.py)


def _python_tanh_gelu_classes() -> tuple[type, ...]:
    activations = sys.modules.get("transformers.activations")
    if activations is None:  # no Transformers model was built in this process
        return ()
    return tuple(getattr(activations, name) for name in PYTHON_TANH_GELUS if hasattr(activations, name))

