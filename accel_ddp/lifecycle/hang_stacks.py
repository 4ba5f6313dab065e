"""What a hung run's stacks say: each rank's frame of the user's own code and the collective it waits in, and the
one line that names the stuck ranks (:mod:`accel_ddp.lifecycle.hang` writes the stacks and gathers these).

A rank's stacks are faulthandler's text (``faulthandler.dump_traceback``: CPython's Python/traceback.c
``_Py_DumpTracebackThreads``): for each thread a header, ``Thread 0x... (most recent call first):``, then one
line per frame, ``  File "PATH", line N in NAME``, innermost first. :mod:`~accel_ddp.lifecycle.hang` puts a line
of its own (``SECTION``) before the rank's dump and before each of its DataLoader workers'.

Who is stuck. Every rank of a hung run waits somewhere: those that reached the next collective wait in it (in
``distributed_c10d.py``, or in the backward pass, where DDP all-reduces the gradients); the one that never got there
is elsewhere, usually in the user's own code (a loss, a metric, a dataset's ``__getitem__`` in a worker). So a rank
is stuck when it is behind the others' optimizer step, or it stands in the user's code, or it waits in no
collective; a rank in a collective called from the user's code is stuck too when no rank stands in the user's code
outside one (a collective only some ranks call). A rank with no stacks (stopped, dead) is named as such.
"""

from __future__ import annotations

import os
import re
import sys
import sysconfig
from dataclasses import dataclass

SECTION = "=== "  # starts the line hang.py writes before a process's dump
WORKER_SECTION = "DataLoader worker"  # ... in that line: a worker's dump follows
_FRAME = re.compile(r'^\s+File "(?P<file>[^"]*)", line (?P<line>\d+|\?\?\?) in (?P<name>.+)$')
_THREAD = re.compile(r"^(?:Current thread|Thread) (0x[0-9a-fA-F]+)")
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # accel_ddp/
# The backward pass: where DDP's reducer waits for the gradients' all-reduce (torch/autograd/graph.py).
_BACKWARD = ("_engine_run_backward",)


@dataclass(frozen=True)
class Frame:
    file: str
    line: str
    name: str

    def shown(self) -> str:
        """``path:line in name``, the path relative to the working directory when under it."""
        path = os.path.relpath(self.file) if self.file.startswith(os.getcwd() + os.sep) else self.file
        return f"{path}:{self.line} in {self.name}"


def sections(text: str) -> list[tuple[str, list[list[Frame]], list[int]]]:
    """``text`` split at ``SECTION`` lines: (the section's line, its threads' frames innermost first, their ids)."""
    found: list[tuple[str, list[list[Frame]], list[int]]] = []
    for row in text.splitlines():
        if row.startswith(SECTION):
            found.append((row[len(SECTION):], [], []))
        elif found and (thread := _THREAD.match(row)):
            found[-1][1].append([])
            found[-1][2].append(int(thread.group(1), 16))
        elif found and found[-1][1] and (frame := _FRAME.match(row)):
            found[-1][1][-1].append(Frame(frame["file"], frame["line"], frame["name"].strip()))
    return found


def _library_roots() -> tuple[str, ...]:
    """Where torch, Accelerate and the standard library live: frames there are never the user's line."""
    roots = {sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["platstdlib"], _PACKAGE}
    for name in ("torch", "accelerate"):
        module = sys.modules.get(name)
        if module is not None and getattr(module, "__file__", None):
            roots.add(os.path.dirname(os.path.abspath(module.__file__)))
    return tuple(os.path.join(root, "") for root in roots)


def user_frame(frames: list[Frame], roots: tuple[str, ...] | None = None) -> Frame | None:
    """The innermost frame of the user's own code that the package (or torch) called; None where the thread stands
    in library code only. Frames outside the package's calls (a script calling ``train()``) do not count."""
    roots = roots or _library_roots()
    for frame in frames:  # innermost first
        if frame.file.startswith(os.path.join(_PACKAGE, "")):
            return None  # reached the package before any user frame: the user's frames further out called it
        if not (frame.file.startswith(roots) or frame.file.startswith("<")):  # "<frozen ...>": the stdlib's
            return frame
    return None


