"""Checkpoints, exact resume, preemption and elastic restarts on 2 gloo ranks.

Every multi-process test compares final weights with one uninterrupted run (the ``reference``
fixture). The model is ``mnist_cnn``, whose dropout makes the RNG state part of what a resume
must restore: a resume that loses it, or re-draws a seed, ends with different weights.

Runs are forked ranks of a gloo group (tests/helpers/multiproc.py) except where only a launch shows the
behaviour: torchrun's elastic restart and SIGUSR1 to one of its workers, shown by one launch (``@pytest.mark.slow``;
SIGTERM to the launcher, and its SIGKILL, are launched with DataLoader workers in tests/lifecycle/test_guarantees.py).
A SIGKILL of every rank is a SIGKILL of forked ranks: nothing of theirs runs after it. A forked run
and a launched one of the same command end with bitwise-equal weights, so launched runs are compared with the
forked reference too. Faults come from tests/helpers/faults.py: ``faults.install(...)`` inside a forked rank, or
FAULT_* variables read by tests/scripts/faulty_train.py in a launch:

    FAULT_STEP_DELAY=0.15            sleep after each optimizer step, so a test can signal a live run
    FAULT_CRASH_IN_CHECKPOINT=12     the main process SIGKILLs itself halfway through saving step 12
    FAULT_FAIL_AT_STEP=10:1          rank 1 raises after step 10 ...
    FAULT_FAIL_ONCE=PATH             ... only while PATH does not exist (it creates it): one crash
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
import signal
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from accel_ddp.checkpoint.manager import (
    CheckpointManager,
    CorruptCheckpoint,
    list_checkpoints,
    read_checkpoint,
)
from accel_ddp.checkpoint.train_state import TrainState
from accel_ddp.cli.train import main
from accel_ddp.lifecycle.preemption import PreemptionWatcher
from accel_ddp.outputs.names import MARKER_NAME
from tests.helpers import faults
from tests.helpers.checkpoints import assert_same_weights, steps_of
from tests.helpers.files import wait_for_file
from tests.helpers.multiproc import RankFailed, free_port, run_ranks
from tests.helpers.runs import (
    load_weights,
    log_of,
    main_ranks,
    read_metrics,
    read_summary,
    running,
    wait_for_checkpoint,
    workers_of,
)

# 256 samples / global batch 32 = 8 optimizer steps per epoch; 4 epochs = 32 steps (about 1 s of compute).
ARGS = ["--dataset", "synthetic", "--synthetic_samples", "256", "--synthetic_shape", "1", "8", "8",
        "--model", "mnist_cnn", "--global_batch_size", "32", "--epochs", "4", "--num_workers", "0",
        "--log_every", "4"]
STEPS, STEPS_PER_EPOCH = 32, 8
LIVE = {"FAULT_STEP_DELAY": "0.15"}  # ~5 s of training: time to signal it after its first checkpoint


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """The uninterrupted run, checkpointing every 4 steps and keeping the last 5 (forked ranks): steps 16 to 32; below
    the last, one for each kind of damaged RNG file and an intact one before them."""
    out = tmp_path_factory.mktemp("reference")
    assert main_ranks([*ARGS, "--checkpointing_steps", "4", "--keep_last", "5", "--output_dir", str(out)]) == [0, 0]
    return out


def resume(args: list[str], capfd, world_size: int = 2) -> str:
    """``main(args)`` on forked ranks, which must exit 0 and, their resume being exact, say nothing about RNG states;
    returns what they printed on stdout."""
    capfd.readouterr()
    assert main_ranks(args, world_size) == [0] * world_size
    printed = capfd.readouterr()
    assert "not exact" not in printed.err, printed.err
    return printed.out


# ----------------------------------------------------------------------------- without launches


class _StubAccelerator:
    num_processes = 1

    def register_save_state_pre_hook(self, hook):
        pass

    def register_load_state_pre_hook(self, hook):
        pass


def _fake_checkpoint(root: Path, step: int, complete: bool = True) -> Path:
    folder = root / f"step_{step:08d}"
    folder.mkdir(parents=True)
    (folder / "optimizer.bin").write_bytes(b"x" * 10)
    if complete:
        digest = hashlib.sha256(b"x" * 10).hexdigest()
        (folder / MARKER_NAME).write_text(json.dumps(
            {"step": step, "files": {"optimizer.bin": {"bytes": 10, "sha256": digest}}}))
    return folder


def test_prune_keeps_the_newest_k_and_never_the_one_just_written(tmp_path):
    root = tmp_path / "checkpoints"
    for step in (10, 20, 30, 40):
        _fake_checkpoint(root, step)
    _fake_checkpoint(root, 50, complete=False)  # not a checkpoint: never counted, never loaded
    (root / ".tmp-step_00000060").mkdir()       # debris of a crashed save
    stub = _StubAccelerator()
    nothing = TrainState(accelerator=stub, model=torch.nn.Identity(), optimizer=None, scheduler=None)  # not saved
    manager = CheckpointManager(stub, str(tmp_path), keep_last=2, run_facts={}, state=nothing)
    manager.prune(keep=str(root / "step_00000040"))
    assert [s for s, _ in list_checkpoints(str(root))] == [30, 40]
    assert not (root / ".tmp-step_00000060").exists()
    # A resumed run that saves an older step than some left-overs keeps what it just wrote.
    manager.keep_last = 1
    manager.prune(keep=str(root / "step_00000030"))
    assert [s for s, _ in list_checkpoints(str(root))] == [30, 40]


def test_read_checkpoint_names_the_damaged_file(reference, tmp_path):
    folder = tmp_path / "step_00000028"
    shutil.copytree(reference / "checkpoints" / "step_00000028", folder)
    assert read_checkpoint(str(folder))["step"] == 28
    optimizer = folder / "optimizer.bin"
    size = optimizer.stat().st_size
    optimizer.write_bytes(b"y" * size)  # same size, other bytes
    with pytest.raises(CorruptCheckpoint, match=r"optimizer\.bin is corrupt"):
        read_checkpoint(str(folder))
    optimizer.write_bytes(b"x" * 4)
    with pytest.raises(CorruptCheckpoint, match=r"optimizer\.bin is truncated"):
        read_checkpoint(str(folder))
    (folder / MARKER_NAME).unlink()
    with pytest.raises(CorruptCheckpoint, match="incomplete"):
        read_checkpoint(str(folder))


def test_preemption_watcher_records_the_signal_and_keeps_recording_after_it():
    before = signal.getsignal(signal.SIGUSR1), signal.getsignal(signal.SIGTERM)
    quiet = PreemptionWatcher(_StubAccelerator()).install()
    assert not quiet.stop_requested()
    quiet.uninstall()
    assert (signal.getsignal(signal.SIGUSR1), signal.getsignal(signal.SIGTERM)) == before  # no signal: restored
    watcher = PreemptionWatcher(_StubAccelerator()).install()
    try:
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.01)
        assert watcher.stop_requested() and watcher.signal_name == "SIGUSR1"
        watcher.uninstall()  # preempted: a follow-up SIGTERM from the launcher must not kill a rank still exiting
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.01)
        assert watcher.signal_name == "SIGUSR1"
    finally:
        signal.signal(signal.SIGUSR1, before[0])
        signal.signal(signal.SIGTERM, before[1])


# ----------------------------------------------------------------------------- 2-process runs


def test_keep_last_keeps_exactly_k_complete_checkpoints(reference):
    assert steps_of(reference) == [16, 20, 24, 28, 32]  # every 4 steps, the last 5
    assert sorted(os.listdir(reference / "checkpoints")) == [f"step_{step:08d}" for step in (16, 20, 24, 28, 32)]
    meta = read_checkpoint(str(reference / "checkpoints" / "step_00000028"))  # every file as recorded
    assert (meta["step"], meta["epoch"], meta["step_in_epoch"], meta["world_size"]) == (28, 3, 4, 2)
    assert {"model.safetensors", "optimizer.bin", "scheduler.bin", "random_states_0.pkl",
            "random_states_1.pkl"} <= set(meta["files"])


def test_sigkill_at_a_random_step_then_resume_gives_bitwise_equal_weights(reference, tmp_path, capfd):
    """Both ranks SIGKILLed at once, at a random moment after the first checkpoint, as a node failure kills a job
    (nothing runs after SIGKILL: forked ranks show what a launch would; the launcher's own SIGKILL is launched in
    tests/lifecycle/test_guarantees.py)."""
    seed = int(os.environ.get("ACCEL_DDP_TEST_SEED", random.randrange(1_000_000)))
    delay = random.Random(seed).uniform(0.0, 0.5)  # ~10 steps of 0.05 s: the kill lands anywhere in steps 4 to 14
    print(f"ACCEL_DDP_TEST_SEED={seed}: SIGKILL {delay:.2f} s after the first checkpoint")
    out, pids = tmp_path / "run", tmp_path / "pids"
    args = [*ARGS, "--checkpointing_steps", "4", "--keep_last", "2", "--output_dir", str(out)]
    pids.mkdir()

    def live_rank() -> int:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        (pids / os.environ["RANK"]).write_text(str(os.getpid()))
        faults.install(step_delay=0.05)
        steps = [0]

        def killed_before_the_last_step(*_) -> None:  # however late the kill comes (a loaded machine): still live
            steps[0] += 1
            deadline = time.monotonic() + 60
            while steps[0] == STEPS - 1 and time.monotonic() < deadline:
                time.sleep(0.01)

        register_optimizer_step_post_hook(killed_before_the_last_step)
        return main(args)

    def kill_both_after_the_first_checkpoint() -> None:
        wait_for_file(out / "checkpoints" / "step_00000004" / MARKER_NAME, 120)
        time.sleep(delay)
        for rank in ("0", "1"):
            os.kill(int((pids / rank).read_text()), signal.SIGKILL)

    killer = threading.Thread(target=kill_both_after_the_first_checkpoint, daemon=True)
    killer.start()
    with pytest.raises(RankFailed, match="exited with code -9"):
        run_ranks(live_rank, grace=1)
    killer.join()
    assert not (out / "summary.json").exists(), "the run finished before the kill: nothing was tested"
    killed_after = steps_of(out)
    print(f"complete checkpoints after the kill: {killed_after}")
    assert killed_after and killed_after[-1] >= 4

    printed = resume([*args, "--resume_from_checkpoint", "auto"], capfd)
    assert f"resumed from {out / 'checkpoints' / f'step_{killed_after[-1]:08d}'}" in printed
    assert_same_weights(out, reference)
    assert read_summary(out)["optimizer_steps"] == STEPS
    # The steps logged between the checkpoint and the kill were dropped and logged again: the curve
    # holds each step once, with the uninterrupted run's losses.
    assert logged_losses(out) == pytest.approx(logged_losses(reference), rel=1e-6)


def logged_losses(output_dir: Path) -> dict[int, float]:
    records = read_metrics(output_dir)
    steps = [r["step"] for r in records if "loss" in r]
    assert len(steps) == len(set(steps)), f"a step was logged twice: {steps}"
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def test_crash_while_writing_a_checkpoint_leaves_the_previous_one_for_auto(reference, tmp_path, capfd):
    out = tmp_path / "run"
    args = [*ARGS, "--checkpointing_steps", "6", "--keep_last", "1", "--output_dir", str(out)]

    def crash_in_checkpoint_12():
        faults.install(crash_in_checkpoint=12)
        return main(args)

    with pytest.raises(RankFailed, match="exited with code -9"):  # rank 0 SIGKILLed; rank 1 fails or is killed
        run_ranks(crash_in_checkpoint_12, grace=1)
    root = out / "checkpoints"
    assert sorted(os.listdir(root)) == [".tmp-step_00000012", "step_00000006"]  # keep_last 1 pruned nothing
    assert not (root / ".tmp-step_00000012" / MARKER_NAME).exists()
    read_checkpoint(str(root / "step_00000006"))  # intact

    printed = resume([*args, "--resume_from_checkpoint", "auto"], capfd)
    assert f"resumed from {root / 'step_00000006'}" in printed
    assert_same_weights(out, reference)
    assert sorted(os.listdir(root)) == ["step_00000030"]  # the debris went with the next save


@pytest.mark.slow
def test_elastic_restart_after_a_rank_crash_then_sigusr1_to_one_worker_stops_every_rank_after_the_same_step(
        reference, tmp_path, capfd):
    """One launch for the two things only torchrun shows. Its elastic restart: rank 1 raises after step 10, the
    launcher restarts both ranks, which resume from step 6 under ``auto``. Then SIGUSR1 to one worker of the
    restarted group: only rank 1 hears it, rank 0 learns it from the all-reduce, both stop after the same step and
    exit 75, and with no restart left torchrun reports both exit codes. The forked resume that finishes the run ends
    with the uninterrupted run's weights: the restart's resume and the signal's checkpoint were both exact."""
    out, once = tmp_path / "run", tmp_path / "crashed-once"
    args = [*ARGS, "--checkpointing_steps", "6", "--output_dir", str(out), "--resume_from_checkpoint", "auto"]
    # Without TORCH_DISABLE_SHARE_RDZV_TCP_STORE a restarted group may read the failed attempt's addresses and hang
    # (pytorch#135712); the c10d rendezvous meets at localhost:29400 unless given a port of its own.
    env = {**LIVE, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "PET_RDZV_ENDPOINT": f"127.0.0.1:{free_port()}",
           "FAULT_FAIL_AT_STEP": "10:1", "FAULT_FAIL_ONCE": str(once)}
    with running(args, out, env=env, launch_args=["--max_restarts", "1", "--rdzv_backend", "c10d"]) as proc:
        wait_for_checkpoint(proc, out, 12)  # saved by the restarted group: the first one crashed after step 10
        os.kill(workers_of(proc)[1], signal.SIGUSR1)  # only rank 1 hears it
        assert proc.wait(timeout=120) == 1
    log = log_of(out)
    assert once.exists() and "injected failure on rank 1 at step 10" in log
    assert "no checkpoint in" in log  # the first attempt started fresh under `auto`
    assert f"resumed from {out / 'checkpoints' / 'step_00000006'}" in log
    assert log.count("exitcode  : 75") == 2, log[-3000:]  # torchrun's report of the last attempt: both ranks
    step = int(re.search(r"SIGUSR1 received: stopped after optimizer step (\d+)", log).group(1))
    assert steps_of(out)[-1] == step

    printed = resume(args, capfd)
    assert f"resumed from {out / 'checkpoints' / f'step_{step:08d}'}" in printed
    assert_same_weights(out, reference)


