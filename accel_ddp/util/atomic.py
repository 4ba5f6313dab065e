"""The one crash-safe write every layer needs (the run's files, torchelastic's error file of a failing rank).

    atomic_write_text("outputs/run/summary.json", text)   # readers see the old file or the new, never half
"""

from __future__ import annotations

import os


def atomic_write_text(path: str, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file renamed into place: a reader sees the old file or the new."""
    tmp = f"{path}.tmp{os.getpid()}"  # one per writer
    try:
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):  # a write that failed (a full disk) leaves no half file behind
            os.remove(tmp)
