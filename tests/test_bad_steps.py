"""Bad steps (accel_ddp/bad_steps.py) on two forked ranks.

A loss that turns nan or inf under the default ``--on_anomaly stop``: every rank stops at the same step, nothing
saved after it, metrics stay JSON; the device-side watch (``LossWatch``) that finds the first bad step.

``--on_anomaly skip|rollback``: a non-finite batch at optimizer step K on one rank.

The fault (tests/helpers/anomaly.py) is injected in the ranks' own process, as tests/helpers/faults.py does:
``bad_step_mlp``'s training forward is nan during optimizer step K on one rank, K read from the LR scheduler
(restored by a checkpoint, so a rollback or a resume meets the bad batch again at the same step).

The reference for "skip" is precise: the same run on clean data whose optimizer ``step()`` call of step K is
dropped on every rank (the schedule, the data order and every other step unchanged).
"""

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
from tests.helpers.anomaly import ARGS, BAD, FAULT, fused_skip_equals_never_stepping, install
from tests.helpers.checkpoints import steps_of
from tests.helpers.files import CHECKPOINTED_ARGS, ckpt, error_lines
from tests.helpers.multiproc import RankFailed, run_ranks
from tests.helpers.runs import load_weights, read_metrics, read_summary

# ----------------------------------------------------------------------------- a loss that turns nan (stop)


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
        return main([*CHECKPOINTED_ARGS, "--model", "tests.helpers.faults:nan_mlp", "--max_steps", "20",
                     "--log_every", log_every, "--output_dir", str(out)])

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
        return main([*CHECKPOINTED_ARGS, "--model", "tests.helpers.faults:nan_mlp", "--max_steps", "8", "--debug",
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


# ----------------------------------------------------------------------------- --on_anomaly skip|rollback


def ranks(args: list[str], **fault) -> list[int]:
    def rank() -> int:
        install(**fault)
        return main(args)

    return run_ranks(rank, world_size=2)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The clean run without step BAD's update, and the skip run with the bad batch (one of each)."""
    ref, skipped = tmp_path_factory.mktemp("ref"), tmp_path_factory.mktemp("skip")
    assert ranks([*ARGS, "--output_dir", str(ref)], bad=None, drop_update_at=BAD[0]) == [0, 0]
    assert ranks([*ARGS, "--on_anomaly", "skip", "--output_dir", str(skipped)]) == [0, 0]
    return ref, skipped


def assert_same_weights(a, b) -> None:
    wa, wb = load_weights(a), load_weights(b)
    assert wa.keys() == wb.keys() and all((wa[k] == wb[k]).all() for k in wa), "weights differ"


def anomaly_records(out) -> list[dict]:
    return [r for r in read_metrics(out) if "anomaly" in r]


def test_stop_is_todays_behaviour(tmp_path, capfd):
    assert ranks([*ARGS, "--output_dir", str(tmp_path)]) == [3, 3]
    assert "the training loss became nan or inf at optimizer step 5" in capfd.readouterr().err
    assert not (tmp_path / "anomalies.json").exists()


def test_skip_leaves_out_exactly_the_bad_steps_update_on_every_rank(reference, capfd):
    ref, skipped = reference
    assert_same_weights(skipped, ref)
    summary = read_summary(skipped)
    assert (summary["anomaly_skipped_steps"], summary["anomaly_rollbacks"]) == (1, 0)
    assert summary["optimizer_steps"] == 10 and summary["lr_scheduler_steps"] == 10  # the schedule moved on
    (record,) = anomaly_records(skipped)
    assert (record["step"], record["anomaly"], record["action"]) == (5, "non_finite", "skip")
    assert json.loads((skipped / "anomalies.json").read_text()) == {"skipped": {"5": "non_finite"}, "rollbacks": []}
    losses = [r["loss"] for r in read_metrics(skipped) if "loss" in r]
    assert len(losses) == 5 and all(isinstance(x, float) for x in losses)  # the nan step is out of the mean


def test_skip_prints_one_line_on_the_main_process(tmp_path, capfd):
    capfd.readouterr()
    assert ranks([*ARGS, "--on_anomaly", "skip", "--max_steps", "6", "--output_dir", str(tmp_path)]) == [0, 0]
    out = capfd.readouterr()
    lines = [line for line in (out.out + out.err).splitlines() if line.startswith("accel_ddp: anomaly:")]
    assert lines == ["accel_ddp: anomaly: non-finite at optimizer step 5 (gradient norm nan); skipped its update "
                     "on every rank (1 in a row, at most --max_anomalies 5)"]


def test_max_anomalies_in_a_row_stops_as_today(tmp_path, capfd):
    def rank() -> int:
        install()
        FAULT["step"] = None
        # Every training forward of rank 1 is nan from step 3 on.
        import accel_ddp.optim.user as optim_user
        sched = optim_user.build_lr_scheduler

        def seen(*a, **k):
            s = sched(*a, **k)
            FAULT["scheduler"] = type("Late", (), {"last_epoch": property(lambda self: 2 if s.last_epoch >= 2
                                                                             else -9)})()
            FAULT["step"] = 3
            return s

        optim_user.build_lr_scheduler = seen
        return main([*ARGS, "--on_anomaly", "skip", "--max_anomalies", "3", "--log_every", "1",
                     "--output_dir", str(tmp_path)])

    capfd.readouterr()
    assert run_ranks(rank, world_size=2) == [3, 3]
    err = capfd.readouterr().err
    assert "non-finite step 5 (gradient norm nan): 3 anomalies in a row (--max_anomalies 3); every rank stopped" \
        in err
    assert "Traceback" not in err and err.count("accel_ddp: error:") == 1
    assert [r["action"] for r in anomaly_records(tmp_path)] == ["skip", "skip", "stop"]
    assert not (tmp_path / "model.safetensors").exists()


def test_rollback_replays_without_the_bad_step_then_a_kill_and_resume_is_bitwise(reference, tmp_path, capfd):
    _, skipped = reference
    args = [*ARGS, "--on_anomaly", "rollback", "--checkpointing_steps", "2"]
    whole = tmp_path / "whole"
    capfd.readouterr()
    assert ranks([*args, "--output_dir", str(whole)]) == [0, 0]
    printed = capfd.readouterr().out
    assert printed.count("accel_ddp: anomaly:") == 1
    assert f"rolled every rank back to {whole / 'checkpoints' / 'step_00000004'}, leaving out step 5" in printed
    assert_same_weights(whole, skipped)  # rolled back to step 4, replayed 5 without its update: the skip run
    summary = read_summary(whole)
    assert (summary["anomaly_skipped_steps"], summary["anomaly_rollbacks"]) == (1, 1)
    assert [(r["step"], r["action"]) for r in anomaly_records(whole)] == [(5, "rollback")]  # the replay's record
    assert [r["step"] for r in read_metrics(whole) if "loss" in r] == [2, 4, 6, 8, 10]  # each step logged once

    killed = tmp_path / "killed"
    with pytest.raises(RankFailed) as failed:
        ranks([*args, "--output_dir", str(killed)], kill_after=7)  # after the rollback and step 6's checkpoint
    assert all("exited with code -9" in text for text in failed.value.failures.values())
    assert json.loads((killed / "anomalies.json").read_text())["skipped"] == {"5": "non_finite"}
    assert ranks([*args, "--resume_from_checkpoint", "auto", "--output_dir", str(killed)]) == [0, 0]
    assert_same_weights(killed, whole)
    assert read_summary(killed)["resumed_from_step"] == 6
    assert read_summary(killed)["anomaly_rollbacks"] == 1


def test_the_anomaly_log_is_saved_with_each_checkpoint_and_restored_with_it(reference, tmp_path):
    """The log is part of the training state (checkpoint/train_state.py): step 6's checkpoint holds the skip of step
    5, so a run branched off it into an empty folder (no anomalies.json there) continues the log. A checkpoint saved
    without it (the layout before) resumes with anomalies.json's."""
    _, skipped = reference
    args = [*ARGS, "--on_anomaly", "skip", "--checkpointing_steps", "6"]
    killed = tmp_path / "killed"
    with pytest.raises(RankFailed):
        ranks([*args, "--output_dir", str(killed)], kill_after=7)
    marker = killed / "checkpoints" / "step_00000006" / "checkpoint.json"
    meta = json.loads(marker.read_text())
    assert meta["anomalies"] == {"skipped": {"5": "non_finite"}, "rollbacks": []}

    branch = tmp_path / "branch"
    assert ranks([*args, "--resume_from_checkpoint", str(marker.parent), "--output_dir", str(branch)]) == [0, 0]
    assert read_summary(branch)["anomaly_skipped_steps"] == 1
    assert_same_weights(branch, skipped)

    del meta["anomalies"]
    marker.write_text(json.dumps(meta))
    assert ranks([*args, "--resume_from_checkpoint", "auto", "--output_dir", str(killed)]) == [0, 0]
    assert read_summary(killed)["anomaly_skipped_steps"] == 1
    assert_same_weights(killed, skipped)


def test_rollback_without_a_checkpoint_before_the_bad_step_stops(tmp_path, capfd):
    capfd.readouterr()
    # the first checkpoint would be step 8, after the bad step 5 (without --checkpointing_steps: refused up front)
    assert ranks([*ARGS, "--on_anomaly", "rollback", "--checkpointing_steps", "8", "--output_dir", str(tmp_path)]) \
        == [3, 3]
    err = capfd.readouterr().err
    assert "no checkpoint from before it to roll back to; every rank stopped and no checkpoint was saved" in err
    assert "Traceback" not in err and err.count("accel_ddp: error:") == 1


def test_inf_loss_with_finite_gradients_is_skipped_on_every_rank(tmp_path):
    """A constant +inf loss on rank 1 has finite gradients: the guard's poison makes them nan, so both skip."""
    args = [*ARGS, "--model", "mlp", "--hidden_size", "16", "--loss", "tests.helpers.faults:inf_loss",
            "--max_steps", "6"]

    def rank(out, **fault) -> int:
        faults._LOSS_CALLS[0] = 0
        if fault.get("nan"):
            faults.install(nan_at=(3, 1))
        install(bad=None, drop_update_at=fault.get("drop"))
        return main([*args, "--on_anomaly", "skip" if fault.get("nan") else "stop", "--output_dir", str(out)])

    assert run_ranks(lambda: rank(tmp_path / "skip", nan=True), world_size=2) == [0, 0]
    assert run_ranks(lambda: rank(tmp_path / "ref", drop=3), world_size=2) == [0, 0]
    assert_same_weights(tmp_path / "skip", tmp_path / "ref")
    assert read_summary(tmp_path / "skip")["anomaly_skipped_steps"] == 1


def test_spike_factor_with_skip_is_refused():
    from accel_ddp.config import TrainConfig
    from accel_ddp.util.validation import ConfigError

    with pytest.raises(ConfigError, match="--spike_factor 3 with --on_anomaly skip"):
        TrainConfig(on_anomaly="skip", spike_factor=3.0)
    with pytest.raises(ConfigError, match="--on_anomaly 'later' is unknown"):
        TrainConfig(on_anomaly="later")


@pytest.mark.parametrize("mode", ["rollback", "stop"])
def test_a_loss_spike_rolls_back_to_before_it_or_stops(tmp_path, capfd, mode):
    """Step 7's loss on rank 1 is ~1000x (finite): the logged loss (all-reduced, the same on both ranks) is above
    5 x the median of the last 3. rollback: back to step 6's checkpoint, step 7 left out; the weights are those of
    the clean run without step 7's update."""
    args = [*ARGS, "--log_every", "1", "--spike_factor", "5", "--spike_window", "3", "--checkpointing_steps", "2",
            "--on_anomaly", mode]
    capfd.readouterr()
    codes = ranks([*args, "--output_dir", str(tmp_path / "spike")], bad=(7, 1), factor=1000.0)
    printed = capfd.readouterr()
    if mode == "stop":
        assert codes == [3, 3]
        assert "spike step 7 (loss " in printed.err and "--on_anomaly stop; every rank stopped" in printed.err
        return
    assert codes == [0, 0]
    assert "accel_ddp: anomaly: spike at optimizer step 7 (loss " in printed.out
    assert ranks([*ARGS, "--output_dir", str(tmp_path / "ref")], bad=None, drop_update_at=7) == [0, 0]
    assert_same_weights(tmp_path / "spike", tmp_path / "ref")
    assert json.loads((tmp_path / "spike" / "anomalies.json").read_text())["rollbacks"] == [
        {"kind": "spike", "steps": [7], "to_step": 6}]


@pytest.mark.parametrize("name", ["adamw", "sgd"])
def test_a_skipped_step_of_a_fused_optimizer_changes_no_bit(name):
    """The CUDA path (found_inf on the device), with torch's fused CPU kernels: skip, train == train, the first
    step skipped included (fused SGD would keep uninitialised momentum buffers: they start as zeros)."""
    assert fused_skip_equals_never_stepping(name)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["adamw", "sgd"])
def test_a_skipped_step_of_a_fused_cuda_optimizer_changes_no_bit_without_a_host_sync(name):
    from tests.helpers.runs import check, gpu_env, run_python

    result = check(run_python("from tests.helpers.anomaly import fused_skip_equals_never_stepping as f; "
                              f"print(f({name!r}, 'cuda'))", env=gpu_env()))
    assert result.stdout.strip().splitlines()[-1] == "True", result.stdout + result.stderr

def sum_loss(outputs, batch):
    """``--loss tests.test_bad_steps:sum_loss``: a (sum, num_items) loss (the token-exact path)."""
    import torch
    import torch.nn.functional as F

    return F.cross_entropy(outputs, batch[1], reduction="sum"), torch.tensor(batch[1].numel())


@pytest.mark.parametrize("extra", [
    ["--per_device_batch_size", "8"],  # 2 micro-steps per step: accelerator.backward, no_sync
    ["--max_grad_norm", "0"],  # no clipping: the guard computes the norm itself
    ["--loss", "tests.test_bad_steps:sum_loss", "--per_device_batch_size", "8", "--with_tracking",
     "--report_to", "csv"],  # (sum, num_items), rescaled after the items' all-reduce; the records reach a tracker
], ids=["accumulation", "no_clipping", "summed_loss"])
def test_skip_on_every_update_path_equals_the_run_without_that_update(tmp_path, extra):
    args = [*ARGS, "--max_steps", "8", *extra]
    assert ranks([*args, "--on_anomaly", "skip", "--output_dir", str(tmp_path / "skip")]) == [0, 0]
    assert ranks([*args, "--output_dir", str(tmp_path / "ref")], bad=None, drop_update_at=BAD[0]) == [0, 0]
    assert_same_weights(tmp_path / "skip", tmp_path / "ref")
    assert [r["step"] for r in anomaly_records(tmp_path / "skip")] == [BAD[0]]