def waits_in(frames: list[Frame]) -> str | None:
    """The collective a thread waits in (``all_reduce``, ``barrier``, ...), ``backward`` in DDP's backward pass, or
    None."""
    for frame in frames:  # innermost first
        if frame.file.endswith(os.path.join("distributed", "distributed_c10d.py")) and frame.name != "wrapper":
            return frame.name
        if frame.name in _BACKWARD and os.path.join("torch", "autograd") in frame.file:
            return "backward"
    return None


def summarize(text: str, main_thread: int) -> dict:
    """A rank's dump (``text``) in a few words, sent to the reporting rank: ``where`` (the user's frame, in the main
    thread or else in a DataLoader worker), ``wait`` (the main thread's collective), ``inner`` (its innermost frame)."""
    where = wait = inner = worker = None
    for title, threads, ids in sections(text):
        if title.startswith(WORKER_SECTION):
            frame = next((found for frames in threads if (found := user_frame(frames))), None)
            if where is None and frame is not None:
                where, worker = frame.shown(), title.split(" of rank")[0]  # "DataLoader worker pid N"
            continue
        main = next((frames for frames, ident in zip(threads, ids, strict=True) if ident == main_thread), [])
        wait, frame = waits_in(main), user_frame(main)
        inner = main[0].shown() if main else None
        where = frame.shown() if frame is not None else where
    return {"where": where, "wait": wait, "inner": inner, "worker": worker}


def stuck_ranks(states: dict[int, dict]) -> list[int]:
    """The ranks that stopped the others, from each reporting rank's state (``step``, ``where``, ``wait``)."""
    if not states:
        return []
    newest = max(state["step"] for state in states.values())
    outside = any(state["where"] and not state["wait"] for state in states.values())  # user code, no collective

    def stuck(state: dict) -> bool:
        if state["step"] < newest or not state["wait"]:
            return True
        return bool(state["where"]) and not outside  # a collective the others did not call, from the user's code

    return [rank for rank, state in sorted(states.items()) if stuck(state)]


def hang_line(states: dict[int, dict], world_size: int, seconds: float, folder: str) -> str:
    """The one line: who is stuck and where, who waits in what, who said nothing; where the stacks are."""
    silent = [rank for rank in range(world_size) if rank not in states]
    stuck = stuck_ranks(states)
    parts = [_stuck_part(rank, states[rank]) for rank in stuck]
    waiting: dict[str, list[int]] = {}
    for rank, state in sorted(states.items()):
        if rank not in stuck:
            waiting.setdefault(_wait_words(state["wait"]), []).append(rank)
    parts += [f"{_ranks(ranks)} waiting in {what}" for what, ranks in waiting.items()]
    parts += [f"{_ranks(silent)}: no stack: stopped or dead (no answer from its watchdog)"] if silent else []
    if not stuck and not silent:
        parts.insert(0, "no rank stands out")
    return (f"{'; '.join(parts)}: no optimizer step for {seconds:g} s (--hang_timeout); every rank's stacks in "
            f"{folder}; once fixed, --resume_from_checkpoint auto continues from the last checkpoint")


def _stuck_part(rank: int, state: dict) -> str:
    step = f"after optimizer step {state['step']}"
    if state["where"]:
        inside = f", in {state['wait']}, which the other ranks did not call" if state["wait"] else ""
        worker = f", in its {state['worker']}" if state["worker"] else ""
        return f"rank {rank} is stuck at {state['where']}{worker}{inside} ({step})"
    return f"rank {rank} is stuck at {state['inner'] or 'an unknown frame'} ({step})"


def _wait_words(wait: str | None) -> str:
    return "backward (DDP's gradient all-reduce)" if wait == "backward" else str(wait)


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
