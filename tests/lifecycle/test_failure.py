"""Bad input: one clear line, exit code 2, nothing already saved is touched; how a process ends.

Several ranks: exactly one error line per launch whichever rank fails first, and the launcher's
failure summary names each failing rank's real error (accel_ddp/lifecycle/failure.py). Forked ranks show the
election on a TCPStore hosted here, as torchrun hosts it; two launches show what only torchrun does
(it SIGTERMs the others when the first rank exits, and prints the summary).
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from accel_ddp.cli.train import main
from accel_ddp.distributed.world import single_process_trap
from tests.helpers import data as helpers_data
from tests.helpers.files import wait_for_file
from tests.helpers.multiproc import RankFailed, free_port
from tests.helpers.ranks import C10D_UNSHARED, assert_quiet, error_lines, launch_ranks, recorded
from tests.helpers.runs import SCRIPTS, launch_together, main_ranks, run_single

STEPS = ["--epochs", "1", "--global_batch_size", "16"]
BASE = ["--dataset", "synthetic", "--synthetic_samples", "64", "--synthetic_shape", "4", *STEPS]


def _error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.strip()]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--dataset", "imagenet22k"], "unknown dataset 'imagenet22k'; choose one of"),
        (["--model", "gpt5"], "unknown model 'gpt5'; choose one of"),
        (["--model", "no_such_pkg.models:build"], "cannot import module 'no_such_pkg.models'"),
        (["--global_batch_size", "30", "--per_device_batch_size", "4"], "not divisible by world size 1"),
        (["--lr", "-1"], "--lr must be > 0"),
        (["--synthetic_samples", "8"], "fewer than one global batch"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, argv, message):
    base = STEPS if "--dataset" in argv else BASE  # no synthetic sizes beside another dataset: refused
    assert main([*base, *argv, "--output_dir", str(tmp_path)]) == 2
    lines = _error_lines(capsys.readouterr().err)
    assert len(lines) == 1 and message in lines[0], lines
    assert lines[0].startswith("accel_ddp: error: ")


def test_missing_mnist_says_where_it_looked_and_what_to_do(tmp_path, capsys):
    empty = tmp_path / "nothing_here"
    assert main(["--dataset", "mnist", "--data_dir", str(empty), "--output_dir", str(tmp_path / "out")]) == 2
    (line,) = _error_lines(capsys.readouterr().err)
    assert str(empty / "MNIST" / "raw") in line and "--download" in line


@pytest.mark.parametrize("content, message", [("epochs: [1\n", "not valid YAML at line"),
                                              ("epoch: 3\n", "unknown key(s) epoch")])
def test_bad_recipe_is_one_line_and_exit_2(tmp_path, capsys, content, message):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(content)
    assert main(["--config", str(recipe)]) == 2
    (line,) = _error_lines(capsys.readouterr().err)
    assert message in line and "recipe.yaml" in line


def test_unreadable_recipe(tmp_path, capsys):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_bytes(b"\xff\xfe\x00 not text")
    assert main(["--config", str(recipe)]) == 2
    (line,) = _error_lines(capsys.readouterr().err)
    assert "recipe.yaml" in line


def test_a_bad_rerun_leaves_the_previous_results_alone(tmp_path, capsys):
    saved = {"config.yaml": "lr: 0.1\n", "metrics.jsonl": '{"step": 1}\n', "summary.json": "{}\n"}
    for name, text in saved.items():
        (tmp_path / name).write_text(text)
    assert main([*STEPS, "--dataset", "nope", "--output_dir", str(tmp_path)]) == 2
    for name, text in saved.items():
        assert (tmp_path / name).read_text() == text


@pytest.mark.slow  # a fresh interpreter's exit/start is the behaviour
def test_plain_python_exit_code_and_single_line(tmp_path):
    result = run_single([*BASE, "--model", "gpt5", "--output_dir", str(tmp_path)])
    assert result.returncode == 2
    (line,) = _error_lines(result.stderr)
    assert line.startswith("accel_ddp: error: unknown model 'gpt5'; choose one of") and "mlp" in line


@pytest.mark.slow  # a fresh interpreter's exit/start is the behaviour
def test_unexpected_error_exits_1_with_its_traceback(tmp_path):
    error_file = tmp_path / "error.json"  # what torchrun gives each worker
    result = run_single([*BASE, "--output_dir", str(tmp_path)],
                        env={"FAULT_FAIL_AT_STEP": "2:0", "TORCHELASTIC_ERROR_FILE": str(error_file)})
    assert result.returncode == 1
    assert "Traceback (most recent call last)" in result.stderr
    assert "InjectedFailure: injected failure on rank 0 at step 2" in result.stderr
    assert not (tmp_path / "summary.json").exists()
    recorded = json.loads(error_file.read_text())["message"]  # what the launcher's summary shows
    assert recorded["message"] == "InjectedFailure: injected failure on rank 0 at step 2"
    assert recorded["extraInfo"]["py_callstack"].startswith("Traceback (most recent call last)")
    assert "in _after_step" in recorded["extraInfo"]["py_callstack"]


def test_bad_input_goes_into_the_launchers_error_file_without_a_traceback(tmp_path, capsys, monkeypatch):
    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    assert main([*BASE, "--model", "gpt5", "--output_dir", str(tmp_path)]) == 2
    (line,) = _error_lines(capsys.readouterr().err)
    recorded = json.loads(error_file.read_text())["message"]
    assert recorded["message"] == "ConfigError: " + line.removeprefix("accel_ddp: error: ")
    assert recorded["extraInfo"]["py_callstack"] == recorded["message"]


# ----------------------------------------------------------------------------- one report per launch

TRAINING = ["--dataset", "synthetic", "--synthetic_samples", "4096", "--synthetic_shape", "6", "--global_batch_size",
            "16", "--epochs", "50"]  # far longer than any test waits: a rank that is not stopped hangs the test


@pytest.fixture(params=["static", "c10d"])
def torchrun_env(request, launcher_store) -> dict[str, str]:
    return launcher_store[1] if request.param == "static" else C10D_UNSHARED


def test_two_ranks_report_bad_input_once_without_rank_tracebacks(tmp_path, capfd):
    """Forked ranks, no launcher store: they agree on rank 0's, the group's (a c10d launch that does not share)."""
    assert main_ranks([*STEPS, "--dataset", "imagenet22k", "--output_dir", str(tmp_path)]) == [2, 2]
    err = capfd.readouterr().err
    assert err.count("accel_ddp: error: unknown dataset 'imagenet22k'") == 1
    assert_quiet(err)


def _reports_after_the_other(folder, late: int, torchrun_env: dict[str, str]):
    """A ``launch_ranks`` patch: rank ``late`` starts its failure report only once the other rank has claimed the
    launch's failure (its error file, written right after the claim, exists), an order that a fixed sleep made only
    likely. Where the other cannot claim first (c10d's rank 0 hosts the store before the process group exists, and
    the other waits for it: ``peers.rank_store``), once the other waits for that store."""
    import accel_ddp.lifecycle.failure as failure
    import accel_ddp.lifecycle.peers as peers

    early = 1 - late
    waits_for_the_late_host = torchrun_env is C10D_UNSHARED and late == 0
    ready = folder / (f"waiting{early}" if waits_for_the_late_host else f"error{early}.json")

    def patch(rank: int) -> None:
        if rank == early:
            listening = peers.listening
            peers.listening = lambda *args: ((folder / f"waiting{early}").touch(), listening(*args))[1]
            return
        report = failure.report

        def report_second(*args):
            wait_for_file(ready, 30)  # never met: the test fails on the order
            return report(*args)

        failure.report = report_second

    return patch


@pytest.mark.parametrize("late_rank", [0, 1])
def test_whichever_rank_fails_first_prints_the_one_line(tmp_path, capfd, torchrun_env, late_rank):
    """Bad input on every rank, one of them late (it reports once the other has claimed the failure); the first
    rank to exit SIGTERMs the other, as torchrun does (with "rank 0 prints", the c10d launch lost the line whenever
    rank 1 exited first). One rank prints; both exit 2, and the other's error file says why. Which one: with
    torchrun's store, the first to fail; without it, before the process group exists, mostly rank 0 (it hosts the
    store the other waits for)."""
    args = [*BASE, "--lr", "-1", "--output_dir", str(tmp_path)]
    codes = launch_ranks(tmp_path, args, torchrun_env, _reports_after_the_other(tmp_path, late_rank, torchrun_env))
    assert codes == [2, 2]
    err = capfd.readouterr().err
    assert error_lines(err) == ["accel_ddp: error: --lr must be > 0, got -1.0; try --lr 3e-3"]
    assert_quiet(err)
    first = 0 if recorded(tmp_path, 0)["message"].startswith("ConfigError") else 1
    if torchrun_env is not C10D_UNSHARED:
        assert first == 1 - late_rank
    assert recorded(tmp_path, first)["message"] == "ConfigError: --lr must be > 0, got -1.0; try --lr 3e-3"
    assert recorded(tmp_path, 1 - first)["message"] == \
        f"stopped because rank {first} failed: ConfigError: --lr must be > 0, got -1.0; try --lr 3e-3"


def test_the_rank_about_to_print_outlives_the_launchers_sigterm(tmp_path, capfd, torchrun_env):
    """torchrun's SIGTERM reaches rank 0 just before it prints (here it sends it to itself): the line still comes,
    rank 0 exits 2, and rank 1 exits only after the line is out."""
    import accel_ddp.lifecycle.failure as failure

    rank_1_late = _reports_after_the_other(tmp_path, 1, torchrun_env)

    def sigterm_first(rank: int) -> None:
        rank_1_late(rank)
        if rank == 0:
            real = failure.print_report
            failure.print_report = lambda text: (os.kill(os.getpid(), signal.SIGTERM), time.sleep(0.3), real(text))

    args = [*BASE, "--lr", "-1", "--output_dir", str(tmp_path)]
    # Rank 1 reports once rank 0 has claimed the failure, so rank 0 is first: it prints.
    assert launch_ranks(tmp_path, args, torchrun_env, sigterm_first) == [2, 2]
    err = capfd.readouterr().err.splitlines()
    line = err.index("accel_ddp: error: --lr must be > 0, got -1.0; try --lr 3e-3")
    assert line < err.index("rank 1 returned 2"), err
    assert sum(entry.startswith("accel_ddp: error:") for entry in err) == 1


@pytest.mark.parametrize("failing_rank", [0, 1])
def test_a_rank_whose_peer_failed_stops_quietly_with_its_exit_code(tmp_path, capfd, torchrun_env, failing_rank):
    """An exception on one rank mid-run, rank 0's progress bar mid-line: that rank's traceback, once, at the start of
    a line; the other, blocked in a collective with it, learns at once (not at the failing rank's exit, which waits
    for it), prints nothing and exits 1 too; its error file (the launcher's summary) names the failing rank. Rank 0
    failing is the case where it hosts the store (c10d)."""
    args = [*TRAINING, "--output_dir", str(tmp_path)]
    codes = launch_ranks(tmp_path, args, torchrun_env, fail_at=(3, failing_rank))
    assert codes == [1, 1]
    err = capfd.readouterr().err
    assert "step/s]" in err or "s/step]" in err  # rank 0's progress bar was drawn (forked ranks draw it)
    assert err.count("Traceback (most recent call last)") == 1
    assert "\nTraceback (most recent call last):\n" in err  # it starts a line, not after the bar's last
    assert f"InjectedFailure: injected failure on rank {failing_rank} at step 3" in err
    assert "Connection closed by peer" not in err and "DistBackendError" not in err and "frame #" not in err
    injected = f"InjectedFailure: injected failure on rank {failing_rank} at step 3"
    assert recorded(tmp_path, failing_rank)["message"] == injected
    assert recorded(tmp_path, failing_rank)["callstack"].startswith("Traceback (most recent call last)")
    assert recorded(tmp_path, 1 - failing_rank)["message"] == f"stopped because rank {failing_rank} failed: {injected}"
    assert not (tmp_path / "summary.json").exists()


def test_a_nan_loss_on_one_rank_is_one_line_and_exit_3_on_every_rank(tmp_path, capfd, torchrun_env):
    args = [*TRAINING, "--model", "tests.helpers.faults:nan_mlp", "--output_dir", str(tmp_path)]
    codes = launch_ranks(tmp_path, args, torchrun_env, nan_at=(3, 1))
    assert codes == [3, 3]
    err = capfd.readouterr().err
    (line,) = error_lines(err)
    assert line.startswith("accel_ddp: error: the training loss became nan or inf at optimizer step 3;")
    assert_quiet(err)


@pytest.mark.parametrize("store, killed", [("static", 1), ("c10d", 1), ("c10d", 0)])
def test_a_rank_killed_outright_stops_the_other_at_once_without_a_traceback(tmp_path, capfd, launcher_store, store,
                                                                             killed):
    """A rank dies without a word (SIGKILL, as the OOM killer does): the other stops at once (its collective fails),
    exit 1, no gloo traceback: one line saying so where it can tell that no rank reported. Without torchrun's
    store, a killed rank 0 took the store along: rank 1 cannot tell, and stops without a word (its error file
    and the launcher's summary say what happened)."""
    args = [*TRAINING, "--output_dir", str(tmp_path)]
    env = launcher_store[1] if store == "static" else C10D_UNSHARED
    with pytest.raises(RankFailed) as failed:
        launch_ranks(tmp_path, args, env, kill_at=(3, killed))
    assert "exited with code -9" in failed.value.failures[killed] and 1 - killed not in failed.value.failures
    err = capfd.readouterr().err
    assert f"rank {1 - killed} returned 1" in err
    lost = f"rank {1 - killed} lost its connection to another rank, which ended without reporting an error"
    lines = error_lines(err)
    if (store, killed) == ("c10d", 0):
        assert lines == []
    else:
        assert len(lines) == 1 and lines[0].startswith(f"accel_ddp: error: {lost}")
    assert recorded(tmp_path, 1 - killed)["message"].startswith(lost)
    assert_quiet(err)


def _summary(stderr: str) -> dict[int, dict[str, str]]:
    """The launcher's ChildFailedError summary by rank: exitcode, error_file, traceback, root (the root cause?)."""
    text = stderr[stderr.index("ChildFailedError"):]
    root_at = text.index("Root Cause (first observed failure):")
    entries = {}
    entry = re.compile(r"  rank +: (\d+) \(local_rank: \d+\)\n  exitcode +: (-?\d+)[^\n]*\n  error_file: ([^\n]*)\n"
                       r"  traceback : (.*?)(?=\n\[\d+\]:|\n-{20,}|\n={20,})", re.DOTALL)
    for match in entry.finditer(text):
        entries[int(match[1])] = {"exitcode": match[2], "error_file": match[3], "traceback": match[4],
                                  "root": match.start() > root_at}
    return entries


def _rendezvous(kind: str) -> dict:
    """accelerate launch's flags and environment for a kind of rendezvous: "static", the shipped configs' (its
    store shared with the workers), or "c10d" as docs/checkpoints.md launches it. On one machine Accelerate passes
    torchrun no rendezvous endpoint (accelerate/utils/launch.py, prepare_multi_gpu_env), so every c10d launch
    meets at localhost:29400 unless told otherwise: each gets its own port (torchrun reads PET_RDZV_ENDPOINT)."""
    if kind == "static":
        return {}
    return {"launch_args": ["--rdzv_backend", "c10d"],
            "env": {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "PET_RDZV_ENDPOINT": f"127.0.0.1:{free_port()}"}}


@pytest.mark.slow
def test_a_launch_of_either_rendezvous_prints_the_one_line_with_rank_0_a_second_late(tmp_path):
    """Bad input on both ranks, launched with each rendezvous kind, rank 0 a second late: the failing order that
    lost the line (issue 20: rank 1 exited first, torchrun SIGTERMed rank 0 before it printed). That order is
    forced, so a launch whose line is lost fails every time; the forked tests above
    (test_whichever_rank_fails_first_prints_the_one_line, ..._outlives_the_launchers_sigterm) go through both
    orders on each kind's store, with torchrun's SIGTERM after the first exit (tests/helpers/ranks.py). A launch
    as started (no order forced, the other order or this one as the start-up falls) showed nothing those do not:
    not launched. Each launch prints the line exactly once, at the start of a line, and the launcher's summary has
    both ranks' exit code 2 and why (which rank is first: not asserted, c10d's rank 0 hosts the store the other
    waits for). The two launches run at once: both cores stay busy through the interpreters' start-up."""
    runs = []
    for i, rendezvous in enumerate(["static", "c10d"]):
        kind = _rendezvous(rendezvous)
        runs.append({"script_args": [*BASE, "--lr", "nan", "--output_dir", str(tmp_path / str(i))],
                     "launch_args": kind.get("launch_args"),
                     "env": {**kind.get("env", {}), "FAULT_REPORT_DELAY": "1:0"}})
    results = launch_together(*runs)
    line = "accel_ddp: error: --lr must be a finite number, got nan; give a finite number, e.g. --lr 0.003"
    for i, result in enumerate(results):
        assert error_lines(result.stderr) == [line], (i, result.stderr[-3000:])
        assert result.stderr.count("Traceback (most recent call last)") == 1  # the launcher's own ChildFailedError
        summary = _summary(result.stderr)
        first = next(rank for rank, entry in summary.items() if not entry["traceback"].startswith("stopped"))
        assert {entry["exitcode"] for entry in summary.values()} == {"2"}, (i, summary)
        assert summary[first]["traceback"] == line.replace("accel_ddp: error: ", "ConfigError: ")
        assert summary[1 - first]["traceback"].startswith(f"stopped because rank {first} failed: ConfigError: ")


def _bad_sample_args(tmp_path) -> list[str]:
    return ["--dataset", "tests.helpers.data:one_bad_sample", "--loader", "dataloader", "--num_workers", "0",
            "--global_batch_size", "16", "--epochs", "50", "--output_dir", str(tmp_path)]


def test_a_sample_that_does_not_decode_on_rank_1_is_one_line_under_rank_0s_progress_bar(tmp_path, capfd,
                                                                                         launcher_store):
    """Rank 1 fails mid-run on a sample that does not decode while rank 0's progress bar stands mid-line (forked
    ranks draw it: the product passes tqdm's ``disable`` itself). Its one line starts a line; rank 0 prints nothing
    and exits with rank 1's code 2; its error file, which the launcher's summary shows, says why. The exception
    case: test_a_rank_whose_peer_failed_stops_quietly_with_its_exit_code."""
    codes = launch_ranks(tmp_path, _bad_sample_args(tmp_path), launcher_store[1])
    assert codes == [2, 2]
    err = capfd.readouterr().err
    assert "step/s]" in err or "s/step]" in err  # the bar was drawn
    (line,) = error_lines(err)  # at the start of a line
    assert helpers_data.BAD_SAMPLE_MESSAGE in line
    assert_quiet(err)
    assert recorded(tmp_path, 0)["message"].startswith("stopped because rank 1 failed: DataError: ")
    assert recorded(tmp_path, 1)["message"].startswith("DataError: ")
    assert helpers_data.BAD_SAMPLE_MESSAGE in recorded(tmp_path, 1)["message"]


# ----------------------------------------------------------------------------- the one-process launch trap


SIMPLE_LAUNCHER = {"ACCELERATE_USE_CPU": "True", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


@pytest.mark.parametrize(("env", "trapped"), [
    (SIMPLE_LAUNCHER, True),  # MULTI_CPU without mpirun, NO or --cpu, with num_processes > 1
    ({**SIMPLE_LAUNCHER, "ACCELERATE_USE_CPU": "False"}, True),  # distributed_type NO, num_processes 2
    ({"ACCELERATE_USE_CPU": "False"}, False),  # the simple launcher for 1 process: what was asked for
    ({**SIMPLE_LAUNCHER, "WORLD_SIZE": "2", "RANK": "0"}, False),  # torchrun started it
    ({**SIMPLE_LAUNCHER, "PMI_SIZE": "2", "PMI_RANK": "0"}, False),  # mpirun started it
    ({"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}, False),  # plain python in a batch job's environment
])
def test_single_process_trap_is_read_from_what_the_launcher_left(env, trapped):
    assert (single_process_trap(env) is not None) == trapped


def test_one_process_where_several_were_asked_is_refused_before_training(tmp_path, capsys, monkeypatch):
    for name, value in SIMPLE_LAUNCHER.items():
        monkeypatch.setenv(name, value)
    assert main([*BASE, "--output_dir", str(tmp_path / "out")]) == 2
    (line,) = _error_lines(capsys.readouterr().err)
    assert line.startswith("accel_ddp: error: accelerate launch started 1 process, but its config asks for several")
    assert "distributed_type: MULTI_GPU" in line and "accelerate_configs/cpu_2proc.yaml" in line
    assert not (tmp_path / "out").exists()


@pytest.mark.slow  # a fresh interpreter's exit/start is the behaviour
def test_exit_process_ends_cleanly_with_a_collective_still_in_flight():
    """The CI flake this fixes: a run that succeeded, then SIGABRT while Python tore itself down."""
    def end(how: str):
        return run_single([str(free_port()), how], script=SCRIPTS / "exit_in_flight.py", timeout=60,
                          env={"PYTHONUNBUFFERED": ""})  # buffered stdout: exit_process must flush it

    def shows_the_race(times: int) -> bool:  # independent processes: both cores
        with ThreadPoolExecutor(times) as pool:
            return any("terminate called without an active exception" in result.stderr
                       for result in pool.map(end, ["sys_exit"] * times))

    # exit_process runs once, beside the plain exit's first try: the race lives in the interpreter's finalization,
    # and its stdout shows that it never finalized (no "finalized" line from the script): deterministic, where an
    # abort shows in some runs only. The race itself: the plain exit gets up to four chances to show it (1, 2, then
    # 1: each try is an interpreter, ~3 s of CPU), so that the test is not vacuous; else it skips, saying so.
    with ThreadPoolExecutor(1) as pool:
        clean = pool.submit(end, "exit_process")
        shown = shows_the_race(1)
        result = clean.result()
    assert result.returncode == 3, result.stderr
    assert result.stdout.splitlines() == ["unflushed line", "atexit handler ran"]  # no "finalized"
    assert "terminate called" not in result.stderr
    if not (shown or shows_the_race(2) or shows_the_race(1)):
        pytest.skip("this torch/Python did not abort when gloo freed a tensor during teardown; "
                    "the setup does not reproduce the race")


def test_the_error_file_is_renamed_into_place(tmp_path, monkeypatch):
    """torchrun may SIGTERM a rank while it writes its error file, and the agent fails on a half-written one:
    the file appears whole or not at all."""
    import accel_ddp.outputs.files as files
    from accel_ddp.lifecycle.failure import write_error_file

    path = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
    renamed = []
    real_replace = os.replace
    monkeypatch.setattr(files.os, "replace", lambda src, dst: (renamed.append(dst), real_replace(src, dst)))
    write_error_file("accel_ddp: error: x", "Traceback ...")
    assert renamed == [str(path)]
    assert json.loads(path.read_text())["message"]["message"] == "accel_ddp: error: x"
    assert [p.name for p in tmp_path.iterdir()] == ["error.json"]
