"""Train IndexRecorder on IndexDataset through the Python API; each rank dumps what it was served.

usage: record_indices.py OUT_PREFIX GLOBAL_BATCH PER_DEVICE_BATCH EPOCHS SEED
"""
import json
import sys

from accelerate import PartialState

from accel_ddp import TrainConfig, exit_process, train
from tests.helpers_data import IndexDataset, IndexRecorder

out, global_batch, per_device, epochs, seed = sys.argv[1], *map(int, sys.argv[2:6])
model = IndexRecorder()
cfg = TrainConfig(global_batch_size=global_batch, per_device_batch_size=per_device, epochs=epochs, seed=seed,
                  optimizer="sgd", lr=0.1, output_dir=f"{out}_run")
summary = train(cfg, model=model, train_dataset=IndexDataset(100))
rank = PartialState().process_index
with open(f"{out}_rank{rank}.json", "w") as fh:
    json.dump({"seen": model.seen, "summary": summary}, fh)
exit_process(0)
