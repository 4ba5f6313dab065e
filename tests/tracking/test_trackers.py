"""Trackers (--with_tracking, --report_to), their failures, resumes, and the model card.

MLflow and W&B run for real and offline: MLflow on a local file store (MLFLOW_TRACKING_URI=file:...),
W&B with WANDB_MODE=offline; each is read back with its own API (MlflowClient, `wandb leet inspect`).
Without the package, those tests skip.
"""

from __future__ import annotations

import csv
import json
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from accel_ddp.cli.args import parse_args
from accel_ddp.config import ACCELERATE_TRACKERS
from accel_ddp.outputs.model_card import launch_command
from accel_ddp.tracking.recorder import RunRecorder
from accel_ddp.tracking.trackers import CSVTracker, build_trackers, resolve_report_to
from accel_ddp.util.validation import ConfigError
from tests.helpers import faults
from tests.helpers.multiproc import RankFailed, run_ranks
from tests.helpers.output import decode_png, series
from tests.helpers.runs import main_ranks, read_metrics, read_summary, train_ranks
from tools import flag_table

TRACKED = ["--log_every", "2", "--eval_every", "8", "--with_tracking"]


def _offline(tmp_path: Path, monkeypatch) -> dict[str, str]:
    """MLflow on a file store in tmp_path, W&B offline with its own folders there: nothing leaves the machine."""
    for name in ("WANDB_API_KEY", "WANDB_DIR", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_RUN_ID", "MLFLOW_TAGS"):
        monkeypatch.delenv(name, raising=False)
    env = {
        "MLFLOW_TRACKING_URI": f"file:{tmp_path / 'mlruns'}",
        "MLFLOW_ALLOW_FILE_STORE": "true",  # MLflow 3.x refuses its file store unless asked
        "WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_BASE_URL": "http://127.0.0.1:9",
        "WANDB_CONFIG_DIR": str(tmp_path / "wandb_config"), "WANDB_CACHE_DIR": str(tmp_path / "wandb_cache"),
        "WANDB_DATA_DIR": str(tmp_path / "wandb_data"), "HOME": str(tmp_path / "home"),
        # What W&B records of the machine beside the run, which no test reads: the installed packages' list
        # (x_save_requirements: every distribution's metadata parsed, ~0.2 s of the rank's CPU), the system
        # metadata and the system metrics (x_disable_meta, x_disable_stats: wandb-core's own work)
        "WANDB__SAVE_REQUIREMENTS": "false", "WANDB__DISABLE_META": "true", "WANDB__DISABLE_STATS": "true",
    }
    for name, value in env.items():
        monkeypatch.setenv(name, value)  # the test process reads the stores back with the same settings
    return env


def _mlflow():
    mlflow = pytest.importorskip("mlflow", reason="the mlflow tracker needs mlflow (pip install 'accel_ddp[tracking]')")
    return mlflow  # imported here, once: the forked ranks inherit it


def _wandb_history(out: Path) -> list[tuple[str, list[dict], dict, dict]]:
    """(run id, history rows, run record, config and summary updates) of each offline W&B run under
    OUTPUT_DIR/wandb, read with W&B's own reader of its .wandb transaction log (`wandb leet inspect --json`)."""
    pytest.importorskip("wandb", reason="the wandb tracker needs wandb (pip install 'accel_ddp[tracking]')")
    from wandb.util import get_core_path

    runs = []
    for path in sorted((out / "wandb").glob("offline-run-*/run-*.wandb")):
        # What `wandb leet inspect --json PATH` runs (wandb/cli/leet.py: launch_inspect, _base_args, offline), without
        # the Python interpreter that only starts it (~1 s of CPU)
        inspect = [get_core_path(), "leet", "inspect", "--no-observability", "--json", "--run-file", str(path),
                   str(path.parent.parent)]
        listing = subprocess.run(inspect, capture_output=True, text=True, check=True, timeout=60).stdout
        records = [json.loads(line) for line in listing.splitlines() if line.startswith("{")]
        (run,) = [r["run"] for r in records if r["type"] == "run"]
        history = [r["history"]["item"] for r in records if r["type"] == "history"]
        updates = {kind: [r[kind]["update"] for r in records if r["type"] == kind] for kind in ("config", "summary")}
        runs.append((run["run_id"], history, run, updates))
    return runs


# ----------------------------------------------------------------------------- flags


def test_tracker_names_are_accelerates():
    from accelerate.tracking import LOGGER_TYPE_TO_CLASS

    assert set(ACCELERATE_TRACKERS) == set(LOGGER_TYPE_TO_CLASS)  # config/choices.py lists them without importing torch


@pytest.mark.parametrize("old, report_to", [("tensorboard", "tensorboard"), ("csv", "csv"), ("all", "tensorboard,csv")])
def test_old_with_tracking_values_still_work_with_one_deprecation_line(tmp_path, capsys, old, report_to):
    cfg = parse_args(["--with_tracking", old])
    assert (cfg.with_tracking, cfg.report_to) == (True, report_to)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"with_tracking: {old}\n")
    cfg = parse_args(["--config", str(recipe)])
    assert (cfg.with_tracking, cfg.report_to) == (True, report_to)
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 2 and all(f"--with_tracking --report_to {report_to}" in line for line in lines), lines
    assert parse_args(["--with_tracking", "none"]).with_tracking is False
    assert "deprecated" in capsys.readouterr().err
    table = flag_table.table()  # docs/flags.md lists the old spellings
    assert f"| `--with_tracking {old}` | `--with_tracking --report_to {report_to}` |" in table
    assert "| `--with_tracking none` | `--with_tracking false` |" in table


