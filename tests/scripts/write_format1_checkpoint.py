"""Writes tests/checkpoint/format1/: the checkpoint of a streaming run with the best model's records and the anomaly
log, saved by the code of main at fa7fbcd (before TrainState's parts were each a Stateful, issue 52). Kept so that
tests/checkpoint/test_format1.py proves the checkpoints on disk resume as they are.

    git archive fa7fbcd | tar -x -C /tmp/old && PYTHONPATH=/tmp/old python tests/scripts/write_format1_checkpoint.py
"""
import os
import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent
sys.path.append(str(HERE.parent))  # tests.helpers; accel_ddp from PYTHONPATH (the old code) first

from tests.helpers.data import image_shards  # noqa: E402  (tests/: the test makes the same data)

# The run the test resumes: 4 of 8 steps, one checkpoint at step 4 (tests/checkpoint/test_format1.py's ARGS).
ARGS = ["--dataset", "hf", "--data_dir", "d", "--model", "tests.helpers.anomaly:bad_step_mlp", "--streaming",
        "--global_batch_size", "8", "--shuffle_buffer", "0", "--num_workers", "0",
        "--lr_schedule", "constant", "--eval_every", "2", "--metric_for_best_model", "eval_loss",
        "--greater_is_better", "true", "--on_anomaly", "skip", "--seed", "3"]  # the best: step 2's, the highest
BAD_STEP = (3, 0)  # optimizer step 3 on rank 0 has a nan loss: skipped, in the anomaly log


def main() -> None:
    import accel_ddp
    from accel_ddp import train
    from accel_ddp.cli.args import parse_args
    from tests.helpers import anomaly

    print("writing with", accel_ddp.__file__)
    with tempfile.TemporaryDirectory() as tmp:
        os.chdir(tmp)  # --data_dir d, relative: the stream's position names it as given, so the test's d matches
        image_shards(Path(tmp) / "d", [40], n_test=4)
        run = Path(tmp) / "run"
        anomaly.install(BAD_STEP)
        train(parse_args([*ARGS, "--max_steps", "4", "--checkpointing_steps", "4", "--output_dir", str(run)]))
        target = HERE / "checkpoint" / "format1"
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(run / "checkpoints" / "step_00000004", target / "step_00000004")
        for name in sorted(os.listdir(target / "step_00000004")):
            print(name, os.path.getsize(target / "step_00000004" / name))


if __name__ == "__main__":
    main()
