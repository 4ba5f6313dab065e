"""The backward and the optimizer update (clip, step, zero_grad) without Accelerate's per-call work where it adds
nothing.

Accelerate's ``AcceleratedOptimizer.step`` looks for the ``lomo_optim`` package twice per call
(``importlib.util.find_spec`` over ``sys.path``, not cached), its ``zero_grad`` inspects the
optimizer's signature on every call, and ``Accelerator.clip_grad_norm_`` compares torch versions
and sorts DTensor gradients from plain ones on every call; torch's own ``clip_grad_norm_`` then
groups the gradients by device and dtype twice. Together about 0.3 ms of host time per optimizer
step, a tenth of a small model's step on two CPU ranks (docs/performance.md, "Framework tax").
``Accelerator.backward`` divides every loss by the accumulation steps, 1 included: one more
operation forward and one more node backward (~50 us of the same step).

Where none of that can apply (one device or plain DDP, no fp16 loss scaler, a plain
``AcceleratedOptimizer``) ``build_update`` steps the torch optimizer itself and clips with one
multi-tensor norm, bit for bit what ``torch.nn.utils.clip_grad_norm_`` computes, and, without
accumulation, ``build_backward`` calls ``loss.backward()`` (dividing by 1 changes no bit). Everywhere
else (FSDP, DeepSpeed, XLA, fp16, accumulation) they call Accelerate's methods.

:class:`LossAccumulator` backpropagates each micro-step's loss (a mean, or a ``(sum, num_items)``
pair made token-exact over the whole global batch) and keeps the running loss for the log lines.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from accelerate import Accelerator
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.utils import DistributedType

from accel_ddp.step_graph import DDP_WARMUP, EAGER_WARMUP, StepGraph, device_learning_rates
from accel_ddp.util.messages import empty_sum, out_of_memory
from accel_ddp.util.validation import ConfigError

if TYPE_CHECKING:
    from accel_ddp.tasks.protocol import Loss


# Distributed types whose optimizer step and clipping Accelerate does nothing special for (no sharding, no XLA).
PLAIN_TYPES = (DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU)


def build_update(
    accelerator: Accelerator, model: torch.nn.Module, optimizer, max_grad_norm: float, guard=None
) -> Callable[[], None]:
    """The update at the end of an optimizer step: clip to ``max_grad_norm`` (0: no clipping), step, zero_grad.

    Call it once per optimizer step, when ``accelerator.sync_gradients`` is true (after the last
    micro-step's backward), with the model and optimizer ``accelerator.prepare`` returned.

        >>> update = build_update(accelerator, model, optimizer, max_grad_norm=1.0)
        >>> if accelerator.sync_gradients:
        ...     update()

    ``guard`` (``--on_anomaly skip|rollback``: an ``AnomalyGuard``): the update is left out, on every rank, of a
    step whose all-reduced gradient norm ``guard.decide`` finds bad (see accel_ddp/anomaly.py).
    """
    plain = (type(optimizer) is AcceleratedOptimizer and optimizer.scaler is None
             and accelerator.distributed_type in PLAIN_TYPES)
    if not plain:
        def accelerate_update() -> None:
            if max_grad_norm > 0 or guard is not None:  # inf: the global norm (FSDP: over every shard), no scaling
                norm = accelerator.clip_grad_norm_(model.parameters(), max_grad_norm or math.inf)
            # The guard's decision on this path: one host sync per step (FSDP, DeepSpeed: no found_inf hand-off).
            if guard is None or not bool(guard.decide(norm)):
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        return accelerate_update

    torch_optimizer = optimizer.optimizer
    params = [p for p in model.parameters() if p.requires_grad]
    clip = build_clip(params, max_grad_norm) if max_grad_norm > 0 else None
    if guard is not None:
        return _guarded_update(torch_optimizer, params, clip or build_norm(params), guard)

    def update() -> None:
        if clip is not None:
            clip()
        torch_optimizer.step()
        torch_optimizer.zero_grad(set_to_none=True)

    return update


def _guarded_update(torch_optimizer, params, clip: Callable[[], torch.Tensor], guard) -> Callable[[], None]:
    """The plain update, left out where ``guard.decide`` (on the clipped norm) says so.

    A fused optimizer (CUDA) takes the decision as its ``found_inf`` flag, on the device: float32, exactly 1.0 to
    skip (its kernels compare ``== 1``; GradScaler hands it the same way, torch/amp/grad_scaler.py), no host sync.
    Its step counter goes +1 then -1, Adam's moments and the weight decay are untouched. Fused SGD allocates its
    momentum buffers uninitialised on its first step (torch/optim/sgd.py ``_fused_sgd``, ``torch.empty_like``)
    and keeps them even when the kernel skipped: they start as zeros here instead (``0.9 * 0 + g == g``, the
    bits of its own first step). Other optimizers (multi-tensor, the CPU's) reject ``found_inf``: one ``bool()``
    per step, free on the CPU, whose kernels have run by the time the host gets there.
    """
    fused = bool(torch_optimizer.defaults.get("fused")) and getattr(torch_optimizer, "_step_supports_amp_scaling",
                                                                   False)
    if fused and isinstance(torch_optimizer, torch.optim.SGD):
        for group in torch_optimizer.param_groups:
            for p in group["params"]:
                if group["momentum"] and "momentum_buffer" not in torch_optimizer.state[p]:
                    torch_optimizer.state[p]["momentum_buffer"] = torch.zeros_like(p)

    def update() -> None:
        bad = guard.decide(clip())
        if fused:
            torch_optimizer.found_inf = bad.float()
            try:
                torch_optimizer.step()
            finally:
                del torch_optimizer.found_inf
        elif not bool(bad):
            torch_optimizer.step()
        torch_optimizer.zero_grad(set_to_none=True)

    return update


def build_norm(params: list[torch.nn.Parameter]) -> Callable[[], torch.Tensor]:
    """The global L2 norm of the gradients of ``params``, not clipping (``--max_grad_norm 0`` with a guard)."""
    def norm() -> torch.Tensor:
        grads = [p.grad for p in params if p.grad is not None]
        return torch.nn.utils.get_total_norm(grads) if grads else torch.zeros(())

    return norm


def build_clip(params: list[torch.nn.Parameter], max_norm: float) -> Callable[[], torch.Tensor]:
    """Clip the gradients of ``params`` to a global L2 norm of ``max_norm``; returns the norm before clipping.

    ``torch.nn.utils.clip_grad_norm_``'s arithmetic, the same bits, without its per-call grouping
    where every parameter shares one device and dtype (the common case); otherwise torch's. No host
    sync: the scale factor stays on the device.
    """
    if len({(p.device, p.dtype) for p in params}) > 1:
        return lambda: torch.nn.utils.clip_grad_norm_(params, max_norm)

    def clip() -> torch.Tensor:
        grads = [p.grad for p in params if p.grad is not None]
        if not grads:
            return torch.zeros(())
        total = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2.0)), 2.0)
        torch._foreach_mul_(grads, torch.clamp(max_norm / (total + 1e-6), max=1.0))
        return total

    return clip


def build_backward(accelerator: Accelerator) -> Callable[[torch.Tensor], None]:
    """``accelerator.backward``, or ``Tensor.backward`` where Accelerate would only divide the loss by 1.

        >>> backward = build_backward(accelerator)
        >>> backward(loss)
    """
    plain = (accelerator.gradient_accumulation_steps == 1 and accelerator.scaler is None
             and accelerator.distributed_type in PLAIN_TYPES)
    return torch.Tensor.backward if plain else accelerator.backward


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

    def __init__(self, accelerator, accumulation: int, nominal_items: int, guard=None):
        self.accelerator = accelerator
        self.guard = guard  # --on_anomaly skip|rollback: a skipped step's loss stays out of the logged mean
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
        # Off under --cuda_graphs (TrainStep): a replay runs none of this Python, so the sums are added on the device
        # in the captured step instead, and the watch gets a copy of the running loss after each step.
        self.keep_losses = guard is None
        self._folded_since_log = False  # some kept losses are in running / running_mean already
        self._step_values: list[torch.Tensor] = []  # this optimizer step's kept losses, for the non-finite watch
        self._step_started = True  # the next micro-step begins an optimizer step (step_values starts over)
        # One micro-step per optimizer step on one process, plain backward: the step's items are this micro-batch's,
        # so a (sum, num_items) loss is backpropagated with gradient 1 / items (what autograd's ones_like would have
        # been, divided: the bits of backpropagating sum / items), with no count to reduce and no rescale after.
        self._single = (accumulation == 1 and accelerator.num_processes == 1 and guard is None
                        and self._backward is torch.Tensor.backward)
        if guard is not None:  # this step's share of running / running_mean, added by end_step unless skipped
            self._step_running, self._step_mean = torch.zeros_like(self.running), torch.zeros_like(self.running_mean)
        # Several plain ranks (DDP over torch.distributed): the step's item count is all-reduced asynchronously,
        # launched after the last micro-step's forward and waited for before the rescale (overlaps the backward).
        self._async_count = accelerator.num_processes > 1 and accelerator.distributed_type in PLAIN_TYPES
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


def graph_warmup(accelerator: Accelerator) -> int:
    """Eager steps before a --cuda_graphs capture: more under DDP (accel_ddp/step_graph.py)."""
    return DDP_WARMUP if accelerator.num_processes > 1 else EAGER_WARMUP


class TrainStep:
    """One micro-step on this rank: forward and loss, backward (gradients all-reduced on the step's last), and
    there the token-exact rescale, clip, optimizer step, zero_grad and the schedule's step.

        steps = TrainStep(accelerator, model, task, optimizer, scheduler, accumulation, global_batch, max_grad_norm,
                          start_step)
        for batch in loader:
            if steps.micro_step(batch):   # True: optimizer step ``steps.step`` was taken
                ...
    """

    def __init__(self, accelerator: Accelerator, model, task, optimizer, scheduler, accumulation: int,
                 global_batch_size: int, max_grad_norm: float, start_step: int = 0,
                 check_loss: Callable[[torch.Tensor, int], None] | None = None, guard=None,
                 per_device_batch: int | None = None, graphs=None):
        self.accelerator, self.model, self.task, self.scheduler = accelerator, model, task, scheduler
        # guard (--on_anomaly skip|rollback): a bad step's update is left out on every rank, its loss off the log
        self.guard = guard
        self.losses = LossAccumulator(accelerator, accumulation, global_batch_size, guard)  # backward, logged mean
        self.update = build_update(accelerator, model, optimizer, max_grad_norm, guard)  # clip, step, zero_grad
        self.step = start_step  # optimizer steps done
        self.check_loss = check_loss  # --debug: (each micro-step's loss, the step it belongs to) before its backward
        self.layout = (per_device_batch, accumulation)  # named by the one line of an out-of-memory error
        # --cuda_graphs (accel_ddp/step_graph.py): the whole step captured after a few eager ones, then replayed
        self.graph = None if graphs is None else StepGraph(self._train_on, graph_warmup(accelerator), graphs)
        if graphs is not None:  # each group's LR: the device tensor the schedule updates and the replays read
            device_learning_rates(getattr(optimizer, "optimizer", optimizer), accelerator.device)
            # the item count's all-reduce in stream order (captured with the step), not an async Work waited on
            self.losses._async_count = False
            # a replay runs no Python: the losses summed on the device in the captured step, the eager backward
            self.losses.keep_losses = self.losses._single = False

    def _train_on(self, batch) -> None:
        """The micro-step's device work: forward, loss, backward; at the step's last, rescale, clip and update."""
        loss = self.task.training_loss(self.model, batch)  # a mean, or a (sum, num_items) pair
        if self.check_loss is not None:
            self.check_loss(loss.value, self.step + 1)
        self.losses.backward(loss)
        if self.accelerator.sync_gradients:  # the step's last micro-step: gradients are synced
            self.losses.finish_step(self.model)  # (sum, num_items): the gradient of total loss / total items
            self.update()  # clip (--max_grad_norm), optimizer step, zero_grad
            if self.guard is not None:
                self.losses.end_step()  # a skipped step's loss stays out of the logged mean

    def micro_step(self, batch) -> bool:
        """Forward and backward ``batch``; the optimizer step where it completes one (returns True).

        Out of device memory: one line naming ``--per_device_batch_size`` (bad input, exit 2). The other ranks wait
        in a gradient all-reduce this rank never joins. Over gloo its failure report shuts its connections, so
        theirs fails at once and they exit (accel_ddp/lifecycle/failure.py). Over NCCL it leaves the connections
        alone: they stay blocked until torchrun, seeing this rank exit, stops them (SIGTERM, SIGKILL after its grace
        period), or NCCL's watchdog after ``--ddp_timeout``: bounded, not prompt.
        """
        try:
            with self.accelerator.accumulate(self.model):
                (self.graph or self._train_on)(batch)
        except torch.OutOfMemoryError as err:
            raise ConfigError(out_of_memory(self.step + 1, *self.layout)) from err
        if not self.accelerator.sync_gradients:
            return False
        self.losses.step_done()
        self.scheduler.step()  # exactly once per optimizer step
        self.step += 1
        return True
