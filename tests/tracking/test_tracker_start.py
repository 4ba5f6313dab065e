"""A tracker's start (--with_tracking): what `all` starts, a bounded start, a signal during it, what a failed
start leaves, where trackers write, and scalars only.

Network trackers are fakes built where trackers.py builds every tracker (``new_tracker``, patched before the
ranks fork): a start that never returns, one that fails, one that gets a SIGTERM meanwhile. Nothing here
reaches a network.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import types
from pathlib import Path
from types import SimpleNamespace

import pytest
from accelerate.tracking import GeneralTracker

from accel_ddp.config import ACCELERATE_TRACKERS
from accel_ddp.tracking import configured
from accel_ddp.tracking.configured import unconfigured
from accel_ddp.tracking.trackers import flat_scalars, resolve_report_to
from tests.helpers.multiproc import run_ranks
from tests.helpers.runs import main_ranks, read_metrics

NO_ACCOUNTS = ("WANDB_API_KEY", "WANDB_MODE", "WANDB_DIR", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_DISABLED",
               "WANDB_BASE_URL", "NETRC", "MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_RUN_ID",
               "COMET_API_KEY", "COMET_CONFIG", "CLEARML_API_ACCESS_KEY", "CLEARML_API_SECRET_KEY",
               "CLEARML_CONFIG_FILE", "CLEARML_OFFLINE_MODE", "SWANLAB_API_KEY", "SWANLAB_MODE")


@pytest.fixture
def no_accounts(tmp_path, monkeypatch) -> Path:
    """A machine with no tracker account or server: a HOME of its own (no netrc, no config files), no variables;
    the working directory an empty folder (returned), to show that nothing is written there."""
    for name in NO_ACCOUNTS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    return cwd


def _lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("accel_ddp: ")]


def _files(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): p.read_text(errors="replace") for p in sorted(folder.rglob("*"))
            if p.is_file() and p.name != ".lock"}


def _earlier_run(out: Path) -> dict[str, str]:
    """What an earlier run left (an old event file in tensorboard/ too): a refused start leaves all of it."""
    (out / "tensorboard").mkdir(parents=True)
    for name, text in {"metrics.jsonl": '{"step": 2, "loss": 1.0}\n', "config.yaml": "lr: 0.1\n",
                       "tensorboard/events.out.tfevents.1.old": "old events"}.items():
        (out / name).write_text(text)
    return _files(out)


# ----------------------------------------------------------------------------- what `all` starts


@pytest.mark.parametrize("name, env, files", [
    ("wandb", {"WANDB_MODE": "offline"}, {}),
    ("wandb", {"WANDB_MODE": "disabled"}, {}),
    ("wandb", {"WANDB_API_KEY": "k" * 40}, {}),
    ("wandb", {}, {"home/.netrc": "machine api.wandb.ai\n  login user\n  password " + "k" * 40 + "\n"}),
    ("wandb", {"WANDB_BASE_URL": "https://wandb.internal"}, {"home/.netrc": "machine wandb.internal password k\n"}),
    ("mlflow", {"MLFLOW_TRACKING_URI": "http://mlflow.internal:5000"}, {}),
    ("comet_ml", {"COMET_API_KEY": "k"}, {}),
    ("comet_ml", {}, {"home/.comet.config": "[comet]\napi_key = k\n"}),
    ("clearml", {}, {"home/clearml.conf": "api {}\n"}),
    ("clearml", {"CLEARML_OFFLINE_MODE": "1"}, {}),
    ("swanlab", {"SWANLAB_MODE": "offline"}, {}),
])
def test_a_tracker_is_configured_by_what_it_reads(tmp_path, no_accounts, monkeypatch, name, env, files):
    assert unconfigured(name) is not None  # nothing set: `all` leaves it out
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    for path, text in files.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(text)
    assert unconfigured(name) is None


def test_a_netrc_entry_for_another_host_or_wandb_online_is_not_a_wandb_login(tmp_path, no_accounts, monkeypatch):
    (tmp_path / "home").mkdir()
    (tmp_path / "home/.netrc").write_text("machine github.com login me password secret\n")
    monkeypatch.setenv("WANDB_MODE", "online")
    assert unconfigured("wandb") == configured.CONFIGURED["wandb"][1]
    for name in ("tensorboard", "aim", "dvclive", "trackio", "csv"):  # files only: always
        assert unconfigured(name) is None


def test_report_to_all_leaves_out_the_unconfigured_in_one_line_and_a_named_one_stays(no_accounts, monkeypatch,
                                                                                     capsys):
    import accelerate.utils

    for name in ACCELERATE_TRACKERS:
        monkeypatch.setattr(accelerate.utils, f"is_{name}_available",
                            lambda n=name: n in ("tensorboard", "wandb", "mlflow"))
    assert resolve_report_to("all") == ["tensorboard", "csv"]
    assert capsys.readouterr().err == (
        "accel_ddp: note: --report_to all: not logging to wandb (set WANDB_API_KEY or run `wandb login`, or "
        "WANDB_MODE=offline to log locally), mlflow (set MLFLOW_TRACKING_URI); name a tracker in --report_to to "
        "require it\n")
    assert resolve_report_to("all,wandb") == ["tensorboard", "csv", "wandb"]  # named: it must start
    assert "not logging to mlflow (set MLFLOW_TRACKING_URI);" in capsys.readouterr().err
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:9")
    assert resolve_report_to("all") == ["tensorboard", "wandb", "mlflow", "csv"]
    assert capsys.readouterr().err == ""


def test_with_tracking_alone_and_no_accounts_trains_on_two_ranks_and_names_what_it_left_out(
        tmp_path, tiny_args, no_accounts, capfd, monkeypatch):
    """Right after `pip install -e '.[test]'` (W&B and MLflow installed): it stopped on 'W&B not logged in'."""
    import accelerate.utils

    for name in ("wandb", "mlflow"):
        monkeypatch.setattr(accelerate.utils, f"is_{name}_available", lambda: True)  # as after the install
    out = tmp_path / "run"
    assert main_ranks([*tiny_args, "--with_tracking", "--log_every", "4", "--output_dir", str(out)]) == [0, 0]
    lines = _lines(capfd.readouterr().err)
    assert [line for line in lines if "--report_to all" in line] == [
        "accel_ddp: note: --report_to all: not logging to wandb (set WANDB_API_KEY or run `wandb login`, or "
        "WANDB_MODE=offline to log locally), mlflow (set MLFLOW_TRACKING_URI); name a tracker in --report_to to "
        "require it"]  # once: the main process
    assert not [line for line in lines if "error" in line]
    assert (out / "metrics.csv").is_file() and not (out / "wandb").exists() and not (out / "mlflow.db").exists()
    assert list(no_accounts.iterdir()) == []  # nothing in the working directory


# ----------------------------------------------------------------------------- fake network trackers


class _FakeTracker(GeneralTracker):
    """Stands in for W&B: its start writes a run folder in OUTPUT_DIR/wandb/, then does ``action``."""

    name = "wandb"
    requires_logging_directory = False
    main_process_only = True

    def __init__(self, output_dir: str, action: str, record: str | None = None):
        super().__init__()
        self.output_dir, self.action, self.record = output_dir, action, record

    def start(self) -> None:
        partial = Path(self.output_dir) / "wandb" / "run-partial"
        partial.mkdir(parents=True)
        (partial / "run.wandb").write_text("half a run")
        if self.action == "fail":
            raise RuntimeError("the server said no")
        if self.action == "sigterm":  # the launcher stops the job while the server keeps us waiting
            os.kill(os.getpid(), signal.SIGTERM)
        if self.action in ("hang", "sigterm"):
            threading.Event().wait()  # a server that never answers

    @property
    def tracker(self):
        return SimpleNamespace(id="fake", summary={})

    def store_init_configuration(self, values: dict) -> None:
        pass

    def log(self, values: dict, step: int | None = None, **kwargs) -> None:
        with open(self.record, "a") as fh:
            fh.write(json.dumps({"step": step, "values": values}) + "\n")


def _fake_wandb(monkeypatch, action: str, record: str | None = None) -> None:
    """W&B is the fake from now on, in the ranks forked next; every other tracker is the real one."""
    import accelerate.utils

    import accel_ddp.tracking.trackers as trackers

    real = trackers.new_tracker
    monkeypatch.setattr(accelerate.utils, "is_wandb_available", lambda: True)
    monkeypatch.setattr(trackers, "new_tracker", lambda name, run: _FakeTracker(run.output_dir, action, record)
                        if name == "wandb" else real(name, run))


def _refused(args: list[str], out: Path, capfd, codes: list[int]) -> list[str]:
    capfd.readouterr()
    assert main_ranks(args) == codes  # every rank, none left waiting
    err = capfd.readouterr().err
    assert "Traceback" not in err
    return _lines(err)


@pytest.mark.parametrize("action", ["hang", "fail"])
def test_a_start_that_never_answers_or_fails_stops_every_rank_and_leaves_the_folder_as_it_was(
        tmp_path, tiny_args, no_accounts, capfd, monkeypatch, action):
    """A slow start waited for minutes (MLflow 259 s, W&B 109 s) and each failed start left tensorboard/ and wandb/
    behind. TensorBoard starts first here and writes an event file, which goes too; the old one stays.
    Its module is imported before the ranks fork: that import (half a second, seconds on a loaded host) within
    the 1 s start bound made tensorboard the tracker that timed out."""
    pytest.importorskip("torch.utils.tensorboard", reason="--report_to tensorboard needs the tensorboard package")
    _fake_wandb(monkeypatch, action)
    out = tmp_path / "run"
    before = _earlier_run(out)
    lines = _refused([*tiny_args, "--with_tracking", "--report_to", "tensorboard,wandb,csv",
                      "--tracker_start_timeout", "1", "--output_dir", str(out)], out, capfd, [2, 2])
    (line,) = lines
    if action == "hang":
        assert line == ("accel_ddp: error: --report_to wandb: it did not start within --tracker_start_timeout 1 s "
                        "(a server that does not answer?); check that its server is reachable, raise "
                        "--tracker_start_timeout, or leave wandb out of --report_to")
    else:
        assert line.startswith("accel_ddp: error: --report_to wandb: it failed to start (RuntimeError: the server "
                               "said no); log in with `wandb login`")
    assert _files(out) == before
    assert sorted(p.name for p in out.iterdir()) == [".lock", "config.yaml", "metrics.jsonl", "tensorboard"]


def test_a_sigterm_while_a_tracker_starts_stops_every_rank_at_once(tmp_path, tiny_args, no_accounts, capfd,
                                                                    monkeypatch):
    """The signal was held until the start gave up (259 s). With a start timeout of 10 minutes, only a prompt stop
    ends this run within run_ranks' timeout: exit 75 (preempted during start-up) on both ranks."""
    _fake_wandb(monkeypatch, "sigterm")
    out = tmp_path / "run"
    before = _earlier_run(out)
    lines = _refused([*tiny_args, "--with_tracking", "--report_to", "csv,wandb", "--tracker_start_timeout", "600",
                      "--ddp_timeout", "7200", "--output_dir", str(out)], out, capfd, [75, 75])
    assert lines == ["accel_ddp: preempted: SIGTERM received during start-up (trackers): no optimizer step taken in "
                     "this launch, nothing saved; relaunch the same command (exit code 75)"]
    assert _files(out) == before


