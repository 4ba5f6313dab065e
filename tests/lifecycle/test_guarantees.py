"""The guarantee matrix: each guarantee on each training path (DESIGN.md, "Every guarantee holds on every path").

Paths: the device loader, a DataLoader with workers, memory-mapped Arrow files, streaming, and the text
tasks (causal_lm, its packed blocks on the device loader; sequence_classification once, memory-mapped through
a worker). Runs are forked ranks (tests/helpers/multiproc.py); a launch only where only a launch shows the
behaviour.

The errors section's forked ranks (tests/helpers/ranks.py) run the CLI's ``main()`` with their own torchelastic
error files, and the other rank gets torchrun's SIGTERM once one has exited; what each rank prints is visible to
``capfd``.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
import torch

from accel_ddp.checkpoint.manager import list_checkpoints, read_checkpoint
from accel_ddp.data.hf import STATS_SAMPLE, stats_rows
from tests.helpers import data as helpers_data
from tests.helpers.checkpoints import assert_same_weights
from tests.helpers.multiproc import RankFailed, run_ranks
from tests.helpers.ranks import assert_quiet, error_lines, launch_ranks, recorded
from tests.helpers.runs import main_ranks, read_metrics, read_summary

# ============================================================================= preemption and kill -9
#
# Each rank of these runs calls os.setpgrp() first: torchrun starts every worker in a session of its own
# (start_new_session=True), so its DataLoader workers share its process group and a signal to that group
# (torchrun's os.killpg, scancel) reaches them too. Rank 1 sends the signal right after optimizer step
# SIGNAL_AT, from a short-lived process of its own session (as a launcher or scancel would: not from the
# workers' parent, whose SIGTERM they obey), and waits for it to be sent. The ranks compare preemption
# flags after every step here (CHECK_EVERY_SECONDS = 0), so every rank stops after exactly that step.

SIGNAL_AT = 5  # odd: on the streaming path the next batch is the second worker's, so the turns must continue
SAVE_EVERY = "3"


def _images(n: int, seed: int, mode: str = "L"):
    import datasets
    from PIL import Image

    rng = np.random.default_rng(seed)
    shape = (8, 8) if mode == "L" else (8, 8, 3)
    images = [Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8), mode=mode) for _ in range(n)]
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(num_classes=4)})
    return datasets.Dataset.from_dict({"image": images, "label": [i % 4 for i in range(n)]}, features=features)


def _build_mapped(root: Path) -> Path:
    folder = root / "mapped"
    folder.mkdir()
    _images(96, 0, "RGB").to_parquet(str(folder / "train.parquet"))
    _images(20, 1, "RGB").to_parquet(str(folder / "test.parquet"))
    return folder


def _build_stream(root: Path) -> Path:
    """4 files of different sizes: one per reader (2 ranks x 2 workers); a rank's first worker runs out first."""
    folder = root / "stream"
    folder.mkdir()
    for k, size in enumerate([24, 40, 32, 48]):
        _images(size, k).to_parquet(str(folder / f"train-{k:05d}-of-00004.parquet"))
    _images(8, 99).to_parquet(str(folder / "test.parquet"))
    return folder


def _build_corpus(root: Path) -> Path:
    """texts/{train,test}.json, reviews/{train,test}.csv (text, label), tokenizer/, gpt2.json (with dropout)."""
    from tests.helpers.text import build_word_tokenizer, sentences

    corpus = root / "corpus"
    (corpus / "texts").mkdir(parents=True)
    (corpus / "reviews").mkdir()
    splits = {"train": sentences(160, seed=0), "test": sentences(21, seed=1)}
    for split, rows in splits.items():
        (corpus / "texts" / f"{split}.json").write_text("".join(json.dumps({"text": t}) + "\n" for t, _ in rows))
        (corpus / "reviews" / f"{split}.csv").write_text("review,sentiment\n" + "".join(f"{t},{y}\n" for t, y in rows))
    build_word_tokenizer([text for text, _ in splits["train"]], corpus / "tokenizer")
    (corpus / "gpt2.json").write_text(json.dumps({
        "model_type": "gpt2", "n_layer": 1, "n_head": 2, "n_embd": 16, "n_positions": 64, "vocab_size": 8,
        "resid_pdrop": 0.1, "embd_pdrop": 0.1, "attn_pdrop": 0.1}))
    return corpus


SYNTHETIC = ["--dataset", "synthetic", "--synthetic_samples", "256", "--synthetic_shape", "1", "8", "8",
             "--model", "mnist_cnn", "--global_batch_size", "32", "--epochs", "2"]  # 16 steps


def _path_args(path: str, root: Path) -> list[str]:
    """The options of a run on ``path`` (its data built once under ``root``), without --output_dir."""
    if path == "device":
        return [*SYNTHETIC, "--num_workers", "0"]
    if path == "dataloader":  # eval on a DataLoader with a worker too
        return [*SYNTHETIC, "--loader", "dataloader", "--num_workers", "1"]
    if path == "memory_mapped":
        return ["--dataset", "hf", "--data_dir", str(_data(root, "mapped", _build_mapped)), "--model", "mnist_cnn",
                "--device_loader_max_mb", "0", "--num_workers", "1", "--global_batch_size", "16", "--epochs", "2"]
    if path == "streaming":  # no shuffle buffer: exact; 2 workers per rank
        return ["--dataset", "hf", "--data_dir", str(_data(root, "stream", _build_stream)), "--streaming",
                "--shuffle_buffer", "0", "--num_workers", "2", "--model", "mnist_cnn", "--global_batch_size", "8",
                "--max_steps", "20"]  # the first pass ends after 16 steps (rank 0's 64 rows)
    pytest.importorskip("transformers")
    corpus = _data(root, "corpus", _build_corpus)
    text = ["--tokenizer", str(corpus / "tokenizer"), "--model_config", str(corpus / "gpt2.json"),
            "--max_length", "32", "--global_batch_size", "16", "--num_workers", "1", "--max_steps", "12"]
    if path == "causal_lm":
        return ["--task", "causal_lm", "--dataset", "hf", "--data_dir", str(corpus / "texts"), "--packing", *text]
    assert path == "sequence_classification"
    return ["--task", "sequence_classification", "--dataset", "hf", "--data_dir", str(corpus / "reviews"),
            "--text_column", "review", "--label_column", "sentiment", *text]


def _data(root: Path, name: str, build) -> Path:
    return root / name if (root / name).exists() else build(root)


