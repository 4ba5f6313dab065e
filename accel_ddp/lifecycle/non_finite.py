"""A training loss that became nan or inf: the exception every rank raises (exit code 3).

How a bad step is found, what the run does about it and its words live in ``accel_ddp/bad_steps/``.
"""

from __future__ import annotations

from accel_ddp.lifecycle.exit_codes import ExitCode

EXIT_NON_FINITE = ExitCode.NON_FINITE  # 3, re-exported: the one list is accel_ddp/lifecycle/exit_codes.py


class NonFiniteLoss(Exception):  # noqa: N818 - an outcome, like Preempted
    """Raised by ``train()`` on every rank once a bad step stopped the run (exit code 3): a nan/inf loss, or one that
    ``--on_anomaly`` could not skip or roll back (``bad_steps.AnomalyStop``). Its words, and where it is raised, are
    accel_ddp/bad_steps/'s; it lives here because failure.py, which maps it to exit code 3, imports nothing above
    lifecycle/."""

    def __init__(self, message: str, step: int, checkpoint: str | None):
        super().__init__(message)
        self.step, self.checkpoint = step, checkpoint
