"""Trust nothing on disk: checkpoints that lie, finished runs, a full disk while saving, changed hyperparameters
on resume.

Every run here is forked ranks of a gloo group (tests/helpers/multiproc.py), not a launch. Config-level cases
(types, ranges, YAML) live in tests/cli/test_args.py and tests/config/; the run folder's lock and bad output folders in
tests/outputs/test_run_dir.py, users' functions in tests/tasks/test_user_code.py, a nan loss in
tests/bad_steps/test_watch.py.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
import yaml

from accel_ddp.checkpoint.manager import (
    CheckpointManager,
    CorruptCheckpoint,
    list_checkpoints,
    read_checkpoint,
)
from accel_ddp.checkpoint.train_state import TrainState
from accel_ddp.cli.train import main
from accel_ddp.outputs.files import file_sha256
from accel_ddp.outputs.names import MARKER_NAME
from accel_ddp.tracking.recorder import RunRecorder
from tests.helpers.checkpoints import assert_same_weights, plant_pickle, steps_of
from tests.helpers.files import CHECKPOINTED_ARGS as ARGS
from tests.helpers.files import as_unprivileged, chown_tree, ckpt, edit_marker, error_lines, snapshot
from tests.helpers.multiproc import run_ranks
from tests.helpers.runs import load_weights, main_ranks, read_metrics, read_summary


@pytest.fixture(scope="module")
def stopped_at_20(tmp_path_factory) -> Path:
    """A 2-rank run that ended at --max_steps 20, with checkpoints at 5, 10, 15 and 20 (tests copy it)."""
    out = tmp_path_factory.mktemp("stopped") / "run"
    assert main_ranks([*ARGS, "--max_steps", "20", "--output_dir", str(out)]) == [0, 0]
    assert steps_of(out) == [5, 10, 15, 20]
    return out


@pytest.fixture(scope="module")
def thirty_steps(tmp_path_factory) -> Path:
    """The same run straight to step 30: what every resumed run below must equal, bit for bit."""
    out = tmp_path_factory.mktemp("reference") / "run"
    assert main_ranks([*ARGS, "--max_steps", "30", "--output_dir", str(out)]) == [0, 0]
    return out


def copy_run(source: Path, tmp_path: Path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(source, out)
    return out


# ----------------------------------------------------------------------------- 1. checkpoints that lie


def test_read_checkpoint_checks_the_step_the_manifest_and_the_scheduler(stopped_at_20, tmp_path):
    out = copy_run(stopped_at_20, tmp_path)
    read_checkpoint(str(ckpt(out, 20)))  # intact
    for step in (7, -5, 999):
        edit_marker(ckpt(out, 20), step=step)
        with pytest.raises(CorruptCheckpoint, match=f"checkpoint.json says step {step}, its name says step 20"):
            read_checkpoint(str(ckpt(out, 20)))
    edit_marker(ckpt(out, 20), step=True)
    with pytest.raises(CorruptCheckpoint, match="unreadable or malformed"):
        read_checkpoint(str(ckpt(out, 20)))

    renamed = out / "checkpoints" / "step_00099999"
    ckpt(out, 15).rename(renamed)
    with pytest.raises(CorruptCheckpoint, match="says step 15, its name says step 99999"):
        read_checkpoint(str(renamed))

    (ckpt(out, 10) / "optimizer.bin").unlink()  # deleted, and dropped from the manifest
    meta = json.loads((ckpt(out, 10) / MARKER_NAME).read_text())
    del meta["files"]["optimizer.bin"]
    (ckpt(out, 10) / MARKER_NAME).write_text(json.dumps(meta))
    with pytest.raises(CorruptCheckpoint, match="does not list optimizer.bin, which every checkpoint holds"):
        read_checkpoint(str(ckpt(out, 10)))

    # A consistent manifest over another step's scheduler: the schedule's own step count gives it away.
    five = ckpt(out, 5)
    shutil.copy(ckpt(stopped_at_20, 10) / "scheduler.bin", five / "scheduler.bin")
    meta = json.loads((five / MARKER_NAME).read_text())
    meta["files"]["scheduler.bin"] = {"bytes": (five / "scheduler.bin").stat().st_size,
                                      "sha256": file_sha256(str(five / "scheduler.bin"))}
    (five / MARKER_NAME).write_text(json.dumps(meta))
    with pytest.raises(CorruptCheckpoint, match="says step 5, its scheduler.bin has stepped 10 times"):
        read_checkpoint(str(five))


def test_branching_off_another_runs_checkpoint_needs_a_folder_of_its_own(stopped_at_20, tmp_path, capfd):
    """Another run's checkpoint into a folder holding checkpoints or a finished run: one line, nothing touched;
    into an empty folder it resumes."""
    occupied = copy_run(stopped_at_20, tmp_path / "b")
    finished_only = copy_run(stopped_at_20, tmp_path / "c")
    shutil.rmtree(finished_only / "checkpoints")
    source = str(ckpt(stopped_at_20, 15))
    for out in (occupied, finished_only):
        before = snapshot(out)
        capfd.readouterr()
        assert main_ranks([*ARGS, "--max_steps", "30", "--output_dir", str(out),
                           "--resume_from_checkpoint", source]) == [2, 2]
        lines = error_lines(capfd.readouterr().err)
        assert len(lines) == 1 and "belongs to another run" in lines[0] and "empty --output_dir" in lines[0], lines
        assert snapshot(out) == before
    fresh = tmp_path / "d" / "run"
    assert main_ranks([*ARGS, "--max_steps", "20", "--output_dir", str(fresh), "--resume_from_checkpoint", source]) \
        == [0, 0]
    assert read_summary(fresh)["resumed_from_step"] == 15


def test_a_resume_from_the_last_steps_checkpoint_still_evaluates_the_final_weights(stopped_at_20, tmp_path):
    """Killed after its last checkpoint but before its summary: the relaunch trains nothing and must still
    report the final weights' evaluation, the same as the run would have."""
    out = copy_run(stopped_at_20, tmp_path)
    finished = read_summary(out)
    assert finished["eval_samples"] > 0
    (out / "summary.json").unlink()
    assert main_ranks([*ARGS, "--max_steps", "20", "--output_dir", str(out), "--resume_from_checkpoint", "auto"]) \
        == [0, 0]
    resumed = read_summary(out)
    assert resumed["resumed_from_step"] == 20 and resumed["optimizer_steps"] == 20
    for key in ("eval_samples", "eval_loss", "eval_accuracy"):
        assert resumed[key] == finished[key], key


