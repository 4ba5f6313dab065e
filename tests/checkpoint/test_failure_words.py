"""Failures that were held, with the wrong words: a full disk during an async save, a read-only or immutable
folder, a malicious pickle that the manifest vouches for. Each says what failed, where, and the fix."""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

import pytest

from accel_ddp.cli.train import main
from accel_ddp.tracking.recorder import RunRecorder
from tests.helpers.checkpoints import assert_same_weights, plant_pickle, steps_of
from tests.helpers.files import CHECKPOINTED_ARGS as ARGS
from tests.helpers.files import ckpt, error_lines
from tests.helpers.multiproc import run_ranks
from tests.helpers.runs import main_ranks, read_summary


@pytest.fixture(scope="module")
def stopped_at_20(tmp_path_factory) -> Path:
    """A 2-rank run that ended at --max_steps 20, with checkpoints at 5, 10, 15 and 20 (tests copy it)."""
    out = tmp_path_factory.mktemp("stopped") / "run"
    assert main_ranks([*ARGS, "--max_steps", "20", "--output_dir", str(out)]) == [0, 0]
    assert steps_of(out) == [5, 10, 15, 20]
    return out


@pytest.fixture(scope="module")
def thirty_steps(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("reference") / "run"
    assert main_ranks([*ARGS, "--max_steps", "30", "--output_dir", str(out)]) == [0, 0]
    return out


# ------------------------------------------------------------------------------ a malicious pickle, resealed


def test_auto_passes_over_a_malicious_optimizer_file_and_resumes_the_newest_safe_checkpoint(stopped_at_20,
                                                                                              thirty_steps, tmp_path,
                                                                                              capfd):
    """step_20's optimizer.bin replaced by a pickle that would run code, its manifest recomputed: the manifest passes,
    the safe load refuses it on every rank; auto says so in one line naming the file (never torch's advice to load
    with weights_only=False), resumes step 15 and ends with the uninterrupted run's weights, bit for bit."""
    out, proof = tmp_path / "run", tmp_path / "payload-ran"
    shutil.copytree(stopped_at_20, out)
    plant_pickle(ckpt(out, 20), "optimizer.bin", proof)
    capfd.readouterr()
    assert main_ranks([*ARGS, "--max_steps", "30", "--output_dir", str(out), "--resume_from_checkpoint", "auto"]) \
        == [0, 0]
    err = capfd.readouterr().err
    skipped = [line for line in err.splitlines() if "skipping an unsafe checkpoint" in line]
    assert len(skipped) == 1, err
    assert f"{ckpt(out, 20) / 'optimizer.bin'} holds objects that a safe load" in skipped[0]
    assert "(Unsupported global: GLOBAL io.open)" in skipped[0], skipped
    assert skipped[0].endswith("falling back to the previous one")
    assert "weights_only=False" not in err and "weights_only` set to `False" not in err
    assert not proof.exists()
    assert read_summary(out)["resumed_from_step"] == 15
    assert_same_weights(out, thirty_steps)


def test_an_explicit_malicious_checkpoint_is_one_line_exit_2(stopped_at_20, tmp_path, capfd):
    out, proof = tmp_path / "run", tmp_path / "payload-ran"
    shutil.copytree(stopped_at_20, out)
    plant_pickle(ckpt(out, 20), "optimizer.bin", proof)
    capfd.readouterr()
    assert main_ranks([*ARGS, "--max_steps", "30", "--output_dir", str(out),
                       "--resume_from_checkpoint", str(ckpt(out, 20))]) == [2, 2]
    err = capfd.readouterr().err
    lines = error_lines(err)
    assert len(lines) == 1, err
    assert f"{ckpt(out, 20)}: {ckpt(out, 20) / 'optimizer.bin'} holds objects that a safe load" in lines[0]
    assert lines[0].endswith("or use auto, which passes over it")
    assert "weights_only=False" not in err and "Traceback" not in err and not proof.exists()


def test_a_malicious_scheduler_file_is_skipped_without_torchs_advice(stopped_at_20, tmp_path, capfd):
    """scheduler.bin is read when auto verifies a checkpoint: the same words, before any load."""
    out, proof = tmp_path / "run", tmp_path / "payload-ran"
    shutil.copytree(stopped_at_20, out)
    plant_pickle(ckpt(out, 20), "scheduler.bin", proof)
    capfd.readouterr()
    assert main_ranks([*ARGS, "--max_steps", "30", "--output_dir", str(out), "--resume_from_checkpoint", "auto"]) \
        == [0, 0]
    err = capfd.readouterr().err
    assert read_summary(out)["resumed_from_step"] == 15
    assert f"{ckpt(out, 20) / 'scheduler.bin'} holds objects that a safe load" in err, err
    assert "weights_only=False" not in err and not proof.exists()


# ------------------------------------------------------------------------------ a full disk, a read-only folder


def test_a_full_disk_during_an_async_save_names_the_save_and_removes_its_folder(tmp_path, capfd):
    """The main process's writer of step 10 meets a full disk; the metrics line of step 12 meets it too, first on
    the main thread: the line names the checkpoint of step 10 and its folder, not metrics.jsonl, and
    .tmp-step_00000010 is gone (its space given back); step 5 intact."""
    import accel_ddp.checkpoint.async_save as async_save

    out = tmp_path / "run"

    def run() -> int:
        write, log = async_save.write_state, RunRecorder.log

        def full(state, folder, rank):
            if rank == 0 and folder.endswith("step_00000010"):
                raise OSError(errno.ENOSPC, "No space left on device", folder)
            write(state, folder, rank)

        def full_at_12(self, record):
            if record.get("step") == 12 and self.enabled and self._metrics is not None:
                self._metrics.close()
                self._metrics = open("/dev/full", "w", encoding="utf-8")  # every write: ENOSPC
            return log(self, record)

        async_save.write_state, RunRecorder.log = full, full_at_12
        return main([*ARGS, "--max_steps", "30", "--checkpointing_steps", "5", "--async_checkpointing",
                     "--output_dir", str(out)])

    capfd.readouterr()
    assert run_ranks(run) == [2, 2]
    err = capfd.readouterr().err
    lines = error_lines(err)
    assert len(lines) == 1, err
    assert lines[0].startswith(f"accel_ddp: error: cannot save the checkpoint of step 10 in {out / 'checkpoints'}: "
                               "the file system is full"), lines
    assert "metrics.jsonl" not in lines[0] and "(step_00000005, the last checkpoint, is intact)" in lines[0]
    assert sorted(os.listdir(out / "checkpoints")) == ["step_00000005"]


@pytest.mark.parametrize("code", [errno.EROFS, errno.EPERM])
def test_a_read_only_or_immutable_folder_says_read_only_not_free_space(code, tmp_path, capfd):
    """EROFS (a read-only mount) or EPERM (chattr +i, which root meets too) while saving step 10: the line says
    read-only and how to make it writable, never "free space there"."""
    import torch

    out = tmp_path / "run"

    def run() -> int:
        real = torch.save

        def refused(obj, f, *args, **kwargs):
            if "step_00000010" in str(f):
                raise OSError(code, os.strerror(code), str(f))
            return real(obj, f, *args, **kwargs)

        torch.save = refused
        return main([*ARGS, "--max_steps", "30", "--output_dir", str(out)])

    capfd.readouterr()
    assert run_ranks(run) == [2, 2]
    lines = error_lines(capfd.readouterr().err)
    assert len(lines) == 1, lines
    assert f"cannot save the checkpoint of step 10 in {out / 'checkpoints'}: it is read-only ({os.strerror(code)}" \
        in lines[0], lines
    assert "make it writable" in lines[0] and "free space" not in lines[0]


def test_the_runs_own_files_in_a_read_only_folder_say_read_only(tmp_path):
    from accel_ddp.outputs.files import OUTPUTS_FIX, WriteFailed, written

    def refuse():
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    with pytest.raises(WriteFailed, match=r"cannot write summary.json in /x: it is read-only \(Read-only file system"
                                          r".*; make it writable \(.*\) or give another --output_dir") as caught:
        written(refuse, "summary.json", "/x", OUTPUTS_FIX)
    assert "free space" not in str(caught.value)
