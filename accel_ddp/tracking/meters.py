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
from accel_ddp.tracking.flops import ModelFlops, device_peak_flops, mfu


def progress_bar(total: int, initial: int, enabled: bool) -> tqdm:
    """One bar per machine's first process; other ranks get a disabled bar with the same API."""
    return tqdm(total=total, initial=initial, disable=not enabled, unit="step", dynamic_ncols=True)


def end_progress(bar: tqdm) -> None:
    """The one place a run's bar ends (its last line written, the line ended): at the loop's end (``StepLog.close``,
    before ``finish`` and the callbacks write), else first in the teardown (``assemble._watches``). Twice is once."""
    bar.close()


class ThroughputMeter:
    """Training throughput between two log lines, evaluation time left out: samples/s, tokens/s, model FLOP/s, MFU.

        meter = ThroughputMeter.for_run(accelerator, model, cfg.global_batch_size, cfg.mixed_precision, cfg.tf32, step)
        ...  # every micro-step:     meter.add_batch(batch)      (host-side shapes: no sync)
        ...  # at a log line:        record.update(meter.record(step, tokens, token_steps))
        ...  # after an evaluation:  meter.reset(step)
        ...  # in summary.json:      meter.summary(train_seconds, steps)

    Samples count the global batch of every optimizer step (every micro-step of every rank: the
    accumulation factor is in it, bionemo-recipes#1548 left it out). Tokens are the real tokens of a
    token task, those its loss counts (not padding, not ignored labels), summed over the ranks where
    the loop syncs anyway (the log line's loss all-reduce). Model FLOPs (:mod:`accel_ddp.tracking.flops`)
    are this rank's per-sample, or per-token at its processed length, cost times the global samples or
    real tokens: padding positions add nothing. Per device: the total over the world size. MFU needs a
    known device peak (None on the CPU and on devices not in the table).
    """

    def __init__(self, global_batch_size: int, step: int = 0, world_size: int = 1, flops=None,
                 peak: float | None = None, device_name: str | None = None):
        self.global_batch_size = global_batch_size
        self.world_size = world_size
        self.flops = flops  # a flops.ModelFlops, or None: no FLOP figures
        self.peak, self.device_name = peak, device_name
        self._local = [0.0, 0, 0]  # this rank's model FLOPs, samples, positions over the run (host numbers)
        self.total_tokens = 0  # real tokens over the run, every rank (token tasks)
        self.token_task = False  # set by the first record() given tokens
        self.reset(step)

    @classmethod
    def for_run(cls, accelerator, model, global_batch_size: int, mixed_precision: str, tf32: bool,
                step: int = 0) -> ThroughputMeter:
        """The run's meter: its model's FLOPs and this rank's device peak (None off CUDA)."""
        device_name, peak = device_peak_flops(accelerator.device, mixed_precision, tf32)
        return cls(global_batch_size, step, accelerator.num_processes, ModelFlops(model), peak, device_name)

    def reset(self, step: int) -> None:
        self._step, self._time = step, time.perf_counter()

    def add_batch(self, batch) -> None:
        """One micro-batch of this rank: its FLOPs from its shapes (cached per shape)."""
        if self.flops is not None and (counted := self.flops.of_batch(batch)) is not None:
            for i, value in enumerate(counted):
                self._local[i] += value

    def rate(self, step: int) -> float:
        """Samples/s since the last call (or reset)."""
        return self.record(step)["samples_per_sec"]

    def record(self, step: int, tokens: float | None = None, token_steps: int = 0) -> dict[str, float]:
        """The log line's figures since the last record (or reset). ``tokens``: the real tokens of every rank in the
        last ``token_steps`` optimizer steps (since the previous log line), None for a sample task."""
        now = time.perf_counter()
        steps, seconds = step - self._step, max(now - self._time, 1e-9)
        self._step, self._time = step, now
        samples = steps * self.global_batch_size
        out = self._rates(samples, seconds)
        if tokens is not None:
            self.token_task = True
            self.total_tokens += int(tokens)
            # An evaluation between two log lines restarts the clock: count the tokens of the steps timed.
            timed_tokens = tokens * steps / token_steps if token_steps else 0.0
            out.update(tokens=int(tokens), **self._token_rates(timed_tokens, seconds))
        return out

    def summary(self, seconds: float, steps: int) -> dict[str, object]:
        """summary.json's throughput over the run's ``steps`` optimizer steps in ``seconds`` of training (None: unknown
        or not a token task)."""
        seconds, samples = max(seconds, 1e-9), steps * self.global_batch_size
        tokens = self.total_tokens if self.token_task else None
        rates = self._flop_rates(samples if tokens is None else tokens, seconds, per_token=tokens is not None)
        return {
            "train_samples_per_sec_per_device": samples / seconds / self.world_size,
            "train_tokens": tokens,
            "train_tokens_per_sec": None if tokens is None else tokens / seconds,
            "train_tokens_per_sec_per_device": None if tokens is None else tokens / seconds / self.world_size,
            "model_flops_per_sample": self._cost(per_token=False),
            "model_flops_per_token": self._cost(per_token=True) if self.token_task else None,
            "flops_method": self.flops.method if self.flops is not None and self._local[0] else None,
            "train_flops_per_sec": rates.get("flops_per_sec"),
            "train_flops_per_sec_per_device": rates.get("flops_per_sec_per_device"),
            "device_name": self.device_name,
            "peak_flops": self.peak,
            "mfu": rates.get("mfu"),
        }

    def _cost(self, per_token: bool) -> float | None:
        """This rank's model FLOPs per sample, or per processed position (a token at its batch's length)."""
        flops, samples, positions = self._local
        count = positions if per_token else samples
        return flops / count if flops and count else None

    def _rates(self, samples: float, seconds: float) -> dict[str, float]:
        out = {"samples_per_sec": samples / seconds, "samples_per_sec_per_device": samples / seconds / self.world_size}
        out.update(self._flop_rates(samples, seconds))
        return out

    def _token_rates(self, tokens: float, seconds: float) -> dict[str, float]:
        out = {"tokens_per_sec": tokens / seconds, "tokens_per_sec_per_device": tokens / seconds / self.world_size}
        out.update(self._flop_rates(tokens, seconds, per_token=True))
        return out

    def _flop_rates(self, count: float, seconds: float, per_token: bool = False) -> dict[str, float]:
        """Model FLOP/s of ``count`` samples (or real tokens) in ``seconds``; nothing where the cost is unknown."""
        cost = self._cost(per_token=per_token)
        if cost is None:
            return {}
        per_device = count * cost / seconds / self.world_size
        out = {"flops_per_sec": per_device * self.world_size, "flops_per_sec_per_device": per_device}
        if (utilisation := mfu(per_device, self.peak)) is not None:
            out["mfu"] = utilisation
        return out


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