def test_a_start_timeout_the_other_ranks_cannot_wait_out_is_refused_before_anything_starts():
    """The other ranks wait for the trackers' start in one broadcast: two trackers, each bounded three times
    (start, config, close after a failed start) by 300 s, could take 1800 s, the default --ddp_timeout: a
    collective timeout on every rank instead of the line naming the tracker."""
    from accel_ddp.cli.args import parse_args
    from accel_ddp.util.validation import ConfigError

    tracking = ["--with_tracking", "--report_to", "csv,wandb"]
    with pytest.raises(ConfigError) as refused:
        parse_args([*tracking, "--tracker_start_timeout", "300"])
    assert str(refused.value) == (
        "--tracker_start_timeout 300 s with 2 tracker(s) can keep the other ranks waiting 1800 s (each tracker's "
        "start, its config and, after a failed start, its close, in turn), not less than --ddp_timeout 1800 s; "
        "lower --tracker_start_timeout below 300 or raise --ddp_timeout above 1800")
    assert parse_args([*tracking, "--tracker_start_timeout", "299"]).tracker_start_timeout == 299
    assert parse_args([*tracking, "--tracker_start_timeout", "300", "--ddp_timeout", "1801"]).ddp_timeout == 1801
    with pytest.raises(ConfigError, match="--tracker_start_timeout without --with_tracking: nothing "
                                          "would use it"):  # no tracker starts, so no wait: a dead flag
        parse_args(["--report_to", "none", "--tracker_start_timeout", "3600"])


