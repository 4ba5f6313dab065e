"""--hang_timeout: a hung run names the stuck rank and its line of code, before --ddp_timeout (lifecycle/hang.py).

Two forked gloo ranks with --hang_timeout 2 and --ddp_timeout 60: the watch, not gloo's timeout, ends the run, with
one line naming rank 1 and its frame in this module, every rank's stacks in OUTPUT_DIR/hang/ and exit code 124.
2 s, the time each hang is waited out, is far above these runs' healthy steps: at most 0.25 s between two steps (0.4
s after a save, which is allowed twice --hang_timeout) with the 2-core machine at a load average of 10 to 16.
"""

from __future__ import annotations

import itertools
import os
import re
import signal
import time

import pytest
import torch

from accel_ddp.lifecycle.exit_codes import ExitCode
from accel_ddp.lifecycle.hang_stacks import Frame, hang_line, stuck_ranks, summarize, user_frame, waits_in
from tests.helpers.data import TensorRows
from tests.helpers.multiproc import RankFailed, run_ranks
from tests.helpers.runs import main_ranks, read_summary

HANG = ["--hang_timeout", "2", "--ddp_timeout", "60"]
_calls = itertools.count()  # a user function's calls on this rank (each forked rank has its own)


def sleepy_loss(outputs, batch):
    """A user loss that blocks on rank 1 at its 7th call (a few optimizer steps in, after a save)."""
    if os.environ.get("RANK") == "1" and next(_calls) == 6:
        time.sleep(3600)  # the line the report must name
    return torch.nn.functional.cross_entropy(outputs, batch[1])


def spinning_loss(outputs, batch):
    """A user loss that loops in Python forever on rank 1 at its 7th call: the main thread keeps the GIL but for the
    interpreter's switches, at which the watch's thread runs."""
    if os.environ.get("RANK") == "1" and next(_calls) == 6:
        while True:  # the loop the report must name (its jump back is where the thread stands)
            pass
    return torch.nn.functional.cross_entropy(outputs, batch[1])


class OneRankCollective:
    """A user metric whose update runs a collective on rank 1 only (the others never enter it), after the start-up
    probe's call."""

    def update(self, outputs, batch):
        if os.environ.get("RANK") == "1" and next(_calls) == 2:
            torch.distributed.barrier()  # the line the report must name

    def compute(self):
        return {"never": 0.0}


class SleepyRows(TensorRows):
    """A dataset whose reads block in rank 1's DataLoader worker after its first 48 samples."""

    def __getitem__(self, index: int):
        if os.environ.get("RANK") == "1" and next(_calls) == 48:
            time.sleep(3600)  # the read that the report must name
        return super().__getitem__(index)


def sleepy_rows(data_dir, download):
    from accel_ddp.data import DatasetBundle

    generator = torch.Generator().manual_seed(0)
    x, y = torch.randn(256, 6, generator=generator), torch.randint(0, 2, (256,), generator=generator)
    return DatasetBundle(SleepyRows(x, y), TensorRows(x[:32], y[:32]), 2, (6,))


def _line_of(pattern: str) -> int:
    """The line number of ``pattern``'s first line in this module."""
    with open(__file__) as source:
        return next(number for number, row in enumerate(source, 1) if pattern in row)


def hung(fn, capfd) -> tuple[str, float]:
    """``fn`` on two forked ranks that must both end with ExitCode.HUNG: the report's line and the seconds it took."""
    capfd.readouterr()
    started = time.monotonic()
    with pytest.raises(RankFailed) as failed:
        run_ranks(fn, world_size=2, timeout=90)
    seconds = time.monotonic() - started
    assert failed.value.failures == {rank: f"exited with code {ExitCode.HUNG} without a result" for rank in (0, 1)}, \
        failed.value
    err = capfd.readouterr().err
    assert "Traceback" not in err, err[-3000:]
    lines = [row for row in err.splitlines() if "accel_ddp: error:" in row]
    assert len(lines) == 1, err[-3000:]
    return lines[0], seconds


