"""A checkpoint written before TrainState's parts were each a Stateful (issue 52) resumes as it is: the folder
tests/checkpoint/format1/step_00000004 was saved by main's code at fa7fbcd (tests/scripts/write_format1_checkpoint.py)
and is read by today's. Its weights, optimizer, schedule, RNGs, stream position, best-model records and anomaly log
all come back: the resumed run ends where a run trained in one go ends."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import torch

from tests.helpers import anomaly
from tests.helpers.data import image_shards
from tests.helpers.multiproc import run_ranks
from tests.helpers.runs import load_weights

SAVED = Path(__file__).resolve().parent / "format1" / "step_00000004"
# tests/scripts/write_format1_checkpoint.py's run (its ARGS, BAD_STEP): 4 of 8 steps, step 3 skipped (a nan loss)
ARGS = ["--dataset", "hf", "--data_dir", "d", "--model", "tests.helpers.anomaly:bad_step_mlp", "--streaming",
        "--global_batch_size", "8", "--shuffle_buffer", "0", "--num_workers", "0", "--lr_schedule", "constant",
        "--eval_every", "2", "--metric_for_best_model", "eval_loss", "--greater_is_better", "true", "--on_anomaly",
        "skip", "--seed", "3", "--max_steps", "8", "--checkpointing_steps", "8"]


def _moved_here(checkpoint: Path, data: Path) -> None:
    """The stream's position names the data folder the writer used (a temporary one): put this test's folder, with
    the same files, in its place, and the file's new digest in checkpoint.json. Nothing else is changed."""
    position = checkpoint / "data_state_rank0.json"
    saved = json.loads(position.read_text())
    saved["made_from"]["source"] = str(data)
    position.write_text(json.dumps(saved))
    meta = json.loads((checkpoint / "checkpoint.json").read_text())
    meta["files"][position.name] = {"bytes": position.stat().st_size,
                                    "sha256": hashlib.sha256(position.read_bytes()).hexdigest()}
    (checkpoint / "checkpoint.json").write_text(json.dumps(meta, indent=2))


def test_a_checkpoint_saved_before_the_stateful_parts_resumes_to_the_weights_of_an_uninterrupted_run(
        tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # --data_dir d
    data = image_shards(tmp_path / "d", [40], n_test=4)
    checkpoint = tmp_path / "run" / "checkpoints" / SAVED.name
    shutil.copytree(SAVED, checkpoint)
    _moved_here(checkpoint, data.resolve())

    def train(output_dir: str, *more: str, bad: tuple[int, int] | None = None) -> dict:
        from accel_ddp.cli.args import parse_args
        from accel_ddp.loop import train

        anomaly.install(bad)
        return train(parse_args([*ARGS, "--output_dir", output_dir, *more]))

    resumed, = run_ranks(lambda: train("run", "--resume_from_checkpoint", "auto"), world_size=1)
    whole, = run_ranks(lambda: train("whole", bad=(3, 0)), world_size=1)
    assert (resumed["resumed_from_step"], resumed["optimizer_steps"]) == (4, 8)
    ours, reference = load_weights(tmp_path / "run"), load_weights(tmp_path / "whole")
    assert ours.keys() == reference.keys() and all(torch.equal(ours[k], reference[k]) for k in reference)
    # the records continue: the anomaly log holds step 3's skip; the best eval loss (the highest: --greater_is_better)
    # is step 2's, which only the checkpoint's records know, and 3 evaluations followed without a better one
    assert resumed["anomaly_skipped_steps"] == whole["anomaly_skipped_steps"] == 1
    best, best_whole = ({k: json.loads((tmp_path / run / "checkpoints" / "step_00000008" / "checkpoint.json")
                                       .read_text())["best"][k] for k in ("best_metric", "counter")}
                        for run in ("run", "whole"))
    assert best == best_whole and best["counter"] == 3
