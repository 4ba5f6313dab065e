"""The best model and early stopping (accel_ddp/checkpoint/best.py), with the Trainer's names and rules.

The rules on scripted metric sequences (no ranks); then 2 forked gloo ranks: the stop step, the
kept folders (--keep_last plus the best), the exported weights, the summary, a resume in the middle
of the patience count, a relaunch after the stop.
"""

from __future__ import annotations

import math
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from accel_ddp.checkpoint.best import BestModel, BestModelOptions
from accel_ddp.checkpoint.manager import list_checkpoints, read_checkpoint
from accel_ddp.cli.args import parse_args
from accel_ddp.config import TrainConfig
from accel_ddp.config.views import section_of
from accel_ddp.util.validation import ConfigError
from tests.helpers.ranks import error_lines
from tests.helpers.runs import load_weights, main_ranks, read_metrics, read_summary

# 256 samples / global batch 32 = 8 steps per epoch, 4 epochs = 32 steps; an evaluation every 2 steps.
ARGS = ["--dataset", "synthetic", "--synthetic_samples", "256", "--synthetic_shape", "1", "8", "8",
        "--model", "mlp", "--hidden_size", "32", "--global_batch_size", "32", "--epochs", "4",
        "--num_workers", "0", "--log_every", "2", "--eval_every", "2", "--checkpointing_steps", "4",
        "--keep_last", "1"]
# No improvement ever exceeds an absolute threshold of 100 on a loss: the count grows from the second
# evaluation on, so the 6th evaluation (step 12) stops the run. The best moves all the same (the Trainer's
# rule): with --greater_is_better on the loss it is the highest eval_loss among the kept steps 4, 8, 12.
STOPPING = ["--metric_for_best_model", "loss", "--greater_is_better", "--early_stopping_patience", "5",
            "--early_stopping_threshold", "100", "--load_best_model_at_end"]
STOP_STEP = 12


def tracker(patience=None, threshold=0.0, greater=None, metric="loss", save_steps=4, total=100) -> BestModel:
    return BestModel(metric, greater, patience, threshold, save_steps, steps_per_epoch=8, total_steps=total,
                     load_at_end=True)


def feed(best: BestModel, values: list[float], every: int = 2) -> int | None:
    """The step at which ``values`` (one evaluation each ``every`` steps) stop the run, or None."""
    for i, value in enumerate(values, start=1):
        if best.after_eval({best.metric: value}, i * every):
            return i * every
    return None


def test_defaults_follow_the_trainer_except_that_perplexity_is_lower_is_better():
    assert tracker(metric="loss").metric == "eval_loss" and not tracker(metric="loss").greater
    assert not tracker(metric="eval_perplexity").greater  # the Trainer's rule would say greater (name not *loss)
    assert tracker(metric="accuracy").greater and tracker(metric="accuracy").metric == "eval_accuracy"
    assert tracker(metric="loss", greater=True).greater


def test_patience_counts_evaluations_without_an_improvement_above_the_threshold():
    assert feed(tracker(patience=2), [1.0, 0.9, 0.95, 0.8, 0.85, 0.86]) == 12  # 0.8 restarted the count
    assert feed(tracker(patience=2), [1.0, 0.9, 0.8, 0.7]) is None
    # Smaller improvements than the threshold count as none, yet move the best (compared with the best before).
    best = tracker(patience=2, threshold=0.05)
    assert feed(best, [1.0, 0.98, 0.97]) == 6 and best.best_metric == 0.97
    assert feed(tracker(patience=1), [1.0, math.nan]) == 4  # NaN never improves
    assert feed(tracker(patience=1, greater=True, metric="accuracy"), [0.5, 0.6, 0.6]) == 6  # equal is no better


def test_the_best_model_is_chosen_among_kept_weights_only():
    best = tracker(save_steps=4, total=10)
    feed(best, [0.5, 0.9, 0.1, 0.8, 0.7])  # steps 2, 4, 6, 8, 10: 2 and 6 are not saved; 10 is the last step
    assert (best.kept_step, best.kept_metric) == (10, 0.7)
    best = tracker(save_steps="epoch")
    feed(best, [0.4, 0.3], every=8)
    assert best.kept_step == 16
    restored = tracker(save_steps=4, total=10)
    restored.load_state_dict(best.state_dict())
    assert restored.state_dict() == best.state_dict()
    restored.load_state_dict({**best.state_dict(), "metric": "eval_accuracy"})  # another metric: not continued
    assert restored.state_dict() == best.state_dict()


@pytest.mark.parametrize("flags, message", [
    (["--load_best_model_at_end"], "no checkpoint is saved"),
    (["--load_best_model_at_end", "--checkpointing_steps", "5", "--eval_every", "2"], "must be a multiple"),
    (["--load_best_model_at_end", "--checkpointing_steps", "epoch", "--eval_every", "2"], "drop --eval_every 2"),
    (["--early_stopping_threshold", "0.1"], "without --early_stopping_patience"),
    (["--greater_is_better"], "without --metric_for_best_model"),
    (["--early_stopping_patience", "0"], "early_stopping_patience"),
])
def test_flags_that_cannot_work_together_are_one_error(flags, message):
    with pytest.raises(ConfigError, match=message):
        parse_args(flags)


