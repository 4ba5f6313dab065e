"""The DDP semantics of DESIGN.md, proven on real 2-rank gloo groups (forked ranks; a few real launches)."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

from accel_ddp import TrainConfig, train
from tests.helpers.data import IndexDataset, IndexRecorder
from tests.helpers.host_memory import GLIBC, PAGES
from tests.helpers.multiproc import run_ranks
from tests.helpers.runs import (
    CPU_2PROC,
    check,
    launcher_env,
    load_weights,
    read_metrics,
    read_summary,
    run_single,
    train_ranks,
)

# 320 samples / global batch 32 = 10 optimizer steps per epoch, 3 epochs = 30 steps.
EQUIV_ARGS = ["--dataset", "synthetic", "--synthetic_samples", "320", "--synthetic_shape", "12",
              "--model", "mlp", "--hidden_size", "16", "--global_batch_size", "32", "--epochs", "3",
              "--optimizer", "sgd", "--lr", "0.05", "--warmup_steps", "3", "--log_every", "5"]


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    """The same training run under four (world size, per-device batch, accumulation) layouts."""
    root = tmp_path_factory.mktemp("layouts")
    runs = {
        "2x16": (2, 16),   # 2 ranks, no accumulation
        "1x32": (1, 32),   # 1 process, the whole global batch at once
        "1x16": (1, 16),   # 1 process, 2 accumulation micro-steps
        "2x8": (2, 8),     # 2 ranks with 2 accumulation micro-steps each
    }
    out = {}
    for name, (world, per_device) in runs.items():
        train_ranks([*EQUIV_ARGS, "--per_device_batch_size", str(per_device), "--output_dir", str(root / name)],
                    world_size=world)
        out[name] = root / name
    return out


def test_same_weights_whatever_the_world_size_and_accumulation(layouts):
    reference = load_weights(layouts["1x32"])
    for name in ("2x16", "1x16", "2x8"):
        weights = load_weights(layouts[name])
        assert weights.keys() == reference.keys()
        for key in reference:
            assert torch.allclose(weights[key], reference[key], atol=1e-5), f"{name}: {key} differs"
    initial = torch.nn.Linear(12, 16)  # sanity: training moved the weights far beyond the tolerance
    assert not torch.allclose(reference["1.weight"], initial.weight, atol=1e-2)


def test_layouts_report_their_world_and_accumulation(layouts):
    expected = {"2x16": (2, 16, 1), "1x32": (1, 32, 1), "1x16": (1, 16, 2), "2x8": (2, 8, 2)}
    for name, (world, per_device, accumulation) in expected.items():
        summary = read_summary(layouts[name])
        assert (summary["world_size"], summary["per_device_batch_size"], summary["grad_accum_steps"]) == (
            world, per_device, accumulation)
        assert summary["global_batch_size"] == 32


def test_lr_schedule_steps_once_per_optimizer_step(layouts):
    for name, run in layouts.items():
        summary = read_summary(run)
        assert summary["optimizer_steps"] == 30, name
        assert summary["lr_scheduler_steps"] == summary["optimizer_steps"], name
        lrs = {r["step"]: r["lr"] for r in read_metrics(run) if "lr" in r}
        assert lrs[5] == pytest.approx(layouts_lr(5)), name  # logged after step 5: schedule index 5
        assert lrs[30] == pytest.approx(0.0, abs=1e-12), name  # cosine reaches 0 at the last step


def layouts_lr(step: int) -> float:
    from accel_ddp.optim.build import lr_multiplier

    return 0.05 * lr_multiplier(step, "cosine", warmup_steps=3, total_steps=30)


# The same run with the Python API's own optimizer and schedule: RAdam, StepLR halving the LR every 7 steps.
USER_ARGS = ["--dataset", "synthetic", "--synthetic_samples", "320", "--synthetic_shape", "12", "--model", "mlp",
             "--hidden_size", "16", "--global_batch_size", "32", "--epochs", "3", "--log_every", "5"]


def _users_run(out, world: int, per_device: int, built: bool) -> list[dict]:
    """``train(..., model=, optimizer=, lr_scheduler=)`` on ``world`` ranks: functions, or (``built``) an optimizer
    and a scheduler already built on the model, as a Lightning or Trainer user would hand them over."""
    from accel_ddp.cli.args import parse_args
    from accel_ddp.models import build_model

    def rank() -> dict:
        torch.manual_seed(0)  # the same initial weights in every run (DDP broadcasts rank 0's anyway)
        model = build_model("mlp", num_classes=10, input_shape=(12,), hidden_size=16)
        cfg = parse_args([*USER_ARGS, "--per_device_batch_size", str(per_device), "--output_dir", str(out)])
        radam = lambda groups: torch.optim.RAdam(groups, lr=0.05)  # noqa: E731
        step_lr = lambda optimizer: torch.optim.lr_scheduler.StepLR(optimizer, step_size=7, gamma=0.5)  # noqa: E731
        if built:
            optimizer = radam(model.parameters())
            return train(cfg, model=model, optimizer=optimizer, lr_scheduler=step_lr(optimizer))
        return train(cfg, model=model, optimizer=radam, lr_scheduler=step_lr)

    return run_ranks(rank, world_size=world)


def test_a_users_optimizer_and_schedule_give_the_same_weights_on_1_and_2_ranks(tmp_path):
    """RAdam and StepLR given to train() on 1 process, 2 ranks, 2 ranks with accumulation: the same weights, and
    the schedule stepped once per optimizer step in each (its LR halved after steps 7, 14, 21 and 28)."""
    runs = {"1x32": (1, 32, False), "2x16": (2, 16, True), "2x8": (2, 8, False)}
    for name, (world, per_device, built) in runs.items():
        summaries = _users_run(tmp_path / name, world, per_device, built)
        assert summaries[0]["optimizer"] == "RAdam (train(optimizer=...))" and summaries[0]["grad_accum_steps"] == (
            32 // (world * per_device))
        assert summaries[0]["lr_scheduler_steps"] == summaries[0]["optimizer_steps"] == 30
        lrs = {r["step"]: r["lr"] for r in read_metrics(tmp_path / name) if "lr" in r}
        assert lrs[5] == 0.05 and lrs[15] == 0.0125 and lrs[30] == 0.05 / 16, name
    reference = load_weights(tmp_path / "1x32")
    for name in ("2x16", "2x8"):
        weights = load_weights(tmp_path / name)
        for key in reference:
            assert torch.allclose(weights[key], reference[key], atol=1e-5), f"{name}: {key} differs"
    from accel_ddp.models import build_model

    torch.manual_seed(0)
    initial = build_model("mlp", num_classes=10, input_shape=(12,), hidden_size=16)
    assert not torch.allclose(reference["1.weight"], initial[1].weight, atol=1e-2)  # trained far beyond tolerance


def test_two_ranks_form_one_cpu_group(layouts):
    summary = read_summary(layouts["2x16"])
    assert summary["world_size"] == 2
    assert summary["distributed_type"] == "MULTI_CPU"
    assert summary["device"] == "cpu"


def _record(tmp_path, world: int, per_device: int, seed: int = 3) -> list[list[int]]:
    """Per optimizer step, the sorted sample indices all ranks trained on (global batch 8, 3 epochs)."""
    def served() -> list[list[int]]:
        model = IndexRecorder()
        cfg = TrainConfig(global_batch_size=8, per_device_batch_size=per_device, epochs=3, seed=seed,
                          optimizer="sgd", lr=0.1, output_dir=str(tmp_path / f"w{world}b{per_device}s{seed}"))
        train(cfg, model=model, train_dataset=IndexDataset(100))
        return model.seen

    per_rank = run_ranks(served, world_size=world)
    micro_per_step = 8 // (world * per_device)
    steps = []
    for step in range(len(per_rank[0]) // micro_per_step):
        chunk = slice(step * micro_per_step, (step + 1) * micro_per_step)
        steps.append(sorted(i for rank in per_rank for batch in rank[chunk] for i in batch))
    return steps


@pytest.fixture(scope="module")
def two_ranks_served(tmp_path_factory) -> list[list[int]]:
    """``_record`` on 2 ranks x 4, seed 3: the one run both sampling tests read."""
    return _record(tmp_path_factory.mktemp("served"), world=2, per_device=4)


def test_sharding_covers_each_sample_once_per_epoch_in_a_new_order(two_ranks_served):
    steps = two_ranks_served
    steps_per_epoch = 100 // 8  # 12 steps: 96 samples, the last 4 are dropped each epoch
    assert len(steps) == 3 * steps_per_epoch
    epochs = [steps[e * steps_per_epoch:(e + 1) * steps_per_epoch] for e in range(3)]
    for epoch in epochs:
        seen = [i for step in epoch for i in step]
        assert len(seen) == 96 and len(set(seen)) == 96, "a sample was repeated or lost within an epoch"
    assert epochs[0] != epochs[1] and epochs[1] != epochs[2], "the order did not change between epochs"


def test_same_samples_per_step_for_any_world_size_and_accumulation(tmp_path, two_ranks_served):
    two_ranks = two_ranks_served
    assert _record(tmp_path, world=1, per_device=8) == two_ranks
    assert _record(tmp_path, world=1, per_device=2) == two_ranks  # accumulation 4
    assert _record(tmp_path, world=2, per_device=4, seed=4) != two_ranks  # the seed does matter


def _prepare_from_a_rank_seeded_init() -> dict:
    """Each rank builds its model from a different seed; what prepare leaves on every rank."""
    from accel_ddp.assemble import build_world
    from accel_ddp.models import build_model

    accelerator, _, _ = build_world(TrainConfig(global_batch_size=8))
    torch.manual_seed(100 + accelerator.process_index)
    model = build_model("mlp", num_classes=3, input_shape=(5,), hidden_size=16)
    before = torch.cat([p.detach().flatten() for p in model.parameters()])
    model = accelerator.prepare(model)
    after = torch.cat([p.detach().flatten() for p in model.parameters()])
    everyone_before = accelerator.gather(before.unsqueeze(0))
    everyone_after = accelerator.gather(after.unsqueeze(0))
    return {
        "world": accelerator.num_processes,
        "differed_before": not torch.equal(everyone_before[0], everyone_before[1]),
        "identical_after": all(torch.equal(everyone_after[0], row) for row in everyone_after),
        "matches_rank0_init": torch.equal(after, everyone_before[0]),
    }


def test_every_rank_starts_from_rank0_weights():
    for result in run_ranks(_prepare_from_a_rank_seeded_init):
        assert result["world"] == 2
        assert result["differed_before"], "the ranks' own inits should differ for this test to mean anything"
        assert result["identical_after"] and result["matches_rank0_init"]


def _train_with_audited_writes(log_prefix: str, args: list[str]) -> int:
    """main(args) while logging every file this rank opens for writing or renames into LOG_PREFIX_rank<R>.log."""
    from accel_ddp.cli.train import main

    log = open(f"{log_prefix}_rank{os.environ.get('RANK', '0')}.log", "w", buffering=1)

    def audit(event: str, event_args: tuple) -> None:
        if event == "open" and isinstance(event_args[0], str) and event_args[1] and \
                any(m in event_args[1] for m in "wax+"):
            log.write(f"open\t{os.path.abspath(event_args[0])}\n")
        elif event in ("os.rename", "os.replace"):
            log.write(f"rename\t{os.path.abspath(event_args[1])}\n")

    sys.addaudithook(audit)  # only in this forked rank: the hook dies with it
    return main(args)


@pytest.mark.curves
def test_only_the_main_process_writes(tmp_path):
    out = tmp_path / "run"
    args = ["--dataset", "synthetic", "--synthetic_samples", "128", "--synthetic_shape", "6", "--hidden_size", "8",
            "--global_batch_size", "16", "--epochs", "2", "--log_every", "4", "--output_dir", str(out)]
    assert run_ranks(lambda: _train_with_audited_writes(str(tmp_path / "audit"), args)) == [0, 0]
    assert sorted(p.name for p in out.iterdir()) == [".lock", "README.md", "config.yaml", "curves.png",
                                                     "metrics.jsonl", "model.safetensors", "run.log", "summary.json"]
    rank0 = (tmp_path / "audit_rank0.log").read_text().splitlines()
    rank1 = (tmp_path / "audit_rank1.log").read_text().splitlines()
    assert not [line for line in rank1 if str(out) in line], f"rank 1 wrote: {rank1}"
    for name in ("config.yaml", "summary.json", "model.safetensors", "curves.png", "README.md"):
        assert sum(line == f"rename\t{out / name}" for line in rank0) == 1, name
    assert sum(line == f"open\t{out / 'metrics.jsonl'}" for line in rank0) == 1
    records = read_metrics(out)
    train_steps = [r["step"] for r in records if "loss" in r]
    assert train_steps == [4, 8, 12, 16], "each logged step appears exactly once"
    assert len([r for r in records if "eval_accuracy" in r]) == 2  # one eval per epoch


def _premade_state_then_main(args: list[str], error_files: str) -> int:
    """A script that builds Accelerate's state without asking for CPU before calling accel_ddp: on a machine
    without GPUs each rank torchrun started then becomes a lone world of 1, and accel_ddp must refuse to train."""
    from accelerate import PartialState

    from accel_ddp.cli.train import main

    os.environ["TORCHELASTIC_ERROR_FILE"] = f"{error_files}{os.environ['RANK']}.json"  # torchrun's, one per worker
    PartialState()  # no cpu=True
    return main(args)


def test_lone_processes_are_refused(tmp_path, capfd, launcher_store):
    """The 2 ranks never met. Forked ranks get what `accelerate launch --config_file cpu_2proc.yaml` gives its
    workers: Accelerate's variables (tests.helpers.runs.launcher_env), torchrun's and its store (launcher_store)."""
    _, env = launcher_store
    env.update(launcher_env(["--config_file", str(CPU_2PROC), "--num_processes", "2"]))
    args = ["--dataset", "synthetic", "--output_dir", str(tmp_path)]
    assert run_ranks(lambda: _premade_state_then_main(args, str(tmp_path / "error")), env=env) == [2, 2]
    # One error line; the launcher's failure summary names the error too: it prints each rank's error file.
    assert capfd.readouterr().err.count(
        "accel_ddp: error: the launcher started 2 processes but they formed a group of 1") == 1
    for rank in (0, 1):
        recorded = json.loads((tmp_path / f"error{rank}.json").read_text())["message"]["message"]
        # The rank that claimed first records its error, the other that it stopped for it: the same error either way.
        assert recorded.removeprefix("stopped because rank 0 failed: ").removeprefix(
            "stopped because rank 1 failed: ").startswith(
            "LaunchError: the launcher started 2 processes but they formed a group of 1")
    assert not (tmp_path / "metrics.jsonl").exists()


# The README's main run (no flags but the output folder) trains digits to 95% on two launched ranks: in
# tests/cli/test_doctor.py, as the launch that follows `accelerate config` (one launch for both).


@pytest.mark.slow
def test_plain_python(tmp_path):
    """`python train.py`: one process, no launcher. Its pair, `accelerate launch -m accel_ddp train`, is launched in
    test_doctor.py after `accelerate config` (one launch for both, and the default run's 95%)."""
    args = ["--dataset", "synthetic", "--synthetic_samples", "64", "--synthetic_shape", "4",
            "--global_batch_size", "16", "--epochs", "1"]
    check(run_single([*args, "--output_dir", str(tmp_path / "p")]))
    assert read_summary(tmp_path / "p")["world_size"] == 1


@pytest.mark.skipif(not GLIBC, reason="glibc's malloc thresholds only")
def test_every_cpu_rank_keeps_a_steps_freed_host_memory_for_the_next_step():
    def fn():
        from accel_ddp.assemble import build_world
        from tests.helpers.host_memory import faults_per_step, give_freed_memory_back

        give_freed_memory_back()  # whatever the forked test process had set
        before = faults_per_step(3)
        build_world(TrainConfig(global_batch_size=2))
        return before, faults_per_step()

    for before, after in run_ranks(fn, world_size=2):
        assert min(before[1:]) >= PAGES // 2  # glibc gave each step's memory back
        assert max(after[1:]) < PAGES // 20, f"faults per step: {after} (before the world formed: {before})"
