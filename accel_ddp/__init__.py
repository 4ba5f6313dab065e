"""accel_ddp: data-parallel PyTorch training through Hugging Face Accelerate, done right.

``train`` and ``exit_process`` are imported on first use: ``import accel_ddp.models`` (or
``accel_ddp.config``, the CLI's ``--help``, the doctor) then costs no Accelerate import.
"""

from accel_ddp.config import TrainConfig
from accel_ddp.util.validation import ConfigError

__all__ = ["ConfigError", "TrainConfig", "exit_process", "train"]
__version__ = "0.2.0"


def __getattr__(name: str):
    if name == "train":
        from accel_ddp.loop import train

        return train
    if name == "exit_process":
        from accel_ddp.lifecycle.preemption import exit_process

        return exit_process
    raise AttributeError(f"module 'accel_ddp' has no attribute {name!r}")
