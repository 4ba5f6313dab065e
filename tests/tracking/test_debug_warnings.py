"""``--debug`` prints no false errors: the warnings the package's own code triggers in debug mode (issue 40).

The FLOP counter (accel_ddp/tracking/flops.py) runs a backward on meta tensors; under the anomaly mode that
``--debug`` turns on, that backward failed with torch's ``Error detected in SumBackward0`` warning (and the
figure was lost). Runs are forked gloo ranks (tests/helpers/multiproc.py).
"""

from __future__ import annotations

import warnings

import torch

from accel_ddp.tracking.flops import counted_flops
from tests.helpers.multiproc import run_ranks
from tests.helpers.runs import read_summary


def test_the_flop_count_under_anomaly_mode_warns_nothing_and_counts_the_same():
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    batch = (torch.randn(2, 4), torch.zeros(2))
    plain = counted_flops(model, batch)
    with warnings.catch_warnings(record=True) as seen, torch.autograd.detect_anomaly():
        warnings.simplefilter("always")
        debug = counted_flops(model, batch)
        assert torch.is_anomaly_enabled()  # the count left the user's mode as it found it
    assert plain is not None and debug == plain
    assert [str(w.message) for w in seen if "Error detected" in str(w.message)] == []


def test_a_debug_run_triggers_no_error_warning_on_any_rank(tmp_path, tiny_args):
    args = [*tiny_args, "--debug", "--output_dir", str(tmp_path)]

    def rank() -> list[str]:
        from accel_ddp.cli.args import parse_args
        from accel_ddp.loop import train

        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            train(parse_args(args))
        return [f"{w.category.__name__}: {w.message}" for w in seen]

    for messages in run_ranks(rank, world_size=2):
        assert [m for m in messages if "Error detected" in m] == [], messages
    assert read_summary(tmp_path)["optimizer_steps"] > 0
