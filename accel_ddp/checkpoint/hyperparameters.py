"""The run's facts against a checkpoint's: which must match, which are recorded, and which win on a resume (this run's).

    with flags_in_force(optimizer, scheduler):
        step = checkpoints.resume("auto")
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from accel_ddp.util.messages import warn
from accel_ddp.util.validation import ConfigError

# Recorded in every checkpoint.json; a resume with other values warns, and this run's values are in force.
HYPERPARAMETERS = ("lr", "lr_schedule", "warmup_steps", "weight_decay", "max_grad_norm", "optimizer_kwargs")
# Run facts that decide what an optimizer step means; a checkpoint made with other values cannot continue.
# A stream has no epoch length: its steps_per_epoch is the run's --max_steps, which a longer run raises.
MUST_MATCH = ("global_batch_size", "steps_per_epoch", "optimizer")
# How the base's fingerprint of every value starts (finetune.base_fingerprint); earlier versions recorded a sampled
# one (16 hex digits, finetune.sampled_fingerprint), compared as such, with a warning.
FULL_FINGERPRINT = "sha256:"


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


def check_compatible(folder: str, meta: dict[str, Any], run_facts: dict[str, Any], is_main: bool) -> None:
    """A ConfigError when ``meta`` (a checkpoint.json) was made with other MUST_MATCH facts than ``run_facts``;
    on the main process, a warning for each difference that this run's values settle (world size,
    hyperparameters, seed, total steps)."""
    check_same_base(folder, meta.get("base_fingerprint"), run_facts, is_main)
    saved_r, our_r = meta.get("lora_r"), run_facts.get("lora_r")
    if saved_r is not None and our_r is not None and saved_r != our_r:  # else a list of adapter shape mismatches
        raise ConfigError(f"--resume_from_checkpoint {folder}: its adapters have rank --lora_r {saved_r}, this run has "
                          f"--lora_r {our_r}; resume with --lora_r {saved_r}, or start in another --output_dir")
    streams = meta.get("loader") == run_facts.get("loader") == "streaming"
    for key in MUST_MATCH:
        if key in meta and meta[key] != run_facts.get(key) and not (streams and key == "steps_per_epoch"):
            raise ConfigError(f"--resume_from_checkpoint {folder}: it was made with {key} {meta[key]}, this run "
                              f"has {run_facts.get(key)}; resume with the options of the run that saved it")
    if not is_main:
        return
    if meta.get("world_size") != run_facts.get("world_size"):
        warn(f"{folder} was saved by {meta.get('world_size')} ranks, this run has "
             f"{run_facts.get('world_size')}: the global batch keeps each step's samples, so training "
             "continues equivalently (equal within float tolerance, not bitwise)")
    changed = [f"{key} {meta[key]} -> {run_facts[key]}" for key in HYPERPARAMETERS
               if key in meta and key in run_facts and meta[key] != run_facts[key]]
    if changed:
        warn(f"{folder} was saved with other hyperparameters ({', '.join(changed)}): this run's values are in "
             f"force from step {meta['step']} on (the schedule continues at that step), and config.yaml "
             "records them")
    for key, why in (("seed", "the data order"), ("total_steps", "the learning-rate schedule")):
        if key in meta and meta[key] != run_facts.get(key):
            warn(f"{folder} was saved with {key} {meta[key]}, this run has {run_facts.get(key)}: "
                 f"{why} after the resume differs from the original run's")


def check_same_base(folder: str, saved: str | None, run_facts: dict[str, Any], is_main: bool = True) -> None:
    """A checkpoint of a fine-tuned model holds its trainable state only: it continues only on the frozen base it
    was trained on (``finetune.base_fingerprint``, recorded in checkpoint.json). A checkpoint of an earlier version
    holds the sampled fingerprint: compared with this base's sampled one, and a warning says the check is weaker."""
    ours = run_facts.get("base_fingerprint")
    if saved is not None and ours is not None and not saved.startswith(FULL_FINGERPRINT):
        ours = run_facts.get("base_sampled_fingerprint")
        if saved == ours:
            if is_main:
                warn(f"{folder} was saved by an earlier version, with the sampled fingerprint of its base (64 values "
                     "per tensor): it matches this run's base, but a few changed weights would not show; this run's "
                     "checkpoints hold the fingerprint of every value")
            return
    if saved == ours:
        return
    if saved is None:
        why = "it holds a model trained in full, this run freezes a base (--peft)"
    elif ours is None:
        why = "it holds the trainable part of a fine-tuned model (an adapter), this run trains every parameter"
    else:
        why = f"its adapter belongs to another base model (fingerprint {_short(saved)}, this run's base {_short(ours)})"
    raise ConfigError(f"--resume_from_checkpoint {folder}: {why}; resume with the --model and --peft options of the "
                      "run that saved it, or start in another --output_dir")


def _short(fingerprint: str) -> str:
    """A fingerprint as a line shows it: 16 hex digits are enough to tell two apart."""
    return fingerprint.removeprefix(FULL_FINGERPRINT)[:16]
