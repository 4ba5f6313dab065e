"""The run's hyperparameters against a checkpoint's: which are recorded, and which win on a resume (this run's).

    with flags_in_force(optimizer, scheduler):
        step = checkpoints.resume("auto")
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

# Recorded in every checkpoint.json; a resume with other values warns, and this run's values are in force.
HYPERPARAMETERS = ("lr", "lr_schedule", "warmup_steps", "weight_decay", "max_grad_norm")


@contextmanager
def flags_in_force(optimizer: Any, scheduler: Any) -> Iterator[None]:
    """Keep this run's hyperparameters across a ``load_state`` inside the block.

    ``load_state`` restores the optimizer's param groups (lr, weight decay, betas, ...) and the schedule's
    peak LR from the checkpoint, while the schedule's shape and clipping come from the flags: a mix nobody
    asked for. Here the flags win, all of them, and the LR is recomputed for the restored step. Unchanged
    flags give back the very floats the checkpoint holds, so an unchanged resume stays bitwise exact.

        >>> with flags_in_force(optimizer, scheduler):
        ...     step = checkpoints.resume("auto")
    """
    fresh = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
    schedule = getattr(scheduler, "scheduler", scheduler)  # Accelerate's AcceleratedScheduler wraps it
    base_lrs = list(schedule.base_lrs)
    yield
    for group, values in zip(optimizer.param_groups, fresh, strict=True):
        group.update(values)
    schedule.base_lrs = base_lrs
    if lambdas := getattr(schedule, "lr_lambdas", None):  # LambdaLR: lr = peak x multiplier(step)
        lrs = [base * fn(schedule.last_epoch) for base, fn in zip(base_lrs, lambdas, strict=True)]
        for group, lr in zip(optimizer.param_groups, lrs, strict=True):
            group["lr"] = lr
        schedule._last_lr = lrs
