"""train.py in a process allowed only ``CAPPED_MEMORY_GIB`` GiB of its GPU: a real out-of-memory error, quickly.

``torch.cuda.set_per_process_memory_fraction`` makes the CUDA caching allocator refuse (with the
``torch.OutOfMemoryError`` a full device gives) any allocation past that share of the device's memory, so a
batch that exceeds a few GiB runs out of memory as one that exceeds the whole GPU would, without filling a
large GPU first: what ``benchmarks/gpu_check.py``'s ``auto_batch_oom`` check uses for ``--per_device_batch_size
auto``. Memory outside the allocator (the CUDA context) is not counted. Without a GPU, or without the
variable, it is plain train.py.

    CAPPED_MEMORY_GIB=2 accelerate launch --config_file accelerate_configs/1gpu_debug.yaml \\
        benchmarks/capped_memory.py --per_device_batch_size auto ...
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from accel_ddp.cli.train import run  # noqa: E402

if torch.cuda.is_available() and os.environ.get("CAPPED_MEMORY_GIB"):
    device = int(os.environ.get("LOCAL_RANK", "0"))
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(float(os.environ["CAPPED_MEMORY_GIB"]) * 2**30 / total, device)
run(sys.argv[1:])
