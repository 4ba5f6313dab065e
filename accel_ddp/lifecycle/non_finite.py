"""A training loss that became nan or inf: the exception every rank raises (exit code 3).

How a bad step is found, what the run does about it and its words live in ``accel_ddp/bad_steps.py``.
"""

from __future__ import annotations

EXIT_NON_FINITE = 3  # not 75 (preempted): a relaunch would diverge again


class NonFiniteLoss(Exception):  # noqa: N818 - an outcome, like Preempted
    """Raised by ``train()`` on every rank once the loss of some optimizer step was nan or inf (exit code 3);
    ``message`` replaces the default text (``--on_anomaly``'s stops say which rule stopped the run)."""

    def __init__(self, step: int, checkpoint: str | None, detail: str = "", *, message: str | None = None):
        kept = f"the last checkpoint, {checkpoint}, is from before it" if checkpoint else "no checkpoint was saved"
        super().__init__(message or f"the training loss became nan or inf at optimizer step {step}{detail}; every "
                         f"rank stopped and {kept}; lower --lr, clip with --max_grad_norm, or rerun with --debug to "
                         "see where")
        self.step, self.checkpoint = step, checkpoint