def test_damaged_checkpoints_are_named_and_auto_falls_back(reference, tmp_path, capfd):
    out = tmp_path / "run"
    shutil.copytree(reference / "checkpoints", out / "checkpoints")
    root = out / "checkpoints"
    optimizer = root / "step_00000032" / "optimizer.bin"
    data = bytearray(optimizer.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte, same size
    optimizer.write_bytes(bytes(data))
    weights = root / "step_00000028" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])  # truncated
    args = [*ARGS, "--output_dir", str(out)]

    capfd.readouterr()
    assert main_ranks([*args, "--resume_from_checkpoint", str(root / "step_00000032")], world_size=1) == [2]
    explicit = capfd.readouterr().err
    assert f"{optimizer} is corrupt" in explicit and explicit.count("accel_ddp: error") == 1
    assert main_ranks(args, world_size=1) == [2]  # no --resume_from_checkpoint over an earlier run's checkpoints
    assert "already holds checkpoints" in capfd.readouterr().err

    assert main_ranks([*args, "--resume_from_checkpoint", "auto"]) == [0, 0]
    result = capfd.readouterr()
    assert f"{optimizer} is corrupt" in result.err and f"{weights} is truncated" in result.err
    assert f"resumed from {root / 'step_00000024'}" in result.out
    assert_same_weights(out, reference)


