"""accel_ddp: data-parallel PyTorch training through Hugging Face Accelerate, done right."""

from accel_ddp.config import ConfigError, TrainConfig
from accel_ddp.loop import train
from accel_ddp.preemption import exit_process

__all__ = ["ConfigError", "TrainConfig", "exit_process", "train"]
__version__ = "0.2.0"
