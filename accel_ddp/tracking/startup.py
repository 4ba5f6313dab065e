"""Start-up time of a worker: from the process's start to its first optimizer step, by phase.

The zero point is the worker process's start as the kernel recorded it (``/proc/self/stat``),
because a launcher's own start is not visible to the processes it starts: interpreter start-up
and imports count, the launcher's time before it started the worker (``accelerate launch`` and
torchrun: ~1-2 s) does not. No torch or Accelerate import here, so benchmarks/bare_ddp.py
measures its start-up the same way.

    >>> clock = StartupClock()       # first thing in setup(): "imports" = process start -> now
    >>> clock.mark("process_group")  # ... after each phase
    >>> clock.phases()               # {"imports": 2.9, "process_group": 0.4, ...} in seconds
"""

from __future__ import annotations

import os
import time


def process_age() -> float | None:
    """Seconds since this process started (10 ms resolution), or None where ``/proc`` is missing.

    ``/proc/self/stat`` field 22 is the start in clock ticks after boot; ``CLOCK_BOOTTIME`` is
    now on the same clock, to the nanosecond (``/proc/stat``'s ``btime``, what ``psutil`` adds
    to it, is rounded to the second).
    """
    try:
        with open("/proc/self/stat", encoding="ascii") as fh:
            start_ticks = int(fh.read().rsplit(")", 1)[1].split()[19])  # after "(comm)": field 22 is the 20th
        return time.clock_gettime(time.CLOCK_BOOTTIME) - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):  # not Linux
        return None


class StartupClock:
    """Marks on ``time.perf_counter()``'s clock, from the process's start; the first phase ends at construction."""

    def __init__(self, first_phase: str = "imports"):
        now = time.perf_counter()
        age = process_age()
        self.process_start = None if age is None else now - age
        self._marks: list[tuple[str, float]] = [(first_phase, now)]

    def mark(self, phase: str) -> None:
        """``phase`` ended now (the time since the previous mark is its duration)."""
        self._marks.append((phase, time.perf_counter()))

    def seconds(self) -> float | None:
        """Process start to the last mark; None without a process start time."""
        return None if self.process_start is None else self._marks[-1][1] - self.process_start

    def phases(self) -> dict[str, float]:
        """Seconds per phase, in order; the first phase starts at the process start (absent without it)."""
        phases = {}
        if self.process_start is not None:
            phases[self._marks[0][0]] = self._marks[0][1] - self.process_start
        for (_, before), (name, at) in zip(self._marks, self._marks[1:], strict=False):
            phases[name] = at - before
        return phases
