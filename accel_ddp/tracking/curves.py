"""``curves.png``: a run's curves against the optimizer step, from its folder alone (metrics.jsonl, config.yaml).

    training loss (log axis)  |  eval loss (log axis)  |  the task's metric (perplexity on a log axis, accuracy, ...)
    learning rate             |  samples/s             |  the other eval metrics (left out when there are none)

Epoch boundaries are dashed vertical lines on every panel. The task's metric is read from what the eval
records hold: ``eval_perplexity`` (``causal_lm``, exp of the eval loss), else ``eval_accuracy``, else the
first of a user's metrics. The writer is :mod:`accel_ddp.tracking.recorder`; ``accel-ddp plot`` reruns this.

    >>> plot_run("outputs/run")   # -> "outputs/run/curves.png"
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

from accel_ddp.outputs.metrics_file import read_metrics
from accel_ddp.outputs.names import CONFIG_NAME, CURVES_NAME, METRICS_NAME, SUMMARY_NAME
from accel_ddp.tracking.report import read_json, read_yaml

Curves = dict[str, tuple[list[int], list[float]]]

NOT_CURVES = ("step", "time")  # the x axis, and when a line was written
# Eval figures that are not a quality metric: the eval loss has its own panel, the counts are no curve.
NOT_METRICS = ("eval_loss", "eval_samples", "eval_tokens")
TASK_METRICS = ("eval_perplexity", "eval_accuracy")  # first recorded wins: causal_lm records both
LOG_SCALED = ("loss", "eval_loss", "eval_perplexity")  # positive and falling by orders of magnitude
MAX_EPOCH_LINES = 40  # past that many boundaries, every n-th is drawn (a long run of short epochs stays readable)


@dataclass(frozen=True)
class Panel:
    keys: tuple[str, ...]  # one line per recorded key
    title: str
    ylabel: str
    legend: bool = False  # each line named (``_label``)
    metric: str | None = None  # the figure's task metric, which names the others


def read_curves(output_dir: str) -> Curves:
    """``{key: (steps, values)}`` for every number the step records of ``metrics.jsonl`` hold, sorted by step.

    Values that are not finite numbers (a nan loss, an eval loss of None) are left out. A resumed run may
    log a step twice (once before the interruption, once after); the later line wins, which is the curve
    of the run that finished.
    """
    by_key: dict[str, dict[int, float]] = {}
    for record in read_metrics(output_dir):
        step = record.get("step")
        if not isinstance(step, int) or isinstance(step, bool):
            continue
        for key, value in record.items():
            if key in NOT_CURVES or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            if math.isfinite(value):
                by_key.setdefault(key, {})[step] = float(value)
    return {key: (sorted(points), [points[s] for s in sorted(points)]) for key, points in by_key.items()}


def task_metric(curves: Curves) -> str | None:
    """The eval metric of the run's task: perplexity, else accuracy, else the first of a user's metrics."""
    metrics = _eval_metrics(curves)
    return next((key for key in TASK_METRICS if key in metrics), metrics[0] if metrics else None)


def _eval_metrics(curves: Curves) -> list[str]:
    return sorted(key for key in curves if key.startswith("eval_") and key not in NOT_METRICS)


def _label(key: str, metric: str | None = None) -> str:
    """``eval_top5`` -> ``top5``; beside perplexity, a causal LM's accuracy is that of the next token."""
    if key == "eval_accuracy" and metric == "eval_perplexity":
        return "next-token accuracy"
    return key.removeprefix("eval_").replace("_", " ")


def panels(curves: Curves) -> list[Panel]:
    """The figure's panels, in reading order (see the module docstring)."""
    metric = task_metric(curves)
    found = [
        Panel(("loss",), "training loss", "loss"),
        Panel(("eval_loss",), "eval loss", "loss"),
        Panel((metric or "eval_accuracy",), f"eval {_label(metric or 'eval_accuracy')}", _label(metric or "accuracy")),
        Panel(("lr",), "learning rate", "lr"),
        Panel(("samples_per_sec",), "throughput", "samples/s"),
    ]
    others = tuple(key for key in _eval_metrics(curves) if key != metric)
    if others:
        found.append(Panel(others, "other eval metrics", "value", legend=True, metric=metric))
    return found


def epoch_boundaries(curves: Curves, steps_per_epoch: int | None = None) -> list[int]:
    """The optimizer steps after which a new epoch began, within the plotted steps.

    At multiples of the run's ``steps_per_epoch`` when it is known (config.yaml), else the last logged step of
    each epoch that a later epoch follows (the records' ``epoch`` field; exact when an epoch's last step is logged,
    as its end-of-epoch evaluation is).
    """
    last = max((steps[-1] for steps, _ in curves.values() if steps), default=0)
    if steps_per_epoch:
        return list(range(steps_per_epoch, last, steps_per_epoch))
    steps, epochs = curves.get("epoch", ([], []))
    return [step for step, epoch, after in zip(steps[:-1], epochs[:-1], epochs[1:], strict=True) if after > epoch]


