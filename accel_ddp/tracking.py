"""What a run leaves behind: resolved config, metrics lines, summary, trackers, curves, progress bar.

Every writer here is a no-op off the main process, so the loop can call them on all ranks.

    OUTPUT_DIR/metrics.jsonl   always (RunRecorder)
    OUTPUT_DIR/metrics.csv     --with_tracking --report_to csv (CSVTracker, through Accelerate's tracker API)
    OUTPUT_DIR/tensorboard/    --report_to tensorboard (Accelerate's TensorBoardTracker); wandb, mlflow and
                               the other trackers Accelerate knows go where their own settings say
    OUTPUT_DIR/trackers.json   the W&B and MLflow run ids, so that a resumed run continues those runs
    OUTPUT_DIR/curves.png      plot_run(): loss, eval accuracy, LR and samples/s against step
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import yaml
from accelerate.tracking import GeneralTracker, on_main_process
from tqdm.auto import tqdm

from accel_ddp.config import ACCELERATE_TRACKERS, ConfigError
from accel_ddp.failure import main_process_decides
from accel_ddp.files import atomic_write_text
from accel_ddp.outputs import (
    CONFIG_NAME,
    CSV_NAME,
    CURVES_NAME,
    METRICS_NAME,
    PROFILE_SUBDIR,
    SUMMARY_NAME,
    TENSORBOARD_SUBDIR,
    TRACKERS_NAME,
)
from accel_ddp.report import plot_run, read_metrics


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


class RunRecorder:
    """Writes ``config.yaml``, ``metrics.jsonl`` and ``summary.json`` under ``output_dir``.

    Given the ``accelerator``, it also feeds Accelerate's trackers (``Accelerator(log_with=...)``,
    see ``tracking_kwargs``): ``start_trackers`` starts them with the config as hyperparameters,
    every ``log`` record goes to them too, keyed by its ``step``, and ``write_summary`` sends them
    the final summary.
    """

    def __init__(self, output_dir: str, is_main_process: bool, accelerator: Any = None):
        self.output_dir = output_dir
        self.enabled = is_main_process
        self._accelerator = accelerator if accelerator is not None and accelerator.log_with else None
        self._trackers_started = False
        self._metrics = None
        if self.enabled:
            os.makedirs(output_dir, exist_ok=True)

    def rewind(self, step: int) -> None:
        """Drop metric records after ``step``: a fresh run (0) starts an empty file, a resumed one
        forgets the steps logged after its checkpoint, which the resumed run will log again."""
        if not self.enabled:
            return
        self.close()
        path = os.path.join(self.output_dir, METRICS_NAME)
        if step and os.path.exists(path):
            with open(path, encoding="utf-8") as fh:
                kept = [line for line in fh if line.strip() and json.loads(line).get("step", 0) <= step]
            atomic_write_text(path, "".join(kept))
        # Appending lets a resumed run extend the curve; a fresh run starts the file anew.
        self._metrics = open(path, "a" if step else "w", encoding="utf-8")

    def write_config(self, resolved: dict[str, Any]) -> None:
        if self.enabled:
            atomic_write_text(os.path.join(self.output_dir, CONFIG_NAME), yaml.safe_dump(resolved, sort_keys=False))

    def start_trackers(self, project: str, resolved: dict[str, Any], start_step: int) -> None:
        """Start the trackers on the main process, the resolved config as their hyperparameters (collective).

        Call it once the run knows where it starts and before ``rewind``: a tracker that cannot start
        is a ConfigError on every rank, and nothing in the output folder has changed yet. A resumed
        run (``start_step`` > 0) continues the tracker runs it interrupted where the tracker allows.
        """
        if self._accelerator is None or self._trackers_started:
            return
        main_process_decides(self._accelerator, lambda: self._start_trackers(project, resolved, start_step))
        self._trackers_started = True

    def _start_trackers(self, project: str, resolved: dict[str, Any], start_step: int) -> None:
        saved, logged = {}, set()
        if start_step:  # what the interrupted attempt kept of its tracker runs, and what it sent them after start_step
            saved = _read_json(os.path.join(self.output_dir, TRACKERS_NAME))
            has_metrics = os.path.isfile(os.path.join(self.output_dir, METRICS_NAME))
            records = read_metrics(self.output_dir) if has_metrics else []
            logged = {(r["step"], frozenset(k for k in r if k not in ("time", "step")))
                      for r in records if isinstance(r.get("step"), int) and r["step"] > start_step}
        trackers = [t for t in self._accelerator.log_with if isinstance(t, GuardedTracker)]
        for tracker in trackers:
            tracker.prepare(start_step, saved.get(tracker.name, {}), logged)
        self._accelerator.init_trackers(project, config=flat_hparams(resolved))  # starts them: main process only
        state = {t.name: kept for t in trackers if (kept := t.saved_state())}
        if state:
            atomic_write_text(os.path.join(self.output_dir, TRACKERS_NAME), json.dumps(state, indent=2) + "\n")
        for tracker in trackers:
            if start_step and not tracker.continued:
                why = (f"{TRACKERS_NAME} holds no run of it" if tracker.name in RUN_IDS
                       else "accel_ddp continues csv, tensorboard, wandb and mlflow runs only")
                print(f"accel_ddp: {tracker.name} starts a new run at step {start_step} ({why})", flush=True)

    def log(self, record: dict[str, Any]) -> None:
        if self.enabled:
            if self._metrics is None:  # used without rewind(): extend whatever is there
                self._metrics = open(os.path.join(self.output_dir, METRICS_NAME), "a", encoding="utf-8")
            self._metrics.write(_json_line({"time": round(time.time(), 3), **record}) + "\n")
            self._metrics.flush()
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
            print(f"accel_ddp: warning: could not write {CURVES_NAME} ({type(err).__name__}: {err}); the run's "
                  f"other files are complete; rerun `accel-ddp plot {self.output_dir}`", file=sys.stderr)
            return None

    def write_summary(self, summary: dict[str, Any], step: int) -> None:
        """``summary.json``, and the summary to each tracker at the run's last optimizer ``step``."""
        if self.enabled:
            atomic_write_text(os.path.join(self.output_dir, SUMMARY_NAME), _json_line(summary, indent=2) + "\n")
        if self._trackers_started and self.enabled:
            for tracker in self._accelerator.trackers:
                if isinstance(tracker, GuardedTracker):
                    tracker.log_summary(summary, step)

    def close(self) -> None:
        if self._metrics is not None:
            self._metrics.close()
            self._metrics = None