def test_an_fsdp_checkpoint_needs_fsdps_own_model_and_optimizer_files(stopped_at_20, tmp_path):
    """Under FSDP Accelerate saves `pytorch_model_fsdp_0/` and `optimizer_0/` instead of our two files: such a
    checkpoint is intact (it resumes), and one without its optimizer folder is still damaged."""
    folder = ckpt(copy_run(stopped_at_20, tmp_path), 20)
    meta = json.loads((folder / MARKER_NAME).read_text())
    for ours, theirs in (("model.safetensors", "pytorch_model_fsdp_0/__0_0.distcp"),
                         ("optimizer.bin", "optimizer_0/__0_0.distcp")):
        (folder / theirs).parent.mkdir()
        (folder / ours).rename(folder / theirs)
        meta["files"][theirs] = meta["files"].pop(ours)
    meta["distributed_type"] = "FSDP"
    (folder / MARKER_NAME).write_text(json.dumps(meta))
    assert read_checkpoint(str(folder))["step"] == 20

    del meta["files"]["optimizer_0/__0_0.distcp"]
    (folder / MARKER_NAME).write_text(json.dumps(meta))
    with pytest.raises(CorruptCheckpoint, match=r"does not list optimizer\* \(FSDP\)"):
        read_checkpoint(str(folder))


