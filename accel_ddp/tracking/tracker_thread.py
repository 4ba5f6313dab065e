"""The one thread that calls into the trackers, so that a tracker's start can be abandoned.

A tracker's start may wait on a network for minutes (an unreachable MLflow server retried for 259 s,
W&B online without a network for 109 s) and no tracker takes a timeout for it. So every call into
a run's trackers (start, config, records, finish) runs on one daemon thread, and the main thread
waits for a start at most ``--tracker_start_timeout`` seconds, answering a preemption signal at once.
One thread for every call, not one per start: MLflow keeps its active run per thread
(``_active_run_stack`` is a ``ThreadLocalVariable`` in mlflow/tracking/fluent.py), so the run a start
opened must be logged to from the same thread. A start given up on leaves the thread behind, busy;
it is a daemon, and the run is stopping anyway (``exit_process`` ends the process with ``os._exit``).

    >>> worker = TrackerThread()
    >>> worker.call(tracker.start, timeout=30, watcher=preemption)   # TrackerTimedOut / TrackerInterrupted
    >>> worker.call(lambda: tracker.log(values, step=4))             # waits as long as it takes
    >>> worker.close()
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Any


class TrackerTimedOut(Exception):  # noqa: N818 - an outcome the caller turns into its own line
    """A call did not return within its timeout; the thread is left to it."""


class TrackerInterrupted(Exception):  # noqa: N818
    """A preemption signal came while the main thread waited for a call."""


SLICE_S = 0.1  # the main thread waits in slices this long, and looks for a recorded signal between two


def _wait(done: threading.Event, timeout: float | None, stopped: Callable[[], bool]) -> bool | None:
    """``done.wait(timeout)`` in slices: True once done, False past ``timeout``, None once ``stopped()`` says so.

    A signal only sets a flag (the watcher's handler) and this loop reads it between slices: an
    exception raised from a handler into ``Event.wait`` could land inside ``Condition.wait``'s
    ``_acquire_restore``, before the lock is taken back, and ``Event.wait`` would then release a
    lock it does not hold ("RuntimeError: release unlocked lock", which replaces the interrupt;
    threading.py). The handler still runs within a slice: a signal interrupts the lock wait of the
    main thread (Lock.acquire: "can be interrupted by signals" on POSIX), or a slice ends first."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while not stopped():
        left = SLICE_S if deadline is None else min(SLICE_S, deadline - time.monotonic())
        if left <= 0:
            return done.is_set()
        if done.wait(left):
            return True
    return None


class TrackerThread:
    """A daemon thread running the calls it is given, one at a time, in order; started by the first call."""

    def __init__(self) -> None:
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self.abandoned = False  # a call timed out or was interrupted: the thread may never be free again
        self.users = 0  # trackers sharing it that have not finished (GuardedTracker counts itself)

    def call(self, fn: Callable[[], Any], timeout: float | None = None, watcher: Any = None) -> Any:
        """``fn()`` on the thread; its result, or its exception raised here.

        ``timeout``: seconds to wait at most (``TrackerTimedOut``); None waits as long as it takes.
        ``watcher``: a ``PreemptionWatcher``: a SIGTERM or SIGUSR1 while waiting (or before) raises
        ``TrackerInterrupted`` within a slice (``SLICE_S``), from here, not from the signal handler.
        """
        if self.abandoned:
            raise TrackerTimedOut("an earlier call to the trackers never returned")
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, name="accel_ddp-trackers", daemon=True)
            self._thread.start()
        done, outcome = threading.Event(), {}
        self._calls.put((fn, done, outcome))
        returned = done.wait(timeout) if watcher is None else _wait(done, timeout, lambda: watcher.signalled)
        if returned is None:
            self.abandoned = True
            raise TrackerInterrupted(watcher.reason)
        if not returned:
            self.abandoned = True
            raise TrackerTimedOut(f"no answer within {timeout:g} s")
        if "error" in outcome:
            raise outcome["error"]
        return outcome.get("value")

    def close(self) -> None:
        """Let the thread end once it has run what it was given (a thread left busy stays a daemon)."""
        if self._thread is not None:
            self._calls.put(None)
            if not self.abandoned:
                self._thread.join()
            self._thread = None

    def _serve(self) -> None:
        while (item := self._calls.get()) is not None:
            fn, done, outcome = item
            try:
                outcome["value"] = fn()
            except BaseException as err:  # noqa: BLE001 - handed to the caller, whatever it is
                outcome["error"] = err
            finally:
                done.set()
