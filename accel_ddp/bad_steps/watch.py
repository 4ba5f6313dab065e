"""A nan/inf training loss found on the device, without a host sync per step (``LossWatch``), and ``--debug``'s trace
of the operation that made it (``trace_non_finite``)."""

from __future__ import annotations

import warnings

import torch
from accelerate import Accelerator
from accelerate.utils import gather_object

from accel_ddp.util.messages import first_line, say


class LossWatch:
    """Finds the first optimizer step whose loss was nan or inf, with no device work on most steps.

    ``after_step`` keeps the step's loss values (the detached device scalars the loop already made: no new
    operation, no sync); every ``FOLD_EVERY`` steps, and at ``first_bad_step``, they are folded into a count, on the
    device, of the steps before the first non-finite one (a dozen small operations, about 0.2 per step: the host
    operations per step stay those of a bare loop, benchmarks/ops_per_step.py). ``first_bad_step`` is collective
    (an all-reduce and one ``.item()``): the loop calls it only where it syncs anyway (a log line whose loss is not
    finite, evaluations) and before every save, and every rank learns the same step.

        >>> watch = LossWatch(accelerator, start_step=0)
        >>> watch.after_step([loss.detach()])             # every optimizer step: its micro-steps' losses
        >>> watch.first_bad_step(step)                    # at a sync point: None, or the first bad step
    """

    FOLD_EVERY = 64  # optimizer steps whose losses are kept before they are folded into the count

    def __init__(self, accelerator: Accelerator, start_step: int):
        self.accelerator = accelerator
        self._start = start_step
        self._finite_steps = torch.zeros((), dtype=torch.int64, device=accelerator.device)
        self._clean = torch.ones((), dtype=torch.int64, device=accelerator.device)  # 0 once a bad step was folded
        self._pending: list[list[torch.Tensor]] = []  # per step since the last fold: its micro-steps' losses

    def after_step(self, losses: list[torch.Tensor]) -> None:
        """``losses``: this optimizer step's loss values (device scalars that nothing changes afterwards)."""
        self._pending.append(losses)
        if len(self._pending) >= self.FOLD_EVERY:
            self._fold()

    def _fold(self) -> None:
        if not self._pending:
            return
        values = torch.stack([value for step in self._pending for value in step])
        finite = torch.isfinite(values).view(len(self._pending), -1).all(dim=1)  # per step: all its micro-steps
        self._finite_steps += finite.cumprod(0).sum() * self._clean  # the steps before this fold's first bad one
        self._clean *= finite.all()
        self._pending = []

    def first_bad_step(self, step: int) -> int | None:
        """The first non-finite step over all ranks up to ``step``, or None (collective)."""
        self._fold()
        finite = -int(self.accelerator.reduce(-self._finite_steps, "max").item())  # the fewest, on any rank
        return None if finite >= step - self._start else self._start + finite + 1

    def any_rank(self, loss: torch.Tensor) -> bool:
        """--debug only (a host sync per call): is ``loss`` nan or inf on any rank right now? (collective)"""
        bad = (~torch.isfinite(loss.detach())).to(torch.int64)
        return bool(self.accelerator.reduce(bad, "max").item())


def trace_non_finite(accelerator: Accelerator, model: torch.nn.Module, loss: torch.Tensor) -> str:
    """--debug: the backward of a nan/inf loss under anomaly detection, without gradient sync, on the ranks that
    have one. We print torch's forward trace of the operation that made it (a warning, which filters could
    hide); every rank gets the error's first line for its message."""
    found = ""
    if not bool(torch.isfinite(loss.detach())):
        with warnings.catch_warnings(record=True) as traces:
            warnings.simplefilter("always")
            try:
                # Gradients of the parameters without accumulating them: DDP's reducer hooks, armed by a
                # forward that ran in sync, fire on accumulation, and an all-reduce the finite ranks never
                # join would hang them (no_sync entered after the forward does not disarm them).
                params = [p for p in model.parameters() if p.requires_grad]
                torch.autograd.grad(loss, params, allow_unused=True)
            except RuntimeError as err:
                found = f" ({first_line(err)})"
        for trace in traces:
            say(f"rank {accelerator.process_index}: {trace.message}", err=True)
    return next((text for text in gather_object([found]) if text), "")  # collective