def build_curves_figure(curves: Curves, title: str = "", steps_per_epoch: int | None = None):
    """The figure of ``curves`` (Agg canvas, no pyplot, no global backend switch), before it is saved."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(15, 7.5))
    FigureCanvasAgg(fig)
    # Fixed margins: the constrained layout engine measures every label first, ~0.5 s of the main process's exit.
    fig.subplots_adjust(left=0.06, right=0.985, bottom=0.07, top=0.9, hspace=0.32, wspace=0.24)
    axes = fig.subplots(2, 3).ravel()
    shown = panels(curves)
    boundaries = epoch_boundaries(curves, steps_per_epoch)
    every = math.ceil(len(boundaries) / MAX_EPOCH_LINES) if boundaries else 1
    for index, (ax, panel) in enumerate(zip(axes, shown, strict=False)):  # six places, five or six panels
        _draw_panel(ax, panel, curves)
        for number, step in enumerate(boundaries[every - 1::every]):
            label = None if index or number else ("epoch boundary" if every == 1 else f"every {every} epochs")
            ax.axvline(step, color="0.55", linestyle="--", linewidth=0.8, alpha=0.7, zorder=0, gid="epoch",
                       label=label)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small", loc="best")
    for ax in axes[len(shown):]:
        fig.delaxes(ax)
    if title:
        fig.suptitle(title)
    return fig


def _draw_panel(ax: Any, panel: Panel, curves: Curves) -> None:
    ax.set_title(panel.title)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(panel.ylabel)
    ax.grid(alpha=0.3)
    drawn = [key for key in panel.keys if curves.get(key, ([], []))[0]]
    for key in drawn:
        steps, values = curves[key]
        label = _label(key, panel.metric) if panel.legend else None
        ax.plot(steps, values, marker="o" if len(steps) <= 30 else None, markersize=3, linewidth=1.2, label=label)
    if not drawn:
        ax.text(0.5, 0.5, f"no '{panel.keys[0]}' in {METRICS_NAME}", ha="center", va="center", transform=ax.transAxes)
    # A log axis needs every value above zero (a user's loss may be negative): else the panel stays linear.
    elif all(key in LOG_SCALED for key in drawn) and all(v > 0 for key in drawn for v in curves[key][1]):
        ax.set_yscale("log")
        plain = _plain_log_labels()
        ax.yaxis.set_major_formatter(plain())
        ax.yaxis.set_minor_formatter(plain(labelOnlyBase=False))


def _plain_log_labels() -> type:
    """Matplotlib's choice of which log ticks to label, written 0.6 rather than 6x10^-1 (a loss spans a decade or
    two: most labels are minor ticks)."""
    from matplotlib.ticker import LogFormatterSciNotation

    class PlainLogFormatter(LogFormatterSciNotation):
        def __call__(self, x, pos=None):
            return f"{x:g}" if super().__call__(x, pos) else ""

    return PlainLogFormatter


def run_figure(output_dir: str):
    """The figure of a run folder's ``metrics.jsonl`` (epochs from its config.yaml), not yet saved."""
    curves = read_curves(output_dir)
    if not any(steps for steps, _ in curves.values()):
        raise ValueError(f"{os.path.join(output_dir, METRICS_NAME)} has no step records yet; nothing to plot")
    config = read_yaml(os.path.join(output_dir, CONFIG_NAME))
    resolved = config.get("resolved") if isinstance(config.get("resolved"), dict) else {}
    per_epoch = resolved.get("steps_per_epoch")
    per_epoch = per_epoch if isinstance(per_epoch, int) and not isinstance(per_epoch, bool) and per_epoch > 0 else None
    return build_curves_figure(curves, title=_run_title(output_dir, config), steps_per_epoch=per_epoch)


def plot_run(output_dir: str, path: str | None = None) -> str:
    """Write ``curves.png`` (see the module docstring) from ``metrics.jsonl``; return its path."""
    fig = run_figure(output_dir)
    path = path or os.path.join(output_dir, CURVES_NAME)
    tmp = f"{path}.tmp"
    fig.savefig(tmp, format="png", dpi=100)
    os.replace(tmp, path)
    return path


def _run_title(output_dir: str, config: dict[str, Any]) -> str:
    summary = read_json(os.path.join(output_dir, SUMMARY_NAME))
    summary = summary if isinstance(summary, dict) else {}
    facts = [os.path.basename(os.path.normpath(output_dir))]
    if isinstance(config.get("task"), str):
        facts.append(f"task {config['task']}")
    if "world_size" in summary:
        facts.append(f"{summary['world_size']} process(es)")
    if "global_batch_size" in summary:
        facts.append(f"global batch {summary['global_batch_size']}")
    return ", ".join(facts)
