"""What happens after optimizer step N: log, evaluate, save, stop.

``fit`` (loop.py) feeds batches to the optimizer step; after each step it completes, ``AfterStep`` decides, on every
rank alike, what follows, when the run's plan says so (``plan.cadence``: decided once from the options):

    after = AfterStep(run, steps.losses, step)  # steps: the TrainStep, built by fit (assemble.build_train_step)
    after.step_done(step, epoch)                # log line, preemption, evaluation, save; True: the epoch ends here
    after.epoch_done(step, epoch)               # the epoch's record, its evaluation and save; True: the run ends
    metrics = after.finish(step)                # the last check, the final evaluation, the last save sealed

Every decision that needs the other ranks is a collective at a point every rank reaches at the same step
(tests/test_after_step.py pins their order). A preemption signal stops the run after the step it was agreed on, or
after the evaluation or save during which it came, with that step saved (``Preempted``).

Bad steps (a nan/inf loss, ``--on_anomaly``, ``--spike_factor``: accel_ddp/bad_steps/) are told of every step
(``run.bad_steps.step_done``), give the log line its loss, and are checked before every evaluation and save and
before the final outputs: there the run stops (exit 3), skips, or rolls back (``RolledBack``, caught by ``train()``).
"""

from __future__ import annotations

from typing import Any, NoReturn

import torch

from accel_ddp.assemble import Run
from accel_ddp.config.views import section_of
from accel_ddp.evaluation import evaluate
from accel_ddp.lifecycle.preemption import Preempted
from accel_ddp.step.losses import LossAccumulator
from accel_ddp.tracking.step_log import StepLog, StepLogOptions
from accel_ddp.util.messages import write
from accel_ddp.util.validation import ConfigError


class AfterStep:
    """What follows each optimizer step of ``fit``, from ``start_step`` on (built again after a rollback); ``losses``:
    the step's (its running loss for the log lines and the bad steps' watch)."""

    def __init__(self, run: Run, losses: LossAccumulator, start_step: int):
        self.run, self.plan, self.cadence = run, run.plan, run.plan.cadence
        self.checkpoints, self.best = run.checkpoints, run.checkpoints.best
        self.bad_steps = run.bad_steps  # nan/inf losses, --on_anomaly: found, acted on, recorded (bad_steps/)
        self.bad_steps.restart(start_step, losses)
        self.log = StepLog(run, losses, section_of(run.cfg, StepLogOptions))
        self.callbacks = run.callbacks  # --callbacks, train(callbacks=): their hooks and requests (callbacks.py)
        self.eval_metrics: dict[str, Any] = {}  # the last evaluation's
        self.evaluated_at: int | None = None  # the step of the last evaluation

    def step_done(self, step: int, epoch: int) -> bool:
        """After optimizer ``step`` (collective where the cadence says): the log line, the preemption flags, the
        evaluation, the save. True: the epoch ends here (early stopping, or the run's last step)."""
        run, cadence = self.run, self.cadence
        run.hang.step_done(step)  # --hang_timeout: the watch's deadline moves (an attribute store)
        self.bad_steps.step_done()  # its losses kept for the watch (no device work)
        self.log.step_done(step)
        asked = self.callbacks.step_end(step, epoch)  # on_step_end; with callbacks, what any rank asked (collective)
        if cadence.logs(step, self.plan.total_steps) or asked.stop:  # a stop's step is logged, as the last step is
            self.log.line(step, epoch, self.bad_steps.logged_loss(step))
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
        self.bad_steps.check(step)
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
        self.bad_steps.check(step)
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
        self.bad_steps.check(step)
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