EXPECTED = {"device": ("device", "in_memory"), "dataloader": ("dataloader", "in_memory"),
            "memory_mapped": ("dataloader", "memory_mapped"), "streaming": ("streaming", "streaming"),
            "causal_lm": ("device", "in_memory"), "sequence_classification": ("dataloader", "memory_mapped")}


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    """Data built once; a datasets cache for this module (forked ranks inherit it)."""
    import datasets

    root = tmp_path_factory.mktemp("matrix")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(datasets.config, "HF_DATASETS_CACHE", str(root / "hf_cache"))
        yield {"root": root, "references": {}}


def args_for(matrix, path: str, out: Path, *extra: str) -> list[str]:
    return [*_path_args(path, matrix["root"]), "--checkpointing_steps", SAVE_EVERY, "--log_every", "4",
            "--output_dir", str(out), *extra]


def reference(matrix, path: str, users: bool = False) -> Path:
    """The uninterrupted run of ``path`` (once per module), with the Python API's optimizer and schedule if
    ``users`` (``users_train``). It saves no checkpoint: the runs it is compared with save theirs every 3 steps, so
    their equality also shows that a save leaves training alone."""
    if (path, users) not in matrix["references"]:
        out = matrix["root"] / f"reference-{path}{'-users' if users else ''}"
        args = [*_path_args(path, matrix["root"]), "--log_every", "4", "--output_dir", str(out)]
        if users:
            [summary, _] = run_ranks(lambda: users_train(args), world_size=2)
            assert summary["optimizer"] == "RAdam (train(optimizer=...))" and summary["optimizer_steps"] == 16
        else:
            assert main_ranks(args) == [0, 0]
            summary = read_summary(out)
        assert not (out / "checkpoints").exists()
        assert (summary["loader"], summary["data_source"]) == EXPECTED[path]
        matrix["references"][path, users] = out
    return matrix["references"][path, users]


def send(sig: int, target: str, pids: Path) -> None:
    """From a process of its own session: ``sig`` to this rank ("rank"), its process group ("group": its
    DataLoader workers too) or every rank's group ("job", as scancel does). Returns once it is sent."""
    me = os.getpid()
    ranks = [int(p.read_text()) for p in sorted(pids.glob("rank*"))]
    calls = {"rank": [f"os.kill({me}, {sig})"], "group": [f"os.killpg({me}, {sig})"],
             "job": [f"os.killpg({pid}, {sig})" for pid in ranks]}[target]
    subprocess.run([sys.executable, "-S", "-c", "import os; " + "; ".join(calls)], start_new_session=True,
                   check=True)


def as_torchrun_worker(pids: Path) -> int:
    """In a forked rank: a process group of its own, its pid recorded; flags compared after every step."""
    import accel_ddp.lifecycle.preemption as preemption

    os.setpgrp()
    rank = int(os.environ.get("RANK", "0"))
    (pids / f"rank{rank}").write_text(str(os.getpid()))
    preemption.CHECK_EVERY_SECONDS = 0  # every step: the stop comes after exactly the step of the signal
    return rank


def run_signalled(args: list[str], pids: Path, sig: int, target: str, at: int = SIGNAL_AT,
                  patch=None, setup=None) -> list[int]:
    """``main(args)`` on 2 forked ranks, rank 1 sending ``sig`` to ``target`` after optimizer step ``at`` (or
    where ``patch(rank, fire)`` arranges to call ``fire()``); each rank's exit code. ``setup()``: first, in each rank
    (the Python API's arguments: ``with_users_optimization``)."""
    pids.mkdir(exist_ok=True)

    def rank_main() -> int:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        from accel_ddp.cli.train import main

        rank = as_torchrun_worker(pids)
        if setup is not None:
            setup()

        def fire():
            send(sig, target, pids)

        if patch is not None:
            patch(rank, fire)
        elif rank == 1:
            steps = [0]

            def after_step(*_):
                steps[0] += 1
                if steps[0] == at:
                    fire()

            register_optimizer_step_post_hook(after_step)
        return main(args)

    return run_ranks(rank_main, world_size=2)


def preempted_line(err: str) -> str:
    lines = [line for line in err.splitlines() if "accel_ddp: preempted:" in line]
    assert len(lines) == 1, err[-3000:]
    return lines[0][lines[0].index("accel_ddp: preempted:"):]


def assert_clean(err: str) -> None:
    assert "Traceback" not in err and "killed by signal" not in err, err[-3000:]


def assert_stopped_after(out: Path, step: int, capfd, reason: str = "SIGTERM received") -> str:
    """The run stopped after ``step`` with that step's checkpoint, one line saying so and why, no traceback; what it
    printed on stdout."""
    printed = capfd.readouterr()
    err = printed.err
    assert_clean(err)
    line = preempted_line(err)
    assert re.search(rf"preempted: {reason}: stopped after optimizer step {step} and saved \S+step_{step:08d}; "
                     r"relaunch with --resume_from_checkpoint auto to continue \(exit code 75\)", line), line
    assert [s for s, _ in list_checkpoints(str(out / "checkpoints"))][-1] == step
    read_checkpoint(str(out / "checkpoints" / f"step_{step:08d}"))  # complete, every file as recorded
    assert not (out / "summary.json").exists()
    return printed.out


def assert_resumes_bitwise(matrix, path: str, out: Path, step: int, *extra: str) -> None:
    """Resumed with ``auto`` from ``step``, the run ends with the uninterrupted run's weights, bit for bit."""
    assert main_ranks(args_for(matrix, path, out, "--resume_from_checkpoint", "auto", *extra)) == [0, 0]
    assert read_summary(out)["resumed_from_step"] == step
    assert_same_weights(out, reference(matrix, path))


# Each path once, its cell also showing what another test would otherwise train its own runs for: on the device
# loader, the Python API's optimizer and schedule (``train(optimizer=, lr_scheduler=)``, whose state a resume restores:
# nothing in it depends on the path); on the memory-mapped path, the signal to one rank's process group only
# (torchrun's os.killpg to each rank, its DataLoader worker too): the other rank learns it at the next comparison of
# flags, and stops after the same step. The DataLoader path's cells are one chain with a signal during a save and one
# during an evaluation (test_on_the_dataloader_path_...).
CELLS = [pytest.param("device", "SIGTERM", "job", True, id="device-users_optimizer"),
         pytest.param("memory_mapped", "SIGTERM", "group", False, id="memory_mapped-one_ranks_group"),
         pytest.param("streaming", "SIGTERM", "job", False, id="streaming"),
         pytest.param("causal_lm", "SIGTERM", "job", False, id="causal_lm"),
         pytest.param("sequence_classification", "SIGUSR1", "job", False, id="sequence_classification-SIGUSR1")]


