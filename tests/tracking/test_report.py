"""Reading a run back (accel_ddp/tracking/report.py, curves.py): curves.png and the summary table, of a real run and
a missing one (curves.png from synthetic records: test_curves.py)."""

from __future__ import annotations

import pytest

from accel_ddp.cli import commands as cli
from accel_ddp.cli.train import main
from accel_ddp.tracking.curves import read_curves
from tests.helpers.files import CHECKPOINTED_ARGS as ARGS
from tests.helpers.multiproc import run_ranks
from tests.helpers.output import decode_png, series
from tests.helpers.runs import (
    read_metrics,
    read_summary,
    train_ranks,
)

# ----------------------------------------------------------------------------- curves.png and summary


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
