"""The output folder as a whole: checked and claimed for one run before anything is written; finished runs.

    lock = claim_output_dir(accelerator, "outputs/run")   # collective: every rank gets the same ConfigError
    summary = finished_summary("outputs/run", total_steps=320, global_batch_size=64)   # None: not finished
    lock.release()                                        # or let the process end: the kernel releases it

One run per folder: the main process holds an exclusive ``flock`` on ``OUTPUT_DIR/.lock`` for the
whole run. The kernel drops it when the process ends, however it ends (SIGKILL and node-local OOM
kills included), so a crashed run never leaves a stale lock behind, unlike a marker file. The lock
file stays in the folder (removing a locked file would let a third run lock a new one beside it).
On NFS, Linux maps ``flock`` to NFS byte-range locks, which the server arbitrates between machines.
"""

from __future__ import annotations

import fcntl
import json
import os
from typing import Any

from accelerate import Accelerator

from accel_ddp.checkpoint import main_process_decides
from accel_ddp.config import ConfigError
from accel_ddp.outputs import LOCK_NAME, SUMMARY_NAME, WEIGHTS_NAME


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
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as err:
            raise ConfigError(f"--output_dir {path}: cannot write in it ({err.strerror}); "
                              "give a folder you can write") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise ConfigError(f"--output_dir {path} is in use by another run (it holds {lock_path}); wait "
                              "for that run to end, or give another --output_dir") from None
        except OSError as err:  # e.g. ENOLCK: a network file system without lock support
            os.close(fd)
            raise ConfigError(f"--output_dir {path}: cannot lock {lock_path} ({err.strerror}); give a folder "
                              "on a file system with locks (a local disk, NFSv4)") from None
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the last descriptor of the open file drops the flock
            self._fd = None


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
    return None
