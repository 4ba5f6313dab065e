"""How failing ranks report: one report per launch, from the rank that failed first; the others stay quiet.

A failure on one rank ends every rank, and then every rank has something to say: bad input fails on
every rank alike, and a rank whose peer went away gets gloo's "Connection closed by peer". So the
ranks agree, on a store they all reach (:mod:`accel_ddp.lifecycle.peers`), which failure came first
(``claim``). That rank prints ``accel_ddp: error: <what is wrong>; <the fix>`` for bad input (exit
2) and a nan/inf loss (exit 3), its traceback for anything else (exit 1). Every other rank prints
nothing and exits with that rank's code; its torchelastic error file says that it stopped because
rank N failed.

What ``report`` (``main()``'s failure path) makes sure of, and the race behind each:

- The rank that really failed is first. A peer's collective fails only once this rank's
  connections close, and ``train()`` claims before that (before it destroys the process group).
- The peers learn now, not at this rank's exit: its connections are shut down (a process group's
  sockets outlive ``destroy_process_group`` while the DDP model holds it; DataLoader workers hold
  copies), so the ranks blocked in a collective with it fail and report.
- The line is not lost. torchrun answers the first worker that exits by SIGTERMing the others at
  its next check (``--monitor_interval``, 0.1 s) and SIGKILLs them 30 s later (torch/distributed/
  elastic/agent/server/api.py ``_invoke_run``, multiprocessing/api.py ``_close``): "rank 0 prints"
  lost the line whenever rank 1 exited first. So no rank exits before every rank has reported
  (``ACK_WAIT_S`` at most) and the report is out, and a reporting rank records SIGTERM instead of
  dying of it.
- The line starts a line: it is printed once every rank has reported, so rank 0's progress bar
  has ended its line (``train()``'s teardown closes it), in one write.
- The store outlives its readers: rank 0's process may host it, so it leaves last.

Every failing rank writes torchelastic's error file (``TORCHELASTIC_ERROR_FILE``, set by torchrun
for each worker; what ``torch.distributed.elastic.multiprocessing.errors.record`` writes), so the
launcher's ``ChildFailedError`` summary shows the real error instead of ``error_file: <N/A>``
(pytorch/pytorch#66182).

Once the process group exists, ``main_process_decides`` keeps a check that only the main process
can make (the file system, a tracker's start) from failing one rank alone: every rank gets its
result, or raises the same ConfigError.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from accel_ddp.lifecycle.exit_codes import ExitCode
from accel_ddp.lifecycle.peers import close_peer_connections, group_connections, rank_store
from accel_ddp.lifecycle.transport import LOST, STOPPED, Said, peer_message
from accel_ddp.util.atomic import atomic_write_text
from accel_ddp.util.messages import error_line, first_line, write
from accel_ddp.util.ranks import launch_rank, launch_world_size
from accel_ddp.util.validation import ConfigError, LaunchError, ServiceFailure, UserCodeFailed

# How long a failing rank waits for the others to report before it exits anyway, at most: the others
# learn of the failure at their next collective (a step at most) or fail alike at once.
ACK_WAIT_S = 10.0
POLL_S = 0.02  # between two looks at the store while waiting (a blocking wait logs a warning on its timeout)
# The launcher's stop, SLURM's warning, Ctrl-C and a closed terminal (forwarded by torchrun): recorded while reporting.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT, signal.SIGHUP)
# The one line of a rank that lost a peer that never reported (killed, out of memory): gloo's traceback says no more.
_LOST = ("rank {rank} lost its connection to another rank, which ended without reporting an error (killed? out of "
         "memory?); the launcher's summary says how it ended")


class PeerFailed(RuntimeError):
    """Raised by a rank that learned that another rank failed: that rank reports, this one never first."""

    def __init__(self, rank: int, message: str):
        super().__init__(message)
        self.rank = rank


@dataclass
class Claim:
    """This launch attempt's first failure, as this rank learned it."""

    rank: int
    world_size: int
    first: dict[str, Any]  # {"rank", "code", "message"}: ours, or the rank's that failed before us
    store: Any = None  # where the ranks agreed; held, as rank 0's process may host it
    key: str = ""
    hosts: bool = False  # this process serves the store: it must leave last
    stop: _Recorder | None = None  # the launcher's SIGTERM, recorded from the claim on (several ranks)
    nccl: bool = False  # the process group runs NCCL: its connections are left alone

    @property
    def ours(self) -> bool:
        return self.first["rank"] == self.rank


