"""The red team's cases (issue 39), as the suite's own: input a user can give ends in one line and exit 2, never a
traceback (T1-T6; T9, a stopped rank: one line naming it, exit 1); options that make a run silently wrong are
refused up front, or said once where the run still means something (S1-S7); Ctrl-C and a closed terminal stop like
SIGTERM, exit 130 and 129 (T7, S8); a killed DataLoader worker is replaced and the run goes on bitwise (T8, in the
resume after S8's stop); the layout claim exactly as README says it.

Forked ranks (tests/helpers/runs.py ``main_ranks``) unless only a launch shows the behaviour.
"""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from accel_ddp.data import DatasetBundle
from tests.helpers.runs import main_ranks

HERE = "tests.lifecycle.test_red_team"


# ----------------------------------------------------------------------------- user code the cases name


def no_rows(data_dir: str, download: bool) -> DatasetBundle:
    """T1: a builder whose training set is empty."""
    return DatasetBundle(TensorDataset(torch.zeros(0, 4), torch.zeros(0, dtype=torch.long)), None, 2, (4,))


def float_labels(data_dir: str, download: bool) -> DatasetBundle:
    """T2: labels of a float dtype for a classification loss."""
    x = torch.randn(64, 4)
    return DatasetBundle(TensorDataset(x, (x[:, 0] > 0).float()), None, 2, (4,))


def wrong_shape(data_dir: str, download: bool) -> DatasetBundle:
    """T3: the builder declares input_shape (7,) for 4-feature samples."""
    x = torch.randn(64, 4)
    return DatasetBundle(TensorDataset(x, (x[:, 0] > 0).long()), None, 2, (7,))


def one_class(data_dir: str, download: bool) -> DatasetBundle:
    """S1: a dataset that declares a single class."""
    x = torch.randn(64, 4)
    return DatasetBundle(TensorDataset(x, torch.zeros(64, dtype=torch.long)), None, 1, (4,))


def no_classes(data_dir: str, download: bool) -> DatasetBundle:
    """S2: num_classes 0."""
    x = torch.randn(64, 4)
    return DatasetBundle(TensorDataset(x, torch.zeros(64, dtype=torch.long)), None, 0, (4,))


def no_eval(data_dir: str, download: bool) -> DatasetBundle:
    """S4: a training set and no eval set."""
    x = torch.randn(64, 4)
    return DatasetBundle(TensorDataset(x, (x[:, 0] > 0).long()), None, 2, (4,))


class NoParameters(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x[:, :1], -x[:, :1]], dim=1)


def no_parameters(num_classes: int, input_shape: tuple[int, ...]) -> nn.Module:
    """T4: a model with nothing to train."""
    return NoParameters()


def one_error_line(err: str) -> str:
    """The run's one ``accel_ddp: error:`` line (no traceback)."""
    assert "Traceback" not in err, err[-3000:]
    lines = [line for line in err.splitlines() if "accel_ddp: error:" in line]
    assert len(lines) == 1, err[-3000:]
    return lines[0]


def assert_refused(args: list[str], capfd, *words: str, world_size: int = 2) -> str:
    capfd.readouterr()
    assert main_ranks(args, world_size) == [2] * world_size
    line = one_error_line(capfd.readouterr().err)
    for word in words:
        assert re.search(word, line), line
    return line


def user_data(name: str, tmp_path, *extra: str) -> list[str]:
    return ["--dataset", f"{HERE}:{name}", "--model", "mlp", "--hidden_size", "8", "--global_batch_size", "16",
            "--epochs", "1", "--output_dir", str(tmp_path / "run"), *extra]


# ============================================================================= T1-T6: bad input, one line, exit 2


def test_t1_a_dataset_of_zero_rows_is_refused(tmp_path, capfd):
    assert_refused(user_data("no_rows", tmp_path), capfd, r"no_rows", r"no (training )?samples|0 rows")


def test_t2_float_labels_for_classification_are_refused(tmp_path, capfd):
    assert_refused(user_data("float_labels", tmp_path), capfd, r"float", r"label", r"long|integer|int64")


def test_t3_an_input_shape_that_is_not_the_samples_is_refused(tmp_path, capfd):
    assert_refused(user_data("wrong_shape", tmp_path), capfd, r"input_shape \(7,\)", r"\(4,\)")


