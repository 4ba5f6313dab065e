"""How a worker ends: preemption (SIGTERM or SIGUSR1 -> every rank saves and stops; Ctrl-C's SIGINT and a closed
terminal's SIGHUP alike), exit codes (a non-finite loss: ``non_finite.py``).

The signal flow. ``main()`` installs the recording handler (``PreemptionWatcher.install``) once the
options parsed (bad ones are refused before torch is imported); from then on a signal is recorded,
never fatal. Under torchrun a thread also watches the launcher (``watch_launcher``): its death is
recorded like a signal. Nothing acts
on a record at once; the ranks compare them (an all-reduce, MAX) at points every rank reaches
together, so every rank decides the same way at the same point:

- start-up: the end of each phase (``check_start_up``) and the barriers of ``local_main_first``,
  where a first process building the data alone is interrupted by the signal (``interruptible``);
  the main process waiting for a tracker's start gives up once it sees the record (``signalled``,
  tracking/tracker_thread.py; then phase "trackers"); every rank raises ``Preempted`` with nothing saved;
- training: after optimizer steps (``stop_requested``), about once a second at a step every
  rank agreed on; after each evaluation and each save (``agree``): the loop saves that step's
  checkpoint together and ``train()`` raises ``Preempted``.

A rank's DataLoader workers ignore the job's signals (accel_ddp/data/workers.py): torchrun and
scancel signal them too, and torch's worker handler would let them die. Exit codes of ``train.py``
(each worker process):

    0   training finished; OUTPUT_DIR/model.safetensors and summary.json written
    1   an error (a Python exception on some rank, or a rank killed); an object store that failed once
        the run held its lock (one line, util.validation.ServiceFailure: a relaunch may get past it)
    2   bad input: options, missing or damaged checkpoint, weights of another model, an output folder
        that is unusable or in use by another run, a --checkpoint_dir that refuses the run at its start or
        stops answering (a call past --store_timeout)
    3   the training loss became nan or inf: every rank stopped at the same step, nothing was saved
        after the first bad step (the last checkpoint before it is intact); lower --lr, clip with
        --max_grad_norm, or rerun with --debug to see the operation that made it
    124 a hung run: no optimizer step on some rank for --hang_timeout seconds; one line names the stuck rank and
        its line of code, the stacks are in OUTPUT_DIR/hang/ (lifecycle/hang.py); checkpoints before it stay
    75  preempted (EX_TEMPFAIL, "try again"), or the launcher died: a checkpoint of the current step
        was saved; relaunch the same command with --resume_from_checkpoint auto to continue exactly
        where it stopped (stopped during start-up: nothing trained, nothing saved; a save that failed or that a
        stuck store held when the signal came: not saved, the line names the last intact checkpoint)
    130 SIGINT (Ctrl-C), 129 SIGHUP (the terminal or ssh session closed): stopped as on SIGTERM, with the
        same checkpoint and line, but 128 + the signal as a shell reports it: a person stopped the run,
        and a scheduler that requeues on 75 must not start it again

``accelerate launch`` does not pass these on: it exits 1 when the job failed, 128 + the signal
when it was itself signalled (accelerate 1.16; 1 before), and logs each worker's exit code. Batch
scripts should decide to requeue from the signal they forwarded, not from the launcher's exit code
(docs/checkpoints.md, "Exit codes").

What reaches the workers: torchrun (inside ``accelerate launch``) starts each worker in its own
session (``start_new_session=True`` in torch/distributed/elastic/multiprocessing/subprocess_handler/
subprocess_handler.py), so a signal to the launcher's process group does not reach them directly.
The launcher forwards SIGTERM, SIGINT, SIGHUP and SIGQUIT to each worker's process group
(``os.killpg`` in ``SubprocessHandler.close``: the worker's DataLoader workers too), waits
``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` seconds (default 30) and then SIGKILLs them. SIGUSR1 to the
launcher kills it outright, leaving the workers orphaned (they notice, and stop), unless it runs
with ``PET_SIGNALS_TO_HANDLE=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1``.
"""

from __future__ import annotations

import _thread
import atexit
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any, NoReturn, TypeVar

import torch
import torch.distributed as dist
from accelerate import Accelerator

from accel_ddp.lifecycle.exit_codes import ExitCode
from accel_ddp.lifecycle.stdio import guard_stdio, silence_dead_pipes

