"""This process's stdout and stderr once nobody reads them: writes go to /dev/null instead of failing the run.

A launcher killed with its process group (``kill -9 -- -PGID``, the OOM killer taking a job step)
takes the rest of its shell pipeline with it (``accelerate launch ... 2>&1 | tee log``). Its ranks
live on in sessions of their own (accel_ddp.lifecycle.preemption notices the launcher is gone, and they stop
and save), but their stdout and stderr are then pipes without a reader: the next write, the
progress bar's a tenth of a second later or the exit line, raises BrokenPipeError (Python ignores
SIGPIPE) and would end the rank before its checkpoint is saved.

    >>> guard_stdio()          # under torchrun, at start-up: sys.stdout and sys.stderr survive a dead pipe
    >>> silence_dead_pipes()   # fds 1 and 2, where they are pipes nobody reads: /dev/null from now on
"""

from __future__ import annotations

import os
import select
import stat
import sys
from typing import Any


def silence_dead_pipes(fds: tuple[int, ...] = (1, 2)) -> None:
    """Point those of ``fds`` that are pipes nobody reads any more at /dev/null (such a pipe polls POLLERR)."""
    if not hasattr(select, "poll"):
        return
    for fd in fds:
        try:
            if not stat.S_ISFIFO(os.fstat(fd).st_mode):
                continue
            poller = select.poll()
            poller.register(fd, select.POLLOUT)
            if not any(events & select.POLLERR for _, events in poller.poll(0)):
                continue
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, fd)
            os.close(devnull)
        except OSError:  # closed, or not ours to change: the write will tell
            continue


class _DeadPipeGuard:
    """A text stream whose writes to a pipe that lost its reader go to /dev/null from then on."""

    def __init__(self, stream):
        self._stream = stream

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)

    def _retried(self, method: str, *args):
        try:
            return getattr(self._stream, method)(*args)
        except BrokenPipeError:
            silence_dead_pipes((self._stream.fileno(),))
            return getattr(self._stream, method)(*args)  # what was buffered goes to /dev/null too

    def write(self, text: str) -> int:
        return self._retried("write", text)

    def flush(self) -> None:
        self._retried("flush")


def _is_pipe(stream) -> bool:
    try:
        return stat.S_ISFIFO(os.fstat(stream.fileno()).st_mode)
    except (AttributeError, OSError, ValueError):  # no file descriptor (a capture, a closed stream)
        return False


def guard_stdio() -> None:
    """Wrap ``sys.stdout`` and ``sys.stderr``, where they are pipes, so that a dead pipe cannot fail a write.

    Before anything keeps a reference to them (a progress bar takes ``sys.stderr`` when it is made)."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if not isinstance(stream, _DeadPipeGuard) and _is_pipe(stream):
            setattr(sys, name, _DeadPipeGuard(stream))
