"""The optimizer and the learning-rate schedule a run steps: any ``torch.optim`` class by name (``--optimizer``,
``--optimizer_kwargs``) or a user's function of the parameter groups, the weight-decay groups, fused or multi-tensor
kernels. Muon's split (hidden matrices to Muon, the rest to AdamW) is ``optim_muon.py``; the Python API's own
optimizer and schedule (``train(optimizer=, lr_scheduler=)``) ``optim_user.py``.

Imports torch and util only (benchmarks/bare_ddp.py builds its optimizer with it, without Accelerate).
"""

from __future__ import annotations

import inspect
import json
import math
from typing import Any

import torch
from torch import nn

from accel_ddp.optim.muon import MuonWithAdamW, muon_split
from accel_ddp.util.messages import first_line
from accel_ddp.util.registry import resolve
from accel_ddp.util.validation import ConfigError

FUSED_DEVICES = ("cuda", "cpu")  # where torch has fused AdamW and SGD kernels (CPU since torch 2.4)
# The classes whose fused kernels were measured (benchmarks/cpu_kernels.py: AdamW and SGD; Adam runs AdamW's
# kernel without the decoupled decay). Adagrad's fused kernel is CPU-only and unmeasured: multi-tensor, unless
# --optimizer_kwargs '{"fused": true}' asks for it.
FUSED_CLASSES = ("adamw", "adam", "sgd")
# torch.optim classes this loop cannot step, and why (refused by name, with the reason).
UNSTEPPABLE = {
    "lbfgs": "its step re-evaluates the model through a closure, and the loop steps once per global batch",
    "sparseadam": "it takes sparse gradients only, and DDP's all-reduce makes them dense",
}
# What --optimizer sgd has meant since the start: Nesterov momentum 0.9 (--optimizer_kwargs overrides either).
SGD_DEFAULTS = {"momentum": 0.9, "nesterov": True}


def use_fused_optimizer(name: str, device_type: str, fsdp2: bool = False) -> bool:
    """Whether ``build_optimizer`` should ask for the fused (one-kernel) implementation.

    On CUDA and on the CPU, yes: on the CPU the fused AdamW step is 2.6-4.4x faster than the multi-tensor
    one (tiny GPT-2: 3.84 -> 0.88 ms; mnist_cnn: 2.69 -> 0.65 ms; the mlp: 0.26 -> 0.10 ms, one thread,
    benchmarks/cpu_kernels.py), fused SGD 2.0-2.6x. The exception is SGD under FSDP2: FSDP2's parameters are
    DTensors, and torch 2.14 has a DTensor rule for the fused Adam/AdamW kernels only
    (``torch/distributed/tensor/_ops/_pointwise_ops.py``), so fused SGD stops with ``NotImplementedError
    ... aten._fused_sgd_.default``. The multi-tensor (``foreach``) SGD it gets instead has DTensor rules
    and the same arithmetic. Elsewhere (MPS, XPU, ...): the multi-tensor kernels. Only the classes of
    ``FUSED_CLASSES`` get the fused kernel; the others their multi-tensor one where they have it.
    """
    return device_type in FUSED_DEVICES and not (fsdp2 and name == "sgd")


def optimizer_classes() -> dict[str, type[torch.optim.Optimizer]]:
    """The installed torch's optimizer classes by lower-case name (``Muon`` since torch 2.9), steppable ones only."""
    return {name.lower(): cls for name, cls in vars(torch.optim).items()
            if isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer) and cls is not torch.optim.Optimizer
            and name.lower() not in UNSTEPPABLE}


def optimizer_class(name: str) -> type[torch.optim.Optimizer]:
    """The ``torch.optim`` class ``--optimizer name`` names (lower case), or one line listing the choices."""
    if name in UNSTEPPABLE:
        raise ConfigError(f"--optimizer {name} cannot be used here: {UNSTEPPABLE[name]}; choose another optimizer")
    classes = optimizer_classes()
    if name not in classes:
        raise ConfigError(f"unknown optimizer {name!r}; choose one of {', '.join(sorted(classes))} (torch.optim of "
                          f"torch {torch.__version__}, any case), or give 'pkg.module:function'")
    return classes[name]