# SIGUSR1: what SLURM's --signal sends by default; SIGINT: Ctrl-C; SIGHUP: the terminal (or ssh session) closed.
PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT, signal.SIGHUP)
# A person stopped the run: 128 + the signal, as a shell reports a process it killed, not 75 ("try again").
EXIT_INTERRUPTED = {"SIGINT": ExitCode.INTERRUPTED, "SIGHUP": ExitCode.HANGUP}
# Ranks compare their preemption flags about this often: the bound on the delay from a signal to the stop,
# against the launcher's 30 s between its SIGTERM and its SIGKILL and SLURM's --signal lead time (minutes).
# 1 s: a step longer than the interval compares after every step, a blocking all-reduce on which a rank waits for
# the slower one (5.6 ms of a 0.3 s causal-LM step in benchmarks/README.md's profile at 0.25 s); a second more to
# stop is nothing beside a scheduler's grace period (SLURM's KillWait defaults to 30 s).
CHECK_EVERY_SECONDS = 1.0
MAX_CHECK_INTERVAL = 10_000  # optimizer steps between two comparisons, at most
LAUNCHER_DIED = 1000  # the flag's value for a lost launcher: above every signal number, so MAX keeps it
LAUNCHER_POLL_SECONDS = 0.5  # how often a rank under torchrun checks that its launcher is alive
T = TypeVar("T")


class Preempted(Exception):  # noqa: N818 - it is an outcome, not a failure
    """Raised by ``train()`` on every rank after a preemption signal (or the launcher's death), once the checkpoint
    is saved; or during start-up (``phase``), before any optimizer step, with nothing saved."""

    def __init__(self, reason: str, step: int | None, checkpoint: str | None, *, phase: str | None = None,
                 signal_name: str | None = None, unsaved: str | None = None):
        if unsaved is not None:  # the save of this step failed (a store that stopped answering): the last one stands
            last = f"{checkpoint}, the last checkpoint, is intact" if checkpoint else "no checkpoint was saved"
            text = (f"{reason}: stopped after optimizer step {step} without its checkpoint ({unsaved}); {last}; "
                    "relaunch with --resume_from_checkpoint auto to continue")
        elif phase is not None:
            text = (f"{reason} during start-up ({phase}): no optimizer step taken in this launch, nothing saved; "
                    "relaunch the same command")
        else:
            text = (f"{reason}: stopped after optimizer step {step} and saved {checkpoint}; relaunch with "
                    "--resume_from_checkpoint auto to continue")
        super().__init__(text)
        self.reason, self.step, self.checkpoint, self.phase = reason, step, checkpoint, phase
        self.signal_name = signal_name

    @property
    def exit_code(self) -> int:
        """75 (preempted, the launcher died), or 130 / 129 for SIGINT / SIGHUP (a person stopped it)."""
        return EXIT_INTERRUPTED.get(self.signal_name or "", ExitCode.PREEMPTED)


class _Interrupted(KeyboardInterrupt):  # noqa: N818 - what Ctrl-C raises, for the same purpose
    """Raised by the signal handler inside ``PreemptionWatcher.interruptible``: a long start-up build gives up.

    A KeyboardInterrupt: no ``except Exception`` in the build swallows it, and libraries clean up after
    it as after Ctrl-C (``datasets.map`` removes its unfinished cache file: ``except (Exception,
    KeyboardInterrupt)`` in datasets/arrow_dataset.py)."""