_OWN_PEAK_KIB = [0.0]  # the highest own peak read so far in this process: see peak_memory_mb


def peak_memory_mb() -> tuple[float, float]:
    """(this process's peak RSS, the largest peak RSS among its live child processes), in MiB.

    The children of a rank are its DataLoader workers, where the memory-mapped path reads and
    decodes. Peak RSS counts file pages a process has mapped (the memory-mapped path drops its own
    after each batch), and a forked worker's figure includes pages it still shares with its parent,
    so the two are not to be added up.

    The own figure never goes down: Linux's ``VmHWM`` is the larger of a recorded high-water mark and the current
    RSS, and that mark is only brought up to date at some unmaps, so RSS given back another way (a page range
    dropped with madvise) can take ``VmHWM`` below a figure it showed earlier (seen: an epoch's 647.4 MiB, then
    647.3 in summary.json). The highest reading so far is the process's peak.
    """
    import resource

    own = _peak_rss_kib() or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (1024 if sys.platform == "darwin"
                                                                                    else 1)  # bytes on macOS
    own = _OWN_PEAK_KIB[0] = max(own, _OWN_PEAK_KIB[0])
    try:
        pids = _child_pids()
        if pids is None:
            import psutil

            pids = [child.pid for child in psutil.Process().children()]
        children = [_peak_rss_kib(pid) for pid in pids]
    except Exception:  # noqa: BLE001 - psutil missing or a child gone: the figure is informative only
        children = []
    return own / 1024, max(children, default=0.0) / 1024


def _child_pids() -> list[int] | None:
    """This process's children as Linux lists them, each thread's in ``/proc/self/task/<tid>/children``: a few reads,
    where psutil's ``children()`` reads the status of every process of the machine (~5 ms a call on a host with a few
    hundred). None where that list is not there (no /proc, a kernel without CONFIG_PROC_CHILDREN, a thread gone)."""
    try:
        pids = []
        for task in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{task}/children", encoding="ascii") as fh:
                pids += [int(pid) for pid in fh.read().split()]
        return pids
    except (OSError, ValueError):
        return None


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
