"""A user's function that does not fit (accel_ddp/tasks/user_code.py): one line and exit 2 on every rank."""

from __future__ import annotations

import sys

import pytest

from accel_ddp.cli.train import main
from tests.helpers.files import CHECKPOINTED_STEPS, MLP_16, SYNTHETIC_8X8, error_lines
from tests.helpers.multiproc import run_ranks

# ----------------------------------------------------------------------------- 6. users' functions

USER_MODULE = '''
import torch
from torch import nn

def wrong_signature(classes):
    return nn.Linear(64, classes)

def returns_a_number(num_classes, input_shape):
    return 5

def three_d_output(num_classes, input_shape):
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 2 * num_classes), nn.Unflatten(1, (num_classes, 2)))

class TupleOut(nn.Module):
    def __init__(self, num_classes, input_shape):
        super().__init__()
        self.fc = nn.Linear(64, num_classes)

    def forward(self, x):
        return (self.fc(x.flatten(1)),)

def bad_dataset(data_dir, download):
    data = torch.utils.data.TensorDataset(torch.zeros(64, 4), torch.zeros(64, dtype=torch.long))
    return data, data, "ten", (4,)
'''


@pytest.mark.parametrize("flag, name, message", [
    ("--model", "user_broken:build", "--model user_broken:build: module 'user_broken' has a syntax error ("),
    ("--model", "user_raises:build", "--model user_raises:build: importing module 'user_raises' raised "
                                     "RuntimeError: no GPU here; fix the module"),
    ("--model", "user_models:wrong_signature", "--model user_models:wrong_signature cannot be called as a model "
                                               "builder (missing a required argument: 'classes'); "
                                               "expected def build(num_classes: int, input_shape"),
    ("--model", "torch.nn:Linear", "--model torch.nn:Linear cannot be called as a model builder (missing a "
                                   "required argument: 'in_features')"),
    ("--model", "user_models:returns_a_number", "--model user_models:returns_a_number returned int; it must return "
                                                "a torch.nn.Module"),
    # Checked before training on two samples (tasks.Task.check, shapes only): a batch of 2.
    ("--model", "user_models:three_d_output", "the model's output has shape (2, 10, 2) but the labels have shape "
                                              "(2,); the model must return logits of shape (2, num_classes)"),
    ("--model", "user_models:TupleOut", "the model returned tuple from forward; expected a tensor of logits "
                                        "(batch, num_classes) for labels of shape (2,)"),
    ("--dataset", "user_models:bad_dataset", "--dataset user_models:bad_dataset returned num_classes 'ten' and "
                                             "input_shape (4,); expected an int and a tuple of ints"),
    ("--dataset", "user_models:returns_a_number", "--dataset user_models:returns_a_number cannot be called as a "
                                                  "dataset builder"),
])
def test_a_users_function_that_does_not_fit_is_one_line_and_exit_2_on_every_rank(tmp_path, capfd, flag, name,
                                                                                  message):
    (tmp_path / "user_models.py").write_text(USER_MODULE)
    (tmp_path / "user_broken.py").write_text("def build(num_classes, input_shape:\n    return None\n")
    (tmp_path / "user_raises.py").write_text("raise RuntimeError('no GPU here')\n")

    def run() -> int:
        sys.path.insert(0, str(tmp_path))
        given = [*SYNTHETIC_8X8] if flag == "--model" else [*MLP_16]  # the other's, not a size for the user's
        return main([*given, *CHECKPOINTED_STEPS, "--max_steps", "2", "--output_dir", str(tmp_path / "run"), flag,
                     name])

    capfd.readouterr()
    assert run_ranks(run, world_size=2) == [2, 2]
    err = capfd.readouterr().err
    (line,) = error_lines(err)
    assert message in line and "Traceback" not in err
