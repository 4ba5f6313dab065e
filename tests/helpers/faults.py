"""Fault injection for tests: patches applied inside a test's own process (a forked rank, or the
wrapper script tests/scripts/faulty_train.py). accel_ddp itself has no test hooks.

    install(fail_at=(10, 1))              rank 1 raises right after optimizer step 10
    install(fail_at=(10, 1), once=path)   ... only while `path` does not exist (it creates it): one crash
    install(crash_in_checkpoint=12)       the main process SIGKILLs itself in the middle of saving step 12
    install(step_delay=0.15)              sleep after each optimizer step, so a test can signal a live run
    install(report_delay=(3, 0))          rank 0 starts its failure report 3 s late (another rank reports first)
    install(print_delay=(3, 0))           rank 0 prints its report (error line, traceback) 3 s late
    install(nan_at=(7, 1))                with --model tests.helpers.faults:nan_mlp: rank 1's output is nan at step 7
    install(kill_at=(3, 1))               rank 1 SIGKILLs itself right after optimizer step 3 (the OOM killer)
    main_signalled_after(args, 6, SIGINT) the CLI's main(), Ctrl-C right after optimizer step 6

The step hook wraps the LR scheduler's ``step``, which the loop calls exactly once per optimizer
step (a tested invariant), so ``scheduler.last_epoch`` is the optimizer step just finished.
"""

from __future__ import annotations

import os
import signal
import time

ENV_FAIL_AT = "FAULT_FAIL_AT_STEP"  # "STEP:RANK"
ENV_FAIL_ONCE = "FAULT_FAIL_ONCE"  # a file path
ENV_CRASH_IN_CHECKPOINT = "FAULT_CRASH_IN_CHECKPOINT"  # "STEP"
ENV_STEP_DELAY = "FAULT_STEP_DELAY"  # seconds
ENV_REPORT_DELAY = "FAULT_REPORT_DELAY"  # "SECONDS:RANK"
ENV_PRINT_DELAY = "FAULT_PRINT_DELAY"  # "SECONDS:RANK"


class InjectedFailure(RuntimeError):
    pass


def install(fail_at: tuple[int, int] | None = None, once: str | None = None, crash_in_checkpoint: int | None = None,
            step_delay: float = 0.0, report_delay: tuple[float, int] | None = None,
            print_delay: tuple[float, int] | None = None, nan_at: tuple[int, int] | None = None,
            kill_at: tuple[int, int] | None = None) -> None:
    import accel_ddp.checkpoint.manager as checkpoint
    import accel_ddp.lifecycle.failure as failure
    import accel_ddp.optim.user as optim_user  # where setup's optimizer and schedule are built

    if fail_at is not None or step_delay or kill_at is not None:
        build = optim_user.build_lr_scheduler

        def build_with_fault(*args, **kwargs):
            scheduler = build(*args, **kwargs)
            # A subclass, not an attribute: the scheduler's __dict__ is its checkpointed state.
            scheduler.__class__ = type("FaultyScheduler", (type(scheduler),), {"step": _faulty_step})
            return scheduler

        _STEP_FAULT.update(fail_at=fail_at, once=once, step_delay=step_delay, kill_at=kill_at)
        optim_user.build_lr_scheduler = build_with_fault
    if nan_at is not None:
        _NAN_AT.update(step=nan_at[0], rank=nan_at[1])
    if crash_in_checkpoint is not None:
        seal = checkpoint.CheckpointManager.seal

        def seal_or_die(self, tmp, final, step):
            if step == crash_in_checkpoint:  # every rank has written its files; the checkpoint is not sealed
                os.kill(os.getpid(), signal.SIGKILL)
            seal(self, tmp, final, step)

        checkpoint.CheckpointManager.seal = seal_or_die
    if report_delay is not None:
        failure.report = _delayed(failure.report, *report_delay)
    if print_delay is not None:
        failure.print_report = _delayed(failure.print_report, *print_delay)


def _delayed(fn, seconds: float, rank: int):
    """``fn``, but on ``rank`` only after ``seconds`` of sleep."""
    def slow(*args, **kwargs):
        if int(os.environ.get("RANK", "0")) == rank:
            time.sleep(seconds)
        return fn(*args, **kwargs)

    return slow


