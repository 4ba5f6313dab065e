"""What the loop does per optimizer step beyond the bare DDP loop: no host syncs, a cheap preemption check;
start-up time; imports kept off the light paths (the update's arithmetic: tests/step/test_train_step.py).

Speed itself is measured in benchmarks/tax.py, against the bare loop; these tests pin the behaviour.
"""

from __future__ import annotations

import ast
import hashlib
import os
import signal
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import TensorDataset

from accel_ddp.cli.args import parse_args
from accel_ddp.data.builtin import read_digits
from accel_ddp.tracking.startup import StartupClock, process_age
from tests.helpers.multiproc import RankFailed, free_port, run_ranks
from tests.helpers.runs import REPO, load_weights, read_metrics, train_ranks
from tests.helpers.syncs import OVERHEAD_RUN, count_host_syncs

# ----------------------------------------------------------------------------- host syncs


def test_no_host_sync_per_optimizer_step_outside_log_steps(tmp_path):
    """16 more optimizer steps (same epoch, no evaluation, no checkpoint) add no .item()-like call on any rank,
    while logging every step adds at least one per step: what a GPU run would stall on is only at log lines.

    SGD, because torch's multi-tensor AdamW reads its step counters with .item() every step: CPU tensors
    by design (no device sync; the fused AdamW accel_ddp uses on CUDA keeps them on the device).
    """
    def counts(steps: int, log_every: int, name: str) -> list[Counter]:
        args = [*OVERHEAD_RUN, "--max_steps", str(steps), "--log_every", str(log_every), "--eval_every", "1000",
                "--output_dir", str(tmp_path / name)]
        return run_ranks(lambda: count_host_syncs(args), world_size=2)

    short, long, logged = counts(8, 1000, "short"), counts(24, 1000, "long"), counts(24, 1, "logged")
    for rank in range(2):
        assert long[rank] == short[rank], f"rank {rank}: {short[rank]} syncs for 8 steps, {long[rank]} for 24"
        assert logged[rank]["item"] >= long[rank]["item"] + 23  # the counting sees the log lines' syncs


# ----------------------------------------------------------------------------- preemption


def _train_until_preempted(args: list[str], signal_after: int) -> tuple[int, int, str, str]:
    """In a forked rank: rank 1 sends itself SIGUSR1 right after optimizer step ``signal_after``; returns (step of
    the signal, step the rank stopped after, the signal it reports, the checkpoint it saved)."""
    from torch.optim.optimizer import register_optimizer_step_post_hook

    import accel_ddp.lifecycle.preemption as preemption
    from accel_ddp.loop import train

    preemption.CHECK_EVERY_SECONDS = 0.02  # compare flags often, so that a short run shows several comparisons
    steps = [0]

    def after_step(*_):
        steps[0] += 1
        if steps[0] == signal_after and os.environ["RANK"] == "1":
            os.kill(os.getpid(), signal.SIGUSR1)

    register_optimizer_step_post_hook(after_step)
    try:
        train(parse_args(args))
    except preemption.Preempted as stop:
        return signal_after, stop.step, stop.signal_name, stop.checkpoint
    raise AssertionError("the run finished: the signal was not acted on")


def test_a_signal_to_one_rank_stops_every_rank_after_the_same_step(tmp_path):
    args = [*OVERHEAD_RUN, "--synthetic_samples", "8192", "--epochs", "1", "--output_dir", str(tmp_path)]  # 512 steps
    results = run_ranks(lambda: _train_until_preempted(args, signal_after=40), world_size=2)
    (sent, stopped, name, saved), other = results
    assert other == results[0], f"the ranks disagree: {results}"  # same step, same signal, same checkpoint
    assert name == "SIGUSR1" and sent <= stopped < 512  # after the step the signal came in, long before the end
    assert saved == str(tmp_path / "checkpoints" / f"step_{stopped:08d}")
    assert (Path(saved) / "model.safetensors").is_file()


def test_ranks_compare_flags_now_and_then_not_after_every_step(tmp_path):
    """With steps of a few ms, the flag all-reduce runs on a small share of the steps (still on every rank alike)."""
    def count_all_reduces():
        import torch.distributed as dist

        import accel_ddp.lifecycle.preemption as preemption
        from accel_ddp.loop import train

        calls = [0]
        original = dist.all_reduce

        def counting(tensor, *args, **kwargs):
            calls[0] += tensor.dtype == torch.int64 and tensor.numel() == 2  # the flag's shape
            return original(tensor, *args, **kwargs)

        preemption.dist.all_reduce = counting  # the module's own reference to torch.distributed
        try:
            train(parse_args([*OVERHEAD_RUN, "--epochs", "4", "--output_dir", str(tmp_path)]))  # 128 steps
        finally:
            preemption.dist.all_reduce = original
        return calls[0]

    checks = run_ranks(count_all_reduces, world_size=2)
    assert checks[0] == checks[1] and 2 <= checks[0] < 64, checks