def claim(err: BaseException, code: int) -> Claim:
    """Record ``err`` (exit ``code``) as the launch's failure unless another rank's came first; idempotent.

    ``train()`` calls it before it destroys the process group, ``report`` again (the same answer).
    With other ranks, SIGTERM and SIGUSR1 are recorded from here on, not obeyed (and the handlers
    stay): the launcher is stopping every rank, and this one must exit with its own code, report first.
    """
    made = getattr(err, "_accel_ddp_claim", None)
    if made is not None:
        return made
    rank, world = launch_rank(), launch_world_size()
    mine = {"rank": rank, "code": code, "message": f"{type(err).__name__}: {first_line(err)}"}
    made = Claim(rank, world, mine, stop=_Recorder().install() if world > 1 else None, nccl=_nccl())
    if world > 1:
        try:
            _agree(made, err)
        except (RuntimeError, OSError, ValueError):  # the store's host was killed: report, a second line beats none
            made.store, made.first = None, mine
    with contextlib.suppress(AttributeError):  # an exception type without a __dict__: claimed again in report
        err._accel_ddp_claim = made
    return made


def peer_named(err: BaseException, made: Claim) -> BaseException:
    """``err`` as a ``PeerFailed`` naming the rank that failed first, where ``err`` is only this rank's transport
    error for it (a lost connection, a timeout: what gloo or NCCL say of a peer that went away); else ``err``.

    ``main()`` reports once per launch and keeps the others quiet; a caller of ``train()`` sees what each rank
    raised, and rank 1's "Connection closed by peer" names neither rank 0 nor its error. The claim goes with it."""
    if made.ours or isinstance(err, PeerFailed) or not (lost_peer(err) or timed_out(err)):
        return err
    first = made.first
    named = PeerFailed(first["rank"], f"rank {first['rank']} failed: {first['message']}; this rank stopped as its "
                                      f"connection to rank {first['rank']} ended")
    named._accel_ddp_claim = made
    return named


def _agree(made: Claim, err: BaseException) -> None:
    """``made.first``: whatever rank recorded its failure first on the ranks' store (this one, when no other did)."""
    found = rank_store(made.rank, lost_peer(err))
    if found is None:
        return
    made.store, made.hosts = found
    made.key = f"accel_ddp/failure/{os.environ.get('TORCHELASTIC_RUN_ID', '')}/" \
               f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    if isinstance(err, PeerFailed):  # the failing rank claims at about the same time: let it
        _wait_for(made.store, [f"{made.key}/first"], ACK_WAIT_S)
    made.first = json.loads(made.store.compare_set(f"{made.key}/first", "", json.dumps(made.first)))
    made.store.set(_claimed(made, made.rank), "1")  # read: the store's host may go (outlive_readers)


def outlive_readers(err: BaseException | None) -> None:
    """``train()``'s last step on a failure, in the process that hosts the ranks' store (env://, mpirun, forked ranks:
    rank 0's): end its group's connections, so that the ranks blocked in a collective with it fail now, and keep its
    process, store and all, until every other rank has claimed (read the launch's first failure), ``ACK_WAIT_S`` at
    most. Its caller may exit at once (a script, a forked rank), and a rank that then finds no store cannot tell who
    failed: it raised gloo's "Connection closed by peer" naming no rank. Only the group's own sockets are shut
    (``peers.group_connections``): the caller's process goes on (``report`` shuts them all, on its way out)."""
    made = getattr(err, "_accel_ddp_claim", None)
    if made is None or not made.hosts or made.store is None:
        return
    if not made.nccl:  # the group's destroy leaves them open while the DDP model (in the traceback) holds it
        close_peer_connections(group_connections())
    if made.ours and (lost_peer(err) or timed_out(err)):  # first, for a peer gone or stopped: none will read it
        return
    others = [_claimed(made, rank) for rank in range(made.world_size) if rank != made.rank]
    with contextlib.suppress(RuntimeError):  # the store failed: nobody can read it any more
        _wait_for(made.store, others, ACK_WAIT_S, made.stop)


