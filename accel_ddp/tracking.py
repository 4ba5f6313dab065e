"""What a run leaves behind: resolved config, metrics lines, summary, progress bar.

Every writer here is a no-op off the main process, so the loop can call them on all ranks.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import yaml
from tqdm.auto import tqdm


def _atomic_write_text(path: str, text: str) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(text)
    os.replace(tmp, path)


class RunRecorder:
    """Writes ``config.yaml``, ``metrics.jsonl`` and ``summary.json`` under ``output_dir``."""

    def __init__(self, output_dir: str, is_main_process: bool):
        self.output_dir = output_dir
        self.enabled = is_main_process
        self._metrics = None
        if self.enabled:
            os.makedirs(output_dir, exist_ok=True)
            # Appending lets a resumed run extend the curve instead of erasing it.
            self._metrics = open(os.path.join(output_dir, "metrics.jsonl"), "a", encoding="utf-8")

    def write_config(self, resolved: dict[str, Any]) -> None:
        if self.enabled:
            _atomic_write_text(os.path.join(self.output_dir, "config.yaml"), yaml.safe_dump(resolved, sort_keys=False))

    def log(self, record: dict[str, Any]) -> None:
        if self.enabled:
            self._metrics.write(json.dumps({"time": round(time.time(), 3), **record}) + "\n")
            self._metrics.flush()

    def write_summary(self, summary: dict[str, Any]) -> None:
        if self.enabled:
            _atomic_write_text(os.path.join(self.output_dir, "summary.json"), json.dumps(summary, indent=2) + "\n")

    def close(self) -> None:
        if self._metrics is not None:
            self._metrics.close()
            self._metrics = None


def progress_bar(total: int, initial: int, enabled: bool) -> tqdm:
    """One bar per machine's first process; other ranks get a disabled bar with the same API."""
    return tqdm(total=total, initial=initial, disable=not enabled, unit="step", dynamic_ncols=True)