def test_t4_a_model_with_no_parameters_is_refused(tmp_path, capfd):
    args = user_data("no_rows", tmp_path)
    args[args.index("--dataset") + 1] = "synthetic"
    args[args.index("--model") + 1] = f"{HERE}:no_parameters"
    size = args.index("--hidden_size")
    del args[size:size + 2]  # mlp's size: refused beside another --model
    assert_refused([*args, "--synthetic_shape", "4", "--synthetic_classes", "2", "--synthetic_samples", "64"], capfd,
                   r"no (trainable )?parameters")


def test_t6_fp8_on_a_cpu_is_refused(tmp_path, capfd, tiny_args):
    assert_refused([*tiny_args, "--mixed_precision", "fp8", "--output_dir", str(tmp_path / "run")], capfd,
                   r"--mixed_precision fp8", r"GPU")


def test_t6_a_launch_configs_fp8_on_a_cpu_is_refused(tmp_path, capfd, tiny_args):
    """`accelerate launch --mixed_precision fp8` (or a launch config saying fp8) sets the workers' environment."""
    capfd.readouterr()
    args = [*tiny_args, "--output_dir", str(tmp_path / "run")]
    assert main_ranks(args, 2, env={"ACCELERATE_MIXED_PRECISION": "fp8"}) == [2, 2]
    line = one_error_line(capfd.readouterr().err)
    assert "the launch config's mixed_precision fp8 needs a GPU" in line, line


# ============================================================================= S1-S7: refused up front, or warned


def test_s1_one_synthetic_class_is_refused(tmp_path, capfd, tiny_args):
    assert_refused([*tiny_args, "--synthetic_classes", "1", "--output_dir", str(tmp_path / "run")], capfd,
                   r"--synthetic_classes must be >= 2, got 1")


def test_s1_a_dataset_declaring_one_class_is_refused(tmp_path, capfd):
    assert_refused(user_data("one_class", tmp_path), capfd, r"num_classes 1", r"2 or more")


def test_s2_a_dataset_declaring_no_classes_is_refused(tmp_path, capfd):
    assert_refused(user_data("no_classes", tmp_path), capfd, r"num_classes 0", r"2 or more")


def test_t5_causal_lm_on_texts_that_are_all_empty_is_refused(tmp_path, capfd, monkeypatch):
    import datasets

    from tests.helpers.text import build_word_tokenizer, lm_args, sentences

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))
    corpus = tmp_path / "corpus"
    (corpus / "texts").mkdir(parents=True)
    for split in ("train", "test"):
        (corpus / "texts" / f"{split}.json").write_text('{"text": ""}\n' * 40)
    build_word_tokenizer([text for text, _ in sentences(20, seed=0)], corpus / "tokenizer")
    (corpus / "gpt2.json").write_text('{"model_type": "gpt2", "n_layer": 1, "n_head": 2, "n_embd": 16, '
                                      '"n_positions": 64, "vocab_size": 8}')
    assert_refused(lm_args(corpus, tmp_path / "run", "--max_steps", "2"), capfd, r"empty|no tokens?", r"--packing|text")


# ============================================================================= T9: a rank that stops answering


@pytest.mark.slow
@pytest.mark.parametrize("hidden_size", ["32", "512"])
def test_t9_a_stopped_rank_is_named_with_the_timeout_in_one_line(tmp_path, capfd, tiny_args, monkeypatch, hidden_size):
    """SIGSTOP on rank 1 after step 3 with --ddp_timeout 3: rank 0's collective times out and it says, in one line,
    which rank did not answer and within which timeout (not gloo's raw ``Timed out waiting 3000ms for recv``, nor,
    under a larger model, ``Application timeout caused pair closure``: issue 50 item 4).
    Rank 1 is SIGKILLed once rank 0 has reported, as the launcher would."""
    import multiprocessing
    import os
    import signal
    import time

    from torch.optim.optimizer import register_optimizer_step_post_hook

    import accel_ddp.lifecycle.failure as failure
    from accel_ddp.cli.train import main
    from tests.helpers.multiproc import RankFailed, run_ranks

    monkeypatch.setattr(failure, "ACK_WAIT_S", 1.0)  # the stopped rank never reports: no need to wait 10 s for it
    done = tmp_path / "rank0.code"
    args = [*tiny_args, "--hidden_size", hidden_size, "--ddp_timeout", "3", "--output_dir", str(tmp_path / "run")]

    def killer(rank1: int) -> None:
        while not done.exists():
            time.sleep(0.1)
        os.kill(rank1, signal.SIGKILL)
        os._exit(0)

    def rank_main() -> int:
        if os.environ["RANK"] == "1":
            steps = [0]

            def after_step(*_):
                steps[0] += 1
                if steps[0] == 3:
                    multiprocessing.get_context("fork").Process(target=killer, args=(os.getpid(),)).start()
                    os.kill(os.getpid(), signal.SIGSTOP)

            register_optimizer_step_post_hook(after_step)
        code = main(args)
        done.write_text(str(code))
        return code

    capfd.readouterr()
    with pytest.raises(RankFailed, match="rank 1 failed:\nexited with code -9"):
        run_ranks(rank_main, world_size=2, timeout=90)
    assert done.read_text() == "1"
    line = one_error_line(capfd.readouterr().err)
    assert re.search(r"rank 1 did not answer within --ddp_timeout( 3 s)? \(gloo: (Timed out waiting 3000ms|Application "
                     r"timeout caused pair closure)", line), line