def _claimed(made: Claim, rank: int) -> str:
    return f"{made.key}/claimed/{rank}"


def exit_code(err: BaseException) -> int:
    """The exit code of a run that raised ``err``: 2 bad input, 3 a nan/inf loss, 1 anything else (a
    ``ServiceFailure`` too: a store that failed mid-run, which a relaunch may get past)."""
    from accel_ddp.lifecycle.non_finite import NonFiniteLoss  # torch: imported once it fails

    if isinstance(err, (ConfigError, LaunchError)):
        return ExitCode.BAD_INPUT
    return ExitCode.NON_FINITE if isinstance(err, NonFiniteLoss) else ExitCode.FAILED


def report(err: BaseException, code: int) -> int:
    """``main()``'s failure path: the launch's one report, or silence; returns the exit code to use."""
    made = claim(err, code)
    stop = made.stop
    if made.world_size > 1 and not made.nccl:
        close_peer_connections()  # the ranks waiting for this one in a collective fail now, and report
    _write_error_file_of(made, err)
    # First with a lost connection: a rank died without a word; nobody is left to wait for (or they stop alike).
    alone = made.ours and lost_peer(err)
    everyone = _all_reported(made, stop, wait=not alone) if made.store is not None else made.world_size == 1
    if _prints(made, err):
        # A rank not heard from may have left its progress bar mid-line: start a fresh one.
        print_report(("" if everyone else "\n") + _report_text(err, made.first["code"], made))
    if made.store is not None:
        _leave(made, stop)
    return made.first["code"]


def lost_peer(err: BaseException) -> bool:
    """Does ``err`` say that another rank went away (its process ended, or the connection to it did)?"""
    from torch.distributed import DistNetworkError

    return isinstance(err, (DistNetworkError, PeerFailed)) or peer_message(str(err), LOST) is not None


