"""Accelerate's trackers for ``--with_tracking --report_to``: which, built how, kept from stopping a run.

    Accelerator(**tracking_kwargs(state, "tensorboard,csv", "outputs/run"))   # log_with=[GuardedTracker, ...]

``RunRecorder`` (tracking.py) starts them and feeds them every record. Each tracker is wrapped in a
``GuardedTracker``: a failure to start is one ConfigError line naming the fix, a failure later warns
once and the run goes on. A resumed run continues the tracker runs it interrupted (``RUN_IDS``).
``CSVTracker`` writes ``OUTPUT_DIR/metrics.csv``: Accelerate 1.x has none.
"""

from __future__ import annotations

import csv
import io
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from accelerate.tracking import GeneralTracker, on_main_process
from tqdm.auto import tqdm

from accel_ddp.config import ACCELERATE_TRACKERS
from accel_ddp.lifecycle.failure import main_process_decides
from accel_ddp.outputs.metrics_file import damaged_line
from accel_ddp.outputs.names import CSV_NAME, METRICS_NAME, TENSORBOARD_SUBDIR
from accel_ddp.util.atomic import atomic_write_text
from accel_ddp.util.messages import first_line, line
from accel_ddp.util.validation import ConfigError


class CSVTracker(GeneralTracker):
    """``OUTPUT_DIR/metrics.csv``, one row per logged step: Accelerate 1.x has no CSV tracker.

    Passed to ``Accelerator(log_with=[...])`` as an instance, so nothing is registered globally.
    Columns grow as new keys appear (eval metrics arrive after the first loss lines): the file is
    then rewritten with the wider header. An existing file is extended; with ``keep_until`` (the
    step a run resumes from, 0 for a fresh one) its rows past that step go first, as in metrics.jsonl.
    """

    name = "csv"
    requires_logging_directory = False
    main_process_only = True

    def __init__(self, output_dir: str, keep_until: int | None = None):
        super().__init__()
        self.path = os.path.join(output_dir, CSV_NAME)
        self.keep_until = keep_until
        self.columns: list[str] = ["step"]
        self.rows: list[dict[str, Any]] = []

    @on_main_process
    def start(self) -> None:
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        if os.path.isfile(self.path):
            with open(self.path, "rb") as fh:
                raw = fh.read()
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as err:  # damage: the run only writes UTF-8
                raise ConfigError(damaged_line(self.path, raw.count(b"\n", 0, err.start) + 1)) from None
            reader = csv.DictReader(io.StringIO(text, newline=""))
            self.columns = list(reader.fieldnames or ["step"])
            self.rows = list(reader)
            if self.keep_until is not None:
                kept = [r for r in self.rows if r.get("step", "").isdigit() and int(r["step"]) <= self.keep_until]
                if len(kept) < len(self.rows):
                    self.rows = kept
                    atomic_write_text(self.path, self._render(self.rows, header=True))

    @property
    def tracker(self) -> str:
        return self.path

    @on_main_process
    def store_init_configuration(self, values: dict) -> None:
        """The config lives in config.yaml already; a CSV of metrics has no place for it."""

    @on_main_process
    def log(self, values: dict, step: int | None = None, **kwargs) -> None:
        row = {"step": "" if step is None else step}
        for key, value in values.items():
            if isinstance(value, dict):  # TensorBoard-style grouped scalars
                row.update({f"{key}/{sub}": v for sub, v in value.items()})
            else:
                row[key] = value.item() if hasattr(value, "item") else value
        new = [k for k in row if k not in self.columns]
        self.rows.append(row)
        if new or not os.path.isfile(self.path):
            self.columns += new
            atomic_write_text(self.path, self._render(self.rows, header=True))
        else:
            with open(self.path, "a", newline="", encoding="utf-8") as fh:
                fh.write(self._render([row], header=False))

    def _render(self, rows: list[dict[str, Any]], header: bool) -> str:
        out = io.StringIO()
        writer = csv.DictWriter(out, fieldnames=self.columns, restval="", lineterminator="\n")
        if header:
            writer.writeheader()
        writer.writerows(rows)
        return out.getvalue()


# pip package where it differs from the tracker's name (mlflow-skinny: the client without a server's dependencies)
PIP_NAMES = {"comet_ml": "comet-ml", "mlflow": "mlflow-skinny"}


# What to do when a tracker fails to start; the others get "check its settings".
START_FIXES = {
    "wandb": "log in with `wandb login` (or set WANDB_API_KEY), or log locally with WANDB_MODE=offline",
    "mlflow": "set MLFLOW_TRACKING_URI to a reachable tracking server (e.g. http://host:5000) or a local store "
              "(sqlite:///mlflow.db needs `pip install mlflow`)",
    "comet_ml": "log in with `comet login` (or set COMET_API_KEY)",
    "clearml": "configure it with `clearml-init` (or the CLEARML_* variables)",
    "swanlab": "log in with `swanlab login` (or set SWANLAB_API_KEY)",
}