@pytest.mark.parametrize("flags", [["--streaming", "--max_steps", "40", "--checkpointing_steps", "epoch"],
                                   ["--on_anomaly", "rollback"]], ids=["S3", "S7"])
def test_s3_s7_options_that_would_be_silently_wrong_are_refused(flags):
    from accel_ddp.cli.args import parse_args
    from accel_ddp.util.validation import ConfigError

    expected = {"S3": r"--streaming with --checkpointing_steps epoch: a stream has no epochs",
                "S7": r"--on_anomaly rollback reloads the last checkpoint, but no checkpoint is saved; add "
                      r"--checkpointing_steps"}
    with pytest.raises(ConfigError, match=expected["S3" if flags[0] == "--streaming" else "S7"]):
        parse_args(["--dataset", "hf", *flags])


def test_s5_a_flag_given_twice_with_different_values_is_said_once_when_the_run_starts(tmp_path, capfd, tiny_args):
    from accel_ddp.cli.args import parse_args

    assert parse_args(["--lr", "1e-3", "--epochs", "2", "--lr=1e-4", "--dataset", "synthetic", "--synthetic_shape", "1",
                       "8", "8", "--synthetic_shape", "1", "4", "4"]).repeated_flags == [
        "--lr 1e-3 and --lr 1e-4: --lr is given 2 times; the last, --lr 1e-4, is used (give it once to silence this)",
        "--synthetic_shape 1 8 8 and --synthetic_shape 1 4 4: --synthetic_shape is given 2 times; the last, "
        "--synthetic_shape 1 4 4, is used (give it once to silence this)"]
    assert parse_args(["--lr", "1e-3", "--lr", "1e-3", "--debug", "--debug"]).repeated_flags == []  # the same value
    capfd.readouterr()
    args = [*tiny_args, "--max_steps", "2", "--output_dir", str(tmp_path / "run"), "--max_steps", "1"]
    assert main_ranks(args, 2) == [0, 0]
    err = capfd.readouterr().err
    assert err.count("accel_ddp: warning: --max_steps 2 and --max_steps 1: --max_steps is given 2 times; the last, "
                     "--max_steps 1, is used") == 1, err
    args[args.index("--dataset") + 1] = "nope"  # bad input stays one line: the run never started
    assert main_ranks(args, 2) == [2, 2]
    err = capfd.readouterr().err
    assert "given 2 times" not in err
    one_error_line(err)


def test_s5_a_yaml_key_given_twice_is_refused(tmp_path):
    from accel_ddp.cli.args import parse_args
    from accel_ddp.util.validation import ConfigError

    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("lr: 0.001\nepochs: 2\nlr: 0.0001\n")
    with pytest.raises(ConfigError, match=r"recipe.yaml: key 'lr' is given twice \(lines 1 and 3\); which one"):
        parse_args(["--config", str(recipe)])


@pytest.mark.parametrize("flag", [["--load_best_model_at_end", "--checkpointing_steps", "epoch"],
                                  ["--early_stopping_patience", "2"]], ids=["best", "patience"])
def test_s4_the_best_model_or_early_stopping_without_an_eval_set_is_refused(flag, tmp_path, capfd):
    assert_refused(user_data("no_eval", tmp_path, *flag), capfd, rf"{flag[0]}.* rank evaluations, but --dataset "
                   rf"{HERE}:no_eval has no eval set")


