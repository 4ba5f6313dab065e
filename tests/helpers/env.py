"""The suite's process environment, set before torch loads: import this module first (tests/conftest.py does).

The suite tests CPU semantics, also on a GPU machine: the test process hides every GPU
(``CUDA_VISIBLE_DEVICES=''``), so forked ranks and launches see none. ``OFFERED_GPUS`` keeps what the
machine offered, for the GPU tests (``runs.gpu_env``).
"""

from __future__ import annotations

import os

# The GPUs this machine offers the suite, before it hides them (None: all of them).
OFFERED_GPUS = os.environ.get("CUDA_VISIBLE_DEVICES")
os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before torch initialises CUDA: CPU semantics tests stay on the CPU

# Before torch loads: two ranks on two cores, no thread oversubscription; nothing reaches the network.
os.environ.setdefault("OMP_NUM_THREADS", "1")
for _name, _value in {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TQDM_DISABLE": "1",
                      "TOKENIZERS_PARALLELISM": "false"}.items():
    os.environ[_name] = _value
