"""Host batches checked for nan and inf inputs where they are made: in the DataLoader workers, after the collate.

A nan input makes the loss nan at the step that meets it, whatever the learning rate; met there it would stop
the run with exit 3 and the advice to lower --lr. So every floating tensor of each host batch (the DataLoader
path's, the streaming path's) is checked by the worker that collated it, in parallel with training, and a nan
names its batch and sample (one line, exit 2). Integer tensors (uint8 images, token ids) cannot hold one and
are skipped. Inputs held in memory are checked once at start-up instead (:mod:`accel_ddp.tasks.finite`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.utils.data import default_collate

from accel_ddp.data.bundle import DataError

FIX = "a nan or inf input makes the loss nan whatever --lr; clean the data or leave that sample out"


def first_non_finite_row(tensor: Any) -> int | None:
    """The first row (sample) of a floating tensor that holds a nan or inf, or None."""
    if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point() or tensor.dim() == 0 \
            or tensor.numel() == 0:
        return None
    # A nan propagates to the min and max ("NaN values are propagated to the output", torch.aminmax's docs), an inf
    # is one of them: one reduction, no mask (about 20x cheaper than isfinite on a float32 image batch;
    # benchmarks/non_finite_check.py). The mask only finds the row.
    low, high = torch.aminmax(tensor)
    if bool(torch.isfinite(low) & torch.isfinite(high)):
        return None
    bad = ~torch.isfinite(tensor)
    if not bool(bad.any()):
        return None
    return int(bad.reshape(len(tensor), -1).any(dim=1).nonzero()[0])


def non_finite_samples(tensor: Any) -> torch.Tensor | None:
    """The indices (on the CPU) of the samples (rows) of a floating tensor holding a nan or inf; None for another."""
    if first_non_finite_row(tensor) is None:  # the one reduction: nothing more where every value is finite
        return None if not isinstance(tensor, torch.Tensor) else torch.zeros(0, dtype=torch.long)
    return (~torch.isfinite(tensor)).reshape(len(tensor), -1).any(dim=1).nonzero().flatten().cpu()


def batch_problem(batch: Any, where: Callable[[int], str]) -> str | None:
    """The line for the first sample of ``batch`` (a tuple or a dict of tensors) whose floating values are not all
    finite (``where(row)`` names it), or None."""
    fields = batch.items() if isinstance(batch, Mapping) else enumerate(batch) if isinstance(batch, (tuple, list)) \
        else [(0, batch)]
    for key, tensor in fields:
        row = first_non_finite_row(tensor)
        if row is not None:
            field = f"its {key!r}" if isinstance(key, str) else "its input" if key == 0 else f"its field {key}"
            return f"{where(row)} holds nan or inf values ({field}); {FIX}"
    return None


class NonFiniteBatch(DataError):
    """A host batch with a nan or inf input, raised by the worker that collated it: ``row`` is the sample's row in
    the batch, which the rank names (it knows the batch's place in the epoch). Comes back from a worker as
    ``NonFiniteBatch(worker traceback)``: the row is read back from the line."""

    PLACE = "row {row} of a micro-batch"
    _ROW = re.compile(r"^row (\d+) of a micro-batch ")

    def __init__(self, message: str):
        super().__init__(message)
        found = self._ROW.match(str(self))
        self.row = int(found[1]) if found else None

    def named(self, name: str) -> DataError:
        """The same line with its sample named by the rank (``name``)."""
        return DataError(str(self).replace(self.PLACE.format(row=self.row), name, 1))


class NonFiniteInput:
    """A host batch with a nan or inf input, as the worker that collated it hands it on: the rank names the sample
    and either stops (``DataError``: exit 2, the default) or, under ``--on_anomaly skip|rollback``, reports it and
    trains on the batch, whose step the anomaly guard then leaves out on every rank (accel_ddp/bad_steps/).
    ``line``: the problem's line, its sample named by ``where`` in the worker; ``row``: the sample's row."""

    def __init__(self, batch: Any, row: int, line: str):
        self.batch, self.row, self.line = batch, row, line

    def named(self, name: str) -> str:
        """The line with its sample named by the rank (``name``), for a line made with ``NonFiniteBatch.PLACE``."""
        return self.line.replace(NonFiniteBatch.PLACE.format(row=self.row), name, 1)


def without_fix(line: str) -> str:
    """The line's description of the bad sample, without the advice (an anomaly record's detail)."""
    return line.removesuffix(f"; {FIX}")


class FiniteCollate:
    """A ``collate_fn`` (``collate``, or torch's ``default_collate``) whose batches are checked for nan and inf
    inputs in the worker that makes them; picklable, for workers started by spawn or forkserver. A bad batch comes
    back as a :class:`NonFiniteInput`: the rank decides (``HostLoader``).

        >>> DataLoader(dataset, batch_sampler=sampler, collate_fn=FiniteCollate(user_collate), num_workers=2)
    """

    def __init__(self, collate: Callable[[list], Any] | None = None):
        self.collate = collate

    def __call__(self, samples: list) -> Any:
        batch = (self.collate or default_collate)(samples)
        rows = []
        if (line := batch_problem(batch, lambda row: rows.append(row) or NonFiniteBatch.PLACE.format(row=row))):
            return NonFiniteInput(batch, rows[0], line)
        return batch
