"""What a run measures of itself as it trains: samples/s, step times, data wait, peak memory, a profile.

    meter = ThroughputMeter(global_batch_size=64)        # samples/s between two log lines
    timer = EpochTimer(global_batch_size=64)             # per-epoch step-time percentiles, data-wait share
    for batch in timed(loader, timer): ...; timer.step_done()
    memory_record(accelerator)                           # every rank's peak RSS (collective)

The timers read host clocks only: they never wait for the device. The progress bar lives here too.
"""

from __future__ import annotations

import os
import sys
import time

from tqdm.auto import tqdm

from accel_ddp.outputs.names import PROFILE_SUBDIR


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
