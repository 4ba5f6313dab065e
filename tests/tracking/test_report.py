"""Reading a run back (accel_ddp/tracking/report.py): curves.png and the summary table, of a real run and a
missing one."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from accel_ddp.cli import commands as cli
from accel_ddp.cli.train import main
from accel_ddp.tracking.report import CURVES, build_curves_figure, read_curves
from tests.helpers.files import CHECKPOINTED_ARGS as ARGS
from tests.helpers.multiproc import run_ranks
from tests.helpers.output import decode_png, series
from tests.helpers.runs import (
    REPO,
    read_metrics,
    read_summary,
    suite_env,
    train_ranks,
)

# ----------------------------------------------------------------------------- curves.png and summary


def test_plotted_values_are_the_metrics_jsonl_values(tmp_path):
    records = [
        {"step": 1, "epoch": 0, "loss": 2.3, "lr": 0.1, "samples_per_sec": 900.0},
        {"step": 2, "epoch": 0, "loss": 2.0, "lr": 0.09, "samples_per_sec": 1000.0},
        {"step": 2, "epoch": 0, "eval_loss": 1.9, "eval_accuracy": 0.40, "eval_samples": 64},
        {"step": 3, "epoch": 1, "loss": 1.7, "lr": 0.07, "samples_per_sec": 1100.0},
        # resumed from the step-2 checkpoint: step 3 is logged again, the later line is the real run
        {"step": 3, "epoch": 1, "loss": 1.6, "lr": 0.07, "samples_per_sec": 950.0},
        {"step": 4, "epoch": 1, "loss": 1.2, "lr": 0.0, "samples_per_sec": 1200.0},
        {"step": 4, "epoch": 1, "eval_loss": 1.1, "eval_accuracy": 0.75, "eval_samples": 64},
    ]
    lines = [json.dumps({"time": 1.0 + i, **r}) for i, r in enumerate(records)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + '\n{"step": 5, "lo')  # cut short by a crash
    expected = {
        "loss": ([1, 2, 3, 4], [2.3, 2.0, 1.6, 1.2]),
        "eval_accuracy": ([2, 4], [0.40, 0.75]),
        "lr": ([1, 2, 3, 4], [0.1, 0.09, 0.07, 0.0]),
        "samples_per_sec": ([1, 2, 3, 4], [900.0, 1000.0, 950.0, 1200.0]),
    }
    curves = read_curves(str(tmp_path))
    assert curves == expected
    figure = build_curves_figure(curves)
    for ax, (key, _, _) in zip(figure.axes, CURVES, strict=True):
        (line,) = ax.lines
        assert np.asarray(line.get_xdata()).tolist() == expected[key][0]
        assert np.asarray(line.get_ydata()).tolist() == expected[key][1]

    result = subprocess.run([sys.executable, "-m", "accel_ddp", "plot", str(tmp_path)], capture_output=True,
                            text=True, env=suite_env(), cwd=REPO, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(tmp_path / "curves.png")
    assert decode_png(tmp_path / "curves.png") == (1100, 700)


@pytest.mark.curves
def test_plot_and_summary_of_a_real_run(tmp_path, tiny_args, capsys):
    out = tmp_path / "run"
    train_ranks([*tiny_args, "--log_every", "1", "--eval_every", "4", "--output_dir", str(out)], world_size=1)
    (out / "curves.png").unlink(missing_ok=True)  # written at the end of training too; rebuild it here

    assert cli.main(["plot", str(out)]) == 0
    decode_png(out / "curves.png")
    records = read_metrics(out)
    curves = read_curves(str(out))
    for key in ("loss", "eval_accuracy", "lr"):
        assert curves[key] == series(records, key), key
    assert curves["loss"][0] == list(range(1, 17)) and curves["eval_accuracy"][0] == [4, 8, 12, 16]

    capsys.readouterr()
    assert cli.main(["summary", str(out)]) == 0
    rows = dict(line.split("  ", 1) for line in capsys.readouterr().out.splitlines()[2:-1])
    rows = {label.strip(): value.strip() for label, value in rows.items()}
    summary = read_summary(out)
    assert rows["processes (world size)"] == str(summary["world_size"]) == "1"
    assert rows["optimizer steps"] == str(summary["optimizer_steps"]) == "16"
    assert rows["global batch (samples/step)"] == "32"
    assert rows["eval accuracy"] == f"{100 * summary['eval_accuracy']:.2f} %"
    assert rows["dataset"] == "synthetic" and rows["model"] == "mlp"
    assert "model.safetensors" in rows["files"] and "curves.png" in rows["files"]


@pytest.mark.parametrize("command", ["plot", "summary"])
def test_plot_and_summary_of_a_missing_run_exit_2(tmp_path, command, capsys):
    assert cli.main([command, str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "--output_dir" in err


@pytest.mark.curves
def test_a_failing_plot_warns_and_the_run_still_succeeds(tmp_path, capfd):
    def run() -> int:
        import accel_ddp.tracking.recorder

        def broken_plot(output_dir):
            raise RuntimeError("font cache exploded")

        accel_ddp.tracking.recorder.plot_run = broken_plot
        return main([*ARGS, "--max_steps", "4", "--output_dir", str(tmp_path / "run")])

    capfd.readouterr()
    assert run_ranks(run, world_size=1) == [0]
    err = capfd.readouterr().err
    assert "accel_ddp: warning: could not write curves.png (RuntimeError: font cache exploded)" in err
    assert read_summary(tmp_path / "run")["optimizer_steps"] == 4
