"""Evaluate and predict with a trained run (accel_ddp/inference.py, accel_ddp/outputs/trained.py, accel_ddp/cli/
inference.py): the run's own figures again on 1 and 2 ranks, a checkpoint's step's figures, one prediction row per
eval sample in order and the same file at any world size, and one line with exit 2 for what is not a trained run.

The runs are trained once per module on forked ranks (digits/mlp: the device loader and the DataLoader path; a tiny
GPT-2 on token sequences; LoRA adapters on a saved GPT-2), then evaluated and predicted on 1 and 2 forked ranks.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

from accel_ddp.cli.commands import build_parser
from tests.helpers.multiproc import run_ranks
from tests.helpers.runs import SCRIPTS, launch, read_metrics, read_summary, train_ranks
from tests.helpers.text import Sequences, tiny_gpt  # and GPT-2's modelling, loaded here once for the forked ranks

DIGITS = ["--dataset", "digits", "--model", "mlp", "--hidden_size", "64", "--global_batch_size", "64",
          "--max_steps", "12", "--eval_every", "6", "--checkpointing_steps", "6", "--lr", "1e-2",
          "--eval_batch_size", "48"]  # 360 eval samples: 2 ranks x 48 leave a last batch that Accelerate pads


@pytest.fixture(scope="module")
def digits_runs(tmp_path_factory) -> dict[str, Path]:
    """Two finished digits runs on 2 ranks, with checkpoints at steps 6 and 12: the device loader (its eval set
    sliced per rank) and the DataLoader path (a prepared DataLoader, the last batch padded)."""
    root = tmp_path_factory.mktemp("digits")
    runs = {"device": root / "device", "dataloader": root / "dataloader"}
    train_ranks([*DIGITS, "--output_dir", str(runs["device"])], world_size=2)
    train_ranks([*DIGITS, "--loader", "dataloader", "--num_workers", "0", "--output_dir", str(runs["dataloader"])],
                world_size=2)
    return runs


def evaluate_ranks(run: Path | str, world: int, **kwargs) -> list[dict]:
    from accel_ddp import evaluate

    return run_ranks(lambda: evaluate(str(run), **kwargs), world)


def predict_ranks(run: Path, out: Path, world: int) -> list[int]:
    from accel_ddp import predict

    return run_ranks(lambda: predict(str(run), str(out)), world)


def cli_ranks(argv: list[str], world: int) -> list[int]:
    """``accel-ddp evaluate|predict ...``'s ``main`` on forked ranks: their exit codes."""
    from accel_ddp.cli.inference import main

    return run_ranks(lambda: main(build_parser().parse_args(argv)), world)


def assert_same_figures(got: dict, expected: dict) -> None:
    """The same evaluation to float rounding: per-sample float32 values summed in float64, batched differently."""
    for key, value in expected.items():
        if key.startswith("eval_"):
            assert got[key] == (value if isinstance(value, int) else pytest.approx(value, rel=1e-6)), key
    assert {k for k in got if k.startswith("eval_")} == {k for k in expected if k.startswith("eval_")}


@pytest.mark.parametrize("loader", ["device", "dataloader"])
def test_evaluate_gives_the_runs_own_final_figures_on_one_and_two_ranks(digits_runs, loader, tmp_path):
    run = digits_runs[loader]
    summary = read_summary(run)
    assert summary["loader"] == loader and summary["eval_samples"] == 360
    one = evaluate_ranks(run, 1)
    two = evaluate_ranks(run, 2, out=str(tmp_path / "eval.json"))
    assert two[0] == two[1]  # every rank returns the gathered figures
    for result in (one[0], two[0]):
        assert_same_figures(result, summary)
        assert result["optimizer_steps"] == 12
    written = json.loads((tmp_path / "eval.json").read_text())
    assert written == two[0] and written["eval_samples"] == 360


def test_three_ranks_evaluate_a_run_whose_global_batch_they_do_not_divide(digits_runs):
    run = digits_runs["dataloader"]
    assert read_summary(run)["global_batch_size"] == 64
    for result in evaluate_ranks(run, 3):
        assert_same_figures(result, read_summary(run))