def test_auto_skips_lying_checkpoints_and_half_a_metrics_line_keeps_the_intact_ones_and_resumes_exactly(
        stopped_at_20, thirty_steps, tmp_path, capfd):
    """Checkpoints that lie (a step that is not its name's, a renamed folder, a file missing from the manifest) are
    skipped with a line each; and the half line a run killed in the middle of a metrics write leaves does not block
    the resume, which drops it and goes on."""
    out = copy_run(stopped_at_20, tmp_path)
    with open(out / "metrics.jsonl", "a", encoding="utf-8") as fh:
        fh.write('{"step": 16, "loss": 0.4')  # no closing brace, no newline
    edit_marker(ckpt(out, 20), step=7)  # issue 14: this resumed at step 7 and overwrote steps 10 and 15
    shutil.copytree(ckpt(out, 15), out / "checkpoints" / "step_00099999")  # a renamed folder is not the newest
    (ckpt(out, 15) / "optimizer.bin").unlink()
    meta = json.loads((ckpt(out, 15) / MARKER_NAME).read_text())
    del meta["files"]["optimizer.bin"]
    (ckpt(out, 15) / MARKER_NAME).write_text(json.dumps(meta))
    damaged_20 = snapshot(ckpt(out, 20))
    intact = {step: snapshot(ckpt(out, step)) for step in (5, 10)}
    capfd.readouterr()

    assert main_ranks([*ARGS, "--max_steps", "30", "--output_dir", str(out), "--resume_from_checkpoint", "auto"]) \
        == [0, 0]
    captured = capfd.readouterr()
    skipped = [line for line in captured.err.splitlines() if "skipping a damaged checkpoint" in line]
    assert len(skipped) == 3, captured.err
    assert "step_00099999: its checkpoint.json says step 15, its name says step 99999" in skipped[0]
    assert "step_00000020: its checkpoint.json says step 7, its name says step 20" in skipped[1]
    assert "does not list optimizer.bin" in skipped[2]
    assert f"resumed from {ckpt(out, 10)} (optimizer step 10" in captured.out
    assert_same_weights(out, thirty_steps)
    assert read_summary(out)["optimizer_steps"] == 30
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]  # every line whole
    logged = [r["step"] for r in records if "loss" in r]
    assert logged == sorted(set(logged)) and logged[-1] == 30, logged
    for step, files in intact.items():  # neither overwritten nor pruned
        assert snapshot(ckpt(out, step)) == files
    # The damaged ones the run reached again were set aside, byte for byte, not deleted; the others stay.
    assert snapshot(out / "checkpoints" / "step_00000020.damaged") == damaged_20
    assert (out / "checkpoints" / "step_00000015.damaged" / MARKER_NAME).exists()
    assert (out / "checkpoints" / "step_00099999" / MARKER_NAME).exists()
    assert steps_of(out) == [5, 10, 15, 20, 25, 30, 99999]
    for step in (15, 20, 25, 30):
        assert read_checkpoint(str(ckpt(out, step)))["step"] == step
    assert f"{ckpt(out, 20)} was damaged; moved it to {ckpt(out, 20)}.damaged" in captured.err


def test_an_explicit_lying_checkpoint_is_exit_2_and_nothing_is_touched(stopped_at_20, tmp_path, capfd):
    out = copy_run(stopped_at_20, tmp_path)
    edit_marker(ckpt(out, 20), step=999)  # issue 14: this exited 0 with optimizer_steps 999 in summary.json
    before = snapshot(out)
    capfd.readouterr()
    assert main_ranks([*ARGS, "--max_steps", "30", "--output_dir", str(out),
                       "--resume_from_checkpoint", str(ckpt(out, 20))]) == [2, 2]
    (line,) = error_lines(capfd.readouterr().err)
    assert "checkpoint.json says step 999, its name says step 20; resume from an older checkpoint, or use auto" in line
    assert snapshot(out) == before


