"""``--compile_regions``: ``torch.compile`` of a model's repeated blocks, one compiled graph shared by the blocks.

Imports torch, util and its section of the options only (the same layer as ``fused_activations``: both change how a
built model runs, never its weights). Its converter, ``COMPILE_REGIONS``, is one of ``assemble.MODEL_CONVERTERS``.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from accel_ddp.config.views import config_section
from accel_ddp.util.converters import ModelBuild, ModelConverter
from accel_ddp.util.validation import ConfigError


def compile_regions(model: nn.Module) -> int:
    """``--compile_regions``: ``torch.compile`` each block of the model's repeated blocks, in place; the count.

    Regional compilation, as Accelerate's ``accelerate.utils.compile_regions`` (accelerate 1.16, utils/other.py)
    and torch's recipe (recipes/regional_compilation): the blocks of one ``nn.ModuleList`` whose children are all
    of one class share one compiled graph, so a 12-layer GPT-2 compiles one block, not twelve. Unlike Accelerate's,
    which wraps each block in an ``OptimizedModule`` (parameter names gain ``_orig_mod.``), this calls
    ``nn.Module.compile()`` on each block: parameter names, checkpoints and saved weights stay the same. Compiling
    happens at the blocks' first call (the first step's start-up phase). A model without repeated blocks is
    refused with one line."""
    lists, names = [], []
    for name, module in model.named_modules():
        if (isinstance(module, nn.ModuleList) and len(module) > 1 and len({type(child) for child in module}) == 1
                and not any(name.startswith(f"{outer}.") for outer in names)):  # not inside a block compiled already
            lists.append(module)
            names.append(name)
    if not lists:
        raise ConfigError(f"--compile_regions: {type(model).__name__} has no repeated blocks (an nn.ModuleList of "
                          "one class) to compile; use --compile for the whole model, or drop the flag")
    for blocks in lists:
        for block in blocks:
            block.compile()
    return sum(len(blocks) for blocks in lists)


def slower_here(device_type: str, *, compile: bool, compile_regions: bool) -> str | None:
    """The warning line for a compile asked for where it was measured slower than eager, or None.

    On the CPU, ``benchmarks/compile_cost.py`` (docs/performance.md, "What a compile costs on the CPU") measured the
    compiled step dearer than the eager one for the tiny GPT-2 and the MNIST CNN, so the compile never pays back:
    both stay off by default there, and a run that asks for one is told, and runs as asked. On a GPU the gain is
    unmeasured (no warning: nothing says it is slower there)."""
    if device_type != "cpu" or not (compile or compile_regions):
        return None
    flag = "--compile" if compile else "--compile_regions"
    return (f"{flag} on the CPU: measured slower than eager here (each step costs more CPU and the compile never "
            "pays back; benchmarks/compile_cost.py, docs/performance.md); it runs as asked: drop it to train faster")


@config_section
@dataclass(frozen=True)
class CompileRegionsOptions:
    """What ``COMPILE_REGIONS`` reads (config/views.py)."""

    compile_regions: bool


def _compile_regions(model: nn.Module, options: CompileRegionsOptions, build: ModelBuild) -> tuple[nn.Module, str]:
    regions = compile_regions(model)  # in place, before DDP wraps it: the same parameter names
    return model, f"{regions} repeated block{'s' if regions != 1 else ''} compiled (--compile_regions)"


COMPILE_REGIONS = ModelConverter("compile_regions", CompileRegionsOptions, applies=lambda o: o.compile_regions,
                                 apply=_compile_regions, training_only=True)  # in assemble.MODEL_CONVERTERS