# Trackers that continue the interrupted run on a resume: the file-based ones drop (csv) or hide
# (tensorboard's purge_step) what was logged after the checkpoint; these two reopen the run by its
# id, kept in OUTPUT_DIR/trackers.json, and skip the records they already hold (they cannot rewrite them).
RUN_IDS = {"wandb": "id", "mlflow": "run_id"}


def _installed(name: str) -> bool:
    import accelerate.utils

    return getattr(accelerate.utils, f"is_{name}_available")()


def resolve_report_to(report_to: str) -> list[str]:
    """The tracker names of ``--report_to`` (already checked by TrainConfig), each installed.

    ``all`` is every tracker Accelerate knows whose package is installed, then csv, as in the
    Hugging Face example scripts. A tracker named explicitly but not installed is a ConfigError:
    Accelerate would silently drop it.

        >>> resolve_report_to("all")   # e.g. ["tensorboard", "wandb", "csv"]
    """
    names: list[str] = []
    for name in report_to.split(","):
        names += [n for n in ACCELERATE_TRACKERS if _installed(n)] + ["csv"] if name == "all" else [name]
    names = list(dict.fromkeys(names))
    missing = [name for name in names if name != "csv" and not _installed(name)]
    if missing:
        packages = " ".join(PIP_NAMES.get(name, name) for name in missing)
        raise ConfigError(f"--report_to {','.join(missing)}: not installed; pip install {packages} "
                          "(or pip install 'accel_ddp[tracking]' for tensorboard, wandb and mlflow)")
    return names


@dataclass
class TrackerRun:
    """Where a tracker writes and what it continues; known once the run has agreed where it starts."""

    output_dir: str
    project: str  # --tracker_project_name
    name: str  # --run_name, default the output folder's name
    start_step: int = 0  # the step resumed from; 0 for a fresh run
    saved: dict[str, Any] = field(default_factory=dict)  # this tracker's entry of trackers.json (resumes only)


def _new_tracker(name: str, run: TrackerRun) -> GeneralTracker:
    """Accelerate's tracker ``name``, with this run's project, run name, folder and resume state."""
    from accelerate import tracking

    if name == "csv":
        return CSVTracker(run.output_dir, keep_until=run.start_step)
    if name == "tensorboard":  # same folder; events logged after the checkpoint are purged from TensorBoard's view
        return tracking.TensorBoardTracker(TENSORBOARD_SUBDIR, run.output_dir, purge_step=run.start_step + 1)
    if name == "wandb":
        where = {} if os.environ.get("WANDB_DIR") else {"dir": run.output_dir}  # OUTPUT_DIR/wandb/, not ./wandb/
        return tracking.WandBTracker(run.project, name=run.name, id=run.saved.get("id"), resume="allow", **where)
    if name == "mlflow":  # MLFLOW_TRACKING_URI says where; MLFLOW_EXPERIMENT_NAME and MLFLOW_RUN_ID win (Accelerate)
        return tracking.MLflowTracker(experiment_name=run.project, run_id=run.saved.get("run_id"), run_name=run.name)
    if name == "aim":  # an Aim repository in OUTPUT_DIR, as Accelerate does with project_dir
        return tracking.AimTracker(run.name, run.output_dir, experiment=run.project)
    if name == "clearml":
        return tracking.ClearMLTracker(run.project, project_name=run.project, task_name=run.name)
    if name == "dvclive":
        return tracking.DVCLiveTracker(dir=os.path.join(run.output_dir, "dvclive"))
    if name == "swanlab":
        return tracking.SwanLabTracker(run.project, experiment_name=run.name)
    if name == "trackio":
        return tracking.TrackioTracker(run.project, name=run.name)
    return tracking.CometMLTracker(run.project)  # comet_ml: it names the experiment itself