def test_an_import_failure_while_reading_a_checkpoint_is_not_called_damage(stopped_at_20, monkeypatch):
    """torch failing to import its own code is a broken environment: surfaced, not a reason to skip checkpoints."""
    from accel_ddp.checkpoint import manifest

    def broken_load(*args, **kwargs):
        raise ModuleNotFoundError("No module named 'torch.utils.serialization'")

    monkeypatch.setattr(manifest, "accelerate_load", broken_load)
    with pytest.raises(ModuleNotFoundError):
        manifest.read_checkpoint(str(ckpt(stopped_at_20, 20)))


def test_unreadable_checkpoint_file_is_damaged_and_auto_falls_back(stopped_at_20, thirty_steps, open_dir, capfd):
    out = copy_run(stopped_at_20, open_dir)
    chown_tree(out)
    (ckpt(out, 20) / "optimizer.bin").chmod(0o000)
    capfd.readouterr()

    def resume_unprivileged() -> int:
        as_unprivileged()
        return main([*ARGS, "--max_steps", "30", "--output_dir", str(out), "--resume_from_checkpoint", "auto"])

    assert run_ranks(resume_unprivileged, world_size=1) == [0]
    captured = capfd.readouterr()
    assert f"skipping a damaged checkpoint: {ckpt(out, 20)}/optimizer.bin cannot be read (Permission denied)" \
        in captured.err
    assert f"resumed from {ckpt(out, 15)}" in captured.out
    assert read_summary(out)["optimizer_steps"] == 30
    # 1 process resumed what 2 saved: equal within float tolerance (the global batch is the unit).
    got, expected = load_weights(out), load_weights(thirty_steps)
    assert all(torch.allclose(got[k], expected[k], atol=1e-5) for k in expected)


def test_a_checkpoint_past_the_runs_total_is_refused_not_skipped(stopped_at_20, tmp_path, capfd):
    """Skipping it would resume older and overwrite the longer run's model.safetensors and summary.json."""
    out = copy_run(stopped_at_20, tmp_path)
    before = snapshot(out)
    capfd.readouterr()
    for spec in ("auto", str(ckpt(out, 20))):
        assert main_ranks([*ARGS, "--max_steps", "15", "--output_dir", str(out), "--resume_from_checkpoint", spec],
                          world_size=1) == [2]
        (line,) = error_lines(capfd.readouterr().err)
        assert "it holds step 20, past this run's last step 15 (were --epochs or --max_steps lowered?)" in line
    assert snapshot(out) == before


def test_resuming_an_older_checkpoint_over_intact_newer_ones_is_refused(stopped_at_20, tmp_path, capfd):
    out = copy_run(stopped_at_20, tmp_path)
    before = snapshot(out)
    capfd.readouterr()
    assert main_ranks([*ARGS, "--max_steps", "30", "--output_dir", str(out),
                       "--resume_from_checkpoint", str(ckpt(out, 10))], world_size=1) == [2]
    (line,) = error_lines(capfd.readouterr().err)
    assert f"{out / 'checkpoints'} holds a newer checkpoint, step_00000015, that this run would overwrite" in line
    assert snapshot(out) == before


def test_keep_last_never_prunes_checkpoints_newer_than_the_one_saved(tmp_path):
    root = tmp_path / "checkpoints"
    for step in (10, 20, 30, 40):
        folder = root / f"step_{step:08d}"
        folder.mkdir(parents=True)
        (folder / MARKER_NAME).write_text("{}")

    class Stub:
        def register_save_state_pre_hook(self, hook):
            pass

        register_load_state_pre_hook = register_save_state_pre_hook

    nothing = TrainState(accelerator=Stub(), model=torch.nn.Identity(), optimizer=None, scheduler=None)  # not saved
    manager = CheckpointManager(nothing.accelerator, str(tmp_path), keep_last=1, run_facts={}, state=nothing)
    manager.prune(keep=str(root / "step_00000020"))  # a run resumed at 10 past damaged 30 and 40
    assert [s for s, _ in list_checkpoints(str(root))] == [20, 30, 40]