@pytest.mark.parametrize("path,signame,target,users", CELLS)
def test_preempted_then_killed_a_run_resumes_bitwise_on_every_path(matrix, path, signame, target, users, tmp_path,
                                                                   capfd):
    """The two cells of each path, one after the other:

    1. ``sig`` to every process of the job, as scancel sends it (the DataLoader workers too, which ignore it), or to
       rank 1's process group only: every rank saves after step 5 and exits 75;
    2. resumed with ``auto``, then the whole job SIGKILLed after step 7 (a node failure);
    3. resumed with ``auto`` from the checkpoint of step 6: the uninterrupted run's weights, bit for bit; with the
       user's RAdam and StepLR, its learning rates too (the schedule's state restored, not restarted).
    """
    setup = with_users_optimization if users else None
    uninterrupted = reference(matrix, path, users)
    out, pids = tmp_path / "run", tmp_path / "pids"
    capfd.readouterr()
    assert run_signalled(args_for(matrix, path, out), pids, getattr(signal, signame), target, setup=setup) == [75, 75]
    assert_stopped_after(out, SIGNAL_AT, capfd, reason=f"{signame} received")
    resumed = args_for(matrix, path, out, "--resume_from_checkpoint", "auto")
    with pytest.raises(RankFailed, match="exited with code -9"):
        run_signalled(resumed, pids, signal.SIGKILL, "job", at=2, setup=setup)  # this process's second step: step 7
    assert [s for s, _ in list_checkpoints(str(out / "checkpoints"))][-2:] == [SIGNAL_AT, 6]
    assert not (out / "summary.json").exists()
    if not users:
        assert_resumes_bitwise(matrix, path, out, 6)
        return
    summary = run_ranks(lambda: users_train(resumed), world_size=2)[0]
    assert summary["resumed_from_step"] == 6 and summary["lr_scheduler_steps"] == 16
    assert_same_weights(out, uninterrupted)
    lrs = [{r["step"]: r["lr"] for r in read_metrics(run) if "lr" in r} for run in (out, uninterrupted)]
    assert lrs[0] == lrs[1] and lrs[0][16] == 0.02 / 16


def users_radam(groups):
    """The Python API's optimizer in the runs above (a function of the parameter groups)."""
    return torch.optim.RAdam(groups, lr=0.02)


def users_step_lr(optimizer):
    """... and its schedule: the LR halved every 4 optimizer steps (a function of the optimizer)."""
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.5)


def with_users_optimization() -> None:
    """In a rank: the CLI's ``main()`` trains with ``train(cfg, optimizer=users_radam, lr_scheduler=users_step_lr)``
    (cli/train.py imports ``accel_ddp.loop.train`` when it runs), so its exit codes and messages are the CLI's."""
    import functools

    import accel_ddp.loop as loop

    loop.train = functools.partial(loop.train, optimizer=users_radam, lr_scheduler=users_step_lr)


def users_train(args: list[str]) -> dict:
    """``train()`` of the Python API with RAdam and StepLR on these options; its summary."""
    from accel_ddp.cli.args import parse_args
    from accel_ddp.loop import train

    return train(parse_args(args), optimizer=users_radam, lr_scheduler=users_step_lr)


# ----------------------------------------------------------------------------- during a save, an evaluation, start-up


def test_on_the_dataloader_path_a_signal_during_a_save_then_during_an_evaluation_then_kill_9_resume_bitwise(
        matrix, tmp_path, capfd):
    """The DataLoader path's cells, one run after the other (its workers, in training and evaluation, ignore the
    signals):

    1. SIGTERM to the main process alone (not its workers, nor the other rank) while it seals the checkpoint of step
       3: it is completed, the other rank learns of the signal when the flags are compared after the save, and every
       rank stops after step 3 with exit code 75;
    2. resumed with ``auto`` from step 3, evaluating every 4 steps: SIGTERM to every process of the job during the
       first evaluation; it completes and is logged, then every rank saves the step it evaluated and stops, not a
       step later;
    3. resumed, the whole job SIGKILLed after step 7; resumed from the checkpoint of step 6: the uninterrupted run's
       weights, bit for bit (that run evaluates once an epoch: evaluations leave training alone).
    """
    reference(matrix, "dataloader")
    out, pids = tmp_path / "run", tmp_path / "pids"

    def while_sealing(rank: int, fire) -> None:
        from accel_ddp.checkpoint.manager import CheckpointManager

        seal = CheckpointManager.seal

        def signalled(self, tmp, final, step):
            fire()  # every rank has written its files; the other rank waits in the save's last barrier
            seal(self, tmp, final, step)

        CheckpointManager.seal = signalled

    capfd.readouterr()
    codes = run_signalled(args_for(matrix, "dataloader", out), pids, signal.SIGTERM, "rank",
                          patch=while_sealing)  # the main process seals: "rank" is rank 0
    assert codes == [75, 75]
    assert_stopped_after(out, int(SAVE_EVERY), capfd)

    def during_first_evaluation(rank: int, fire) -> None:
        import accel_ddp.after_step as after_step

        evaluate = after_step.evaluate

        def signalled(*args, **kwargs):
            if rank == 1 and not (tmp_path / "fired").exists():
                (tmp_path / "fired").touch()
                fire()
            return evaluate(*args, **kwargs)

        after_step.evaluate = signalled

    resumed = args_for(matrix, "dataloader", out, "--resume_from_checkpoint", "auto")
    codes = run_signalled([*resumed, "--eval_every", "4"], pids, signal.SIGTERM, "job", patch=during_first_evaluation)
    assert codes == [75, 75]
    assert [r["step"] for r in read_metrics(out) if "eval_loss" in r] == [4]
    printed = assert_stopped_after(out, 4, capfd)
    assert re.search(r"start: +resumed from step 3 of checkpoint", printed), printed[-3000:]
    with pytest.raises(RankFailed, match="exited with code -9"):
        run_signalled(resumed, pids, signal.SIGKILL, "job", at=3)  # this process's third step: step 7
    assert [s for s, _ in list_checkpoints(str(out / "checkpoints"))][-2:] == [4, 6]
    assert_resumes_bitwise(matrix, "dataloader", out, 6)


