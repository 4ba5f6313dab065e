"""Counting host syncs (``.item()`` and the like) on a forked rank while it trains.

Every call that makes the host wait for the device's value of a tensor is counted, whatever the tensor's device:
on the CPU none of them waits, but each would on a GPU. ``.cpu()`` of a CPU tensor is counted too (a copy
back on a GPU); so is ``torch.cuda.synchronize``.
"""

from __future__ import annotations

import os
import sys
from collections import Counter
from pathlib import Path

import torch

from accel_ddp.cli.args import parse_args

# A run whose steps the overhead tests count: 512 samples of 6 numbers, 16 per step, SGD.
OVERHEAD_RUN = ["--dataset", "synthetic", "--synthetic_samples", "512", "--synthetic_shape", "6", "--model", "mlp",
        "--hidden_size", "16", "--global_batch_size", "16", "--optimizer", "sgd"]


# What makes a device tensor's value a Python one, or a host copy of it.
HOST_SYNCS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__")
_TORCH = str(Path(torch.__file__).parent)


def _caller() -> str:
    """The path and line of the innermost frame outside torch: where a counted call came from."""
    frame = sys._getframe(3)  # past _caller, _count and the counting wrapper
    while frame is not None and frame.f_code.co_filename.startswith(_TORCH):
        frame = frame.f_back
    return "?" if frame is None else f"{frame.f_code.co_filename}:{frame.f_lineno}"


class SyncCounter:
    """Counts host syncs while ``active``, by kind (``counts``) and by the line that made each (``where``).

    Those made by a Transformers model's own forward (``model``, by line) are kept apart: the model's, not the
    loop's; a bare loop feeding it the same batches pays them too (GPT-2's check of a padding mask, to skip it).

        counter = SyncCounter().install()   # in a forked rank: patches torch.Tensor for the rest of its life
        counter.active = True; ...; counter.active = False
    """

    def __init__(self):
        self.counts: Counter = Counter()
        self.where: Counter = Counter()
        self.model: Counter = Counter()
        self.active = False

    def _count(self, name: str) -> None:
        if not self.active:
            return
        caller = _caller()
        place = f"{name} {Path(caller.rsplit(':', 1)[0]).name}:{caller.rsplit(':', 1)[1]}"
        if f"{os.sep}transformers{os.sep}" in caller:
            self.model[place] += 1
            return
        self.counts[name] += 1
        self.where[place] += 1

    def install(self) -> SyncCounter:
        for name in HOST_SYNCS:
            original = getattr(torch.Tensor, name)

            def counting(tensor, *args, _original=original, _name=name, **kwargs):
                self._count(_name)
                return _original(tensor, *args, **kwargs)

            setattr(torch.Tensor, name, counting)
        synchronize = torch.cuda.synchronize

        def counting_synchronize(*args, **kwargs):
            self._count("cuda.synchronize")
            return synchronize(*args, **kwargs)

        torch.cuda.synchronize = counting_synchronize
        return self


def count_host_syncs(args: list[str]) -> Counter:
    """In a forked rank: train, counting every call that turns a tensor into a Python value."""
    from accel_ddp.loop import train

    counter = SyncCounter().install()
    counter.active = True
    train(parse_args(args))
    return counter.counts


def count_step_syncs(args: list[str]) -> tuple[SyncCounter, int]:
    """In a forked rank: train, counting host syncs from the first micro-step to the end of the training loop
    (``StepLog.close``: before the final evaluation and export). Returns the counter and the optimizer steps taken.

    Not counted: the ids check of a host batch before its copy to the device (``tasks/labels.py``
    ``first_out_of_range``, the DataLoader and streaming paths): a tensor on the host on a GPU too, read there so
    that the device never has to be.
    """
    import accel_ddp.tasks.labels as labels
    from accel_ddp.loop import train
    from accel_ddp.step.train_step import TrainStep
    from accel_ddp.tracking.step_log import StepLog

    counter = SyncCounter().install()
    micro_step, close, check = TrainStep.micro_step, StepLog.close, labels.first_out_of_range
    steps = [0]

    def host_check(*args, **kwargs):
        active, counter.active = counter.active, False
        try:
            return check(*args, **kwargs)
        finally:
            counter.active = active

    labels.first_out_of_range = host_check

    def counted_micro_step(self, batch):
        counter.active = True
        done = micro_step(self, batch)
        steps[0] = self.step
        return done

    def closed(self):
        counter.active = False
        return close(self)

    TrainStep.micro_step, StepLog.close = counted_micro_step, closed
    try:
        train(parse_args(args))
    finally:
        TrainStep.micro_step, StepLog.close, labels.first_out_of_range = micro_step, close, check
    return counter, steps[0]