def test_sha256_reads_in_chunks(tmp_path):
    data = os.urandom(3 * (1 << 20) + 17)  # more than one 1 MiB chunk
    (tmp_path / "f").write_bytes(data)
    assert file_sha256(str(tmp_path / "f")) == hashlib.sha256(data).hexdigest()


# ----------------------------------------------------------------------------- 2. finished runs


def test_the_same_auto_command_on_a_finished_run_touches_nothing(stopped_at_20, tmp_path, capfd):
    out = copy_run(stopped_at_20, tmp_path)
    before = snapshot(out)
    summary = read_summary(out)
    capfd.readouterr()
    assert main_ranks([*ARGS, "--max_steps", "20", "--output_dir", str(out), "--resume_from_checkpoint", "auto"]) \
        == [0, 0]
    captured = capfd.readouterr()
    assert captured.out.count(f"accel_ddp: {out} already finished at step 20") == 1, captured.out
    assert "error" not in captured.err
    assert snapshot(out) == before  # byte for byte and mtime for mtime: metrics, config, summary, checkpoints
    assert read_summary(out) == summary


@pytest.mark.parametrize("resume", [[], ["--resume_from_checkpoint", "auto"]], ids=["fresh", "auto-longer"])
def test_a_start_from_scratch_never_overwrites_a_finished_run(stopped_at_20, tmp_path, capfd, resume):
    """A finished run with no checkpoint left: neither a fresh start nor `auto` asking for more steps
    (nothing to continue from) may overwrite its summary and weights."""
    out = copy_run(stopped_at_20, tmp_path)
    shutil.rmtree(out / "checkpoints")
    before = snapshot(out)
    capfd.readouterr()
    assert main_ranks([*ARGS, "--max_steps", "30", "--output_dir", str(out), *resume]) == [2, 2]
    lines = error_lines(capfd.readouterr().err)
    assert len(lines) == 1 and "holds a finished run" in lines[0] and "another --output_dir" in lines[0], lines
    assert snapshot(out) == before


# ----------------------------------------------------------------------------- 1b. a malicious pickle, resealed


def _planted(source: Path, tmp_path: Path, name: str, capfd) -> tuple[Path, Path]:
    """A copy of ``source`` whose step_20 ``name`` is a pickle that would create ``proof``, its manifest recomputed."""
    out, proof = copy_run(source, tmp_path), tmp_path / "payload-ran"
    plant_pickle(ckpt(out, 20), name, proof)
    capfd.readouterr()
    return out, proof


def test_auto_passes_over_malicious_scheduler_and_optimizer_files_and_resumes_the_newest_safe_checkpoint(
        stopped_at_20, thirty_steps, tmp_path, capfd):
    """step_20's scheduler.bin and step_15's optimizer.bin replaced by pickles that would run code, their manifests
    recomputed: the manifests pass. scheduler.bin is read when auto verifies a checkpoint, before any load;
    optimizer.bin only by the load, which the safe unpickler refuses on every rank. auto says so in one line each
    naming the file (never torch's advice to load with weights_only=False), resumes step 10 and ends with the
    uninterrupted run's weights, bit for bit. (One run for both files: each is found at its own stage, the
    verification and the load.)"""
    out, proof = _planted(stopped_at_20, tmp_path, "scheduler.bin", capfd)
    optimizer_proof = tmp_path / "optimizer-payload-ran"
    plant_pickle(ckpt(out, 15), "optimizer.bin", optimizer_proof)
    assert main_ranks([*ARGS, "--max_steps", "30", "--output_dir", str(out), "--resume_from_checkpoint", "auto"]) \
        == [0, 0]
    err = capfd.readouterr().err
    assert f"{ckpt(out, 20) / 'scheduler.bin'} holds objects that a safe load" in err, err
    skipped = [line for line in err.splitlines() if "skipping a checkpoint that does not load safely" in line]
    assert len(skipped) == 1, err
    assert f"{ckpt(out, 15) / 'optimizer.bin'} holds objects that a safe load" in skipped[0]
    assert "(Unsupported global: GLOBAL io.open)" in skipped[0], skipped
    assert skipped[0].endswith("falling back to the previous one")
    assert "weights_only=False" not in err and "weights_only` set to `False" not in err
    assert not proof.exists() and not optimizer_proof.exists()
    assert read_summary(out)["resumed_from_step"] == 10
    assert_same_weights(out, thirty_steps)


