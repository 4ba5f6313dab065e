"""accel_ddp: data-parallel PyTorch training through Hugging Face Accelerate, done right."""

from accel_ddp.config import ConfigError, TrainConfig

__all__ = ["ConfigError", "TrainConfig", "train"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # `train` pulls in torch and accelerate; importing it lazily keeps `--help` and config checks fast.
    if name == "train":
        from accel_ddp.train import train

        return train
    raise AttributeError(f"module 'accel_ddp' has no attribute {name!r}")