def progress_bar(total: int, initial: int, enabled: bool) -> tqdm:
    """One bar per machine's first process; other ranks get a disabled bar with the same API."""
    return tqdm(total=total, initial=initial, disable=not enabled, unit="step", dynamic_ncols=True)


class ThroughputMeter:
    """Training samples per second between two log lines, evaluation time left out.

        meter = ThroughputMeter(global_batch_size=64)
        ...  # at a log line:        record["samples_per_sec"] = meter.rate(step)
        ...  # after an evaluation:  meter.reset(step)
    """

    def __init__(self, global_batch_size: int, step: int = 0):
        self.global_batch_size = global_batch_size
        self.reset(step)

    def reset(self, step: int) -> None:
        self._step, self._time = step, time.perf_counter()

    def rate(self, step: int) -> float:
        now = time.perf_counter()
        samples = (step - self._step) * self.global_batch_size
        rate = samples / max(now - self._time, 1e-9)
        self._step, self._time = step, now
        return rate


class EpochTimer:
    """Per-epoch step-time percentiles, samples/s, the share of step time spent waiting for data, host CPU.

    Host clock only, no device synchronisation: on a GPU the interval between two optimizer steps
    equals the device's step time once the launch queue is full, so percentiles stay honest
    without stalling the pipeline. Evaluation and checkpoint time is excluded (``pause``).
    ``cpu_ms_per_step`` is this process's CPU time (all its threads) per optimizer step: near the
    step time, the host is what bounds the step (a CPU run, or a GPU waiting for Python).

        timer.start_epoch()
        for batch in timed(loader, timer): ...; timer.step_done()
        record = timer.end_epoch()   # {"samples_per_sec", "step_time_p50_ms", "step_time_p90_ms", "data_wait_share",
                                     #  "cpu_ms_per_step"}
    """

    def __init__(self, global_batch_size: int):
        self.global_batch_size = global_batch_size
        self.all_steps: list[float] = []
        self.all_wait = 0.0
        self.all_cpu = 0.0
        self.start_epoch()

    def start_epoch(self) -> None:
        self._steps: list[float] = []
        self._wait = 0.0
        self._cpu = 0.0
        self.pause()

    def waited(self, seconds: float) -> None:
        self._wait += seconds

    def step_done(self) -> None:
        now, cpu = time.perf_counter(), time.process_time()
        self._steps.append(now - self._last)
        self._cpu += cpu - self._last_cpu
        self._last, self._last_cpu = now, cpu

    def pause(self) -> None:
        """Call after work that is not training (eval, checkpoint): the next interval starts now."""
        self._last, self._last_cpu = time.perf_counter(), time.process_time()

    def end_epoch(self) -> dict[str, float]:
        self.all_steps.extend(self._steps)
        self.all_wait += self._wait
        self.all_cpu += self._cpu
        return _step_stats(self._steps, self._wait, self._cpu, self.global_batch_size)

    def totals(self) -> dict[str, float]:
        return _step_stats(self.all_steps, self.all_wait, self.all_cpu, self.global_batch_size)


