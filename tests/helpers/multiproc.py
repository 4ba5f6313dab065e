"""Run a function on N ranks of a real gloo process group, forked from the test process.

A full `accelerate launch` costs three interpreter start-ups (launcher + two workers), each
importing torch and Accelerate: ~8 s of a 2-core machine for ~1 s of training. Forking the test
process, which has imported everything already, gives the same two ranks over the same gloo
transport in a fraction of that. What only a launch can show (signals through torchrun, elastic
restarts, two launchers, the README run) stays in the launch tests.

    results = run_ranks(lambda: train(cfg), world_size=2)   # [rank 0's summary, rank 1's summary]

``world_size=1`` runs one process with no distributed environment at all: exactly what
``python train.py`` gets. Each rank's return value comes back pickled; an exception on any rank
fails the test with every failing rank's traceback. Children leave through ``os._exit`` (no
interpreter teardown, see ``accel_ddp.exit_process``).
"""

from __future__ import annotations

import faulthandler
import gc
import multiprocessing
import multiprocessing.connection
import os
import pickle
import random
import shutil
import signal
import socket
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

# What the launcher would set, or leave out, that must not leak in from the test's own environment.
_LAUNCH_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
               "MASTER_ADDR", "MASTER_PORT", "ACCELERATE_USE_CPU", "TORCHELASTIC_RUN_ID")