def _start_up_stop(err: str, phase: str, out: Path) -> None:
    """Every rank stopped during start-up: one line names the phase, nothing was written."""
    assert_clean(err)
    assert preempted_line(err) == (f"accel_ddp: preempted: SIGTERM received during start-up ({phase}): no optimizer "
                                   "step taken in this launch, nothing saved; relaunch the same command (exit code 75)")
    assert not out.exists()  # the output folder is claimed only once the input is checked


def test_a_signal_while_the_first_process_tokenizes_interrupts_it_and_every_rank_exits_75(matrix, tmp_path, capfd):
    """SIGTERM to every process while rank 0 tokenizes (here: a build that would take 60 s) and rank 1 waits for it:
    the build gives up at once and both ranks stop together."""
    args = args_for(matrix, "causal_lm", tmp_path / "run")

    def slow_tokenizing(rank: int, fire) -> None:
        import accel_ddp.data.resolve as resolve

        build_text = resolve.build_text

        def slow(*a, **kw):
            # From a process of its own (not this one: it is about to sleep), once the build has begun.
            begun = tmp_path / "begun"
            subprocess.Popen([sys.executable, "-S", "-c", f"import os, time\nwhile not os.path.exists({str(begun)!r}):"
                              f"\n    time.sleep(0.005)\n"
                              f"[os.killpg(int(open(p).read()), 15) for p in {[str(p) for p in pids()]}]"],
                             start_new_session=True)
            begun.touch()
            time.sleep(60)
            (tmp_path / "tokenized").touch()
            return build_text(*a, **kw)

        def pids():
            while len(list((tmp_path / "pids").glob("rank*"))) < 2:
                time.sleep(0.01)
            return sorted((tmp_path / "pids").glob("rank*"))

        resolve.build_text = slow

    capfd.readouterr()
    assert run_signalled(args, tmp_path / "pids", signal.SIGTERM, "job", patch=slow_tokenizing) == [75, 75]
    assert not (tmp_path / "tokenized").exists()
    _start_up_stop(capfd.readouterr().err, "data: tokenizing", tmp_path / "run")


def test_a_rank_signalled_while_it_waits_for_the_first_process_stops_every_rank_there(matrix, tmp_path, capfd):
    """Only rank 1, waiting in local_main_first for rank 0's build, gets SIGTERM: rank 0 learns it at the next
    barrier (a flag comparison) and neither trains."""
    args = args_for(matrix, "causal_lm", tmp_path / "run")

    def signal_the_waiting_rank(rank: int, fire) -> None:
        import accel_ddp.data.resolve as resolve

        build_text = resolve.build_text

        def build(*a, **kw):
            if rank == 1:  # its own build comes second: the signal came while it waited
                return build_text(*a, **kw)
            while len(list((tmp_path / "pids").glob("rank*"))) < 2:
                time.sleep(0.01)
            rank1 = int((tmp_path / "pids" / "rank1").read_text())
            subprocess.run([sys.executable, "-S", "-c", f"import os; os.kill({rank1}, 15)"], check=True,
                           start_new_session=True)
            (tmp_path / "built").touch()
            return build_text(*a, **kw)

        resolve.build_text = build

    capfd.readouterr()
    assert run_signalled(args, tmp_path / "pids", signal.SIGTERM, "rank", patch=signal_the_waiting_rank) == [75, 75]
    assert (tmp_path / "built").exists()  # rank 0 got no signal: its build ran to the end
    _start_up_stop(capfd.readouterr().err, "data: tokenizing", tmp_path / "run")


def test_a_signal_before_the_process_group_forms_stops_every_rank_once_it_has(matrix, tmp_path, capfd):
    args = args_for(matrix, "device", tmp_path / "run")

    def before_the_group(rank: int, fire) -> None:
        import accel_ddp.assemble as assemble

        build_accelerator = assemble.build_accelerator

        def signalled(*a, **kw):
            if rank == 1:
                fire()
            return build_accelerator(*a, **kw)

        assemble.build_accelerator = signalled

    capfd.readouterr()
    assert run_signalled(args, tmp_path / "pids", signal.SIGTERM, "rank", patch=before_the_group) == [75, 75]
    _start_up_stop(capfd.readouterr().err, "process_group", tmp_path / "run")


# ----------------------------------------------------------------------------- DataLoader workers


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE  # dead; its new parent may not reap it
    except psutil.NoSuchProcess:
        return True


def wait_until_gone(pids: list[int], timeout: float = 30) -> list[int]:
    """The pids still alive after ``timeout`` seconds (a deadline for an outcome, not a measured speed)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not all(gone(pid) for pid in pids):
        time.sleep(0.05)
    return [pid for pid in pids if not gone(pid)]


def _workers_hear_only_their_parent() -> tuple[list[bool], int, int | None]:
    from accel_ddp.data import HostLoader
    from tests.helpers.data import IndexDataset

    loader = iter(HostLoader(IndexDataset(64), 4, 4, seed=0, num_workers=2).loader)  # its DataLoader: 16 batches
    next(loader)
    workers = list(loader._workers)
    signals = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT, signal.SIGHUP)  # the job's, Ctrl-C's, a closed terminal's
    job = "; ".join(f"os.kill({w.pid}, {int(sig)})" for w in workers for sig in signals)
    subprocess.run([sys.executable, "-S", "-c", f"import os; {job}"], check=True)  # as torchrun's killpg would
    time.sleep(0.5)
    alive = [w.is_alive() for w in workers]
    served = sum(1 for _ in loader)
    workers[0].terminate()  # the parent's SIGTERM: torch's last resort, and multiprocessing's at exit
    workers[0].join(30)
    return alive, served, workers[0].exitcode


def test_dataloader_workers_ignore_the_jobs_signals_ctrl_c_and_hangup_and_obey_their_parents_sigterm():
    """SIGTERM and SIGUSR1 from anyone but the parent, SIGINT and SIGHUP (red team T7, S8: torch's worker loop ends
    quietly on KeyboardInterrupt and SIGHUP's default kills; either would make the rank's next read fail, or restart
    its workers): the workers serve on; the parent's SIGTERM ends one quietly."""
    [(alive, served, exitcode)] = run_ranks(_workers_hear_only_their_parent, world_size=1)
    assert alive == [True, True] and served == 15
    assert exitcode == 0  # a quiet exit, as torch's own handler gives the parent's SIGTERM


