"""What happens after optimizer step N (accel_ddp/after_step.py): the collectives every rank calls, in order.

Every rank must call the same collectives in the same order, or a run hangs; a change in where the loop logs,
evaluates, saves, compares preemption flags or checks for a non-finite loss shows here first. The expected order
is built from the run's cadences, as the loop decides them (the order recorded on the loop before
accel_ddp/after_step.py existed).
"""

from __future__ import annotations

import pytest

from tests.helpers.collectives import record_fit_collectives
from tests.helpers.multiproc import run_ranks

FLAG = "all_reduce int64[2]"  # the preemption flags (lifecycle/preemption.py): after steps 1, 3, 7, 15, ...; agree()
LOG = "all_reduce float32[1]"  # a log line's mean loss
FINITE = "all_reduce int64[1]"  # the non-finite check: before each evaluation and save, and at the end
EVAL = "all_reduce float64[6]"  # an evaluation's statistics (classification: 6 numbers)
SAVE = ["broadcast_object_list", "all_gather_object", "broadcast_object_list"]  # a checkpoint: folder, write, seal
EPOCH = "all_gather float64[2]"  # an epoch's end: peak memory over the ranks
CALLBACKS = "all_reduce int64[3]"  # with callbacks only: their requests, after each step and evaluation in training

BASE = ["--dataset", "synthetic", "--synthetic_samples", "256", "--synthetic_shape", "1", "8", "8",
        "--model", "mlp", "--hidden_size", "32", "--global_batch_size", "32", "--num_workers", "0"]  # 8 steps/epoch
STEPS_PER_EPOCH = 8


def expected(total: int, log_every: int, eval_every: int | str, save_every: int | str,
             callbacks: bool = False) -> list[str]:
    """The collectives of ``fit`` for a run of ``total`` steps; ``eval_every``/``save_every``: a step count or
    "epoch" (evaluation at each epoch's end: ``--eval_every 0``); ``callbacks``: a run given one."""
    asked = [CALLBACKS] if callbacks else []
    calls, next_flag, interval, evaluated = [], 1, 1, None

    def stop_point(step: int) -> list[str]:  # after an evaluation or a save: a signal during it stops the run there
        return [FLAG] if step < total else []

    def evaluation(step: int) -> list[str]:
        nonlocal evaluated
        evaluated = step
        return [FINITE, EVAL, *asked, *stop_point(step)]

    for step in range(1, total + 1):
        calls += asked
        if step % log_every == 0 or step == total:
            calls.append(LOG)
        if step == next_flag:
            calls.append(FLAG)
            interval *= 2
            next_flag = step + interval
        if eval_every != "epoch" and step % eval_every == 0:
            calls += evaluation(step)
        if save_every != "epoch" and step % save_every == 0:
            calls += [FINITE, *SAVE, *stop_point(step)]
        if step % STEPS_PER_EPOCH == 0 or step == total:
            calls.append(EPOCH)
            if eval_every == "epoch":
                calls += evaluation(step)
            if save_every == "epoch" and step % STEPS_PER_EPOCH == 0:
                calls += [FINITE, *SAVE, *stop_point(step)]
    calls.append(FINITE)  # before the final outputs
    if evaluated != total:
        calls.append(EVAL)  # the final weights' metrics
    return calls


@pytest.fixture(scope="module")
def collectives(tmp_path_factory):
    """``record(max_steps, log_every, eval_every, save_every, callbacks)``: each rank's collectives of ``fit`` for a
    run of those cadences (``callbacks``: given ``Noop``), each run once in this module (the callbacks test compares
    with the run of the last cadence case)."""
    runs: dict[tuple, list[list[str]]] = {}

    def record(max_steps: int, log_every: int, eval_every: int | str, save_every: int | str,
               callbacks: bool = False) -> list[list[str]]:
        key = (max_steps, log_every, eval_every, save_every, callbacks)
        if key not in runs:
            args = [*BASE, "--max_steps", str(max_steps), "--log_every", str(log_every),
                    "--eval_every", "0" if eval_every == "epoch" else str(eval_every),
                    "--checkpointing_steps", str(save_every), "--output_dir", str(tmp_path_factory.mktemp("run")),
                    *(["--callbacks", "tests.test_after_step:Noop"] if callbacks else [])]
            runs[key] = run_ranks(lambda: record_fit_collectives(args), world_size=2)
        return runs[key]

    return record


@pytest.mark.parametrize("max_steps,log_every,eval_every,save_every", [
    (16, 3, 4, 6),  # evaluations, saves and log lines on steps of their own and together (12)
    (14, 5, "epoch", "epoch"),  # at each epoch's end; the run ends mid-epoch, with a final evaluation
    (13, 4, 5, 5),  # an evaluation and a save at the same step; the final evaluation of step 13
])
def test_every_rank_calls_the_same_collectives_in_the_order_the_cadences_give(collectives, max_steps, log_every,
                                                                                eval_every, save_every):
    ranks = collectives(max_steps, log_every, eval_every, save_every)
    assert ranks[0] == ranks[1]
    assert ranks[0] == expected(max_steps, log_every, eval_every, save_every)


class Noop:
    """A callback whose one hook does nothing: the collectives it adds are the agreement's alone."""

    def on_step_end(self, state):
        pass


def test_callbacks_add_one_all_reduce_per_step_and_per_evaluation_and_none_without(collectives):
    """Without callbacks ``fit`` calls exactly what it called before they existed; with one, an int64[3]
    all-reduce after every step and after every evaluation during training (not after the final one). The run
    without is the last cadence case's (an evaluation and a save at one step, the final evaluation of step 13)."""
    without = collectives(13, 4, 5, 5)
    given = collectives(13, 4, 5, 5, callbacks=True)
    assert without[0] == without[1] == expected(13, 4, 5, 5)
    assert CALLBACKS not in without[0]
    assert given[0] == given[1] == expected(13, 4, 5, 5, callbacks=True)
    assert given[0].count(CALLBACKS) == 13 + 2  # 13 steps, the evaluations of steps 5 and 10
    assert [call for call in given[0] if call != CALLBACKS] == without[0]
