"""The output folder as a whole: checked and claimed for one run before anything is written; finished runs.

    check_output_dir("outputs/run")                       # at once, creating nothing: a file in the way, ...
    lock = claim_output_dir(accelerator, "outputs/run")   # before the first write (collective: every rank
                                                          # gets the same ConfigError)
    summary = finished_summary("outputs/run", total_steps=320, global_batch_size=64)   # None: not finished
    stop_if_finished(accelerator, "outputs/run", 320, 64)  # the same, collective: RunFinished on every rank
    refuse_to_overwrite_finished(accelerator, "outputs/run")  # before a start from scratch (collective)
    lock.release()                                        # or let the process end: the kernel releases it

One run per folder: the main process holds an exclusive POSIX record lock (``lockf``) on
``OUTPUT_DIR/.lock`` for the whole run. The kernel drops it when the process ends, however it ends
(SIGKILL and node-local OOM kills included), so a crashed run never leaves a stale lock behind,
unlike a marker file. A POSIX lock belongs to the process, not to the open file: DataLoader workers
forked from the main process do not hold it, so a crashed run's lingering workers cannot block the
relaunch (an ``flock`` would be shared with them). It is also the lock NFS arbitrates between
machines. The lock file stays in the folder (removing a locked file would let a third run lock a
new one beside it).
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
from typing import Any

from accelerate import Accelerator

from accel_ddp.lifecycle.failure import main_process_decides
from accel_ddp.outputs.names import (
    CHECKPOINTS_DIR,
    CONFIG_NAME,
    CSV_NAME,
    CURVES_NAME,
    LOCK_NAME,
    METRICS_NAME,
    MODEL_CARD_NAME,
    PRETRAINED_SUBDIR,
    PROFILE_SUBDIR,
    RUN_LOG_NAME,
    SUMMARY_NAME,
    TENSORBOARD_SUBDIR,
    TRACKERS_NAME,
    WEIGHTS_NAME,
)
from accel_ddp.util.messages import say
from accel_ddp.util.validation import ConfigError


class OutputLock:
    """The exclusive lock of one output folder; held by the main process, a no-op elsewhere."""

    def __init__(self, path: str):
        self.path = path
        self._fd: int | None = None

    def acquire(self) -> None:
        """Create the folder if needed, check it is writable and lock it, or raise one ConfigError line."""
        path = self.path
        if os.path.exists(path) and not os.path.isdir(path):
            raise ConfigError(f"--output_dir {path} is a file, not a folder; give a folder path")
        try:
            os.makedirs(path, exist_ok=True)
        except NotADirectoryError:
            raise ConfigError(f"--output_dir {path}: part of that path is a file, not a folder; "
                              "give a path made of folders") from None
        except OSError as err:  # no permission, read-only or special file system (/proc), name too long, ...
            raise ConfigError(f"--output_dir {path}: cannot create it ({err.strerror}); "
                              "give a folder you can write") from None
        if not os.access(path, os.W_OK | os.X_OK):
            raise ConfigError(f"--output_dir {path} is not writable; give a folder you can write, "
                              "or fix its permissions")
        lock_path = os.path.join(path, LOCK_NAME)
        try:
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)  # less the umask
        except OSError as err:
            raise ConfigError(f"--output_dir {path}: cannot write in it ({err.strerror}); "
                              "give a folder you can write") from None
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            os.close(fd)
            if err.errno in (errno.EACCES, errno.EAGAIN):  # POSIX allows either for a lock held elsewhere
                raise ConfigError(f"--output_dir {path} is in use by another run (it holds {lock_path}); wait "
                                  "for that run to end, or give another --output_dir") from None
            # e.g. ENOLCK: a network file system without lock support
            raise ConfigError(f"--output_dir {path}: cannot lock {lock_path} ({err.strerror}); give a folder "
                              "on a file system with locks (a local disk, NFSv4)") from None
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing it drops the lock (so would closing any other descriptor of the file)
            self._fd = None


def check_output_dir(path: str) -> None:
    """What can be told about ``--output_dir`` without creating anything (a ConfigError line), at start-up.

    A file in the way, a parent that is a file, a folder we may not write. The rest (a special file
    system such as /proc, a full disk) shows when ``claim_output_dir`` creates the folder.
    """
    if os.path.exists(path):
        if not os.path.isdir(path):
            raise ConfigError(f"--output_dir {path} is a file, not a folder; give a folder path")
        _check_names(path)
        nearest = path
    else:
        nearest = os.path.dirname(os.path.abspath(path))
        while not os.path.exists(nearest):
            nearest = os.path.dirname(nearest)
        if not os.path.isdir(nearest):
            raise ConfigError(f"--output_dir {path}: part of that path is a file, not a folder; "
                              "give a path made of folders")
    if not os.access(nearest, os.W_OK | os.X_OK):
        raise ConfigError(f"--output_dir {path}: cannot create or write it ({nearest} is not writable); give a "
                          "folder you can write, or fix its permissions")


# What the run writes under OUTPUT_DIR: these are folders, every other name of outputs.py a file.
FOLDERS = (CHECKPOINTS_DIR, PRETRAINED_SUBDIR, PROFILE_SUBDIR, TENSORBOARD_SUBDIR)
FILES = (CONFIG_NAME, METRICS_NAME, SUMMARY_NAME, WEIGHTS_NAME, CURVES_NAME, CSV_NAME, TRACKERS_NAME,
         MODEL_CARD_NAME, LOCK_NAME, RUN_LOG_NAME)


def _check_names(path: str) -> None:
    """A file where the run keeps a folder (``checkpoints``), or a folder where it writes a file: found at the
    first save or write otherwise, a traceback after training."""
    for name in FOLDERS + FILES:
        where = os.path.join(path, name)
        if os.path.exists(where) and os.path.isdir(where) != (name in FOLDERS):
            kind, other = ("a file", "a folder") if name in FOLDERS else ("a folder", "a file")
            raise ConfigError(f"--output_dir {path}: {where} is {kind}, not {other} (the run writes {name} there); "
                              "move it out of the way, or give another --output_dir")


def claim_output_dir(accelerator: Accelerator, path: str) -> OutputLock:
    """Check ``path`` is a usable folder and lock it for this run (collective; ConfigError on every rank)."""
    lock = OutputLock(path)
    main_process_decides(accelerator, lock.acquire)
    return lock


def finished_summary(output_dir: str, total_steps: int, global_batch_size: int) -> dict[str, Any] | None:
    """The ``summary.json`` of a run in ``output_dir`` that already finished what this config asks, else None.

    Finished means: ``summary.json`` (written at the very end) says ``optimizer_steps == total_steps`` at the
    same global batch, and the final ``model.safetensors`` is there. A run given more steps (a higher
    ``--epochs`` or ``--max_steps``) is not finished: it continues from its newest checkpoint.
    """
    try:
        with open(os.path.join(output_dir, SUMMARY_NAME), encoding="utf-8") as fh:
            summary = json.load(fh)
    except (OSError, ValueError):
        return None
    if not isinstance(summary, dict) or not os.path.isfile(os.path.join(output_dir, WEIGHTS_NAME)):
        return None
    steps, batch = summary.get("optimizer_steps"), summary.get("global_batch_size")
    if type(steps) is int and steps == total_steps and batch == global_batch_size:
        return summary
    if isinstance(summary.get("stopped_early"), dict) and batch == global_batch_size:
        return summary  # early stopping ended it (checkpoint/best.py): a relaunch has nothing to do
    return None


class RunFinished(Exception):  # noqa: N818 - an outcome, not a failure
    """``setup`` found that ``cfg.output_dir`` holds a run that already finished what ``cfg`` asks."""

    def __init__(self, summary: dict[str, Any]):
        super().__init__(f"already finished at step {summary['optimizer_steps']}")
        self.summary = summary


def stop_if_finished(accelerator: Accelerator, output_dir: str, total_steps: int, global_batch_size: int) -> None:
    """Raise ``RunFinished`` (every rank) if the run to resume already ended, before any file is touched."""
    summary = main_process_decides(accelerator, lambda: finished_summary(output_dir, total_steps, global_batch_size))
    if summary is not None:
        if accelerator.is_main_process:
            say(f"{output_dir} already finished at step {summary['optimizer_steps']} (see its {SUMMARY_NAME}); "
                "nothing to do")
        raise RunFinished(summary)


def refuse_to_overwrite_finished(accelerator: Accelerator, output_dir: str) -> None:
    """A start from step 0 must not overwrite another run's final outputs (collective: every rank raises).

    Reached when no checkpoint is resumed: a fresh start, or ``auto`` in a folder without checkpoints
    whose finished run asked for another step count (a finished run with checkpoints continues from them).
    """
    def finished_here() -> bool:
        return os.path.isfile(os.path.join(output_dir, SUMMARY_NAME))
    if main_process_decides(accelerator, finished_here):
        raise ConfigError(f"{output_dir} holds a finished run ({SUMMARY_NAME}, {WEIGHTS_NAME}) and no checkpoint to "
                          "continue from; starting from scratch would overwrite it: pick another --output_dir, or "
                          "delete that folder first")
