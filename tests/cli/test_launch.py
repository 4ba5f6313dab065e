"""Issue 51 item 1: `accel-ddp launch` (accel_ddp/cli/launch.py) takes `accelerate launch`'s arguments and ends a
failed launch with the failing rank's own line and exit code: no launcher traceback, no ChildFailedError box
(`accelerate launch` prints ~43 lines after the rank's line and exits 1 for the same refusal)."""

from __future__ import annotations

import signal

import pytest

from accel_ddp.cli import launch
from accel_ddp.lifecycle import exit_codes
from tests.helpers.runs import ACCEL_DDP_LAUNCH, log_of, running, wait_for_checkpoint
from tests.helpers.runs import launch as launch_job

LAUNCHER_NOISE = ("Traceback", "ChildFailedError", "FAILED", "Sending process", "exitcode", "error_file")


def test_a_failed_launch_exits_with_the_code_of_the_rank_that_failed_first(capsys):
    # {rank: (exit code, timestamp)} as torchrun's ChildFailedError holds them; every accel_ddp rank exits with the
    # first failing rank's code, a rank the launcher stopped may show -15
    assert launch.failed_rank_code({0: (2, 10), 1: (2, 11)}, {}) == 2
    assert launch.failed_rank_code({1: (-15, 9), 0: (3, 10)}, {}) == 3
    assert launch.failed_rank_code({0: (75, 10), 1: (75, 10)}, {}) == 75  # SIGTERM to the ranks: preempted
    assert capsys.readouterr().err == ""
    # killed without a word (the OOM killer): one line naming it, 128 + the signal as a shell says
    assert launch.failed_rank_code({1: (-9, 10), 0: (-15, 11)}, {}) == 128 + signal.SIGKILL
    assert capsys.readouterr().err == ("accel_ddp: error: rank 1 was killed by SIGKILL (out of memory? the kernel's "
                                       "OOM killer sends SIGKILL)\n")
    assert launch.failed_rank_code({0: (-15, 10)}, {0: 75, 1: 75}) == 75  # stopped, but it said how it ended


def test_the_ranks_recorded_codes_outlast_the_launcher_s_own(tmp_path, monkeypatch):
    monkeypatch.setenv(exit_codes.EXIT_CODES_DIR, str(tmp_path))
    for rank, code in ((1, 75), (0, 75)):
        monkeypatch.setenv("RANK", str(rank))
        exit_codes.record(code)
    (tmp_path / "0.tmp123").write_text("garbage")  # a write mid-rename is no rank's code
    assert exit_codes.recorded(str(tmp_path)) == {0: 75, 1: 75}
    assert launch.ranks_code({0: 0, 1: 130}) == 130 and launch.ranks_code({0: 0, 1: 0}) == 0
    monkeypatch.delenv(exit_codes.EXIT_CODES_DIR)
    exit_codes.record(2)  # not under accel-ddp launch: nothing written, no error
    assert exit_codes.recorded(str(tmp_path)) == {0: 75, 1: 75}


@pytest.mark.slow
def test_a_refusal_is_its_one_line_and_exit_2():
    result = launch_job(["--lr", "-1"], launcher=ACCEL_DDP_LAUNCH)
    out = result.stdout + result.stderr
    assert result.returncode == 2, out
    assert len(out.splitlines()) <= 3 and "accel_ddp: error: --lr must be > 0, got -1.0; try --lr 3e-3\n" in out, out
    assert not any(noise in out for noise in LAUNCHER_NOISE), out


@pytest.mark.slow
def test_sigterm_to_the_launcher_exits_75_once_the_ranks_saved(tmp_path):
    """torchrun stops the ranks and re-raises the signal (Accelerate exits 143): the ranks' own 75 is the code."""
    out = tmp_path / "run"
    args = ["--max_steps", "400", "--checkpointing_steps", "3", "--output_dir", str(out)]
    with running(args, out, env={"FAULT_STEP_DELAY": "0.2"}, launcher=ACCEL_DDP_LAUNCH) as proc:
        wait_for_checkpoint(proc, out, 3)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 75, log_of(out)[-3000:]
    log = log_of(out)
    assert "accel_ddp: preempted: SIGTERM received: stopped after optimizer step" in log, log[-3000:]
    assert not any(noise in log for noise in LAUNCHER_NOISE), log[-3000:]