def test_new_flags_from_cli_and_yaml(tmp_path, capsys):
    cfg = parse_args(["--with_tracking", "--report_to", "MLflow, wandb,mlflow", "--tracker_project_name", "mnist",
                      "--run_name", "baseline"])
    assert (cfg.with_tracking, cfg.report_to, cfg.tracker_project_name, cfg.run_name) == (
        True, "mlflow,wandb", "mnist", "baseline")
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({"with_tracking": True, "report_to": "csv", "tracker_project_name": "p",
                                      "run_name": "r"}))
    cfg = parse_args(["--config", str(recipe), "--report_to", "tensorboard"])
    assert (cfg.with_tracking, cfg.report_to, cfg.tracker_project_name, cfg.run_name) == (True, "tensorboard", "p", "r")
    assert parse_args([]).with_tracking is False and parse_args([]).report_to is None
    assert parse_args(["--with_tracking"]).report_to == "all"  # --with_tracking alone: today's default
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("report_to", ["wandb", "tensorboard,csv", "all"])
def test_report_to_alone_turns_tracking_on_as_in_the_trainer(report_to, tmp_path, capsys):
    cfg = parse_args(["--report_to", report_to])
    assert (cfg.with_tracking, cfg.report_to) == (True, report_to)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({"report_to": report_to}))
    assert parse_args(["--config", str(recipe)]).with_tracking is True
    assert capsys.readouterr().err == ""  # no "has no effect" warning: it has


@pytest.mark.parametrize("argv, message", [
    (["--with_tracking", "wandb"], "name the trackers with --report_to, e.g. --with_tracking --report_to wandb"),
    (["--report_to", "neptune"], "unknown tracker neptune; give one or more of tensorboard, wandb, mlflow"),
    (["--report_to", ","], "unknown tracker (none given)"),
    (["--run_name", " "], "--run_name is empty"),
])
def test_bad_tracking_flags_are_one_line(argv, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")) as err:
        parse_args(argv)
    assert "\n" not in str(err.value)


def test_report_to_all_is_every_installed_tracker_plus_csv(monkeypatch):
    import accelerate.utils

    for name in ACCELERATE_TRACKERS:
        monkeypatch.setattr(accelerate.utils, f"is_{name}_available", lambda n=name: n in ("mlflow", "tensorboard"))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:9")  # configured (test_tracker_start.py: when not)
    assert resolve_report_to("all") == ["tensorboard", "mlflow", "csv"]
    assert resolve_report_to("csv,all") == ["csv", "tensorboard", "mlflow"]
    with pytest.raises(ConfigError, match=r"--report_to wandb,comet_ml: not installed; pip install wandb comet-ml"):
        resolve_report_to("all,wandb,comet_ml")


# ----------------------------------------------------------------------------- csv and tensorboard


def _log_csv_rows(out: str) -> None:
    """What the loop does with a recorder, minus the training: rows from every rank, a widening header."""
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True, log_with=[CSVTracker(out)])
    recorder = RunRecorder(out, accelerator.is_main_process, accelerator=accelerator)
    recorder.start_trackers("test", {"lr": 0.1, "resolved": {"world_size": accelerator.num_processes}}, 0)
    for step in (1, 2):
        recorder.log({"step": step, "loss": 1.0 / step, "lr": 0.1})
    recorder.log({"step": 2, "eval_accuracy": 0.5})  # a new column: the header widens
    recorder.log({"step": 3, "loss": 0.25, "lr": 0.05})
    recorder.close()
    accelerator.end_training()