def _cli(args: list[str]):
    from accel_ddp.cli.train import main

    return lambda: main(args)


@pytest.mark.parametrize("loss", ["sleepy_loss", pytest.param("spinning_loss", marks=pytest.mark.slow)])
def test_a_loss_that_blocks_on_rank_1_is_named_with_its_line(tmp_path, capfd, tiny_args, loss):
    """The loss sleeps (or loops in Python) on rank 1 after a checkpoint: one line names rank 1 at this module's line,
    rank 0 waits in the backward pass (DDP's all-reduce); both stacks are written; the checkpoints stay and auto
    resumes from the last one."""
    out = tmp_path / "run"
    line, seconds = hung(_cli([*tiny_args, *HANG, "--loss", f"{__name__}:{loss}", "--checkpointing_steps", "2",
                               "--output_dir", str(out)]), capfd)
    mark = "time.sleep(3600)  # the line" if loss == "sleepy_loss" else "while True:  # the loop"
    where = f"tests/lifecycle/test_hang.py:{_line_of(mark)} in {loss}"
    assert re.search(rf"rank 1 is stuck at {re.escape(where)} \(after optimizer step [2-6]\)", line), line
    assert "rank 0 waiting in backward" in line and f"stacks in {out / 'hang'}" in line, line
    assert sorted(os.listdir(out / "hang")) == ["rank0.txt", "rank1.txt"]
    assert f"in {loss}" in (out / "hang" / "rank1.txt").read_text()
    assert seconds < 60  # the watch, not --ddp_timeout's 60 s
    saved = sorted(os.listdir(out / "checkpoints"))
    assert saved and saved[-1] == "step_00000004", saved  # steps 2 and 4 were saved before the hang at step 5
    resumed = [*tiny_args, "--checkpointing_steps", "2", "--resume_from_checkpoint", "auto", "--output_dir", str(out)]
    assert main_ranks(resumed, 2) == [0, 0]  # the loss that hung left out: the run continues from step 4
    assert read_summary(out)["resumed_from_step"] == 4


@pytest.mark.slow  # a wait for the watch by design, as test_a_loss_that_blocks... shows it
def test_a_metric_that_runs_a_collective_on_one_rank_only_is_named(tmp_path, capfd, tiny_args):
    """A user metric's barrier on rank 1 only, during the evaluation (twice --hang_timeout for it): rank 1 is named at
    the barrier's line, in barrier, which the others did not call."""
    from accel_ddp.cli.args import parse_args
    from accel_ddp.loop import train

    cfg = parse_args([*tiny_args, *HANG, "--eval_every", "2", "--output_dir", str(tmp_path / "run")])
    line, _ = hung(lambda: train(cfg, metrics=[OneRankCollective()]), capfd)
    where = f"tests/lifecycle/test_hang.py:{_line_of('torch.distributed.barrier()  # the line')} in update"
    assert f"rank 1 is stuck at {where}, in barrier, which the other ranks did not call" in line, line


@pytest.mark.slow  # a wait for the watch by design, as test_a_loss_that_blocks... shows it
def test_a_dataloader_worker_that_blocks_is_named_with_its_line(tmp_path, capfd):
    """Rank 1's DataLoader worker blocks in the dataset's __getitem__: the line names it there, in the worker."""
    out = tmp_path / "run"
    line, _ = hung(_cli(["--dataset", f"{__name__}:sleepy_rows", "--loader", "dataloader", "--num_workers", "1",
                         "--hidden_size", "8", "--global_batch_size", "16", "--epochs", "2", *HANG,
                         "--output_dir", str(out)]), capfd)
    where = f"tests/lifecycle/test_hang.py:{_line_of('time.sleep(3600)  # the read')} in __getitem__"
    assert re.search(rf"rank 1 is stuck at {re.escape(where)}, in its DataLoader worker pid \d+ \(after optimizer "
                     r"step \d+\); rank 0 waiting in backward", line), line
    assert "DataLoader worker" in (out / "hang" / "rank1.txt").read_text()


