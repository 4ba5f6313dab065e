"""Reading a finished (or running) run back: ``curves.png`` and the ``accel-ddp summary`` table.

Everything here only reads ``OUTPUT_DIR`` (its ``metrics.jsonl`` through :mod:`accel_ddp.outputs.metrics_file`);
the writers live in :mod:`accel_ddp.tracking.recorder`.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

import yaml

from accel_ddp.outputs.metrics_file import read_metrics
from accel_ddp.outputs.names import (
    CHECKPOINTS_DIR,
    CONFIG_NAME,
    CSV_NAME,
    CURVES_NAME,
    METRICS_NAME,
    SUMMARY_NAME,
    TENSORBOARD_SUBDIR,
    WEIGHTS_NAME,
)

# ----------------------------------------------------------------------------- curves.png

# (metrics.jsonl key, panel title, y label)
CURVES = (
    ("loss", "training loss", "cross-entropy"),
    ("eval_accuracy", "eval accuracy", "accuracy"),
    ("lr", "learning rate", "lr"),
    ("samples_per_sec", "throughput", "samples/s"),
)


def read_curves(output_dir: str) -> dict[str, tuple[list[int], list[float]]]:
    """``{key: (steps, values)}`` for each of ``CURVES``, sorted by step.

    A resumed run may log a step twice (once before the interruption, once after); the later
    line wins, which is the curve of the run that finished.
    """
    by_step: dict[str, dict[int, float]] = {key: {} for key, _, _ in CURVES}
    for record in read_metrics(output_dir):
        if "step" not in record:
            continue
        for key in by_step:
            value = record.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                by_step[key][int(record["step"])] = float(value)
    return {key: (sorted(points), [points[s] for s in sorted(points)]) for key, points in by_step.items()}


def build_curves_figure(curves: dict[str, tuple[list[int], list[float]]], title: str = ""):
    """A 2x2 matplotlib Figure (Agg canvas, no pyplot, no global backend switch)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 7))
    FigureCanvasAgg(fig)
    # Fixed margins: the constrained layout engine measures every label first, ~0.5 s of the main process's exit.
    fig.subplots_adjust(left=0.085, right=0.98, bottom=0.07, top=0.92, hspace=0.32, wspace=0.22)
    axes = fig.subplots(2, 2).ravel()
    for ax, (key, panel, ylabel) in zip(axes, CURVES, strict=True):
        steps, values = curves.get(key, ([], []))
        ax.set_title(panel)
        ax.set_xlabel("optimizer step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if steps:
            ax.plot(steps, values, marker="o" if len(steps) <= 30 else None, markersize=3, linewidth=1.2)
        else:
            ax.text(0.5, 0.5, f"no '{key}' in {METRICS_NAME}", ha="center", va="center", transform=ax.transAxes)
    if title:
        fig.suptitle(title)
    return fig


def plot_run(output_dir: str, path: str | None = None) -> str:
    """Write ``curves.png`` (loss, eval accuracy, LR, samples/s against step) from ``metrics.jsonl``."""
    curves = read_curves(output_dir)
    if not any(steps for steps, _ in curves.values()):
        raise ValueError(f"{os.path.join(output_dir, METRICS_NAME)} has no step records yet; nothing to plot")
    path = path or os.path.join(output_dir, CURVES_NAME)
    fig = build_curves_figure(curves, title=_run_title(output_dir))
    tmp = f"{path}.tmp"
    fig.savefig(tmp, format="png", dpi=100)
    os.replace(tmp, path)
    return path


def _run_title(output_dir: str) -> str:
    summary = _read_json(os.path.join(output_dir, SUMMARY_NAME)) or {}
    facts = [os.path.basename(os.path.normpath(output_dir))]
    if "world_size" in summary:
        facts.append(f"{summary['world_size']} process(es)")
    if "global_batch_size" in summary:
        facts.append(f"global batch {summary['global_batch_size']}")
    return ", ".join(facts)


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


def _read_json(path: str) -> Any:
    try:
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)
    except (OSError, ValueError):  # JSONDecodeError and UnicodeDecodeError (a damaged file) are ValueErrors
        return None


def _format_value(value: Any, formatter=str) -> str:
    if value is None:
        return "-"
    if formatter is str and isinstance(value, float):
        return f"{value:.4g}"
    return formatter(value)


def format_summary(output_dir: str) -> str:
    """A finished run as a two-column table: what ran, how it was batched, how it ended."""
    summary = _read_json(os.path.join(output_dir, SUMMARY_NAME))
    if not isinstance(summary, dict):
        raise FileNotFoundError(f"no readable {SUMMARY_NAME} in {output_dir}; point at a finished run's --output_dir")
    config = {}
    config_path = os.path.join(output_dir, CONFIG_NAME)
    try:  # the config's rows are left out of a table whose config.yaml is missing or damaged
        with open(config_path, encoding="utf-8") as fh:
            config = yaml.safe_load(fh) or {}
    except (OSError, ValueError, yaml.YAMLError):
        config = {}
    config = config if isinstance(config, dict) else {}
    rows = [(name, _format_value(config[name])) for name in _CONFIG_ROWS if name in config]
    rows += [(label, _format_value(summary[key], fmt)) for key, label, fmt in _SUMMARY_ROWS if key in summary]
    known = {key for key, _, _ in _SUMMARY_ROWS}
    rows += [(key, _format_value(value)) for key, value in summary.items() if key not in known]
    files = [name for name in (WEIGHTS_NAME, CURVES_NAME, CSV_NAME, TENSORBOARD_SUBDIR, CHECKPOINTS_DIR)
             if os.path.exists(os.path.join(output_dir, name))]
    rows.append(("files", ", ".join(files) or "-"))
    width = max(len(label) for label, _ in rows)
    rule = "-" * (width + 2 + max(len(value) for _, value in rows))
    lines = [f"run {output_dir}", rule]
    lines += [f"{label:<{width}}  {value}" for label, value in rows]
    lines.append(rule)
    return "\n".join(lines)
