"""What a run leaves behind: resolved config, metrics lines, summary, trackers, curves, progress bar.

Every writer here is a no-op off the main process, so the loop can call them on all ranks.

    OUTPUT_DIR/metrics.jsonl   always (RunRecorder)
    OUTPUT_DIR/metrics.csv     --with_tracking csv|all (CSVTracker, through Accelerate's tracker API)
    OUTPUT_DIR/tensorboard/    --with_tracking tensorboard|all (Accelerate's TensorBoardTracker)
    OUTPUT_DIR/curves.png      plot_run(): loss, eval accuracy, LR and samples/s against step
"""

from __future__ import annotations

import csv
import io
import json
import os
import sys
import time
from typing import Any

import yaml
from accelerate.tracking import GeneralTracker, on_main_process
from tqdm.auto import tqdm

from accel_ddp.config import ConfigError
from accel_ddp.outputs import (
    CONFIG_NAME,
    CSV_NAME,
    CURVES_NAME,
    METRICS_NAME,
    PROFILE_SUBDIR,
    SUMMARY_NAME,
    TENSORBOARD_SUBDIR,
)
from accel_ddp.report import plot_run


def _atomic_write_text(path: str, text: str) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(text)
    os.replace(tmp, path)


class RunRecorder:
    """Writes ``config.yaml``, ``metrics.jsonl`` and ``summary.json`` under ``output_dir``.

    Given the ``accelerator``, it also feeds Accelerate's trackers (``Accelerator(log_with=...)``,
    see ``tracking_kwargs``): ``write_config`` starts them with the config as hyperparameters and
    every ``log`` record goes to them too, keyed by its ``step``.
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
            _atomic_write_text(path, "".join(kept))
        # Appending lets a resumed run extend the curve; a fresh run starts the file anew.
        self._metrics = open(path, "a" if step else "w", encoding="utf-8")

    def write_config(self, resolved: dict[str, Any]) -> None:
        if self.enabled:
            _atomic_write_text(os.path.join(self.output_dir, CONFIG_NAME), yaml.safe_dump(resolved, sort_keys=False))
        if self._accelerator is not None and not self._trackers_started:
            # init_trackers and log run on the main process only (Accelerate's @on_main_process).
            self._accelerator.init_trackers(TENSORBOARD_SUBDIR, config=flat_hparams(resolved))
            self._trackers_started = True

    def log(self, record: dict[str, Any]) -> None:
        if self.enabled:
            if self._metrics is None:  # used without rewind(): extend whatever is there
                self._metrics = open(os.path.join(self.output_dir, METRICS_NAME), "a", encoding="utf-8")
            self._metrics.write(json.dumps({"time": round(time.time(), 3), **record}) + "\n")
            self._metrics.flush()
        if self._trackers_started:
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
        except (OSError, ValueError) as err:
            print(f"accel_ddp: warning: could not write {CURVES_NAME}: {err}; rerun `accel-ddp plot "
                  f"{self.output_dir}`", file=sys.stderr)
            return None

    def write_summary(self, summary: dict[str, Any]) -> None:
        if self.enabled:
            _atomic_write_text(os.path.join(self.output_dir, SUMMARY_NAME), json.dumps(summary, indent=2) + "\n")

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
    """Per-epoch step-time percentiles, samples/s and the share of step time spent waiting for data.

    Host clock only, no device synchronisation: on a GPU the interval between two optimizer steps
    equals the device's step time once the launch queue is full, so percentiles stay honest
    without stalling the pipeline. Evaluation and checkpoint time is excluded (``pause``).

        timer.start_epoch()
        for batch in timed(loader, timer): ...; timer.step_done()
        record = timer.end_epoch()   # {"samples_per_sec", "step_time_p50_ms", "step_time_p90_ms", "data_wait_share"}
    """

    def __init__(self, global_batch_size: int):
        self.global_batch_size = global_batch_size
        self.all_steps: list[float] = []
        self.all_wait = 0.0
        self.start_epoch()

    def start_epoch(self) -> None:
        self._steps: list[float] = []
        self._wait = 0.0
        self._last = time.perf_counter()

    def waited(self, seconds: float) -> None:
        self._wait += seconds

    def step_done(self) -> None:
        now = time.perf_counter()
        self._steps.append(now - self._last)
        self._last = now

    def pause(self) -> None:
        """Call after work that is not training (eval, checkpoint): the next interval starts now."""
        self._last = time.perf_counter()

    def end_epoch(self) -> dict[str, float]:
        self.all_steps.extend(self._steps)
        self.all_wait += self._wait
        return _step_stats(self._steps, self._wait, self.global_batch_size)

    def totals(self) -> dict[str, float]:
        return _step_stats(self.all_steps, self.all_wait, self.global_batch_size)


def _step_stats(steps: list[float], wait: float, global_batch_size: int) -> dict[str, float]:
    if not steps:
        return {}
    ordered = sorted(steps)
    total = sum(steps)
    return {
        "samples_per_sec": len(steps) * global_batch_size / max(total, 1e-9),
        "step_time_p50_ms": 1e3 * ordered[len(ordered) // 2],
        "step_time_p90_ms": 1e3 * ordered[min(int(0.9 * len(ordered)), len(ordered) - 1)],
        "data_wait_share": min(wait / max(total, 1e-9), 1.0),
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

    Passed to ``Accelerator(log_with=[CSVTracker(dir)])`` as an instance, so nothing is registered
    globally. Columns grow as new keys appear (eval metrics arrive after the first loss lines):
    the file is then rewritten with the wider header. A resumed run appends to the existing file.
    """

    name = "csv"
    requires_logging_directory = False
    main_process_only = True

    def __init__(self, output_dir: str):
        super().__init__()
        self.path = os.path.join(output_dir, CSV_NAME)
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
            _atomic_write_text(self.path, self._render(self.rows, header=True))
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


def build_trackers(with_tracking: str, output_dir: str) -> list[Any]:
    """``log_with`` for ``--with_tracking none|tensorboard|csv|all``.

    ``all`` means TensorBoard and CSV, not Accelerate's ``"all"`` (every tracker package that
    happens to be installed, wandb included).
    """
    if with_tracking == "none":
        return []
    wanted = ("tensorboard", "csv") if with_tracking == "all" else (with_tracking,)
    trackers: list[Any] = []
    if "tensorboard" in wanted:
        from accelerate.utils import is_tensorboard_available

        if not is_tensorboard_available():  # Accelerate would silently drop it
            raise ConfigError(f"--with_tracking {with_tracking} needs the tensorboard package: "
                              "pip install tensorboard (or pip install 'accel_ddp[tracking]')")
        trackers.append("tensorboard")
    if "csv" in wanted:
        trackers.append(CSVTracker(output_dir))
    return trackers


def tracking_kwargs(with_tracking: str, output_dir: str) -> dict[str, Any]:
    """Keyword arguments for ``Accelerator(...)``: ``log_with`` and ``project_dir`` (TensorBoard's root).

        >>> Accelerator(**tracking_kwargs("all", "outputs/run"))  # -> outputs/run/tensorboard, outputs/run/metrics.csv
    """
    trackers = build_trackers(with_tracking, output_dir)
    return {"log_with": trackers, "project_dir": output_dir} if trackers else {}


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