def test_csv_tracker_writes_each_row_once_from_two_ranks_and_appends_on_resume(tmp_path):
    out = tmp_path / "run"
    run_ranks(lambda: _log_csv_rows(str(out)))
    expected = ["step,loss,lr,eval_accuracy", "1,1.0,0.1,", "2,0.5,0.1,", "2,,,0.5", "3,0.25,0.05,"]
    assert (out / "metrics.csv").read_text().splitlines() == expected
    run_ranks(lambda: _log_csv_rows(str(out)))  # a resumed run extends the file
    assert (out / "metrics.csv").read_text().splitlines() == expected + expected[1:]


def test_tensorboard_missing_is_one_clear_error(monkeypatch, tmp_path):
    import accelerate.utils

    monkeypatch.setattr(accelerate.utils, "is_tensorboard_available", lambda: False)
    with pytest.raises(ConfigError, match="pip install tensorboard"):
        resolve_report_to("tensorboard,csv")  # what the old --with_tracking all means
    assert [t.name for t in build_trackers(resolve_report_to("csv"), str(tmp_path))] == ["csv"]
    assert build_trackers([], str(tmp_path)) == []
    assert "tensorboard" not in resolve_report_to("all")  # all = the installed ones


def test_report_to_csv_alone_writes_metrics_csv(tmp_path, tiny_args):
    out = tmp_path / "run"
    train_ranks([*tiny_args, "--log_every", "8", "--report_to", "csv", "--output_dir", str(out)], world_size=1)
    with open(out / "metrics.csv", newline="") as fh:
        assert [int(r["step"]) for r in csv.DictReader(fh) if r["loss"]] == [8, 16]


def _tensorboard():
    """TensorBoard's reader of event files; ``torch.utils.tensorboard`` imported here, once: the forked ranks inherit
    it (each run's main process imported it otherwise, ~0.3 s)."""
    pytest.importorskip("torch.utils.tensorboard", reason="--report_to tensorboard needs the tensorboard package")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    return EventAccumulator


