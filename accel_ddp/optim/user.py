"""The optimizer and LR schedule of a run, whoever makes them: the flags (``--optimizer``, ``--lr_schedule``: optim.py)
or the Python API's ``train(..., optimizer=, lr_scheduler=)``.

``optimizer``: a function of the parameter groups returning a ``torch.optim.Optimizer`` (it gets the groups
``optim.user_groups`` makes: weight decay for matrices and kernels, none for biases and norms), or an optimizer
already built on ``model.parameters()`` (then ``model=`` must be given: it must hold the parameters).
``lr_scheduler``: a function of that optimizer returning a ``torch.optim.lr_scheduler.LRScheduler`` (or one already
built on it), stepped once per optimizer step like the built-in schedule, which it replaces. Both are checkpointed
by Accelerate's ``save_state`` (``optimizer.bin``, ``scheduler.bin``) and restored by ``load_state`` as saved.

    check_optimization(options, model, optimizer=fn, lr_scheduler=fn)    # options: section_of(cfg, OptimizerOptions)
    optimization = build_optimization(options, model, accelerator, total_steps, warmup, optimizer=fn, lr_scheduler=fn)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from accel_ddp.config.checks import optimizer_kwargs
from accel_ddp.config.views import config_section, defaults_of
from accel_ddp.optim.build import build_lr_scheduler, build_optimizer, check_optimizer, use_fused_optimizer, user_groups
from accel_ddp.optim.muon import MuonWithAdamW
from accel_ddp.util.cpu_bf16 import cpu_has_bf16_units, read_cpuinfo
from accel_ddp.util.messages import warn
from accel_ddp.util.validation import ConfigError

LRScheduler = torch.optim.lr_scheduler.LRScheduler
USER_OPTIMIZER = "train(optimizer=...)"
USER_SCHEDULER = "train(lr_scheduler=...)"


@config_section
@dataclass(frozen=True)
class OptimizerOptions:
    """The options this module reads (config/views.py): the flags' optimizer and schedule, and those a user's
    optimizer or schedule would make void."""

    optimizer: str
    optimizer_kwargs: str | None
    lr: float
    weight_decay: float
    warmup_steps: int
    warmup_ratio: float | None
    lr_schedule: str
    cuda_graphs: bool


@dataclass(frozen=True)
class Optimization:
    """What ``setup`` prepares and checkpoints, and what the run says about it."""

    optimizer: torch.optim.Optimizer
    scheduler: LRScheduler
    name: str  # the "optimizer" fact of checkpoint.json (must match on a resume) and summary.json
    lines: dict[str, str]  # the start-up block's lines that the flags alone cannot write
    schedule_from_flags: bool  # the built-in schedule: on a resume this run's --lr and friends are in force


def check_optimization(options: OptimizerOptions, model: nn.Module | None, optimizer: Any, lr_scheduler: Any) -> None:
    """Before any data is read: the flags' optimizer exists and takes its keywords, and the API's objects are of a
    usable kind, with no flag beside them that would silently do nothing. One line (ConfigError) each."""
    if optimizer is None:
        check_optimizer(options.optimizer, optimizer_kwargs(options))
        if ":" in options.optimizer:  # a function's optimizer sets its own learning rate
            _refuse_unused(options, ["lr"], f"--optimizer {options.optimizer}",
                           "set lr in the function, or pass it with --optimizer_kwargs '{\"lr\": ...}'")
    else:
        _check_users_optimizer(options, model, optimizer)
    if lr_scheduler is not None:
        _check_users_scheduler(options, lr_scheduler)


def build_optimization(options: OptimizerOptions, model: nn.Module, accelerator: Any, total_steps: int, warmup: int,
                       optimizer: Any = None, lr_scheduler: Any = None) -> Optimization:
    """The run's optimizer on ``model``'s trainable parameters and its schedule (``check_optimization`` passed);
    ``warmup``: the built-in schedule's warmup in optimizer steps (--warmup_steps, or --warmup_ratio resolved)."""
    lines = {}
    if optimizer is None:
        built = build_optimizer(
            options.optimizer, model, options.lr, options.weight_decay,
            fused=use_fused_optimizer(options.optimizer, accelerator.device.type, accelerator.is_fsdp2),
            capturable=options.cuda_graphs, kwargs=optimizer_kwargs(options))
        name = options.optimizer
        if isinstance(built, MuonWithAdamW):
            if accelerator.distributed_type.value == "FSDP":  # FSDP saves optimizer state by parameter name
                raise ConfigError("--optimizer muon is not supported under FSDP (its state is two optimizers'); "
                                  "use DDP, or another optimizer")
            lines["optimizer split"] = built.split.describe()
            if accelerator.device.type == "cpu" and not cpu_has_bf16_units(read_cpuinfo()):
                warn("--optimizer muon on a CPU without bf16 units: torch's Muon runs its Newton-Schulz iterations in "
                     "bf16, ~20x slower than float32 matrix products here (docs/optimizers.md)", ranks="main")
    else:
        made = _is_builder(optimizer)
        built = optimizer(user_groups(model, options.weight_decay)) if made else optimizer
        _check_built(built, model)
        name = f"{type(built).__name__} ({USER_OPTIMIZER})"
        decay = (f"weight decay {options.weight_decay:g}" if options.weight_decay else "its own weight decay") + \
            " (none for biases and norms)" if made else "its own parameter groups"
        lines["optimizer"] = f"{name}, its own learning rate, {decay}"
    if lr_scheduler is None:
        scheduler = build_lr_scheduler(built, options.lr_schedule, warmup, total_steps)
        if optimizer is not None or ":" in options.optimizer:  # the peak is the optimizer's own learning rate
            lines["learning rate"] = (f"the optimizer's {scheduler.base_lrs[0]:g} after {warmup} warmup step"
                                      f"{'s' * (warmup != 1)}, then --lr_schedule {options.lr_schedule}")
    else:
        scheduler = lr_scheduler(built) if _is_builder(lr_scheduler) else lr_scheduler
        _check_scheduler(scheduler, built)
        lines["learning rate"] = (f"{type(scheduler).__name__} ({USER_SCHEDULER}), stepped once per optimizer "
                                  f"step, from {scheduler.get_last_lr()[0]:g}")
    return Optimization(optimizer=built, scheduler=scheduler, name=name, lines=lines,
                        schedule_from_flags=lr_scheduler is None)