_STEP_FAULT: dict = {}  # this process's step fault, set by install()
_NAN_AT: dict = {}  # this process's nan fault, set by install(nan_at=...)


def nan_mlp(num_classes: int, input_shape: tuple[int, ...]):
    """``--model tests.helpers.faults:nan_mlp``: a small mlp whose output is nan in the training forward of one
    optimizer step on one rank (``install(nan_at=(step, rank))``; one forward per step: no accumulation)."""
    from accel_ddp.models import build_mlp

    model = build_mlp(num_classes, input_shape, hidden_size=16)
    forwards = [0]

    def poison(module, args, output):
        if not module.training:
            return output
        forwards[0] += 1
        if (forwards[0], int(os.environ.get("RANK", "0"))) == (_NAN_AT.get("step"), _NAN_AT.get("rank")):
            return output * float("nan")
        return output

    model.register_forward_hook(poison)
    return model


def inf_loss(outputs, batch):
    """``--loss tests.helpers.faults:inf_loss``: cross-entropy, plus +inf in the training loss of one optimizer step on
    one rank (``install(nan_at=(step, rank))``). The inf is a constant: the backward stays finite and reaches
    every parameter, so DDP's gradient hooks fire (unlike a nan forward, which anomaly mode stops first)."""
    import torch
    import torch.nn.functional as F

    loss = F.cross_entropy(outputs, batch[1])
    if torch.is_grad_enabled() and outputs.requires_grad:  # training forwards only (not the set-up probe)
        _LOSS_CALLS[0] += 1
        if (_LOSS_CALLS[0], int(os.environ.get("RANK", "0"))) == (_NAN_AT.get("step"), _NAN_AT.get("rank")):
            return loss + float("inf")
    return loss


_LOSS_CALLS = [0]


def _faulty_step(scheduler, *args, **kwargs) -> None:
    super(type(scheduler), scheduler).step(*args, **kwargs)
    _after_step(scheduler.last_epoch, **_STEP_FAULT)


def _after_step(step: int, fail_at, once: str | None, step_delay: float, kill_at=None) -> None:
    if step_delay:
        time.sleep(step_delay)
    rank = int(os.environ.get("RANK", "0"))
    if kill_at == (step, rank):
        os.kill(os.getpid(), signal.SIGKILL)
    if fail_at != (step, rank):
        return
    if once is not None:
        if os.path.exists(once):
            return
        open(once, "w").close()
    raise InjectedFailure(f"injected failure on rank {rank} at step {step}")


def install_from_env() -> None:
    """``install`` with the FAULT_* environment variables (for launched scripts)."""
    fail_at = None
    if os.environ.get(ENV_FAIL_AT):
        step, _, rank = os.environ[ENV_FAIL_AT].partition(":")
        fail_at = int(step), int(rank or 0)
    crash = os.environ.get(ENV_CRASH_IN_CHECKPOINT)
    install(fail_at=fail_at, once=os.environ.get(ENV_FAIL_ONCE) or None,
            crash_in_checkpoint=int(crash) if crash else None,
            step_delay=float(os.environ.get(ENV_STEP_DELAY) or 0.0),
            report_delay=_seconds_at_rank(ENV_REPORT_DELAY), print_delay=_seconds_at_rank(ENV_PRINT_DELAY))


def _seconds_at_rank(name: str) -> tuple[float, int] | None:
    if not os.environ.get(name):
        return None
    seconds, _, rank = os.environ[name].partition(":")
    return float(seconds), int(rank or 0)


def main_signalled_after(args: list[str], step: int, sig: int) -> int:
    """The CLI's ``main(args)`` in this process (a forked rank) that sends itself ``sig`` right after its ``step``-th
    optimizer step: Ctrl-C's SIGINT, the OOM killer's SIGKILL. Returns main's exit code (SIGKILL: never)."""
    from torch.optim.optimizer import register_optimizer_step_post_hook

    from accel_ddp.cli.train import main

    steps = [0]

    def after_step(*_):
        steps[0] += 1
        if steps[0] == step:
            os.kill(os.getpid(), sig)

    register_optimizer_step_post_hook(after_step)
    return main(args)
