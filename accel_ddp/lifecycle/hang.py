"""A hung run names the stuck rank and its line of code, before --ddp_timeout: ``--hang_timeout`` (``HangWatch``).

When no optimizer step completed on a rank for ``--hang_timeout`` seconds (twice that before the first step, and
after a step that an evaluation, a save, an epoch's end or the run's end follows), every rank that can:

1. writes the Python stacks of all its threads, then those of its DataLoader workers, to ``OUTPUT_DIR/hang/
   rank<R>.txt`` (``faulthandler.dump_traceback``; each worker dumps its own on ``STACK_SIGNAL``, see
   ``answer_stack_requests``);
2. posts a summary of them (its last step, the frame of the user's code it stands in, the collective it waits in:
   :mod:`accel_ddp.lifecycle.hang_stacks`) to the launch's store, the one the failure report uses
   (:func:`accel_ddp.lifecycle.peers.rank_store`: torchrun's, or the process group's), not to the process group,
   which is what hangs; so the report is the same on one machine or several;
3. the lowest rank that posted waits ``GRACE_S`` for the others, prints the one line (``hang_stacks.hang_line``:
   ``rank 1 is stuck at my_loss.py:14 in loss ...; rank 0 waiting in backward ...``; a rank that never posted is
   "no stack: stopped or dead"), and every rank exits with ``ExitCode.HUNG`` once it is out (``os._exit``: the main
   thread is the one that hangs). Checkpoints already written stay; ``--resume_from_checkpoint auto`` resumes.

The watch is a Python thread that polls the step counter ``step_done`` sets: one attribute store per step on the
main thread, no allocation, no collective, no device sync (benchmarks/hang_watch.py). It runs while the main thread
waits in C (a collective, a sleep, a read: they release the GIL) and while it loops in Python (the interpreter
switches threads every ``sys.getswitchinterval()``, 5 ms). A main thread that holds the GIL in C forever stops the
watch too: that rank is named "no stack" by the others. Not ``faulthandler.dump_traceback_later`` re-armed per
step: each call starts and joins an OS thread (CPython's Modules/faulthandler.c, ``cancel_dump_traceback_later``
then ``PyThread_start_new_thread``: 66 us a call against 78 ns, benchmarks/hang_watch.py) and the process has one such
timer, which a user's (or pytest's) own would lose.

On NCCL the flight recorder is switched on before the process group forms (``flight_recorder_env``) and the watch
dumps it too, to ``OUTPUT_DIR/hang/nccl_trace_rank_<R>`` (read with ``torchfrtrace OUTPUT_DIR/hang``).
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from accel_ddp.lifecycle.exit_codes import ExitCode
from accel_ddp.lifecycle.hang_stacks import SECTION, WORKER_SECTION, hang_line, summarize
from accel_ddp.lifecycle.peers import rank_store
from accel_ddp.util.messages import error_line
from accel_ddp.util.ranks import launch_rank, launch_world_size

PHASE_FACTOR = 2  # start-up's first step, an evaluation, a save: twice --hang_timeout
GRACE_S = 5.0  # how long the reporting rank waits for the others' stacks before it names them "no stack"
WORKER_DUMP_S = 1.0  # how long a DataLoader worker may take to write its stacks
STACK_SIGNAL = signal.SIGUSR2  # asks a DataLoader worker of ours for its stacks (faulthandler.register)
HANG_FILE_ENV = "ACCEL_DDP_HANG_FILE"  # the file a rank's DataLoader workers append their stacks to
HANG_DIR = "hang"
# NCCL's flight recorder (torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp; docs: torch_nccl_environment_variables):
# read when a process group forms, so set before. Entries kept per rank, its dump on NCCL's own timeout, and where.
FLIGHT_RECORDER = {"TORCH_NCCL_TRACE_BUFFER_SIZE": "2000", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}
FLIGHT_RECORDER_FILE = "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"  # a prefix: torch appends the rank


class HangWatch:
    """The watch of one rank: ``start`` it once the run is set up, ``step_done(step)`` after every optimizer step,
    ``stop()`` at the end (the teardown's).

        >>> watch = HangWatch.start(600, "outputs/run", start_step, pauses_after=lambda step: step % 100 == 0)
        >>> watch.step_done(step)      # every optimizer step: an attribute store
    """

    def __init__(self, seconds: float, output_dir: str, step: int, pauses_after: Callable[[int], bool]):
        self.seconds, self.step = seconds, step
        self.folder = os.path.join(output_dir, HANG_DIR)
        self.rank, self.world_size = launch_rank(), launch_world_size()
        self._pauses_after = pauses_after
        self._stopped = threading.Event()
        self._poll_s = min(1.0, seconds / 10)
        self._main_thread = threading.main_thread().ident
        self._thread: threading.Thread | None = None
        self._partial = os.path.join(self.folder, f".rank{self.rank}.partial")

    @classmethod
    def start(cls, seconds: float, output_dir: str, step: int, pauses_after: Callable[[int], bool]) -> HangWatch:
        """A started watch (none runs for ``seconds`` 0: ``step_done`` and ``stop`` do nothing then)."""
        watch = cls(seconds, output_dir, step, pauses_after)
        if seconds > 0:
            os.environ[HANG_FILE_ENV] = watch._partial  # DataLoader workers started from now on answer STACK_SIGNAL
            watch._thread = threading.Thread(target=watch._watch, name="accel_ddp-hang-watch", daemon=True)
            watch._thread.start()
        return watch

    def step_done(self, step: int) -> None:
        """After optimizer ``step`` (every rank, every step): the watch's deadline moves."""
        self.step = step

    def stop(self) -> None:
        """The run ended (or failed): the watch ends with it; once it found a hang, it ends the process instead."""
        self._stopped.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        os.environ.pop(HANG_FILE_ENV, None)
        for leftover, remove in ((self._partial, os.remove), (self.folder, os.rmdir)):
            with contextlib.suppress(OSError):  # a worker's answer_stack_requests made them; the folder if empty
                remove(leftover)

    def _watch(self) -> None:
        seen, since, allowance = self.step, time.monotonic(), PHASE_FACTOR * self.seconds  # the first step: start-up
        while not self._stopped.wait(self._poll_s):
            step, now = self.step, time.monotonic()
            if step != seen:
                seen, since = step, now
                allowance = self.seconds * (PHASE_FACTOR if self._pauses_after(step) else 1)
            elif now - since > allowance:
                self._hung(seen, now - since)
                return

    def _hung(self, step: int, idle: float) -> None:
        """This rank made no progress for ``idle`` seconds: stacks written, posted, reported; the process ends."""
        state = {"step": step, "host": socket.gethostname(), "pid": os.getpid()}
        try:
            state.update(summarize(self._write_stacks(step, idle), self._main_thread))
        except OSError as err:  # an unwritable folder: the line still says where this rank stood, as far as known
            state.update({"where": None, "wait": None, "inner": f"(stacks not written: {err})", "worker": None})
        _dump_flight_recorder(self.folder, self.rank)
        code = report(state, self.rank, self.world_size, self.seconds, self.folder)
        # Whatever the main thread does meanwhile (a collective that failed as another rank left: its teardown waits
        # in stop()), this process ends here, with the one report out.
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):
                stream.flush()
        os._exit(code)

    def _write_stacks(self, step: int, idle: float) -> str:
        """Every thread's stack, then each DataLoader worker's, into hang/rank<R>.txt; returns the text."""
        os.makedirs(self.folder, exist_ok=True)
        with open(self._partial, "w") as stacks:  # the workers append (O_APPEND): after this rank's stacks
            stacks.write(f"{SECTION}rank {self.rank} (pid {os.getpid()} on {socket.gethostname()}, main thread "
                         f"0x{self._main_thread:016x}): no optimizer step for {idle:.1f} s after step {step}\n")
            stacks.flush()
            faulthandler.dump_traceback(file=stacks, all_threads=True)
            for pid in _our_workers():
                stacks.write(f"\n{SECTION}{WORKER_SECTION} pid {pid} of rank {self.rank}\n")
                stacks.flush()
                _ask_for_stacks(pid, self._partial)
        final = os.path.join(self.folder, f"rank{self.rank}.txt")
        os.replace(self._partial, final)
        with open(final) as written:
            return written.read()


