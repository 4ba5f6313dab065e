"""Each rank's exit code, left for ``accel-ddp launch`` (accel_ddp/cli/launch.py) to exit with.

torchrun reports a worker's exit code only when the worker ended the job (its ``ChildFailedError``); when the
launcher itself was signalled it stops the workers, waits for them and re-raises the signal, and Accelerate then
exits 128 + the signal (accelerate/commands/launch.py ``_run_torchrun``): the ranks' 75 ("preempted, checkpoint
saved") is lost. So under ``accel-ddp launch`` (which sets ``EXIT_CODES_DIR`` for its workers) each rank writes
its code to ``DIR/<rank>`` just before it exits, and the launch reads them once every worker has ended.

    record(75)             # a rank, on its way out: nothing outside accel-ddp launch
    recorded("/tmp/...")   # the launch: {rank: code}
"""

from __future__ import annotations

import os

from accel_ddp.util.atomic import atomic_write_text
from accel_ddp.util.ranks import launch_rank

EXIT_CODES_DIR = "ACCEL_DDP_EXIT_CODES_DIR"  # set by accel-ddp launch for its workers


def record(code: int) -> None:
    """Leave this rank's exit ``code`` for ``accel-ddp launch``; nothing when not under it, never an error."""
    folder = os.environ.get(EXIT_CODES_DIR)
    if not folder or not os.path.isdir(folder):
        return
    try:
        atomic_write_text(os.path.join(folder, str(launch_rank())), str(code))
    except OSError:  # the launch then exits with what the launcher says
        pass


def recorded(folder: str) -> dict[int, int]:
    """``{rank: exit code}`` that the ranks of this machine left in ``folder``."""
    codes = {}
    for name in os.listdir(folder) if os.path.isdir(folder) else ():
        try:
            with open(os.path.join(folder, name), encoding="utf-8") as fh:
                codes[int(name)] = int(fh.read())
        except (OSError, ValueError):  # a temporary file mid-rename, or foreign: not a rank's code
            continue
    return codes
