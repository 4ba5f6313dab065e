"""File-system steps that must survive a crash: fsyncs, hashes, moves out of the way, a failed write explained.

The atomic write itself is :func:`accel_ddp.util.atomic.atomic_write_text` (failure reports need it too).

    fingerprint(path)                                      # {"bytes": ..., "sha256": ...}, after an fsync
    remove_dir(folder)                                     # rename, then delete: never a half-deleted folder
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
import shutil
from collections.abc import Callable
from typing import Any

from accel_ddp.util.messages import first_line
from accel_ddp.util.validation import ConfigError

LOW_SPACE = 1 << 20  # bytes: below this, a write that failed without an errno failed for want of space
# What to do when the run's own files (weights, summary, metrics) cannot be written: the checkpoints hold the run.
OUTPUTS_FIX = ("free space there or give another --output_dir (a copy of this one), then resume with "
               "--resume_from_checkpoint auto: it continues from the last checkpoint")
# A folder that refuses writes for want of permission, not of space: a read-only mount (EROFS), an immutable
# folder (chattr +i: EPERM, even for root) or one without write permission (EACCES).
READ_ONLY_ERRNOS = (errno.EROFS, errno.EPERM, errno.EACCES)
READ_ONLY = "it is read-only"  # how write_failure's answer starts for those
WRITABLE_FIX = "make it writable (a read-write mount, chmod u+w, chattr -i) or give another --output_dir"


class WriteFailed(ConfigError):
    """The file system refused a write (full, over quota, read-only, failing): not a bug, one line and exit 2.

    Raised on every rank where the write's outcome is shared (a collective); ``only_this_rank`` where only the main
    process knows (a metrics line mid-run): it prints the line itself (``accel_ddp.lifecycle.failure.report``).
    """

    only_this_rank = False


def file_sha256(path: str, fsync: bool = False) -> str:
    """Hex sha256 of a file, read in 1 MiB chunks (``hashlib.file_digest`` needs Python 3.11; we support 3.10)."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        if fsync:
            os.fsync(fh.fileno())
        while chunk := fh.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def fingerprint(path: str) -> dict[str, Any]:
    """Size and sha256 of a file, after forcing it to disk (the marker must not outlive its files)."""
    return {"bytes": os.path.getsize(path), "sha256": file_sha256(path, fsync=True)}


def relative_files(folder: str) -> list[str]:
    """Every file under ``folder`` (sharded strategies write sub-folders), as sorted relative paths."""
    found = []
    for parent, _, names in os.walk(folder):
        found += [os.path.relpath(os.path.join(parent, name), folder) for name in names]
    return sorted(found)


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def set_aside(path: str) -> str:
    """Rename ``path`` to ``path.damaged`` (or ``.damaged-2``, ...): out of the way, never deleted."""
    aside, n = f"{path}.damaged", 1
    while os.path.exists(aside):
        n += 1
        aside = f"{path}.damaged-{n}"
    os.rename(path, aside)
    return aside


def remove_dir(path: str) -> None:
    """Rename first (atomic), then delete: a crash mid-delete leaves debris, never a gutted checkpoint."""
    trash = os.path.join(os.path.dirname(path), f".trash-{os.path.basename(path)}")
    shutil.rmtree(trash, ignore_errors=True)
    os.rename(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


def write_failure(err: BaseException, folder: str) -> str | None:
    """Why writing into ``folder`` failed, when the file system is at fault; None for anything else (a bug).

    Python's writes raise OSError with an errno; safetensors raises SafetensorError naming the OS error
    ("I/O error: No space left on device (os error 28)"); torch.save to a path writes through C++ and
    loses the errno ("[enforce fail at inline_container.cc:672] . unexpected pos", "basic_ios::clear:
    iostream error"): that one is a full disk when the file system has less than ``LOW_SPACE`` left.
    """
    code = err.errno if isinstance(err, OSError) else None
    found = re.search(r"\(os error (\d+)\)", str(err)) if type(err).__name__ == "SafetensorError" else None
    code = int(found.group(1)) if found else code
    free = free_bytes(folder)
    if code in (errno.ENOSPC, errno.EDQUOT) or (code is None and _torch_write_error(err) and free < LOW_SPACE):
        full = "over its quota" if code == errno.EDQUOT else "full"
        return f"the file system is {full} ({human_size(free)} free there)"
    if code in READ_ONLY_ERRNOS:
        return f"{READ_ONLY} ({os.strerror(code)}: a read-only mount, an immutable folder or no write permission)"
    if code is not None:
        return f"the file system refused it ({os.strerror(code)})"
    if _torch_write_error(err):
        return f"the write failed ({first_line(err, 200)}; {human_size(free)} free there)"
    return None


def _torch_write_error(err: BaseException) -> bool:
    text = str(err)
    return isinstance(err, RuntimeError) and any(
        mark in text for mark in ("PytorchStreamWriter", "inline_container", "iostream error", "file write failed"))


def free_bytes(folder: str) -> int:
    """Bytes this process may still write in ``folder`` (root may use the blocks kept back for it)."""
    while folder and not os.path.exists(folder):
        folder = os.path.dirname(folder)
    try:
        stats = os.statvfs(folder or ".")
    except OSError:
        return LOW_SPACE  # unknown: not evidence of a full disk
    return (stats.f_bfree if os.geteuid() == 0 else stats.f_bavail) * stats.f_frsize


def human_size(num_bytes: float) -> str:
    """``300.0 MiB``, ``1.2 GiB``: a byte count as a person reads it."""
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if num_bytes < 1024 or unit == "GiB":
            return f"{num_bytes:.0f} {unit}" if unit == "bytes" else f"{num_bytes:.1f} {unit}"
        num_bytes /= 1024
    return ""


def written(call: Callable[[], Any], what: str, folder: str, fix: str) -> Any:
    """``call()``; when the file system refuses its writes, ``WriteFailed``: what, where, why and ``fix``, one line.

        >>> written(lambda: atomic_write_text(path, text), "summary.json", "outputs/run", "free space there")
    """
    try:
        return call()
    except Exception as err:
        why = write_failure(err, folder)
        if why is None:
            raise
        if why.startswith(READ_ONLY):  # no space to free: the fix for a full disk would mislead
            fix = fix.replace("free space there", WRITABLE_FIX.replace(" or give another --output_dir", ""))
        raise WriteFailed(f"cannot write {what} in {folder}: {why}; {fix}") from err