def pauses_after(plan: Any) -> Callable[[int], bool]:
    """For the run's plan (``assemble.Plan``: its ``cadence``, ``steps_per_epoch``, ``total_steps``): is optimizer
    ``step`` followed by more than a step (an evaluation, a save, an epoch's or the run's end)?"""
    cadence, epoch = plan.cadence, max(plan.steps_per_epoch, 1)
    return lambda step: (cadence.evaluates(step) or cadence.saves(step) or step % epoch == 0
                         or step >= plan.total_steps)


def report(state: dict, rank: int, world_size: int, seconds: float, folder: str) -> int:
    """Post this rank's ``state`` to the launch's store; the lowest rank that posted prints the line once the others
    posted (``GRACE_S`` at most); every rank leaves once it is out. Returns ``ExitCode.HUNG`` (124)."""
    from accel_ddp.lifecycle.failure import print_report, write_error_file

    key = f"accel_ddp/hang/{os.environ.get('TORCHELASTIC_RUN_ID', '')}/" \
          f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    found = rank_store(rank, lost_peer=False) if world_size > 1 else None
    if found is None:  # one process, or no store to meet on: this rank's own line
        line = hang_line({rank: state}, 1 if world_size == 1 else world_size, seconds, folder)
        write_error_file(line)
        print_report("\n" + error_line(line))
        return ExitCode.HUNG
    store, hosts = found
    try:
        store.set(f"{key}/rank/{rank}", json.dumps(state))
        _wait_for(store, [f"{key}/rank/{other}" for other in range(world_size)], GRACE_S)
        states = {other: json.loads(store.get(f"{key}/rank/{other}")) for other in range(world_size)
                  if store.check([f"{key}/rank/{other}"])}
        line = hang_line(states, world_size, seconds, folder)
        write_error_file(line)
        if rank == min(states):
            print_report("\n" + error_line(line))
            store.set(f"{key}/printed", "1")
        else:
            _wait_for(store, [f"{key}/printed"], GRACE_S)
        if hosts:  # the others read the store until they leave
            _wait_for(store, [f"{key}/left/{other}" for other in states if other != rank], GRACE_S)
        else:
            store.set(f"{key}/left/{rank}", "1")
    except RuntimeError:  # the store's host is gone (it reported and left, or it is the one that died)
        pass
    return ExitCode.HUNG


