"""A model converter: one transform of a built model before DDP wraps it (``--init_from``, ``--peft``,
``--fused_kernels``, ...), in the spirit of torchtitan's model converters (``build_model_converters(...)``).

Each converter lives in the module that owns its feature, with the typed section of the run's options it reads
(``config/views.py``); the one ordered list is ``assemble.MODEL_CONVERTERS``. util imports no config, so the caller,
which holds the run's options, hands ``convert_model`` the reader of sections:

    FUSED_KERNELS = ModelConverter("fused_kernels", FusedKernelsOptions, applies=lambda o: o.fused_kernels,
                                   apply=_fuse)
    model, lines = convert_model(model, ModelBuild(accelerator, task), MODEL_CONVERTERS, partial(section_of, cfg))
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

if TYPE_CHECKING:  # util imports torch only inside a function (util/__init__.py)
    from torch import nn

Options = TypeVar("Options")


@dataclass(frozen=True)
class ModelBuild:
    """What every converter may read besides its options: the run's Accelerator and its task (util imports neither:
    ``Any``)."""

    accelerator: Any  # accelerate.Accelerator, prepared nothing yet
    task: Any  # accel_ddp.tasks.protocol.Task: its memory format, the chunked loss's split head


@dataclass(frozen=True)
class NoOptions:
    """The section of a converter that reads no option (it applies always, or by what ``ModelBuild`` holds)."""


class ReadSection(Protocol):
    """The run's options as the section ``cls`` declares (``config.views.section_of`` bound to the config)."""

    def __call__(self, cls: type[Options], /) -> Options: ...


@dataclass(frozen=True)
class ModelConverter(Generic[Options]):
    """One transform: ``applies(options)`` says whether the run asks for it; ``apply(model, options, build)`` returns
    the model (the same or a wrapper) and the start-up line it adds to the model's description, or None.
    ``options``: the dataclass of the options it reads, its section of the run's options."""

    name: str  # the option that switches it on
    options: type[Options]
    applies: Callable[[Options], bool]
    apply: Callable[[nn.Module, Options, ModelBuild], tuple[nn.Module, str | None]]
    training_only: bool = False  # not applied to a trained run's model rebuilt for evaluation (inference.py)


def convert_model(model: nn.Module, build: ModelBuild, converters: Iterable[ModelConverter],
                  read: ReadSection) -> tuple[nn.Module, list[str]]:
    """``model`` through each converter that applies, in order, each given its own section (``read``); the start-up
    lines they add."""
    lines = []
    for converter in converters:
        options = read(converter.options)
        if converter.applies(options):
            model, line = converter.apply(model, options, build)
            if line:
                lines.append(line)
    return model, lines
