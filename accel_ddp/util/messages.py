"""The one place for what accel_ddp says on the console: warnings, notes, error lines, and which rank prints.

    warn("--foo is deprecated ...", ranks="first")     # accel_ddp: warning: --foo is deprecated ...
    warn("padding with <eos>", kind="note", ranks="main")
    say("resumed from outputs/run/checkpoints/step_00000100 ...")   # accel_ddp: resumed from ... (stdout)
    error_line("--lr -1: must be > 0; pass a positive number")   # accel_ddp: error: --lr -1: ...
    first_line(err)                                    # an error's first line, for a one-line message
    write(report.render())                             # text as it is: a command's output, the start-up block
    write(f"step 40 epoch 1: loss 0.3131 ...", above_bar=True)   # a log or eval line while the bar is on screen

Which rank prints (``ranks``):

- ``"first"``: the process the launcher numbered 0 (``accel_ddp.util.ranks``: the one rule). For what every rank finds
  alike before the process group exists (the command line, the config): one line, not one per rank.
- ``"main"``: Accelerate's main process, once the group exists (every rank sees the same batches).
- ``"every"``: each rank that finds it; for what is that rank's own (its stream position, its checkpoint
  reads), or where only the main process calls anyway.

A failing launch's ``accel_ddp: error:`` line is printed by the rank that failed first
(:mod:`accel_ddp.lifecycle.failure`); it is formatted here. Nothing else in the package writes to the console
(``print``, ``sys.stdout.write``, ``tqdm.write``): tests/test_layering.py checks it; the progress bar is tqdm's own.
"""

from __future__ import annotations

import sys

from accel_ddp.util.ranks import is_first_rank

PREFIX = "accel_ddp"


def first_line(err: BaseException, limit: int = 300, mark: str = "") -> str:
    """An error's first line (its type's name when it says nothing), at most ``limit`` characters; a line cut
    short ends with ``mark`` (e.g. "...")."""
    line = (str(err).strip().splitlines() or [type(err).__name__])[0]
    return line if len(line) <= limit else line[:limit - len(mark)] + mark


def error_line(message: object) -> str:
    """The one line of bad input: ``accel_ddp: error: <what is wrong>; <the fix>``, newline included."""
    return line("error", message) + "\n"


def prints(ranks: str) -> bool:
    """Does this process print a message meant for ``ranks`` ("first", "main" or "every")?"""
    if ranks == "every":
        return True
    if ranks == "first":
        return is_first_rank()
    if ranks == "main":
        from accelerate import PartialState  # imported here: the CLI's messages need no Accelerate

        return PartialState().is_main_process
    raise ValueError(f"ranks must be 'first', 'main' or 'every', got {ranks!r}")


def line(kind: str, message: object) -> str:
    """``accel_ddp: <kind>: <message>``: a warning's or note's text, for a caller that writes it its own way."""
    return f"{PREFIX}: {kind}: {message}"


def warn(message: str, kind: str = "warning", ranks: str = "every", above_bar: bool = False) -> None:
    """``accel_ddp: <kind>: <message>`` on stderr, from the ``ranks`` that print it (see the module's docstring).

    ``above_bar``: while a progress bar may be on screen (training), through ``tqdm.write``, which clears the
    bar's line first and redraws it below."""
    if prints(ranks):
        _write(line(kind, message), sys.stderr, above_bar)


def say(message: str, ranks: str = "every", err: bool = False, above_bar: bool = False) -> None:
    """``accel_ddp: <message>`` on stdout (stderr with ``err``): what the run is doing, e.g. where it resumed from."""
    if prints(ranks):
        _write(f"{PREFIX}: {message}", sys.stderr if err else sys.stdout, above_bar)


def _write(text: str, stream, above_bar: bool) -> None:
    if above_bar:
        from tqdm.auto import tqdm

        tqdm.write(text, file=stream)
        stream.flush()
    else:
        print(text, file=stream, flush=True)


def write(text: str, err: bool = False, above_bar: bool = False, end: str = "\n") -> None:
    """``text`` as it is (no ``accel_ddp:`` prefix), then ``end``, on stdout (stderr with ``err``), flushed; in one
    write, so another process's output cannot land inside it. ``above_bar``: through ``tqdm.write``, as ``warn``'s.
    The caller decides which rank writes."""
    stream = sys.stderr if err else sys.stdout
    if above_bar:
        from tqdm.auto import tqdm

        tqdm.write(text, file=stream, end=end)
    else:
        stream.write(text + end)
    stream.flush()


def note(message: str, ranks: str = "every") -> None:
    """``accel_ddp: note: <message>`` on stderr: something worth knowing that needs no change."""
    warn(message, kind="note", ranks=ranks)


def empty_sum(loss: str = "the loss function") -> str:
    """The error line for a ``(sum, num_items)`` loss whose sum is not 0 over 0 items."""
    return (f"{loss} returned a (sum, num_items) pair with a non-zero sum over num_items 0 (a sum over no items is "
            "0); return the count of the items the sum adds up, e.g. (losses[mask].sum(), mask.sum())")


def out_of_memory(step: int, per_device: int | None, accumulation: int) -> str:
    """The one line of a training step that ran out of device memory (``--per_device_batch_size auto`` decides
    only at start: a later, larger batch, such as a longer text, can still run out)."""
    return (f"out of device memory in optimizer step {step} with --per_device_batch_size {per_device} x {accumulation} "
            "accumulation steps; give a smaller --per_device_batch_size that divides each rank's share of the global "
            "batch (the global batch, and so the training, stays the same), or --per_device_batch_size auto to find "
            "the largest that fits at start")