def test_report_to_all_is_checked_against_ddp_timeout_once_it_is_resolved(tmp_path, tiny_args, no_accounts, capfd):
    """`all` is known only on the ranks (what is installed and configured there): csv at least, 3 x 100 s."""
    out = tmp_path / "run"
    *left_out, line = _refused([*tiny_args, "--with_tracking", "--tracker_start_timeout", "100", "--ddp_timeout",
                                "300", "--output_dir", str(out)], out, capfd, [2, 2])
    assert all(text.startswith("accel_ddp: note: --report_to all: not logging to ") for text in left_out), left_out
    assert line.startswith("accel_ddp: error: --tracker_start_timeout 100 s with ") and \
        "not less than --ddp_timeout 300 s; lower --tracker_start_timeout below " in line
    assert not (out / "metrics.jsonl").exists()


def test_a_signal_while_the_wait_retakes_its_lock_is_still_an_interrupt_not_a_runtime_error():
    """The handler raised into ``Event.wait``; landing in ``Condition._acquire_restore`` before the lock was retaken,
    it made ``Event.wait`` release a lock it did not hold: RuntimeError instead of the interrupt, exit 1, not 75.
    The signal is sent at exactly that point (once, in the main thread)."""
    def wait_through_a_signal() -> str:
        from accel_ddp.lifecycle.preemption import PreemptionWatcher
        from accel_ddp.tracking.tracker_thread import TrackerInterrupted, TrackerThread

        watcher = PreemptionWatcher().install()
        real, sent, release = threading.Condition._acquire_restore, [], threading.Event()

        def signal_before_the_lock(self, state):
            if not sent and threading.current_thread() is threading.main_thread():
                sent.append(signal.SIGTERM)
                os.kill(os.getpid(), signal.SIGTERM)  # its handler runs right here, before the lock is taken
            real(self, state)

        worker = TrackerThread()
        worker.call(lambda: None)  # its thread started: Thread.start waits on an Event too
        threading.Condition._acquire_restore = signal_before_the_lock
        try:
            worker.call(lambda: release.wait(60), timeout=60, watcher=watcher)
            return "returned"
        except TrackerInterrupted as err:
            return f"interrupted: {err}"
        finally:
            threading.Condition._acquire_restore = real
            release.set()

    assert run_ranks(wait_through_a_signal, world_size=1) == ["interrupted: SIGTERM received"]


