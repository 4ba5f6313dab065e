"""Each rank builds its model from a different seed; after prepare every rank must hold rank 0's weights.

usage: prepare_sync.py OUT_PREFIX
"""
import json
import sys

import torch

from accel_ddp import TrainConfig, exit_process
from accel_ddp.models import build_model
from accel_ddp.train import build_accelerator

accelerator, _, _ = build_accelerator(TrainConfig(global_batch_size=8))
rank = accelerator.process_index
torch.manual_seed(100 + rank)
model = build_model("mlp", num_classes=3, input_shape=(5,), hidden_size=16)
before = torch.cat([p.detach().flatten() for p in model.parameters()])
model = accelerator.prepare(model)
after = torch.cat([p.detach().flatten() for p in model.parameters()])
everyone_before = accelerator.gather(before.unsqueeze(0))
everyone_after = accelerator.gather(after.unsqueeze(0))
with open(f"{sys.argv[1]}_rank{rank}.json", "w") as fh:
    json.dump({
        "world": accelerator.num_processes,
        "differed_before": not torch.equal(everyone_before[0], everyone_before[1]),
        "identical_after": all(torch.equal(everyone_after[0], row) for row in everyone_after),
        "matches_rank0_init": torch.equal(after, everyone_before[0]),
    }, fh)
accelerator.end_training()
exit_process(0)  # not sys.exit: see exit_process