# ----------------------------------------------------------------------------- every rank's RNG state (issue 20)


def _rewrite_rng_file(folder: Path, rank: int, content: bytes) -> Path:
    """Replace a rank's RNG file and record its new size and sha256 in checkpoint.json: a checkpoint that lies."""
    path = folder / f"random_states_{rank}.pkl"
    path.write_bytes(content)
    meta = json.loads((folder / MARKER_NAME).read_text())
    meta["files"][path.name] = {"bytes": len(content), "sha256": hashlib.sha256(content).hexdigest()}
    (folder / MARKER_NAME).write_text(json.dumps(meta))
    return path


def _torch_saved(obj) -> bytes:
    import io

    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _rng_contents(rng_file: Path) -> dict[str, bytes]:
    """Lying contents for a rank's RNG file, each intact by hash once recorded: what torch cannot load, what
    lacks states, and what torch loads (weights_only, NumPy allow-listed) but no generator accepts."""
    import numpy as np

    states = torch.load(rng_file, weights_only=False)  # the test's own file
    return {
        "not loadable": b"not an RNG state",
        "no numpy or torch state": _torch_saved({"step": states["step"], "random_state": states["random_state"]}),
        "a numpy state that does not apply": _torch_saved(
            {**states, "numpy_random_seed": ("MT19937", np.zeros(3, dtype=np.uint32), 0, 0, 0.0)}),
    }


