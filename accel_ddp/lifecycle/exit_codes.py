"""Every exit code of the package, one ``IntEnum`` (``ExitCode``), and each rank's code, left for ``accel-ddp launch``
(accel_ddp/cli/launch.py) to exit with.

    sys.exit(ExitCode.BAD_INPUT)   # never a bare 2: tests/lifecycle/test_exit_codes.py finds one

torchrun reports a worker's exit code only when the worker ended the job (its ``ChildFailedError``); when the
launcher itself was signalled it stops the workers, waits for them and re-raises the signal, and Accelerate then
exits 128 + the signal (accelerate/commands/launch.py ``_run_torchrun``): the ranks' 75 ("preempted, checkpoint
saved") is lost. So under ``accel-ddp launch`` (which sets ``EXIT_CODES_DIR`` for its workers) each rank writes
its code to ``DIR/<rank>`` just before it exits, and the launch reads them once every worker has ended.

    record(ExitCode.PREEMPTED)   # a rank, on its way out (75): nothing outside accel-ddp launch
    recorded("/tmp/...")   # the launch: {rank: code}
"""

from __future__ import annotations

import os
import signal
from enum import IntEnum

from accel_ddp.util.atomic import atomic_write_text
from accel_ddp.util.ranks import launch_rank

EXIT_CODES_DIR = "ACCEL_DDP_EXIT_CODES_DIR"  # set by accel-ddp launch for its workers


class ExitCode(IntEnum):
    """What each exit code of a run (``python train.py``, ``accel-ddp launch``, the other commands) means."""

    OK = 0
    FAILED = 1  # anything else: a bug, a store that failed mid-run (a relaunch may get past it); the doctor's problems
    BAD_INPUT = 2  # bad flags, data, checkpoint or launch: one line naming the problem and the fix
    NON_FINITE = 3  # a nan/inf loss: not 75 (preempted), a relaunch would diverge again
    PREEMPTED = 75  # sysexits.h EX_TEMPFAIL: a checkpoint is saved, the job may be retried
    HUNG = 124  # what timeout(1) returns for a command that ran past its limit: no rank is to blame for the code
    # A person stopped the run: 128 + the signal, as a shell reports a process it killed, not 75 ("try again").
    HANGUP = 128 + signal.SIGHUP  # 129: the terminal (or ssh session) closed
    INTERRUPTED = 128 + signal.SIGINT  # 130: Ctrl-C

    def __str__(self) -> str:  # "2" in files and lines, as Python 3.11's IntEnum writes it (3.10's: "ExitCode.X")
        return str(int(self))


def killed_by(signum: int) -> int:
    """The code a shell gives a process ended by signal ``signum``: 128 + it."""
    return 128 + signum


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