class GuardedTracker(GeneralTracker):
    """One tracker of ``--report_to``, built when the run starts and kept from stopping it.

    Passed to ``Accelerator(log_with=[...])`` on every rank; Accelerate starts and feeds it on the
    main process only. The real tracker is built in ``start`` (``_new_tracker``), once ``prepare``
    has said where the run starts: a resumed run reopens the tracker run it interrupted where the
    tracker can. A failure to start or to store the config is a ConfigError naming the fix; a
    failure after that warns once and the tracker gets no more records: the run goes on, and
    metrics.jsonl keeps everything.
    """

    requires_logging_directory = False
    main_process_only = True

    def __init__(self, name: str, run: TrackerRun):
        self.name = name
        super().__init__()
        self.run = run
        self.inner: GeneralTracker | None = None
        self.continued = False  # writing on in the tracker run a resumed run interrupted
        self.failed = False
        self.skip: set[tuple[int, frozenset[str]]] = set()  # (step, keys) records the continued run holds already

    def prepare(self, start_step: int, saved: dict[str, Any], logged: set[tuple[int, frozenset[str]]]) -> None:
        """Before ``start``: the step the run resumes from, what trackers.json kept of this tracker's run,
        and the records metrics.jsonl holds past ``start_step`` (sent to the trackers by the interrupted run)."""
        self.run.start_step, self.run.saved = start_step, saved if start_step else {}
        by_id = self.name in RUN_IDS and bool(self.run.saved.get(RUN_IDS[self.name]))
        self.continued = bool(start_step) and (self.name in ("csv", "tensorboard") or by_id)
        self.skip = logged if by_id else set()

    @property
    def tracker(self) -> Any:
        return None if self.inner is None else self.inner.tracker

    def start(self) -> None:
        try:
            self.inner = _new_tracker(self.name, self.run)
            self.inner.start()
        except ConfigError:  # one line of its own (a damaged metrics.csv)
            self.inner = None
            raise
        except Exception as err:  # noqa: BLE001 - each tracker raises its own types; all mean "cannot start"
            self.inner = None
            raise ConfigError(self._cannot_start(err)) from err

    def store_init_configuration(self, values: dict) -> None:
        if self.inner is None or (self.continued and self.name in RUN_IDS):  # the interrupted run has it already
            return
        try:
            self.inner.store_init_configuration(values)
        except Exception as err:  # noqa: BLE001
            raise ConfigError(self._cannot_start(err)) from err

    def log(self, values: dict, step: int | None = None, **kwargs) -> None:
        if (step, frozenset(values)) not in self.skip:
            self._guarded(step, lambda: self.inner.log(values, step=step, **kwargs))

    def log_summary(self, summary: dict[str, Any], step: int) -> None:
        """The final summary's numbers as ``summary/<key>`` (W&B: the run summary; csv: none, see summary.json)."""
        values = {f"summary/{k}": v for k, v in summary.items()
                  if isinstance(v, (int, float)) and not isinstance(v, bool)}
        if self.name == "wandb":
            self._guarded(step, lambda: self.inner.tracker.summary.update(values))
        elif self.name != "csv":
            self._guarded(step, lambda: self.inner.log(values, step=step))

    def saved_state(self) -> dict[str, Any]:
        """What a resumed run needs to reopen this tracker's run (trackers.json)."""
        if self.inner is None or self.name not in RUN_IDS:
            return {}
        if self.name == "wandb":
            return {"id": self.inner.tracker.id, "project": self.run.project}
        info = self.inner.tracker.info
        return {"run_id": info.run_id, "experiment_id": info.experiment_id}

    def finish(self) -> None:
        self._guarded(None, self.inner.finish if self.inner is not None else lambda: None)

    def _guarded(self, step: int | None, call: Callable[[], Any]) -> None:
        if self.inner is None or self.failed:
            return
        try:
            call()
        except Exception as err:  # noqa: BLE001 - a tracker's trouble must not end a training run
            self.failed = True
            where = "at the end of the run" if step is None else f"at step {step}"
            tqdm.write(line("warning", f"tracker {self.name} failed {where} ({type(err).__name__}: "
                            f"{first_line(err, 200, '...')}); it gets no more records and the run goes on "
                            f"({METRICS_NAME} has them all)"), file=sys.stderr)  # clears the progress bar's line first

    def _cannot_start(self, err: BaseException) -> str:
        fix = START_FIXES.get(self.name, f"check {self.name}'s settings")
        why = first_line(err, 200, "...")
        return (f"--report_to {self.name}: it failed to start ({type(err).__name__}: {why}); {fix}, "
                f"or leave {self.name} out of --report_to")


def build_trackers(names: list[str], output_dir: str, project: str = "accel_ddp",
                   run_name: str | None = None) -> list[GuardedTracker]:
    """``log_with`` for the trackers ``names`` (from ``resolve_report_to``); nothing starts yet."""
    run_name = run_name or os.path.basename(os.path.abspath(output_dir))
    return [GuardedTracker(name, TrackerRun(output_dir, project, run_name)) for name in names]


def tracking_kwargs(state: Any, report_to: str, output_dir: str, project: str = "accel_ddp",
                    run_name: str | None = None) -> dict[str, Any]:
    """Keyword arguments for ``Accelerator(...)``: ``log_with``, the trackers of ``--report_to``.

    Collective: the main process resolves the names (``all``; a missing package is a ConfigError on
    every rank at once), every rank builds the same list.

        >>> Accelerator(**tracking_kwargs(PartialState(), "tensorboard,csv", "outputs/run"))
    """
    names = main_process_decides(state, lambda: resolve_report_to(report_to))
    return {"log_with": build_trackers(names, output_dir, project, run_name)}


def flat_hparams(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested config -> the flat ``{name: bool|int|float|str}`` TensorBoard's hparams accept."""
    flat: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flat_hparams(value, f"{name}/"))
        elif value is None:
            flat[name] = "none"
        elif isinstance(value, (bool, int, float, str)):
            flat[name] = value
        else:
            flat[name] = str(list(value) if isinstance(value, tuple) else value)
    return flat
