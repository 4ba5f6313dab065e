"""Callbacks (accel_ddp/callbacks.py): hooks on every rank, in order, with the step and epoch they are at; a request
made on one rank (stop, save, evaluate) honoured by every rank right after that step; a hook that raises stops the
run with one line; ``--callbacks`` imports, makes and checks each one (one line, exit 2). On 2 forked gloo ranks.
"""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest

from accel_ddp.callbacks import Callbacks
from accel_ddp.cli.args import parse_args
from accel_ddp.util.validation import ConfigError
from tests.helpers.multiproc import run_ranks
from tests.helpers.ranks import assert_quiet
from tests.helpers.runs import main_ranks, read_metrics, read_summary, train_ranks

BASE = ["--dataset", "synthetic", "--synthetic_samples", "256", "--synthetic_shape", "1", "8", "8",
        "--model", "mlp", "--hidden_size", "32", "--global_batch_size", "32", "--num_workers", "0"]  # 8 steps/epoch


class Recorder:
    """Every hook call: (hook, process, step, epoch, what it was given); asks on ``process`` at the steps given."""

    def __init__(self, process: int = -1, stop: int = 0, save: int = 0, evaluate: int = 0, stop_on_eval: int = 0,
                 evaluate_on: int | None = None):
        self.process, self.stop, self.save, self.evaluate, self.stop_on_eval = process, stop, save, evaluate, \
            stop_on_eval
        self.evaluate_on = process if evaluate_on is None else evaluate_on  # the evaluation asked on another rank
        self.calls: list[tuple] = []

    def _record(self, hook, state, given=None):
        self.calls.append((hook, state.step, state.epoch, given))

    def on_train_begin(self, state):
        self._record("begin", state, (state.max_steps, state.is_main_process == (state.process_index == 0)))

    def on_step_end(self, state):
        self._record("step", state)
        if state.process_index == self.process:
            state.should_stop = state.step == self.stop
            state.should_save = state.step == self.save
        if state.process_index == self.evaluate_on:
            state.should_evaluate = state.step == self.evaluate

    def on_evaluate(self, state, metrics):
        self._record("evaluate", state, metrics["eval_samples"])
        if state.process_index == self.process and state.step == self.stop_on_eval:
            state.should_stop = state.should_save = True

    def on_save(self, state, checkpoint_dir):
        self._record("save", state, checkpoint_dir.rsplit("/", 1)[-1])

    def on_train_end(self, state, summary):
        self._record("end", state, summary["optimizer_steps"])


def _train(args: list[str], **asks) -> list[tuple[dict, list[tuple]]]:
    """Each rank's (summary, hook calls) of a run with one ``Recorder``."""
    from accel_ddp.loop import train

    def rank():
        recorder = Recorder(**asks)
        return train(parse_args(args), callbacks=[recorder]), recorder.calls

    return run_ranks(rank, world_size=2)


def _steps(calls: list[tuple]) -> list[int]:
    return [step for hook, step, _, _ in calls if hook == "step"]


def test_hooks_run_on_every_rank_in_order_with_the_step_and_epoch(tmp_path):
    args = [*BASE, "--max_steps", "10", "--eval_every", "4", "--checkpointing_steps", "6", "--output_dir",
            str(tmp_path)]
    ranks = _train(args)
    expected = [("begin", 0, 0, (10, True))]
    for step in range(1, 11):
        epoch = (step - 1) // 8
        expected.append(("step", step, epoch, None))
        if step % 4 == 0:
            expected.append(("evaluate", step, epoch, 64))
        if step == 6:
            expected.append(("save", 6, 0, "step_00000006"))
    expected += [("evaluate", 10, 1, 64), ("end", 10, 1, 10)]  # the final weights' evaluation, then the summary
    assert ranks[0][1] == ranks[1][1] == expected
    assert ranks[0][0]["callbacks"] == ["Recorder"] and "stopped_early" not in ranks[0][0]


def test_a_stop_asked_on_one_rank_ends_every_rank_after_that_step(tmp_path):
    """Rank 1 asks at step 12: both ranks end there and finish as early stopping does (final weights, evaluation,
    summary); the same command again has nothing to do."""
    args = [*BASE, "--max_steps", "20", "--log_every", "5", "--output_dir", str(tmp_path)]
    ranks = _train(args, process=1, stop=12)
    for summary, calls in ranks:
        assert summary["optimizer_steps"] == 12
        assert summary["stopped_early"] == {"step": 12, "reason": "callback Recorder.on_step_end on rank 1 set "
                                                                  "should_stop"}
        assert _steps(calls) == list(range(1, 13))
        assert calls[-2:] == [("evaluate", 12, 1, 64), ("end", 12, 1, 12)]
    assert read_summary(tmp_path)["optimizer_steps"] == 12 and (tmp_path / "model.safetensors").is_file()
    losses = [row["step"] for row in read_metrics(tmp_path) if "loss" in row]
    assert losses == [5, 10, 12]  # the stop's step is logged, as a last step is
    again = train_ranks([*args, "--resume_from_checkpoint", "auto"])
    assert [summary["optimizer_steps"] for summary in again] == [12, 12]  # finished: nothing trained


