"""Bad input to a task (accel_ddp/tasks.py, evaluate.py, update.py): a user's loss, collate_fn or metric that
returns the wrong thing, labels the model cannot take, evaluations with nothing to count.

Each is one line ``accel_ddp: error: ...`` naming the value and the fix, exit code 2, as early as it can be
known (the start-up probe where it can), or a figure reported as missing (null), never a wrong number.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.conftest import main_ranks

TINY = ["--dataset", "synthetic", "--synthetic_samples", "64", "--synthetic_shape", "4", "--hidden_size", "8",
        "--global_batch_size", "16", "--epochs", "1"]


def error_lines(stderr: str) -> list[str]:
    """The lines of a run's stderr that say something went wrong: accel_ddp's own, and any traceback. An error met
    mid-training may follow the progress bar on its line: the line is taken from ``accel_ddp: error`` on."""
    marker = "accel_ddp: error"
    return [line[line.index(marker):] if marker in line else line for line in stderr.splitlines()
            if marker in line or "Traceback" in line or "Error:" in line]


def one_error(capfd, *parts: str) -> str:
    lines = error_lines(capfd.readouterr().err)
    assert len(lines) == 1 and lines[0].startswith("accel_ddp: error: "), lines
    assert all(part in lines[0] for part in parts), lines[0]
    return lines[0]


def nothing_written(out: Path) -> bool:
    return not out.exists() or not any(out.iterdir())


# ----------------------------------------------------------------------------- losses


def count_is_text(outputs, batch):
    return F.cross_entropy(outputs, batch[1], reduction="sum"), "many"


def count_per_sample(outputs, batch):
    return F.cross_entropy(outputs, batch[1], reduction="sum"), torch.ones(len(batch[1]))


def count_is_zero(outputs, batch):
    return F.cross_entropy(outputs, batch[1], reduction="sum"), 0


def count_zero_in_training(outputs, batch):
    """Right at the start-up probe (which runs without grad), a sum over 0 items in every training step."""
    items = torch.zeros((), dtype=torch.long) if torch.is_grad_enabled() else torch.tensor(len(batch[1]))
    return F.cross_entropy(outputs, batch[1], reduction="sum"), items


def detached(outputs, batch):
    return F.cross_entropy(outputs, batch[1]).detach()


def as_number(outputs, batch):
    return torch.tensor(F.cross_entropy(outputs, batch[1]).item())


@pytest.mark.parametrize("loss, message", [
    ("count_is_text", "the loss function tests.test_task_errors:count_is_text returned a (sum, num_items) pair whose "
                      "num_items is str 'many', not a count; return the number of items the sum adds up"),
    ("count_per_sample", "the loss function tests.test_task_errors:count_per_sample returned a (sum, num_items) "
                         "pair whose num_items is a tensor of shape (2,), not a count"),
    ("count_is_zero", "the loss function tests.test_task_errors:count_is_zero returned a (sum, num_items) pair with "
                      "a non-zero sum over num_items 0 (a sum over no items is 0); return the count of the items"),
])
def test_a_loss_whose_count_is_not_a_count_is_refused_at_start_up(tmp_path, capfd, loss, message):
    out = tmp_path / "out"
    assert main_ranks([*TINY, "--loss", f"tests.test_task_errors:{loss}", "--output_dir", str(out)]) == [2, 2]
    one_error(capfd, message)
    assert nothing_written(out)


@pytest.mark.parametrize("when", ["log line", "save"])
def test_a_sum_over_zero_items_in_training_stops_at_the_next_sync_before_anything_is_saved(tmp_path, capfd, when):
    """No host sync per step: the flag is counted on the device and read where the loop syncs anyway."""
    out = tmp_path / "out"
    extra = ["--log_every", "1"] if when == "log line" else ["--log_every", "100", "--checkpointing_steps", "2"]
    args = [*TINY, "--loss", "tests.test_task_errors:count_zero_in_training", *extra, "--output_dir", str(out)]
    assert main_ranks(args) == [2, 2]
    one_error(capfd, "returned a (sum, num_items) pair with a non-zero sum over num_items 0")
    assert not (out / "checkpoints").exists() or not any((out / "checkpoints").iterdir())
    assert not (out / "model.safetensors").exists() and not (out / "summary.json").exists()


@pytest.mark.parametrize("loss", ["detached", "as_number"])
def test_a_loss_detached_from_the_model_is_one_line_at_the_first_step(tmp_path, capfd, loss):
    out = tmp_path / "out"
    assert main_ranks([*TINY, "--loss", f"tests.test_task_errors:{loss}", "--output_dir", str(out)]) == [2, 2]
    one_error(capfd, f"the loss function tests.test_task_errors:{loss} returned a loss detached from the model "
                     "(no grad_fn")
    assert not (out / "model.safetensors").exists() and not (out / "summary.json").exists()


def test_max_length_1_for_a_causal_lm_is_refused(tmp_path, capfd):
    """One token per sequence leaves nothing to predict: today's run would report loss 0.0 and perplexity 1.0."""
    from accel_ddp.loop import main

    out = tmp_path / "out"
    assert main(["--task", "causal_lm", "--max_length", "1", "--dataset", "hf", "--output_dir", str(out)]) == 2
    one_error(capfd, "--max_length 1 with --task causal_lm leaves no next token to predict", "--max_length 2 or more")
    assert nothing_written(out)