@pytest.mark.curves
def test_training_with_tracking_writes_csv_tensorboard_curves_and_the_model_card(tmp_path, tiny_args):
    """One 2-rank run as `accelerate launch --config_file cpu_2proc.yaml train.py ARGS` gives each rank: the trackers'
    files, curves.png, and the model card (_assert_model_card)."""
    EventAccumulator = _tensorboard()
    out = tmp_path / "run"
    args = [*tiny_args, *TRACKED, "--report_to", "tensorboard,csv", "--output_dir", str(out)]

    def launched():  # what `accelerate launch --config_file cpu_2proc.yaml train.py ARGS` gives each rank
        import os

        sys.argv = ["train.py", *args]
        os.environ["ACCELERATE_MIXED_PRECISION"] = "no"
        from accel_ddp.loop import train

        return train(parse_args(args))

    run_ranks(launched)
    records = read_metrics(out)
    steps, losses = series(records, "loss")
    assert steps == [2, 4, 6, 8, 10, 12, 14, 16]
    assert all(r["samples_per_sec"] > 0 for r in records if "loss" in r)

    with open(out / "metrics.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    csv_loss = [(int(r["step"]), float(r["loss"])) for r in rows if r["loss"]]
    assert csv_loss == list(zip(steps, losses, strict=True))  # one row per step: the main process only
    assert [(int(r["step"]), float(r["eval_accuracy"])) for r in rows if r["eval_accuracy"]] == [
        (s, v) for s, v in zip(*series(records, "eval_accuracy"), strict=True)]

    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    scalars = events.Scalars("loss")
    assert [e.step for e in scalars] == steps
    assert [e.value for e in scalars] == pytest.approx(losses, rel=1e-6)
    summary = read_summary(out)
    assert [(e.step, e.value) for e in events.Scalars("summary/optimizer_steps")] == [(16, 16)]
    assert [e.value for e in events.Scalars("summary/eval_accuracy")] == pytest.approx([summary["eval_accuracy"]])

    decode_png(out / "curves.png")  # plotted at the end of training
    _assert_model_card(out, args)


# ----------------------------------------------------------------------------- MLflow and W&B, offline


def test_mlflow_and_wandb_offline_hold_each_metric_once_after_a_two_rank_run(tmp_path, tiny_args, monkeypatch):
    mlflow = _mlflow()
    pytest.importorskip("wandb", reason="the wandb tracker needs wandb (pip install 'accel_ddp[tracking]')")
    _offline(tmp_path, monkeypatch)
    out = tmp_path / "run"
    train_ranks([*tiny_args, *TRACKED, "--report_to", "mlflow,wandb", "--tracker_project_name", "proj",
                 "--output_dir", str(out)])
    records = read_metrics(out)
    steps, losses = series(records, "loss")
    eval_steps, accuracies = series(records, "eval_accuracy")
    summary = read_summary(out)
    ids = json.loads((out / "trackers.json").read_text())

    client = mlflow.tracking.MlflowClient()
    (run,) = client.search_runs([client.get_experiment_by_name("proj").experiment_id])  # one run: the main process's
    assert run.info.run_id == ids["mlflow"]["run_id"] and run.info.run_name == "run"  # default: the folder's name
    history = client.get_metric_history(run.info.run_id, "loss")
    assert [m.step for m in history] == steps  # each step once, not once per rank
    assert [m.value for m in history] == pytest.approx(losses, rel=1e-6)
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "eval_accuracy")] == list(
        zip(eval_steps, accuracies, strict=True))
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "summary/train_seconds")] == [
        (16, pytest.approx(summary["train_seconds"]))]
    assert run.data.params["lr"] == "0.003" and run.data.params["resolved/world_size"] == "2"  # the config, once

    ((run_id, history, wandb_run, updates),) = _wandb_history(out)  # one W&B run
    assert run_id == ids["wandb"]["id"] and (wandb_run["project"], wandb_run["display_name"]) == ("proj", "run")
    assert [(row["_step"], row["loss"]) for row in history if "loss" in row] == list(zip(steps, losses, strict=True))
    assert [(row["_step"], row["eval_accuracy"]) for row in history if "eval_accuracy" in row] == list(
        zip(eval_steps, accuracies, strict=True))
    (config,) = updates["config"]  # the config, once
    assert config["lr"] == 0.003 and config["resolved/world_size"] == 2
    assert [s["summary/eval_accuracy"] for s in updates["summary"] if "summary/eval_accuracy" in s] == [
        summary["eval_accuracy"]]


def test_a_resumed_run_continues_the_same_tracker_runs_without_duplicate_steps(tmp_path, tiny_args, monkeypatch):
    """Killed at step 7 (checkpoint at 4, steps 2-6 already logged); the resumed run reopens the MLflow
    run by its id, drops or hides what csv and tensorboard hold past step 4, and each tracker ends with
    every step once. (W&B takes the same path as MLflow: test_a_resume_says_which_trackers_start_a_new_run
    checks it gets its id back; left out here, it would add two W&B starts.)"""
    mlflow = _mlflow()
    EventAccumulator = _tensorboard()
    _offline(tmp_path, monkeypatch)
    out = tmp_path / "run"
    args = [*tiny_args, *TRACKED, "--report_to", "csv,tensorboard,mlflow", "--run_name", "resumable",
            "--checkpointing_steps", "4", "--output_dir", str(out)]

    def fail_at_step_7():
        faults.install(fail_at=(7, 1))
        from accel_ddp.loop import train

        return train(parse_args(args))

    with pytest.raises(RankFailed, match="injected failure on rank 1 at step 7"):
        run_ranks(fail_at_step_7, grace=1)
    first_ids = json.loads((out / "trackers.json").read_text())
    train_ranks([*args, "--resume_from_checkpoint", "auto"])
    assert read_summary(out)["resumed_from_step"] == 4
    steps, losses = series(read_metrics(out), "loss")
    assert steps == [2, 4, 6, 8, 10, 12, 14, 16]
    assert json.loads((out / "trackers.json").read_text()) == first_ids

    client = mlflow.tracking.MlflowClient()
    (run,) = client.search_runs([client.get_experiment_by_name("accel_ddp").experiment_id])
    assert run.info.run_id == first_ids["mlflow"]["run_id"] and run.info.run_name == "resumable"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "loss")] == steps  # 6 not twice
    assert [m.step for m in client.get_metric_history(run.info.run_id, "summary/optimizer_steps")] == [16]


    with open(out / "metrics.csv", newline="") as fh:
        assert [int(r["step"]) for r in csv.DictReader(fh) if r["loss"]] == steps
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("loss")] == steps
    assert [e.value for e in events.Scalars("loss")] == pytest.approx(losses, rel=1e-6)