RNG_DAMAGE = [  # what a rank's RNG file holds, what the error says of it, the step whose file it replaces
    ("not loadable", "cannot be loaded (UnpicklingError", 28),
    ("no numpy or torch state", "holds no NumPy, torch CPU RNG state", 24),
    ("a numpy state that does not apply", "holds RNG states that do not apply (IndexError", 20),
]


def test_rank_rng_files_that_would_not_restore_are_damage_and_auto_resumes_exactly_from_the_one_before(
        reference, tmp_path, capfd):
    """Rank 1's random_states_1.pkl replaced, its hash rewritten to match. Accelerate's load_state caught the
    failure to load or apply it and logged it at INFO only (huggingface/accelerate#4283): rank 1 went on with its
    seeded RNG, other dropout masks, and the resumed weights were not the uninterrupted run's. Each kind of lie in
    a checkpoint of its own: each named exactly by an explicit resume (which writes nothing), and all skipped by one
    ``auto``, which resumes from the intact one before them."""
    out = tmp_path / "run"
    shutil.copytree(reference / "checkpoints", out / "checkpoints", ignore=shutil.ignore_patterns("step_00000032"))
    lies = {}
    for kind, problem, step in RNG_DAMAGE:
        folder = out / "checkpoints" / f"step_{step:08d}"
        lies[folder] = _rewrite_rng_file(folder, 1, _rng_contents(folder / "random_states_1.pkl")[kind]), problem
    args = [*ARGS, "--checkpointing_steps", "4", "--keep_last", "3", "--output_dir", str(out)]
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    for folder, (lying, problem) in lies.items():
        capfd.readouterr()
        assert main_ranks([*args, "--resume_from_checkpoint", str(folder)]) == [2, 2]
        (out / ".lock").unlink()  # the run's lock, taken before it resumes: nothing else was written
        err = capfd.readouterr().err
        (line,) = [line for line in err.splitlines() if line.startswith("accel_ddp: error")]
        assert f"--resume_from_checkpoint {folder}: {lying} {problem}" in line and "Traceback" not in err
        assert err.count("accel_ddp: error") == 1
        assert line.endswith("; resume from an older checkpoint, or use auto, which skips damaged ones")
        assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before

    assert main_ranks([*args, "--resume_from_checkpoint", "auto"]) == [0, 0]
    result = capfd.readouterr()
    for lying, problem in lies.values():
        assert f"skipping a damaged checkpoint: {lying} {problem}" in result.err
    assert f"resumed from {out / 'checkpoints' / 'step_00000016'}" in result.out
    assert_same_weights(out, reference)  # dropout on both ranks replayed the original masks


