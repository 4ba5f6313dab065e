"""``accel-ddp launch``: ``accelerate launch`` with the failing rank's own line and exit code.

    accel-ddp launch --config_file accelerate_configs/cpu_2proc.yaml train.py --lr -1
    accel_ddp: error: --lr must be > 0, got -1.0; try --lr 3e-3          (and exit code 2)

It takes exactly ``accelerate launch``'s arguments (Accelerate's own parser) and runs Accelerate's launcher in this
process (``accelerate.commands.launch.launch_command``: the same config file, defaults, environment and torchrun).
What differs is the end of a launch that failed:

- Accelerate re-raises torchrun's ``ChildFailedError`` (``_run_torchrun``), so Python prints the launcher's
  traceback and the error's box of every rank's failure (~40 lines after the rank's own line), and exits 1; torchrun's
  agent also logs each worker's end ("Sending process N closing signal SIGTERM", "failed (exitcode: 2)"). Here the
  error is caught and the agent's log (logger ``torch.distributed.elastic``) kept to CRITICAL: what remains is what
  the ranks printed themselves, and the exit code is the failing rank's (2 bad input, 3 a nan/inf loss, 75
  preempted, 130 Ctrl-C, ...; accel_ddp/lifecycle/preemption.py lists them).
- Signalled itself (SIGTERM, Ctrl-C), torchrun stops the workers and Accelerate exits 128 + the signal: the
  workers' 75 is lost. Each accel_ddp rank leaves its code for this launch (accel_ddp/lifecycle/exit_codes.py).
- The one-process launcher (``distributed_type: NO``) raises ``CalledProcessError`` (its traceback, exit 1) after
  copying the worker's stderr through: the worker's code here.

With Accelerate's ``--debug`` the launcher's own output is left as Accelerate prints it (its stack trace of
``torch.distributed``); the exit code is still the rank's. A rank killed by a signal says nothing itself: one line
names it (exit 128 + the signal, as a shell reports it).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import subprocess
import tempfile

from accel_ddp.lifecycle.exit_codes import EXIT_CODES_DIR, ExitCode, killed_by, recorded
from accel_ddp.util.messages import error_line, write

ELASTIC_LOGGER = "torch.distributed.elastic"  # torchrun's agent: each worker's end, logged after the rank's line


def run(argv: list[str]) -> int:
    """Launch as ``accelerate launch ARGV`` would; return the failing rank's exit code (0 when every rank succeeded)."""
    from accelerate.commands.launch import launch_command, launch_command_parser

    parser = launch_command_parser()
    parser.prog = "accel-ddp launch"
    args = parser.parse_args(argv)
    folder = tempfile.mkdtemp(prefix="accel_ddp-exit-codes-")
    previous = os.environ.get(EXIT_CODES_DIR)
    os.environ[EXIT_CODES_DIR] = folder  # the workers inherit the launcher's environment (torchrun, simple)
    try:
        with _launcher_log_quiet(not args.debug):
            return _launch(launch_command, args, folder)
    finally:
        if previous is None:
            os.environ.pop(EXIT_CODES_DIR, None)
        else:
            os.environ[EXIT_CODES_DIR] = previous
        shutil.rmtree(folder, ignore_errors=True)


def _launch(launch_command, args, folder: str) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    try:
        launch_command(args)
    except ChildFailedError as err:  # a worker failed (or was killed): every worker has ended
        return failed_rank_code({rank: (f.exitcode, f.timestamp) for rank, f in err.failures.items()},
                                recorded(folder))
    except subprocess.CalledProcessError as err:  # the one-process launcher; the worker's stderr is printed
        return ranks_code(recorded(folder)) or _signal_code(err.returncode, "the training process")
    except SystemExit as stop:  # Accelerate's exit when it was signalled (128 + the signal, 130 for Ctrl-C)
        launcher = stop.code if isinstance(stop.code, int) else ExitCode.FAILED
        return ranks_code(recorded(folder)) or launcher
    return ExitCode.OK


def failed_rank_code(failures: dict[int, tuple[int, int]], codes: dict[int, int]) -> int:
    """The exit code of a failed launch from torchrun's ``{rank: (exit code, timestamp)}`` of the failed workers
    and the ``codes`` the ranks recorded: the first failure's code (every accel_ddp rank exits with the code of the
    rank that failed first, accel_ddp/lifecycle/failure.py); a rank killed by a signal (a negative code), when no
    rank exited with a code of its own, is named in one line and gives 128 + the signal."""
    exited = sorted((stamp, rank, code) for rank, (code, stamp) in failures.items() if code > 0)
    if exited:
        return exited[0][2]
    if ranks_code(codes):
        return ranks_code(codes)
    stamp, rank, code = min((stamp, rank, code) for rank, (code, stamp) in failures.items())
    return _signal_code(code, f"rank {rank}")


def ranks_code(codes: dict[int, int]) -> int:
    """The code the ranks recorded: the lowest rank's that is not 0 (they agree: one failure or one stop), else 0."""
    return next((codes[rank] for rank in sorted(codes) if codes[rank]), 0)


def _signal_code(code: int, who: str) -> int:
    """A positive code as it is; a process killed by a signal (-N): one line naming it, and 128 + N."""
    if code >= 0:
        return code
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = f"signal {-code}"
    hint = " (out of memory? the kernel's OOM killer sends SIGKILL)" if -code == signal.SIGKILL else ""
    write(error_line(f"{who} was killed by {name}{hint}"), err=True, end="")
    return killed_by(-code)


@contextlib.contextmanager
def _launcher_log_quiet(quiet: bool):
    """torchrun's agent logs only what is CRITICAL while ``quiet``: each worker's end is the ranks' to say."""
    logger = logging.getLogger(ELASTIC_LOGGER)
    level = logger.level
    if quiet:
        logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)
