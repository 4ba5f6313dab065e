"""The training run, read top to bottom: ``setup`` (accel_ddp/assemble.py) -> ``fit`` (what follows each optimizer
step: accel_ddp/after_step.py) -> ``finish``.

``train()`` is the Python API; ``main()`` the CLI (returns an exit code); ``run()`` the script
entry point (``train.py``, ``accel-ddp train``), which exits the process safely.

    accelerate launch --config_file accelerate_configs/cpu_2proc.yaml train.py --dataset digits

    from accel_ddp import TrainConfig, train
    summary = train(TrainConfig(epochs=3), model=my_model, train_dataset=ds, eval_dataset=ds_eval)
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import Dataset

from accel_ddp.after_step import AfterStep
from accel_ddp.assemble import Run, build_train_step, setup
from accel_ddp.bad_steps import AnomalyStop, RolledBack
from accel_ddp.checkpoint.weights import export_weights
from accel_ddp.config import TrainConfig
from accel_ddp.lifecycle.preemption import PreemptionWatcher
from accel_ddp.models import export_pretrained
from accel_ddp.outputs.files import WriteFailed
from accel_ddp.outputs.model_card import launch_command, write_model_card
from accel_ddp.outputs.run_dir import (
    RunFinished,
)
from accel_ddp.tasks.arguments import ArgumentError, a_kind, check_arguments
from accel_ddp.tracking.console_log import ConsoleLog
from accel_ddp.tracking.meters import (
    EpochTimer,
    ThroughputMeter,
    largest,
    memory_record,
    timed,
)


def train(
    cfg: TrainConfig,
    model: torch.nn.Module | None = None,
    train_dataset: Dataset | None = None,
    eval_dataset: Dataset | None = None,
    *,
    loss_fn: Callable[[Any, Any], Any] | None = None,
    metrics: Sequence[Any] = (),
    collate_fn: Callable[[list], Any] | None = None,
    preemption: PreemptionWatcher | None = None,
    optimizer: Any = None,
    lr_scheduler: Any = None,
    callbacks: Sequence[Any] = (),
    console: ConsoleLog | None = None,
) -> dict[str, Any]:
    """Train on every rank of the current launch; return the summary (the same on every rank).

    ``model`` and the datasets default to those named in ``cfg``. Datasets yield ``(input,
    label)`` pairs or dicts of tensors (``model(**batch)``), batched by ``collate_fn`` (default:
    dicts padded per batch); without ``eval_dataset`` no evaluation runs. ``loss_fn(outputs,
    batch)`` returns a mean or a ``(sum, num_items)`` pair; ``metrics`` are objects with
    ``update(outputs, batch)`` and ``compute() -> dict`` (see :mod:`accel_ddp.tasks.protocol`). ``optimizer``: a
    function of the parameter groups returning a ``torch.optim.Optimizer``, or one built on ``model.parameters()``;
    ``lr_scheduler``: a function of the optimizer returning an ``LRScheduler``, stepped once per optimizer step
    instead of the built-in schedule; both are checkpointed and restored (:mod:`accel_ddp.optim.user`).
    ``callbacks``: objects (or classes) with any of ``on_train_begin(state)``, ``on_step_end(state)``,
    ``on_evaluate(state, metrics)``, ``on_save(state, checkpoint_dir)``, ``on_train_end(state, summary)``, called on
    every rank; a request (``state.should_stop/should_save/should_evaluate``) on any rank is every rank's
    (:mod:`accel_ddp.callbacks`). On SIGTERM or
    SIGUSR1 every rank stops after the same optimizer step, saves a checkpoint and raises ``Preempted``
    (``preemption``: the watcher ``main()`` installed before parsing the options; None: one is installed now).
    What the main process prints goes to ``OUTPUT_DIR/run.log`` too (``console``: the CLI's, which outlives the
    run for its last line; None: one for the length of this call).
    An error in a launch of several ranks is recorded on the ranks' store before the process group goes
    (:func:`accel_ddp.lifecycle.failure.claim`); from then on this process records SIGTERM and SIGUSR1 instead of
    dying of them: the launcher is stopping every rank, and ``main()`` reports, then exits.
    """
    _check_config(cfg)  # a wrong kind: one line naming it, nothing built
    check_arguments(model, train_dataset, eval_dataset, model_name=cfg.model, dataset_name=cfg.dataset)
    with ExitStack() as teardown:  # on any exit: signal handlers back, files closed, lock and process group gone
        try:
            run = setup(cfg, teardown, model, train_dataset, eval_dataset, loss_fn=loss_fn, metrics=metrics,
                        collate_fn=collate_fn, preemption=preemption, optimizer=optimizer, lr_scheduler=lr_scheduler,
                        callbacks=callbacks, console=console)
        except RunFinished as done:  # the same command again after the run ended: nothing to do, nothing touched
            return done.summary
        run.callbacks.train_begin(run.start_step)
        while True:
            try:
                return finish(run, fit(run))
            except RolledBack as back:  # --on_anomaly rollback: every rank reloads the checkpoint and trains on
                run.start_step = run.bad_steps.roll_back(back, run.bar)
            except AnomalyStop:  # it names the newest checkpoint, maybe one in flight: sealed before the exit
                run.checkpoints.wait()
                raise
            except WriteFailed as err:  # a metrics line on a disk that an async save filled: the save is the news
                failed = run.checkpoints.failed_save(err)
                if failed is err:
                    raise
                raise failed from err


def _check_config(cfg: object) -> None:
    """``cfg=`` a TrainConfig, else ``ArgumentError`` saying how to build one (a dict's fields fail deep inside)."""
    if not isinstance(cfg, TrainConfig):
        how = "TrainConfig(**your_dict)" if isinstance(cfg, Mapping) else \
            "TrainConfig(...), or accel_ddp.cli.args.parse_args([flags])"
        raise ArgumentError(f"cfg= must be a TrainConfig, not {a_kind(cfg)}; build one with {how}")


@dataclass
class FitResult:
    step: int  # optimizer steps done
    eval_metrics: dict[str, Any]  # the last evaluation's, empty without an eval set
    timer: EpochTimer  # step times and data-wait share over the run
    meter: ThroughputMeter  # tokens, model FLOPs and MFU over the run


def fit(run: Run) -> FitResult:
    """The training loop, from ``run.start_step`` to the last optimizer step.

    ``micro_step`` = one forward/backward per rank; ``step`` = one optimizer step over the global batch.
    Every rank takes the same branches at the same step: what follows a step (log lines, evaluations, saves, stops:
    accel_ddp/after_step.py) is decided by the plan's cadence and by collectives.
    """
    plan = run.plan
    step = run.start_step  # epochs have a fixed number of steps, so the step alone says where we are
    steps = build_train_step(run, step)  # the optimizer step: forward, backward, update
    after = AfterStep(run, steps.losses, step)  # what follows each one
    log = after.log
    for epoch in range(step // plan.steps_per_epoch, plan.num_epochs):
        if step >= plan.total_steps:  # resumed from the last step's checkpoint
            break
        run.model.train()
        # A new permutation each epoch, identical on every rank; a resumed epoch skips what was trained on.
        skip = (step - epoch * plan.steps_per_epoch) * plan.accumulation
        log.timer.start_epoch()
        for batch in timed(_epoch_batches(run.train_loader, epoch, skip), log.timer):
            log.meter.add_batch(batch)  # host-side: the batch's shapes give its model FLOPs (cached per shape)
            if not steps.micro_step(batch):  # forward, backward; on the step's last micro-step the update
                continue
            step = steps.step
            if after.step_done(step, epoch):  # log, stop, evaluate, save; True: early stopping or the last step
                break
        if after.epoch_done(step, epoch):  # the epoch's record, evaluation and save; True: early stopping
            break
    eval_metrics = after.finish(step)  # checked, evaluated and sealed before finish() exports the weights
    return FitResult(step, eval_metrics, log.timer, log.meter)


def finish(run: Run, result: FitResult) -> dict[str, Any]:
    """Export the final weights, write summary.json and curves.png; return the summary."""
    best = run.checkpoints.best
    if best:  # --load_best_model_at_end: the best checkpoint's weights become the final ones (checkpoint/best.py)
        best.load_best(run.accelerator, run.model, run.checkpoints.local_folder, result.step)
    export_weights(run.accelerator, run.model, run.cfg.output_dir)
    export_pretrained(run.accelerator, run.model, run.tokenizer, run.cfg.output_dir,  # Transformers: hf_model/
                      merge_adapter=run.cfg.merge_adapter)  # --peft lora: adapter/ (and merged, hf_model/)
    timing = result.timer.totals()
    summary = {
        **run.facts,
        "optimizer_steps": result.step,
        "epochs": run.plan.num_epochs,
        "eval_accuracy": result.eval_metrics.get("eval_accuracy"),
        "eval_loss": result.eval_metrics.get("eval_loss"),
        "eval_samples": result.eval_metrics.get("eval_samples", 0),
        **result.eval_metrics,  # and the task's others: eval_perplexity, eval_tokens, user metrics
        "train_samples_per_sec": timing.pop("samples_per_sec", 0.0),
        **timing,  # step_time_p50_ms, step_time_p90_ms, data_wait_share, cpu_ms_per_step over the whole run
        "train_seconds": sum(result.timer.all_steps),
        **result.meter.summary(sum(result.timer.all_steps), len(result.timer.all_steps)),  # tokens/s, FLOP/s, MFU
        "elapsed_sec": time.perf_counter() - run.started,
        **_startup_figures(run),
        "lr_scheduler_steps": run.scheduler.scheduler.last_epoch,
        "resumed_from_step": run.start_step,
        **run.bad_steps.summary(),  # --on_anomaly: skipped steps, rollbacks
        **largest(memory_record(run.accelerator)),  # peak_rss_mb, peak_worker_rss_mb: max over ranks (MiB)
        **(best.summary(result.step) if best else {}),  # best_step, final_weights_step, stopped_early
        **run.callbacks.summary(),  # their names; stopped_early where one asked to stop
    }
    run.recorder.write_summary(summary, result.step)  # and to the trackers
    run.recorder.plot()  # OUTPUT_DIR/curves.png
    if run.accelerator.is_main_process:
        write_model_card(run.cfg.output_dir, run.cfg.to_dict(), summary, launch_command(sys.argv, os.environ))
    run.callbacks.train_end(result.step, max(result.step - 1, 0) // run.plan.steps_per_epoch, summary)
    return summary


def _startup_figures(run: Run) -> dict[str, Any]:
    """``startup_sec``: worker process start -> first optimizer step, the slowest rank's (collective); and
    ``startup_phases_sec``: this rank's by phase. None where the run did no step or /proc is missing."""
    phases = run.startup.phases()
    mine = run.startup.seconds() if "first_step" in phases else None
    seconds = torch.tensor([-1.0 if mine is None else mine], dtype=torch.float64, device=run.accelerator.device)
    slowest = run.accelerator.gather(seconds)
    return {"startup_sec": None if bool((slowest < 0).any()) else float(slowest.max()),
            "startup_phases_sec": {name: round(sec, 3) for name, sec in phases.items()}}


def _epoch_batches(loader, epoch: int, skip: int) -> Iterable:
    """The batches of ``epoch`` on this rank, without its first ``skip`` (those a checkpoint already holds).

    The one place that fast-forwards a loader. Every loader of ours computes where to start from the
    position alone (no RNG replay) and draws nothing from torch's global generator, so the resumed
    run's dropout stream continues exactly where the checkpoint's RNG state left it.
    """
    loader.set_epoch(epoch)
    return loader if skip == 0 else loader.skip_first_batches(skip)
