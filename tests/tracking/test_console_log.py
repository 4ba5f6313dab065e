"""Issue 51 item 4: with --logging_steps N (--log_every) given, the main process prints a line per N optimizer steps
(step, epoch, loss, learning rate) above the progress bar, as the Trainer does; run.log holds everything the main
process printed (accel_ddp/tracking/console_log.py): the start-up block, log and evaluation lines, warnings, the
final bar and the interrupt line."""

from __future__ import annotations

import io
import re
import signal
import sys

from accel_ddp.outputs.names import RUN_LOG_NAME
from accel_ddp.tracking.console_log import ConsoleLog
from tests.helpers import faults
from tests.helpers.multiproc import run_ranks
from tests.helpers.runs import main_ranks

LOG_LINE = re.compile(r"^step (\d+) epoch (\d+): loss \d+\.\d{4} lr [\d.e-]+$", re.M)


def test_logging_steps_prints_a_line_per_n_steps_and_run_log_keeps_all_that_was_printed(tmp_path, tiny_args, capfd):
    out = tmp_path / "run"
    args = [*tiny_args, "--logging_steps", "4", "--eval_every", "8", "--seed", "1", "--seed", "3",
            "--output_dir", str(out)]
    assert main_ranks(args) == [0, 0]
    printed = capfd.readouterr()
    # 256 samples / 32 = 8 steps an epoch, 2 epochs; once, from the main process
    assert [(int(s), int(e)) for s, e in LOG_LINE.findall(printed.out)] == [(4, 0), (8, 0), (12, 1), (16, 1)]
    log = (out / RUN_LOG_NAME).read_text()
    assert LOG_LINE.findall(log) == LOG_LINE.findall(printed.out)
    for shown in ("accel_ddp: ***** Running training *****", "  start:            fresh",
                  "step 8 epoch 0: eval_loss", "step 16 epoch 1: eval_loss",
                  "accel_ddp: warning: --seed 1 and --seed 3: --seed is given 2 times"):
        assert shown in log, (shown, log)
    assert re.search(r"^100%\|.*\| 16/16 ", log, re.M), log  # the bar as it ended, not its redraws
    assert "\r" not in log and log.count("16/16") == 1


def test_without_logging_steps_only_the_bar_says_the_loss(tmp_path, tiny_args, capfd):
    assert main_ranks([*tiny_args, "--output_dir", str(tmp_path)], world_size=1) == [0]
    assert not LOG_LINE.search(capfd.readouterr().out)


def test_run_log_ends_with_the_interrupt_line(tmp_path, tiny_args, capfd):
    out = tmp_path / "run"
    args = [*tiny_args, "--output_dir", str(out)]
    assert run_ranks(lambda: faults.main_signalled_after(args, 6, signal.SIGINT), world_size=1) == [130]
    last = (out / RUN_LOG_NAME).read_text().splitlines()[-1]
    assert last.startswith("accel_ddp: interrupted: SIGINT received: stopped after optimizer step "), last
    assert last in capfd.readouterr().err


def test_the_log_keeps_lines_as_shown_and_nothing_before_its_folder_is_known(tmp_path, monkeypatch):
    out, err = io.StringIO(), io.StringIO()
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.setattr(sys, "stderr", err)
    console = ConsoleLog().install()
    print("before the folder is owned")
    sys.stderr.write("\r  3%|▎| 1/30\r  7%|▋| 2/30")  # a bar's redraws
    sys.stderr.write("\r" + " " * 20 + "\r")  # tqdm.write clears the bar's line, then writes its own
    print("step 2 epoch 0: loss 1.0000 lr 0.003")
    console.start(str(tmp_path / "run.log"), append=False)
    sys.stderr.write("\r 10%|█| 3/30\n")  # the bar's last state ends its line
    print("partial", end="")
    console.close()
    assert sys.stdout is out and sys.stderr is err  # the streams as they were
    print("after the run")
    lines = (tmp_path / "run.log").read_text().splitlines()
    assert lines[1:] == ["before the folder is owned", "step 2 epoch 0: loss 1.0000 lr 0.003", " 10%|█| 3/30",
                         "partial"]
    assert out.getvalue().endswith("partial" + "after the run\n")  # the console saw everything, as before


def test_a_log_that_is_never_started_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "stdout", io.StringIO())
    monkeypatch.chdir(tmp_path)
    console = ConsoleLog().install()
    print("refused")
    console.close()
    assert list(tmp_path.iterdir()) == []