def test_a_save_and_an_evaluation_asked_on_one_rank_happen_at_that_step_on_every_rank(tmp_path):
    """Rank 0 asks for a checkpoint at step 5 (none are scheduled), rank 1 for an evaluation at step 7 (none before
    the epoch's end): the checkpoint of step 5 is written through the collective save, on_save runs on every rank;
    step 7 is evaluated and recorded."""
    args = [*BASE, "--max_steps", "8", "--output_dir", str(tmp_path)]
    ranks = _train(args, process=0, save=5, evaluate_on=1, evaluate=7)  # one run: each rank asks for one of them
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_00000005"]
    for _, calls in ranks:
        assert [(hook, step, given) for hook, step, _, given in calls if hook in ("save", "evaluate")] == [
            ("save", 5, "step_00000005"), ("evaluate", 7, 64), ("evaluate", 8, 64)]
    assert [row["step"] for row in read_metrics(tmp_path) if "eval_loss" in row] == [7, 8]


def test_a_stop_and_a_save_asked_in_on_evaluate_are_honoured_at_that_evaluation(tmp_path):
    """Early stopping written as a callback: rank 1 asks in on_evaluate at step 4 (``--eval_every 4``) for a stop and
    a checkpoint; every rank saves step 4 and stops there."""
    args = [*BASE, "--max_steps", "16", "--eval_every", "4", "--output_dir", str(tmp_path)]
    ranks = _train(args, process=1, stop_on_eval=4)
    for summary, calls in ranks:
        assert summary["optimizer_steps"] == 4
        assert summary["stopped_early"]["reason"] == "callback Recorder.on_evaluate on rank 1 set should_stop"
        assert _steps(calls) == [1, 2, 3, 4] and ("save", 4, 0, "step_00000004") in calls
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_00000004"]


def test_a_resumed_run_continues_the_step_count(tmp_path):
    args = [*BASE, "--checkpointing_steps", "4", "--output_dir", str(tmp_path)]
    _train([*args, "--max_steps", "8"])
    ranks = _train([*args, "--max_steps", "12", "--resume_from_checkpoint", "auto"])
    for summary, calls in ranks:
        assert calls[0] == ("begin", 8, 1, (12, calls[0][3][1]))
        assert _steps(calls) == [9, 10, 11, 12] and summary["optimizer_steps"] == 12


class Boom:
    """Raises in on_step_end at step 6 on rank 1, after asking for a checkpoint at step 3."""

    def on_step_end(self, state):
        state.should_save = state.step == 3
        if state.step == 6 and state.process_index == 1:
            raise ValueError(f"boom at step {state.step}")


def test_a_callback_that_raises_stops_every_rank_with_one_line_and_keeps_the_checkpoints(tmp_path, capfd):
    args = [*BASE, "--max_steps", "20", "--callbacks", "tests.test_callbacks:Boom", "--output_dir", str(tmp_path)]
    assert main_ranks(args, timeout=60) == [1, 1]
    err = capfd.readouterr().err
    lines = [line for line in err.split("\n") if line.startswith("accel_ddp: error:")]
    assert len(lines) == 1, err
    assert lines[0].startswith("accel_ddp: error: callback Boom.on_step_end raised ValueError: boom at step 6 (at ")
    source, first = inspect.getsourcelines(Boom.on_step_end)
    raised = first + next(i for i, text in enumerate(source) if "raise" in text)
    assert lines[0].endswith(f"test_callbacks.py:{raised})")  # where the callback raised
    assert_quiet(err)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_00000003"]
    assert not (tmp_path / "summary.json").exists()


class StopAt3:
    def on_step_end(self, state):
        state.should_stop = state.step == 3 and not state.is_main_process


def test_the_command_line_takes_callbacks_by_name(tmp_path):
    args = [*BASE, "--max_steps", "10", "--callbacks", "tests.test_callbacks:StopAt3, tests.test_callbacks:Recorder",
            "--output_dir", str(tmp_path)]
    assert main_ranks(args) == [0, 0]
    summary = read_summary(tmp_path)
    assert summary["optimizer_steps"] == 3 and summary["callbacks"] == ["StopAt3", "Recorder"]


