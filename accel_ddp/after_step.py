"""What happens after optimizer step N: log, evaluate, save, stop, roll back; and the non-finite loss policy.

``fit`` (loop.py) feeds batches to the optimizer step; after each step it completes, ``AfterStep`` decides, on every
rank alike, what follows, when the run's plan says so (``plan.cadence``: decided once from the options):

    after = AfterStep(run, step)           # the optimizer step (after.steps) and what follows each one
    after.step_done(step, epoch)           # log line, preemption, evaluation, save; True: the epoch ends here
    after.epoch_done(step, epoch)          # the epoch's record, its evaluation and save; True: the run ends here
    metrics = after.finish(step)           # the last check, the final evaluation, the last save sealed

Every decision that needs the other ranks is a collective at a point every rank reaches at the same step
(tests/test_after_step.py pins their order). A preemption signal stops the run after the step it was agreed on, or
after the evaluation or save during which it came, with that step saved (``Preempted``).

The non-finite policy (``NonFinite``): each step's losses are kept and checked on the device (``LossWatch``) and
acted on where the loop syncs anyway: at a log line whose loss is not finite, before every evaluation and save, and
before the final outputs (every rank raises ``NonFiniteLoss``, exit 3, nothing saved after the bad step); with
``--debug`` every micro-step's loss is checked before its backward, with a trace of the operation that made it.
Under ``--on_anomaly skip|rollback`` (or ``--spike_factor``) the guard (anomaly.py) reads its per-step decisions at
the same points and skips, stops (``AnomalyStop``) or rolls back (``RolledBack``: ``train()`` reloads the checkpoint
with ``roll_back``). A ``(sum, num_items)`` loss that summed over no items is refused there too (exit 2).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NoReturn

import torch

from accel_ddp.anomaly import AnomalyGuard, RolledBack
from accel_ddp.assemble import Run
from accel_ddp.config.debug import debug_mode
from accel_ddp.evaluation import evaluate
from accel_ddp.lifecycle.non_finite import LossWatch, NonFiniteLoss, trace_non_finite
from accel_ddp.lifecycle.preemption import Preempted
from accel_ddp.step.graph import CudaGraphs
from accel_ddp.step.losses import LossAccumulator
from accel_ddp.step.train_step import TrainStep
from accel_ddp.tracking.step_log import StepLog
from accel_ddp.util.messages import write
from accel_ddp.util.validation import ConfigError


class NonFinite:
    """The non-finite policy, whole: where a nan/inf loss (or a broken loss sum, or an anomaly) stops every rank."""

    def __init__(self, run: Run, watch: LossWatch, losses: LossAccumulator, guard: AnomalyGuard | None):
        self.checkpoints, self.watch, self.losses, self.guard = run.checkpoints, watch, losses, guard

    @staticmethod
    def micro_step_check(run: Run, watch: LossWatch) -> Callable[[torch.Tensor, int], None] | None:
        """``--debug``: every micro-step's loss is checked on every rank (a sync per step), so a nan/inf stops the run
        before its backward, with a trace of the operation that made it; None otherwise (checked at sync points)."""
        if not debug_mode(run.cfg).check_micro_steps:
            return None

        def check(loss: torch.Tensor, step: int) -> None:
            if watch.any_rank(loss):
                raise NonFiniteLoss(step, run.checkpoints.last_saved_folder,
                                    trace_non_finite(run.accelerator, run.model, loss))

        return check

    def after_step(self) -> None:
        """Every optimizer step: its losses, kept for the watch (no device work; checked at the sync points)."""
        self.watch.after_step(self.losses.step_values)

    def check(self, step: int) -> None:
        """Before every save and evaluation, at a log line whose loss is not finite, and before the final outputs
        (collective): the guard's pending decisions, then a nan/inf loss on any rank, then a broken loss sum."""
        if self.guard is not None:  # the skipped steps' lines and records; stop or roll back (syncs here anyway)
            self.guard.resolve(step, self.checkpoints.newest())
        if (bad := self.watch.first_bad_step(step)) is not None:
            raise NonFiniteLoss(bad, self.checkpoints.last_saved_folder)
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