class PreemptionWatcher:
    """SIGTERM or SIGUSR1 on any rank, or a lost launcher -> every rank stops after the same optimizer step.

    ``install()`` comes first, before the options are parsed: from then on a signal is recorded, not
    fatal. ``connect(accelerator)`` (collective) joins the ranks once their process group exists.

    ``stop_requested()`` is called after every optimizer step on every rank. In a process group it
    compares the ranks' flags (a 16-byte all-reduce over a CPU gloo group: no GPU synchronisation;
    on GPU runs a separate gloo group carries it, from one rank up, so that a one-GPU launch runs
    the same path as a multi-GPU one) only every ``interval`` steps. The ranks agree on the next
    ``interval`` in that same all-reduce, sized so that comparisons fall about
    ``CHECK_EVERY_SECONDS`` apart (it at most doubles from one to the next). An all-reduce costs
    ~0.1 ms on an idle host, but it is one more point where every rank's host thread must wait
    for the others: on a busy 2-core host, after every step, it cost a small model a fifth of its
    steps/s (benchmarks/README.md). A signal stops every rank within about
    ``CHECK_EVERY_SECONDS`` plus one step; without a process group, after the step during which it
    came. ``agree()`` compares at once, where every rank is at the same point anyway (a start-up
    phase's end, after an evaluation or a save). ``timeout`` bounds how long the all-reduce waits for
    a missing rank (the loop passes ``--ddp_timeout``; torch's gloo default is 30 minutes). Handlers
    are installed only from the main thread.

        >>> watcher = PreemptionWatcher().install()          # first thing: signals recorded from now on
        >>> watcher.connect(accelerator, timedelta(seconds=cfg.ddp_timeout))
        >>> if watcher.stop_requested(): ...   # after every optimizer step, on every rank
    """

    def __init__(self, accelerator: Accelerator | None = None, timeout: timedelta | None = None):
        self.signal_name: str | None = None
        self._received = 0  # a signal number, or LAUNCHER_DIED
        self._previous: dict[int, Any] = {}
        self._distributed = False
        self._group = None
        self._flag = torch.zeros(2, dtype=torch.int64)  # [signal, -steps to the next comparison]: MAX suits both
        self._flag_values = self._flag.numpy()  # the same memory: read and written without a torch call
        self._steps = 0  # stop_requested() calls so far: optimizer steps of this run
        self._interval = 1  # steps between comparisons, agreed by every rank at the last one
        self._next_check = 1  # the step of the next comparison, the same on every rank
        self._last_check = (0, time.perf_counter())
        self._interruptible = False  # inside interruptible(): the handler raises _Interrupted
        self._stop_watching = threading.Event()
        if accelerator is not None:
            self.connect(accelerator, timeout)

    def install(self) -> PreemptionWatcher:
        if threading.current_thread() is threading.main_thread():
            for sig in PREEMPTION_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._record)
        return self

    def connect(self, accelerator: Accelerator, timeout: timedelta | None = None) -> PreemptionWatcher:
        """Compare flags with the other ranks from now on (collective: every rank, once its process group exists)."""
        self._distributed = dist.is_available() and dist.is_initialized()
        self._group = flag_group(timeout) if self._distributed else None
        return self

    def uninstall(self) -> None:
        """Restore the previous handlers, unless a preemption is under way; stop watching the launcher.

        After a preemption the recording handlers stay: the launcher follows the first rank that exits
        with a SIGTERM to the others, which must not turn their exit code 75 into a kill. A handler
        installed after ours stays too: a failing rank's (``failure.claim``) records SIGTERM until it reported.
        """
        self._stop_watching.set()
        if self._received:
            return
        for sig, handler in self._previous.items():
            if signal.getsignal(sig) == self._record:
                signal.signal(sig, handler)
        self._previous.clear()

    def _record(self, signum: int, frame) -> None:
        self._received = self._received or signum
        if self._interruptible:
            self._interruptible = False  # once: the build's own clean-up must not be interrupted again
            raise _Interrupted

    @property
    def group(self):
        """The CPU gloo group the flags go over (None: the default group, gloo already); other small CPU flags that
        every rank compares at the same points may share it (accel_ddp/callbacks.py)."""
        return self._group

    @property
    def signalled(self) -> bool:
        """Has this rank recorded a signal (or the launcher's death)? Its own record, not compared with the others:
        for a wait on this rank alone to give up (the main process waiting for a tracker's start)."""
        return bool(self._received)

    @property
    def reason(self) -> str:
        """What stopped the run, for its exit line: "SIGTERM received", or the launcher's death."""
        if self._received == LAUNCHER_DIED:
            return "the launcher died (every rank's parent process is gone)"
        return f"{self.signal_name or signal.Signals(self._received).name} received"

    def _learn(self, received: int) -> bool:
        if received:
            self._received = self._received or received  # a rank told by the others is preempted too
            if received != LAUNCHER_DIED:
                self.signal_name = signal.Signals(received).name
        return bool(received)

    def stop_requested(self) -> bool:
        """After an optimizer step: True on every rank, after the same step, once any rank got a signal (collective)."""
        self._steps += 1
        if not self._distributed:
            return self._learn(self._received)
        if self._steps < self._next_check:
            return False
        self._flag_values[:] = (self._received, -self._steps_per_interval())
        dist.all_reduce(self._flag, op=dist.ReduceOp.MAX, group=self._group)
        self._interval = -int(self._flag_values[1])  # the fewest steps any rank asked for
        self._next_check = self._steps + self._interval
        return self._learn(int(self._flag_values[0]))

    def agree(self) -> bool:
        """Compare the flags now: True on every rank once any rank got a signal (collective, in a process group)."""
        if not self._distributed:
            return self._learn(self._received)
        self._flag_values[:] = (self._received, -self._interval)  # the agreed interval stays as it is
        dist.all_reduce(self._flag, op=dist.ReduceOp.MAX, group=self._group)
        return self._learn(int(self._flag_values[0]))

    def check_start_up(self, phase: str) -> None:
        """At the end of start-up phase ``phase`` (collective): every rank raises ``Preempted`` if any got a signal."""
        if self.agree():
            raise Preempted(self.reason, None, None, phase=phase, signal_name=self.signal_name)

    def interruptible(self, build: Callable[[], T]) -> tuple[bool, T | None]:
        """``(True, build())``, or ``(False, None)`` when a preemption signal came first or arrived during it.

        For a long start-up step on one rank (tokenizing, a download) that nothing else waits on but a
        barrier: a signal raises out of it at once, like Ctrl-C, instead of after it (torchrun SIGKILLs
        ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` = 30 s after its SIGTERM). Never around a collective.
        """
        try:
            try:
                self._interruptible = not self._received
                if not self._interruptible:
                    return False, None
                return True, build()
            finally:
                self._interruptible = False
        except _Interrupted:
            return False, None

    def watch_launcher(self) -> None:
        """Under torchrun: a thread notices within ``LAUNCHER_POLL_SECONDS`` that the launcher died (its workers are
        in sessions of their own: a SIGKILL of the launcher's process group leaves them training) and records it
        like a signal, so every rank stops after the same step, saves, and exits. Not PR_SET_PDEATHSIG, which
        fires when the parent *thread* exits (prctl(2)), and kills outright: no checkpoint."""
        if "TORCHELASTIC_RUN_ID" not in os.environ:
            return
        guard_stdio()  # a launcher killed with its `| tee` leaves pipes nobody reads: writes must not fail the save
        threading.Thread(target=self._poll_parent, args=(os.getppid(),), name="accel_ddp-launcher-watch",
                         daemon=True).start()

    def _poll_parent(self, parent: int) -> None:
        while not self._stop_watching.wait(LAUNCHER_POLL_SECONDS):
            if os.getppid() != parent:  # reparented: to init, or to a subreaper
                silence_dead_pipes()  # also what C code writes there
                self._received = self._received or LAUNCHER_DIED
                if self._interruptible:  # a start-up build on the main thread gives up, as on a signal
                    _thread.interrupt_main(signal.SIGTERM)
                return

    def _steps_per_interval(self) -> int:
        """How many of this rank's recent steps fit in CHECK_EVERY_SECONDS: at least 1, at most twice the last
        interval (a GPU run's host races ahead of the device until the launch queue is full: a few fast
        steps must not set a long interval)."""
        now = time.perf_counter()
        last_steps, last_time = self._last_check
        self._last_check = (self._steps, now)
        seconds_per_step = (now - last_time) / max(self._steps - last_steps, 1)
        fits = int(CHECK_EVERY_SECONDS / max(seconds_per_step, 1e-9))
        return max(1, min(fits, 2 * self._interval, MAX_CHECK_INTERVAL))


