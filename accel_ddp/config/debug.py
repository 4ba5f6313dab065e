"""What ``--debug`` switches on, decided in one place; each module reads the behaviour it applies, not the flag.

    debug = debug_mode(cfg)           # DEBUG_ON or DEBUG_OFF, built once at import
    debug.max_steps                   # config/plan.py: the run cut to at most this many optimizer steps
    debug.workers(cfg.num_workers)    # assemble.py, inference.py: 0 DataLoader workers (tracebacks in the rank)

Each field names its reader; the start-up block's ``debug`` line is ``DEBUG_ON.changes()``, so what the block says
and what the run does cannot drift apart. Only this module reads ``cfg.debug`` (tests/config/test_debug.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from accel_ddp.config.choices import DEBUG_MAX_STEPS


@dataclass(frozen=True)
class DebugMode:
    """The behaviours of ``--debug``, each off (None, False) unless it is given."""

    on: bool = False  # the start-up block's debug lines (tracking/startup_block.py)
    max_steps: int | None = None  # config/plan.py: at most this many optimizer steps
    train_batches: int | None = None  # data/resolve.py: the training set cut to this many global batches
    eval_batches: int | None = None  # data/resolve.py: the eval set cut to this many global batches
    no_workers: bool = False  # assemble.py, inference.py: DataLoader work in the rank itself
    detect_anomaly: bool = False  # assemble.py: torch.autograd.set_detect_anomaly, the op that made a nan named
    deterministic: bool = False  # assemble.py: torch.use_deterministic_algorithms(warn_only=True)
    accelerate_checks: bool = False  # distributed/world.py: ACCELERATE_DEBUG_MODE, cross-rank shape checks
    check_micro_steps: bool = False  # after_step.py: every micro-step's loss on every rank (a sync per step)

    def workers(self, num_workers: int) -> int:
        """DataLoader workers: ``num_workers``, or 0 with ``no_workers``."""
        return 0 if self.no_workers else num_workers

    def changes(self) -> str:
        """What it switches on besides the data and the step count, in the start-up block's words."""
        said = [("0 DataLoader workers", self.no_workers), ("anomaly detection", self.detect_anomaly),
                ("deterministic kernels", self.deterministic),
                ("Accelerate's cross-rank shape checks", self.accelerate_checks),
                ("every micro-step's loss checked", self.check_micro_steps)]
        words = [text for text, on in said if on]
        return "; ".join([words[0], ", ".join(words[1:])]) if len(words) > 1 else "".join(words)


DEBUG_OFF = DebugMode()
DEBUG_ON = DebugMode(on=True, max_steps=DEBUG_MAX_STEPS, train_batches=DEBUG_MAX_STEPS, eval_batches=4,
                     no_workers=True, detect_anomaly=True, deterministic=True, accelerate_checks=True,
                     check_micro_steps=True)


def debug_mode(cfg: Any) -> DebugMode:
    """``cfg``'s --debug behaviours (``cfg``: a TrainConfig, or any section that holds ``debug``)."""
    return DEBUG_ON if cfg.debug else DEBUG_OFF