def test_rng_states_that_load_state_does_not_apply_are_one_loud_warning_and_the_run_goes_on(reference, tmp_path,
                                                                                           capfd):
    """A file that checks out but that Accelerate does not apply on some rank (here its NumPy setter fails on rank
    1, as another Accelerate or another device could): every rank compares its generators with its file after
    load_state; the main process says, once, which rank, which file, which generators, and that the resume is not
    exact. Weights, optimizer and schedule are restored: the run goes on."""
    import types

    import accelerate.checkpointing
    import numpy as np

    out = tmp_path / "run"
    shutil.copytree(reference / "checkpoints", out / "checkpoints", ignore=shutil.ignore_patterns("step_00000032"))

    def resume_with_rank_1_failing_to_apply() -> int:
        from accel_ddp.cli.train import main

        if os.environ["RANK"] == "1":
            def set_state(state):
                raise ValueError("state is not a legacy MT19937 state")
            accelerate.checkpointing.np = types.SimpleNamespace(
                random=types.SimpleNamespace(set_state=set_state, get_state=np.random.get_state))
        return main([*ARGS, "--checkpointing_steps", "4", "--keep_last", "3", "--output_dir", str(out),
                     "--resume_from_checkpoint", "auto"])

    capfd.readouterr()
    assert run_ranks(resume_with_rank_1_failing_to_apply) == [0, 0]
    result = capfd.readouterr()
    warnings = [line for line in result.err.splitlines() if "is not exact" in line]
    folder = out / "checkpoints" / "step_00000028"
    # NumPy's state was not set either, but nothing drew from it since set_seed: it equals the saved one. Torch's,
    # set after NumPy's by load_accelerator_state, was skipped: dropout drew from it.
    assert warnings == [f"accel_ddp: warning: the resume from {folder} is not exact: load_state did not restore the "
                        "generators of rank 1's random_states_1.pkl (torch CPU); random layers such as "
                        "dropout and random augmentation on those ranks differ from the original run's from step 28 "
                        "on (weights, optimizer, schedule and data position are restored exactly)"]
    assert read_summary(out)["optimizer_steps"] == STEPS
    got, expected = load_weights(out), load_weights(reference)
    assert any(not torch.equal(got[k], expected[k]) for k in expected)  # what the warning said: not exact


