"""The room's one entry (``BadSteps``): the hooks the step is given, and the checks, at the points where the loop
syncs anyway, that stop the run, skip a step, roll back or refuse a broken loss sum (see ``__init__.py``)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from accelerate import Accelerator

from accel_ddp.bad_steps.guard import AnomalyGuard
from accel_ddp.bad_steps.stops import BadStepOptions, RolledBack, non_finite_loss
from accel_ddp.bad_steps.watch import LossWatch, trace_non_finite
from accel_ddp.config.debug import debug_mode
from accel_ddp.util.validation import ConfigError

if TYPE_CHECKING:
    from accel_ddp.checkpoint.manager import CheckpointManager
    from accel_ddp.step.losses import LossAccumulator
    from accel_ddp.tracking.recorder import RunRecorder


class BadSteps:
    """The run's bad steps (one per run, built by ``setup``): the hooks the step is given, and the checks, at the
    points where the loop syncs anyway, that stop the run, skip, roll back or refuse a broken loss sum."""

    def __init__(self, options: BadStepOptions, accelerator: Accelerator, model: torch.nn.Module,
                 recorder: RunRecorder):
        # --on_anomaly skip|rollback, --spike_factor: the guard's decisions and records (None: stop at the first)
        self.guard = AnomalyGuard(options, accelerator, recorder) \
            if options.on_anomaly != "stop" or options.spike_factor else None
        self.debug_switches, self.accelerator, self.model = debug_mode(options), accelerator, model
        self.recorder = recorder
        self.checkpoints: CheckpointManager | None = None  # begin()
        self.watch: LossWatch | None = None  # restart(): the steps of this fit
        self.losses: LossAccumulator | None = None

    @property
    def step_guard(self) -> AnomalyGuard | None:
        """What the step's update and loss consult (step/): the guard where it skips (``stop`` with ``--spike_factor``
        judges log lines only: none)."""
        return self.guard if self.guard is not None and self.guard.skips else None

    @property
    def check_loss(self) -> Callable[[torch.Tensor, int], None] | None:
        """``--debug``: every micro-step's loss checked on every rank before its backward (a sync per step), so a
        nan/inf stops the run there, with a trace of the operation that made it; None otherwise."""
        return self._check_micro_step if self.debug_switches.check_micro_steps else None

    def begin(self, start_step: int, checkpoints: CheckpointManager, train_loader) -> None:
        """Once the start is agreed: the guard's log continued (a resume) or forgotten; a nan/inf input becomes its
        step's anomaly, its sample named by the loader."""
        self.checkpoints = checkpoints
        if self.guard is not None:
            self.guard.begin(start_step)
        if self.step_guard is not None:
            train_loader.report_bad_inputs(self.guard.bad_input)

    def restart(self, start_step: int, losses: LossAccumulator) -> None:
        """At the start of each ``fit`` (again after a rollback): the steps from ``start_step`` on, whose losses
        ``losses`` (the step's) keeps; a nan/inf loss is noticed at the next sync point."""
        if self.guard is not None:
            self.guard.restart(start_step)
        self.watch, self.losses = LossWatch(self.accelerator, start_step), losses

    def step_done(self) -> None:
        """Every optimizer step: its losses, kept for the watch (no device work; checked at the sync points)."""
        self.watch.after_step(self.losses.step_values)

    def check(self, step: int) -> None:
        """Before every save and evaluation, at a log line whose loss is not finite, and before the final outputs
        (collective): the guard's pending decisions, then a nan/inf loss on any rank, then a broken loss sum."""
        if self.guard is not None:  # the skipped steps' lines and records; stop or roll back (syncs here anyway)
            self.guard.resolve(step, self.checkpoints.newest())
        if (bad := self.watch.first_bad_step(step)) is not None:
            raise non_finite_loss(bad, self.checkpoints.last_saved_folder)
        if (problem := self.losses.empty_sum_problem()) is not None:  # a sum over 0 items trained as a raw sum
            raise ConfigError(problem)

    def logged_loss(self, step: int) -> float:
        """A log step's mean loss over every rank (the one host sync of a log line), the skipped steps left out;
        the guard's spike check on it; a loss that is not finite is checked (and stops the run) before it is logged."""
        guard = self.guard
        skipped = guard.resolve(step, self.checkpoints.newest()) if guard is not None else 0  # one D2H copy more
        mean_loss = self.losses.mean_since_log(skipped)
        if guard is not None:
            guard.after_log(step, mean_loss, self.checkpoints.newest())  # --spike_factor: on the all-reduced loss
        if not math.isfinite(mean_loss):
            self.check(step)
        return mean_loss

    def roll_back(self, back: RolledBack, bar) -> int:
        """``--on_anomaly rollback``, every rank: reload ``back.folder`` (weights, optimizer, schedule, RNGs) and
        forget the metrics after it; the step to train on from (``fit`` replays from there, leaving out the recorded
        steps). ``bar``: the progress bar, whose count goes back too."""
        step = self.checkpoints.resume(back.folder)
        self.recorder.rewind(step)
        bar.n = step  # tqdm's count: the replayed steps are counted again
        return step

    def summary(self) -> dict[str, int]:
        """summary.json's counts of skipped steps and rollbacks (none without a guard)."""
        return self.guard.summary() if self.guard is not None else {}

    def _check_micro_step(self, loss: torch.Tensor, step: int) -> None:
        if self.watch.any_rank(loss):
            raise non_finite_loss(step, self.checkpoints.last_saved_folder,
                                  trace_non_finite(self.accelerator, self.model, loss))
