"""File-system steps that must survive a crash: atomic writes, fsyncs, hashes, moves out of the way.

    atomic_write_text("outputs/run/summary.json", text)   # readers see the old file or the new, never half
    fingerprint(path)                                      # {"bytes": ..., "sha256": ...}, after an fsync
    remove_dir(folder)                                     # rename, then delete: never a half-deleted folder
"""

from __future__ import annotations

import hashlib
import os
import shutil
from typing import Any


def atomic_write_text(path: str, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file renamed into place: a reader sees the old file or the new."""
    tmp = f"{path}.tmp{os.getpid()}"  # one per writer
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(text)
    os.replace(tmp, path)


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
