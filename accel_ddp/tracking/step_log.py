"""What each optimizer step leaves behind on the host: the progress bar, step times, the profile, log lines.

    log = StepLog(run, losses, section_of(cfg, StepLogOptions))
    log.step_done(step)                       # after every optimizer step: timers, the profile, the bar
    log.line(step, epoch, mean_loss)          # at a log step (accel_ddp/after_step.py decides which, and the loss);
                                              # --log_every given: also printed, step 20 epoch 0: loss 0.29 lr 0.003
    log.paused(step)                          # after an evaluation or a save: not training time
    log.epoch_done(step, epoch)               # the epoch's step-time figures and peak memory (collective)

Host clocks only: the logged loss (the one host sync of a log line) is read by the caller.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from accel_ddp.config.views import config_section
from accel_ddp.tracking.meters import EpochTimer, StepProfiler, ThroughputMeter, end_progress, memory_record
from accel_ddp.util.messages import write


@config_section
@dataclass(frozen=True)
class StepLogOptions:
    """The options the step log reads (``global_batch_size``: the resolved run's, never None here)."""

    global_batch_size: int | None
    tf32: bool
    profile: bool
    output_dir: str


class StepLog:
    def __init__(self, run: Any, losses: Any, options: StepLogOptions):
        self.run, self.losses = run, losses
        # samples/s, real tokens/s, model FLOP/s and MFU between log lines (tracking/meters.py, tracking/flops.py)
        self.meter = ThroughputMeter.for_run(run.accelerator, run.model, options.global_batch_size,
                                             run.accelerator.mixed_precision, options.tf32, run.start_step)
        self.tokens = run.task.counts_tokens  # a token task: its real tokens are the loss's items
        self.timer = EpochTimer(options.global_batch_size)  # per-epoch step-time percentiles and data-wait share
        self.profiler = StepProfiler(options.profile, options.output_dir, run.accelerator.process_index)

    def step_done(self, step: int) -> None:
        """After optimizer ``step``: timers, the start-up clock's first step, the profile, the bar."""
        run = self.run
        self.timer.step_done()
        if step == run.start_step + 1:
            run.startup.mark("first_step")
        self.profiler.step()
        run.bar.update(1)

    def line(self, step: int, epoch: int, mean_loss: float) -> None:
        """A log step's line: ``mean_loss`` (all-reduced), the learning rate and the throughput since the last."""
        run = self.run
        tokens = self.losses.logged_items if self.tokens else None  # real tokens, all ranks
        lr = float(run.scheduler.get_last_lr()[0])  # a tensor under --cuda_graphs (the capturable AdamW's)
        run.recorder.log({"step": step, "epoch": epoch, "loss": mean_loss, "lr": lr,
                          **self.meter.record(step, tokens, self.losses.logged_steps)})
        run.bar.set_postfix(loss=f"{mean_loss:.4f}", refresh=False)  # shown at the bar's next redraw (<= 0.1 s)
        if run.plan.cadence.log_lines and run.accelerator.is_main_process:  # the Trainer's --logging_steps line
            write(f"step {step} epoch {epoch}: loss {mean_loss:.4f} lr {lr:.4g}", above_bar=True)  # as eval lines

    def paused(self, step: int) -> None:
        """After an evaluation or a checkpoint: neither is training throughput nor step time."""
        self.meter.reset(step)
        self.timer.pause()

    def epoch_done(self, step: int, epoch: int) -> None:
        self.run.recorder.log({"step": step, "epoch": epoch, **self.timer.end_epoch(),
                               **memory_record(self.run.accelerator)})

    def close(self) -> None:
        """The loop's end: the bar's line ended before ``finish`` and the callbacks write. Any other exit (an error,
        a stop) ends it in the teardown, first (``assemble._watches``); both through ``end_progress``."""
        end_progress(self.run.bar)
        self.profiler.stop()
