"""Failures that were held, with the wrong words: a full disk during an async save, a read-only or immutable
folder. Each says what failed, where, and the fix. (A malicious pickle its manifest vouches for: test_damage.py.)"""

from __future__ import annotations

import errno
import os

import pytest

from accel_ddp.cli.train import main
from accel_ddp.tracking.recorder import RunRecorder
from tests.helpers.files import CHECKPOINTED_ARGS as ARGS
from tests.helpers.files import error_lines
from tests.helpers.multiproc import run_ranks

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
