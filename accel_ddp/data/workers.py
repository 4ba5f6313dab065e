"""DataLoader workers: deaf to the job's preemption signals, and never alive after their rank.

A signal meant for the job reaches a rank's DataLoader workers too. torchrun forwards SIGTERM to
each worker's whole process group (``os.killpg`` in ``SubprocessHandler.close``,
torch/distributed/elastic/multiprocessing/subprocess_handler/subprocess_handler.py; the workers
start with ``start_new_session=True``), and ``scancel`` signals every process of the job. torch's
own worker handler (``handler_SIGTERM`` in torch/csrc/DataLoader.cpp, installed by
``_set_worker_signal_handlers`` at the top of ``_worker_loop``) exits quietly only when the sender
is the worker's parent; from anyone else it re-raises SIGTERM with the default action. The worker
dies and its rank fails with "DataLoader worker (pid N) is killed by signal: Terminated" instead of
saving a checkpoint. So every DataLoader the package builds passes :class:`WorkerInit` as its
``worker_init_fn``, which torch calls after its own handlers (torch/utils/data/_utils/worker.py).
In the worker (Linux):

- SIGUSR1, SIGINT and SIGHUP are ignored (a Ctrl-C or a closed terminal reaches the whole foreground process
  group; torch's worker loop ends quietly on KeyboardInterrupt, and SIGHUP's default kills: either way the rank
  would fail with "DataLoader worker exited unexpectedly" instead of saving).
- SIGTERM is blocked in every thread and taken by one thread (``sigwaitinfo``), which exits the
  worker quietly when the sender is its parent, as torch's handler does, and drops it otherwise.
  The parent's SIGTERM must still end it: torch's last resort in ``_shutdown_workers`` is
  ``terminate()``, and multiprocessing's exit handler (``multiprocessing.util._exit_function``)
  terminates daemonic children, which DataLoader workers are, then joins them without a timeout:
  a worker deaf to its parent would hang the rank's exit.
- ``PR_SET_PDEATHSIG`` with SIGKILL: the kernel kills the worker when the thread that forked it
  ends, so a rank killed outright (SIGKILL, the OOM killer) leaves no worker behind, even one
  busy in a long read (torch's own watchdog, a ``getppid()`` check between two batches, misses
  those). That thread is the one iterating the DataLoader: the rank's main thread for every loader
  of ours (the pin-memory thread forks nothing). A DataLoader iterated in a thread that ends
  before the loader is done would lose its workers with that thread.

On other systems the worker keeps torch's SIGTERM handler; SIGUSR1, SIGINT and SIGHUP are ignored.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import multiprocessing.context
import os
import signal
import sys
import threading
from collections.abc import Callable

from accel_ddp.lifecycle.exit_codes import ExitCode
from accel_ddp.lifecycle.hang import answer_stack_requests

_PR_SET_PDEATHSIG = 1  # linux/prctl.h
# accel_ddp.lifecycle.preemption.PREEMPTION_SIGNALS, written out: this module imports no torch.
_JOB_SIGNALS = {signal.SIGTERM, signal.SIGUSR1, signal.SIGINT, signal.SIGHUP}
_IGNORED = (signal.SIGUSR1, signal.SIGINT, signal.SIGHUP)  # the job's signals but SIGTERM, which the parent sends


# How a DataLoader worker's death shows in its rank, wherever the rank was: torch's RuntimeError ("DataLoader worker
# (pid N) exited unexpectedly", "... is killed by signal: Killed."; torch/utils/data/dataloader.py
# ``_try_get_data``, torch/utils/data/_utils/signal_handling.py) when torch saw it dead; else what receiving a batch's
# shared storage from it raised (torch/multiprocessing/reductions.py ``rebuild_storage_fd`` -> ``DupFd.detach`` in
# multiprocessing/resource_sharer.py, which connects to the worker's listener and receives the descriptor there):
# refused or gone before the connection (ConnectionRefusedError, FileNotFoundError: its socket file), reset with the
# request unread (ConnectionResetError, BrokenPipeError), or an end instead of the descriptor (EOFError,
# ``reduction.recv_handle``). Each is a death only where a worker is found dead (``HostLoader._dead_workers``).
WORKER_DEATH_ERRORS = (RuntimeError, ConnectionError, EOFError, FileNotFoundError)


class WorkerInit:
    """A ``worker_init_fn``: the job's preemption signals ignored, death with the rank; then ``then(worker_id)``.

    Built in the rank (it records the rank's pid); picklable, for DataLoaders started by spawn or forkserver.

        >>> DataLoader(dataset, num_workers=2, worker_init_fn=WorkerInit(my_worker_init))
    """

    def __init__(self, then: Callable[[int], None] | None = None, forked: bool = False):
        self.then = then
        self.rank_pid = os.getpid()
        self.forked = forked  # the worker is the rank's child (its getppid() is the rank's pid while it lives)

    def __call__(self, worker_id: int) -> None:
        deaf_to_job_signals()
        die_with_rank(self.rank_pid if self.forked else None)
        answer_stack_requests()  # --hang_timeout: a hung rank asks its workers for their stacks (lifecycle/hang.py)
        if self.then is not None:
            self.then(worker_id)


def worker_options(num_workers: int, then: Callable[[int], None] | None = None) -> dict:
    """``DataLoader`` keywords for workers of ours: ``worker_init_fn`` (:class:`WorkerInit`, then ``then``) and, where
    workers are forked, a ``multiprocessing_context`` whose workers start with the job's signals blocked.

    torch installs its SIGTERM handler first thing in the worker and calls ``worker_init_fn`` a little later;
    a SIGTERM in between (the whole job signalled while a DataLoader starts its workers, such as the first
    evaluation's) would still kill the worker. A forked child inherits its parent's signal mask, so
    :class:`_QuietForkProcess` blocks the signals around the fork: one arriving early waits, pending, for
    :func:`deaf_to_job_signals`. Accelerate's ``prepare`` keeps both keywords (``prepare_data_loader`` copies
    every DataLoader argument, ``_PYTORCH_DATALOADER_KWARGS`` in accelerate/data_loader.py).

        >>> DataLoader(dataset, num_workers=2, **worker_options(2))
    """
    if num_workers == 0:
        return {}  # torch refuses a multiprocessing_context without workers
    if isinstance(then, WorkerInit):
        then = then.then
    default = multiprocessing.get_start_method(allow_none=True) or multiprocessing.get_all_start_methods()[0]
    if default != "fork":  # spawn and forkserver children do not start from this thread's signal mask
        return {"worker_init_fn": WorkerInit(then)}
    return {"worker_init_fn": WorkerInit(then, forked=True), "multiprocessing_context": _QuietForkContext()}


class _QuietForkProcess(multiprocessing.context.ForkProcess):
    def start(self) -> None:
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, _JOB_SIGNALS)
        try:
            super().start()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)  # a signal that came meanwhile is handled now


class _QuietForkContext(multiprocessing.context.ForkContext):
    Process = _QuietForkProcess


def deaf_to_job_signals() -> None:
    """In a DataLoader worker's main thread, before it starts other threads: SIGUSR1, SIGINT and SIGHUP ignored,
    SIGTERM taken by a thread that ends the worker only when its parent sent it."""
    for sig in _IGNORED:
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, set(_IGNORED))  # one pending since the fork: ignored now
    if not hasattr(signal, "sigwaitinfo"):  # not Linux: torch's SIGTERM handler stays
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
        return
    # Threads inherit the signal mask of the thread that starts them: blocked here, SIGTERM stays blocked in
    # every thread the worker starts later (multiprocessing's queue feeders, Arrow's readers).
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    threading.Thread(target=_exit_on_parents_sigterm, name="accel_ddp-sigterm", daemon=True).start()


def _exit_on_parents_sigterm() -> None:
    while True:  # one pending since the fork is taken first
        info = signal.sigwaitinfo({signal.SIGTERM})
        if info.si_pid == os.getppid():  # torch's handler_SIGTERM: the parent's SIGTERM is a quiet exit
            os._exit(ExitCode.OK)


def die_with_rank(rank_pid: int | None) -> None:
    """Have the kernel SIGKILL this worker when the thread that forked it ends (Linux ``PR_SET_PDEATHSIG``).

    ``rank_pid``: the pid of the rank that forked this worker; None when another process started it (spawn,
    forkserver: then PR_SET_PDEATHSIG follows that process)."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
        return  # not allowed here (a sandbox): torch's watchdog still ends the worker between two batches
    if rank_pid is not None and os.getppid() != rank_pid:  # the rank died before the prctl: no signal will come
        os._exit(ExitCode.OK)