class _StubTracker(CSVTracker):
    """A csv tracker standing in for any tracker: it records how it was built."""

    built: list = []

    def __init__(self, name, run):
        super().__init__(run.output_dir)
        _StubTracker.built.append((name, run.start_step, dict(run.saved)))

    @property
    def tracker(self):  # what W&B's run and MLflow's active run answer
        return SimpleNamespace(id="new", info=SimpleNamespace(run_id="new", experiment_id="0"))


def test_a_resume_says_which_trackers_start_a_new_run(tmp_path, capfd, monkeypatch):
    import accel_ddp.tracking.trackers as trackers

    monkeypatch.setattr(trackers, "new_tracker", _StubTracker)
    out = tmp_path / "run"
    out.mkdir()
    (out / "trackers.json").write_text(json.dumps({"wandb": {"id": "abc123"}}))

    def resume_at(step):
        from accelerate import Accelerator

        accelerator = Accelerator(cpu=True, log_with=build_trackers(["wandb", "mlflow", "comet_ml"], str(out)))
        RunRecorder(str(out), True, accelerator=accelerator).start_trackers("p", {"lr": 0.1}, step)
        accelerator.end_training()
        return _StubTracker.built

    assert run_ranks(lambda: resume_at(4), world_size=1) == [[("wandb", 4, {"id": "abc123"}), ("mlflow", 4, {}),
                                                              ("comet_ml", 4, {})]]
    lines = _lines(capfd.readouterr().out)
    assert lines == ["accel_ddp: mlflow starts a new run at step 4 (trackers.json holds no run of it)",
                     "accel_ddp: comet_ml starts a new run at step 4 (accel_ddp continues csv, tensorboard, wandb "
                     "and mlflow runs only)"]  # wandb continues its run: no line
    assert run_ranks(lambda: resume_at(0), world_size=1) == [[("wandb", 0, {}), ("mlflow", 0, {}),
                                                              ("comet_ml", 0, {})]]
    assert _lines(capfd.readouterr().out) == []  # a fresh run starts new tracker runs without a word


def test_wandb_and_mlflow_are_built_to_reopen_the_kept_run(tmp_path, monkeypatch):
    from accel_ddp.tracking.trackers import TrackerRun, new_tracker

    monkeypatch.delenv("WANDB_DIR", raising=False)
    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)
    wandb = new_tracker("wandb", TrackerRun(str(tmp_path), "proj", "r1", 4, {"id": "abc123"}))
    assert (wandb.run_name, wandb.init_kwargs) == ("proj", {"name": "r1", "id": "abc123", "resume": "allow",
                                                            "dir": str(tmp_path)})
    mlflow = new_tracker("mlflow", TrackerRun(str(tmp_path), "proj", "r1", 4, {"run_id": "f00"}))
    assert (mlflow.experiment_name, mlflow.run_id, mlflow.run_name) == ("proj", "f00", "r1")


# ----------------------------------------------------------------------------- failures


def _lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("accel_ddp: ")]


def _earlier_run(out: Path) -> dict[str, str]:
    """Files an earlier run left in the output folder, which a refused start must not touch."""
    out.mkdir(parents=True)
    files = {"metrics.jsonl": '{"step": 2, "loss": 1.0}\n', "config.yaml": "lr: 0.1\n"}
    for name, text in files.items():
        (out / name).write_text(text)
    return files


def test_a_named_tracker_that_is_not_installed_stops_every_rank_before_training(tmp_path, tiny_args, capfd,
                                                                                monkeypatch):
    import accelerate.utils

    monkeypatch.setattr(accelerate.utils, "is_wandb_available", lambda: False)  # forked ranks inherit it
    out = tmp_path / "run"
    files = _earlier_run(out)
    assert main_ranks([*tiny_args, "--with_tracking", "--report_to", "csv,wandb", "--output_dir", str(out)]) == [2, 2]
    (line,) = _lines(capfd.readouterr().err)
    assert line == ("accel_ddp: error: --report_to wandb: not installed; pip install wandb "
                    "(or pip install 'accel_ddp[tracking]' for tensorboard, wandb and mlflow)")
    assert {p.name: p.read_text() for p in out.iterdir()} == files


