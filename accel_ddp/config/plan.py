"""What an optimizer step means for a run (``Plan``) and when the loop logs, evaluates and saves (``Cadence``),
derived once from the options, the world size and the loaders by ``assemble.setup`` (``plan_run``). No torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from accel_ddp.config.choices import DEFAULT_LOG_EVERY
from accel_ddp.config.debug import debug_mode
from accel_ddp.config.options import TrainConfig


@dataclass(frozen=True)
class Cadence:
    """When the loop logs, evaluates and saves (accel_ddp/after_step.py), decided once from ``--log_every``,
    ``--eval_every``, ``--checkpointing_steps`` and whether there is an eval set; the same on every rank."""

    log_every: int  # a log line every N optimizer steps, and after the last
    log_lines: bool  # --log_every (--logging_steps) given: each log step also printed, as the Trainer does
    eval_every: int  # an evaluation every N optimizer steps; 0: none by step count
    eval_at_epoch_end: bool  # --eval_every 0 with an eval set: at each epoch's end
    save_every: int  # a checkpoint every N optimizer steps; 0: none by step count
    save_at_epoch_end: bool  # --checkpointing_steps epoch: after each full epoch

    @classmethod
    def from_config(cls, cfg: TrainConfig, evaluates: bool) -> Cadence:
        by_epoch = cfg.checkpointing_steps == "epoch"
        return cls(log_every=cfg.log_every or DEFAULT_LOG_EVERY, log_lines=cfg.log_every is not None,
                   eval_every=cfg.eval_every if evaluates else 0,
                   eval_at_epoch_end=evaluates and not cfg.eval_every,
                   save_every=0 if cfg.checkpointing_steps is None or by_epoch else int(cfg.checkpointing_steps),
                   save_at_epoch_end=by_epoch)

    def logs(self, step: int, total_steps: int) -> bool:
        return step % self.log_every == 0 or step == total_steps

    def evaluates(self, step: int) -> bool:
        return bool(self.eval_every) and step % self.eval_every == 0

    def saves(self, step: int) -> bool:
        return bool(self.save_every) and step % self.save_every == 0


@dataclass(frozen=True)
class Plan:
    """What an optimizer step means for this run, derived once from the config and the world size."""

    per_device_batch: int  # samples per forward pass on one rank
    accumulation: int  # micro-steps per optimizer step
    steps_per_epoch: int  # optimizer steps; the trailing partial global batch is dropped
    total_steps: int  # optimizer steps of the whole run
    num_epochs: int
    cadence: Cadence  # when the loop logs, evaluates and saves
    auto_batch: dict[str, Any] | None = None  # --per_device_batch_size auto: what was asked, tried, and from where


def plan_run(cfg: TrainConfig, steps_in_epoch: int, per_device_batch: int, accumulation: int, *, evaluates: bool,
          auto_batch: dict[str, Any] | None) -> Plan:
    """The run's plan: its total steps (``--max_steps``, else the epochs'; ``--debug``: at most DEBUG_MAX_STEPS),
    epochs and cadence, from the loaders' steps per epoch and the batch layout (``assemble.setup``)."""
    total_steps = cfg.max_steps or cfg.epochs * steps_in_epoch
    if (most := debug_mode(cfg).max_steps) is not None:
        total_steps = min(total_steps, most)
    return Plan(per_device_batch=per_device_batch, accumulation=accumulation, steps_per_epoch=steps_in_epoch,
                total_steps=total_steps, num_epochs=math.ceil(total_steps / steps_in_epoch),
                cadence=Cadence.from_config(cfg, evaluates), auto_batch=auto_batch)
