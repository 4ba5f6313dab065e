"""What every part of the room shares: the options it reads (its typed section) and the words and
exceptions of a bad step that ends or rewinds the run.

One family: ``NonFiniteLoss`` (lifecycle/non_finite.py, where failure.py maps it to exit code 3) is raised for a
nan/inf loss, its subclass ``AnomalyStop`` for a bad step ``--on_anomaly`` could not skip or roll back; both say
what was found, then the same words (:func:`stopped`). ``RolledBack`` is no error: ``train()`` catches it and reloads.
"""

from __future__ import annotations

from dataclasses import dataclass

from accel_ddp.config.views import config_section
from accel_ddp.lifecycle.non_finite import NonFiniteLoss


@config_section
@dataclass(frozen=True)
class BadStepOptions:
    """The options this room reads (config/options.py holds their defaults, help and checks)."""

    on_anomaly: str  # stop, skip or rollback
    spike_factor: float  # 0: no spike check
    spike_window: int  # logged losses in the spike check's median
    max_anomalies: int  # in a row, then stop
    debug: bool  # every micro-step's loss checked before its backward, with a trace
    output_dir: str  # where anomalies.json goes


def stopped(what: str, checkpoint: str | None) -> str:
    """The words of every bad step that stops the run: what was found, what every rank kept, and the fix."""
    kept = f"the last checkpoint, {checkpoint}, is from before it" if checkpoint else "no checkpoint was saved"
    return (f"{what}; every rank stopped and {kept}; lower --lr, clip with --max_grad_norm, or rerun with --debug to "
            "see where")


def non_finite_loss(step: int, checkpoint: str | None, detail: str = "") -> NonFiniteLoss:
    """The stop of a nan/inf loss (exit 3) first seen at optimizer ``step`` (``detail``: --debug's trace)."""
    return NonFiniteLoss(stopped(f"the training loss became nan or inf at optimizer step {step}{detail}", checkpoint),
                         step, checkpoint)


class AnomalyStop(NonFiniteLoss):
    """A non-finite loss (exit code 3) that ``--on_anomaly`` could not skip or roll back: too many anomalies in a row
    (``--max_anomalies``), a spike under ``stop``, or a rollback with no checkpoint before the bad step. ``train()``
    seals a checkpoint in flight before it exits (the text may name it)."""

    def __init__(self, what: str, step: int, checkpoint: str | None):
        super().__init__(stopped(what, checkpoint), step, checkpoint)


class RolledBack(Exception):  # noqa: N818 - an outcome, caught by train()
    """Raised on every rank by :meth:`AnomalyGuard.resolve` under ``rollback``: reload ``folder`` and train again
    (:meth:`BadSteps.roll_back`)."""

    def __init__(self, folder: str, step: int):
        super().__init__(f"rollback to {folder}")
        self.folder, self.step = folder, step