def _start_loaders_under_fire(count: int) -> list[int]:
    from torch.utils.data import DataLoader

    from accel_ddp.data.workers import worker_options
    from tests.helpers.data import IndexDataset

    os.setpgrp()  # the sender's SIGTERMs reach this process and the workers it starts, and nothing else
    signal.signal(signal.SIGTERM, lambda signum, frame: None)  # as the rank's recording handler
    sender = subprocess.Popen([sys.executable, "-S", "-c", f"import os, time\nwhile True:\n    "
                               f"os.killpg({os.getpgrp()}, 15); time.sleep(0.002)"], start_new_session=True)
    try:
        return [sum(1 for _ in DataLoader(IndexDataset(16), batch_size=4, num_workers=2, **worker_options(2)))
                for _ in range(count)]
    finally:
        sender.kill()
        sender.wait()


def test_dataloader_workers_survive_the_jobs_sigterm_while_they_start():
    """SIGTERM to the process group every 2 ms while DataLoaders start their workers (as the first evaluation's do
    when the job is signalled): torch's handler is in place before our worker_init_fn, but the workers start with
    the signal blocked, so none dies in between. A race: without the blocking, the first loader usually fails."""
    [served] = run_ranks(lambda: _start_loaders_under_fire(6), world_size=1)
    assert served == [4] * 6


class _EndlessReads(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int):
        time.sleep(600)  # a read that never ends: torch's watchdog, which looks between reads, never runs
        return torch.zeros(1), 0


def _rank_stuck_in_a_read(pid_file: Path) -> None:
    from accel_ddp.data.host_loader import HostLoader

    batches = iter(HostLoader(_EndlessReads(), 2, 2, seed=0, num_workers=1).loader)  # its DataLoader: workers start
    pid_file.write_text(str(batches._workers[0].pid))
    next(batches)


def test_a_dataloader_worker_busy_in_a_read_dies_with_its_rank(tmp_path):
    """SIGKILL of the rank (as the OOM killer would): its worker, deaf to SIGTERM and stuck in a read, dies too."""
    pid_file = tmp_path / "worker"
    rank = multiprocessing.get_context("fork").Process(target=_rank_stuck_in_a_read, args=(pid_file,))
    rank.start()
    try:
        while not pid_file.exists() or not pid_file.read_text():
            assert rank.is_alive(), "the rank ended before starting its worker"
            time.sleep(0.02)
        worker = int(pid_file.read_text())
        assert not gone(worker)
        os.kill(rank.pid, signal.SIGKILL)
        rank.join()
        assert wait_until_gone([worker]) == [], "the worker outlived its rank"
    finally:
        rank.kill()
        if pid_file.exists() and not gone(worker := int(pid_file.read_text())):
            os.kill(worker, signal.SIGKILL)


def _user_init(worker_id: int) -> None:
    os.environ["TEST_USER_INIT"] = str(worker_id + 1)


class _WorkerProbe(torch.utils.data.Dataset):
    """Sample i: (i, SIGUSR1 ignored, SIGTERM blocked, the user's worker_init_fn ran) as seen in the worker."""

    def __len__(self) -> int:
        return 6

    def __getitem__(self, index: int):
        blocked = signal.SIGTERM in signal.pthread_sigmask(signal.SIG_BLOCK, set())
        return torch.tensor([index, signal.getsignal(signal.SIGUSR1) == signal.SIG_IGN, blocked,
                             int(os.environ.get("TEST_USER_INIT", "0"))]), 0


def _probe_prepared_eval_loader() -> list[list[int]]:
    from accelerate import Accelerator

    from accel_ddp.data.loaders import build_eval_loader

    accelerator = Accelerator(cpu=True)
    loader = accelerator.prepare(build_eval_loader(_WorkerProbe(), 3, num_workers=1, worker_init_fn=_user_init))
    return [row.tolist() for inputs, _ in loader for row in inputs]


def test_a_users_worker_init_fn_runs_after_ours_also_through_accelerate_prepare():
    """Accelerate's prepare re-creates the DataLoader: the workers still ignore the job's signals, then run the
    user's worker_init_fn."""
    [rows] = run_ranks(_probe_prepared_eval_loader, world_size=1)
    assert rows == [[i, 1, 1, 1] for i in range(6)]


# ----------------------------------------------------------------------------- the launcher dies


def _launcher(args: list[str], pids: Path, kill_at: int, piped: bool) -> None:
    """torchrun as its workers see it: their parent, hosting the store they joined through; rank 1 SIGKILLs it
    after optimizer step ``kill_at``. ``piped``: the ranks' stdout and stderr are a pipe it reads (as when the
    launcher's output goes through ``| tee``), which loses its reader with it. Each rank writes its exit code:
    nobody is left to hear it."""
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    env = {"TORCHELASTIC_USE_AGENT_STORE": "True", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port),
           "TORCHELASTIC_RUN_ID": "test", "TORCHELASTIC_RESTART_COUNT": "0"}
    reader = None
    if piped:
        reader, writer = os.pipe()
        out = os.dup(2)
        threading.Thread(target=_copy, args=(reader, out), daemon=True).start()
        for fd in (1, 2):
            os.dup2(writer, fd)
        os.close(writer)

    def orphaned_rank() -> int:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        import accel_ddp.lifecycle.preemption as preemption
        from accel_ddp.cli.train import main

        if reader is not None:
            os.close(reader)  # the launcher is the pipe's only reader
            # print() to the pipe, not to pytest's capture, which replaced sys.stdout and sys.stderr
            sys.stdout, sys.stderr = (open(fd, "w", buffering=1, closefd=False) for fd in (1, 2))
        rank = as_torchrun_worker(pids)
        noticed = _tell_when_the_launcher_watch_noticed(preemption)
        steps = [0]

        def after_step(*_):
            steps[0] += 1
            if steps[0] == kill_at:
                (pids / f"workers{rank}").write_text(" ".join(str(c.pid) for c in psutil.Process().children()))
                if rank == 1:
                    os.kill(os.getppid(), signal.SIGKILL)
                # The step ends once this rank's own watch recorded the launcher's death (not a step's length
                # later): every rank then stops after this step. A watch that never notices: the run goes on.
                noticed.wait(30)

        register_optimizer_step_post_hook(after_step)
        code = main(args)
        (pids / f"exit{rank}").write_text(str(code))
        return code

    run_ranks(orphaned_rank, world_size=2, env=env)


