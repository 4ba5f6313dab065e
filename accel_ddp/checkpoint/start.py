"""Where a run starts: the one function that decides it (fresh, resumed, already finished, refused).

    start_step = where_to_start(cfg, accelerator, checkpoints, optimizer, scheduler, plan.total_steps)

Every rank gets the same answer or the same error: each decision is the main process's
(``main_process_decides``), or a collective read of the same checkpoint.
"""

from __future__ import annotations

from typing import Any

from accelerate import Accelerator

from accel_ddp.checkpoint.manager import CheckpointManager, flags_in_force
from accel_ddp.config import TrainConfig
from accel_ddp.outputs.run_dir import refuse_to_overwrite_finished, stop_if_finished


def where_to_start(cfg: TrainConfig, accelerator: Accelerator, checkpoints: CheckpointManager, optimizer: Any,
                   scheduler: Any, total_steps: int) -> int:
    """The optimizer step this run starts after: 0 for a fresh start, else the resumed checkpoint's step.

    - ``--resume_from_checkpoint`` and the folder's run already did what this one asks: ``RunFinished``
      (nothing to do, nothing touched);
    - resumed: weights, optimizer, schedule, scaler and every rank's RNG from the checkpoint, with this
      run's lr, schedule and weight decay winning (``flags_in_force``, a warning where they differ);
    - fresh: refused where the folder holds checkpoints of another run;
    - from step 0 either way: refused where it would overwrite a finished run's outputs.
    """
    if cfg.resume_from_checkpoint:
        stop_if_finished(accelerator, cfg.output_dir, total_steps, cfg.global_batch_size)
        with flags_in_force(optimizer, scheduler):
            start_step = checkpoints.resume(cfg.resume_from_checkpoint)
    else:
        checkpoints.check_fresh_start()
        start_step = 0
    if start_step == 0:
        refuse_to_overwrite_finished(accelerator, cfg.output_dir)
    return start_step