def check_optimizer(name: str, kwargs: dict[str, Any]) -> None:
    """``--optimizer`` and ``--optimizer_kwargs`` before anything is built: an unknown name or keyword, a user's
    function that does not import or cannot take the groups and the keywords: one line (ConfigError)."""
    if ":" in name:
        _optimizer_function(name, kwargs)
    else:
        _check_keywords(optimizer_class(name), kwargs)


def build_optimizer(
    name: str, model: nn.Module, lr: float, weight_decay: float, fused: bool = False, capturable: bool = False,
    kwargs: dict[str, Any] | None = None,
) -> torch.optim.Optimizer:
    """The optimizer ``--optimizer name`` names, with ``--optimizer_kwargs`` (``kwargs``); biases and norms get no
    weight decay. ``sgd`` is Nesterov momentum 0.9 unless the keywords say otherwise; ``muon`` is Muon for the hidden
    matrices and AdamW for the rest (``optim_muon.py``); ``pkg.module:function`` is called with the parameter groups
    (and the keywords) and must return an optimizer.

    ``fused`` (the loop sets it from ``use_fused_optimizer``) updates all parameters in one kernel instead of a
    launch per tensor, for the classes of ``FUSED_CLASSES``. Otherwise the multi-tensor (``foreach``)
    implementation where the class has one, asked for explicitly: torch picks it by itself only for CUDA tensors,
    and on the CPU it nearly halves an AdamW step against the per-tensor loop (mnist_cnn: 6.8 -> 3.7 ms; see
    benchmarks/README.md). Keywords that name ``fused`` or ``foreach`` themselves are left as given.

    ``capturable`` (``--cuda_graphs``, AdamW only): the multi-tensor AdamW that a CUDA graph can capture, its step
    count on the device and its LR a tensor (the schedule ``fill_``s it; a float would be baked into the graph).
    torch documents ``capturable=True`` with a tensor LR for Adam/AdamW (``torch.optim.AdamW``'s ``lr``).
    """
    kwargs = _as_tuples(kwargs or {})
    if capturable:
        if name != "adamw":
            raise ConfigError(f"--cuda_graphs needs --optimizer adamw (a capturable optimizer), not {name}")
        return torch.optim.AdamW(_groups(model, weight_decay), lr=torch.tensor(float(lr)),
                                 **{"foreach": True, **kwargs, "capturable": True})
    if ":" in name:
        return _from_function(name, model, weight_decay, kwargs)
    cls = optimizer_class(name)
    _check_keywords(cls, kwargs)
    if name == "muon":
        return _muon_with_adamw(model, lr, weight_decay, fused, kwargs)
    if weight_decay and "weight_decay" not in inspect.signature(cls).parameters:
        raise ConfigError(f"--weight_decay {weight_decay:g} with --optimizer {name}: {cls.__name__} has no weight "
                          "decay; drop --weight_decay or choose another optimizer")
    options = {**(SGD_DEFAULTS if name == "sgd" else {}), **_kernels(cls, fused and name in FUSED_CLASSES, kwargs),
               **kwargs}
    return _construct(cls, _groups(model, weight_decay), name, lr=lr, **options)


def _muon_with_adamw(model: nn.Module, lr: float, weight_decay: float, fused: bool,
                     kwargs: dict[str, Any]) -> MuonWithAdamW:
    """Muon (``--optimizer_kwargs`` its keywords) for the hidden matrices, AdamW for everything else, one object.

    Both take ``--lr``: Muon's update is scaled to AdamW's RMS (``adjust_lr_fn="match_rms_adamw"``, Moonshot's
    adjustment, which torch's Muon docstring says lets it reuse AdamW's learning rate and weight decay) unless the
    keywords choose another ``adjust_lr_fn``.
    """
    split = muon_split(model)
    if not split.matrices:
        raise ConfigError(f"--optimizer muon: {type(model).__name__} has no hidden 2-D matrix for Muon (its "
                          f"{split.describe_rest()} go to AdamW); choose another optimizer, e.g. adamw")
    options = {"adjust_lr_fn": "match_rms_adamw", **kwargs}
    muon = _construct(torch.optim.Muon, [{"params": split.matrices, "weight_decay": weight_decay}], "muon", lr=lr,
                      **options)
    adamw = torch.optim.AdamW(_groups(split.rest, weight_decay), lr=lr,
                              **_kernels(torch.optim.AdamW, fused, {}))
    return MuonWithAdamW(muon, adamw, split)