def _tell_when_the_launcher_watch_noticed(preemption) -> threading.Event:
    """In a rank: an event set once the launcher's watch (``PreemptionWatcher._poll_parent``) has recorded the
    launcher's death, and returned; its poll every 20 ms instead of 0.5 s."""
    noticed = threading.Event()
    poll_parent = preemption.PreemptionWatcher._poll_parent

    def poll_then_tell(self, parent: int) -> None:
        poll_parent(self, parent)
        if self.signalled:
            noticed.set()

    preemption.PreemptionWatcher._poll_parent = poll_then_tell
    preemption.LAUNCHER_POLL_SECONDS = 0.02  # read at each poll
    return noticed


def _copy(source: int, target: int) -> None:
    while chunk := os.read(source, 65536):
        os.write(target, chunk)


def _orphaned_run(args: list[str], pids: Path, kill_at: int, piped: bool) -> None:
    """``_launcher`` SIGKILLed after step ``kill_at``: its ranks and their DataLoader workers end, each rank with
    exit code 75."""
    launcher = multiprocessing.get_context("fork").Process(target=_launcher, args=(args, pids, kill_at, piped))
    launcher.start()
    launcher.join()
    assert launcher.exitcode == -signal.SIGKILL
    ranks = [int((pids / f"rank{r}").read_text()) for r in (0, 1)]
    workers = [int(pid) for r in (0, 1) for pid in (pids / f"workers{r}").read_text().split()]
    try:
        assert len(workers) >= 2 and wait_until_gone(ranks + workers, timeout=60) == [], \
            "a rank or its DataLoader worker goes on without its launcher"
    finally:
        for pid in ranks + workers:
            if not gone(pid):
                os.kill(pid, signal.SIGKILL)
    assert [(pids / f"exit{r}").read_text() for r in (0, 1)] == ["75", "75"]