def test_a_metric_the_evaluation_does_not_give_is_one_line_exit_2(tmp_path, capfd):
    out = tmp_path / "run"
    assert main_ranks([*ARGS, "--metric_for_best_model", "bleu", "--output_dir", str(out)]) == [2, 2]
    err = capfd.readouterr().err
    lines = error_lines(err)
    assert len(lines) == 1 and "--metric_for_best_model eval_bleu" in lines[0] and "eval_loss" in lines[0], err
    assert "Traceback" not in err


@pytest.fixture(scope="module")
def stopped(tmp_path_factory) -> Path:
    """The uninterrupted run that early stopping ends at step 12."""
    out = tmp_path_factory.mktemp("stopped") / "run"
    assert main_ranks([*ARGS, *STOPPING, "--output_dir", str(out)]) == [0, 0]
    return out


def test_early_stopping_ends_every_rank_at_the_same_step_and_exports_the_best(stopped):
    summary = read_summary(stopped)
    assert summary["optimizer_steps"] == STOP_STEP
    assert summary["stopped_early"]["step"] == STOP_STEP and "early stopping" in summary["stopped_early"]["reason"]
    records = read_metrics(stopped)
    assert max(r["step"] for r in records) == STOP_STEP
    evals = {r["step"]: r["eval_loss"] for r in records if "eval_loss" in r}
    assert sorted(evals) == [2, 4, 6, 8, 10, 12]
    best_step = max((4, 8, 12), key=lambda s: evals[s])  # --greater_is_better: the highest loss of the kept
    assert summary["best_step"] == summary["final_weights_step"] == best_step
    assert summary["best_metric"] == evals[best_step] and summary["metric_for_best_model"] == "eval_loss"
    kept = [step for step, _ in list_checkpoints(str(stopped / "checkpoints"))]
    assert kept == sorted({8, best_step} - {12})  # --keep_last 1 (the newest, 8) plus the best, never pruned
    if best_step != STOP_STEP:
        best_folder = stopped / "checkpoints" / f"step_{best_step:08d}"
        expected = load_file(str(best_folder / "model.safetensors"))
        got = load_weights(stopped)
        assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in expected)
    meta = read_checkpoint(str(stopped / "checkpoints" / "step_00000008"))
    assert meta["best"]["counter"] == 3 and meta["best"]["metric"] == "eval_loss"  # evaluations 2, 3, 4


def test_a_resume_in_the_middle_of_the_patience_count_stops_at_the_same_step(stopped, tmp_path, capfd):
    """The stopped run's checkpoints are those a run that failed after step 10 leaves: step 8 (the count at 3 of 5)
    and the best one before it, kept as --keep_last 1 keeps them. Resumed from them, the run stops at step 12 too."""
    out = tmp_path / "run"
    args = [*ARGS, *STOPPING, "--output_dir", str(out)]
    shutil.copytree(stopped / "checkpoints", out / "checkpoints")
    assert [step for step, _ in list_checkpoints(str(out / "checkpoints"))][-1] == 8
    capfd.readouterr()
    assert main_ranks([*args, "--resume_from_checkpoint", "auto"]) == [0, 0]
    assert f"resumed from {out / 'checkpoints' / 'step_00000008'}" in capfd.readouterr().out
    got, expected = read_summary(out), read_summary(stopped)
    for key in ("optimizer_steps", "stopped_early", "best_step", "best_metric", "final_weights_step"):
        assert got[key] == expected[key], key
    a, b = load_weights(out), load_weights(stopped)
    assert all(torch.equal(a[k], b[k]) for k in b)
    # A relaunch after the stop has nothing to do, and touches nothing.
    before = {name: os.path.getmtime(out / name) for name in ("summary.json", "model.safetensors")}
    capfd.readouterr()
    assert main_ranks([*args, "--resume_from_checkpoint", "auto"]) == [0, 0]
    assert "already finished at step 12" in capfd.readouterr().out
    assert before == {name: os.path.getmtime(out / name) for name in before}


def test_without_the_flags_nothing_changes(tmp_path):
    cfg = TrainConfig()
    assert BestModel.from_options(section_of(cfg, BestModelOptions), 8, 32) is None


def test_early_stopping_at_an_epoch_end_evaluation(tmp_path):
    out = tmp_path / "run"
    args = [arg for arg in ARGS]
    args[args.index("--eval_every") + 1] = "0"  # evaluate at each epoch's end (8 steps), save there too
    args[args.index("--checkpointing_steps") + 1] = "epoch"
    assert main_ranks([*args, "--early_stopping_patience", "1", "--early_stopping_threshold", "100",
                       "--output_dir", str(out)]) == [0, 0]
    summary = read_summary(out)
    assert summary["optimizer_steps"] == 16 and summary["stopped_early"]["step"] == 16
    assert summary["final_weights_step"] == 16 and summary["best_step"] == 16  # lower loss, and the final weights
    assert [step for step, _ in list_checkpoints(str(out / "checkpoints"))] == [8]  # no save after the stop
