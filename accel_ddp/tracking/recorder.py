"""What a run leaves behind: resolved config, metrics lines, summary, trackers, curves.

Every writer here is a no-op off the main process, so the loop can call them on all ranks. Which
trackers, and how each is built and guarded: ``trackers.py``.

    OUTPUT_DIR/config.yaml     the resolved config (RunRecorder.write_config)
    OUTPUT_DIR/metrics.jsonl   always (RunRecorder)
    OUTPUT_DIR/summary.json    the final figures (RunRecorder.write_summary)
    OUTPUT_DIR/run.log         what the main process printed, each start's (RunRecorder.write_startup, console_log.py)
    OUTPUT_DIR/metrics.csv     --with_tracking --report_to csv (CSVTracker, through Accelerate's tracker API)
    OUTPUT_DIR/tensorboard/    --report_to tensorboard (Accelerate's TensorBoardTracker); wandb, mlflow and
                               the other trackers Accelerate knows go where their own settings say
    OUTPUT_DIR/trackers.json   the W&B and MLflow run ids, so that a resumed run continues those runs
    OUTPUT_DIR/curves.png      plot_run() (tracking/curves.py): losses, the task's metric, LR, samples/s against step
"""

from __future__ import annotations

import atexit
import json
import math
import os
import time
from typing import Any

from accel_ddp.lifecycle.failure import main_process_decides
from accel_ddp.outputs.files import OUTPUTS_FIX, WriteFailed, written
from accel_ddp.outputs.metrics_file import metrics_lines, parse_record, read_metrics
from accel_ddp.outputs.names import (
    CONFIG_NAME,
    CURVES_NAME,
    METRICS_NAME,
    RUN_LOG_NAME,
    SUMMARY_NAME,
    TRACKERS_NAME,
)
from accel_ddp.tracking.curves import plot_run
from accel_ddp.tracking.folder_snapshot import FolderSnapshot
from accel_ddp.tracking.tracker_thread import TrackerInterrupted
from accel_ddp.tracking.trackers import RUN_IDS, GuardedTracker, flat_hparams
from accel_ddp.util import yaml_text
from accel_ddp.util.atomic import atomic_write_text
from accel_ddp.util.messages import first_line, say, warn
from accel_ddp.util.validation import ConfigError


def _json_line(record: dict[str, Any], indent: int | None = None) -> str:
    """Strict JSON: a nan or inf (a diverged loss, an empty eval) becomes null, not a NaN literal no parser takes."""
    return json.dumps(_finite_or_null(record), indent=indent, allow_nan=False)