def test_s6_a_warmup_longer_than_the_run_is_said_once(tmp_path, capfd, tiny_args):
    capfd.readouterr()
    args = [*tiny_args, "--max_steps", "5", "--warmup_steps", "50", "--output_dir", str(tmp_path / "run")]
    assert main_ranks(args, 2) == [0, 0]
    err = capfd.readouterr().err
    assert err.count("--warmup_steps 50 is longer than this run's 5 optimizer steps: the learning rate never reaches "
                     "--lr 0.003 (at most 0.0003)") == 1, err[-3000:]


# ============================================================================= T7, S8: Ctrl-C and a closed terminal

INTERRUPT_AT = 3


def _interrupted_args(out, *extra: str, steps: int = 8, save_every: int = 4) -> list[str]:
    return ["--dataset", "synthetic", "--synthetic_samples", "256", "--synthetic_shape", "1", "8", "8", "--model",
            "mnist_cnn", "--global_batch_size", "32", "--max_steps", str(steps), "--loader", "dataloader",
            "--num_workers", "1", "--checkpointing_steps", str(save_every), "--output_dir", str(out), *extra]


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    """The run of ``_interrupted_args`` never stopped, trained once for the module (T7, S8 and T8 compare with it;
    none writes into it)."""
    out = tmp_path_factory.mktemp("whole") / "run"
    assert main_ranks(_interrupted_args(out)) == [0, 0]
    return out


def _signalled_ranks(args: list[str], sig: int, pids) -> list[int]:
    """``main(args)`` on 2 forked ranks, each in a process group of its own with its DataLoader worker (as torchrun
    starts them); after optimizer step INTERRUPT_AT rank 1 sends ``sig`` to every rank's group (what torchrun does
    with a Ctrl-C or SIGHUP it got: ``os.killpg`` per worker), from a process of its own session."""
    import os
    import subprocess
    import sys

    from torch.optim.optimizer import register_optimizer_step_post_hook

    import accel_ddp.lifecycle.preemption as preemption
    from accel_ddp.cli.train import main
    from tests.helpers.multiproc import run_ranks

    pids.mkdir(exist_ok=True)

    def rank_main() -> int:
        os.setpgrp()
        rank = int(os.environ["RANK"])
        (pids / f"rank{rank}").write_text(str(os.getpid()))
        preemption.CHECK_EVERY_SECONDS = 0  # compare after every step: the stop comes right after the signal's step
        if rank == 1:
            steps = [0]

            def after_step(*_):
                steps[0] += 1
                if steps[0] == INTERRUPT_AT:
                    groups = [int(p.read_text()) for p in sorted(pids.glob("rank*"))]
                    calls = "; ".join(f"os.killpg({pid}, {int(sig)})" for pid in groups)
                    subprocess.run([sys.executable, "-S", "-c", f"import os; {calls}"], start_new_session=True,
                                   check=True)

            register_optimizer_step_post_hook(after_step)
        return main(args)

    return run_ranks(rank_main, world_size=2)


@pytest.mark.parametrize("signame,code,kill_a_worker", [("SIGINT", 130, False), ("SIGHUP", 129, True)],
                         ids=["SIGINT-130", "SIGHUP-129-t8_a_worker_killed_in_the_resume"])
def test_t7_s8_ctrl_c_and_a_closed_terminal_save_the_step_and_resume_bitwise(signame, code, kill_a_worker, whole,
                                                                            tmp_path, capfd):
    """The resume after SIGHUP also shows T8 (``resume_killing_a_worker``): resumed and bitwise all the same."""
    import signal

    from accel_ddp.checkpoint.manager import list_checkpoints
    from tests.helpers.checkpoints import assert_same_weights
    from tests.helpers.runs import read_summary

    out = tmp_path / "run"
    capfd.readouterr()
    assert _signalled_ranks(_interrupted_args(out), getattr(signal, signame), tmp_path / "pids") == [code, code]
    err = capfd.readouterr().err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err and "killed by signal" not in err, err[-3000:]
    lines = [line for line in err.splitlines() if line.startswith("accel_ddp: interrupted:")]
    assert lines == [f"accel_ddp: interrupted: {signame} received: stopped after optimizer step {INTERRUPT_AT} and "
                     f"saved {out / 'checkpoints' / f'step_{INTERRUPT_AT:08d}'}; relaunch with "
                     f"--resume_from_checkpoint auto to continue (exit code {code})"], err[-3000:]
    assert [step for step, _ in list_checkpoints(str(out / "checkpoints"))] == [INTERRUPT_AT]
    resumed = _interrupted_args(out, "--resume_from_checkpoint", "auto")
    if kill_a_worker:
        resume_killing_a_worker(resumed, tmp_path / "killed", capfd)
    else:
        assert main_ranks(resumed) == [0, 0]
    assert read_summary(out)["resumed_from_step"] == INTERRUPT_AT
    assert_same_weights(out, whole)


