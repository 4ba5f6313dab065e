"""Accelerate's trackers for ``--with_tracking --report_to``: which, built how, kept from stopping a run.

    Accelerator(**tracking_kwargs(state, "tensorboard,csv", "outputs/run"))   # log_with=[GuardedTracker, ...]

``RunRecorder`` (recorder.py) starts them and feeds them every record. Each tracker is wrapped in a
``GuardedTracker``: a failure to start (or a start slower than ``--tracker_start_timeout``) is one
ConfigError line naming the fix, a failure later warns once and the run goes on. Every call into
the trackers runs on one ``TrackerThread`` (tracker_thread.py), so a start can be given up on. A
resumed run continues the tracker runs it interrupted (``RUN_IDS``). ``CSVTracker`` writes
``OUTPUT_DIR/metrics.csv`` (csv_tracker.py): Accelerate 1.x has none. ``all``: configured.py; how each
tracker is built: tracker_builds.py.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from accelerate.tracking import GeneralTracker

from accel_ddp.config import ACCELERATE_TRACKERS
from accel_ddp.lifecycle.failure import main_process_decides
from accel_ddp.outputs.names import METRICS_NAME
from accel_ddp.tracking.configured import skipped_line, unconfigured
from accel_ddp.tracking.csv_tracker import CSVTracker
from accel_ddp.tracking.tracker_builds import TrackerRun, new_tracker
from accel_ddp.tracking.tracker_thread import TrackerInterrupted, TrackerThread, TrackerTimedOut
from accel_ddp.util.messages import first_line, note, warn
from accel_ddp.util.validation import ConfigError

__all__ = ["CSVTracker", "TrackerRun", "new_tracker"]  # built elsewhere, used from here


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
    """The tracker names of ``--report_to`` (already checked with the options: config/checks.py), each installed.

    ``all`` is every tracker Accelerate knows whose package is installed and which is configured to
    run here (configured.py), then csv, as in the Hugging Face example scripts; the installed ones
    it leaves out are named in one note. A tracker named explicitly but not installed is a
    ConfigError: Accelerate would silently drop it.

        >>> resolve_report_to("all")   # e.g. ["tensorboard", "csv"], and a note: "not logging to wandb (set ...)"
    """
    names: list[str] = []
    skipped: list[str] = []
    for name in report_to.split(","):
        if name != "all":
            names.append(name)
            continue
        installed = [n for n in ACCELERATE_TRACKERS if _installed(n)]
        skipped += [n for n in installed if unconfigured(n) is not None]
        names += [n for n in installed if n not in skipped] + ["csv"]
    names = list(dict.fromkeys(names))
    missing = [name for name in names if name != "csv" and not _installed(name)]
    if missing:
        packages = " ".join(PIP_NAMES.get(name, name) for name in missing)
        raise ConfigError(f"--report_to {','.join(missing)}: not installed; pip install {packages} "
                          "(or pip install 'accel_ddp[tracking]' for tensorboard, wandb and mlflow)")
    if skipped := [n for n in dict.fromkeys(skipped) if n not in names]:  # `all,wandb`: named, so required
        note(skipped_line(skipped))
    return names


def flat_scalars(values: dict[str, Any]) -> dict[str, Any]:
    """``{"peak_rss_mb": {"rank0": 1.0}}`` -> ``{"peak_rss_mb/rank0": 1.0}``: trackers take scalars (MLflow drops a
    dict with a warning; TensorBoard would write a folder of event files per key)."""
    flat: dict[str, Any] = {}
    for key, value in values.items():
        if isinstance(value, dict):
            flat.update({f"{key}/{sub}": v for sub, v in value.items()})
        else:
            flat[key] = value
    return flat


class GuardedTracker(GeneralTracker):
    """One tracker of ``--report_to``, built when the run starts and kept from stopping it.

    Passed to ``Accelerator(log_with=[...])`` on every rank; Accelerate starts and feeds it on the
    main process only. The real tracker is built in ``start`` (``new_tracker``), once ``prepare``
    has said where the run starts: a resumed run reopens the tracker run it interrupted where the
    tracker can. Every call into it runs on the run's ``TrackerThread``. A failure to start or to
    store the config, or no answer within ``start_timeout`` seconds, is a ConfigError naming the fix;
    a preemption signal meanwhile raises ``TrackerInterrupted``. A failure after that warns once and
    the tracker gets no more records: the run goes on, and metrics.jsonl keeps everything.
    """

    requires_logging_directory = False
    main_process_only = True

    def __init__(self, name: str, run: TrackerRun, worker: TrackerThread | None = None):
        self.name = name
        super().__init__()
        self.run = run
        self.worker = worker or TrackerThread()  # shared by a run's trackers (build_trackers)
        self.worker.users += 1
        self._released = False
        self.inner: GeneralTracker | None = None
        self.continued = False  # writing on in the tracker run a resumed run interrupted
        self.failed = False
        self.skip: set[tuple[int, frozenset[str]]] = set()  # (step, keys) records the continued run holds already
        self.start_timeout: float | None = None  # --tracker_start_timeout
        self.watcher: Any = None  # the run's PreemptionWatcher: a signal stops the wait for a start

    def prepare(self, start_step: int, saved: dict[str, Any], logged: set[tuple[int, frozenset[str]]],
                start_timeout: float | None = None, watcher: Any = None) -> None:
        """Before ``start``: the step the run resumes from, what trackers.json kept of this tracker's run,
        and the records metrics.jsonl holds past ``start_step`` (sent to the trackers by the interrupted run);
        how long its start may take, and the watcher whose signal ends the wait."""
        self.run.start_step, self.run.saved = start_step, saved if start_step else {}
        by_id = self.name in RUN_IDS and bool(self.run.saved.get(RUN_IDS[self.name]))
        self.continued = bool(start_step) and (self.name in ("csv", "tensorboard") or by_id)
        self.skip = logged if by_id else set()
        self.start_timeout, self.watcher = start_timeout, watcher

    @property
    def tracker(self) -> Any:
        return None if self.inner is None else self.inner.tracker

    def start(self) -> None:
        def build_and_start() -> GeneralTracker:
            inner = new_tracker(self.name, self.run)
            inner.start()
            return inner

        try:
            self.inner = self._bounded(build_and_start)
        except (ConfigError, TrackerInterrupted):  # a line of its own (a damaged metrics.csv, a start too slow)
            self.inner = None
            raise
        except Exception as err:  # noqa: BLE001 - each tracker raises its own types; all mean "cannot start"
            self.inner = None
            raise ConfigError(self._cannot_start(err)) from err

    def store_init_configuration(self, values: dict) -> None:
        if self.inner is None or (self.continued and self.name in RUN_IDS):  # the interrupted run has it already
            return
        try:
            self._bounded(lambda: self.inner.store_init_configuration(values))
        except (ConfigError, TrackerInterrupted):
            raise
        except Exception as err:  # noqa: BLE001
            raise ConfigError(self._cannot_start(err)) from err

    def _bounded(self, call: Callable[[], Any]) -> Any:
        """``call()`` on the tracker thread, within ``start_timeout`` seconds (a ConfigError past it)."""
        try:
            return self.worker.call(call, timeout=self.start_timeout, watcher=self.watcher)
        except TrackerTimedOut:
            raise ConfigError(f"--report_to {self.name}: it did not start within --tracker_start_timeout "
                              f"{self.start_timeout:g} s (a server that does not answer?); check that its server "
                              f"is reachable, raise --tracker_start_timeout, or leave {self.name} out of "
                              "--report_to") from None

    def log(self, values: dict, step: int | None = None, **kwargs) -> None:
        if (step, frozenset(values)) not in self.skip:
            scalars = flat_scalars(values)
            self._guarded(step, lambda: self.inner.log(scalars, step=step, **kwargs))

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

    def finish(self, timeout: float | None = None) -> None:
        """Close the tracker (``timeout``: at most this long, after a failed start); the last one ends the thread."""
        self._guarded(None, self.inner.finish if self.inner is not None else lambda: None, timeout)
        self.inner = None
        if not self._released:  # the thread ends once every tracker of the run has finished
            self._released = True
            self.worker.users -= 1
            if self.worker.users <= 0:
                self.worker.close()

    def _guarded(self, step: int | None, call: Callable[[], Any], timeout: float | None = None) -> None:
        if self.inner is None or self.failed or self.worker.abandoned:
            return
        try:
            self.worker.call(call, timeout=timeout)
        except Exception as err:  # noqa: BLE001 - a tracker's trouble must not end a training run
            self.failed = True
            where = "at the end of the run" if step is None else f"at step {step}"
            warn(f"tracker {self.name} failed {where} ({type(err).__name__}: {first_line(err, 200, '...')}); it gets "
                 f"no more records and the run goes on ({METRICS_NAME} has them all)", above_bar=True)

    def _cannot_start(self, err: BaseException) -> str:
        fix = START_FIXES.get(self.name, f"check {self.name}'s settings")
        why = first_line(err, 200, "...")
        return (f"--report_to {self.name}: it failed to start ({type(err).__name__}: {why}); {fix}, "
                f"or leave {self.name} out of --report_to")


def build_trackers(names: list[str], output_dir: str, project: str = "accel_ddp",
                   run_name: str | None = None) -> list[GuardedTracker]:
    """``log_with`` for the trackers ``names`` (from ``resolve_report_to``); nothing starts yet."""
    run_name = run_name or os.path.basename(os.path.abspath(output_dir))
    worker = TrackerThread()  # one for all: MLflow's active run belongs to the thread that started it
    return [GuardedTracker(name, TrackerRun(output_dir, project, run_name), worker) for name in names]


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
