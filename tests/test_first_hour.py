"""Issue 22: a Hugging Face user's first hour: their flag names (CLI and YAML), no prefix matching, a
did-you-mean, the derived meanings (accumulation, warmup ratio, mixed precision), config.yaml replay, --help's
groups, the README's Python example."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import yaml

from accel_ddp.cli.args import parse_args
from accel_ddp.cli.train import main
from accel_ddp.config import HF_ALIASES, TrainConfig, sections
from accel_ddp.distributed.world import override_mixed_precision
from accel_ddp.util.validation import ConfigError
from tests.helpers.multiproc import run_ranks
from tests.helpers.runs import REPO, read_metrics, read_summary, suite_env, train_ranks

# alias, a value, our flag: the plain aliases (one option each, same value)
PLAIN = [
    ("learning_rate", "0.01", "lr", 0.01),
    ("max_train_steps", "7", "max_steps", 7),
    ("per_device_train_batch_size", "16", "per_device_batch_size", 16),
    ("per_device_eval_batch_size", "16", "eval_batch_size", 16),
    ("num_warmup_steps", "3", "warmup_steps", 3),
    ("logging_steps", "5", "log_every", 5),
    ("eval_steps", "5", "eval_every", 5),
    ("save_steps", "20", "checkpointing_steps", "20"),
    ("dataset_config_name", "wikitext-2-raw-v1", "hf_config", "wikitext-2-raw-v1"),
]


@pytest.mark.parametrize("alias, text, ours, value", PLAIN)
def test_plain_alias_sets_our_option_on_the_cli_and_in_yaml(tmp_path, alias, text, ours, value):
    assert HF_ALIASES[alias][0] == ours
    used = ["--dataset", "hf"] if ours == "hf_config" else []  # a dataset's config means something to hf only
    assert getattr(parse_args([*used, f"--{alias}", text]), ours) == value
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"{alias}: {text}\n" + ("dataset: hf\n" if used else ""))
    assert getattr(parse_args(["--config", str(recipe)]), ours) == value


def test_derived_aliases():
    cfg = parse_args(["--num_train_epochs", "2.0", "--lr_scheduler_type", "constant_with_warmup",
                      "--dataset_name", "wikitext", "--task", "causal_lm", "--block_size", "128",
                      "--model_name_or_path", "org/tiny-gpt2"])
    assert (cfg.epochs, cfg.lr_schedule, cfg.dataset, cfg.hf_name) == (2, "constant", "hf", "wikitext")
    assert (cfg.max_length, cfg.packing) == (128, True)
    assert (cfg.model, cfg.tokenizer) == ("org/tiny-gpt2", "org/tiny-gpt2")  # the model's id names its tokenizer
    other = parse_args(["--task", "causal_lm", "--model_name_or_path", "org/a", "--tokenizer_name", "org/b"])
    assert other.tokenizer == "org/b"
    assert parse_args(["--model", "org/m", "--task", "causal_lm"]).tokenizer == "org/m"  # ours too
    assert parse_args(["--model_name_or_path", "mlp"]).tokenizer is None  # not a text task


@pytest.mark.parametrize("argv, message", [
    (["--learning_rate", "1e-4", "--lr", "3e-3"], "--learning_rate 0.0001 and --lr 0.003 both set --lr to different "
                                                    "values; give one of them"),
    (["--dataset", "digits", "--dataset_name", "wikitext"], "--dataset_name 'wikitext' and --dataset 'digits' both "
                                                            "set --dataset"),
    (["--task", "causal_lm", "--block_size", "64", "--packing", "false"], "both set --packing"),
    (["--num_train_epochs", "1.5"], "--num_train_epochs 1.5: only whole epochs here; for part of an epoch give "
                                    "--max_steps"),
    (["--lr_scheduler_type", "polynomial"], "--lr_scheduler_type 'polynomial' has no equivalent here; choose one of "
                                            "linear, cosine, constant_with_warmup, constant"),
    (["--lr_scheduler_type", "constant", "--num_warmup_steps", "5"], "use --lr_scheduler_type constant_with_warmup"),
    (["--warmup_ratio", "0.1", "--warmup_steps", "5"], "--warmup_ratio 0.1 and --warmup_steps 5 both set the warmup"),
    (["--warmup_ratio", "1.5"], "--warmup_ratio must be below 1"),
    (["--mixed_precision", "fp32"], "--mixed_precision 'fp32' is unknown; choose one of no, fp16, bf16, fp8"),
    (["--learning_rte", "0.1"], "unknown flag --learning_rte; did you mean --learning_rate (= --lr)?"),
    (["--learning-rate", "0.1"], "unknown flag --learning-rate; did you mean --learning_rate (= --lr)?"),
    (["--epoch", "1"], "unknown flag --epoch; did you mean --epochs?"),  # no prefix matching
    (["--lr_sched", "cosine"], "unknown flag --lr_sched; did you mean --lr_schedule?"),
])
def test_bad_or_contradicting_names_are_one_error(argv, message):
    with pytest.raises(ConfigError) as err:
        parse_args(argv)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_a_contradiction_is_one_line_and_exit_2(capsys):
    assert main(["--learning_rate", "1e-4", "--lr", "3e-3"]) == 2
    err = capsys.readouterr().err
    assert err.count("accel_ddp: error: --learning_rate 0.0001 and --lr 0.003") == 1
    assert "Traceback" not in err


def test_across_sources_the_command_line_wins(tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("lr: 0.01\nlearning_rate: 0.01\n")  # equal values in one source: fine
    assert parse_args(["--config", str(recipe), "--learning_rate", "1e-4"]).lr == 1e-4
    recipe.write_text("learnig_rate: 0.01\n")
    with pytest.raises(ConfigError, match=r"unknown key\(s\) learnig_rate; did you mean learning_rate \(= lr\)\?"):
        parse_args(["--config", str(recipe)])


@pytest.mark.parametrize("per_device, accumulation, global_batch, world, expected", [
    (8, 4, None, 2, (8, 4, 64)),  # the Hugging Face meaning: W x per-device x N
    (None, 2, 64, 2, (16, 2, 64)),  # per-device derived from the global batch
    (None, 2, None, 1, (32, 2, 64)),  # ... whose default is 64
    (8, 2, 32, 2, (8, 2, 32)),  # all three, consistent
])
def test_gradient_accumulation_steps_derives_the_global_batch(per_device, accumulation, global_batch, world, expected):
    cfg = TrainConfig(per_device_batch_size=per_device, gradient_accumulation_steps=accumulation,
                      global_batch_size=global_batch)
    assert (*cfg.batch_layout(world), cfg.global_batch_size) == expected
    assert cfg.batch_layout(world) == expected[:2]  # resolved once: asking again gives the same layout
    assert TrainConfig(**cfg.to_dict()).batch_layout(world) == expected[:2]  # ... and so does its replay


@pytest.mark.parametrize("kwargs, world, message", [
    ({"per_device_batch_size": 8, "gradient_accumulation_steps": 4, "global_batch_size": 128}, 2,
     "--gradient_accumulation_steps 4 x --per_device_batch_size 8 x 2 process(es) = 64, but --global_batch_size 128"),
    ({"gradient_accumulation_steps": 3}, 2, "--gradient_accumulation_steps 3: --global_batch_size 64 is not divisible"),
])
def test_gradient_accumulation_contradictions(kwargs, world, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        TrainConfig(**kwargs).batch_layout(world)


def test_warmup_ratio_is_of_the_total_steps():
    assert TrainConfig(warmup_ratio=0.06).warmup_for(330) == 20  # ceil(19.8)
    assert TrainConfig(warmup_steps=7).warmup_for(330) == 7


def test_mixed_precision_wins_over_the_launch_config(capsys):
    env = {"ACCELERATE_MIXED_PRECISION": "no"}
    override_mixed_precision("bf16", cpu=True, env=env)
    assert env["ACCELERATE_MIXED_PRECISION"] == "bf16"
    assert capsys.readouterr().err == ("accel_ddp: note: --mixed_precision bf16 overrides the launch config's "
                                       "mixed_precision no\n")
    override_mixed_precision("bf16", cpu=True, env=env)  # the same: no note
    assert capsys.readouterr().err == ""
    with pytest.raises(ConfigError, match="--mixed_precision fp16 on CPU: Accelerate silently trains in fp32"):
        override_mixed_precision("fp16", cpu=True, env={})


def test_hf_names_train_as_ours_and_config_yaml_replays(tmp_path, tiny_args):
    """Forked ranks: accumulation and a warmup ratio with their Hugging Face meaning; the run's config.yaml
    replays on one process with the same global batch, the same steps and the same learning rates."""
    i = tiny_args.index("--global_batch_size")
    base = tiny_args[:i] + tiny_args[i + 2:]
    hf = train_ranks([*base, "--per_device_train_batch_size", "8", "--gradient_accumulation_steps", "2",
                      "--warmup_ratio", "0.5", "--log_every", "1", "--mixed_precision", "bf16",
                      "--output_dir", str(tmp_path / "hf")], world_size=2)[0]
    assert (hf["global_batch_size"], hf["per_device_batch_size"], hf["grad_accum_steps"]) == (32, 8, 2)
    assert hf["mixed_precision"] == "bf16"
    train_ranks([*base, "--global_batch_size", "32", "--warmup_steps", str(-(-hf["optimizer_steps"] // 2)),
                        "--log_every", "1", "--output_dir", str(tmp_path / "ours")], world_size=1)[0]
    lrs = [[r["lr"] for r in read_metrics(tmp_path / name) if "lr" in r] for name in ("hf", "ours")]
    assert lrs[0] == lrs[1] and len(lrs[0]) == hf["optimizer_steps"]
    written = yaml.safe_load((tmp_path / "hf" / "config.yaml").read_text())
    assert written["gradient_accumulation_steps"] is None and written["global_batch_size"] == 32
    replay = train_ranks(["--config", str(tmp_path / "hf" / "config.yaml"), "--output_dir", str(tmp_path / "replay")],
                         world_size=1)[0]
    assert (replay["global_batch_size"], replay["grad_accum_steps"]) == (32, 4)  # 1 process x 8 x 4: same global
    assert replay["optimizer_steps"] == hf["optimizer_steps"]
    assert read_summary(tmp_path / "replay")["mixed_precision"] == "bf16"


def test_help_is_grouped_as_docs_flags_and_says_what_the_launch_config_sets(capsys):
    with pytest.raises(SystemExit) as done:
        parse_args(["--help"])
    assert done.value.code == 0
    shown = capsys.readouterr().out
    words = " ".join(shown.split())
    assert ("The launch config, not these flags, says how many processes and machines, CPU or GPU, and the default "
            "mixed precision: `accelerate launch --config_file accelerate_configs/4gpu.yaml train.py ...`") in words
    titles = [line[:-1] for line in shown.splitlines() if line.endswith(":") and not line.startswith(" ")]
    groups = [section.title for section in sections()]
    assert titles == ["options", *groups, "Hugging Face names"]
    documented = re.findall(r"^### (.+)$", (REPO / "docs" / "flags.md").read_text(), flags=re.M)
    assert documented[:len(groups)] == groups  # the same source: config.sections()
    for section, next_title in zip(sections(), [*groups[1:], "Hugging Face names"], strict=True):
        inside = shown.split(f"\n{section.title}:\n", 1)[1].split(f"\n{next_title}:\n", 1)[0]
        assert all(re.search(rf"^  --{f.name}\b", inside, flags=re.M) for f in section.fields), section.title
    assert len(shown.splitlines()[0]) < 120  # the usage line: not every flag


def _readme_example() -> str:
    readme = (REPO / "README.md").read_text()
    return re.search(r"## Python API\n\n```python\n(.*?)```", readme, flags=re.S).group(1)


def _run_example(code: str, where: str) -> None:
    import accel_ddp

    os.chdir(where)  # it writes outputs/mine
    accel_ddp.exit_process = lambda code: None  # a forked rank returns to run_ranks instead
    exec(compile(code, "README.md", "exec"), {"__name__": "__main__"})  # noqa: S102 - the README's own example


def test_the_readme_python_example_learns_and_prints_once_on_two_ranks(tmp_path, capfd):
    """The example as the README shows it, on 2 forked ranks (its exit_process, which would end the fork, left out)."""
    run_ranks(lambda: _run_example(_readme_example(), str(tmp_path)), world_size=2)
    printed = [line for line in capfd.readouterr().out.splitlines() if line.startswith("eval accuracy")]
    assert len(printed) == 1  # the main process only
    accuracy = float(printed[0].split()[2])
    assert accuracy > 0.9 and printed[0] == "eval accuracy 0.967 (chance 0.333), eval loss 0.233"  # the README's figure
    assert read_summary(tmp_path / "outputs" / "mine")["world_size"] == 2
    # Run again (issue 51): the finished run is said in one line and its figures printed again, nothing retrained
    run_ranks(lambda: _run_example(_readme_example(), str(tmp_path)), world_size=2)
    again = capfd.readouterr()
    assert again.out.splitlines() == ["accel_ddp: outputs/mine already finished at step 140 (see its summary.json); "
                                      "nothing to do", printed[0]], again
    assert "Error" not in again.err, again.err


@pytest.mark.slow
def test_the_readme_python_example_runs_as_a_script(tmp_path):
    """`python my_train.py`, the example verbatim: one process, the same figure (the global batch is the unit)."""
    (tmp_path / "my_train.py").write_text(_readme_example())
    result = subprocess.run([sys.executable, "my_train.py"], cwd=tmp_path, env=suite_env(), capture_output=True,
                            text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "eval accuracy 0.967 (chance 0.333), eval loss 0.233" in result.stdout.splitlines()
