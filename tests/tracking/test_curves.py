"""curves.png (accel_ddp/tracking/curves.py): what is plotted, on which axis, beside what, with the epochs marked;
from synthetic metrics.jsonl files (a real run's curves are checked in test_report.py)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from accel_ddp.tracking.curves import epoch_boundaries, plot_run, read_curves, run_figure, task_metric
from tests.helpers.output import decode_png
from tests.helpers.runs import REPO, suite_env


def write_run(folder: Path, records: list[dict], steps_per_epoch: int | None = None, task: str = "classification"):
    lines = [json.dumps({"time": 1.0 + i, **r}) for i, r in enumerate(records)]
    (folder / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    if steps_per_epoch is not None:
        config = {"task": task, "resolved": {"world_size": 2, "steps_per_epoch": steps_per_epoch}}
        (folder / "config.yaml").write_text(yaml.safe_dump(config))


def epochs_of(steps: int, per_epoch: int, eval_keys) -> list[dict]:
    """A record every step (loss halving each epoch), an evaluation at each epoch's last step."""
    records = []
    for step in range(1, steps + 1):
        epoch = (step - 1) // per_epoch
        records.append({"step": step, "epoch": epoch, "loss": 2.0 * 0.5 ** (step / per_epoch), "lr": 0.1,
                        "samples_per_sec": 1000.0 + step})
        if step % per_epoch == 0:
            records.append({"step": step, "epoch": epoch, **eval_keys(epoch)})
    return records


def data(line) -> tuple[list, list]:
    return np.asarray(line.get_xdata()).tolist(), np.asarray(line.get_ydata()).tolist()


def epoch_lines(ax) -> list[float]:
    return [line.get_xdata()[0] for line in ax.lines if line.get_gid() == "epoch"]


def curve_lines(ax) -> list:
    return [line for line in ax.lines if line.get_gid() != "epoch"]


