"""accel_ddp: data-parallel PyTorch training through Hugging Face Accelerate, done right.

``train``, ``evaluate``, ``predict`` and ``exit_process`` are imported on first use: ``import accel_ddp.models`` (or
``accel_ddp.config``, the CLI's ``--help``, the doctor) then costs no Accelerate import.

The loop's story is at the root (``loop``, ``after_step``, ``assemble``, ``inference``, ``auto_batch``,
``evaluation``, ``callbacks``, ``models``) with the options in ``config/``, the optimizer in ``optim/``, the model's
transforms in ``transforms/``, one optimizer step in ``step/`` and bad steps in ``bad_steps/``; infrastructure lives
in subpackages, each ``__init__`` saying what it holds and what it may import. Imports run one way: each layer imports
only layers to its left.

    util -> config -> lifecycle -> outputs -> tracking, checkpoint -> distributed -> data -> tasks
         -> models, optim/, transforms/ -> step/, auto_batch, evaluation, callbacks
         -> assemble, bad_steps/ -> after_step, inference -> loop -> cli

(``assemble`` builds a run from everything below it, ``loop`` trains it, ``after_step`` decides what follows each
optimizer step, ``bad_steps/`` (built by ``assemble``, called by ``after_step``) finds a nan/inf or spiking step and
stops, skips or rolls back, ``inference`` evaluates and predicts with a trained run, rebuilt by ``assemble``'s
builders; nothing imports ``cli`` but ``__main__``.)
"""

from accel_ddp.config import TrainConfig
from accel_ddp.util.validation import ConfigError

__all__ = ["ConfigError", "TrainConfig", "evaluate", "exit_process", "predict", "train"]
__version__ = "0.2.0"


def __getattr__(name: str):
    if name == "train":
        from accel_ddp.loop import train

        return train
    if name in ("evaluate", "predict"):  # not accel_ddp.evaluation, the module that evaluates on every rank
        from accel_ddp import inference

        return getattr(inference, name)
    if name == "exit_process":
        from accel_ddp.lifecycle.preemption import exit_process

        return exit_process
    raise AttributeError(f"module 'accel_ddp' has no attribute {name!r}")