@pytest.mark.parametrize("loader", ["device", "dataloader"])
def test_a_checkpoint_evaluates_to_the_figures_of_its_step(digits_runs, loader):
    run = digits_runs[loader]
    [at_six] = [record for record in read_metrics(run) if record.get("step") == 6 and "eval_loss" in record]
    result = evaluate_ranks(run / "checkpoints" / "step_00000006", 2)[0]
    assert_same_figures(result, at_six)
    assert result["optimizer_steps"] == 6
    assert result["eval_loss"] != pytest.approx(read_summary(run)["eval_loss"], rel=1e-6)  # not the final weights


@pytest.mark.parametrize("loader", ["device", "dataloader"])
def test_predict_writes_each_eval_sample_once_in_order_the_same_file_on_one_and_two_ranks(digits_runs, loader,
                                                                                          tmp_path):
    from accel_ddp.data import build_datasets

    run = digits_runs[loader]
    assert predict_ranks(run, tmp_path / "one.jsonl", 1) == [360]
    assert predict_ranks(run, tmp_path / "two.jsonl", 2) == [360, 360]
    one, two = (tmp_path / "one.jsonl").read_bytes(), (tmp_path / "two.jsonl").read_bytes()
    assert one == two
    rows = [json.loads(line) for line in one.decode().splitlines()]
    assert [row["index"] for row in rows] == list(range(360))
    eval_set = build_datasets("digits", "data", False).eval
    assert [row["label"] for row in rows] == [int(eval_set[i][1]) for i in range(len(eval_set))]  # dataset order
    accuracy = sum(row["prediction"] == row["label"] for row in rows) / len(rows)
    assert accuracy == pytest.approx(read_summary(run)["eval_accuracy"], abs=1e-12)


def test_the_cli_refusal_and_a_damaged_checkpoint_are_one_line_and_exit_2_on_every_rank(digits_runs, tmp_path,
                                                                                         capfd):
    copy = tmp_path / "run"
    shutil.copytree(digits_runs["device"], copy)
    weights = copy / "checkpoints" / "step_00000006" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    capfd.readouterr()
    assert cli_ranks(["evaluate", str(weights.parent)], 2) == [2, 2]
    err = capfd.readouterr().err
    lines = [line for line in err.splitlines() if "error:" in line]
    assert len(lines) == 1 and "is corrupt (its sha256 differs" in lines[0], err[-2000:]
    assert "Traceback" not in err