# ----------------------------------------------------------------------------- what trackers receive and where


def test_per_rank_figures_reach_the_trackers_as_scalars(tmp_path, tiny_args, no_accounts, monkeypatch):
    """metrics.jsonl keeps {"peak_rss_mb": {"rank0": ..., "rank1": ...}}; MLflow warned and dropped such a dict."""
    record = tmp_path / "received.jsonl"
    _fake_wandb(monkeypatch, "record", str(record))
    out = tmp_path / "run"
    assert main_ranks([*tiny_args, "--with_tracking", "--report_to", "wandb", "--output_dir", str(out)]) == [0, 0]
    received = [json.loads(line) for line in record.read_text().splitlines()]
    assert received and all(not isinstance(v, dict) for r in received for v in r["values"].values())
    (memory,) = [r for r in read_metrics(out) if "peak_rss_mb" in r and r["epoch"] == 0]
    sent = next(r["values"] for r in received if "peak_rss_mb/rank0" in r["values"] and r["step"] == memory["step"])
    assert {k: sent[k] for k in sent if k.startswith("peak_")} == {
        f"{key}/{rank}": value for key in ("peak_rss_mb", "peak_worker_rss_mb")
        for rank, value in memory[key].items()}
    assert set(memory["peak_rss_mb"]) == {"rank0", "rank1"}