def test_when_the_launcher_dies_every_rank_stops_after_the_same_step_saves_and_exits(matrix, tmp_path, capfd):
    """SIGKILL of the launcher (the OOM killer, kill -9): its ranks, in sessions of their own, notice within a
    poll, stop after the same step, save it, release the folder's lock and exit 75, their DataLoader workers gone
    too; the store the launcher hosted dies with it, and the save's barriers do without it. Resumed under a launcher
    whose output the ranks' goes through (a pipe it reads), killed after the next step: what they print from then on
    goes nowhere, without failing them. The run then resumes exactly. (The launcher is torchrun as its workers see
    it, ``_launcher``: a real `accelerate launch`, killed, does nothing more for them to see.)"""
    import fcntl

    reference(matrix, "dataloader")
    out, pids = tmp_path / "run", tmp_path / "pids"
    pids.mkdir()
    capfd.readouterr()
    _orphaned_run(args_for(matrix, "dataloader", out), pids, 4, piped=False)  # 4: not a step with a save of its own
    err = capfd.readouterr().err
    assert_clean(err)
    assert re.search(r"preempted: the launcher died \(every rank's parent process is gone\): stopped after optimizer "
                     r"step 4 and saved \S+step_00000004; relaunch", preempted_line(err)), err[-3000:]
    assert [s for s, _ in list_checkpoints(str(out / "checkpoints"))][-1] == 4
    read_checkpoint(str(out / "checkpoints" / "step_00000004"))
    with open(out / ".lock", "w") as lock:  # released: this process can take it
        fcntl.lockf(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    resumed = args_for(matrix, "dataloader", out, "--resume_from_checkpoint", "auto")
    _orphaned_run(resumed, pids, 1, piped=True)  # its first step: step 5
    assert_clean(capfd.readouterr().err)
    assert [s for s, _ in list_checkpoints(str(out / "checkpoints"))][-1] == 5
    read_checkpoint(str(out / "checkpoints" / "step_00000005"))
    assert main_ranks(resumed) == [0, 0]
    assert read_summary(out)["resumed_from_step"] == 5
    assert_same_weights(out, reference(matrix, "dataloader"))


def test_outputs_nobody_reads_any_more_go_to_dev_null_instead_of_failing_the_save():
    """After the launcher died with its pipeline (``accelerate launch ... | tee log``): a guarded stream's writes to
    the pipe whose reader is gone go to /dev/null instead of raising BrokenPipeError; a pipe still read is left
    alone."""
    from accel_ddp.lifecycle.stdio import _DeadPipeGuard, silence_dead_pipes

    dead_read, dead = os.pipe()
    os.close(dead_read)
    live_read, live = os.pipe()
    try:
        with pytest.raises(BrokenPipeError):
            os.write(dead, b"a progress bar")
        with open(dead, "w", buffering=1, closefd=False) as stream:
            guarded = _DeadPipeGuard(stream)
            guarded.write("a progress bar\n")
            guarded.flush()
        assert os.write(dead, b"x") == 1  # now /dev/null
        silence_dead_pipes((live,))
        os.write(live, b"still read")
        assert os.read(live_read, 100) == b"still read"
    finally:
        for fd in (dead, live_read, live):
            os.close(fd)


# ----------------------------------------------------------------------------- through accelerate launch


@pytest.mark.slow
def test_ctrl_c_to_the_launcher_stops_ranks_with_dataloader_workers_and_resumes_bitwise(matrix, tmp_path):
    """A real `accelerate launch` in a session of its own, as a terminal runs it; SIGINT to its process group (what
    Ctrl-C sends), where the launcher alone is: torchrun forwards it to each rank's process group (os.killpg), their
    DataLoader workers get it too and ignore it, and every rank saves, says where in one line and exits 130 (the
    launcher 128 + SIGINT), no KeyboardInterrupt anywhere (the launcher's own included); the run resumes from that
    step bitwise. The suite's one launch of a signal with DataLoader workers: torchrun handles SIGTERM with the same
    handler and forwards it the same way (torch/distributed/elastic: multiprocessing/api.py
    ``_terminate_process_handler``, agent/server/api.py ``_shutdown(e.sigval)``); SIGTERM to the launcher:
    tests/cli/test_launch.py; the forked runs above signal every path. (Red team T7's launch and this module's SIGTERM
    launch, in one.)"""
    from tests.helpers.multiproc import free_port
    from tests.helpers.runs import CPU_2PROC, FAULTY_TRAIN, REPO, log_of, suite_env, wait_for_checkpoint

    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CPU_2PROC), "--num_processes",
           "2", "--main_process_port", str(free_port()), str(FAULTY_TRAIN), *args_for(matrix, "dataloader", out)]
    with open(tmp_path / "run.log", "w") as log:  # FAULT_STEP_DELAY: the signal comes before the run's end
        proc = subprocess.Popen(cmd, env=suite_env({"FAULT_STEP_DELAY": "0.2"}), cwd=REPO, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for_checkpoint(proc, out, int(SAVE_EVERY))
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    log = log_of(out)
    for noise in ("Traceback", "KeyboardInterrupt", "killed by signal", "DataLoader worker"):
        assert noise not in log, log[-4000:]
    lines = [line for line in log.splitlines() if "accel_ddp: interrupted: SIGINT received: stopped after" in line]
    assert len(lines) == 1, log[-4000:]
    stopped = re.search(r"accel_ddp: interrupted: SIGINT received: stopped after optimizer step (\d+) and saved "
                        r"(\S+); relaunch .* \(exit code 130\)$", lines[0])
    assert stopped, lines[0]
    step = int(stopped.group(1))
    assert [s for s, _ in list_checkpoints(str(out / "checkpoints"))][-1] == step
    assert stopped.group(2) == str(out / "checkpoints" / f"step_{step:08d}")
    assert proc.returncode == 128 + signal.SIGINT, proc.returncode  # accelerate launch: 128 + its own signal
    assert main_ranks(args_for(matrix, "dataloader", out, "--resume_from_checkpoint", "auto")) == [0, 0]
    assert read_summary(out)["resumed_from_step"] == step
    assert_same_weights(out, reference(matrix, "dataloader"))


PATHS = ["device", "workers", "mapped", "streaming", "text"]


# ============================================================================ errors
#
# (a) A sample that does not decode, met by rank 1 at optimizer step 3 (one rank only): exactly one
#     `accel_ddp: error:` line naming it, every rank exits 2, no traceback anywhere, no hang. On the device loader
#     path every sample is decoded into memory before training: there the bad sample is met by every rank at
#     start-up, which is the earliest it can be known.
# (b) An exception on rank 1 right after step 2: every rank stops promptly (none is let go before every rank
#     reported: a rank that cannot learn of the failure hangs the test), the failing rank's traceback is shown
#     once, the other rank prints nothing, both exit 1, and the other's error file names rank 1.

BATCH = ["--global_batch_size", "8", "--max_steps", "60"]  # far more steps than a test lets a run take


class Paths:
    """Each path's data, built once per module in ``root``: ``args(path, bad)`` and the bad sample's name."""

    def __init__(self, root):
        self.root, self.built = root, {}

    def args(self, path: str, bad: bool) -> tuple[list[str], str]:
        key = (path, bad or path in ("workers", "mapped", "streaming"))  # (b) stops before their bad sample
        if key not in self.built:
            self.built[key] = getattr(self, f"_{path}")(self.root / f"{path}-{int(key[1])}", key[1])
        return self.built[key]

    def _device(self, folder, bad):  # hf, small enough to decode into memory: the device loader
        helpers_data.image_splits(folder, 40, 8, bad_rows=(13,) if bad else ())
        return ["--dataset", "hf", "--data_dir", str(folder), "--loader", "device", *BATCH], \
            "hf: row 13 of the 'train' split does not decode as an image"

    def _workers(self, folder, bad):  # an image folder: decoded per sample by a DataLoader worker
        from torchvision.datasets import ImageFolder

        helpers_data.write_png_classes(folder / "train", ["a", "b"], per_class=20, size=(8, 8))
        helpers_data.write_png_classes(folder / "val", ["a", "b"], per_class=2, size=(8, 8))
        path = ImageFolder(str(folder / "train")).samples[helpers_data.read_at(3, 1, 40, 8, 2)][0]
        with open(path, "wb") as fh:
            fh.write(b"not an image")
        return ["--dataset", "imagefolder", "--data_dir", str(folder), "--num_workers", "1", *BATCH], \
            f"imagefolder: {path} does not decode as an image"

    def _mapped(self, folder, bad):  # hf above the in-memory threshold: memory-mapped, decoded in a worker
        rows = STATS_SAMPLE + 100  # start-up decodes 1024 rows for the normalisation: the bad one is not among them
        decoded_first = set(stats_rows(rows).tolist())
        row = next(row for step in range(3, rows // 8) for row in helpers_data.reads_at(step, 1, rows, 8, 2)
                   if row not in decoded_first)  # rank 1 meets it at step 3 or later
        helpers_data.image_splits(folder, rows, 16, bad_rows=(row,))
        return ["--dataset", "hf", "--data_dir", str(folder), "--device_loader_max_mb", "0", "--num_workers", "1",
                "--checkpointing_steps", "2", *BATCH], f"hf: row {row} of the 'train' split does not decode"

    def _streaming(self, folder, bad):  # parquet files, streamed: rank 1 reads files 1 and 3 (its 9th example)
        helpers_data.image_shards(folder, [STATS_SAMPLE, 8, 8, 8], n_test=8, bad_rows={3: (0,)})
        return ["--dataset", "hf", "--data_dir", str(folder), "--streaming", "--shuffle_buffer", "0",
                "--num_workers", "1", *BATCH], "hf: example 8 read by worker 0 of rank 1 of the 'train' split does not"

    def _text(self, folder, bad):  # token sequences for a GPT-2 (causal_lm), padded per batch, read by a worker
        folder.mkdir()
        dataset = "tests.helpers.data:sequences_one_bad" if bad else "tests.helpers.text:build_sequences"
        return ["--task", "causal_lm", "--dataset", dataset, "--model", "tests.helpers.text:build_gpt",
                "--num_workers", "1", *BATCH], helpers_data.BAD_SAMPLE_MESSAGE


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> Paths:
    return Paths(tmp_path_factory.mktemp("paths"))


@pytest.mark.parametrize("path", PATHS)
def test_a_bad_sample_is_one_line_and_exit_2_on_every_rank(paths, path, tmp_path, capfd):
    args, sample = paths.args(path, bad=True)
    out = tmp_path / "run"
    assert launch_ranks(tmp_path, [*args, "--output_dir", str(out)]) == [2, 2]
    err = capfd.readouterr().err
    lines = error_lines(err)
    assert len(lines) == 1 and sample in lines[0], err
    assert_quiet(err)
    first = 0 if recorded(tmp_path, 0)["message"].startswith("DataError") else 1
    assert recorded(tmp_path, first)["message"] == "DataError: " + lines[0].removeprefix("accel_ddp: error: ")
    assert recorded(tmp_path, 1 - first)["message"].startswith(f"stopped because rank {first} failed: DataError: ")
    if path not in ("device", "streaming"):  # met by rank 1 alone (a stream stops every rank with rank 1's line)
        assert first == 1
    assert not (out / "summary.json").exists() and not (out / "model.safetensors").exists()
    if path == "mapped":  # the checkpoint of step 2, saved before, is intact
        from accel_ddp.checkpoint.manager import list_checkpoints, read_checkpoint

        assert [step for step, _ in list_checkpoints(out / "checkpoints")] == [2]
        read_checkpoint(str(out / "checkpoints" / "step_00000002"))  # every file as saved (sizes and sha256)


@pytest.mark.parametrize("path", PATHS)
def test_a_failing_rank_stops_every_rank_with_its_traceback_once(paths, path, tmp_path, capfd):
    args, _ = paths.args(path, bad=False)
    assert launch_ranks(tmp_path, [*args, "--output_dir", str(tmp_path / "run")], fail_at=(2, 1)) == [1, 1]
    err = capfd.readouterr().err
    injected = "InjectedFailure: injected failure on rank 1 at step 2"
    assert err.count("Traceback (most recent call last)") == 1 and injected in err, err
    assert error_lines(err) == []
    assert "Connection closed by peer" not in err and "frame #" not in err
    assert recorded(tmp_path, 1)["message"] == injected
    assert recorded(tmp_path, 0)["message"] == f"stopped because rank 1 failed: {injected}"


# ============================================================================ a nan/inf input under --on_anomaly
#
# Under --on_anomaly skip (or rollback) a training sample with a nan input is an anomaly like any other: its step is
# left out on every rank, recorded in anomalies.json with the sample named, and the run goes on; under the default
# it stops with the sample named (exit 2: tests/tasks/test_finite_inputs.py). Rank 1 reads it at step 3. Through a
# run on the device loader and the DataLoader path (a worker, or none); memory-mapped sets and streams at their
# loaders (the same collate check, on their own loader each). The worker's case under rollback only: a rollback skips
# the step as skip does (every assertion of skip holds for it), and where the sample is found and named does not
# depend on the mode.

NAN_ARGS = ["--hidden_size", "8", "--global_batch_size", "16", "--max_steps", "6", "--log_every", "2"]
NAN_NAMED = f"training sample {helpers_data.NAN_INPUT_AT} (epoch 0, optimizer step 3, rank 1) holds nan or inf"


@pytest.mark.parametrize("path,mode", [("device", "skip"), ("rank_reads", "skip"),
                                       ("workers", "rollback")])
def test_a_nan_input_under_on_anomaly_is_a_skipped_step_with_its_sample_named(path, mode, tmp_path, capfd):
    from tests.helpers.runs import load_weights

    data = {"device": ["--dataset", "tests.helpers.data:nan_input_in_memory", "--loader", "device"],
            "workers": ["--dataset", "tests.helpers.data:nan_input_per_sample", "--loader", "dataloader",
                        "--num_workers", "1"],
            "rank_reads": ["--dataset", "tests.helpers.data:nan_input_per_sample", "--loader", "dataloader",
                           "--num_workers", "0"]}[path]
    out = tmp_path / "run"
    extra = ["--checkpointing_steps", "2"] if mode == "rollback" else []
    assert main_ranks([*data, *NAN_ARGS, *extra, "--on_anomaly", mode, "--output_dir", str(out)]) == [0, 0]
    printed = capfd.readouterr()
    assert "Traceback" not in printed.err and "accel_ddp: error" not in printed.err, printed.err
    records = json.loads((out / "anomalies.json").read_text())
    assert list(records["skipped"]) == ["3"] and NAN_NAMED in records["inputs"]["3"], records
    logged = [r for r in read_metrics(out) if r.get("anomaly")]  # a rollback's: the replay's record, the first gone
    assert [r["step"] for r in logged] == [3] and logged[0]["action"] == mode, logged
    assert NAN_NAMED in logged[0]["detail"], logged
    assert f"accel_ddp: anomaly: non-finite at optimizer step 3 ({NAN_NAMED}" in printed.out, printed.out
    summary = read_summary(out)
    assert summary["optimizer_steps"] == 6 and summary["anomaly_skipped_steps"] == 1
    assert summary["anomaly_rollbacks"] == (1 if mode == "rollback" else 0)
    weights = load_weights(out)
    assert all(bool(torch.isfinite(w).all()) for w in weights.values())


def _served_with_reports(loader) -> tuple[int, list[str]]:
    reports: list[str] = []
    loader.report_bad_inputs(reports.append)
    served = 0
    for batch in loader:
        served += 1
        assert isinstance(batch, (tuple, list, dict)), type(batch)  # the batch itself, not the flag around it
    return served, reports


def test_a_nan_input_of_a_memory_mapped_set_is_reported_and_served_under_on_anomaly(tmp_path):
    from accel_ddp.data import HostLoader

    loader = HostLoader(helpers_data.mapped_floats_with_inf(tmp_path / "d"), 4, 8, seed=0, num_workers=1)
    step = next(s for s, rows in enumerate(loader.sampler.rank_indices(0).tolist()) if 13 in rows)
    assert _served_with_reports(loader) == (10, [f"training sample 13 (epoch 0, optimizer step {step // 2 + 1}, "
                                                 "rank 0) holds nan or inf values (its 'x')"])


def _streamed_floats(columns, where):
    return [(torch.tensor([float("nan") if i == 27 else float(i)]), 0) for i in columns["idx"]]


def test_a_nan_input_of_a_stream_is_reported_and_served_under_on_anomaly(tmp_path):
    """Rank 1 reads example 27 (files 1 and 3 are its): reported there, every rank trains on through all 10 steps."""
    files = helpers_data.write_shards(tmp_path / "s", [20, 20, 20, 20])

    def run():
        import datasets
        from accelerate import PartialState

        from accel_ddp.data.streaming import StreamingLoader, StreamSource

        state = PartialState(cpu=True)
        stream = datasets.load_dataset("parquet", data_files=files, split="train", streaming=True)
        return _served_with_reports(StreamingLoader(StreamSource(stream, _streamed_floats, 0), 2, 4, max_steps=10,
                                                    seed=0, rank=state.process_index, world_size=2, num_workers=1))

    assert run_ranks(run, grace=5) == [(10, []), (10, ["streaming: example 7 read by worker 0 of rank 1 in pass 0 "
                                                        "holds nan or inf values (its input)"])]