def flag_group(timeout: timedelta | None = None):
    """The process group for CPU flags: the default group if it is gloo, else a new gloo group of every rank.

    Collective (every rank calls it once). A CPU flag must not wait for the GPU stream, and NCCL
    cannot all-reduce CPU tensors.
    """
    if dist.get_backend() == "gloo":
        return None  # the default group; its timeout is the one Accelerate formed it with (--ddp_timeout)
    return dist.new_group(backend="gloo", timeout=timeout)


def ignore_preemption_signals() -> None:
    """For a process about to exit with ``ExitCode.PREEMPTED`` (or 130, 129): ignore further SIGTERM, SIGUSR1, SIGINT,
    SIGHUP.

    The launcher answers the first rank that exits with a SIGTERM to the others; it must not turn
    their exit code 75 into a kill. Python drops its own handlers while the interpreter shuts
    down, so the handler is SIG_IGN, which survives that.
    """
    if threading.current_thread() is threading.main_thread():
        for sig in PREEMPTION_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)


def restart_hazard() -> str | None:
    """Why this launch's elastic restarts may hang, or None.

    torchrun's workers share the agent's rendezvous store unless told otherwise, and a restarted
    gloo or NCCL group can read its peers' addresses from the failed attempt and never connect
    (pytorch/pytorch#135712; the static backend always shares).
    """
    if int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0 and \
            os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return ("--max_restarts with a shared rendezvous store: a restarted group can hang connecting to the "
                "failed attempt's addresses; launch with --rdzv_backend c10d and TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1")
    return None


def exit_process(code: int) -> NoReturn:
    """End this process with ``code``: atexit handlers run and stdio is flushed, then ``os._exit``.

    Why not a plain ``sys.exit``: a gloo worker thread can still be releasing the tensors of the
    last collective when the interpreter starts finalizing. That thread then needs the GIL, and on
    the Python versions we support a thread that asks for it during finalization is unwound, which
    aborts the process ("terminate called without an active exception", SIGABRT) after a run that
    succeeded. ``destroy_process_group()`` does not help: the DDP module keeps the gloo group, and
    with it the worker threads, alive until the very end. Skipping finalization skips the race;
    everything it would have done for us that matters (atexit handlers such as logging's, stdio
    buffers) is done here first. Files must be closed before this, as ``train()`` does.
    """
    try:
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):  # closed or broken pipe: nothing more to save
                pass
        os._exit(code)