class AfterStep:
    """What follows each optimizer step of ``fit``, from ``start_step`` on (built again after a rollback)."""

    def __init__(self, run: Run, start_step: int):
        self.run, self.plan, self.cadence = run, run.plan, run.plan.cadence
        self.checkpoints, self.best = run.checkpoints, run.checkpoints.best
        guard = run.anomalies  # --on_anomaly skip|rollback: bad steps' updates left out (anomaly.py)
        if guard is not None:
            guard.restart(start_step)
        watch = LossWatch(run.accelerator, start_step)  # a nan/inf loss is noticed at the next sync point
        self.steps = TrainStep(run.accelerator, run.model, run.task, run.optimizer, run.scheduler,
                               run.plan.accumulation, run.cfg.global_batch_size, run.cfg.max_grad_norm, start_step,
                               check_loss=NonFinite.micro_step_check(run, watch),
                               guard=guard if guard is not None and guard.skips else None,  # stop: spikes only
                               per_device_batch=run.plan.per_device_batch,
                               graphs=CudaGraphs() if run.cfg.cuda_graphs else None)  # --cuda_graphs: checked in setup
        self.non_finite = NonFinite(run, watch, self.steps.losses, guard)
        if guard is not None and guard.skips:  # a nan/inf input: its step's anomaly, its sample named by the loader
            run.train_loader.report_bad_inputs(guard.bad_input)
        self.log = StepLog(run, self.steps.losses)
        self.callbacks = run.callbacks  # --callbacks, train(callbacks=): their hooks and requests (callbacks.py)
        self.eval_metrics: dict[str, Any] = {}  # the last evaluation's
        self.evaluated_at: int | None = None  # the step of the last evaluation

    def step_done(self, step: int, epoch: int) -> bool:
        """After optimizer ``step`` (collective where the cadence says): the log line, the preemption flags, the
        evaluation, the save. True: the epoch ends here (early stopping, or the run's last step)."""
        run, cadence = self.run, self.cadence
        run.hang.step_done(step)  # --hang_timeout: the watch's deadline moves (an attribute store)
        self.non_finite.after_step()
        self.log.step_done(step)
        asked = self.callbacks.step_end(step, epoch)  # on_step_end; with callbacks, what any rank asked (collective)
        if cadence.logs(step, self.plan.total_steps) or asked.stop:  # a stop's step is logged, as the last step is
            self.log.line(step, epoch, self.non_finite.logged_loss(step))
        if run.preemption.stop_requested():  # ranks compare flags every ~1 s: all stop after the same step
            self.stop(step)
        if cadence.evaluates(step) or asked.evaluate:
            if self.evaluate(step, epoch):
                return True
            self.log.paused(step)
        if cadence.saves(step) or asked.save:  # asked: by on_step_end, or by on_evaluate just now
            self.if_preempted(step, self.save(step))  # a signal during the save: it completes, then all stop
            self.log.paused(step)
        return step >= self.plan.total_steps or self.callbacks.stopped_at is not None

    def epoch_done(self, step: int, epoch: int) -> bool:
        """After ``epoch``'s last step: its record, its evaluation and save. True: early stopping ended the run."""
        self.log.epoch_done(step, epoch)
        if self.stopped_early:  # within the epoch
            return True
        if self.cadence.eval_at_epoch_end and self.evaluated_at != step and self.evaluate(step, epoch):
            return True
        if self.cadence.save_at_epoch_end and step == (epoch + 1) * self.plan.steps_per_epoch \
                or self.callbacks.asked.save:  # a callback's on_evaluate asked for it just now
            self.if_preempted(step, self.save(step))
        self.log.meter.reset(step)  # the next log line's samples/s leaves out this epoch's evaluation and checkpoint
        return self.stopped_early  # a callback's on_evaluate may have asked to stop

    def finish(self, step: int) -> dict[str, Any]:
        """After the last step: checked before ``finish()`` exports the weights, the final weights' metrics, the
        last save sealed (--async_checkpointing). Returns the last evaluation's metrics (empty without an eval set)."""
        self.log.close()
        self.non_finite.check(step)
        metrics = self.final_evaluation(step, max(step - 1, 0) // self.plan.steps_per_epoch)  # its last step's epoch
        self.checkpoints.wait()
        return metrics

    # ---- evaluations: ranked for the best model and early stopping (checkpoint/best.py) on the gathered metrics,
    # so every rank decides the same

    @property
    def stopped_early(self) -> bool:
        """Early stopping, or a callback's should_stop, ended the run before its last step."""
        return bool(self.best) and self.best.stopped_at is not None or self.callbacks.stopped_at is not None

    def evaluate(self, step: int, epoch: int) -> bool:
        """Evaluate after ``step``; True: early stopping ends the run here, on every rank alike."""
        self.non_finite.check(step)
        self.eval_metrics, self.evaluated_at = evaluate_and_log(self.run, step, epoch), step
        self.callbacks.evaluated(step, epoch, self.eval_metrics)  # on_evaluate; a stop or save asked there: now
        if self.best and self.best.after_eval(self.eval_metrics, step):
            return True
        self.if_preempted(step)  # the evaluation was finished: its metrics are logged, then the step saved
        return False

    def final_evaluation(self, step: int, epoch: int) -> dict[str, Any]:
        """The final weights' metrics: evaluated unless the last evaluation was of this step (a candidate for the
        best model too); also for a run resumed from its last step's checkpoint."""
        if self.run.eval_loader is not None and self.evaluated_at != step:
            self.eval_metrics = evaluate_and_log(self.run, step, epoch)
            self.callbacks.evaluated(step, epoch, self.eval_metrics, during_training=False)
            if self.best:
                self.best.after_eval(self.eval_metrics, step)
        return self.eval_metrics

    # ---- saves and stops

    def save(self, step: int) -> str:
        """A checkpoint of ``step``; a nan/inf state is never saved."""
        self.non_finite.check(step)
        try:
            folder = self.checkpoints.save(step)
        except ConfigError as err:  # raised on every rank at once (the save's collectives carry it)
            preemption = self.run.preemption
            if not preemption.agree():
                raise
            # A signal came during a save that failed (a store cut short, a full disk): a stop, not bad input
            raise Preempted(preemption.reason, step, self.checkpoints.last_saved_folder, unsaved=str(err),
                            signal_name=preemption.signal_name) from err
        self.callbacks.saved(step, max(step - 1, 0) // self.plan.steps_per_epoch, folder)  # on_save
        return folder

    def stop(self, step: int, saved: str | None = None) -> NoReturn:
        """Preempted: every rank saves this step (unless ``saved`` already holds it), then stops."""
        checkpoint = saved or self.save(step)
        self.checkpoints.wait()  # --async_checkpointing: the checkpoint is sealed before the exit
        preemption = self.run.preemption
        raise Preempted(preemption.reason, step, checkpoint, signal_name=preemption.signal_name)

    def if_preempted(self, step: int, saved: str | None = None) -> None:
        """After an evaluation or a save, which every rank runs at the same step: a signal that came during it
        stops the run now, with this step's checkpoint, not at the next comparison's step. After the last
        step the run finishes instead (what a relaunch would do)."""
        if step < self.plan.total_steps and self.run.preemption.agree():
            self.stop(step, saved)


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
        write(f"step {step} epoch {epoch}: {shown} ({metrics['eval_samples']} samples)", above_bar=True)
    return metrics


def roll_back(run: Run, back: RolledBack) -> int:
    """``--on_anomaly rollback``, every rank: reload ``back.folder`` (weights, optimizer, schedule, RNGs) and forget
    the metrics after it; the step to train on from (``fit`` replays from there, leaving out the recorded steps)."""
    step = run.checkpoints.resume(back.folder)
    run.recorder.rewind(step)
    run.bar.n = step  # tqdm's count: the replayed steps are counted again
    return step
