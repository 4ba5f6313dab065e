"""Bad flags or a bad recipe, refused before torch is imported: the one line within a second of the start, exit 2.

    return refuse_options(err)     # cli/train.py, cli/inference.py: a ConfigError while reading the options

Every rank parses the same options and fails alike, so rank 0 speaks and no store is needed (``failure.report``'s
agreement would import torch first). Under torchrun the line must survive the launcher's SIGTERM (issue 20): see
``refuse_options``. What it writes goes through ``failure``'s ``print_report`` and ``write_error_file``, looked up
there at each call, as a failure's report does (tests delay or interrupt them there).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Callable

from accel_ddp.lifecycle import failure
from accel_ddp.lifecycle.exit_codes import ExitCode
from accel_ddp.util.messages import error_line, first_line
from accel_ddp.util.ranks import launch_rank, launch_world_size, local_world_size
from accel_ddp.util.validation import ConfigError


def refuse_options(err: ConfigError) -> int:
    """Bad flags or a bad recipe, found before torch is imported: the one line within a second of the start, exit 2.

    Every rank parses the same options and fails alike, so rank 0 speaks and no store is needed (``failure.report``'s
    agreement would import torch first: 3-10 s). Under torchrun, the line must not be lost to the launcher's SIGTERM
    (issue 20): every rank writes its error file at once and takes SIGTERM as exit 2; rank 0 prints, then leaves
    once its machine's other ranks have written theirs (``EARLY_ACK_S`` at most); the others wait for the launcher to
    stop them (``EARLY_WAIT_S``) and, never stopped (rank 0 did not fail alike), print their own line. Without
    torchrun and with several ranks (mpirun) nobody stops the others, and where torch is loaded already (a caller's
    process, forked test ranks) the store costs no import: ``failure.report`` as usual.
    """
    rank, world = launch_rank(), launch_world_size()
    message = f"{type(err).__name__}: {first_line(err)}"
    under_torchrun = bool(os.environ.get("TORCHELASTIC_RUN_ID"))
    if world > 1 and (not under_torchrun or "torch" in sys.modules):
        return failure.report(err, ExitCode.BAD_INPUT)
    handles = under_torchrun and threading.current_thread() is threading.main_thread()
    if rank == 0 or world == 1:
        if handles:  # a SIGTERM now must not lose the line: it waits until the line is out
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        failure.write_error_file(message)
        failure.print_report(error_line(err))
        if handles:
            signal.signal(signal.SIGTERM, lambda *_: _leave_now(ExitCode.BAD_INPUT))
        _wait_until(_local_error_files_written, EARLY_ACK_S)
        return ExitCode.BAD_INPUT
    if handles:
        # the launcher stopping us: our code, not a kill
        signal.signal(signal.SIGTERM, lambda *_: _leave_now(ExitCode.BAD_INPUT))
    failure.write_error_file(f"stopped because rank 0 failed: {message}")
    _wait_until(lambda: False, EARLY_WAIT_S)
    failure.write_error_file(message)  # not stopped: rank 0 did not fail alike, so this rank's line is the one
    failure.print_report(error_line(err))
    return ExitCode.BAD_INPUT


EARLY_ACK_S = 5.0  # rank 0's wait for its machine's other ranks to write their error files (then SIGTERM is safe)
EARLY_WAIT_S = 10.0  # another rank's wait for the launcher's SIGTERM after rank 0 exited


def _local_error_files_written() -> bool:
    """Has every rank of this machine written its error file? torchrun gives each local rank
    ``.../attempt_N/<local rank>/error.json`` (torch/distributed/elastic/agent/server/local_elastic_agent.py)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    local = local_world_size()
    if not path or local <= 1:
        return True
    attempt, name = os.path.dirname(os.path.dirname(path)), os.path.basename(path)
    return all(os.path.isfile(os.path.join(attempt, str(i), name)) for i in range(local))


def _wait_until(done: Callable[[], bool], seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not done() and time.monotonic() < deadline:
        time.sleep(failure.POLL_S)


def _leave_now(code: int) -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(code)
