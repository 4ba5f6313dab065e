"""A loss that turns nan or inf under the default ``--on_anomaly stop`` (accel_ddp/bad_steps/watch.py ``LossWatch``,
room.py ``BadSteps.check``): every rank stops at the same step, nothing saved after it, metrics stay JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from accel_ddp.bad_steps import LossWatch
from accel_ddp.checkpoint.manager import read_checkpoint
from accel_ddp.cli.train import main
from accel_ddp.tracking.recorder import RunRecorder
from tests.helpers import faults
from tests.helpers.checkpoints import steps_of
from tests.helpers.files import CHECKPOINTED_ARGS, CHECKPOINTED_STEPS, SYNTHETIC_8X8, ckpt, error_lines
from tests.helpers.multiproc import run_ranks

# ----------------------------------------------------------------------------- a loss that turns nan (stop)

NAN_MLP_RUN = [*SYNTHETIC_8X8, *CHECKPOINTED_STEPS]  # CHECKPOINTED_ARGS without its mlp (nan_mlp is one)


def strict_json_lines(path: Path) -> list[dict]:
    def refuse(name):
        raise ValueError(f"{name} is not JSON")

    return [json.loads(line, parse_constant=refuse) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("nan_at, log_every, checkpoints, kept", [
    ((7, 1), "4", [5], "the last checkpoint, {out}/checkpoints/step_00000005, is from before it"),
    ((5, 0), "10", [], "no checkpoint was saved"),  # found by the check before the save of step 5
])
def test_a_nan_loss_stops_every_rank_at_the_same_step_and_saves_nothing_after_it(tmp_path, capfd, nan_at,
                                                                                   log_every, checkpoints, kept):
    out = tmp_path / "run"

    def run() -> int:
        faults.install(nan_at=nan_at)
        return main([*NAN_MLP_RUN, "--model", "tests.helpers.faults:nan_mlp", "--max_steps", "20", "--log_every",
                     log_every, "--output_dir", str(out)])

    capfd.readouterr()
    assert run_ranks(run, world_size=2) == [3, 3]
    err = capfd.readouterr().err
    (line,) = error_lines(err)
    assert f"the training loss became nan or inf at optimizer step {nan_at[0]}; every rank stopped and " \
           f"{kept.format(out=out)}" in line
    assert "Traceback" not in err
    assert steps_of(out) == checkpoints
    for step in checkpoints:
        read_checkpoint(str(ckpt(out, step)))
    assert not (out / "summary.json").exists() and not (out / "model.safetensors").exists()
    records = strict_json_lines(out / "metrics.jsonl")
    assert all(r["step"] < nan_at[0] for r in records)


def test_a_nan_loss_under_debug_names_the_operation(tmp_path, capfd):
    def run() -> int:
        faults.install(nan_at=(2, 1))
        return main([*NAN_MLP_RUN, "--model", "tests.helpers.faults:nan_mlp", "--max_steps", "8", "--debug",
                     "--output_dir", str(tmp_path / "run")])

    capfd.readouterr()
    assert run_ranks(run, world_size=2) == [3, 3]
    err = capfd.readouterr().err
    (line,) = error_lines(err)
    assert "the training loss became nan or inf at optimizer step 2 (Function 'LogSoftmaxBackward0' returned nan" \
        in line
    assert "Traceback of forward call that caused the error" in err  # torch's anomaly trace, from rank 1


def test_an_inf_loss_with_finite_gradients_under_debug_stops_every_rank_without_a_hang(tmp_path, capfd):
    """The debug trace's backward on the bad rank alone must not start DDP's gradient all-reduce, which the
    other rank would never join: an inf loss whose backward is finite reaches every parameter's hook."""
    def run() -> int:
        faults.install(nan_at=(2, 1))
        return main([*CHECKPOINTED_ARGS, "--loss", "tests.helpers.faults:inf_loss", "--max_steps", "8", "--debug",
                     "--output_dir", str(tmp_path / "run")])

    capfd.readouterr()
    assert run_ranks(run, world_size=2, timeout=60) == [3, 3]
    (line,) = error_lines(capfd.readouterr().err)
    assert "the training loss became nan or inf at optimizer step 2" in line


def test_metrics_and_summary_stay_json_with_non_finite_values(tmp_path):
    recorder = RunRecorder(str(tmp_path), is_main_process=True)
    recorder.rewind(0)
    recorder.log({"step": 1, "eval_loss": float("nan"), "loss": float("inf"), "nested": {"x": -float("inf")}})
    recorder.write_summary({"eval_loss": float("nan"), "optimizer_steps": 1}, step=1)
    recorder.close()
    assert strict_json_lines(tmp_path / "metrics.jsonl")[0]["eval_loss"] is None
    summary = json.loads((tmp_path / "summary.json").read_text(), parse_constant=lambda name: 1 / 0)
    assert summary == {"eval_loss": None, "optimizer_steps": 1}


def test_loss_watch_names_the_first_non_finite_step_from_a_device_count():
    class OneRank:
        device = torch.device("cpu")

        @staticmethod
        def reduce(tensor, reduction):
            return tensor.clone()

    watch = LossWatch(OneRank(), start_step=10)  # resumed at step 10
    for step, loss in enumerate([0.5, 0.25, float("nan"), 1.0], start=11):
        watch.after_step([torch.tensor(loss)])
        assert watch.first_bad_step(step) == (None if step < 13 else 13)


def test_loss_watch_folds_kept_steps_into_the_count_and_keeps_the_first_bad_one():
    """Steps of two micro-steps each, folded every 4 steps (not only when asked): a nan in step 6's second
    micro-step names step 6, and later finite folds do not move it."""
    class OneRank:
        device = torch.device("cpu")

        @staticmethod
        def reduce(tensor, reduction):
            return tensor.clone()

    watch = LossWatch(OneRank(), start_step=0)
    watch.FOLD_EVERY = 4
    for step in range(1, 13):
        watch.after_step([torch.tensor(1.0), torch.tensor(float("nan") if step == 6 else 2.0)])
        assert len(watch._pending) == step % 4  # folded on its own every 4 steps
    assert watch.first_bad_step(12) == 6
