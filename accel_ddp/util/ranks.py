"""Who is rank 0, and how many ranks, before the process group exists: the one rule, read from the launcher's
environment (torchrun's ``RANK``/``WORLD_SIZE``, then MPI's, the names Accelerate reads in ``PartialState``).

    launch_rank()        # 0 without a launcher
    launch_world_size()  # 1 without a launcher
    is_first_rank()      # launch_rank() == 0: the process that speaks for all before the group forms

Once the group exists, Accelerate's ``is_main_process`` is the same process (rank 0 of the group);
``accel_ddp.util.messages`` prints by either (``ranks="first"`` or ``"main"``).
"""

from __future__ import annotations

import os

RANK_VARS = ("RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK", "MV2_COMM_WORLD_RANK")
WORLD_SIZE_VARS = ("WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE")


def launch_rank() -> int:
    """This process's rank as its launcher numbered it; 0 when no launcher set one."""
    return _env_int(RANK_VARS, 0)


def launch_world_size() -> int:
    """How many processes the launcher started; 1 when no launcher said."""
    return _env_int(WORLD_SIZE_VARS, 1)


def is_first_rank() -> bool:
    """Is this the process the launcher numbered 0 (or the only one)?"""
    return launch_rank() == 0


def _env_int(names: tuple[str, ...], default: int) -> int:
    for name in names:
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return default