def test_one_process_launch_on_cpu_trains_the_plain_model_with_the_same_bits(tmp_path):
    """A launcher's one CPU process (LOCAL_RANK set: Accelerate's MULTI_CPU) gets no 1-rank DDP wrap, and ends
    with the weights of `python train.py` (no launcher at all)."""
    def run(out: str):
        from contextlib import ExitStack

        from accel_ddp.loop import finish, fit, setup

        with ExitStack() as teardown:
            state = setup(parse_args([*OVERHEAD_RUN, "--epochs", "1", "--output_dir", out]), teardown)
            wrapped = isinstance(state.model, torch.nn.parallel.DistributedDataParallel)
            finish(state, fit(state))
            return state.accelerator.distributed_type.value, wrapped

    torchrun = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "GROUP_RANK": "0",
                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    assert run_ranks(lambda: run(str(tmp_path / "launched")), world_size=1, env=torchrun) == [("MULTI_CPU", False)]
    assert run_ranks(lambda: run(str(tmp_path / "plain")), world_size=1) == [("NO", False)]
    launched, plain = load_weights(tmp_path / "launched"), load_weights(tmp_path / "plain")
    assert launched.keys() == plain.keys() and all(torch.equal(launched[k], plain[k]) for k in plain)


# ----------------------------------------------------------------------------- start-up


def test_startup_sec_is_the_slowest_ranks_process_start_to_first_step(tmp_path):
    summaries = train_ranks([*OVERHEAD_RUN, "--epochs", "1", "--output_dir", str(tmp_path)])
    assert summaries[0]["startup_sec"] == summaries[1]["startup_sec"]  # the max over ranks, on every rank
    for summary in summaries:
        phases = summary["startup_phases_sec"]
        assert list(phases) == ["imports", "process_group", "data", "model", "loaders", "optimizer_and_prepare",
                                "resume_and_config", "first_step"]
        assert all(seconds >= 0 for seconds in phases.values())
        # Forked ranks start at the fork, moments before train(): the phases add up to this rank's start-up.
        assert 0 < sum(phases.values()) <= summary["startup_sec"] + 0.01 < 60  # phases are rounded to ms


def test_startup_clock_counts_from_the_process_start():
    age = process_age()
    assert age is not None and 0 < age < 24 * 3600  # the test process started earlier today
    clock = StartupClock()
    clock.mark("work")
    phases = clock.phases()
    assert list(phases) == ["imports", "work"] and phases["imports"] >= age - 1e-3
    assert clock.seconds() == pytest.approx(sum(phases.values()))


# ----------------------------------------------------------------------------- measurements


def test_epoch_records_carry_host_cpu_per_step(tmp_path):
    data = TensorDataset(torch.randn(128, 6), torch.randint(0, 3, (128,)))

    def run():
        from accel_ddp.config import TrainConfig
        from accel_ddp.loop import train
        from accel_ddp.models import build_model

        cfg = TrainConfig(global_batch_size=16, epochs=2, output_dir=str(tmp_path))
        return train(cfg, model=build_model("mlp", 3, (6,), 8), train_dataset=data)

    summary = run_ranks(run, world_size=1)[0]
    epochs = [r for r in read_metrics(tmp_path) if "step_time_p50_ms" in r]
    assert len(epochs) == 2 and all(r["cpu_ms_per_step"] > 0 for r in [*epochs, summary])


def test_log_lines_leave_out_the_evaluation_between_epochs(tmp_path):
    """The throughput meter restarts after each epoch's evaluation: the next log line's samples/s is training only."""
    def run():
        import accel_ddp.loop as loop
        import accel_ddp.tracking.step_log as step_log

        resets = []

        class Meter(step_log.ThroughputMeter):
            def reset(self, step: int) -> None:
                resets.append(step)
                super().reset(step)

        step_log.ThroughputMeter = Meter
        loop.train(parse_args([*OVERHEAD_RUN, "--synthetic_samples", "128", "--epochs", "2", "--output_dir",
                               str(tmp_path)]))
        return resets

    assert run_ranks(run, world_size=1) == [[0, 8, 16]]  # at the start, then after each epoch's evaluation


# ----------------------------------------------------------------------------- imports