def _from_function(name: str, model: nn.Module, weight_decay: float, kwargs: dict[str, Any]) -> torch.optim.Optimizer:
    """``--optimizer pkg.module:function``: ``function(groups, **kwargs)``, which must return an optimizer."""
    function = _optimizer_function(name, kwargs)
    optimizer = function(user_groups(model, weight_decay), **kwargs)
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigError(f"--optimizer {name} returned {type(optimizer).__name__}, not a torch.optim.Optimizer; "
                          "return an optimizer built on the parameter groups it is given")
    return optimizer


def _optimizer_function(name: str, kwargs: dict[str, Any]):
    """The user's ``pkg.module:function``, imported and checked to take the groups and the keywords."""
    function = resolve(name, {}, kind="optimizer")
    try:
        inspect.signature(function).bind([], **kwargs)
    except TypeError as err:
        given = f" and --optimizer_kwargs {json.dumps(kwargs)}" if kwargs else ""
        raise ConfigError(f"--optimizer {name} cannot be called with the parameter groups{given} ({err}); expected "
                          "def build(groups, **kwargs) -> torch.optim.Optimizer") from None
    except ValueError:  # no signature to inspect (a builtin): the call decides
        pass
    return function


def _check_keywords(cls: type, kwargs: dict[str, Any]) -> None:
    """Every ``--optimizer_kwargs`` key is a keyword of ``cls``'s constructor."""
    accepted = [p for p in inspect.signature(cls).parameters if p not in ("params", "lr", "weight_decay")]
    unknown = sorted(set(kwargs) - set(accepted))
    if unknown:
        raise ConfigError(f"--optimizer_kwargs: {cls.__name__} takes no keyword {unknown[0]!r}; it takes "
                          f"{', '.join(accepted)} (and --lr, --weight_decay)")


def _construct(cls: type, groups: list[dict], name: str, **options: Any) -> torch.optim.Optimizer:
    """``cls(groups, **options)``; a value the class refuses (a bad beta, a negative eps) is one line."""
    try:
        return cls(groups, **options)
    except (TypeError, ValueError) as err:
        given = {k: v for k, v in options.items() if k not in ("lr", "fused", "foreach")}
        raise ConfigError(f"--optimizer {name} refused its options {given} ({first_line(err, 200)}); fix "
                          "--optimizer_kwargs") from None


def _kernels(cls: type, fused: bool, kwargs: dict[str, Any]) -> dict[str, bool]:
    """``fused=True`` where asked and the class has it, else ``foreach=True`` where it has that (checked on the
    signature); nothing where the user's keywords choose either."""
    if "fused" in kwargs or "foreach" in kwargs:
        return {}
    accepted = inspect.signature(cls).parameters
    if fused and "fused" in accepted:
        return {"fused": True}
    return {"foreach": True} if "foreach" in accepted else {}


def _as_tuples(kwargs: dict[str, Any]) -> dict[str, Any]:
    """JSON has no tuples: ``betas``, ``eps`` pairs and the like become the tuples torch's signatures name."""
    return {key: tuple(value) if isinstance(value, list) else value for key, value in kwargs.items()}


def _groups(params: nn.Module | list[nn.Parameter], weight_decay: float) -> list[dict]:
    """Weight decay for matrices and convolution kernels; none for biases and norms."""
    params = list(params.parameters()) if isinstance(params, nn.Module) else params
    decay = [p for p in params if p.requires_grad and p.ndim >= 2]
    no_decay = [p for p in params if p.requires_grad and p.ndim < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def user_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """The groups a user's optimizer function gets: matrices and kernels, then biases and norms (``weight_decay``
    0). The first carries ``--weight_decay`` only where it is set (> 0): otherwise the optimizer's own keyword (or
    default) applies to it, since a group's value would win over the keyword silently."""
    decay, no_decay = _groups(model, weight_decay)
    if not weight_decay:
        del decay["weight_decay"]
    return [decay, no_decay]


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
