"""Issue 40: bad flags and a bad recipe are refused before torch is imported (accel_ddp/cli/train.py ``main``,
accel_ddp/lifecycle/refusal.py ``refuse_options``): one line, exit 2, torch not loaded; under torchrun rank 0 speaks
and the other ranks, stopped by the launcher's SIGTERM, exit 2 silently with the reason in their error file.

How soon the line comes is measured, not asserted (docs/launch.md): a test checks what makes it soon, that torch is
not in ``sys.modules`` when the line is out."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import pytest

from tests.helpers.files import wait_for_file
from tests.helpers.runs import REPO, run_python, suite_env

LINE = "accel_ddp: error: --lr must be a finite number, got nan; give a finite number, e.g. --lr 0.003\n"
# main() as train.py runs it, then whether torch (or Accelerate) was imported by then
PROBE = ("import sys\nfrom accel_ddp.cli.train import main\ncode = main({argv!r})\n"
         "print(code, 'torch' in sys.modules, 'accelerate' in sys.modules)")


@pytest.mark.parametrize("argv", [["--lr", "nan"], ["--epochs", "-1"], ["--overwrite_output_dir"],
                                  ["--learning_rte", "1"], ["--config", "missing.yaml"]])
def test_bad_options_are_one_line_and_exit_2_before_torch(argv):
    result = run_python(PROBE.format(argv=argv))
    assert result.stdout == "2 False False\n", result.stderr
    assert result.stderr.startswith("accel_ddp: error: ") and result.stderr.count("\n") == 1, result.stderr


def test_a_bad_recipe_is_refused_before_torch(tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("lr: [1, 2\n")
    result = run_python(PROBE.format(argv=["--config", str(recipe)]))
    assert result.stdout == "2 False False\n"
    assert result.stderr == f"accel_ddp: error: --config {recipe}: not valid YAML at line 2; fix the file's syntax\n"


def test_train_py_exits_2_with_the_line():
    result = subprocess.run([sys.executable, "train.py", "--lr", "nan"], env=suite_env(), capture_output=True,
                            text=True, timeout=60, cwd=REPO)
    assert (result.returncode, result.stderr, result.stdout) == (2, LINE, "")


def _torchrun_env(tmp_path, rank: int) -> dict[str, str]:
    """What torchrun gives worker ``rank`` of two on one machine (the error files' layout of torch's elastic agent)."""
    return {"TORCHELASTIC_RUN_ID": "test", "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
            "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1",
            "TORCHELASTIC_ERROR_FILE": str(tmp_path / "attempt_0" / str(rank) / "error.json")}


def _error_file(tmp_path, rank: int) -> dict:
    return json.loads((tmp_path / "attempt_0" / str(rank) / "error.json").read_text())["message"]


def _started(tmp_path, rank: int) -> subprocess.Popen:
    (tmp_path / "attempt_0" / str(rank)).mkdir(parents=True, exist_ok=True)
    return subprocess.Popen([sys.executable, "train.py", "--lr", "nan"], env=suite_env(_torchrun_env(tmp_path, rank)),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)


def _wait_for(path, timeout: float = 30) -> None:
    assert wait_for_file(path, timeout), f"{path} never written"


def test_under_torchrun_rank_0_prints_and_another_rank_stopped_by_the_launcher_is_silent(tmp_path):
    """The launcher SIGTERMs the other ranks once rank 0 exited: they exit 2 (not killed), print nothing, and their
    error file says why; rank 0 left only after its machine's other rank had written its file (so the SIGTERM
    could not kill it mid-import)."""
    other = _started(tmp_path, 1)
    _wait_for(tmp_path / "attempt_0" / "1" / "error.json")
    first = _started(tmp_path, 0)
    out, err = first.communicate(timeout=60)
    assert (first.returncode, err, out) == (2, LINE, "")
    assert _error_file(tmp_path, 0)["message"] == "ConfigError: " + LINE.strip().removeprefix("accel_ddp: error: ")
    assert other.poll() is None  # still waiting for the launcher
    other.send_signal(signal.SIGTERM)
    out, err = other.communicate(timeout=60)
    assert (other.returncode, err, out) == (2, "", "")
    assert _error_file(tmp_path, 1)["message"].startswith("stopped because rank 0 failed: ConfigError: --lr must be")


def test_under_torchrun_a_sigterm_just_before_rank_0_prints_does_not_lose_the_line(tmp_path):
    """The launcher's SIGTERM (another rank exited first) reaches rank 0 as it is about to print: the line still
    comes, then rank 0 exits 2 (here rank 0 sends it to itself, inside ``print_report``)."""
    (tmp_path / "attempt_0" / "0").mkdir(parents=True)
    code = ("import os, signal, sys\nimport accel_ddp.lifecycle.failure as failure\nreal = failure.print_report\n"
            "failure.print_report = lambda text: (os.kill(os.getpid(), signal.SIGTERM), real(text))\n"
            + PROBE.format(argv=["--lr", "nan"]))
    result = run_python(code, env={**_torchrun_env(tmp_path, 0), "LOCAL_WORLD_SIZE": "1"})
    assert (result.stdout, result.stderr) == ("2 False False\n", LINE)
