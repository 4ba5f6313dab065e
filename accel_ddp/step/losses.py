""":class:`LossAccumulator` backpropagates each micro-step's loss (a mean, or a ``(sum, num_items)`` pair made
token-exact over the whole global batch) and keeps the running loss for the log lines.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from accel_ddp.step.update import PLAIN_TYPES, build_backward
from accel_ddp.util.messages import empty_sum
from accel_ddp.util.validation import ConfigError

if TYPE_CHECKING:
    from accel_ddp.tasks.protocol import Loss


class LossAccumulator:
    """Backpropagates each micro-step's loss and completes each optimizer step's gradient.

    Means (tuple batches, models' own losses, user means): ``accelerator.backward(mean)``, as
    Accelerate's examples do. Micro-batches have equal sizes, so the mean over micro-steps and
    ranks is the global batch's mean: the semantics (and bits) of the loop before tasks existed.

    ``(sum, num_items)`` losses: micro-batches hold different numbers of items (tokens), so a mean
    of their means would weigh a token in a short micro-batch more than one in a long one. The
    step's gradient must be ``grad(sum of all sums) / (all items)`` over every micro-step and
    rank. The item count is only known after each forward (a user loss decides what counts), so
    instead of looking ahead at the step's micro-batches (the Transformers Trainer's way) we
    backpropagate ``sum / nominal`` at each micro-step, add up the items on the device, and at the
    step's last micro-step multiply the gradients by ``world_size * accumulation * nominal /
    global_items``: DDP (and FSDP) averaged them over ranks, Accelerate divided each backward by
    ``accumulation``; the factor undoes both and divides by the true count. One scalar all-reduce
    per optimizer step, on the device (no host sync). ``nominal`` (the global batch size) only keeps
    the backpropagated values near the magnitude of a per-sample mean (fp16 loss scaling, fp16
    gradient compression); it cancels out.

    On one process with one micro-step per optimizer step there is nothing to rescale: the sum is
    backpropagated with gradient ``1 / items`` (the bits of backpropagating ``sum / items``).

    The losses reported in log lines are kept as the detached device scalars each micro-step makes
    and summed at the log line (or a check before it): no device work per step for the log.

    A micro-batch whose sum is not 0 over 0 items is a broken loss (the count left out, or
    counting the wrong thing): the step would train on the raw sum. It is counted on the device
    with the running sums and refused (bad input, exit 2) where the loop syncs anyway: at a log
    line (:meth:`mean_since_log`) and before every save, evaluation and the final export
    (:meth:`empty_sum_problem`). No step's state is saved or reported in between.
    """

    def __init__(self, accelerator, accumulation: int, nominal_items: int, guard=None, *, captured: bool = False):
        self.accelerator = accelerator
        # --on_anomaly skip|rollback (accel_ddp/bad_steps/): a bad micro-step's loss poisoned before its backward, a
        # skipped step's loss kept out of the logged mean. Here, not in the room: both run inside the step.
        self.guard = guard
        self._backward = build_backward(accelerator)  # accelerator.backward, without its division by 1
        self.accumulation = accumulation
        self.nominal = float(nominal_items)
        device = accelerator.device
        self.summed: bool | None = None  # decided by the first micro-step: means or (sum, num_items)
        self.step_items = torch.zeros((), device=device, dtype=torch.float64)  # this rank, this step
        # Since the last log line: loss sum, items, and micro-steps with a non-zero sum over no items.
        self.running = torch.zeros(3, device=device, dtype=torch.float64)
        self.running_mean = torch.zeros((), device=device)  # since the last log: means, as the loop always summed
        self.steps_since_log = 0
        # Without a guard, each micro-step's (loss, items) is kept as the detached device scalars it already is and
        # added into the running sums above at the next log line or check (_fold): no device operation per step
        # for the log's sake (benchmarks/ops_per_step.py: host operations per step within a few of a bare loop's).
        self._pending: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        # Off under --cuda_graphs (``captured``): a replay runs none of this Python, so the sums are added on the
        # device in the captured step instead, and the watch gets a copy of the running loss after each step.
        self.keep_losses = guard is None and not captured
        self._folded_since_log = False  # some kept losses are in running / running_mean already
        self._step_values: list[torch.Tensor] = []  # this optimizer step's kept losses, for the non-finite watch
        self._step_started = True  # the next micro-step begins an optimizer step (step_values starts over)
        # One micro-step per optimizer step on one process, plain backward: the step's items are this micro-batch's,
        # so a (sum, num_items) loss is backpropagated with gradient 1 / items (what autograd's ones_like would have
        # been, divided: the bits of backpropagating sum / items), with no count to reduce and no rescale after.
        # Not with a guard, nor captured (the sums are kept on the device there, the backward the general one).
        self._single = (accumulation == 1 and accelerator.num_processes == 1 and self.keep_losses
                        and self._backward is torch.Tensor.backward)
        if guard is not None:  # this step's share of running / running_mean, added by end_step unless skipped
            self._step_running, self._step_mean = torch.zeros_like(self.running), torch.zeros_like(self.running_mean)
        # Several plain ranks (DDP over torch.distributed): the step's item count is all-reduced asynchronously,
        # launched after the last micro-step's forward and waited for before the rescale (overlaps the backward).
        # Captured: in stream order with the step instead, not an async Work waited on.
        self._async_count = (not captured and accelerator.num_processes > 1
                             and accelerator.distributed_type in PLAIN_TYPES)
        self._count: tuple[torch.Tensor, object] | None = None  # (the reduced count, its Work handle) in flight
        # What the last mean_since_log counted, every rank (host numbers): throughput's real tokens (meters.py).
        self.logged_items: float | None = None
        self.logged_steps = 0
        # The model's parameters, listed once: walking its module tree each step cost ~0.8 ms of a GPT-2's step
        # (benchmarks/README.md, the lm profile); training neither adds nor replaces parameter objects.
        self._params: tuple[torch.nn.Module, list[torch.nn.Parameter]] | None = None

    def backward(self, loss: Loss) -> None:
        summed = loss.items is not None
        if self.summed is None:
            self.summed = summed
        elif summed != self.summed:
            raise ConfigError("the loss switched between a mean and a (sum, num_items) pair; return one kind")
        if self.keep_losses:
            self._keep(loss)
            if summed and self._single:  # 0 items: a gradient of 1 (the sum's own: zero over no items)
                loss.value.backward(torch.reciprocal(loss.items.clamp_min(1)).to(loss.value.dtype))
                return
            if summed:
                self.step_items += loss.items
                if self._async_count and self.accelerator.sync_gradients:  # the step's last forward: counts known
                    self._count = self._launch_count()
            self._backward(loss.value / self.nominal if summed else loss.value)
            return
        trained = loss.value if self.guard is None else self.guard.poisoned(loss.value)
        running, running_mean = (self.running, self.running_mean) if self.guard is None else \
            (self._step_running, self._step_mean)
        if summed:
            value, items = loss.value.detach().double(), loss.items.double()
            self.step_items += items
            running += torch.stack([value, items, value.abs() * (items == 0)])  # 3 small ops, no sync
            if self._async_count and self.accelerator.sync_gradients:  # the step's last forward: every count known
                self._count = self._launch_count()
            self._backward(trained / self.nominal)
        else:
            self._backward(trained)
            mean = loss.value.detach()  # summed over steps, averaged over ranks
            running_mean += mean if self.accumulation == 1 else mean / self.accumulation

    def _keep(self, loss: Loss) -> None:
        """This micro-step's loss (and items) for the log and the non-finite watch, as detached device scalars."""
        if self._step_started:
            self._step_values, self._step_started = [], False
        value = loss.value.detach()
        self._step_values.append(value)
        self._pending.append((value, loss.items))

    def _fold(self) -> None:
        """Add the kept micro-steps' losses into the running sums (before a check between log lines)."""
        if self._pending:
            folded = self._folded()
            if self.summed:
                self.running += folded
            else:
                self.running_mean += folded
            self._folded_since_log = True

    def _folded(self) -> torch.Tensor:
        """The kept micro-steps' losses summed (and forgotten): ``(loss sum, items, sums over no items)`` in
        float64, or the sum of the means / accumulation. Half a dozen operations, at a log line or a check."""
        values = torch.stack([value for value, _ in self._pending])
        if self.summed:
            items = torch.stack([items for _, items in self._pending]).to(values.dtype)
            folded = torch.stack([values, items, values.abs() * (items == 0)]).sum(1, dtype=torch.float64)
        else:  # summed over steps, averaged over ranks
            folded = values.sum(dtype=self.running_mean.dtype)
            folded = folded if self.accumulation == 1 else folded / self.accumulation
        self._pending = []
        return folded

    def end_step(self) -> None:
        """With a guard, after the update: the step's loss joins the running sums unless its update was skipped
        (device-side ``where``: no sync, and a nan of a skipped step does not spread)."""
        skipped = self.guard.last_bad_flag
        self.running += torch.where(skipped, 0.0, self._step_running)
        self.running_mean += torch.where(skipped, 0.0, self._step_mean)
        self._step_running.zero_()
        self._step_mean.zero_()

    def finish_step(self, model: torch.nn.Module) -> None:
        """At the optimizer step's last micro-step (gradients synced), before clipping and the update (device work
        only: under --cuda_graphs it is captured once and replayed; the caller counts the step, ``step_done``)."""
        if not self.summed or self._single:
            return
        acc = self.accelerator
        if self._count is not None:  # launched before this step's backward, in the same order on every rank
            global_items, work = self._count
            work.wait()  # gloo: blocks until done (long done: it ran beside the backward); NCCL: orders the stream
            self._count = None
        else:
            global_items = acc.reduce(self.step_items, reduction="sum") if acc.num_processes > 1 else self.step_items
        # An all-ignored global batch has zero gradients: keep them zero rather than 0/0.
        factor = acc.num_processes * self.accumulation * self.nominal / global_items.clamp_min(1)
        if self._params is None or self._params[0] is not model:
            self._params = (model, list(model.parameters()))
        scale_gradients(self._params[1], factor)
        self.step_items.zero_()

    def step_done(self) -> None:
        """Host bookkeeping of each optimizer step, outside the (maybe captured) device work."""
        self.steps_since_log += 1
        self._step_started = True

    def _launch_count(self) -> tuple[torch.Tensor, object]:
        """All-reduce a copy of this step's item count without waiting (``async_op=True``).

        Issued on every rank between the last forward and its backward, so before DDP's bucket all-reduces on
        the same process group: the collectives' order is the same everywhere (torch.distributed docs,
        "Synchronous and asynchronous collective operations": ``wait()`` blocks the process for CPU
        collectives, only the current stream for CUDA ones). Accelerate's ``reduce`` would block here.
        """
        count = self.step_items.clone()
        return count, torch.distributed.all_reduce(count, op=torch.distributed.ReduceOp.SUM, async_op=True)

    @property
    def step_values(self) -> list[torch.Tensor]:
        """This optimizer step's losses for the non-finite watch: the kept ones, or else (a guard: skipped steps left
        out; --cuda_graphs) a copy of the running loss, non-finite from the first bad step to the next log line."""
        return self._step_values if self.keep_losses else [self.running_loss.clone()]

    @property
    def running_loss(self) -> torch.Tensor:
        """The loss summed since the last log line (a device scalar; nan or inf once any micro-step's was)."""
        self._fold()
        return self.running[0] if self.summed else self.running_mean

    def mean_since_log(self, skipped: int = 0) -> float:
        """The mean training loss since the last call, over every rank (one host sync), leaving out the
        ``skipped`` steps (``--on_anomaly``; nan when every step was).

        nan when some micro-step's sum was not 0 over 0 items: the loop then stops, and
        :meth:`empty_sum_problem` (whose count this call leaves as it is) says why.
        """
        fresh = not self._folded_since_log and bool(self._pending)
        if fresh:  # the usual log line: the kept losses alone, not added into the running sums first
            local = self._folded()
        else:  # a check folded some, or the sums are kept on the device (a guard, --cuda_graphs)
            self._fold()
            local = self.running if self.summed else self.running_mean
        since_log = local
        if self.accelerator.num_processes > 1:
            since_log = self.accelerator.reduce(local, reduction="sum" if self.summed else "mean")
        if self.summed:
            loss_sum, items, empty_sums = since_log.tolist()
            if empty_sums:
                if local is not self.running:  # kept for empty_sum_problem, which says why the loop stops
                    self.running += local
                    self._folded_since_log = True
                return math.nan
            mean = loss_sum / max(items, 1) if skipped < self.steps_since_log else math.nan
            self.logged_items, self.logged_steps = items, self.steps_since_log  # tokens/s: no sync of its own
        else:
            trained = self.steps_since_log - skipped
            mean = since_log.item() / trained if trained else math.nan
        if not fresh:
            self.running.zero_()
            self.running_mean.zero_()
        self._folded_since_log = False
        self.steps_since_log = 0
        return mean

    def empty_sum_problem(self) -> str | None:
        """Whether some rank's loss had a non-zero sum over 0 items since the last log line (collective; the loop
        asks before every save, evaluation and the final export, where it syncs anyway)."""
        if not self.summed:  # the same on every rank: the first micro-step decided it
            return None
        self._fold()
        empty_sums = self.running[2:]
        if self.accelerator.num_processes > 1:
            empty_sums = self.accelerator.reduce(empty_sums, reduction="sum")
        return empty_sum() if empty_sums.item() else None


def scale_gradients(parameters, factor: torch.Tensor) -> None:
    """Multiply every gradient by ``factor`` (a device scalar), one fused kernel per device and dtype."""
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for p in parameters:
        if p.grad is not None:
            groups.setdefault((p.grad.device, p.grad.dtype), []).append(p.grad)
    for (device, dtype), grads in groups.items():
        torch._foreach_mul_(grads, factor.to(device=device, dtype=dtype))