def _imports_at_load(module: str) -> set[str]:
    """Modules that importing ``module`` (an accel_ddp module) imports at load time, its parent packages included,
    following accel_ddp's own imports; imports inside functions are not followed (they are the lazy ones)."""
    seen, todo, found = set(), [module], set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        parts = name.split(".")
        todo += [".".join(parts[:i]) for i in range(1, len(parts))]  # the packages' __init__ run first
        path = REPO.joinpath(*parts)
        source = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
        for node in ast.parse(source.read_text()).body:  # top level only
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module] if isinstance(node, ast.ImportFrom) and node.module else [])
            for imported in names:
                found.add(imported.split(".")[0])
                if imported.startswith("accel_ddp"):
                    todo.append(imported)
                    if isinstance(node, ast.ImportFrom):  # from accel_ddp import loop: a submodule
                        todo += [f"{imported}.{a.name}" for a in node.names
                                 if REPO.joinpath(*imported.split("."), f"{a.name}.py").is_file()]
    return found


@pytest.mark.parametrize(
    "module",
    ["accel_ddp.models", "accel_ddp.transforms.fused_activations", "accel_ddp.data", "accel_ddp.config",
     "accel_ddp.tracking.startup"],
)
def test_light_modules_import_no_accelerate(module):
    """benchmarks/bare_ddp.py builds its model and data with these: they must not pull in Accelerate."""
    assert "accelerate" not in _imports_at_load(module)


def test_training_imports_no_plotting_sklearn_or_datasets_at_load():
    """matplotlib (curves.png, at the end), scikit-learn (digits are read from its CSV) and datasets (HF sources)
    are imported where used, not by every rank's start-up."""
    assert not {"matplotlib", "sklearn", "datasets", "tensorboard"} & _imports_at_load("accel_ddp.loop")


def test_digits_are_read_without_scikit_learn_as_load_digits_returns_them():
    images, labels = read_digits()
    assert images.shape == (1797, 8, 8) and labels.shape == (1797,)
    digest = hashlib.sha256(images.astype(np.uint8).tobytes() + labels.astype(np.int64).tobytes()).hexdigest()
    assert digest == "65e5b4619795efb40c1082f4c350c049e4ad552200d369b6ae99e21eef5e72c5"  # load_digits(), sklearn 1.x


# ----------------------------------------------------------------------------- train() again; its door (issue 50)


def _tiny_train(out: Path, **overrides):
    """``train()`` of a small Linear on 64 samples, 4 optimizer steps; ``overrides`` replace its arguments."""
    from accel_ddp.config import TrainConfig
    from accel_ddp.loop import train

    arguments = {"cfg": TrainConfig(global_batch_size=16, max_steps=4, output_dir=str(out)),
                 "model": torch.nn.Sequential(torch.nn.Linear(6, 3)),
                 "train_dataset": TensorDataset(torch.randn(64, 6), torch.randint(0, 3, (64,)))}
    arguments.update(overrides)
    return train(arguments.pop("cfg"), **arguments)


@pytest.mark.parametrize("store", ["env", "launcher"])
def test_train_called_again_in_the_same_process_trains_and_returns_its_summary_on_every_rank(store, tmp_path,
                                                                                             request):
    """A sweep or a notebook: three train() calls in one process, on 2 ranks, each forming its process group again
    (over env://, where rank 0 hosts the store, and over torchrun's agent store, which outlives every group)."""
    env = request.getfixturevalue("launcher_store")[1] if store == "launcher" else {}

    def sweep() -> list[tuple[int, bool]]:
        from accelerate import PartialState

        # After each call the caller still asks Accelerate which rank it is (the README's example does)
        return [(_tiny_train(tmp_path / f"run{i}")["optimizer_steps"], PartialState().is_main_process)
                for i in range(3)]

    assert run_ranks(sweep, world_size=2, env=env) == [[(4, True)] * 3, [(4, False)] * 3]
    assert all((tmp_path / f"run{i}" / "summary.json").is_file() for i in range(3))


@pytest.mark.parametrize("argument,value,words", [
    ("model", "not a model", "model= must be a torch.nn.Module, not a str"),
    ("cfg", {"epochs": 1}, "cfg= must be a TrainConfig, not a dict; build one with TrainConfig(**your_dict)"),
    ("train_dataset", [1, 2, 3], "train_dataset= must be a Dataset of tensors, tuples or dicts: its sample 0 is an "
                                 "int"),
    ("eval_dataset", "data.csv", "eval_dataset= must be a Dataset (a torch.utils.data.Dataset, a datasets.Dataset), "
                                 "not a str"),
    ("train_dataset", {"x": [1.0]}, "train_dataset= must be a Dataset (a torch.utils.data.Dataset, a "
                                    "datasets.Dataset), not a dict"),
])
def test_train_refuses_arguments_of_the_wrong_kind_at_the_door_in_one_line(argument, value, words, tmp_path):
    from accel_ddp.util.validation import ConfigError

    with pytest.raises(ConfigError) as refused:
        _tiny_train(tmp_path / "run", **{argument: value})
    assert isinstance(refused.value, TypeError)  # either except clause catches it
    assert str(refused.value).startswith(words), str(refused.value)
    assert "\n" not in str(refused.value) and not (tmp_path / "run").exists()