def _finite_or_null(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite_or_null(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite_or_null(v) for v in value]
    return value


def _logged_by(line: str, step: int) -> bool:
    """Is ``line`` a complete record of a step up to ``step``? A run killed mid-write leaves half a line."""
    record = parse_record(line)
    return record is not None and isinstance(record.get("step", 0), int) and record.get("step", 0) <= step


class RunRecorder:
    """Writes ``config.yaml``, ``metrics.jsonl`` and ``summary.json`` under ``output_dir``.

    Given the ``accelerator``, it also feeds Accelerate's trackers (``Accelerator(log_with=...)``,
    see ``trackers.tracking_kwargs``): ``start_trackers`` starts them with the config as hyperparameters,
    every ``log`` record goes to them too, keyed by its ``step``, and ``write_summary`` sends them
    the final summary.
    """

    def __init__(self, output_dir: str, is_main_process: bool, accelerator: Any = None, console: Any = None):
        self.output_dir = output_dir
        self.console = console  # a ConsoleLog (tracking/console_log.py): run.log gets what the console shows
        self.enabled = is_main_process
        self._state = accelerator  # collective decisions (rewind), when given
        self._accelerator = accelerator if accelerator is not None and accelerator.log_with else None
        self._trackers_started = False
        self._metrics = None
        if self.enabled:
            os.makedirs(output_dir, exist_ok=True)

    def rewind(self, step: int) -> None:
        """Drop metric records after ``step``: a fresh run (0) starts an empty file, a resumed one
        forgets the steps logged after its checkpoint, which the resumed run will log again.

        Collective when given an accelerator: a damaged metrics.jsonl is a ConfigError on every rank."""
        if self._state is not None:
            main_process_decides(self._state, lambda: self._rewind(step))
        elif self.enabled:
            self._rewind(step)

    def _rewind(self, step: int) -> None:
        self.close()
        path = os.path.join(self.output_dir, METRICS_NAME)
        if step and os.path.exists(path):
            kept = [line if line.endswith("\n") else line + "\n" for line in metrics_lines(path)
                    if _logged_by(line, step)]
            written(lambda: atomic_write_text(path, "".join(kept)), METRICS_NAME, self.output_dir, OUTPUTS_FIX)
        # Appending lets a resumed run extend the curve; a fresh run starts the file anew.
        self._metrics = open(path, "a" if step else "w", encoding="utf-8")

    def write_config(self, resolved: dict[str, Any]) -> None:
        self._write(CONFIG_NAME, yaml_text.dump(resolved))

    def write_startup(self, text: str, start_step: int) -> None:
        """``run.log``: this start's output after the starts it resumes (a fresh run starts it anew). With a console
        log, what the main process printed so far and, from now on, everything it prints (the block ``text``, about
        to be printed, included); without, the block."""
        path = os.path.join(self.output_dir, RUN_LOG_NAME)

        def append() -> None:
            if self.console is not None:
                self.console.start(path, append=bool(start_step))
                return
            with open(path, "a" if start_step else "w", encoding="utf-8") as fh:
                fh.write(f"{time.strftime('%Y-%m-%d %H:%M:%S %Z')}\n{text}")
        self._write_with(RUN_LOG_NAME, append)

    def _write(self, name: str, text: str) -> None:
        """``OUTPUT_DIR/name`` from the main process; a write the file system refuses is a WriteFailed on every rank
        (collective when given an accelerator)."""
        self._write_with(name, lambda: atomic_write_text(os.path.join(self.output_dir, name), text))

    def _write_with(self, name: str, write_file) -> None:
        def write() -> None:
            written(write_file, name, self.output_dir, OUTPUTS_FIX)
        if self._state is not None:
            main_process_decides(self._state, lambda: write() if self.enabled else None)
        elif self.enabled:
            write()

    def start_trackers(self, project: str, resolved: dict[str, Any], start_step: int, timeout: float | None = None,
                       preemption: Any = None) -> None:
        """Start the trackers on the main process, the resolved config as their hyperparameters (collective).

        Call it once the run knows where it starts and before ``rewind``: a tracker that cannot start,
        or does not within ``timeout`` seconds (``--tracker_start_timeout``), is a ConfigError on every
        rank, and the output folder is as it was (what the failed start created there is removed). A
        preemption signal during a start (``preemption``: the run's watcher) stops every rank at once:
        ``Preempted`` in the start-up phase "trackers". A resumed run (``start_step`` > 0) continues
        the tracker runs it interrupted where the tracker allows.
        """
        if self._accelerator is None or self._trackers_started:
            return
        interrupted = main_process_decides(
            self._accelerator, lambda: self._start_trackers(project, resolved, start_step, timeout, preemption))
        if preemption is not None:  # every rank: the main process's signal (or any rank's) ends the start-up here
            preemption.check_start_up("trackers")
        if interrupted:  # no watcher to say so (cannot happen: only a watcher interrupts)
            raise RuntimeError("the trackers' start was interrupted")
        self._trackers_started = True

    def _start_trackers(self, project: str, resolved: dict[str, Any], start_step: int, timeout: float | None,
                        preemption: Any) -> bool:
        """Main process: start every tracker; True when a preemption signal interrupted the start."""
        saved, logged = {}, set()
        trackers = [t for t in self._accelerator.log_with if isinstance(t, GuardedTracker)]
        if start_step:  # what the interrupted attempt kept of its tracker runs, and what it sent them after start_step
            saved = read_tracker_runs(os.path.join(self.output_dir, TRACKERS_NAME), [t.name for t in trackers],
                                      start_step)
            has_metrics = os.path.isfile(os.path.join(self.output_dir, METRICS_NAME))
            records = read_metrics(self.output_dir) if has_metrics else []
            logged = {(r["step"], frozenset(k for k in r if k not in ("time", "step")))
                      for r in records if isinstance(r.get("step"), int) and r["step"] > start_step}
        for tracker in trackers:
            tracker.prepare(start_step, saved.get(tracker.name, {}), logged, timeout, preemption)
        before = FolderSnapshot(self.output_dir)
        try:
            self._accelerator.init_trackers(project, config=flat_hparams(resolved))  # starts them: main process only
        except (ConfigError, TrackerInterrupted) as err:
            for tracker in trackers:  # those that started: closed, so that what they wrote can go
                tracker.finish(timeout)
            before.remove_new()
            if any(t.worker.abandoned for t in trackers):  # its thread may still write: once more at the exit
                atexit.register(before.remove_new_unless_reused)
            if isinstance(err, TrackerInterrupted):
                return True
            raise
        state = {t.name: kept for t in trackers if (kept := t.saved_state())}
        if state:
            path, text = os.path.join(self.output_dir, TRACKERS_NAME), json.dumps(state, indent=2) + "\n"
            written(lambda: atomic_write_text(path, text), TRACKERS_NAME, self.output_dir, OUTPUTS_FIX)
        for tracker in trackers:
            if start_step and not tracker.continued:
                why = (f"{TRACKERS_NAME} holds no run of it" if tracker.name in RUN_IDS
                       else "accel_ddp continues csv, tensorboard, wandb and mlflow runs only")
                say(f"{tracker.name} starts a new run at step {start_step} ({why})")
        return False

    def log(self, record: dict[str, Any]) -> None:
        if self.enabled:
            if self._metrics is None:  # used without rewind(): extend whatever is there
                self._metrics = open(os.path.join(self.output_dir, METRICS_NAME), "a", encoding="utf-8")
            line = _json_line({"time": round(time.time(), 3), **record}) + "\n"
            try:
                written(lambda: (self._metrics.write(line), self._metrics.flush()), METRICS_NAME, self.output_dir,
                        OUTPUTS_FIX)
            except WriteFailed as err:  # main process only, mid-run: no collective here
                err.only_this_rank = True  # it says so; the other ranks stop when its process has ended
                raise
        if self._trackers_started:  # each tracker's failures stay inside it (GuardedTracker)
            values = {k: v for k, v in record.items() if k != "step"}
            self._accelerator.log(values, step=record.get("step"))

    def plot(self) -> str | None:
        """Write ``curves.png`` (main process). A failed plot warns: the finished run's files stay valid."""
        if not self.enabled:
            return None
        if self._metrics is not None:
            self._metrics.flush()
        try:
            return plot_run(self.output_dir)
        except Exception as err:  # noqa: BLE001 - a picture must never turn a finished run into a failure
            warn(f"could not write {CURVES_NAME} ({type(err).__name__}: {err}); the run's "
                 f"other files are complete; rerun `accel-ddp plot {self.output_dir}`")
            return None

    def write_summary(self, summary: dict[str, Any], step: int) -> None:
        """``summary.json``, and the summary to each tracker at the run's last optimizer ``step``."""
        self._write(SUMMARY_NAME, _json_line(summary, indent=2) + "\n")
        if self._trackers_started and self.enabled:
            for tracker in self._accelerator.trackers:
                if isinstance(tracker, GuardedTracker):
                    tracker.log_summary(summary, step)

    def close(self) -> None:
        if self._metrics is not None:
            try:
                self._metrics.close()
            except OSError:  # its last write failed (a full disk) and was reported then; every line is flushed
                pass
            self._metrics = None


def read_tracker_runs(path: str, names: list[str], start_step: int) -> dict[str, dict[str, str]]:
    """``trackers.json``'s run of each tracker in ``names`` that reopens runs (``RUN_IDS``); {} without the file.

    A file that is not what ``_start_trackers`` writes (not JSON, not UTF-8, an entry that is no object of
    text ids) is a ConfigError: guessing would start new tracker runs, or hand a tracker a garbled id.
    """
    reopened = [name for name in names if name in RUN_IDS]
    if not reopened or not os.path.exists(path):
        return {}
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
        problem = None if isinstance(data, dict) else f"it holds a JSON {type(data).__name__}, not an object"
    except (OSError, ValueError) as err:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        data, problem = {}, f"{type(err).__name__}: {first_line(err, 120)}"
    for name in reopened:
        entry = data.get(name, {}) if problem is None else {}
        if not isinstance(entry, dict) or not all(isinstance(v, str) and v for v in entry.values()):
            problem = f"its {name} entry {entry!r:.80} is not an object of run ids"
    if problem:
        raise ConfigError(f"{path} is damaged ({problem}); delete it to start new {' and '.join(reopened)} runs from "
                          f"step {start_step} (this run's metrics.jsonl keeps every step), or restore it")
    return data