@pytest.mark.slow  # a wait for the watch by design, as test_a_loss_that_blocks... shows it
def test_a_stopped_rank_is_named_no_stack(tmp_path, capfd, tiny_args, monkeypatch):
    """Rank 1 stopped with SIGSTOP after step 3: rank 0 names it "no stack: stopped or dead" after the grace, waits
    in backward itself, and exits 124; rank 1 is SIGKILLed then, as the launcher would."""
    from torch.optim.optimizer import register_optimizer_step_post_hook

    import accel_ddp.lifecycle.hang as hang
    from accel_ddp.cli.train import main

    monkeypatch.setattr(hang, "GRACE_S", 0.1)  # rank 1, stopped, never posts: the whole grace is waited (twice)
    args = [*tiny_args, *HANG, "--output_dir", str(tmp_path / "run")]
    pid_file = tmp_path / "rank1.pid"

    def rank_main() -> int:
        if os.environ["RANK"] == "1":
            steps = itertools.count(1)
            pid_file.write_text(str(os.getpid()))

            def after_step(*_):
                if next(steps) == 3:
                    os.kill(os.getpid(), signal.SIGSTOP)

            register_optimizer_step_post_hook(after_step)
        else:
            real_exit = os._exit

            def exit_killing_rank_1(code):
                os.kill(int(pid_file.read_text()), signal.SIGKILL)
                real_exit(code)

            monkeypatch.setattr(os, "_exit", exit_killing_rank_1)
        return main(args)

    capfd.readouterr()
    with pytest.raises(RankFailed) as failed:
        run_ranks(rank_main, world_size=2, timeout=90)
    assert failed.value.failures[0] == f"exited with code {ExitCode.HUNG} without a result", failed.value
    line = [row for row in capfd.readouterr().err.splitlines() if "accel_ddp: error:" in row]
    assert len(line) == 1 and "rank 1: no stack: stopped or dead" in line[0], line
    assert "rank 0 waiting in " in line[0], line


# ---- the stacks' reading, on faulthandler's text


def _dump(*threads: tuple[int, list[tuple[str, int, str]]]) -> str:
    rows = ["=== rank 1 (pid 7 on host): no optimizer step for 3.0 s after step 2"]
    for ident, frames in threads:
        rows.append(f"Thread 0x{ident:016x} (most recent call first):")
        rows += [f'  File "{file}", line {line} in {name}' for file, line, name in frames]
        rows.append("")
    return "\n".join(rows)


def test_the_user_frame_is_the_innermost_outside_libraries_and_inside_the_package_calls():
    import threading as stdlib_threading

    import accel_ddp

    package = os.path.dirname(accel_ddp.__file__)
    torch_dir = os.path.dirname(torch.__file__)
    frames = [Frame(f"{torch_dir}/distributed/distributed_c10d.py", "10", "all_reduce"),
              Frame(f"{torch_dir}/distributed/c10d_logger.py", "5", "wrapper"),
              Frame("/home/me/my_loss.py", "14", "loss"),
              Frame(f"{package}/tasks/user_code.py", "40", "__call__"),
              Frame("/home/me/train.py", "3", "<module>")]
    assert user_frame(frames) == frames[2] and waits_in(frames) == "all_reduce"
    assert user_frame(frames[3:]) is None  # a script calling the package is not where it hangs
    assert user_frame([Frame(stdlib_threading.__file__, "1", "wait"), *frames[3:]]) is None
    text = _dump((1, [(f"{torch_dir}/autograd/graph.py", 8, "_engine_run_backward"),
                      (f"{package}/step/train_step.py", 3, "micro_step")]),
                 (2, [("/home/me/my_loss.py", 14, "loss")]))  # another thread's user frame does not count
    assert summarize(text, 1) == {"where": None, "wait": "backward", "inner": f"{torch_dir}/autograd/graph.py:8 in "
                                  "_engine_run_backward", "worker": None}