@pytest.mark.parametrize("tracker, env, message", [
    ("mlflow", {"MLFLOW_TRACKING_URI": "bogus://nowhere"}, "set MLFLOW_TRACKING_URI to a reachable tracking server"),
    ("wandb", {"WANDB_MODE": "online"}, "log in with `wandb login` (or set WANDB_API_KEY)"),
])
def test_a_tracker_that_cannot_start_stops_every_rank_before_training(tmp_path, tiny_args, capfd, monkeypatch,
                                                                      tracker, env, message):
    if tracker == "mlflow":
        _mlflow()
    pytest.importorskip(tracker, reason=f"the {tracker} tracker needs {tracker}")
    _offline(tmp_path, monkeypatch)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    out = tmp_path / "run"
    files = _earlier_run(out)
    assert main_ranks([*tiny_args, "--with_tracking", "--report_to", f"csv,{tracker}", "--output_dir", str(out)]) == [
        2, 2]
    (line,) = _lines(capfd.readouterr().err)
    assert line.startswith(f"accel_ddp: error: --report_to {tracker}: it failed to start (") and message in line
    assert line.endswith(f"or leave {tracker} out of --report_to")
    # nothing overwritten or rewound (the run's lock file, .lock, is new and empty)
    assert {p.name: p.read_text() for p in out.iterdir() if p.is_file() and p.name != ".lock"} == files


def test_a_tracker_failing_mid_run_warns_once_and_the_run_goes_on(tmp_path, tiny_args, capfd, monkeypatch):
    EventAccumulator = _tensorboard()

    log = CSVTracker.log

    def log_until_step_4(self, values, step=None, **kwargs):
        if step is not None and step >= 4:
            raise OSError(28, "No space left on device")
        log(self, values, step, **kwargs)

    monkeypatch.setattr(CSVTracker, "log", log_until_step_4)
    out = tmp_path / "run"
    train_ranks([*tiny_args, *TRACKED, "--report_to", "csv,tensorboard", "--output_dir", str(out)])
    (line,) = _lines(capfd.readouterr().err)  # on a line of its own, not glued to the progress bar
    assert line == ("accel_ddp: warning: tracker csv failed at step 4 (OSError: [Errno 28] No space left on device); "
                    "it gets no more records and the run goes on (metrics.jsonl has them all)")
    steps = series(read_metrics(out), "loss")[0]
    assert steps[-1] == 16 and read_summary(out)["optimizer_steps"] == 16
    with open(out / "metrics.csv", newline="") as fh:
        assert [int(r["step"]) for r in csv.DictReader(fh)] == [2]  # what it wrote before failing
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("loss")] == steps  # the other trackers carry on


def test_an_unexpected_error_in_a_main_process_decision_ends_every_rank(tmp_path):
    """main_process_decides (tracker start, checkpoint choice): the other ranks must not wait in the broadcast."""
    from accelerate import PartialState

    from accel_ddp.lifecycle.failure import main_process_decides

    def decide_badly():
        state = PartialState(cpu=True)
        return main_process_decides(state, lambda: 1 / 0)

    with pytest.raises(RankFailed) as failed:
        run_ranks(decide_badly, timeout=60, grace=20)
    assert "ZeroDivisionError" in failed.value.failures[0]
    assert "the main process failed: ZeroDivisionError: division by zero" in failed.value.failures[1]


# ----------------------------------------------------------------------------- model card


def _assert_model_card(out: Path, args: list[str]) -> None:
    """The model card names the model, the data, the layout, the metrics, the command and the curves."""
    card = (out / "README.md").read_text()
    summary = read_summary(out)
    header = yaml.safe_load(card.split("---")[1])
    assert header == {"library_name": "accel_ddp", "tags": ["accel_ddp"], "metrics": ["accuracy"]}
    assert "`mlp` trained on `synthetic` (256 samples of shape [1, 8, 8])" in card
    assert "| world size | 2 ranks on 1 machine (MULTI_CPU, cpu) |" in card
    assert "| global batch | 32 samples = 2 x 16 per device x 1 accumulation steps |" in card
    assert f"| eval accuracy | {summary['eval_accuracy']:.4g} |" in card
    last_loss = series(read_metrics(out), "loss")[1][-1]
    assert f"| final training loss | {last_loss:.4g} |" in card
    command = ("accelerate launch --multi_gpu --num_processes 2 --mixed_precision no train.py "
               + " ".join(args))
    assert f"```bash\n{command}\n```" in card
    assert "](curves.png)" in card and (out / "curves.png").is_file()
    assert len(list(out.glob("README.md*"))) == 1  # written once, by the main process, no temp file left