class _FailsOnRankZero(torch.utils.data.Dataset):
    """A user's dataset whose reads fail on rank 0 from its third sample read on."""

    def __init__(self):
        self.reads = 0

    def __len__(self) -> int:
        return 64

    def __getitem__(self, index):
        self.reads += 1
        if os.environ.get("RANK") == "0" and self.reads > 2:
            raise OSError(f"cannot read sample {index}: disk gone")
        return torch.full((6,), float(index)), index % 3


class _ForwardFailsOnRankZero(torch.nn.Module):
    """A user's model whose third training forward fails on rank 0 (the DDP model then stays in the traceback)."""

    def __init__(self):
        super().__init__()
        self.linear, self.calls = torch.nn.Linear(6, 3), 0

    def forward(self, x):
        self.calls += 1
        if os.environ.get("RANK") == "0" and self.training and self.calls > 2:
            raise OSError("cannot read sample 7: disk gone")
        return self.linear(x)


@pytest.mark.parametrize("store", ["env", "launcher"])
@pytest.mark.parametrize("where", ["dataset", "forward"])
def test_a_failure_on_rank_0_is_named_by_rank_1_not_its_transport_error(store, where, tmp_path, request):
    """Rank 0's dataset raises in __getitem__ (a DataLoader without workers: the rank reads), or its model's forward:
    rank 0 raises that error, rank 1 a PeerFailed naming rank 0 and its error, never gloo's "Connection closed by
    peer". Under torchrun's store, which outlives rank 0, and over env://, where rank 0's process hosts the store
    (as mpirun's and these forked ranks'): rank 0 then ends its group's connections and keeps the store until rank 1
    has read its failure (``failure.outlive_readers``), which it did (no wait ran out), and returns."""
    from accel_ddp.config import TrainConfig
    from accel_ddp.lifecycle import failure

    env = request.getfixturevalue("launcher_store")[1] if store == "launcher" else {}

    def run() -> tuple[str, list[bool]]:
        waits: list[bool] = []
        wait_for = failure._wait_for
        failure._wait_for = lambda *args: waits.append(wait_for(*args)) or waits[-1]
        cfg = TrainConfig(global_batch_size=16, max_steps=4, output_dir=str(tmp_path), loader="dataloader",
                          num_workers=0)
        parts = {"train_dataset": _FailsOnRankZero()} if where == "dataset" else {"model": _ForwardFailsOnRankZero()}
        try:
            _tiny_train(tmp_path, cfg=cfg, **parts)
        except Exception as err:  # noqa: BLE001 - what each rank raised is the outcome
            return f"{type(err).__name__}: {err}", waits
        return "trained", waits

    (rank0, waits), (rank1, _) = run_ranks(run, world_size=2, env=env)
    assert rank0.startswith("OSError: cannot read sample"), rank0
    assert rank1.startswith("PeerFailed: rank 0 failed: OSError: cannot read sample"), rank1
    assert "Connection" not in rank1 and "gloo" not in rank1.split("; this rank")[0], rank1
    assert waits == ([True] if store == "env" else []), waits  # env://: rank 0 waited, and not in vain


class _DiesOnRankOne(_FailsOnRankZero):
    """A user's dataset whose process on rank 1 ends at its third sample read, without a word (as if killed)."""

    def __getitem__(self, index):
        if os.environ.get("RANK") == "1" and self.reads >= 2:
            os._exit(9)
        self.reads += 1
        return torch.full((6,), float(index)), index % 3


def test_rank_0_does_not_wait_for_a_peer_that_is_gone(tmp_path):
    """Rank 1's process ends mid-run: rank 0's train() raises its lost connection at once, without waiting for rank
    1 to read its failure (``failure.outlive_readers``: a rank gone reads nothing; ``ACK_WAIT_S`` would be lost)."""
    import json

    from accel_ddp.config import TrainConfig
    from accel_ddp.lifecycle import failure

    def run() -> None:
        waits: list[bool] = []
        wait_for = failure._wait_for
        failure._wait_for = lambda *args: waits.append(wait_for(*args)) or waits[-1]
        cfg = TrainConfig(global_batch_size=16, max_steps=4, output_dir=str(tmp_path / "run"), loader="dataloader",
                          num_workers=0)
        try:
            _tiny_train(tmp_path, cfg=cfg, train_dataset=_DiesOnRankOne())
        except Exception as err:  # noqa: BLE001 - what rank 0 raised is the outcome
            (tmp_path / "rank0.json").write_text(json.dumps([type(err).__name__, waits]))

    with pytest.raises(RankFailed) as failed:
        run_ranks(run, world_size=2)
    assert set(failed.value.failures) == {1}, failed.value  # rank 1 ended; rank 0 returned
    assert json.loads((tmp_path / "rank0.json").read_text()) == ["RuntimeError", []]