def _wait_for(store: Any, keys: list[str], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while not store.check(keys):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def answer_stack_requests() -> None:
    """In a DataLoader worker (``data/workers.py``'s ``WorkerInit``): on ``STACK_SIGNAL`` faulthandler appends every
    thread's stack to its rank's hang file, from its C signal handler (no GIL needed: a worker stuck in C answers)."""
    path = os.environ.get(HANG_FILE_ENV)
    if not path:
        return
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    except OSError:
        return
    faulthandler.register(STACK_SIGNAL, file=fd, all_threads=True, chain=False)


def _our_workers() -> list[int]:
    """This process's children that answer ``STACK_SIGNAL`` (a child that does not would die of it)."""
    mine, found = os.getpid(), []
    bit = 1 << (STACK_SIGNAL - 1)
    for name in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/status") as status:
                fields = dict(row.split(":", 1) for row in status.read().splitlines() if ":" in row)
        except OSError:  # gone meanwhile
            continue
        if int(fields.get("PPid", "0")) == mine and int(fields.get("SigCgt", "0"), 16) & bit:
            found.append(int(name))
    return sorted(found)


def _ask_for_stacks(pid: int, path: str) -> None:
    """Signal worker ``pid`` and wait until its stacks stop growing the file (``WORKER_DUMP_S`` at most)."""
    before = os.path.getsize(path)
    with contextlib.suppress(OSError):
        os.kill(pid, STACK_SIGNAL)
    deadline, size = time.monotonic() + WORKER_DUMP_S, before
    while time.monotonic() < deadline:
        time.sleep(0.05)
        now = os.path.getsize(path)
        if now > before and now == size:
            return
        size = now


def flight_recorder_env(output_dir: str, seconds: float) -> None:
    """Before the process group forms, on GPUs with the watch on: NCCL's flight recorder on, its dump on NCCL's
    timeout under OUTPUT_DIR/hang/, wherever the user has not set these variables."""
    if seconds <= 0:
        return
    for name, value in FLIGHT_RECORDER.items():
        os.environ.setdefault(name, value)
    os.environ.setdefault(FLIGHT_RECORDER_FILE, os.path.join(os.path.abspath(output_dir), HANG_DIR, "nccl_trace_rank_"))


def _dump_flight_recorder(folder: str, rank: int) -> None:
    """NCCL's flight recorder, dumped now (NCCL's own dump comes only at its timeout): hang/nccl_trace_rank_<R>,
    the pickle ``torchfrtrace`` reads. Untested here: no NCCL on the CPU machines."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available() or not os.environ.get("TORCH_NCCL_TRACE_BUFFER_SIZE"):
        return
    try:
        from torch._C._distributed_c10d import _dump_nccl_trace

        trace = _dump_nccl_trace()
        with open(os.path.join(folder, f"nccl_trace_rank_{rank}"), "wb") as out:
            out.write(trace)
    except (ImportError, RuntimeError, OSError):  # a torch without NCCL, no NCCL group: the stacks suffice
        pass