def test_checkpoint_of_another_model_names_the_mismatched_keys(reference, tmp_path, capfd):
    capfd.readouterr()
    checkpoint = reference / "checkpoints" / "step_00000024"
    assert main_ranks([*ARGS, "--model", "mlp", "--output_dir", str(tmp_path / "run"),
                       "--resume_from_checkpoint", str(checkpoint)], world_size=1) == [2]
    error = [line for line in capfd.readouterr().err.splitlines() if line.startswith("accel_ddp: error")]
    assert len(error) == 1 and "holds the weights of a different model" in error[0]
    assert "missing keys 1.bias, 1.weight" in error[0] and "unexpected keys classifier.0.bias" in error[0]


def _not_exact_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if "is not exact" in line]


def test_resume_with_another_world_size_continues_under_the_global_batch(tmp_path, capfd):
    """2 ranks save step 10, 1 rank resumes from it and saves step 20, 2 ranks resume from that: both directions in
    one chain, each resume compared with the uninterrupted 2-rank run. mlp: no dropout, so 1 and 2 ranks compute the
    same steps up to float summation order. Per-device batch 16: 2 ranks take one micro-batch per step, 1 rank two,
    so the resumes skip 2 vs 4 micro-batches an optimizer step."""
    args = [*ARGS, "--model", "mlp", "--hidden_size", "32", "--epochs", "3", "--per_device_batch_size", "16",
            "--checkpointing_steps", "10"]
    original = tmp_path / "original"
    assert main_ranks([*args, "--output_dir", str(original)]) == [0, 0]
    assert steps_of(original) == [10, 20]
    expected = load_weights(original)
    assert not torch.allclose(expected["1.weight"], torch.nn.Linear(64, 32).weight, atol=1e-2)

    saved_in, step = original, 10
    for saved_by, resumed_by in [(2, 1), (1, 2)]:
        resumed = tmp_path / f"resumed-{saved_by}-{resumed_by}"
        folder = saved_in / "checkpoints" / f"step_{step:08d}"
        capfd.readouterr()
        assert main_ranks([*args, "--output_dir", str(resumed), "--resume_from_checkpoint", str(folder)],
                          world_size=resumed_by) == [0] * resumed_by
        err = capfd.readouterr().err
        assert f"was saved by {saved_by} ranks, this run has {resumed_by}" in err
        assert _not_exact_lines(err) == ([] if resumed_by < saved_by else [  # rank 1 has no RNG file of its own
            f"accel_ddp: warning: the resume from {folder} is not exact: it holds no RNG state for rank 1 (it was "
            "saved by 1 ranks): those keep their seeded RNG; random layers such as dropout and random augmentation on "
            f"those ranks differ from the original run's from step {step} on (weights, optimizer, schedule and data "
            "position are restored exactly)"])
        summary = read_summary(resumed)
        assert (summary["world_size"], summary["resumed_from_step"], summary["optimizer_steps"]) == (resumed_by,
                                                                                                      step, 24)
        got = load_weights(resumed)
        for key in expected:
            assert torch.allclose(got[key], expected[key], atol=1e-5), key
        saved_in, step = resumed, 20