def test_an_explicit_malicious_checkpoint_is_one_line_exit_2(stopped_at_20, tmp_path, capfd):
    out, proof = _planted(stopped_at_20, tmp_path, "optimizer.bin", capfd)
    assert main_ranks([*ARGS, "--max_steps", "30", "--output_dir", str(out),
                       "--resume_from_checkpoint", str(ckpt(out, 20))]) == [2, 2]
    err = capfd.readouterr().err
    lines = error_lines(err)
    assert len(lines) == 1, err
    assert f"{ckpt(out, 20)}: {ckpt(out, 20) / 'optimizer.bin'} holds objects that a safe load" in lines[0]
    assert lines[0].endswith("or use auto, which passes over it")
    assert "weights_only=False" not in err and "Traceback" not in err and not proof.exists()


# ----------------------------------------------------------------------------- 4b. a full disk


@pytest.fixture
def small_disk(tmp_path):
    """A 64 MiB tmpfs of this test's own (root only, where mounts are allowed; else the test is skipped)."""
    mount_point = tmp_path / "disk"
    mount_point.mkdir()
    mounted = os.geteuid() == 0 and shutil.which("mount") and subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(mount_point)], capture_output=True).returncode == 0
    if not mounted:
        pytest.skip("needs a tmpfs of its own (root, with mount allowed); test_a_full_disk_while_saving_... fakes it")
    yield mount_point
    subprocess.run(["umount", "-l", str(mount_point)], capture_output=True)


def _fill(folder: Path) -> None:
    """Write zeros into ``folder`` until its file system is full."""
    with open(folder / "filler", "wb") as fh:
        try:
            while True:
                fh.write(bytes(1 << 20))
                fh.flush()
        except OSError as err:
            assert err.errno == errno.ENOSPC


def _lines_after_bars(err: str) -> list[str]:
    """Each error line, also one printed right after a progress bar's (on the same line)."""
    return ["accel_ddp: error:" + part.splitlines()[0] for part in err.split("accel_ddp: error:")[1:]]


def _full_disk_line(err: str, out: Path, step: int, intact: int) -> str:
    (line,) = _lines_after_bars(err)
    assert line.startswith(f"accel_ddp: error: cannot save the checkpoint of step {step} in {out / 'checkpoints'}: "
                           "the file system is full (")
    assert line.endswith("free space there (a lower --keep_last keeps fewer checkpoints) or give another "
                         "--output_dir, then resume with --resume_from_checkpoint auto "
                         f"(step_{intact:08d}, the last checkpoint, is intact)")
    assert "Traceback" not in err
    return line