def test_who_is_stuck():
    waiting = {"step": 3, "where": None, "wait": "backward"}
    assert stuck_ranks({0: waiting, 1: {"step": 3, "where": "a.py:1 in f", "wait": None}}) == [1]
    assert stuck_ranks({0: waiting, 1: {"step": 3, "where": "a.py:1 in f", "wait": "barrier"}}) == [1]
    assert stuck_ranks({0: waiting, 1: {"step": 2, "where": None, "wait": "all_reduce"}}) == [1]  # behind
    assert stuck_ranks({0: waiting, 1: waiting}) == []
    line = hang_line({0: {**waiting, "inner": None, "worker": None}}, 2, 3, "out/hang")
    assert line.startswith("rank 0 waiting in backward (DDP's gradient all-reduce); rank 1: no stack: stopped or "
                           "dead"), line
    line = hang_line({0: {**waiting, "inner": None, "worker": None}, 1: {**waiting, "inner": None, "worker": None}},
                     2, 3, "out/hang")
    assert line.startswith("no rank stands out; ranks 0, 1 waiting in backward"), line


def test_a_hang_timeout_not_below_the_ddp_timeout_is_refused():
    from accel_ddp.cli.args import parse_args
    from accel_ddp.util.validation import ConfigError

    with pytest.raises(ConfigError, match=r"--hang_timeout 60 s is not less than --ddp_timeout 60 s"):
        parse_args(["--hang_timeout", "60", "--ddp_timeout", "60"])
    assert parse_args([]).hang_seconds() == 600
    assert parse_args(["--ddp_timeout", "600"]).hang_seconds() == 0  # off: the collective's timeout comes first
    assert parse_args(["--hang_timeout", "0"]).hang_seconds() == 0


@pytest.mark.slow
def test_two_launchers_on_loopback_give_the_same_line(tmp_path, tiny_args):
    """Two `accelerate launch --num_machines 2` on 127.0.0.1, one rank each: the ranks meet on torchrun's store, not
    on a shared process, and machine 0's launcher shows the same line as the forked ranks' (rank 1's frame, sent
    from the other machine)."""
    from tests.helpers.runs import launch_machines

    out = tmp_path / "run"
    codes, logs = launch_machines([*tiny_args, *HANG, "--loss", f"{__name__}:sleepy_loss", "--output_dir", str(out)],
                                  2, tmp_path, timeout=240)
    assert codes == [1, 1], logs  # accelerate launch exits 1 when a worker failed; the worker's 124 is in its log
    lines = [row for row in logs[0].splitlines() if row.startswith("accel_ddp: error:")]
    where = f"tests/lifecycle/test_hang.py:{_line_of('time.sleep(3600)  # the line')} in sleepy_loss"
    assert len(lines) == 1 and f"rank 1 is stuck at {where} (after optimizer step" in lines[0], logs
    assert "rank 0 waiting in backward" in lines[0], lines
    assert "exitcode  : 124" in logs[0], logs[0][-3000:]
    assert sorted(os.listdir(out / "hang")) == ["rank0.txt", "rank1.txt"]


def test_the_flight_recorder_is_switched_on_where_the_user_has_not(tmp_path, monkeypatch):
    """GPU runs (set before the process group forms, in distributed/world.py): NCCL's flight recorder on, its dump
    under OUTPUT_DIR/hang/; a variable the user set is left as it is; nothing with the watch off."""
    from accel_ddp.lifecycle.hang import flight_recorder_env

    for name in ("TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_NCCL_DUMP_ON_TIMEOUT", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"):
        monkeypatch.setenv(name, "")  # recorded as it was: the function's values are undone after the test
        monkeypatch.delenv(name)
    flight_recorder_env(str(tmp_path / "run"), 0)
    assert "TORCH_NCCL_TRACE_BUFFER_SIZE" not in os.environ
    monkeypatch.setenv("TORCH_NCCL_TRACE_BUFFER_SIZE", "50")
    flight_recorder_env(str(tmp_path / "run"), 600)
    assert os.environ["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "50" and os.environ["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert os.environ["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == str(tmp_path / "run" / "hang" / "nccl_trace_rank_")