def test_flat_scalars_keeps_scalars_and_names_each_entry_of_a_dict():
    assert flat_scalars({"loss": 0.5, "peak_rss_mb": {"rank0": 1.0, "rank1": 2.0}}) == {
        "loss": 0.5, "peak_rss_mb/rank0": 1.0, "peak_rss_mb/rank1": 2.0}


def _fake_dvclive(monkeypatch, git_root: Path) -> list[dict]:
    """A dvclive package that does what dvclive 3.x does to a git checkout: ``Live()`` calls ``get_dvc_repo()``,
    which makes .dvc/ and .dvcignore in the git root (``Repo.init``), then writes dvc.yaml there and saves an
    experiment ref unless told not to (dvclive/live.py, dvclive/dvc.py). It records how Live was made."""
    made: list[dict] = []
    live_module = types.ModuleType("dvclive.live")

    def get_dvc_repo():
        (git_root / ".dvc").mkdir(exist_ok=True)
        (git_root / ".dvcignore").write_text("")
        return SimpleNamespace(root_dir=str(git_root))

    class Live:
        def __init__(self, dir="dvclive", resume=False, report=None, save_dvc_exp=True, dvcyaml="dvc.yaml", **kw):
            made.append({"dir": dir, "report": report, "save_dvc_exp": save_dvc_exp, "dvcyaml": dvcyaml})
            repo = live_module.get_dvc_repo()
            os.makedirs(dir, exist_ok=True)
            if repo is not None and dvcyaml:
                (git_root / "dvc.yaml").write_text("metrics: []\n")
            if repo is not None and save_dvc_exp:
                (git_root / ".git" / "refs" / "exps").mkdir(parents=True, exist_ok=True)

    live_module.get_dvc_repo, live_module.Live = get_dvc_repo, Live
    package = types.ModuleType("dvclive")
    package.live, package.Live = live_module, Live
    monkeypatch.setitem(sys.modules, "dvclive", package)
    monkeypatch.setitem(sys.modules, "dvclive.live", live_module)
    return made


def test_dvclive_writes_its_folder_only_no_dvc_repository_experiment_or_dvc_yaml(tmp_path, monkeypatch):
    """`--report_to dvclive` made .dvc/, .dvcignore and dvc.yaml in the user's git checkout and committed an
    experiment ref. dvclive is not in the test extra: a fake of what it does stands in (dvclive/live.py, dvc.py)."""
    from accel_ddp.tracking.trackers import TrackerRun, new_tracker

    checkout = tmp_path / "checkout"
    (checkout / ".git").mkdir(parents=True)
    monkeypatch.chdir(checkout)
    made = _fake_dvclive(monkeypatch, checkout)
    out = checkout / "outputs" / "run"

    def start() -> tuple[list[dict], str]:
        new_tracker("dvclive", TrackerRun(str(out), "p", "r")).start()
        return made, sys.modules["dvclive.live"].get_dvc_repo.__name__

    (made_in_rank, restored), = run_ranks(start, world_size=1)
    assert sorted(p.name for p in checkout.iterdir()) == [".git", "outputs"]
    assert list((checkout / ".git").iterdir()) == []
    assert (out / "dvclive").is_dir()
    assert made_in_rank == [{"dir": str(out / "dvclive"), "report": None, "save_dvc_exp": False, "dvcyaml": None}]
    assert restored == "get_dvc_repo"  # dvclive's own function is back after the start


