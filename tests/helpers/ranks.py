"""Forked ranks run as torchrun runs its workers, and what each one reported.

``launch_ranks(folder, args, env)`` runs the CLI's ``main(args)`` on two forked ranks (tests/helpers/multiproc.py)
with what only a launch otherwise shows: each rank's own torchelastic error file, and the agent's
SIGTERM to the other ranks once one has exited (``torchrun_watching``). ``env`` adds the launcher's
environment: ``C10D_UNSHARED``, or conftest's ``launcher_store`` for the static rendezvous.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import signal
import time

from tests.helpers import faults
from tests.helpers.multiproc import run_ranks

# What torchrun's agent gives its workers beyond RANK, WORLD_SIZE and MASTER_* (torch/distributed/elastic/agent/
# server/local_elastic_agent.py, _start_workers) with --rdzv_backend c10d and TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1:
# no shared store; rank 0 hosts the group's (forked ranks form their group over env://, as launched workers do).
C10D_UNSHARED = {"TORCHELASTIC_USE_AGENT_STORE": "False", "TORCHELASTIC_RUN_ID": "test",
                 "TORCHELASTIC_RESTART_COUNT": "0"}


def launched(folder, args: list[str], patch=None, **fault) -> int:
    """``main(args)`` on a forked rank as torchrun runs it: with its own error file (and its pid for
    ``torchrun_watching``); ``patch(rank)`` and ``faults.install(**fault)`` first. Then a marker line,
    ``rank N returned CODE``, in one write: two processes' ``print`` calls interleave (the text and the newline
    are two writes to stderr)."""
    from accel_ddp.cli.train import main

    rank = int(os.environ["RANK"])
    os.environ["TORCHELASTIC_ERROR_FILE"] = str(folder / f"error{rank}.json")
    faults.install(**fault)
    if patch is not None:
        patch(rank)
    (folder / f"pid{rank}.tmp").write_text(str(os.getpid()))
    os.replace(folder / f"pid{rank}.tmp", folder / f"pid{rank}")  # whole, for the watcher
    code = main(args)
    os.write(2, f"rank {rank} returned {code}\n".encode())
    return code


@contextlib.contextmanager
def torchrun_watching(folder):
    """What torchrun's agent does every ``monitor_interval`` (0.1 s): once a rank's process has ended, SIGTERM the
    others (torch/distributed/elastic/agent/server/api.py ``_invoke_run``; here on any exit, all of ours fail).

    A process of its own, not a thread: the test process forks the ranks meanwhile, and a child forked while
    another thread runs can crash (a rank died of SIGSEGV reading ``os.environ`` with a watcher thread).
    """
    watcher = multiprocessing.get_context("fork").Process(target=_watch, args=(folder,), daemon=True)
    watcher.start()
    try:
        yield
    finally:
        watcher.terminate()
        watcher.join()


def _watch(folder) -> None:
    try:
        while True:
            time.sleep(0.1)
            pids = [int(path.read_text()) for path in folder.glob("pid*") if not path.suffix]  # renamed in whole
            if any(_ended(pid) for pid in pids):
                for pid in pids:
                    if not _ended(pid):
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(pid, signal.SIGTERM)
                return
    finally:
        os._exit(0)


def _ended(pid: int) -> bool:
    """Has ``pid`` exited (a zombie until run_ranks reaps it)?"""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


def launch_ranks(folder, args: list[str], env: dict[str, str] | None = None, patch=None, **fault) -> list[int]:
    """``launched`` on two forked ranks watched as torchrun watches its workers; their exit codes. No rank is let
    go before every rank reported (``unbounded_wait``): one that cannot learn of a failure hangs until the
    timeout, and the test fails."""
    def patched(rank: int) -> None:
        unbounded_wait()
        if patch is not None:
            patch(rank)

    with torchrun_watching(folder):
        return run_ranks(lambda: launched(folder, args, patched, **fault), env=env, timeout=60)


def unbounded_wait() -> None:
    """A failing rank waits for every other to report before it exits, here without the bound (ACK_WAIT_S)."""
    import accel_ddp.lifecycle.failure as failure

    failure.ACK_WAIT_S = 3600.0


def recorded(folder, rank: int) -> dict[str, str]:
    """What rank ``rank`` wrote into its torchelastic error file: message and py_callstack."""
    entry = json.loads((folder / f"error{rank}.json").read_text())["message"]
    return {"message": entry["message"], "callstack": entry["extraInfo"]["py_callstack"]}


def error_lines(err: str) -> list[str]:
    """The lines that are an error (split at newlines only: a progress bar's carriage returns end no line)."""
    return [line for line in err.split("\n") if line.startswith("accel_ddp: error:")]


def assert_quiet(err: str) -> None:
    """No rank printed a traceback of its own, nor gloo's lost connection, nor torch a C++ stack."""
    assert "Traceback" not in err and "frame #" not in err and "Connection closed by peer" not in err, err