def free_port() -> int:
    """A loopback port free now, drawn below the kernel's ephemeral range.

    A port the kernel hands out for ``bind(0)`` comes from the ephemeral range, the one every outgoing connection
    (gloo's pairs, the store's clients of the other tests running beside this one) also takes its local port from:
    between this check and the rank's own bind, such a connection could take it (seen: EADDRINUSE under a loaded
    suite). Below that range only an explicit bind takes a port, and each xdist worker draws from its own slice of it,
    so two tests running side by side never draw the same port (a rank of one could then join the other's world).
    """
    low, high = _PORTS_BELOW_EPHEMERAL
    for _ in range(64):
        port = random.randrange(low, high)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _ports_below_ephemeral() -> tuple[int, int]:
    try:
        ephemeral_low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_low = 32768  # Linux's default
    low = min(20000, ephemeral_low // 2)
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    index = int(worker[2:]) if worker[2:].isdigit() else 0
    width = (ephemeral_low - low) // max(workers, 1)
    return (low + index * width, low + (index + 1) * width)


_PORTS_BELOW_EPHEMERAL = _ports_below_ephemeral()


class RankFailed(AssertionError):
    """One or more ranks raised; the message holds each failing rank's traceback."""

    def __init__(self, failures: dict[int, str]):
        self.failures = failures
        super().__init__("\n".join(f"--- rank {rank} failed:\n{tb}" for rank, tb in sorted(failures.items())))


def _reset_accelerate_state() -> None:
    """Forget any Accelerate singleton the test process made: each child joins its own world."""
    from accelerate.state import AcceleratorState, GradientState, PartialState

    AcceleratorState._reset_state(reset_partial_state=True)
    PartialState._reset_state()
    GradientState._reset_state()


def own_tqdm_locks() -> None:
    """In a forked rank: tqdm locks of its own (every rank gets them: ``_child``).

    tqdm's write lock is a multiprocessing RLock made in the test process and shared with every process forked
    from it (by design: tqdm.std.TqdmDefaultWriteLock). A rank SIGKILLed during a progress-bar refresh would hold
    it forever, and the next bar in the test process, or in any rank forked later, would wait on it forever (an
    uninterrupted run forked after a test that SIGKILLed a rank hung at a progress-bar update)."""
    import tqdm.std

    locks = tqdm.std.TqdmDefaultWriteLock
    locks.th_lock = tqdm.std.TRLock()  # the copy made by fork may be held by a thread that is not here
    if hasattr(locks, "mp_lock"):
        del locks.mp_lock  # the next TqdmDefaultWriteLock makes a new one
    classes = [tqdm.std.tqdm]
    while classes:
        cls = classes.pop()
        classes.extend(cls.__subclasses__())
        if "_lock" in vars(cls):
            delattr(cls, "_lock")  # get_lock() makes a new one, with the new locks
        if vars(cls).get("monitor") is not None:
            cls.monitor = None  # a monitor thread of the test process is not here; its Event's lock may be held


def _child(rank: int, world_size: int, port: int, env: dict[str, str], fn: Callable[[], Any], conn,
           stacks: tuple[str, float]) -> None:
    try:
        # What the test process had made and dropped is not this rank's to collect: an object owning a thread
        # that the fork did not copy (a store's server, a reader's pool) would join it from its destructor, and
        # a join of a thread that is not here aborts the rank (seen: "std::system_error: Invalid argument" while
        # garbage-collecting in a save). Frozen, the inherited objects are never collected here; the test process
        # collects its own garbage, where those threads run.
        gc.freeze()
        _dump_stacks_if_still_running(*stacks)
        for name in _LAUNCH_ENV:
            os.environ.pop(name, None)
        if world_size > 1:
            os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
                               "LOCAL_WORLD_SIZE": str(world_size), "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1",
                               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
        os.environ.update(env)
        signal.signal(signal.SIGALRM, signal.SIG_DFL)  # pytest-timeout's alarm belongs to the parent
        _reset_accelerate_state()
        own_tqdm_locks()
        outcome = ("ok", fn())
    except BaseException:  # noqa: BLE001 - everything goes back to the parent
        outcome = ("error", traceback.format_exc())
    try:
        conn.send_bytes(pickle.dumps(outcome))
    except Exception:  # noqa: BLE001 - an unpicklable result
        conn.send_bytes(pickle.dumps(("error", traceback.format_exc())))
    finally:
        conn.close()
        os._exit(0)


def _dump_stacks_if_still_running(path: str, after_s: float) -> None:
    """In a rank: every thread's stack into ``path`` if the rank still runs ``after_s`` seconds from now.

    A hang is then a failure that shows where each rank waits, not only that it did."""
    stacks = open(path, "w")  # noqa: SIM115 - open until the process ends; faulthandler writes into it
    faulthandler.dump_traceback_later(after_s, exit=False, file=stacks)


def _hang_report(stack_files: list[str], threads_at_fork: list[str]) -> str:
    parts = [f"threads of the test process at fork: {threads_at_fork}"]
    for rank, path in enumerate(stack_files):
        text = Path(path).read_text(errors="replace").strip() if Path(path).exists() else ""
        parts.append(f"--- rank {rank} stacks before the kill:\n{text or '(none written)'}")
    return "\n".join(parts)


def run_ranks(fn: Callable[[], Any], world_size: int = 2, timeout: float = 120, env: dict[str, str] | None = None,
              grace: float = 10.0) -> list[Any]:
    """Run ``fn()`` on ``world_size`` forked ranks; return their results in rank order.

    If a rank fails, the others get ``grace`` seconds to finish (a correct program stops them
    promptly); then they are killed and ``RankFailed`` names every failure. Past ``timeout`` every
    rank is killed and the test fails, so a hang costs one timeout, not the CI budget.
    """
    ctx = multiprocessing.get_context("fork")
    port = free_port()
    procs, conns = [], []
    # Forking a process with threads copies their locks, not the threads: note which ran, for a hang's report.
    threads_at_fork = [thread.name for thread in threading.enumerate()]
    stack_dir = tempfile.mkdtemp(prefix="rank-stacks-")
    stack_files = [os.path.join(stack_dir, f"rank{rank}.txt") for rank in range(world_size)]
    for rank in range(world_size):
        parent_end, child_end = ctx.Pipe(duplex=False)
        stacks = (stack_files[rank], max(timeout - 3, 1))
        proc = ctx.Process(target=_child, args=(rank, world_size, port, dict(env or {}), fn, child_end, stacks),
                           daemon=False)
        proc.start()
        child_end.close()
        procs.append(proc)
        conns.append(parent_end)
    outcomes: dict[int, tuple[str, Any]] = {}
    deadline = time.monotonic() + timeout
    first_failure_at = None
    try:
        while len(outcomes) < world_size:
            now = time.monotonic()
            until = deadline if first_failure_at is None else min(deadline, first_failure_at + grace)
            if now > until:
                break
            # Woken by whichever rank answers first (a result, or the end of its pipe when it dies), not by a poll
            # interval: a test waits for its ranks, not for the loop.
            pending = [conn for rank, conn in enumerate(conns) if rank not in outcomes]
            for conn in multiprocessing.connection.wait(pending, timeout=until - now):
                rank = conns.index(conn)
                try:
                    outcomes[rank] = pickle.loads(conn.recv_bytes())
                except EOFError:  # died without a word: killed, or os._exit from inside fn
                    procs[rank].join(1)
                    outcomes[rank] = ("error", f"exited with code {procs[rank].exitcode} without a result")
                if outcomes[rank][0] == "error" and first_failure_at is None:
                    first_failure_at = time.monotonic()
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
            # No timeout: join(timeout) waits on a pipe that DataLoader workers forked by the rank inherit and
            # hold open for seconds after it exits; a plain waitpid returns as soon as the rank is gone.
            proc.join()
        for conn in conns:
            conn.close()
    failures = {rank: detail for rank, (status, detail) in outcomes.items() if status == "error"}
    missing = [rank for rank in range(world_size) if rank not in outcomes]
    report = _hang_report(stack_files, threads_at_fork) if missing and not failures else ""
    shutil.rmtree(stack_dir, ignore_errors=True)
    if failures:
        failures.update({rank: "killed: still running after another rank failed" for rank in missing})
        raise RankFailed(failures)
    if missing:
        raise AssertionError(f"ranks {missing} still running after {timeout:.0f} s: killed (a hang?)\n{report}")
    return [outcomes[rank][1] for rank in range(world_size)]