# T7 through a real `accelerate launch` (Ctrl-C to the launcher's process group: every rank saves and exits 130, no
# KeyboardInterrupt anywhere) is one launch with the guarantee matrix's signal through the launcher, in
# tests/lifecycle/test_guarantees.py test_ctrl_c_to_the_launcher_stops_ranks_with_dataloader_workers_and_resumes_bitwise


# The DataLoader workers ignore Ctrl-C and hangup (T7, S8) with the job's signals: tests/lifecycle/test_guarantees.py
# test_dataloader_workers_ignore_the_jobs_signals_ctrl_c_and_hangup_and_obey_their_parents_sigterm (one loader).


# ============================================================================= T8: a DataLoader worker killed

KILL_AT = INTERRUPT_AT + 2  # in the resumed run (from INTERRUPT_AT): its second step


def resume_killing_a_worker(args: list[str], killed, capfd) -> None:
    """T8: kill -9 of rank 1's DataLoader worker after step KILL_AT (of a run resumed from INTERRUPT_AT): its workers
    start again at the first micro-batch it had not trained on, one line says so, and the run ends (its caller
    compares its weights with the run without the kill, bit for bit: nothing to resume, nothing was lost)."""
    import os
    import signal

    import psutil
    from torch.optim.optimizer import register_optimizer_step_post_hook

    from accel_ddp.cli.train import main
    from tests.helpers.multiproc import run_ranks

    def rank_main() -> int:
        if os.environ["RANK"] == "1":
            steps = [INTERRUPT_AT]

            def after_step(*_):
                steps[0] += 1
                if steps[0] == KILL_AT:
                    workers = psutil.Process().children()
                    assert len(workers) == 1, workers
                    killed.write_text(str(workers[0].pid))
                    os.kill(workers[0].pid, signal.SIGKILL)

            register_optimizer_step_post_hook(after_step)
        return main(args)

    capfd.readouterr()
    assert run_ranks(rank_main, world_size=2) == [0, 0]
    err = capfd.readouterr().err
    assert "Traceback" not in err, err[-3000:]
    lines = [line[line.index("accel_ddp:"):] for line in err.splitlines() if "DataLoader worker" in line]
    assert lines == [f"accel_ddp: warning: a DataLoader worker of rank 1 ended (pid {killed.read_text()}, killed by "
                     f"SIGKILL); started its workers again at micro-batch {KILL_AT} of epoch 0: the same batches "
                     "follow"], err


# ============================================================================= the layout claim, exactly as said

LAYOUT_ARGS = ["--dataset", "synthetic", "--synthetic_samples", "320", "--global_batch_size", "32", "--max_steps", "12",
               "--optimizer", "adamw", "--lr", "0.01", "--warmup_steps", "3", "--eval_every", "0"]


def _layout_weights(tmp_path, model: list[str], world: int) -> dict:
    from tests.helpers.runs import load_weights, train_ranks

    out = tmp_path / f"{model[1]}-{world}"
    train_ranks([*LAYOUT_ARGS, *model, "--output_dir", str(out)], world_size=world, timeout=300)
    return load_weights(out)


def _largest_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[key] - b[key]).abs().max()) for key in a)


def test_a_model_without_randomness_ends_with_the_same_weights_on_1_2_and_4_ranks(tmp_path):
    """README's claim: 1, 2 and 4 processes (per-device batch 32, 16, 8) end within float rounding (1e-5)."""
    model = ["--model", "mlp", "--hidden_size", "16", "--synthetic_shape", "12"]
    one = _layout_weights(tmp_path, model, 1)
    for world in (2, 4):
        assert _largest_difference(_layout_weights(tmp_path, model, world), one) < 1e-5, world
    assert float(one["1.weight"].abs().max()) > 0.1  # trained: far beyond the tolerance from zero


def test_with_dropout_the_layouts_differ_by_the_dropout_draws_as_documented(tmp_path):
    """docs/debugging.md: dropout's masks come from each rank's own generator, so another layout draws other masks
    and the weights differ by more than rounding (the size measured there)."""
    model = ["--model", "mnist_cnn", "--synthetic_shape", "1", "8", "8"]
    assert _largest_difference(_layout_weights(tmp_path, model, 2), _layout_weights(tmp_path, model, 1)) > 1e-3
