"""accel_ddp/bad_steps/room.py: what the room gives the step and what it raises, from its own options (BadStepOptions);
one family of stops with one text. The runs on two ranks are in test_watch.py and test_guard.py."""

from __future__ import annotations

import pytest
import torch

from accel_ddp.bad_steps import AnomalyStop, BadStepOptions, BadSteps
from accel_ddp.config import TrainConfig
from accel_ddp.config.views import section_of
from accel_ddp.lifecycle.failure import exit_code
from accel_ddp.lifecycle.non_finite import NonFiniteLoss
from accel_ddp.util.validation import ConfigError

TAIL = "lower --lr, clip with --max_grad_norm, or rerun with --debug to see where"


class OneRank:
    """The accelerator's part the room reads, on one CPU process (its reduce: the tensor itself)."""

    device = torch.device("cpu")
    scaler = None
    is_main_process = True
    process_index = 0

    @staticmethod
    def reduce(tensor, reduction):
        return tensor.clone()


class Checkpoints:
    last_saved_folder = "out/checkpoints/step_00000002"

    @staticmethod
    def newest():
        return 2, Checkpoints.last_saved_folder


class Losses:
    """The step's LossAccumulator as the room reads it: this step's losses, and whether a sum over no items came."""

    def __init__(self):
        self.step_values: list[torch.Tensor] = []
        self.problem: str | None = None

    def empty_sum_problem(self):
        return self.problem


def room(**options) -> BadSteps:
    return BadSteps(section_of(TrainConfig(**options), BadStepOptions), OneRank(), torch.nn.Linear(2, 1), None)


@pytest.mark.parametrize("options, guarded, skips", [
    ({}, False, False),  # the default: stop at the first bad step, nothing in the step
    ({"spike_factor": 3.0}, True, False),  # stop with a spike check: log lines only, nothing in the step
    ({"on_anomaly": "skip"}, True, True),
])
def test_the_step_gets_the_guard_only_where_it_skips_and_the_debug_check_only_under_debug(options, guarded, skips):
    bad = room(**options)
    assert (bad.guard is not None, bad.step_guard is not None) == (guarded, skips)
    assert bad.check_loss is None and room(debug=True, **options).check_loss is not None
    assert bad.summary() == ({"anomaly_skipped_steps": 0, "anomaly_rollbacks": 0} if guarded else {})


def test_a_nan_loss_is_found_at_the_next_check_and_stops_with_the_words_of_every_stop(tmp_path):
    bad = room(output_dir=str(tmp_path))
    bad.begin(0, Checkpoints(), train_loader=None)
    losses = Losses()
    bad.restart(0, losses)
    for loss in (0.5, float("nan"), 0.25):  # steps 1, 2, 3
        losses.step_values = [torch.tensor(loss)]
        bad.step_done()
    with pytest.raises(NonFiniteLoss) as found:
        bad.check(3)
    assert str(found.value) == ("the training loss became nan or inf at optimizer step 2; every rank stopped and the "
                                f"last checkpoint, out/checkpoints/step_00000002, is from before it; {TAIL}")
    assert (found.value.step, exit_code(found.value)) == (2, 3)
    stop = AnomalyStop("spike step 7 (loss 9 > 3 x median 1): --on_anomaly stop", 7, None)
    assert isinstance(stop, NonFiniteLoss) and exit_code(stop) == 3
    assert str(stop).endswith(f": --on_anomaly stop; every rank stopped and no checkpoint was saved; {TAIL}")


def test_a_sum_over_no_items_is_refused_at_a_check_once_the_losses_are_finite():
    bad = room()
    bad.begin(0, Checkpoints(), train_loader=None)
    losses = Losses()
    bad.restart(0, losses)
    losses.step_values, losses.problem = [torch.tensor(1.0)], "the loss function returned ... over num_items 0"
    bad.step_done()
    with pytest.raises(ConfigError, match="over num_items 0"):
        bad.check(1)
