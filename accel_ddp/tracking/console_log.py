"""``OUTPUT_DIR/run.log``: everything the main process printed, as the console showed it, for each start of the run.

    console = ConsoleLog().install()        # the launch's rank 0: stdout and stderr are teed from here on
    console.start("outputs/run/run.log", append=False)   # once the run owns its folder: what was printed so far,
    ...                                     #   then every line as it is printed (block, log and eval lines, warnings)
    console.close()                         # after the final or the interrupt line: the streams as they were

The start-up block, the log and evaluation lines, notes and warnings, a failure's line and the interrupt line all
reach the console through ``sys.stdout`` and ``sys.stderr`` (``print``, ``tqdm.write``, ``accel_ddp.util.messages``),
so a tee on both catches every one, whoever prints it. The progress bar redraws its line with ``\\r``: only what a
line finally shows is kept (tqdm.write clears the bar with ``\\r`` before its line), so run.log holds the lines, not
thousands of redraws. Until ``start`` the lines are kept in memory (a run that never owns its folder, refused or
already finished, writes nothing); a write that fails (a full disk) ends the log, never the run.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Any

from accel_ddp.util.ranks import is_first_rank

MAX_BUFFERED = 2000  # lines kept before run.log can be written (start-up output; datasets' bars are one line each)


class ConsoleLog:
    """A tee of this process's stdout and stderr into ``run.log`` (rank 0 of the launch only)."""

    def __init__(self):
        self._lock = threading.Lock()  # tracker threads and the loop may print at once
        self._lines: list[str] = []  # printed before start()
        self._partial: dict[str, str] = {}  # each stream's line in progress
        self._file = None
        self._tees: dict[str, _Tee] = {}
        self.closed = False

    def install(self) -> ConsoleLog:
        """Tee ``sys.stdout`` and ``sys.stderr`` (the launch's rank 0, who is the main process; others: nothing)."""
        if is_first_rank() and not self._tees:
            for name in ("stdout", "stderr"):
                if getattr(sys, name) is None:  # no console at all (pythonw): nothing printed, nothing to keep
                    continue
                self._tees[name] = _Tee(getattr(sys, name), self, name)
                setattr(sys, name, self._tees[name])
        return self

    def start(self, path: str, append: bool) -> None:
        """From now on into ``path`` (a resumed run appends; a fresh one starts it anew): a time stamp, the lines
        printed so far, then each line as it ends. OSError (the caller's to report) leaves the log in memory."""
        with self._lock:
            fh = open(path, "a" if append else "w", encoding="utf-8")
            fh.write(f"{time.strftime('%Y-%m-%d %H:%M:%S %Z')}\n" + "".join(f"{line}\n" for line in self._lines))
            fh.flush()
            self._file, self._lines = fh, []

    def feed(self, text: str, stream: str) -> None:
        """What ``stream`` just wrote: its complete lines are logged, each as the console last showed it."""
        with self._lock:
            if self.closed:
                return
            pending = self._partial.get(stream, "") + text
            *done, rest = pending.split("\n")
            self._partial[stream] = rest[rest.rfind("\r"):] if "\r" in rest else rest  # a bar's redraws: the last
            for line in done:
                self._add(shown(line))

    def _add(self, line: str) -> None:
        if self._file is None:
            self._lines = [*self._lines[-(MAX_BUFFERED - 1):], line]
            return
        try:
            self._file.write(line + "\n")
            self._file.flush()  # a crash keeps every line printed before it
        except (OSError, ValueError):  # a full disk: the log ends here, the run goes on
            self._close_file()

    def close(self) -> None:
        """The unfinished lines logged, run.log closed, the streams put back (where nothing wrapped them since)."""
        with self._lock:
            for rest in self._partial.values():
                if shown(rest):
                    self._add(shown(rest))
            self._partial.clear()
            self.closed = True
            self._close_file()
        for name, tee in self._tees.items():
            if getattr(sys, name) is tee:
                setattr(sys, name, tee.stream)

    def _close_file(self) -> None:
        if self._file is not None:
            try:
                self._file.close()
            except OSError:
                pass
            self._file = None


def shown(line: str) -> str:
    """What a terminal shows of ``line``: the text after its last carriage return that is not blank (tqdm.write
    clears the bar's line with spaces between two ``\\r`` before writing its own)."""
    return next((part for part in reversed(line.split("\r")) if part.strip()), "").rstrip()


class _Tee:
    """A text stream that also hands what it writes to the console log; everything else is the stream's."""

    def __init__(self, stream: Any, log: ConsoleLog, name: str):
        self.stream, self._log, self._name = stream, log, name

    def __getattr__(self, name: str) -> Any:  # fileno, isatty, encoding, buffer: tqdm and others ask
        return getattr(self.stream, name)

    def write(self, text: str) -> int:
        written = self.stream.write(text)
        self._log.feed(text, self._name)
        return written

    def flush(self) -> None:
        self.stream.flush()
