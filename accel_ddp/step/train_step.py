"""One micro-step on this rank (:class:`TrainStep`): forward and loss, backward, and at the optimizer step's last
micro-step the rescale, clip, update and the schedule's step; ``--cuda_graphs`` captures it (``step/graph.py``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from accelerate import Accelerator

from accel_ddp.step.graph import DDP_WARMUP, EAGER_WARMUP, StepGraph, device_learning_rates
from accel_ddp.step.losses import LossAccumulator
from accel_ddp.step.update import build_update
from accel_ddp.util.messages import out_of_memory
from accel_ddp.util.validation import ConfigError


def graph_warmup(accelerator: Accelerator) -> int:
    """Eager steps before a --cuda_graphs capture: more under DDP (accel_ddp/step/graph.py)."""
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
        # guard (--on_anomaly skip|rollback: BadSteps.step_guard, accel_ddp/bad_steps/): a bad step's update is left
        # out on every rank, its loss off the log; check_loss (--debug: BadSteps.check_loss) before each backward
        self.guard = guard
        # backward, logged mean; --cuda_graphs: the sums kept on the device, the item count reduced in stream order
        self.losses = LossAccumulator(accelerator, accumulation, global_batch_size, guard, captured=graphs is not None)
        self.update = build_update(accelerator, model, optimizer, max_grad_norm, guard)  # clip, step, zero_grad
        self.step = start_step  # optimizer steps done
        self.check_loss = check_loss  # --debug: (each micro-step's loss, the step it belongs to) before its backward
        self.layout = (per_device_batch, accumulation)  # named by the one line of an out-of-memory error
        # --cuda_graphs (accel_ddp/step/graph.py): the whole step captured after a few eager ones, then replayed
        self.graph = None if graphs is None else StepGraph(self._train_on, graph_warmup(accelerator), graphs)
        if graphs is not None:  # each group's LR: the device tensor the schedule updates and the replays read
            device_learning_rates(getattr(optimizer, "optimizer", optimizer), accelerator.device)

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