def test_init_from_gives_every_rank_the_same_loaded_weights(reference, tmp_path):
    from accel_ddp import TrainConfig, train
    from accel_ddp.models import build_model

    def train_from_file() -> dict:
        torch.manual_seed(100 + int(os.environ["RANK"]))  # a different random model on each rank: only
        model = build_model("mnist_cnn", 10, (1, 8, 8))      # --init_from can make them agree
        cfg = TrainConfig(dataset="synthetic", synthetic_samples=256, synthetic_shape=(1, 8, 8), model="mnist_cnn",
                          global_batch_size=32, max_steps=3, lr=1e-9, num_workers=0, output_dir=str(tmp_path / "run"),
                          init_from=str(reference / "model.safetensors"))
        train(cfg, model=model)
        return {k: v.detach().clone() for k, v in model.state_dict().items()}

    rank0, rank1 = run_ranks(train_from_file)
    start_weights = load_weights(reference)
    for key in start_weights:
        assert torch.equal(rank0[key], rank1[key]), key
        assert torch.allclose(rank0[key], start_weights[key], atol=1e-6), key  # lr 1e-9: still the loaded weights


def test_init_from_bad_files_name_the_file_and_keys(reference, tmp_path, capfd):
    capfd.readouterr()
    assert main_ranks([*ARGS, "--model", "mlp", "--output_dir", str(tmp_path / "a"),
                       "--init_from", str(reference / "model.safetensors")], world_size=1) == [2]
    other = capfd.readouterr().err
    assert f"--init_from {reference / 'model.safetensors'} holds the weights of a different model" in other
    truncated = tmp_path / "truncated.safetensors"
    save_file({"w": torch.zeros(1000)}, str(truncated))
    truncated.write_bytes(truncated.read_bytes()[:500])
    assert main_ranks([*ARGS, "--output_dir", str(tmp_path / "b"), "--init_from", str(truncated)],
                      world_size=1) == [2]
    assert f"--init_from {truncated}: not a readable safetensors file" in capfd.readouterr().err


def test_muon_with_adamw_resumes_bitwise_after_a_rank_fails_and_its_async_checkpoints_hold_the_sync_bytes(
        tmp_path, capfd):
    """--optimizer muon (two optimizers as one): rank 1 fails after step 5, the run resumes with ``auto`` from the
    checkpoint of step 4 and ends with the weights of the run that never failed, bit for bit. The resume runs with
    --async_checkpointing: Muon's and AdamW's state copied to host memory and written in the background make the
    same files, byte for byte, as the uninterrupted run's synchronous saves of steps 6 and 8 (the RNG files but for
    Accelerate's gradient-accumulation counter, which checkpoint/manager.py restarts at a resume; the RNG files of
    both kinds of save are compared byte for byte in test_checkpoint_async.py)."""
    # 8 steps on 6x6 inputs (fc1 64 x 128, not 256 x 128): Muon's Newton-Schulz iterations were most of the time
    muon = [*ARGS, "--synthetic_shape", "1", "6", "6", "--epochs", "1", "--optimizer", "muon",
            "--checkpointing_steps", "2"]
    reference, out = tmp_path / "reference", tmp_path / "run"
    assert main_ranks([*muon, "--output_dir", str(reference)]) == [0, 0]
    assert read_summary(reference)["optimizer"] == "muon"

    def fail_after_step_5():
        faults.install(fail_at=(5, 1))
        return main([*muon, "--output_dir", str(out)])

    assert 0 not in run_ranks(fail_after_step_5)
    assert steps_of(out) == [2, 4]
    printed = resume([*muon, "--output_dir", str(out), "--resume_from_checkpoint", "auto", "--async_checkpointing"],
                     capfd)
    assert "optimizer split:  Muon for 1 hidden matrix (" in printed  # fc1; the convolutions and head: AdamW
    assert read_summary(out)["resumed_from_step"] == 4
    assert_same_weights(out, reference)
    for step in (6, 8):
        mine, theirs = (run / "checkpoints" / f"step_{step:08d}" for run in (out, reference))
        read_checkpoint(str(mine))  # sealed and intact
        names = sorted(name for name in os.listdir(theirs) if name != MARKER_NAME)  # checkpoint.json: the time
        assert "optimizer.bin" in names and sorted(os.listdir(mine)) == sorted([*names, MARKER_NAME])
        for name in names:
            got, expected = (run / name for run in (mine, theirs))
            if name.startswith("random_states_"):  # Accelerate's accumulation counter restarts with a resume
                got, expected = (torch.load(path, weights_only=False) for path in (got, expected))
                del got["step"], expected["step"]
                got, expected = _torch_saved(got), _torch_saved(expected)  # the generators, byte for byte
            else:
                got, expected = got.read_bytes(), expected.read_bytes()
            assert got == expected, f"step {step}: {name} differs from the sync save's"
