"""Who is rank 0, and how many ranks, before the process group exists: the one rule, read from the launcher's
environment (torchrun's ``RANK``/``WORLD_SIZE``, then MPI's, the names Accelerate reads in ``PartialState``).
The only module that reads the launch's variables (tests/util/test_ranks.py checks that no other does).

    launch_rank()        # 0 without a launcher
    launch_world_size()  # 1 without a launcher
    is_first_rank()      # launch_rank() == 0: the process that speaks for all before the group forms
    local_world_size()   # the processes on this machine (torchrun's LOCAL_WORLD_SIZE); 1 without a launcher
    launch_machines()    # the machines of the launch (Accelerate's, else torchrun's count); 1 without a launcher

Each takes the environment to read (``env``, the process's by default): the model card rebuilds a launch command
from one.

Once the group exists, Accelerate's ``is_main_process`` is the same process (rank 0 of the group);
``accel_ddp.util.messages`` prints by either (``ranks="first"`` or ``"main"``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

RANK_VARS = ("RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK", "MV2_COMM_WORLD_RANK")
WORLD_SIZE_VARS = ("WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE")
LOCAL_WORLD_SIZE_VARS = ("LOCAL_WORLD_SIZE",)  # torchrun's (torch/distributed/elastic/agent/server/api.py)
# Accelerate's launch sets ACCELERATE_NUM_MACHINES for its workers; torchrun's GROUP_WORLD_SIZE counts its nodes.
MACHINES_VARS = ("ACCELERATE_NUM_MACHINES", "GROUP_WORLD_SIZE")


def launch_rank(env: Mapping[str, str] = os.environ) -> int:
    """This process's rank as its launcher numbered it; 0 when no launcher set one."""
    return _env_int(RANK_VARS, 0, env)


def launch_world_size(env: Mapping[str, str] = os.environ) -> int:
    """How many processes the launcher started; 1 when no launcher said."""
    return _env_int(WORLD_SIZE_VARS, 1, env)


def local_world_size(default: int = 1, env: Mapping[str, str] = os.environ) -> int:
    """How many processes the launcher started on this machine; ``default`` when it did not say (or said 0)."""
    return _env_int(LOCAL_WORLD_SIZE_VARS, default, env) or default


def launch_machines(env: Mapping[str, str] = os.environ) -> int:
    """How many machines the launch spans; 1 when no launcher said."""
    return _env_int(MACHINES_VARS, 1, env)


def is_first_rank() -> bool:
    """Is this the process the launcher numbered 0 (or the only one)?"""
    return launch_rank() == 0


def _env_int(names: tuple[str, ...], default: int, env: Mapping[str, str]) -> int:
    for name in names:
        if env.get(name, "").isdigit():
            return int(env[name])
    return default
