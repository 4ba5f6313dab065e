"""A nan in the data or in --init_from's weights is named before training (exit 2), not met at the first step as
a nan loss (exit 3, "lower --lr")."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file
from torch.utils.data import TensorDataset

from tests.helpers.ranks import error_lines
from tests.helpers.runs import main_ranks

BAD_ROW = 37


def _data(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=gen)
    return x, (x[:, 0] > 0).long()


def nan_train_row(data_dir, download):
    from accel_ddp.data import DatasetBundle

    (x, y), (ex, ey) = _data(64, 0), _data(16, 1)
    x[BAD_ROW, 3] = float("nan")
    return DatasetBundle(TensorDataset(x, y), TensorDataset(ex, ey), 2, (6,))


def inf_eval_row(data_dir, download):
    from accel_ddp.data import DatasetBundle

    (x, y), (ex, ey) = _data(64, 0), _data(16, 1)
    ex[5, 0] = float("inf")
    return DatasetBundle(TensorDataset(x, y), TensorDataset(ex, ey), 2, (6,))


ARGS = ["--hidden_size", "8", "--global_batch_size", "16", "--max_steps", "4", "--num_workers", "0"]


@pytest.mark.parametrize("dataset, named", [("nan_train_row", f"training sample {BAD_ROW}"),
                                            ("inf_eval_row", "eval sample 5")])
def test_a_nan_input_is_named_before_training_not_blamed_on_the_lr(dataset, named, tmp_path, capfd):
    out = tmp_path / "run"
    assert main_ranks(["--dataset", f"tests.tasks.test_finite_inputs:{dataset}", *ARGS,
                       "--output_dir", str(out)]) == [2, 2]
    err = capfd.readouterr().err
    lines = error_lines(err)
    assert lines == [f"accel_ddp: error: {named} holds nan or inf input values; a nan or inf input makes the loss "
                     "nan whatever --lr; clean the data or leave that sample out"], err
    assert "lower --lr" not in err and "Traceback" not in err


def test_the_probe_batch_names_its_field():
    from accel_ddp.tasks.finite import batch_problem

    batch = {"input_ids": torch.ones(2, 3, dtype=torch.long), "pixel_values": torch.zeros(2, 4)}
    assert batch_problem(batch, lambda row: f"sample {row}") is None
    batch["pixel_values"][1, 2] = float("nan")
    assert batch_problem(batch, lambda row: f"sample {row}") == (
        "sample 1 holds nan or inf values (its 'pixel_values'); a nan or inf input makes the loss nan whatever --lr; "
        "clean the data or leave that sample out")


def test_nan_in_init_from_weights_names_the_file_and_the_tensor(tmp_path, capfd):
    """The weights of a run that diverged, given to --init_from: one line naming the file and the tensor, exit 2."""
    out, weights = tmp_path / "run", tmp_path / "diverged.safetensors"
    args = ["--dataset", "synthetic", "--synthetic_samples", "64", "--synthetic_shape", "1", "4", "4", "--model", "mlp",
            "--hidden_size", "8", "--global_batch_size", "16", "--max_steps", "2", "--num_workers", "0"]
    assert main_ranks([*args, "--output_dir", str(out)]) == [0, 0]
    from safetensors.torch import load_file

    state = load_file(str(out / "model.safetensors"))
    name = sorted(state)[0]
    state[name].view(-1)[0] = float("nan")
    save_file(state, str(weights))
    capfd.readouterr()
    assert main_ranks([*args, "--output_dir", str(tmp_path / "tuned"), "--init_from", str(weights)]) == [2, 2]
    err = capfd.readouterr().err
    lines = error_lines(err)
    assert len(lines) == 1, err
    assert lines[0].startswith(f"accel_ddp: error: --init_from {weights}: its tensor {name} holds nan or inf values "
                               f"(1 of {state[name].numel()}); these weights are damaged"), lines
    assert "lower --lr" not in err
