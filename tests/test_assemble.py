"""accel_ddp/assemble.py: ``setup()`` builds a run from the config on every rank: the batch layout and the plan,
the optimizer over the prepared model, the schedule over the run's own total, the output folder, where it starts."""

from __future__ import annotations

from contextlib import ExitStack

import pytest
import yaml

from accel_ddp.cli.args import parse_args
from tests.helpers.multiproc import run_ranks

ARGS = ["--dataset", "synthetic", "--synthetic_samples", "100", "--synthetic_shape", "6", "--model", "mlp",
        "--hidden_size", "8", "--global_batch_size", "16", "--per_device_batch_size", "4", "--epochs", "2",
        "--lr", "0.2", "--warmup_ratio", "0.25", "--lr_schedule", "linear"]


def _set_up(output_dir: str) -> dict:
    from accel_ddp.assemble import setup

    with ExitStack() as teardown:
        run = setup(parse_args([*ARGS, "--output_dir", output_dir]), teardown)
        trained = {id(p) for p in run.model.parameters()}
        in_optimizer = [p for group in run.optimizer.param_groups for p in group["params"]]
        return {
            "layout": (run.plan.per_device_batch, run.plan.accumulation, run.plan.steps_per_epoch,
                       run.plan.total_steps, run.plan.num_epochs),
            "lrs": [group["lr"] for group in run.optimizer.param_groups],
            "optimizer_holds_the_prepared_model": {id(p) for p in in_optimizer} == trained
            and len(in_optimizer) == len(trained),
            "world": (run.accelerator.num_processes, run.facts["world_size"]),
            "start_step": run.start_step,
        }


@pytest.mark.parametrize("world", [1, 2])
def test_setup_derives_the_layout_plan_and_schedule_from_the_config(tmp_path, world):
    """100 samples, global batch 16 of 4-sample micro-batches: 6 optimizer steps an epoch (the partial batch
    dropped), 12 in 2 epochs, 8 / world micro-steps each; --warmup_ratio 0.25 of 12 is 3 warmup steps, so the first
    step's LR is 0.2 x 1/4 in both parameter groups; every rank agrees, and the run starts at step 0."""
    out = tmp_path / "run"
    built = run_ranks(lambda: _set_up(str(out)), world_size=world)
    assert all(rank == built[0] for rank in built)
    assert built[0]["layout"] == (4, 4 // world, 6, 12, 2)
    assert built[0]["lrs"] == [pytest.approx(0.05)] * 2
    assert built[0]["optimizer_holds_the_prepared_model"] and built[0]["world"] == (world, world)
    assert built[0]["start_step"] == 0
    written = yaml.safe_load((out / "config.yaml").read_text())  # the resolved config, before the first step
    assert (written["global_batch_size"], written["per_device_batch_size"], written["warmup_ratio"]) == (16, 4, 0.25)
