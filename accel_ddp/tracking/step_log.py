"""What each optimizer step leaves behind on the host: the progress bar, step times, the profile, log lines.

    log = StepLog(run, losses)
    log.step_done(step, epoch, on_bad_loss)   # after every optimizer step; a log line every --log_every steps
    log.paused(step)                          # after an evaluation or a save: not training time
    log.epoch_done(step, epoch)               # the epoch's step-time figures and peak memory (collective)

Host clocks only; the one host sync is the logged loss's (``LossAccumulator.mean_since_log``), at a log line.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from accel_ddp.tracking.meters import EpochTimer, StepProfiler, ThroughputMeter, memory_record


class StepLog:
    def __init__(self, run: Any, losses: Any, guard: Any = None):
        cfg = run.cfg
        self.run, self.losses = run, losses
        self.guard = guard  # --on_anomaly / --spike_factor: skipped steps left out of the mean, spikes judged
        self.log_every, self.total_steps = cfg.log_every, run.plan.total_steps
        # samples/s, real tokens/s, model FLOP/s and MFU between log lines (tracking/meters.py, tracking/flops.py)
        self.meter = ThroughputMeter.for_run(run.accelerator, run.model, cfg.global_batch_size,
                                             run.accelerator.mixed_precision, cfg.tf32, run.start_step)
        self.tokens = run.task.name == "causal_lm"  # a token task: its real tokens are the loss's items
        self.timer = EpochTimer(cfg.global_batch_size)  # per-epoch step-time percentiles and data-wait share
        self.profiler = StepProfiler(cfg.profile, cfg.output_dir, run.accelerator.process_index)

    def step_done(self, step: int, epoch: int, on_bad_loss: Callable[[int], None],
                  last_saved: Callable[[], Any] = lambda: None) -> None:
        """After optimizer ``step``: timers, the bar, and at a log step the log line (``on_bad_loss`` first where
        the loss is not finite: it raises on every rank, which all reach the same log step)."""
        run = self.run
        self.timer.step_done()
        if step == run.start_step + 1:
            run.startup.mark("first_step")
        self.profiler.step()
        run.bar.update(1)
        if step % self.log_every == 0 or step == self.total_steps:
            guard = self.guard
            skipped = guard.resolve(step, last_saved()) if guard is not None else 0  # one D2H copy more
            mean_loss = self.losses.mean_since_log(skipped)  # the one host sync: .item() stalls the GPU
            if guard is not None:
                guard.after_log(step, mean_loss, last_saved())  # --spike_factor: on the all-reduced loss
            if not math.isfinite(mean_loss):
                on_bad_loss(step)
            tokens = self.losses.logged_items if self.tokens else None  # real tokens, all ranks
            lr = float(run.scheduler.get_last_lr()[0])  # a tensor under --cuda_graphs (the capturable AdamW's)
            run.recorder.log({"step": step, "epoch": epoch, "loss": mean_loss, "lr": lr,
                              **self.meter.record(step, tokens, self.losses.logged_steps)})
            run.bar.set_postfix(loss=f"{mean_loss:.4f}", refresh=False)  # shown at the bar's next redraw (<= 0.1 s)

    def paused(self, step: int) -> None:
        """After an evaluation or a checkpoint: neither is training throughput nor step time."""
        self.meter.reset(step)
        self.timer.pause()

    def epoch_done(self, step: int, epoch: int) -> None:
        self.run.recorder.log({"step": step, "epoch": epoch, **self.timer.end_epoch(),
                               **memory_record(self.run.accelerator)})

    def close(self) -> None:
        self.run.bar.close()
        self.profiler.stop()
