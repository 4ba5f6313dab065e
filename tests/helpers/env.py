"""The suite's process environment, set before torch loads: import this module first (tests/conftest.py does).

The suite tests CPU semantics, also on a GPU machine: the test process hides every GPU
(``CUDA_VISIBLE_DEVICES=''``), so forked ranks and launches see none. ``OFFERED_GPUS`` keeps what the
machine offered, for the GPU tests (``runs.gpu_env``).

Under pytest-xdist the controller imports this module (through conftest.py) before it starts its workers, which
inherit its environment: by then ``CUDA_VISIBLE_DEVICES`` is blank. So the first process to get here records the
offered value in ``OFFERED_VARIABLE`` and every later one (each xdist worker) reads it from there.
"""

from __future__ import annotations

import compileall
import os
from pathlib import Path

OFFERED_VARIABLE = "ACCEL_DDP_TESTS_OFFERED_GPUS"  # set once, by the first process of a pytest run
_ALL = "<unset>"  # the offered CUDA_VISIBLE_DEVICES was unset: every GPU


def _offered() -> str | None:
    """The GPUs this machine offered the suite, before it hid them (None: all of them), recorded by the first
    process of this pytest run (the xdist controller, or the one process of ``-n 0``)."""
    if OFFERED_VARIABLE not in os.environ:
        os.environ[OFFERED_VARIABLE] = os.environ.get("CUDA_VISIBLE_DEVICES", _ALL)
    recorded = os.environ[OFFERED_VARIABLE]
    return None if recorded == _ALL else recorded


OFFERED_GPUS = _offered()
os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before torch initialises CUDA: CPU semantics tests stay on the CPU

# Before torch loads: two ranks on two cores, no thread oversubscription; nothing reaches the network.
os.environ.setdefault("OMP_NUM_THREADS", "1")
for _name, _value in {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TQDM_DISABLE": "1",
                      "TOKENIZERS_PARALLELISM": "false"}.items():
    os.environ[_name] = _value

# The repository's own bytecode, written once here. Where the environment sets PYTHONDONTWRITEBYTECODE (this
# project's machines and CI do), no import writes it, and every interpreter the suite starts (each launch's
# workers, `python train.py`, `python -m accel_ddp doctor`) would compile accel_ddp and the test helpers from
# source again: ~0.45 s of CPU each (site-packages were compiled by pip). compileall writes whatever that
# variable says, into the gitignored __pycache__ folders, and leaves an up-to-date file as it is (~50 ms).
_REPO = Path(__file__).resolve().parents[2]
for _folder in ("accel_ddp", "tests"):
    compileall.compile_dir(_REPO / _folder, quiet=1)