def test_mlflow_without_a_tracking_uri_keeps_its_store_in_the_output_folder(tmp_path, no_accounts, monkeypatch):
    """MLflow's default store is sqlite:///mlflow.db in the working directory (mlflow/store/tracking/__init__.py)."""
    mlflow = pytest.importorskip("mlflow", reason="the mlflow tracker needs mlflow")
    from accel_ddp.tracking.trackers import TrackerRun, new_tracker

    out = tmp_path / "run"
    uris = []

    def start() -> list[str]:
        tracker = new_tracker("mlflow", TrackerRun(str(out), "p", "r"))
        monkeypatch.setattr(mlflow, "search_experiments",  # in the rank: records where it would look, finds one
                            lambda **kw: uris.append(mlflow.get_tracking_uri()) or [SimpleNamespace(experiment_id="0")])
        monkeypatch.setattr(mlflow, "start_run", lambda **kw: None)
        tracker.start()
        return [*uris, tracker.logging_dir]

    (uri, artifacts) = run_ranks(start, world_size=1)[0]
    assert uri == f"sqlite:///{out / 'mlflow.db'}" and artifacts == str(out / "mlruns")
    assert list(no_accounts.iterdir()) == []


def test_a_snapshot_removes_only_what_is_new_and_not_a_later_runs_files(tmp_path):
    from accel_ddp.tracking.folder_snapshot import FolderSnapshot

    out = tmp_path / "run"
    (out / "tensorboard").mkdir(parents=True)
    (out / "tensorboard/old").write_text("kept")
    (out / "checkpoints/step_00000004").mkdir(parents=True)
    before = FolderSnapshot(str(out))
    (out / "tensorboard/new").write_text("made by the failed start")
    (out / "wandb/run-1/files").mkdir(parents=True)
    (out / "checkpoints/step_00000004/x").write_text("no tracker writes here: not listed")
    (out / ".lock").write_text("")
    assert before.remove_new() == ["tensorboard/new", "wandb"]
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*")) == [
        ".lock", "checkpoints", "checkpoints/step_00000004", "checkpoints/step_00000004/x", "tensorboard",
        "tensorboard/old"]
    (out / "wandb").mkdir()  # the abandoned start wrote again; at the exit it goes...
    before.remove_new_unless_reused()
    assert not (out / "wandb").exists()
    (out / "wandb").mkdir()  # ...unless a later run in this process took the folder on
    (out / "config.yaml").write_text("lr: 0.1\n")
    os.utime(out / "config.yaml", (before.taken_at + 1, before.taken_at + 1))  # written after (clock granularity)
    before.remove_new_unless_reused()
    assert (out / "wandb").is_dir() and (out / "config.yaml").is_file()


def test_without_tracking_the_output_folder_is_not_listed_at_the_start(tmp_path, monkeypatch):
    """The snapshot walks the whole output folder but checkpoints/: only for trackers that start. An Accelerator
    without --with_tracking has no ``log_with``, and the recorder's start returns before any of it."""
    import accel_ddp.tracking.recorder as recorder

    def no_snapshot(folder):
        raise AssertionError(f"{folder} listed for trackers that do not start")

    monkeypatch.setattr(recorder, "FolderSnapshot", no_snapshot)
    run = recorder.RunRecorder(str(tmp_path), True, accelerator=SimpleNamespace(log_with=[], is_main_process=True))
    run.start_trackers("accel_ddp", {}, 0, 30.0)
    assert list(tmp_path.iterdir()) == []
