"""What a dataset builder returns, and the error bad data raises while training."""

from __future__ import annotations

from typing import NamedTuple

from torch.utils.data import Dataset

from accel_ddp.util.validation import ConfigError


class DatasetBundle(NamedTuple):
    """Train and eval datasets plus what a model needs to know about them.

    ``input_shape`` is one sample's shape without the batch dimension, e.g. ``(1, 28, 28)``.
    """

    train: Dataset
    eval: Dataset
    num_classes: int
    input_shape: tuple[int, ...]


class DataError(ConfigError):
    """Bad data met while training: a sample that does not decode, a source that fails or ends early.

    One line naming the sample or file and the fix; ``main()`` exits with code 2. Met while setting
    up, every rank meets it and the first prints it; met by one rank's loader in the middle of
    training (``only_this_rank``), that rank prints it and the others stop when its process ends.
    Raised in a DataLoader worker, it comes back to the main process as ``DataError(worker
    traceback)``; the constructor keeps the original one-line message.
    """

    only_this_rank = False

    def __init__(self, message: str):
        if "Original Traceback" in message:  # torch's ExceptionWrapper.reraise: the original is the last line
            last = message.rstrip().splitlines()[-1]
            message = last.split(f"{type(self).__name__}: ", 1)[-1]
        super().__init__(message)
