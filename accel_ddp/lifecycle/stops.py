"""Where every rank stops together: a nan/inf loss, a broken ``(sum, num_items)`` loss, a preemption signal.

Each check is collective and runs where the loop syncs anyway (a log line, before a save or an
evaluation, the end): every rank reaches the same checks at the same optimizer step, so all of them
raise the same outcome, or none does.
"""

from __future__ import annotations

from typing import Any, NoReturn

from accel_ddp.lifecycle.non_finite import LossWatch, NonFiniteLoss
from accel_ddp.lifecycle.preemption import Preempted, PreemptionWatcher
from accel_ddp.util.validation import ConfigError


class StopPoints:
    """The loop's stops: ``if_not_finite`` (exit 3, or 2 for a broken loss), ``save``, ``stop`` (preempted),
    ``if_preempted`` (after an evaluation or a save)."""

    def __init__(self, checkpoints: Any, preemption: PreemptionWatcher, watch: LossWatch, losses: Any,
                 bar: Any, total_steps: int, guard: Any = None):
        self.checkpoints, self.preemption, self.watch, self.losses = checkpoints, preemption, watch, losses
        self.bar, self.total_steps = bar, total_steps
        self.guard = guard  # --on_anomaly / --spike_factor (anomaly.AnomalyGuard), or None

    def last_saved(self) -> tuple[int, str] | None:
        """(step, folder) of the newest checkpoint this run saved (one in flight included) or resumed from, or None."""
        return self.checkpoints.newest()

    def if_not_finite(self, step: int) -> None:
        """Before every save and evaluation, at a log line whose loss is not finite, and before the export."""
        if self.guard is not None:  # the skipped steps' lines and records; stop or roll back (syncs here anyway)
            self.guard.resolve(step, self.last_saved())
        if (bad := self.watch.first_bad_step(step)) is not None:
            raise NonFiniteLoss(bad, self.checkpoints.last_saved_folder)
        if (problem := self.losses.empty_sum_problem()) is not None:  # a sum over 0 items trained as a raw sum
            raise ConfigError(problem)

    def save(self, step: int) -> str:
        """A checkpoint of ``step``; a nan/inf state is never saved."""
        self.if_not_finite(step)
        return self.checkpoints.save(step)

    def stop(self, step: int, saved: str | None = None) -> NoReturn:
        """Preempted: every rank saves this step (unless ``saved`` already holds it), then stops."""
        checkpoint = saved or self.save(step)
        self.checkpoints.wait()  # --async_checkpointing: the checkpoint is sealed before the exit
        self.bar.close()
        raise Preempted(self.preemption.reason, step, checkpoint, signal_name=self.preemption.signal_name)

    def if_preempted(self, step: int, saved: str | None = None) -> None:
        """After an evaluation or a save, which every rank runs at the same step: a signal that came during it
        stops the run now, with this step's checkpoint, not at the next comparison's step. After the last
        step the run finishes instead (what a relaunch would do)."""
        if step < self.total_steps and self.preemption.agree():
            self.stop(step, saved)
