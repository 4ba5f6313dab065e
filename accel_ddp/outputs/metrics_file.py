"""Reading the run folder's ``metrics.jsonl`` back, line by line: what a crash cut short is skipped, damage is named.

    records = read_metrics("outputs/run")   # every complete record, in order

The writer is :mod:`accel_ddp.tracking.recorder`; the readers (the model card, ``accel-ddp plot``, a resume that
trims the file) all go through here, so the file's format is decided in one place.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

from accel_ddp.outputs.names import METRICS_NAME
from accel_ddp.util.validation import ConfigError


def read_metrics(output_dir: str) -> list[dict[str, Any]]:
    """The records of ``metrics.jsonl``; a line cut short by a crash is skipped, one that is not UTF-8 is a
    ConfigError (``metrics_lines``)."""
    path = os.path.join(output_dir, METRICS_NAME)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no {METRICS_NAME} in {output_dir}; point at a run's --output_dir")
    return [record for record in map(parse_record, metrics_lines(path)) if record is not None]


def metrics_lines(path: str) -> Iterator[str]:
    """The lines of a ``metrics.jsonl``, as text. A crash can cut a line short, but only damage makes bytes that are
    not UTF-8: that is a ConfigError naming the line, not a record quietly dropped (nor a UnicodeDecodeError)."""
    with open(path, "rb") as fh:
        for number, raw in enumerate(fh, start=1):
            try:
                yield raw.decode("utf-8")
            except UnicodeDecodeError:
                raise ConfigError(damaged_line(path, number)) from None


def damaged_line(path: str, number: int) -> str:
    """The one line for a line of a file the run wrote (metrics.jsonl, metrics.csv) that is not UTF-8."""
    return (f"{path} line {number} is not UTF-8 text, so the file is damaged; delete that line (or move the file "
            "aside: the run then writes a new one)")


def parse_record(line: str) -> dict[str, Any] | None:
    """One ``metrics.jsonl`` line as a record, or None for a line a crash cut short (or anything not a record)."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        return None
    return record if isinstance(record, dict) else None