def test_plotted_values_are_the_metrics_jsonl_values(tmp_path):
    records = [
        {"step": 1, "epoch": 0, "loss": 2.3, "lr": 0.1, "samples_per_sec": 900.0},
        {"step": 2, "epoch": 0, "loss": 2.0, "lr": 0.09, "samples_per_sec": 1000.0},
        {"step": 2, "epoch": 0, "eval_loss": 1.9, "eval_accuracy": 0.40, "eval_samples": 64},
        {"step": 3, "epoch": 1, "loss": 1.7, "lr": 0.07, "samples_per_sec": 1100.0},
        # resumed from the step-2 checkpoint: step 3 is logged again, the later line is the real run
        {"step": 3, "epoch": 1, "loss": 1.6, "lr": 0.07, "samples_per_sec": 950.0},
        {"step": 4, "epoch": 1, "loss": float("nan"), "lr": 0.0, "samples_per_sec": 1200.0},  # not finite: left out
        {"step": 4, "epoch": 1, "eval_loss": 1.1, "eval_accuracy": 0.75, "eval_samples": 64},
    ]
    write_run(tmp_path, records)
    with (tmp_path / "metrics.jsonl").open("a") as fh:
        fh.write('{"step": 5, "lo')  # cut short by a crash
    expected = {
        "loss": ([1, 2, 3], [2.3, 2.0, 1.6]),
        "eval_loss": ([2, 4], [1.9, 1.1]),
        "eval_accuracy": ([2, 4], [0.40, 0.75]),
        "lr": ([1, 2, 3, 4], [0.1, 0.09, 0.07, 0.0]),
        "samples_per_sec": ([1, 2, 3, 4], [900.0, 1000.0, 950.0, 1200.0]),
    }
    curves = read_curves(str(tmp_path))
    assert {key: curves[key] for key in expected} == expected
    assert curves["epoch"] == ([1, 2, 3, 4], [0.0, 0.0, 1.0, 1.0])
    figure = run_figure(str(tmp_path))
    for ax, key in zip(figure.axes, expected, strict=True):
        (line,) = curve_lines(ax)
        assert data(line) == expected[key], key
        assert epoch_lines(ax) == [2]  # no config.yaml: the last logged step of epoch 0

    result = subprocess.run([sys.executable, "-m", "accel_ddp", "plot", str(tmp_path)], capture_output=True,
                            text=True, env=suite_env(), cwd=REPO, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(tmp_path / "curves.png")
    assert decode_png(tmp_path / "curves.png") == (1500, 750)


def test_classification_loss_on_a_log_axis_eval_loss_beside_accuracy_and_each_epoch_marked(tmp_path):
    write_run(tmp_path, epochs_of(12, 4, lambda e: {"eval_loss": 1.0 / (e + 1), "eval_accuracy": 0.5 + 0.1 * e,
                                                    "eval_samples": 90}), steps_per_epoch=4)
    figure = run_figure(str(tmp_path))
    titles = [ax.get_title() for ax in figure.axes]
    assert titles == ["training loss", "eval loss", "eval accuracy", "learning rate", "throughput"]
    loss, eval_loss, accuracy, lr, _ = figure.axes
    assert loss.get_yscale() == "log" and eval_loss.get_yscale() == "log"
    assert accuracy.get_yscale() == "linear" and lr.get_yscale() == "linear"
    assert accuracy.get_ylabel() == "accuracy"
    assert data(curve_lines(accuracy)[0]) == ([4, 8, 12], [0.5, 0.6, 0.7])
    for ax in figure.axes:  # three epochs: two boundaries, the run's end is none
        assert epoch_lines(ax) == [4, 8], ax.get_title()
    assert [t.get_text() for t in loss.get_legend().get_texts()] == ["epoch boundary"]
    assert "task classification" in figure.texts[0].get_text()  # the suptitle, from config.yaml


def test_causal_lm_shows_perplexity_beside_the_eval_loss_and_its_next_token_accuracy_apart(tmp_path):
    def evaluation(epoch):
        loss = 6.0 - epoch
        return {"eval_loss": loss, "eval_perplexity": math.exp(loss), "eval_accuracy": 0.05 * (epoch + 1),
                "eval_samples": 65, "eval_tokens": 8000}

    write_run(tmp_path, epochs_of(15, 5, evaluation))  # no config.yaml: the epochs from the records
    figure = run_figure(str(tmp_path))
    assert len(figure.axes) == 6
    perplexity, others = figure.axes[2], figure.axes[5]
    assert perplexity.get_title() == "eval perplexity" and perplexity.get_ylabel() == "perplexity"
    assert perplexity.get_yscale() == "log"
    assert data(curve_lines(perplexity)[0])[1] == pytest.approx([math.exp(6), math.exp(5), math.exp(4)])
    assert others.get_title() == "other eval metrics" and others.get_yscale() == "linear"
    assert [line.get_label() for line in curve_lines(others)] == ["next-token accuracy"]  # eval_tokens: a count
    assert all(epoch_lines(ax) == [5, 10] for ax in figure.axes)


def test_a_single_point_no_evaluation_and_a_negative_loss_still_plot(tmp_path):
    write_run(tmp_path, [{"step": 1, "epoch": 0, "loss": -0.5, "lr": 0.1, "samples_per_sec": 10.0}],
              steps_per_epoch=100)
    figure = run_figure(str(tmp_path))
    loss, eval_loss, metric, *_ = figure.axes
    assert len(figure.axes) == 5 and loss.get_yscale() == "linear"  # a log axis cannot show -0.5
    assert data(curve_lines(loss)[0]) == ([1], [-0.5])
    assert not curve_lines(eval_loss) and "no 'eval_loss' in metrics.jsonl" in eval_loss.texts[0].get_text()
    assert metric.get_ylabel() == "accuracy" and not curve_lines(metric)
    assert all(not epoch_lines(ax) for ax in figure.axes)
    assert decode_png(Path(plot_run(str(tmp_path))))


def test_without_accuracy_or_perplexity_the_task_metric_is_the_first_of_the_users():
    curves = {"eval_loss": ([1], [0.5]), "eval_top5": ([1], [0.9]), "eval_f1": ([1], [0.7]), "eval_samples": ([1], [9])}
    assert task_metric(curves) == "eval_f1"
    assert task_metric({"eval_loss": ([1], [0.5])}) is None


def test_a_long_run_of_short_epochs_marks_every_nth_boundary(tmp_path):
    steps = [1, 1000]
    assert epoch_boundaries({"loss": (steps, [1.0, 0.5])}, steps_per_epoch=10)[:3] == [10, 20, 30]
    write_run(tmp_path, [{"step": s, "epoch": (s - 1) // 10, "loss": 1.0} for s in steps], steps_per_epoch=10)
    loss = run_figure(str(tmp_path)).axes[0]
    assert epoch_lines(loss) == list(range(30, 1000, 30))  # 99 boundaries: every third
    assert [t.get_text() for t in loss.get_legend().get_texts()] == ["every 3 epochs"]


def test_without_matplotlib_plot_run_raises_import_error_and_writes_nothing(tmp_path, monkeypatch):
    """What RunRecorder.plot turns into a warning (tests/tracking/test_report.py has that warning)."""
    write_run(tmp_path, [{"step": 1, "loss": 1.0}])
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # import of it raises ImportError
    with pytest.raises(ImportError):
        plot_run(str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]
