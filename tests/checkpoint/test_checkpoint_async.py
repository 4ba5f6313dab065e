"""--async_checkpointing (accel_ddp/checkpoint/async_save.py) on 2 forked gloo ranks.

The model is mnist_cnn (dropout: the RNG state is part of what must be saved at the save step). Faults
are patches of the writer inside the forked ranks: a write held until training has gone on, a SIGKILL
in the middle of a write, a full disk on one rank. --optimizer muon's state written in the background is compared
with the sync saves' in tests/checkpoint/test_resume.py, on the resume of its failed run.
"""

from __future__ import annotations

import errno
import hashlib
import os
import signal
import threading
from pathlib import Path

import pytest
import torch

import accel_ddp.checkpoint.async_save as async_save
import accel_ddp.optim.user as optim_user
from accel_ddp.checkpoint.manager import list_checkpoints, read_checkpoint
from accel_ddp.cli.train import main
from accel_ddp.outputs.names import MARKER_NAME
from tests.helpers.multiproc import RankFailed, run_ranks
from tests.helpers.ranks import error_lines
from tests.helpers.runs import load_weights, main_ranks, read_summary

# 256 samples / global batch 32 = 8 steps per epoch, 3 epochs = 24 steps, a checkpoint every 4.
ARGS = ["--dataset", "synthetic", "--synthetic_samples", "256", "--synthetic_shape", "1", "8", "8",
        "--model", "mnist_cnn", "--global_batch_size", "32", "--epochs", "3", "--num_workers", "0",
        "--log_every", "4", "--checkpointing_steps", "4", "--keep_last", "2"]


@pytest.fixture(scope="module")
def sync_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("sync") / "run"
    assert main_ranks([*ARGS, "--output_dir", str(out)]) == [0, 0]
    return out


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def assert_same_weights(a: Path, b: Path) -> None:
    got, expected = load_weights(a), load_weights(b)
    assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in expected)


def _steps_seen() -> list[int]:
    """Patch the schedule's step (called once per optimizer step) to record the step count; returns the record."""
    seen = [0]
    build = optim_user.build_lr_scheduler

    def counted(self, *a, **k):
        super(type(self), self).step(*a, **k)
        seen[0] = self.last_epoch

    def recording(*args, **kwargs):
        scheduler = build(*args, **kwargs)
        # A subclass, not an attribute: the scheduler's __dict__ is its checkpointed state (as tests/helpers/faults.py).
        scheduler.__class__ = type("CountedScheduler", (type(scheduler),), {"step": counted})
        return scheduler
    optim_user.build_lr_scheduler = recording
    return seen


def test_training_goes_on_while_the_checkpoint_is_written_and_the_checkpoints_hold_the_sync_bytes(sync_run,
                                                                                                   tmp_path):
    """Rank 0's write of step 4 is held until the loop has trained on to step 7; the run then ends with the sync
    run's weights, and its last two checkpoints, written in the background, hold the sync saves' bytes."""
    out = tmp_path / "run"

    def held_until_three_more_steps() -> int:
        seen, write = _steps_seen(), async_save.write_state
        trained_on = threading.Event()

        def held(state, folder, rank):
            if rank == 0 and folder.endswith("step_00000004"):
                for _ in range(600):  # the loop trains on while this writer waits: steps 5, 6, 7
                    if seen[0] >= 7:
                        trained_on.set()
                        break
                    threading.Event().wait(0.05)
                if not trained_on.is_set():
                    raise RuntimeError(f"training stood still at step {seen[0]} during the write")
            write(state, folder, rank)
        async_save.write_state = held
        return main([*ARGS, "--async_checkpointing", "--output_dir", str(out)])

    assert run_ranks(held_until_three_more_steps) == [0, 0]
    assert_same_weights(out, sync_run)
    assert read_summary(out)["optimizer_steps"] == 24
    assert [s for s, _ in list_checkpoints(str(out / "checkpoints"))] == [20, 24]
    for step in (20, 24):
        mine, theirs = (run / "checkpoints" / f"step_{step:08d}" for run in (out, sync_run))
        read_checkpoint(str(mine))  # sealed and intact
        names = sorted(os.listdir(theirs))
        assert sorted(os.listdir(mine)) == names
        for name in names:
            if name != MARKER_NAME:  # checkpoint.json holds the time of the save
                assert sha(mine / name) == sha(theirs / name), f"step {step}: {name} differs from the sync save's"


