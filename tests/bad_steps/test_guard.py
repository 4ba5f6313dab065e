"""--on_anomaly skip|rollback (accel_ddp/bad_steps/guard.py) on two forked ranks: a non-finite batch at optimizer step
K on one rank.

The fault (tests/helpers/anomaly.py) is injected in the ranks' own process, as tests/helpers/faults.py does:
``bad_step_mlp``'s training forward is nan during optimizer step K on one rank, K read from the LR scheduler
(restored by a checkpoint, so a rollback or a resume meets the bad batch again at the same step).

The reference for "skip" is precise: the same run on clean data whose optimizer ``step()`` call of step K is
dropped on every rank (the schedule, the data order and every other step unchanged).
"""

from __future__ import annotations

import json

import pytest

from accel_ddp.cli.train import main
from tests.helpers import faults
from tests.helpers.anomaly import ARGS, BAD, FAULT, fused_skip_equals_never_stepping, install
from tests.helpers.multiproc import RankFailed, run_ranks
from tests.helpers.runs import load_weights, read_metrics, read_summary


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


def test_a_skip_prints_one_line_and_its_log_is_saved_with_each_checkpoint_and_restored_with_it(reference, tmp_path,
                                                                                               capfd):
    """A skip prints one line, on the main process. The log is part of the training state
    (checkpoint/train_state.py): step 6's checkpoint holds the skip of step 5, so a run branched off it into an empty
    folder (no anomalies.json there) continues the log. A checkpoint saved without it (the layout before) resumes
    with anomalies.json's."""
    _, skipped = reference
    args = [*ARGS, "--on_anomaly", "skip", "--checkpointing_steps", "6"]
    killed = tmp_path / "killed"
    capfd.readouterr()
    with pytest.raises(RankFailed):
        ranks([*args, "--output_dir", str(killed)], kill_after=7)
    out = capfd.readouterr()
    lines = [line for line in (out.out + out.err).splitlines() if line.startswith("accel_ddp: anomaly:")]
    assert lines == ["accel_ddp: anomaly: non-finite at optimizer step 5 (gradient norm nan); skipped its update "
                     "on every rank (1 in a row, at most --max_anomalies 5)"]
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
    """``--loss tests.bad_steps.test_guard:sum_loss``: a (sum, num_items) loss (the token-exact path)."""
    import torch
    import torch.nn.functional as F

    return F.cross_entropy(outputs, batch[1], reduction="sum"), torch.tensor(batch[1].numel())


# Each path in one case at least (the plain step, clipped, is the module's reference): two cases, four runs, where a
# case per path took six.
@pytest.mark.parametrize("extra", [
    # 2 micro-steps per step (accelerator.backward, no_sync), and no clipping: the guard computes the norm itself
    ["--per_device_batch_size", "8", "--max_grad_norm", "0"],
    ["--loss", "tests.bad_steps.test_guard:sum_loss", "--per_device_batch_size", "8", "--with_tracking",
     "--report_to", "csv"],  # (sum, num_items), rescaled after the items' all-reduce; the records reach a tracker
], ids=["accumulation_no_clipping", "summed_loss"])
def test_skip_on_every_update_path_equals_the_run_without_that_update(tmp_path, extra):
    args = [*ARGS, "--max_steps", "8", *extra]
    assert ranks([*args, "--on_anomaly", "skip", "--output_dir", str(tmp_path / "skip")]) == [0, 0]
    assert ranks([*args, "--output_dir", str(tmp_path / "ref")], bad=None, drop_update_at=BAD[0]) == [0, 0]
    assert_same_weights(tmp_path / "skip", tmp_path / "ref")
    assert [r["step"] for r in anomaly_records(tmp_path / "skip")] == [BAD[0]]