def test_a_full_disk_while_saving_a_checkpoint_is_one_line_and_the_resume_loses_nothing(small_disk, thirty_steps,
                                                                                       capfd):
    """A real full file system: torch.save into it raised 'RuntimeError: [enforce fail at inline_container.cc:672]
    . unexpected pos' (its errno lost in C++), a traceback on the main process while the other rank waited."""
    from accel_ddp.checkpoint.manager import CheckpointManager

    out = small_disk / "run"
    save = CheckpointManager.save

    def fill_then_save(self, step):
        if step == 10 and self.accelerator.is_main_process:
            _fill(small_disk)  # something else filled the disk since the checkpoint of step 5
        return save(self, step)

    def run() -> int:
        CheckpointManager.save = fill_then_save
        return main([*ARGS, "--max_steps", "30", "--output_dir", str(out)])

    capfd.readouterr()
    assert run_ranks(run) == [2, 2]
    _full_disk_line(capfd.readouterr().err, out, step=10, intact=5)
    assert steps_of(out) == [5] and read_checkpoint(str(ckpt(out, 5)))["step"] == 5
    assert sorted(os.listdir(out / "checkpoints")) == ["step_00000005"]  # the unsealed folder is gone
    assert not (out / "summary.json").exists()
    (small_disk / "filler").unlink()  # space freed: the same command, resumed, ends as the uninterrupted run
    assert main_ranks([*ARGS, "--max_steps", "30", "--output_dir", str(out), "--resume_from_checkpoint", "auto"]) \
        == [0, 0]
    assert_same_weights(out, thirty_steps)


def _statvfs_full(real):
    """os.statvfs reporting no free block: what a full file system reports."""
    def statvfs(path):
        stats = real(path)
        return os.statvfs_result((stats.f_bsize, stats.f_frsize, stats.f_blocks, 0, 0, *tuple(stats)[5:]))
    return statvfs


@pytest.mark.parametrize("rank", [0, 1])
def test_a_full_disk_while_saving_a_checkpoint_is_one_line_on_every_rank_faked(tmp_path, capfd, rank):
    """Without a tmpfs: torch.save on ``rank`` (the main process's optimizer.bin, or rank 1's RNG file) writes half
    its file and raises what torch raises on a full disk, and the file system reports no free block."""
    out = tmp_path / "run"

    def run() -> int:
        real_save = torch.save

        def save_into_a_full_disk(obj, f, *args, **kwargs):
            if "step_00000010" in str(f) and int(os.environ.get("RANK", "0")) == rank:
                real_save(obj, f, *args, **kwargs)
                Path(f).write_bytes(Path(f).read_bytes()[:100])
                os.statvfs = _statvfs_full(os.statvfs)
                raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 133696 vs 133588")
            return real_save(obj, f, *args, **kwargs)

        torch.save = save_into_a_full_disk
        return main([*ARGS, "--max_steps", "30", "--output_dir", str(out)])

    capfd.readouterr()
    assert run_ranks(run) == [2, 2]
    assert "(0 bytes free there)" in _full_disk_line(capfd.readouterr().err, out, step=10, intact=5)
    assert sorted(os.listdir(out / "checkpoints")) == ["step_00000005"]
    read_checkpoint(str(ckpt(out, 5)))
    assert not (out / "summary.json").exists() and not (out / "model.safetensors").exists()