def _nccl() -> bool:
    """Does the process group run NCCL? Its connections are left alone: what NCCL's watchdog (which may abort
    the process) makes of a shut socket is untested here (no two GPUs); its peers learn at this rank's exit."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and "nccl" in str(dist.get_backend())


def _prints(made: Claim, err: BaseException) -> bool:
    if not made.ours:
        return False
    if made.world_size == 1 or made.store is not None:
        return True
    if lost_peer(err):  # and no store: rank 0 hosted it and is gone; it was the one to report
        return False
    if os.environ.get("MASTER_PORT"):
        return True  # the store was unreachable: better a second line than none
    # Several ranks and no store to agree on (mpirun without MASTER_ADDR): rank 0 speaks for bad input, as
    # every rank fails alike, and a rank's own bad data or bug is its own to print.
    return made.rank == 0 or made.first["code"] == ExitCode.FAILED or getattr(err, "only_this_rank", False)


def timed_out(err: BaseException) -> Said | None:
    """What gloo or NCCL said of a peer that did not answer within the group's timeout (with the timeout where the
    message names it: :mod:`accel_ddp.lifecycle.transport`), or None. The peer is alive (its connections open) but
    stopped, hung or too slow."""
    return peer_message(str(err), STOPPED)


def _timeout_line(err: BaseException, made: Claim | None = None) -> str:
    """One line for a collective's timeout ("Timed out waiting Nms for recv", "Application timeout caused pair
    closure", NCCL's watchdog): which rank did not answer (those that never reported to the ranks' store, once every
    other has), within which timeout, and what to do."""
    found = timed_out(err)
    silent = [] if made is None or made.store is None else _silent_ranks(made)
    who = (f"rank {silent[0]}" if len(silent) == 1 else f"ranks {', '.join(map(str, silent))}" if silent
           else "another rank")
    within = f"--ddp_timeout {found.timeout_s:g} s" if found.timeout_s is not None else "--ddp_timeout"
    return (f"rank {made.rank if made else launch_rank()}: {who} did not answer within {within} "
            f"({found.message.backend}: {found.text}); it is stopped, hung or far "
            "slower (SIGSTOP, a debugger, a stuck read, swapping): see where with py-spy dump --pid PID, or raise "
            "--ddp_timeout if it is only slow")


def _silent_ranks(made: Claim) -> list[int]:
    try:
        return [rank for rank in range(made.world_size)
                if rank != made.rank and not made.store.check([_reported(made, rank)])]
    except RuntimeError:  # the store's host is the silent one
        return []


def _report_text(err: BaseException, code: int, made: Claim | None = None) -> str:
    # A store that failed mid-run, a callback that raised: one line, no traceback (a callback's line says where it
    # raised; its traceback: the error file).
    if code != ExitCode.FAILED or isinstance(err, (ServiceFailure, UserCodeFailed)):
        return error_line(err)
    if lost_peer(err):
        return error_line(_LOST.format(rank=launch_rank()))
    if timed_out(err):
        return error_line(_timeout_line(err, made))
    return "".join(traceback.format_exception(err))


def _write_error_file_of(made: Claim, err: BaseException) -> None:
    first = made.first
    if not made.ours:
        why = f"stopped because rank {first['rank']} failed: {first['message']}"
        own = f"{type(err).__name__}: {first_line(err)}"  # worth adding where it is no mere lost connection
        write_error_file(why, why if own == first["message"] or lost_peer(err) else f"{why}\n(this rank then: {own})")
    elif first["code"] == ExitCode.FAILED and lost_peer(err):  # with what gloo or the store said
        write_error_file(f"{_LOST.format(rank=made.rank)} ({type(err).__name__}: {first_line(err)})")
    elif first["code"] == ExitCode.FAILED and timed_out(err):
        write_error_file(_timeout_line(err))
    elif first["code"] == ExitCode.FAILED and not isinstance(err, ServiceFailure):
        write_error_file(f"{type(err).__name__}: {err}", "".join(traceback.format_exception(err)))
    else:  # the one line, no traceback: bad input is not a bug
        write_error_file(f"{type(err).__name__}: {err}")


def _all_reported(made: Claim, stop: _Recorder | None, wait: bool = True) -> bool:
    """This rank has reported; wait until every rank has (True), ACK_WAIT_S at most, or until the launcher stops
    us (a rank has exited: it reported and left, or it died without a word)."""
    try:
        made.store.set(_reported(made, made.rank), "1")
        everyone = [_reported(made, rank) for rank in range(made.world_size)]
        return _wait_for(made.store, everyone, ACK_WAIT_S, stop) if wait else made.store.check(everyone)
    except RuntimeError:  # the store's host is gone: it has waited for us as long as it could
        return False


def _leave(made: Claim, stop: _Recorder | None) -> None:
    """Once the report is out: the printing rank says so, and the others wait for it before they exit (the
    launcher's SIGTERM follows the first exit). The store's host leaves last, once no rank reads it any more."""
    store, key = made.store, made.key
    try:
        if made.ours:
            store.set(f"{key}/printed", "1")
        elif store.check([_reported(made, made.first["rank"])]):
            _wait_for(store, [f"{key}/printed"], ACK_WAIT_S, stop)
        if not made.hosts:
            store.set(f"{key}/left/{made.rank}", "1")  # the last request to the store
            return
        others = [rank for rank in range(made.world_size) if rank != made.rank
                  and store.check([_reported(made, rank)])]  # the ranks that never reported do not read it
        _wait_for(store, [f"{key}/left/{rank}" for rank in others], ACK_WAIT_S, stop)
    except RuntimeError:
        pass


def _reported(made: Claim, rank: int) -> str:
    return f"{made.key}/reported/{rank}"


def _wait_for(store: Any, keys: list[str], seconds: float, stop: _Recorder | None = None) -> bool:
    """Poll until every key is set (True), ``seconds`` pass or a stop signal came."""
    deadline = time.monotonic() + seconds
    while not store.check(keys):
        if time.monotonic() > deadline or (stop is not None and stop.received):
            return False
        time.sleep(POLL_S)
    return True


class _Recorder:
    """Records SIGTERM and SIGUSR1 instead of dying of them, for a rank that must finish its report."""

    def __init__(self):
        self.received = 0

    def install(self) -> _Recorder:
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                signal.signal(sig, self._record)
        return self

    def _record(self, signum: int, frame) -> None:
        self.received = self.received or signum


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
        raise PeerFailed(0, f"the main process failed: {outcome[2]}")
    if outcome[1] is not None:
        raise ConfigError(outcome[1])
    return outcome[0]



def print_report(text: str) -> None:
    """``text`` on stderr in one write: another process's output cannot land inside a line of it."""
    write(text, err=True, end="")


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