def test_kill_9_during_an_async_write_leaves_the_previous_checkpoint_and_resumes_bitwise(sync_run, tmp_path, capfd):
    out = tmp_path / "run"
    args = [*ARGS, "--async_checkpointing", "--output_dir", str(out)]

    def killed_writing_step_12() -> int:
        write = async_save.write_state

        def dies(state, folder, rank):
            if rank == 0 and folder.endswith("step_00000012"):
                async_save.accelerate_save(state["weights"], os.path.join(folder, "model.safetensors"),
                                           safe_serialization=True)
                os.kill(os.getpid(), signal.SIGKILL)  # half the files written, nothing sealed
            write(state, folder, rank)
        async_save.write_state = dies
        return main(args)

    with pytest.raises(RankFailed, match="exited with code -9"):
        run_ranks(killed_writing_step_12, grace=1)
    root = out / "checkpoints"
    assert [s for s, _ in list_checkpoints(str(root))] == [4, 8]
    assert not (root / ".tmp-step_00000012" / MARKER_NAME).exists()
    read_checkpoint(str(root / "step_00000008"))
    capfd.readouterr()
    assert main_ranks([*args, "--resume_from_checkpoint", "auto"]) == [0, 0]
    assert f"resumed from {root / 'step_00000008'}" in capfd.readouterr().out
    assert_same_weights(out, sync_run)
    assert sorted(os.listdir(root)) == ["step_00000020", "step_00000024"]


def test_a_full_disk_in_one_rank_writer_is_one_line_on_every_rank_exit_2(tmp_path, capfd):
    out = tmp_path / "run"

    def rank_1_disk_full() -> int:
        write = async_save.write_state

        def full(state, folder, rank):
            if rank == 1 and folder.endswith("step_00000008"):
                raise OSError(errno.ENOSPC, "No space left on device", folder)
            write(state, folder, rank)
        async_save.write_state = full
        return main([*ARGS, "--async_checkpointing", "--output_dir", str(out)])

    assert run_ranks(rank_1_disk_full) == [2, 2]
    err = capfd.readouterr().err
    lines = error_lines(err)
    assert len(lines) == 1 and "cannot save the checkpoint of step 8" in lines[0], err
    assert "step_00000004" in lines[0] and "Traceback" not in err
    root = out / "checkpoints"
    assert sorted(os.listdir(root)) == ["step_00000004"]  # the unsealed folder removed, the previous one intact


def test_a_rollback_while_a_save_is_in_flight_waits_for_it_and_rolls_back_to_it(tmp_path, capfd):
    """--on_anomaly rollback, --keep_last 1: the seal of step 4 is held until the guard has found step 5's nan (at
    step 6). The checkpoint in flight is the newest one from before it, as a synchronous save's would be: every rank
    waits for its seal (and the prune of step 2 that follows) before loading it, and the run ends normally."""
    from accel_ddp.bad_steps import AnomalyGuard
    from tests.helpers.anomaly import ARGS as ANOMALY_ARGS
    from tests.helpers.anomaly import install

    out = tmp_path / "run"
    args = [*ANOMALY_ARGS, "--on_anomaly", "rollback", "--checkpointing_steps", "2", "--keep_last", "1",
            "--async_checkpointing", "--output_dir", str(out)]

    def rank() -> int:
        install()
        found, seal, guard_found = threading.Event(), async_save.AsyncSaver._seal_when_all_written, AnomalyGuard._found

        def seal_after_the_anomaly(self, step, *rest):
            if step == 4:
                found.wait(timeout=300)  # a bound against a hang only: the guard sets it
            return seal(self, step, *rest)

        def guard_found_then_release(self, *a, **k):
            found.set()
            return guard_found(self, *a, **k)

        async_save.AsyncSaver._seal_when_all_written = seal_after_the_anomaly
        AnomalyGuard._found = guard_found_then_release
        return main(args)

    capfd.readouterr()
    assert run_ranks(rank) == [0, 0]
    output = capfd.readouterr()
    assert f"rolled every rank back to {out / 'checkpoints' / 'step_00000004'}, leaving out step 5" in output.out, \
        output.out
    assert "Traceback" not in output.err and not error_lines(output.err), output.err
    summary = read_summary(out)
    assert (summary["anomaly_skipped_steps"], summary["anomaly_rollbacks"]) == (1, 1)
    assert [os.path.basename(f) for _, f in list_checkpoints(str(out / "checkpoints"))] == ["step_00000010"]