@pytest.mark.parametrize("argv, env, expected", [
    (["train.py", "--epochs", "2"], {"ACCELERATE_MIXED_PRECISION": "bf16", "WORLD_SIZE": "8",
                                     "ACCELERATE_NUM_MACHINES": "2", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500",
                                     "ACCELERATE_DYNAMO_BACKEND": "INDUCTOR"},
     "accelerate launch --multi_gpu --num_processes 8 --num_machines 2 --machine_rank MACHINE_RANK --main_process_ip "
     "10.0.0.1 --main_process_port 29500 --mixed_precision bf16 --dynamo_backend inductor train.py --epochs 2"),
    (["/src/accel_ddp/__main__.py", "train", "--run_name", "a b"], {"ACCELERATE_MIXED_PRECISION": "no",
                                                                    "ACCELERATE_USE_FSDP": "true", "WORLD_SIZE": "4"},
     "accelerate launch --use_fsdp --num_processes 4 --mixed_precision no -m accel_ddp train --run_name 'a b'"),
    (["train.py"], {"TORCHELASTIC_RUN_ID": "x", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4"},
     "torchrun --nnodes 1 --nproc_per_node 4 train.py"),
    (["train.py"], {"ACCELERATE_MIXED_PRECISION": "no", "WORLD_SIZE": "2", "ACCEL_DDP_EXIT_CODES_DIR": "/tmp/x"},
     "accel-ddp launch --multi_gpu --num_processes 2 --mixed_precision no train.py"),  # what set that variable
    (["train.py", "--debug"], {}, "python train.py --debug"),
    (["/venv/bin/accel-ddp", "train", "--debug"], {}, "accel-ddp train --debug"),
])
def test_launch_command_is_rebuilt_from_argv_and_the_launcher_environment(argv, env, expected):
    assert launch_command(argv, env) == expected


# ----------------------------------------------------------------------------- damaged files of an earlier attempt


def _resume_refused(args: list[str], out, capfd) -> str:
    """An ``auto`` resume of ``out`` to step 8 on 2 ranks: exit 2 on both, one error line (returned), no
    traceback, and the folder exactly as it was."""
    before = _snapshot(out)
    capfd.readouterr()
    assert main_ranks([*args, "--max_steps", "8", "--resume_from_checkpoint", "auto"]) == [2, 2]
    err = capfd.readouterr().err
    (line,) = [line for line in err.splitlines() if line.startswith("accel_ddp: error")]
    assert err.count("accel_ddp: error") == 1
    assert "Traceback" not in err and _snapshot(out) == before
    return line


def _snapshot(folder: Path) -> dict[str, tuple[bytes, int]]:
    return {str(p.relative_to(folder)): (p.read_bytes(), p.stat().st_mtime_ns)
            for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_metrics_file_that_is_not_utf8_stops_the_resume_on_every_rank_and_nothing_is_touched(tmp_path, tiny_args,
                                                                                               capfd):
    """The resume read metrics.jsonl as UTF-8 (a UnicodeDecodeError traceback with trackers), or dropped the line
    quietly; metrics.csv was 'csv failed to start (UnicodeDecodeError ...); check csv's settings'. One run with csv,
    its folder damaged three times, a copy each time: metrics.jsonl resumed without trackers and with csv, then
    metrics.csv (a resume without trackers reads metrics.jsonl alone: the csv run's other files change nothing)."""
    run = tmp_path / "run"
    args = [*tiny_args, "--log_every", "1", "--checkpointing_steps", "2"]
    csv_tracking = ["--with_tracking", "--report_to", "csv"]
    assert main_ranks([*args, *csv_tracking, "--max_steps", "4", "--output_dir", str(run)]) == [0, 0]
    for damaged, tracking in [("metrics.jsonl", []), ("metrics.jsonl", csv_tracking), ("metrics.csv", csv_tracking)]:
        out = tmp_path / f"damaged-{damaged}-{'csv' if tracking else 'no_trackers'}"
        shutil.copytree(run, out)
        lines = (out / damaged).read_bytes().splitlines(keepends=True)
        (out / damaged).write_bytes(b"".join(lines[:1] + [lines[1].replace(b"0", b"\xff", 1)] + lines[2:]))
        line = _resume_refused([*args, *tracking, "--output_dir", str(out)], out, capfd)
        assert line == (f"accel_ddp: error: {out / damaged} line 2 is not UTF-8 text, so the file is damaged; "
                        "delete that line (or move the file aside: the run then writes a new one)")


@pytest.mark.parametrize("content, problem", [
    (b'{"wandb": {"id": "abc', "JSONDecodeError"),
    (b"\xff\xfe{}", "UnicodeDecodeError"),
    (b"[1, 2]", "it holds a JSON list, not an object"),
    (b'{"wandb": "abc123"}', "its wandb entry 'abc123' is not an object of run ids"),
    (b'{"wandb": {"id": 5}}', "its wandb entry {'id': 5} is not an object of run ids"),
])
def test_a_damaged_trackers_json_is_one_line_naming_it_and_the_fix(tmp_path, monkeypatch, content, problem):
    """It was read as nothing (the W&B run started anew, said to be missing from the file), or, with an entry that
    is no object, an AttributeError traceback; a number as the id went to W&B."""
    import accel_ddp.tracking.trackers as trackers

    monkeypatch.setattr(trackers, "new_tracker", _StubTracker)
    out = tmp_path / "run"
    out.mkdir()
    (out / "trackers.json").write_bytes(content)

    def resume_at(step):
        from accelerate import Accelerator

        accelerator = Accelerator(cpu=True, log_with=build_trackers(["wandb", "csv"], str(out)))
        RunRecorder(str(out), True, accelerator=accelerator).start_trackers("p", {"lr": 0.1}, step)

    with pytest.raises(RankFailed) as failed:
        run_ranks(lambda: resume_at(4), world_size=1)
    assert f"ConfigError: {out / 'trackers.json'} is damaged ({problem}" in str(failed.value)
    assert "); delete it to start new wandb runs from step 4 (this run's metrics.jsonl keeps every step), or " \
           "restore it" in str(failed.value)
    assert (out / "trackers.json").read_bytes() == content
    run_ranks(lambda: resume_at(0), world_size=1)  # a fresh start does not read it


def test_a_damaged_trackers_json_stops_the_resume_on_every_rank_before_anything_is_touched(tmp_path, tiny_args,
                                                                                          capfd, monkeypatch):
    import accelerate.utils

    import accel_ddp.tracking.trackers as trackers

    monkeypatch.setattr(trackers, "new_tracker", _StubTracker)  # W&B stands in; forked ranks inherit both
    monkeypatch.setattr(accelerate.utils, "is_wandb_available", lambda: True)
    out = tmp_path / "run"
    args = [*tiny_args, "--with_tracking", "--report_to", "wandb", "--checkpointing_steps", "2", "--output_dir",
            str(out)]
    assert main_ranks([*args, "--max_steps", "4"]) == [0, 0]
    assert json.loads((out / "trackers.json").read_text()) == {"wandb": {"id": "new", "project": "accel_ddp"}}
    (out / "trackers.json").write_text('{"wandb": ["new"]}')
    line = _resume_refused(args, out, capfd)
    assert f"{out / 'trackers.json'} is damaged (its wandb entry ['new'] is not an object of run ids)" in line


def test_reading_back_a_run_with_damaged_files_is_one_line_or_leaves_out_what_is_damaged(tmp_path, capsys):
    """`accel-ddp summary` and `plot` read summary.json, config.yaml and metrics.jsonl as UTF-8: a damaged one was
    a UnicodeDecodeError traceback."""
    from accel_ddp.cli import commands as cli

    out = tmp_path / "run"
    out.mkdir()
    (out / "summary.json").write_text(json.dumps({"world_size": 2, "optimizer_steps": 4}))
    (out / "config.yaml").write_bytes(b"model: caf\xe9\n")
    (out / "metrics.jsonl").write_bytes(b'{"step": 1, "loss": 2.0}\n{"step": 2, "loss": \xff}\n')
    assert cli.main(["summary", str(out)]) == 0  # the config's rows left out
    table = capsys.readouterr().out
    assert "optimizer steps" in table and "model" not in table
    assert cli.main(["plot", str(out)]) == 2
    assert capsys.readouterr().err.strip() == (f"accel-ddp: error: {out / 'metrics.jsonl'} line 2 is not UTF-8 text, "
                                               "so the file is damaged; delete that line (or move the file aside: the "
                                               "run then writes a new one)")
    (out / "summary.json").write_bytes(b'{"world_size": \xff}')
    assert cli.main(["summary", str(out)]) == 2
    assert f"no readable summary.json in {out}" in capsys.readouterr().err
