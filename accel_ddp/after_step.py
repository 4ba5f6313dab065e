"""What happens after optimizer step N: log, evaluate, save, stop, roll back.

``fit`` (loop.py) drives the steps; the parts here decide what follows each one: the stop points (a nan/inf loss,
a broken loss sum, a preemption signal, each checked where every rank syncs anyway), the evaluations (and the best
model's ranking), the saves, and the rollback of ``--on_anomaly rollback``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn

import torch
from tqdm.auto import tqdm

from accel_ddp.anomaly import RolledBack
from accel_ddp.assemble import Run
from accel_ddp.evaluate import evaluate
from accel_ddp.lifecycle.non_finite import LossWatch, NonFiniteLoss, trace_non_finite
from accel_ddp.lifecycle.preemption import Preempted, PreemptionWatcher
from accel_ddp.step import TrainStep
from accel_ddp.tracking.step_log import StepLog
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


def step_parts(run: Run, step: int) -> tuple[LossWatch, TrainStep, StopPoints, StepLog]:
    """What ``fit`` drives from ``step`` on: the non-finite watch, the optimizer step, the stop points, the log."""
    watch = LossWatch(run.accelerator, step)  # a nan/inf loss is noticed at the next sync point, named by its step
    guard = run.anomalies  # --on_anomaly skip|rollback: bad steps' updates left out (anomaly.py)
    if guard is not None:
        guard.restart(step)
    steps = TrainStep(run.accelerator, run.model, run.task, run.optimizer, run.scheduler, run.plan.accumulation,
                      run.cfg.global_batch_size, run.cfg.max_grad_norm, step, check_loss=_debug_check(run, watch),
                      guard=guard if guard is not None and guard.skips else None,  # stop + --spike_factor: logs only
                      per_device_batch=run.plan.per_device_batch)
    stops = StopPoints(run.checkpoints, run.preemption, watch, steps.losses, run.bar, run.plan.total_steps, guard)
    return watch, steps, stops, StepLog(run, steps.losses, guard)


class Evaluations:
    """The run's evaluations: every ``--eval_every`` steps or epoch, and the final weights once.

    Each is ranked for the best model and early stopping (``checkpoint/best.py``) on the gathered metrics, so
    every rank decides the same."""

    def __init__(self, run: Run, stops: StopPoints):
        self.run, self.stops, self.best = run, stops, run.checkpoints.best
        self.metrics: dict[str, Any] = {}
        self.at: int | None = None  # the step of the last evaluation

    @property
    def stopped_early(self) -> bool:
        return bool(self.best) and self.best.stopped_at is not None

    def now(self, step: int, epoch: int) -> bool:
        """Evaluate after ``step``; True: early stopping ends the run here, on every rank alike."""
        self.stops.if_not_finite(step)
        self.metrics, self.at = evaluate_and_log(self.run, step, epoch), step
        if self.best and self.best.after_eval(self.metrics, step):
            return True
        self.stops.if_preempted(step)  # the evaluation was finished: its metrics are logged, then the step saved
        return False

    def final(self, step: int, epoch: int) -> dict[str, Any]:
        """The final weights' metrics: evaluated unless the last evaluation was of this step (a candidate for the
        best model too); also for a run resumed from its last step's checkpoint."""
        if self.run.eval_loader is not None and self.at != step:
            self.metrics = evaluate_and_log(self.run, step, epoch)
            if self.best:
                self.best.after_eval(self.metrics, step)
        return self.metrics


def _debug_check(run: Run, watch: LossWatch) -> Callable[[torch.Tensor, int], None] | None:
    """``--debug``: every micro-step's loss is checked on every rank (a sync per step), so a nan/inf stops the run
    before its backward, with a trace of the operation that made it; None otherwise (checked at sync points)."""
    if not run.cfg.debug:
        return None

    def check(loss: torch.Tensor, step: int) -> None:
        if watch.any_rank(loss):
            raise NonFiniteLoss(step, run.checkpoints.last_saved_folder, trace_non_finite(run.accelerator, run.model,
                                                                                          loss))

    return check


def evaluate_and_log(run: Run, step: int, epoch: int) -> dict[str, Any]:
    """Evaluate on every rank, log the metrics (main process) and return them."""
    # Evaluation must not move the training RNG stream (its loader draws a seed): a resumed run skips
    # the evaluations that came before its checkpoint and must still replay the same dropout masks.
    with torch.random.fork_rng(devices=[]):
        metrics = evaluate(run.accelerator, run.model, run.eval_loader, run.task)
    run.recorder.log({"step": step, "epoch": epoch, **metrics})
    if run.accelerator.is_main_process:
        shown = " ".join(f"{k} {v:.4f}" for k, v in metrics.items() if isinstance(v, float))
        shown = shown if metrics.get("eval_loss") is not None else f"no eval items {shown}".strip()  # a null loss
        tqdm.write(f"step {step} epoch {epoch}: {shown} ({metrics['eval_samples']} samples)")
    return metrics


def roll_back(checkpoints, recorder, bar, back: RolledBack) -> int:
    """Every rank: reload ``back.folder`` (weights, optimizer, schedule, RNGs) and forget the metrics after it;
    the step to train on from (``fit`` replays from there, leaving out the recorded steps)."""
    step = checkpoints.resume(back.folder)
    recorder.rewind(step)
    bar.n = step  # tqdm's count: the replayed steps are counted again
    return step