class NoHooks:
    def on_epoch_end(self, state):
        pass


class NeedsArgs:
    def __init__(self, patience):
        self.patience = patience

    def on_step_end(self, state):
        pass


class TrainerStyle:
    def on_step_end(self, args, state, control, **kwargs):
        pass


@pytest.mark.parametrize("names, message", [
    ("StopAt3", "--callbacks StopAt3: give each callback as 'pkg.module:Name'"),
    ("no_such_pkg.cbs:Stop", "--callbacks no_such_pkg.cbs:Stop: cannot import module 'no_such_pkg.cbs'"),
    ("tests.test_callbacks:Missing", "module 'tests.test_callbacks' has no function 'Missing'"),
    ("tests.test_callbacks:NoHooks", "callback NoHooks has none of the hooks on_train_begin, on_step_end, "
                                     "on_evaluate, on_save, on_train_end; define at least one"),
    ("tests.test_callbacks:NeedsArgs", "--callbacks tests.test_callbacks:NeedsArgs: NeedsArgs() raised TypeError"),
    ("tests.test_callbacks:TrainerStyle", "callback TrainerStyle.on_step_end cannot be called as on_step_end(state)"),
])
def test_a_callback_that_cannot_be_made_or_called_is_refused_in_one_line(names, message):
    with pytest.raises(ConfigError) as caught:
        Callbacks.build(f"tests.test_callbacks:StopAt3,{names}", None)
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_the_python_api_takes_objects_and_classes_and_refuses_what_has_no_hook():
    built = Callbacks.build(None, [StopAt3, Recorder(process=1)])
    assert [type(c).__name__ for c in built.callbacks] == ["StopAt3", "Recorder"]
    with pytest.raises(ConfigError, match="callback object has none of the hooks"):
        Callbacks.build(None, [object()])
    state = built.state
    with pytest.raises(AttributeError):
        state.step = 3  # read-only
    with pytest.raises(AttributeError):
        state.should_stopp = True  # a misspelt request is an error, not ignored


def test_a_refused_callback_is_one_line_and_exit_2_on_every_rank(tmp_path, capfd):
    args = [*BASE, "--max_steps", "4", "--callbacks", "tests.test_callbacks:NoHooks", "--output_dir", str(tmp_path)]
    assert main_ranks(args) == [2, 2]
    err = capfd.readouterr().err
    assert err.count("accel_ddp: error: callback NoHooks has none of the hooks") == 1 and "Traceback" not in err


class AskEvaluation:
    def on_step_end(self, state):
        state.should_evaluate = True


def test_an_evaluation_asked_of_a_run_without_an_eval_set_is_said_once_and_dropped(monkeypatch):
    import accel_ddp.callbacks as callbacks

    said = []
    monkeypatch.setattr(callbacks, "warn", lambda message, **kwargs: said.append(message))
    one_process = SimpleNamespace(is_main_process=True, process_index=0, num_processes=1)
    hooks = Callbacks([AskEvaluation()]).connect(one_process, None, SimpleNamespace(total_steps=4, steps_per_epoch=2),
                                                 evaluates=False)
    assert [hooks.step_end(step, 0).evaluate for step in (1, 2, 3)] == [False, False, False]
    assert said == ["a callback set should_evaluate at step 1, but the run has no eval set: nothing to evaluate"]


def test_the_stop_reason_names_the_lowest_rank_and_its_first_callback_that_asked():
    """Who asked rides in the agreed stop flag (the all-reduce keeps its MAX): of several askers, the lowest rank's
    first callback is named."""
    codes = {}
    for rank in (0, 1):
        hooks = Callbacks([AskEvaluation(), StopAt3()]).connect(
            SimpleNamespace(is_main_process=rank == 0, process_index=rank, num_processes=2), None,
            SimpleNamespace(total_steps=4, steps_per_epoch=2), evaluates=True)
        codes[rank] = {(index, hook): hooks._stop_code(hook, index) for index in (0, 1) for hook in (1, 2)}
    everyone = [code for rank_codes in codes.values() for code in rank_codes.values()]
    assert len(set(everyone)) == len(everyone)  # one code per (rank, callback, hook)
    assert hooks._who(max(codes[0][1, 1], codes[1][0, 1])) == "callback StopAt3.on_step_end on rank 0 set should_stop"
    assert hooks._who(max(codes[1].values())) == "callback AskEvaluation.on_evaluate on rank 1 set should_stop"
