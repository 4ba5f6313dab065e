"""What a failed tracker start created in the output folder, and removing exactly that.

A tracker writes where it starts (``tensorboard/`` event files, ``wandb/`` run folders, an MLflow
store, ``dvclive/``) and none of them can be told to start somewhere else and move. So the recorder
lists the output folder before the trackers start and, when a start fails, removes what is new:
files and folders only, never one that was there (a resumed run's ``tensorboard/`` keeps its
earlier event files). Checkpoints are not listed: no tracker writes there, and they can be many.

    >>> before = FolderSnapshot("outputs/run")
    >>> ...  # a tracker fails to start
    >>> before.remove_new()
"""

from __future__ import annotations

import os
import shutil
import time

from accel_ddp.outputs.names import CHECKPOINTS_DIR, CONFIG_NAME, LOCK_NAME


class FolderSnapshot:
    """The paths under ``folder`` (relative), as they were at construction."""

    def __init__(self, folder: str):
        self.folder = folder
        self.taken_at = time.time()
        self.paths = set(self._walk())

    def _walk(self) -> list[str]:
        found = []
        for root, dirs, files in os.walk(self.folder):
            rel = os.path.relpath(root, self.folder)
            if rel == ".":
                dirs[:] = [d for d in dirs if d != CHECKPOINTS_DIR]
            found += [os.path.normpath(os.path.join(rel, name)) for name in dirs + files]
        return found

    def new_paths(self) -> list[str]:
        """What is there now and was not, outermost first (a new folder stands for what is inside it)."""
        new = sorted(p for p in self._walk() if p not in self.paths and p != LOCK_NAME)
        return [p for p in new if not any(p.startswith(outer + os.sep) for outer in new if outer != p)]

    def remove_new(self) -> list[str]:
        """Remove what is new (a file or folder another process removed first is no error); return it."""
        removed = self.new_paths()
        for rel in removed:
            path = os.path.join(self.folder, rel)
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                try:
                    os.remove(path)
                except FileNotFoundError:
                    pass
        return removed

    def remove_new_unless_reused(self) -> None:
        """At the exit of a process whose tracker start was given up on (its thread may have written since):
        remove what is new again, unless a later run in this process took the folder on (its config.yaml is
        written after its trackers started), whose files these would be."""
        config = os.path.join(self.folder, CONFIG_NAME)
        if os.path.exists(config) and os.path.getmtime(config) >= self.taken_at:
            return
        self.remove_new()
