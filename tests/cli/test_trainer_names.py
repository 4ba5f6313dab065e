"""Issue 40: a Trainer or Accelerate-example user's names mean what they mean there (accel_ddp/cli/args.py,
accel_ddp/config/choices.py ``HF_ALIASES``, ``FOREIGN_FLAGS``), and "did you mean" never names an unrelated flag."""

from __future__ import annotations

import pytest

from accel_ddp.cli.args import did_you_mean, parse_args
from accel_ddp.config import FOREIGN_FLAGS
from accel_ddp.util.validation import ConfigError
from tests.helpers.runs import train_ranks


@pytest.mark.parametrize("argv, precision", [
    (["--bf16"], "bf16"), (["--fp16"], "fp16"), (["--bf16", "true"], "bf16"), (["--bf16", "false"], None),
    ([], None),
])
def test_bf16_and_fp16_are_the_trainers_switches(argv, precision):
    assert parse_args(argv).mixed_precision == precision


def test_bf16_and_fp16_in_a_recipe_and_against_another_precision(tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("bf16: true\nsave_total_limit: 2\n")
    cfg = parse_args(["--config", str(recipe)])
    assert (cfg.mixed_precision, cfg.keep_last) == ("bf16", 2)
    with pytest.raises(ConfigError, match="--fp16 True and --bf16 True both set --mixed_precision"):
        parse_args(["--bf16", "--fp16"])
    with pytest.raises(ConfigError, match="both set --mixed_precision to different values"):
        parse_args(["--bf16", "--mixed_precision", "fp16"])


def test_save_total_limit_is_keep_last():
    assert parse_args(["--save_total_limit", "5"]).keep_last == 5


def test_report_to_none_means_no_trackers():
    cfg = parse_args(["--report_to", "none"])
    assert (cfg.with_tracking, cfg.report_to) == (False, None)
    with pytest.raises(ConfigError, match="--report_to none and --with_tracking contradict each other"):
        parse_args(["--report_to", "none", "--with_tracking"])


@pytest.mark.parametrize("flag", sorted(FOREIGN_FLAGS))
def test_a_foreign_name_is_refused_with_its_replacement(flag):
    with pytest.raises(ConfigError) as refused:
        parse_args([f"--{flag}"])
    assert str(refused.value) == f"--{flag} is not a flag here: {FOREIGN_FLAGS[flag]}; see --help"
    assert "did you mean" not in str(refused.value)


def test_overwrite_output_dir_says_what_to_do_instead_and_gradient_checkpointing_is_the_trainers_switch():
    assert "give a new --output_dir or delete the old one first" in FOREIGN_FLAGS["overwrite_output_dir"]
    assert parse_args(["--gradient_checkpointing"]).gradient_checkpointing is True


@pytest.mark.parametrize("typed, suggested", [
    ("learning_rte", "learning_rate"), ("epoch", "epochs"), ("lr_sched", "lr_schedule"), ("warmup", "warmup_steps"),
    ("global_batchsize", "global_batch_size"), ("per_device_batch", "per_device_batch_size"),
    ("gradient_checkpoint", "gradient_checkpointing"),
    ("overwrite_output_dir", None),  # its own line, not a look-alike of ours
    ("checkpoint_everything", None), ("batch_norm", None), ("max_tokens", None),
])
def test_did_you_mean_suggests_only_a_near_spelling(typed, suggested):
    hint = did_you_mean(typed)
    if suggested is None:
        assert "did you mean" not in hint, hint
    else:
        assert hint.startswith(f"; did you mean --{suggested}"), hint


def test_a_per_device_batch_on_two_ranks_trains_the_trainers_global_batch(tmp_path):
    """--per_device_train_batch_size 8 on 2 processes: a global batch of 16, one micro-step (it was 64, four)."""
    args = ["--dataset", "synthetic", "--synthetic_samples", "64", "--synthetic_shape", "4", "--model", "mlp",
            "--hidden_size", "8", "--epochs", "1", "--per_device_train_batch_size", "8", "--output_dir", str(tmp_path)]
    summary = train_ranks(args)[0]
    assert (summary["global_batch_size"], summary["per_device_batch_size"], summary["grad_accum_steps"],
            summary["optimizer_steps"]) == (16, 8, 1, 4)
