"""Where a run starts: the one function that decides it (fresh, resumed, already finished, refused).

    start = section_of(cfg, StartOptions)
    start_step = where_to_start(start, accelerator, checkpoints, optimizer, scheduler, plan.total_steps)
    start_step = agree_start(start, accelerator, checkpoints, (optimizer, scheduler, flags_win), total_steps, recorder,
                             resolved, block, preemption)  # that step; then the trackers, config.yaml, the block

Every rank gets the same answer or the same error: each decision is the main process's
(``main_process_decides``), or a collective read of the same checkpoint.
"""

from __future__ import annotations

import json
import os
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

from accelerate import Accelerator

from accel_ddp.checkpoint.manager import CheckpointManager, flags_in_force
from accel_ddp.checkpoint.storage import open_store
from accel_ddp.config.views import config_section
from accel_ddp.lifecycle.failure import main_process_decides
from accel_ddp.lifecycle.preemption import PreemptionWatcher
from accel_ddp.outputs.names import CHECKPOINTS_DIR
from accel_ddp.outputs.run_dir import refuse_to_overwrite_finished, stop_if_finished
from accel_ddp.tracking.recorder import RunRecorder
from accel_ddp.tracking.startup_block import StartupBlock, resumed_from


@config_section
@dataclass(frozen=True)
class StartOptions:
    """The options that say where a run starts and what it resumes from (read by ``auto_batch`` too: a resume reuses
    its checkpoint's micro-batch)."""

    resume_from_checkpoint: str | None
    output_dir: str
    checkpoint_dir: str | None
    store_timeout: float
    global_batch_size: int | None  # resolved by the batch layout before a run starts: what a finished run compares
    tracker_project_name: str
    tracker_start_timeout: float


def where_to_start(start: StartOptions, accelerator: Accelerator, checkpoints: CheckpointManager, optimizer: Any,
                   scheduler: Any, total_steps: int, flags_win: bool = True) -> int:
    """The optimizer step this run starts after: 0 for a fresh start, else the resumed checkpoint's step.

    - ``--resume_from_checkpoint`` and the folder's run already did what this one asks: ``RunFinished``
      (nothing to do, nothing touched);
    - resumed: weights, optimizer, schedule, scaler and every rank's RNG from the checkpoint, with this
      run's lr, schedule and weight decay winning (``flags_in_force``, a warning where they differ), unless
      ``flags_win`` is False (a user's LR scheduler, ``train(lr_scheduler=...)``: it sets the LR, and its state
      and the optimizer's groups are restored as saved);
    - fresh: refused where the folder holds checkpoints of another run;
    - from step 0 either way: refused where it would overwrite a finished run's outputs.
    """
    if start.resume_from_checkpoint:
        stop_if_finished(accelerator, start.output_dir, total_steps, start.global_batch_size)
        with flags_in_force(optimizer, scheduler) if flags_win else nullcontext():
            start_step = checkpoints.resume(start.resume_from_checkpoint)
    else:
        checkpoints.check_fresh_start()
        start_step = 0
    if start_step == 0:
        refuse_to_overwrite_finished(accelerator, start.output_dir)
    return start_step


def recorded_layout(start: StartOptions, accelerator: Accelerator) -> dict[str, Any] | None:
    """The run facts (``per_device_batch_size``, ``grad_accum_steps``, ...) recorded in the checkpoint that
    ``--resume_from_checkpoint`` will resume from, read before anything is built, in OUTPUT_DIR/checkpoints or
    the ``--checkpoint_dir`` store (collective: the main process reads, every rank gets the answer); None for a
    fresh start or where there is no readable checkpoint.

    A quiet look at ``checkpoint.json`` only (no file hashed: ``where_to_start`` later proves the checkpoint
    whole, makes the real choice, with its messages and refusals). Where the newest one proves damaged and
    ``auto`` falls back to an older one, that one is of the same run: the same size was recorded.
    """
    if not start.resume_from_checkpoint:
        return None

    def look() -> dict[str, Any] | None:
        # Where the checkpoints are sealed: OUTPUT_DIR/checkpoints, or --checkpoint_dir's store (whose staging
        # folder holds only .tmp-* and .fetched/ debris, never a sealed checkpoint)
        staging = os.path.join(start.output_dir, CHECKPOINTS_DIR)
        store = open_store(start.checkpoint_dir or staging, staging, start.store_timeout)
        spec = start.resume_from_checkpoint
        folders = [folder for _, folder in reversed(store.sealed())] if spec == "auto" else [spec]
        for folder in folders:
            try:
                meta = json.loads(store.manifest(folder))
            except (OSError, ValueError):
                continue
            if isinstance(meta, dict):
                return meta
        return None

    return main_process_decides(accelerator, look)


def agree_start(start: StartOptions, accelerator: Accelerator, checkpoints: CheckpointManager, state: tuple,
                total_steps: int, recorder: RunRecorder, resolved: dict[str, Any], block: StartupBlock,
                preemption: PreemptionWatcher) -> int:
    """The step this run starts after (every rank agrees: checkpoint/start.py), then the trackers, the config and
    the start-up block: nothing an earlier run left is touched before the start point is known. ``resolved``: what
    config.yaml holds, every option and (``resolved:``) the run's facts; the trackers get it too."""
    optimizer, scheduler, flags_win = state
    # A finished run (RunFinished): its one line is said (outputs/run_dir.py), not the block; nothing written.
    start_step = where_to_start(start, accelerator, checkpoints, optimizer, scheduler, total_steps, flags_win)
    block.start = resumed_from(start_step, checkpoints.last_saved_folder) if start_step else "fresh"
    # One that cannot start (or not within --tracker_start_timeout): exit 2 here; a SIGTERM meanwhile: exit 75.
    recorder.start_trackers(start.tracker_project_name, resolved, start_step, start.tracker_start_timeout,
                            preemption)
    # Only now, with the input checked and the start point agreed, touch what earlier runs left.
    recorder.rewind(start_step)  # metrics past the checkpoint belong to the lost steps
    recorder.write_config({**resolved, "startup": block.as_dict()})  # replay (--config) ignores startup:
    recorder.write_startup(block.text(), start_step)
    block.say(accelerator.is_main_process)
    return start_step