def _step_stats(steps: list[float], wait: float, cpu: float, global_batch_size: int) -> dict[str, float]:
    if not steps:
        return {}
    ordered = sorted(steps)
    total = sum(steps)
    return {
        "samples_per_sec": len(steps) * global_batch_size / max(total, 1e-9),
        "step_time_p50_ms": 1e3 * ordered[len(ordered) // 2],
        "step_time_p90_ms": 1e3 * ordered[min(int(0.9 * len(ordered)), len(ordered) - 1)],
        "data_wait_share": min(wait / max(total, 1e-9), 1.0),
        "cpu_ms_per_step": 1e3 * cpu / len(steps),
    }


def timed(batches, timer: EpochTimer):
    """Yield from ``batches``, adding the time spent blocked on each one to ``timer``."""
    iterator = iter(batches)
    while True:
        started = time.perf_counter()
        try:
            batch = next(iterator)
        except StopIteration:
            return
        timer.waited(time.perf_counter() - started)
        yield batch


def _peak_rss_kib(pid: int | str = "self") -> float:
    """A process's peak resident set (``VmHWM``) in KiB; 0 where /proc does not say."""
    try:
        with open(f"/proc/{pid}/status", encoding="utf-8") as fh:
            return float(next((line.split()[1] for line in fh if line.startswith("VmHWM:")), 0))
    except OSError:  # no /proc (macOS), or the process just ended
        return 0.0


def peak_memory_mb() -> tuple[float, float]:
    """(this process's peak RSS, the largest peak RSS among its live child processes), in MiB.

    The children of a rank are its DataLoader workers, where the memory-mapped path reads and
    decodes. Peak RSS counts file pages a process has mapped (the memory-mapped path drops its own
    after each batch), and a forked worker's figure includes pages it still shares with its parent,
    so the two are not to be added up.
    """
    import resource

    own = _peak_rss_kib() or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (1024 if sys.platform == "darwin"
                                                                                    else 1)  # bytes on macOS
    try:
        import psutil

        children = [_peak_rss_kib(child.pid) for child in psutil.Process().children()]
    except Exception:  # noqa: BLE001 - psutil missing or a child gone: the figure is informative only
        children = []
    return own / 1024, max(children, default=0.0) / 1024


def memory_record(accelerator) -> dict[str, dict[str, float]]:
    """Every rank's peak RSS and its workers' (collective), in MiB: ``{"peak_rss_mb": {"rank0": ..., ...}, ...}``.

    Logged per epoch to metrics.jsonl (a dict of scalars: TensorBoard's ``add_scalars``, CSV columns
    ``peak_rss_mb/rank0``); summary.json keeps the largest over ranks (:func:`largest`).
    """
    import torch

    mine = torch.tensor(peak_memory_mb(), dtype=torch.float64, device=accelerator.device)
    every = accelerator.gather(mine).view(-1, 2).tolist()
    return {key: {f"rank{rank}": round(values[i], 1) for rank, values in enumerate(every)}
            for i, key in enumerate(("peak_rss_mb", "peak_worker_rss_mb"))}


def largest(record: dict[str, dict[str, float]]) -> dict[str, float]:
    """The largest value over ranks of each key of a :func:`memory_record`."""
    return {key: max(per_rank.values()) for key, per_rank in record.items()}


class StepProfiler:
    """``--profile``: a torch.profiler trace of a few optimizer steps, one Chrome trace per rank.

    Each rank writes ``OUTPUT_DIR/profile/rank<R>.json`` (open it in Perfetto or chrome://tracing):
    like the per-rank RNG files of a checkpoint, a deliberate exception to "only rank 0 writes".
    Steps 1-2 are skipped (start-up), 3-4 warm up, 5-9 are recorded.
    """

    def __init__(self, enabled: bool, output_dir: str, rank: int):
        self._profiler = None
        if not enabled:
            return
        import torch

        folder = os.path.join(output_dir, PROFILE_SUBDIR)
        os.makedirs(folder, exist_ok=True)
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.path = os.path.join(folder, f"rank{rank}.json")
        self._profiler = torch.profiler.profile(
            activities=activities,
            schedule=torch.profiler.schedule(wait=2, warmup=2, active=5, repeat=1),
            on_trace_ready=lambda prof: prof.export_chrome_trace(self.path),
            record_shapes=True,
        )
        self._profiler.start()

    def step(self) -> None:
        if self._profiler is not None:
            self._profiler.step()

    def stop(self) -> None:
        if self._profiler is not None:
            self._profiler.stop()
            self._profiler = None


# ----------------------------------------------------------------------------- Accelerate trackers


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
            with open(self.path, newline="", encoding="utf-8") as fh:
                reader = csv.DictReader(fh)
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
            tqdm.write(f"accel_ddp: warning: tracker {self.name} failed {where} ({type(err).__name__}: "
                       f"{_first_line(err)}); it gets no more records and the run goes on "
                       f"({METRICS_NAME} has them all)", file=sys.stderr)  # clears the progress bar's line first

    def _cannot_start(self, err: BaseException) -> str:
        fix = START_FIXES.get(self.name, f"check {self.name}'s settings")
        return (f"--report_to {self.name}: it failed to start ({type(err).__name__}: {_first_line(err)}); {fix}, "
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


def _first_line(err: BaseException) -> str:
    line = (str(err).strip().splitlines() or [type(err).__name__])[0]
    return line if len(line) <= 200 else line[:197] + "..."


def _read_json(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


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
