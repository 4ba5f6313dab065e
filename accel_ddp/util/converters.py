"""A model converter: one transform of a built model before DDP wraps it (``--init_from``, ``--peft``,
``--fused_kernels``, ...), in the spirit of torchtitan's model converters (``build_model_converters(...)``).

Each converter lives in the module that owns its feature; the one ordered list is ``assemble.MODEL_CONVERTERS``.

    FUSED_KERNELS = ModelConverter("fused_kernels", applies=lambda cfg: cfg.fused_kernels, apply=_fuse)
    model, lines = convert_model(model, ModelBuild(cfg, accelerator, task), MODEL_CONVERTERS)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # util imports torch only inside a function (util/__init__.py)
    from torch import nn


@dataclass(frozen=True)
class ModelBuild:
    """What a converter may read: the run's options, its Accelerator and its task (util imports neither: ``Any``)."""

    cfg: Any  # accel_ddp.config.TrainConfig
    accelerator: Any  # accelerate.Accelerator, prepared nothing yet
    task: Any  # accel_ddp.tasks.protocol.Task: its memory format, the chunked loss's split head


@dataclass(frozen=True)
class ModelConverter:
    """One transform: ``applies(cfg)`` says whether the run asks for it; ``apply(model, build)`` returns the model
    (the same or a wrapper) and the start-up line it adds to the model's description, or None."""

    name: str  # the option that switches it on
    applies: Callable[[Any], bool]
    apply: Callable[[nn.Module, ModelBuild], tuple[nn.Module, str | None]]
    training_only: bool = False  # not applied to a trained run's model rebuilt for evaluation (inference.py)


def convert_model(model: nn.Module, build: ModelBuild,
                  converters: Iterable[ModelConverter]) -> tuple[nn.Module, list[str]]:
    """``model`` through each converter that applies, in order; the start-up lines they add."""
    lines = []
    for converter in converters:
        if converter.applies(build.cfg):
            model, line = converter.apply(model, build)
            if line:
                lines.append(line)
    return model, lines
