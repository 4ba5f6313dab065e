"""Reading a finished (or running) run back: the ``accel-ddp summary`` table, and the readers ``curves.png`` shares.

Everything here only reads ``OUTPUT_DIR`` (``curves.png`` is :mod:`accel_ddp.tracking.curves`); the writers live in
:mod:`accel_ddp.tracking.recorder`.
"""

from __future__ import annotations

import json
import os
import textwrap
from typing import Any

import yaml

from accel_ddp.outputs.names import (
    CHECKPOINTS_DIR,
    CONFIG_NAME,
    CSV_NAME,
    CURVES_NAME,
    SUMMARY_NAME,
    TENSORBOARD_SUBDIR,
    WEIGHTS_NAME,
)
from accel_ddp.util import yaml_text

# ----------------------------------------------------------------------------- accel-ddp summary

# (summary.json key, label, formatter)
_SUMMARY_ROWS = (
    ("world_size", "processes (world size)", str),
    ("num_machines", "machines", str),
    ("distributed_type", "distributed type", str),
    ("device", "device", str),
    ("mixed_precision", "mixed precision", str),
    ("global_batch_size", "global batch (samples/step)", str),
    ("per_device_batch_size", "per-device batch", str),
    ("grad_accum_steps", "gradient accumulation", str),
    ("optimizer_steps", "optimizer steps", str),
    ("epochs", "epochs", str),
    ("eval_accuracy", "eval accuracy", lambda v: f"{100 * v:.2f} %"),
    ("eval_loss", "eval loss", lambda v: f"{v:.4f}"),
    ("eval_samples", "eval samples", str),
    ("train_samples_per_sec", "training throughput", lambda v: f"{v:,.1f} samples/s"),
    ("train_seconds", "training time", lambda v: f"{v:.2f} s"),
    ("elapsed_sec", "wall time", lambda v: f"{v:.2f} s"),
)
_CONFIG_ROWS = ("dataset", "model", "optimizer", "lr", "lr_schedule", "seed")


def read_json(path: str) -> Any:
    """A JSON file of the run folder, or None when it is missing or damaged."""
    try:
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)
    except (OSError, ValueError):  # JSONDecodeError and UnicodeDecodeError (a damaged file) are ValueErrors
        return None


def read_yaml(path: str) -> dict[str, Any]:
    """A run's config.yaml as a mapping; {} when it is missing or damaged (what is read back from it is optional)."""
    try:
        with open(path, encoding="utf-8") as fh:
            data = yaml_text.load(fh)
    except (OSError, ValueError, yaml.YAMLError):  # UnicodeDecodeError is a ValueError
        return {}
    return data if isinstance(data, dict) else {}


def _format_value(value: Any, formatter=str) -> str:
    if value is None:
        return "-"
    if isinstance(value, dict):  # startup_phases_sec: "imports 3.1, process_group 0.4, ..." (wraps between pairs)
        return ", ".join(f"{key} {_format_value(item)}" for key, item in value.items())
    if formatter is str and isinstance(value, float):
        return f"{value:.4g}"
    return formatter(value)


def format_summary(output_dir: str) -> str:
    """A finished run as a two-column table: what ran, how it was batched, how it ended."""
    summary = read_json(os.path.join(output_dir, SUMMARY_NAME))
    if not isinstance(summary, dict):
        raise FileNotFoundError(f"no readable {SUMMARY_NAME} in {output_dir}; point at a finished run's --output_dir")
    config = read_yaml(os.path.join(output_dir, CONFIG_NAME))  # its rows are left out when it is missing or damaged
    rows = [(name, _format_value(config[name])) for name in _CONFIG_ROWS if name in config]
    rows += [(label, _format_value(summary[key], fmt)) for key, label, fmt in _SUMMARY_ROWS if key in summary]
    known = {key for key, _, _ in _SUMMARY_ROWS}
    rows += [(key, _format_value(value)) for key, value in summary.items() if key not in known]
    files = [name for name in (WEIGHTS_NAME, CURVES_NAME, CSV_NAME, TENSORBOARD_SUBDIR, CHECKPOINTS_DIR)
             if os.path.exists(os.path.join(output_dir, name))]
    rows.append(("files", ", ".join(files) or "-"))
    width = max(len(label) for label, _ in rows)
    room = max(COLUMNS - width - 2, 20)  # a long value (startup_phases_sec) wraps under itself
    lines = [f"{label:<{width}}  {part}" if i == 0 else f"{'':<{width}}  {part}"
             for label, value in rows for i, part in enumerate(textwrap.wrap(value, room) or [value])]
    rule = "-" * max(len(line) for line in lines)
    return "\n".join([f"run {output_dir}", rule, *lines, rule])


COLUMNS = 100  # `accel-ddp summary` fits a terminal this wide
