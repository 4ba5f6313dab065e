"""How a failing worker reports: one error line per launch, and the real error in the launcher's summary.

Bad input fails on every rank alike, and torchrun answers the first worker that exits with a
SIGTERM to the others. "Rank 0 prints" therefore lost the line whenever another rank exited first
(1 launch in 4 on two CPU processes). Instead the failing ranks elect the one that prints, without
a process group (option errors come before there is one): an atomic ``add`` on the launcher's own
TCPStore, which torchrun shares with its workers (``TORCHELASTIC_USE_AGENT_STORE``, always so for
the ``static`` rendezvous of every shipped config and of ``accelerate config``'s answers). The
first rank to get there prints; the others wait until it has printed (at most ``PRINT_WAIT_S``)
before they exit, so the launcher cannot kill it first. Without that store (no torchrun, ``mpirun``,
a rendezvous that does not share its store) rank 0 prints, as every rank fails alike on bad input.

Every failing rank also writes torchelastic's error file (``TORCHELASTIC_ERROR_FILE``, set by
torchrun for each worker; the mechanism behind ``torch.distributed.elastic.multiprocessing.errors.record``),
so the launcher's ``ChildFailedError`` summary shows each failing rank's error instead of
``error_file: <N/A>`` (see pytorch/pytorch#66182).

Once the process group exists, ``main_process_decides`` keeps a check that only the main process
can make (the file system, a tracker's start) from failing one rank alone: every rank gets its
result, or raises the same ConfigError.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from accel_ddp.files import atomic_write_text
from accel_ddp.validation import ConfigError

PRINT_WAIT_S = 10.0  # how long a rank that lost the election waits for the winner's line, at most
STORE_TIMEOUT_S = 5.0  # connecting to the launcher's store: it lives as long as the launcher does
_RANK_VARS = ("RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK", "MV2_COMM_WORLD_RANK")  # torchrun, then MPI's (as Accelerate)


def report_bad_input(err: Exception) -> None:
    """``accel_ddp: error: <err>`` on stderr once per launch; the error file on every failing rank."""
    write_error_file(f"{type(err).__name__}: {err}")  # the one line, no traceback: bad input is not a bug
    store = _launcher_store()
    if store is None:
        if _rank() == 0 or getattr(err, "only_this_rank", False):  # bad data one rank met mid-training
            print_error_line(str(err))
        return
    key = f"accel_ddp/error_line/{os.environ.get('TORCHELASTIC_RUN_ID', '')}/" \
          f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    try:
        elected = store.add(key, 1) == 1
    except RuntimeError:  # the store went away with the launcher: better a second line than none
        elected = True
    if elected:
        print_error_line(str(err))
        try:
            store.set(f"{key}/printed", "1")
        except RuntimeError:
            pass
        return
    try:
        store.wait([f"{key}/printed"], timedelta(seconds=PRINT_WAIT_S))
    except RuntimeError:  # the printer died or hangs: exit anyway, the error file still tells
        pass


def report_unexpected(err: BaseException) -> None:
    """Within ``except``: the traceback on stderr (each rank its own) and in the launcher's summary."""
    import traceback

    callstack = traceback.format_exc()
    print(callstack, end="", file=sys.stderr, flush=True)
    write_error_file(f"{type(err).__name__}: {err}", callstack)


def main_process_decides(state: Any, decide: Callable[[], Any]) -> Any:
    """Run ``decide`` on the main process only; every rank gets its result or raises its ConfigError,
    so all ranks take the same decision. ``state``: an Accelerator or a PartialState (collective)."""
    # Imported here: this module loads without Accelerate (models.py imports it, through weights.py).
    from accelerate.utils import broadcast_object_list

    outcome: list[Any] = [None, None, None]  # result, ConfigError text, any other failure
    failure = None
    if state.is_main_process:
        try:
            outcome[0] = decide()
        except ConfigError as err:
            outcome[1] = str(err)
        except Exception as err:  # noqa: BLE001 - re-raised below, once the other ranks know not to wait
            outcome[2], failure = f"{type(err).__name__}: {err}", err
    broadcast_object_list(outcome)
    if failure is not None:
        raise failure
    if outcome[2] is not None:
        raise RuntimeError(f"the main process failed: {outcome[2]}")
    if outcome[1] is not None:
        raise ConfigError(outcome[1])
    return outcome[0]


def first_line(err: BaseException) -> str:
    """An error's first line, for a one-line message (at most 300 characters)."""
    return (str(err).strip().splitlines() or [type(err).__name__])[0][:300]


def print_error_line(message: str) -> None:
    print(f"accel_ddp: error: {message}", file=sys.stderr, flush=True)


def write_error_file(message: str, callstack: str | None = None) -> None:
    """torchelastic's error file, in the format of its ``ErrorHandler.record_exception``; no-op outside torchrun.

    The launcher prints ``callstack`` as the rank's ``traceback`` in its failure summary.
    """
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    data = {"message": {"message": message, "extraInfo": {"py_callstack": callstack or message,
                                                          "timestamp": str(int(time.time()))}}}
    try:  # renamed into place: torchrun may SIGTERM us mid-write, and its agent fails on a half-written file
        atomic_write_text(path, json.dumps(data))
    except OSError:  # the summary then says <N/A>; the error itself is on stderr
        pass


def _rank() -> int:
    for name in _RANK_VARS:
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return 0


def _launcher_store():
    """A client of the TCPStore that torchrun shares with its workers, or None when there is none."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    try:
        from torch.distributed import TCPStore

        return TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                        timeout=timedelta(seconds=STORE_TIMEOUT_S))
    except (KeyError, ValueError, RuntimeError):  # DistStoreError is a RuntimeError
        return None