def _is_builder(value: Any) -> bool:
    return callable(value) and not isinstance(value, (torch.optim.Optimizer, LRScheduler))


def _check_users_optimizer(options: OptimizerOptions, model: nn.Module | None, optimizer: Any) -> None:
    if not isinstance(optimizer, torch.optim.Optimizer) and not callable(optimizer):
        raise ConfigError(f"{USER_OPTIMIZER} got {type(optimizer).__name__}: give a function of the parameter "
                          "groups returning a torch.optim.Optimizer, or an optimizer built on model.parameters()")
    if isinstance(optimizer, torch.optim.Optimizer) and model is None:
        raise ConfigError(f"{USER_OPTIMIZER} got an optimizer already built, but no model= to train: give the model "
                          "its parameters belong to, or a function of the parameter groups instead")
    unused = ["optimizer", "optimizer_kwargs", "lr", "cuda_graphs"]
    if isinstance(optimizer, torch.optim.Optimizer):  # its groups are made: --weight_decay could not reach them
        unused.append("weight_decay")
    _refuse_unused(options, unused, USER_OPTIMIZER, "set it on your optimizer")


def _check_users_scheduler(options: OptimizerOptions, lr_scheduler: Any) -> None:
    if not isinstance(lr_scheduler, LRScheduler) and not callable(lr_scheduler):
        raise ConfigError(f"{USER_SCHEDULER} got {type(lr_scheduler).__name__}: give a function of the optimizer "
                          "returning a torch.optim.lr_scheduler.LRScheduler")
    _refuse_unused(options, ["warmup_steps", "warmup_ratio", "lr_schedule"], USER_SCHEDULER,
                   "your scheduler sets the LR")


def _refuse_unused(options: OptimizerOptions, flags: list[str], owner: str, fix: str) -> None:
    """A flag changed from its default that ``owner`` makes void: one line naming it (never silently ignored)."""
    defaults = defaults_of(OptimizerOptions)
    given = [f"--{flag} {getattr(options, flag)}" for flag in flags if getattr(options, flag) != defaults[flag]]
    if given:
        raise ConfigError(f"{', '.join(given)} with {owner}: {'it does' if len(given) == 1 else 'they do'} nothing "
                          f"there ({fix}); drop {'it' if len(given) == 1 else 'them'}")


def _check_built(optimizer: Any, model: nn.Module) -> None:
    """The optimizer the API gave or made holds the model's trainable parameters only."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigError(f"{USER_OPTIMIZER}: the function returned {type(optimizer).__name__}, not a "
                          "torch.optim.Optimizer; return an optimizer built on the parameter groups it is given")
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    held = [p for group in optimizer.param_groups for p in group["params"]]
    strangers = [p for p in held if id(p) not in trainable]
    if strangers:
        raise ConfigError(f"{USER_OPTIMIZER}: {len(strangers)} of the optimizer's {len(held)} parameters are not "
                          f"trainable parameters of the model {type(model).__name__} (another model's, or frozen); "
                          "build it on this model's parameters")


def _check_scheduler(scheduler: Any, optimizer: torch.optim.Optimizer) -> None:
    """An LRScheduler on this optimizer, stepped without arguments (ReduceLROnPlateau needs a metric: refused)."""
    if not isinstance(scheduler, LRScheduler):
        raise ConfigError(f"{USER_SCHEDULER}: got {type(scheduler).__name__}, not a "
                          "torch.optim.lr_scheduler.LRScheduler; return one built on the optimizer it is given")
    if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
        raise ConfigError(f"{USER_SCHEDULER}: ReduceLROnPlateau steps on a metric, and the run steps its schedule "
                          "once per optimizer step without one; use a step-based scheduler")
    if scheduler.optimizer is not optimizer:
        raise ConfigError(f"{USER_SCHEDULER}: the {type(scheduler).__name__} is built on another optimizer; build "
                          "it on the optimizer it is given")