def _no_summary(run: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "running"
    shutil.copytree(run, copy)
    (copy / "summary.json").unlink()
    return copy


def _bad_config(run: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "bad"
    shutil.copytree(run, copy, ignore=shutil.ignore_patterns("checkpoints"))
    (copy / "config.yaml").write_text("dataset: [digits\n")
    return copy


def _incomplete_checkpoint(run: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "cut"
    shutil.copytree(run, copy)
    (copy / "checkpoints" / "step_00000006" / "checkpoint.json").unlink()
    return copy / "checkpoints" / "step_00000006"


REFUSALS = {
    "missing": (lambda run, tmp: tmp / "nowhere", "nowhere: no such folder; give a finished run's --output_dir"),
    "empty folder": (lambda run, tmp: tmp, "holds no finished run or checkpoint (no config.yaml)"),
    "not finished": (_no_summary, "holds no finished run (no summary.json: still training, or stopped before its "
                                  "end); give one of its checkpoints, e.g."),
    "unreadable config": (_bad_config, "config.yaml is unreadable (ParserError"),
    "incomplete checkpoint": (_incomplete_checkpoint, "is an incomplete checkpoint (no checkpoint.json"),
}


@pytest.mark.parametrize(("command", "case"), [*(("evaluate", case) for case in sorted(REFUSALS)),
                                               ("predict", "missing"), ("predict", "not finished")])
def test_what_is_not_a_trained_run_is_one_line_and_exit_2(digits_runs, tmp_path, capfd, monkeypatch, command, case):
    # Refused before the group forms: rank 1 finds rank 0's store with a probe that waits PROBE_S (0.2 s) for the
    # reset of a dying server. Rank 0 serves it until every rank has reported: the probe's answer is the same at
    # 0.01 s, 0.2 s less idle (forked ranks inherit the patch).
    monkeypatch.setattr("accel_ddp.lifecycle.peers.PROBE_S", 0.01)
    make, expected = REFUSALS[case]
    path = make(digits_runs["device"], tmp_path)
    capfd.readouterr()
    assert cli_ranks([command, str(path), "--out", str(tmp_path / "out.json")], 2) == [2, 2]
    err = capfd.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("accel_ddp: error: ") and expected in lines[0], err[-2000:]
    assert not (tmp_path / "out.json").exists()


def test_data_dir_replaces_the_runs_and_nothing_else(digits_runs):
    from accel_ddp.outputs.trained import find_trained

    run = digits_runs["device"]
    trained = find_trained(str(run / "checkpoints" / "step_00000012"), data_dir="/data/moved")
    assert trained.options["data_dir"] == "/data/moved" and trained.options["max_steps"] == 12 and trained.step == 12
    assert trained.output_dir == str(run) and trained.weights.endswith("step_00000012/model.safetensors")


def test_accel_ddp_evaluate_prints_and_writes_the_runs_figures(digits_runs, tmp_path, capfd):
    """`accel-ddp evaluate RUN --out FILE` (the command's parser and ``main``, before its exit) in one forked process
    with no launch environment, as `python -m accel_ddp evaluate` runs it (the module entry and the exit through
    ``exit_process`` are started for real by test_doctor.py's `accelerate launch -m accel_ddp train` and
    `python -m accel_ddp doctor`)."""
    from accel_ddp.cli.inference import main

    def evaluate_command() -> int:
        code = main(build_parser().parse_args(["evaluate", str(digits_runs["dataloader"]), "--out",
                                               str(tmp_path / "eval.json")]))
        sys.stdout.flush()  # the forked process ends with os._exit
        return code

    run = digits_runs["dataloader"]
    capfd.readouterr()
    assert run_ranks(evaluate_command, 1) == [0]
    printed = json.loads(capfd.readouterr().out)
    assert printed == json.loads((tmp_path / "eval.json").read_text())
    assert_same_figures(printed, read_summary(run))


def test_train_then_evaluate_in_one_process_forms_the_group_again_on_two_ranks(tmp_path):
    """Accelerate keeps its state of the group that train() ended: evaluate() after it forgets that, and joins anew."""
    from accel_ddp import TrainConfig, evaluate, train

    def fn():
        summary = train(TrainConfig(dataset="digits", max_steps=4, hidden_size=32, output_dir=str(tmp_path / "run")))
        return summary["eval_loss"], evaluate(str(tmp_path / "run"))["eval_loss"]

    for trained, evaluated in run_ranks(fn, 2):
        assert evaluated == pytest.approx(trained, rel=1e-6)


def _mine() -> tuple[torch.nn.Module, torch.utils.data.TensorDataset, torch.utils.data.TensorDataset]:
    """README's Python example, smaller: a model and datasets of the caller's own."""
    torch.manual_seed(0)
    x = torch.randn(600, 20)
    y = (x @ torch.randn(20, 3)).argmax(dim=1)
    model = torch.nn.Sequential(torch.nn.Linear(20, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    return model, torch.utils.data.TensorDataset(x[:500], y[:500]), torch.utils.data.TensorDataset(x[500:], y[500:])


def test_a_run_of_the_callers_own_model_and_data_evaluates_with_them_passed_again(tmp_path):
    from accel_ddp import ConfigError, TrainConfig, evaluate, predict, train

    out = str(tmp_path / "mine")

    def fn():
        model, train_set, eval_set = _mine()
        return train(TrainConfig(global_batch_size=50, epochs=2, output_dir=out), model=model,
                     train_dataset=train_set, eval_dataset=eval_set)

    summary = run_ranks(fn, 2)[0]

    def again():
        model, _, eval_set = _mine()  # fresh weights: the run's replace them
        with pytest.raises(ConfigError, match="holds the weights of a different model.*pass it again"):
            evaluate(out)  # config.yaml names the default --model and --dataset, which this run never used
        return evaluate(out, model=model, eval_dataset=eval_set), predict(out, str(tmp_path / "p.jsonl"),
                                                                          model=model, eval_dataset=eval_set)

    for metrics, rows in run_ranks(again, 2):
        assert_same_figures(metrics, summary)
        assert rows == 100


@pytest.mark.slow  # a real launch: torchrun's store outlives each group, with the ended group's gloo addresses in it
def test_a_script_that_trains_then_evaluates_and_predicts_runs_under_accelerate_launch(tmp_path):
    result = launch([str(tmp_path / "run")], script=SCRIPTS / "train_then_evaluate.py")
    assert result.returncode == 0, result.stderr[-3000:]
    figures = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert len(figures) == 2 and figures[0] == figures[1] and figures[0]["rows"] == 360
    assert figures[0]["first"] == figures[0]["again"] == pytest.approx(figures[0]["summary"], rel=1e-6)


# ----------------------------------------------------------------------------- text: causal_lm, LoRA

LM = ["--task", "causal_lm", "--dataset", "tests.helpers.text:build_sequences", "--model",
      "tests.helpers.text:build_gpt", "--global_batch_size", "8", "--max_steps", "6", "--lr", "1e-2",
      "--num_workers", "0", "--eval_batch_size", "3"]  # 16 eval sequences of 3-16 tokens; 2 x 3 leave a padded batch


def test_a_causal_lm_run_evaluates_and_predicts_its_next_tokens_alike_on_one_and_two_ranks(tmp_path):
    pytest.importorskip("transformers")
    run = tmp_path / "lm"
    [summary] = train_ranks([*LM, "--output_dir", str(run)], world_size=1)
    for result in (evaluate_ranks(run, 1)[0], evaluate_ranks(run, 2)[0]):
        assert_same_figures(result, summary)
        assert result["eval_tokens"] == summary["eval_tokens"] and result["eval_samples"] == 16
    assert predict_ranks(run, tmp_path / "one.jsonl", 1) == [16]
    assert predict_ranks(run, tmp_path / "two.jsonl", 2) == [16, 16]
    text = (tmp_path / "one.jsonl").read_text()
    assert text == (tmp_path / "two.jsonl").read_text()
    rows = [json.loads(line) for line in text.splitlines()]
    eval_set = Sequences(16, seed=1)  # build_sequences' eval set: each row's labels are its next tokens
    assert [row["label"] for row in rows] == [eval_set[i]["input_ids"][1:].tolist() for i in range(16)]
    tokens = sum(len(row["label"]) for row in rows)
    hits = sum(p == t for row in rows for p, t in zip(row["prediction"], row["label"], strict=True))
    assert tokens == summary["eval_tokens"] and hits / tokens == pytest.approx(summary["eval_accuracy"], abs=1e-12)


def test_a_lora_run_evaluates_with_its_final_weights_and_its_adapter_checkpoint(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    base = tmp_path / "gpt2"
    torch.manual_seed(0)
    tiny_gpt().save_pretrained(str(base))
    run = tmp_path / "lora"
    args = ["--task", "causal_lm", "--dataset", "tests.helpers.text:build_sequences", "--model", str(base),
            "--peft", "lora", "--lora_r", "4", "--lora_target_modules", "c_attn", "--global_batch_size", "8",
            "--max_steps", "8", "--lr", "1e-2", "--num_workers", "0", "--eval_every", "4", "--checkpointing_steps",
            "4", "--output_dir", str(run)]
    [summary] = train_ranks(args, world_size=1)
    assert "base_fingerprint" in summary  # the checkpoints hold the adapter only
    assert_same_figures(evaluate_ranks(run, 2)[0], summary)
    [at_four] = [record for record in read_metrics(run) if record.get("step") == 4 and "eval_loss" in record]
    assert_same_figures(evaluate_ranks(run / "checkpoints" / "step_00000004", 1)[0], at_four)
