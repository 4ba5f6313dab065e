"""train.py with a gloo process group formed first: several ranks may then share one GPU.

NCCL refuses two ranks on one device ("Duplicate GPU detected"), and accel_ddp refuses such a
launch up front. gloo does not mind, which lets one GPU run a real multi-rank DDP job (collectives,
DDP's gradient buckets on CUDA tensors, the on-device loader, per-rank checkpoint files): what
``benchmarks/gpu_check.py`` uses to exercise the multi-rank GPU paths on a one-GPU machine.

    accelerate launch --config_file accelerate_configs/cpu_2proc.yaml benchmarks/gloo_on_one_gpu.py --output_dir ...

Two things make it work: the group exists before accel_ddp asks Accelerate for one (``PartialState``
is a singleton, so accel_ddp joins this gloo group, and its one-process-per-GPU guard stands down
for a group that is not NCCL), and ``ACCELERATE_BYPASS_DEVICE_MAP`` makes Accelerate wrap DDP
without ``device_ids=[local_rank]``, which would name a GPU that does not exist for rank 1.
Without a GPU it is plain train.py.
"""

import os
import sys
from datetime import timedelta

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from accelerate import PartialState  # noqa: E402

from accel_ddp.cli.args import parse_args  # noqa: E402
from accel_ddp.cli.train import run  # noqa: E402

if torch.cuda.is_available():
    os.environ["ACCELERATE_BYPASS_DEVICE_MAP"] = "true"
    PartialState(backend="gloo", timeout=timedelta(seconds=parse_args(sys.argv[1:]).ddp_timeout))
run(sys.argv[1:])