@pytest.mark.parametrize("what", ["model.safetensors", "summary.json", "metrics.jsonl"])
def test_a_full_disk_while_writing_the_runs_files_is_one_line_and_the_checkpoints_stay(tmp_path, capfd, what):
    """safetensors raises SafetensorError('... No space left on device (os error 28)'), Python's writes OSError
    ENOSPC: each was a traceback. The checkpoints stay as saved, and no half-written file is left."""
    from safetensors import SafetensorError

    out = tmp_path / "run"

    def run() -> int:
        import accel_ddp.checkpoint.weights
        import accel_ddp.tracking.recorder

        if what == "model.safetensors":
            def save_file(tensors, path, metadata=None):
                Path(path).write_bytes(b"half a file")
                raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
            accel_ddp.checkpoint.weights.save_file = save_file
        elif what == "summary.json":
            write = accel_ddp.tracking.recorder.atomic_write_text

            def atomic_write_text(path, text):
                if path.endswith("summary.json"):
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                return write(path, text)
            accel_ddp.tracking.recorder.atomic_write_text = atomic_write_text
        else:  # the line of step 24, mid-run, on the main process
            log = RunRecorder.log

            def full_at_24(self, record):
                if record.get("step") == 24 and self.enabled and self._metrics is not None:
                    self._metrics.close()
                    self._metrics = open("/dev/full", "w", encoding="utf-8")  # every write: ENOSPC
                return log(self, record)
            RunRecorder.log = full_at_24
        code = main([*ARGS, "--max_steps", "25", "--output_dir", str(out)])  # past step 24 (its metrics line fails)
        (tmp_path / f"exit{os.environ['RANK']}").write_text(str(code))
        return code

    capfd.readouterr()
    # metrics.jsonl: only the main process meets the write; it reports, and the other rank, which learns of it at
    # its next collective, exits quietly with the same code (accel_ddp.lifecycle.failure).
    assert run_ranks(run) == [2, 2]
    err = capfd.readouterr().err
    (line,) = _lines_after_bars(err)
    assert line.startswith(f"accel_ddp: error: cannot write {what} in {out}: the file system is full (")
    assert line.endswith("; free space there or give another --output_dir (a copy of this one), then resume with "
                         "--resume_from_checkpoint auto: it continues from the last checkpoint")
    assert steps_of(out) == ([5, 10, 15, 20] if what == "metrics.jsonl" else [5, 10, 15, 20, 25])
    for step in steps_of(out):
        read_checkpoint(str(ckpt(out, step)))
    assert not list(out.glob("*.tmp*")) and not (out / "summary.json").exists()
    assert (out / "model.safetensors").exists() == (what == "summary.json")


# ----------------------------------------------------------------------------- 7. hyperparameters on resume


def test_changed_hyperparameters_on_resume_warn_once_and_are_in_force(stopped_at_20, tmp_path, capfd):
    out = copy_run(stopped_at_20, tmp_path)
    capfd.readouterr()
    assert main_ranks([*ARGS, "--max_steps", "30", "--output_dir", str(out), "--resume_from_checkpoint", "auto",
                       "--lr", "0.01", "--weight_decay", "0.1", "--max_grad_norm", "0.5", "--lr_schedule", "linear",
                       "--optimizer_kwargs", '{"betas": [0.8, 0.99]}']) == [0, 0]
    warnings = [line for line in capfd.readouterr().err.splitlines() if "other hyperparameters" in line]
    assert len(warnings) == 1, warnings
    assert ("(lr 0.003 -> 0.01, lr_schedule constant -> linear, weight_decay 0.0 -> 0.1, max_grad_norm 1.0 -> 0.5, "
            'optimizer_kwargs None -> {"betas": [0.8, 0.99]}): this run\'s values are in force from step 20 on'
            ) in warnings[0]
    config = yaml.safe_load((out / "config.yaml").read_text())
    assert (config["lr"], config["weight_decay"], config["max_grad_norm"], config["lr_schedule"]) == \
        (0.01, 0.1, 0.5, "linear")
    # The LR the optimizer really used after the resume: the new peak on the new schedule (linear to 0 at 30).
    lrs = {r["step"]: r["lr"] for r in read_metrics(out) if "lr" in r}
    assert lrs[16] == pytest.approx(0.003) and lrs[24] == pytest.approx(0.01 * (1 - 24 / 30))
    meta = read_checkpoint(str(ckpt(out, 25)))  # what a checkpoint records
    assert (meta["lr"], meta["weight_decay"], meta["max_grad_norm"], meta["lr_schedule"]) == (0.01, 0.1, 0.5, "linear")
    optimizer = torch.load(ckpt(out, 25) / "optimizer.bin", weights_only=True)
    assert optimizer["param_groups"][0]["weight_decay"] == 0.1 and optimizer["param_groups"][0]["betas"] == (0.8, 0.99)
    assert optimizer["param_groups"][0]["lr"] == pytest.approx(0.01 * (1 - 25 / 30))
    assert read_checkpoint(str(ckpt(out, 20)))["lr"] == 0.003  # the checkpoint resumed from is left as it was
