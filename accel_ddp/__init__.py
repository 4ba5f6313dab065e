"""accel_ddp: data-parallel PyTorch training through Hugging Face Accelerate, done right."""

from accel_ddp.config import ConfigError, TrainConfig
from accel_ddp.preemption import exit_process

# Imported eagerly on purpose: the submodule accel_ddp.train shares the function's name, and a lazy
# lookup would hand callers the module once anything had imported it.
from accel_ddp.train import train

__all__ = ["ConfigError", "TrainConfig", "exit_process", "train"]
__version__ = "0.1.0"
