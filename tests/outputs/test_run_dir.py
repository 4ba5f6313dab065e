"""The run folder (accel_ddp/outputs/run_dir.py): one run per folder (the lock), bad output folders."""

from __future__ import annotations

import fcntl
import multiprocessing
import os
import signal
import time
from pathlib import Path

import pytest

from accel_ddp.cli.train import main
from accel_ddp.outputs.run_dir import OutputLock
from tests.helpers import faults
from tests.helpers.checkpoints import steps_of
from tests.helpers.files import CHECKPOINTED_ARGS as ARGS
from tests.helpers.files import as_unprivileged, chown_tree, error_lines, wait_for_file
from tests.helpers.multiproc import RankFailed, run_ranks
from tests.helpers.runs import main_ranks, read_metrics, read_summary

# ----------------------------------------------------------------------------- 3. one run per folder


def test_a_folder_locked_by_another_process_is_exit_2_on_every_rank_and_nothing_is_written(tmp_path, capfd):
    out = tmp_path / "run"
    out.mkdir()
    with open(out / ".lock", "w") as held:
        fcntl.lockf(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        capfd.readouterr()
        assert main_ranks([*ARGS, "--max_steps", "4", "--output_dir", str(out)]) == [2, 2]
    (line,) = error_lines(capfd.readouterr().err)
    assert f"--output_dir {out} is in use by another run" in line and "give another --output_dir" in line
    assert sorted(os.listdir(out)) == [".lock"]
    assert (out / ".lock").read_bytes() == b""


def test_two_runs_started_together_into_one_folder(tmp_path, capfd):
    out, refused = tmp_path / "run", tmp_path / "refused"
    together = multiprocessing.get_context("fork").Barrier(2)

    def standalone_run() -> int:  # each forked "rank" becomes an independent 1-process run
        from torch.optim.optimizer import register_optimizer_step_post_hook

        for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            os.environ.pop(name, None)
        register_optimizer_step_post_hook(_wait_for(refused))  # the winner is still training when the loser looks
        together.wait(timeout=60)
        code = main([*ARGS, "--max_steps", "16", "--output_dir", str(out)])
        if code == 2:
            refused.touch()
        return code

    capfd.readouterr()
    assert sorted(run_ranks(standalone_run, world_size=2)) == [0, 2]
    err = capfd.readouterr().err  # two independent runs share it: the winner's progress bar may precede the line
    assert err.count("accel_ddp: error: ") == 1 and f"--output_dir {out} is in use by another run" in err
    records = [r for r in read_metrics(out) if "loss" in r]
    assert [r["step"] for r in records] == [4, 8, 12, 16]  # one run's metrics, not two interleaved
    assert read_summary(out)["optimizer_steps"] == 16 and steps_of(out) == [5, 10, 15]


def _wait_for(path: Path):
    """An optimizer step hook: after its first step, the run waits until ``path`` exists (30 s at most: two runs that
    both train, a broken lock, end instead of hanging, and fail the test)."""
    waited = [False]

    def hook(*_) -> None:
        if not waited[0]:
            wait_for_file(path, 30)
        waited[0] = True

    return hook


def test_the_lock_is_the_main_process_own_not_its_forked_workers(tmp_path):
    """A crashed run's DataLoader workers (forked children) may outlive it by seconds: they must not hold the lock."""
    out = tmp_path / "run"
    worker_done = tmp_path / "worker_done"

    def lock_fork_a_worker_and_exit():
        OutputLock(str(out)).acquire()
        if os.fork() == 0:  # the "worker": lives on after its parent
            time.sleep(3)
            worker_done.touch()
            os._exit(0)
        return "parent gone"

    assert run_ranks(lock_fork_a_worker_and_exit, world_size=1) == ["parent gone"]
    lock = OutputLock(str(out))
    lock.acquire()  # free at once, while the worker still lives (an flock would be shared with it: refused)
    lock.release()
    assert not worker_done.exists()


def test_the_lock_goes_when_its_process_is_killed(tmp_path):
    out = tmp_path / "run"

    def lock_then_die():
        OutputLock(str(out)).acquire()
        os.kill(os.getpid(), signal.SIGKILL)

    with pytest.raises(RankFailed):
        run_ranks(lock_then_die, world_size=1)
    assert (out / ".lock").exists()
    assert main_ranks([*ARGS, "--max_steps", "4", "--output_dir", str(out)], world_size=1) == [0]


# ----------------------------------------------------------------------------- 4. output folders


@pytest.mark.parametrize("case", ["a file", "under a file", "/proc", "read-only"])
def test_a_bad_output_dir_is_one_line_and_exit_2_before_training(open_dir, capfd, case):
    blocker = open_dir / "a_file"
    blocker.write_text("keep me")
    out, message = {
        "a file": (blocker, f"--output_dir {blocker} is a file, not a folder"),
        "under a file": (blocker / "run", f"--output_dir {blocker / 'run'}: part of that path is a file"),
        "/proc": (Path("/proc/accel_ddp_run"), "--output_dir /proc/accel_ddp_run: cannot create"),
        "read-only": (open_dir / "ro" / "run", f"--output_dir {open_dir / 'ro' / 'run'}: cannot create or write it "
                                                f"({open_dir / 'ro'} is not writable)"),
    }[case]
    (open_dir / "ro").mkdir(mode=0o555)
    chown_tree(open_dir / "ro")

    def run() -> int:
        as_unprivileged()
        faults.install(fail_at=(1, 0))  # had training started, this would be a traceback and exit 1
        return main([*ARGS, "--max_steps", "4", "--output_dir", str(out)])

    capfd.readouterr()
    assert run_ranks(run, world_size=1) == [2]
    err = capfd.readouterr().err
    (line,) = error_lines(err)
    assert message in line and "Traceback" not in err
    assert blocker.read_text() == "keep me" and os.listdir(open_dir / "ro") == []


@pytest.mark.parametrize("name, kind, resume", [("checkpoints", "a file", False), ("checkpoints", "a file", True),
                                                ("metrics.jsonl", "a folder", False),
                                                ("model.safetensors", "a folder", False)])
def test_a_file_where_the_run_keeps_a_folder_or_the_reverse_is_one_line_before_training(tmp_path, capfd, name, kind,
                                                                                       resume):
    """OUTPUT_DIR/checkpoints as a file was a FileExistsError at the first save, after training (and with auto,
    'no checkpoint in ...; starting from scratch'); a folder named metrics.jsonl an IsADirectoryError."""
    out = tmp_path / "run"
    out.mkdir()
    blocker = out / name
    blocker.write_text("keep me") if kind == "a file" else blocker.mkdir()
    capfd.readouterr()

    def run() -> int:
        faults.install(fail_at=(1, 0))  # had training started, this would be a traceback and exit 1
        return main([*ARGS, "--max_steps", "4", "--output_dir", str(out),
                     *(["--resume_from_checkpoint", "auto"] if resume else [])])

    assert run_ranks(run) == [2, 2]
    err = capfd.readouterr().err
    (line,) = error_lines(err)
    other = "a folder" if kind == "a file" else "a file"
    assert line == (f"accel_ddp: error: --output_dir {out}: {blocker} is {kind}, not {other} (the run writes {name} "
                    "there); move it out of the way, or give another --output_dir")
    assert "Traceback" not in err and sorted(os.listdir(out)) == [name]


def test_output_dir_from_yaml_must_be_text_and_utf8(tmp_path, capsys):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("output_dir: 123\n")
    assert main(["--config", str(recipe)]) == 2
    assert main(["--output_dir", os.fsdecode(b"/tmp/caf\xe9")]) == 2  # a Latin-1 name
    lines = error_lines(capsys.readouterr().err)
    assert len(lines) == 2 and "--output_dir expects text, got 123 (int)" in lines[0]
    assert "is not valid UTF-8" in lines[1]
