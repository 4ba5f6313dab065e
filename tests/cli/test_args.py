"""accel_ddp/cli/args.py: train.py's command line and the --config YAML recipe: precedence, the refusals (one line
each), YAML's types, the boolean spellings, old spellings, --help naming every option (fast, in-process)."""

from __future__ import annotations

import dataclasses
import re

import pytest

from accel_ddp.cli.args import parse_args
from accel_ddp.config import TrainConfig
from accel_ddp.util.validation import ConfigError


def test_yaml_recipe_then_cli_overrides(tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("lr: 0.05\nepochs: 7\noptimizer: sgd\ndataset: synthetic\nsynthetic_shape: [3, 4, 4]\n")
    cfg = parse_args(["--config", str(recipe), "--epochs", "2", "--compile"])
    assert cfg.lr == 0.05 and cfg.optimizer == "sgd"  # from the recipe
    assert cfg.epochs == 2  # the flag wins over the recipe
    assert cfg.compile is True and cfg.synthetic_shape == (3, 4, 4)
    assert parse_args([]).epochs == TrainConfig().epochs  # defaults untouched


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--lr", "-0.1"], "--lr must be > 0"),
        (["--global_batch_size", "0"], "--global_batch_size must be > 0"),
        (["--seed", "-1"], "--seed must be >= 0, got -1; give a value from 0 to 4294967295"),
        (["--seed", str(2**70)], "--seed must be <= 4294967295"),
        (["--ddp_timeout", str(10**20)], "--ddp_timeout must be <= 604800"),
        (["--ddp_timeout", "1e20"], "argument --ddp_timeout: invalid int value: '1e20'"),
        (["--lr", "inf"], "--lr must be a finite number, got inf"),
        (["--weight_decay", "nan"], "--weight_decay must be a finite number, got nan"),
        (["--max_grad_norm", "nan"], "--max_grad_norm must be a finite number, got nan"),
        (["--hidden_size", "100000000"], "--hidden_size 100000000 is too large: ~1e+16 parameters"),
        (["--model", "resnet18", "--width", "4096"], "--width 4096 is too large"),
        (["--dataset", "synthetic", "--synthetic_samples", str(10**9)],
         "--synthetic_samples 1000000000 with --synthetic_shape 1 28 28 needs"),
        (["--dataset", "synthetic", "--synthetic_classes", "1000000", "--synthetic_shape", "3", "64", "64",
          "--synthetic_samples", "64"],
         "--synthetic_classes 1000000 with --synthetic_shape 3 64 64 needs"),
        (["--num_workers", "100000"], "--num_workers must be <= 256"),
        (["--max_steps", "0"], "--max_steps must be > 0"),
        (["--output_dir", ""], "--output_dir is empty; give a folder"),
        (["--output_dir", "/tmp/caf\udce9"], "is not valid UTF-8"),  # what Python makes of a Latin-1 path
        (["--data_dir", "a\0b"], "--data_dir 'a\\x00b' contains a NUL character"),
        (["--profile", "maybe"], "argument --profile: expected true or false, got 'maybe'"),
        (["--optimizer_kwargs", "[0.9]"], "--optimizer_kwargs must be a JSON object of keyword arguments"),
        (["--optimizer", "my_module:"], "--optimizer 'my_module:': give a torch.optim class name (e.g. adamw) or"),
        (["--lr_schedule", "step"], "choose one of constant, linear, cosine"),
        (["--checkpointing_steps", "often"], "positive step count or 'epoch'"),
        (["--checkpointing_steps", "\u00b2"], "positive step count or 'epoch', got '\u00b2'"),  # isdigit, not int
        (["--checkpointing_steps", "9" * 5000], "positive step count or 'epoch', got '9999"),
        (["--epochs", "three"], "invalid int value"),
        (["--no_such_flag"], "unknown flag --no_such_flag; see --help"),
    ],
)
def test_bad_values_raise_one_clear_config_error(argv, message):
    with pytest.raises(ConfigError, match=re.escape(message)) as err:
        parse_args(argv)
    assert "\n" not in str(err.value)


def test_yaml_errors_name_the_file(tmp_path):
    bad_syntax = tmp_path / "bad.yaml"
    bad_syntax.write_text("lr: [0.1\nepochs: 2\n")
    with pytest.raises(ConfigError, match=r"bad.yaml: not valid YAML at line \d+"):
        parse_args(["--config", str(bad_syntax)])
    unknown = tmp_path / "unknown.yaml"
    unknown.write_text("lr: 0.1\nlearnin_rate: 0.2\n")
    with pytest.raises(ConfigError, match="unknown key\\(s\\) learnin_rate"):
        parse_args(["--config", str(unknown)])
    with pytest.raises(ConfigError, match="no such file"):
        parse_args(["--config", str(tmp_path / "missing.yaml")])
    with pytest.raises(ConfigError, match=rf"^--config {tmp_path} is a folder; give the path of a YAML recipe file"):
        parse_args(["--config", str(tmp_path)])


@pytest.mark.parametrize(
    "recipe, message",
    [
        ('profile: "no"\n', "--profile expects true or false, got 'no' (str)"),
        ('channels_last: "false"\n', "--channels_last expects true or false, got 'false' (str)"),
        ("synthetic_shape: abc\n", "--synthetic_shape expects a list of whole numbers, got 'abc'"),
        ("epochs: .nan\n", "--epochs expects a whole number, got nan (float)"),
        ("hidden_size: true\n", "--hidden_size expects a whole number, got True (bool)"),
        ("1: 2\n", "unknown key(s) 1;"),
        ("seed: -5\n", "--seed must be >= 0, got -5"),
        ("max_steps: 5.7\n", "--max_steps expects a whole number, got 5.7 (float); give a whole number"),
        ('lr: "fast"\n', "--lr expects a finite number, got 'fast' (str)"),
        ("lr: .inf\n", "--lr must be a finite number, got inf"),
        ("output_dir: 123\n", "--output_dir expects text, got 123 (int); give text; in YAML quote it"),
        ("epochs: null\n", "--epochs needs a value (a whole number), got null"),
        ("ddp_timeout: 1e20\n", "--ddp_timeout expects a whole number, got 1e+20 (float)"),
        ("- lr\n- 0.1\n", "expected a mapping of option: value, got list; write one `flag: value` per line"),
        ("just text\n", "expected a mapping of option: value, got str"),
        ("checkpointing_steps: true\n", "--checkpointing_steps expects text, got True (bool)"),
    ],
)
def test_yaml_values_are_checked_by_type_and_range(tmp_path, recipe, message):
    path = tmp_path / "recipe.yaml"
    path.write_text(recipe)
    with pytest.raises(ConfigError) as err:
        parse_args(["--config", str(path)])
    assert message in str(err.value) and "\n" not in str(err.value)


def test_a_yaml_integer_too_long_to_convert_is_one_line(tmp_path):
    path = tmp_path / "recipe.yaml"
    path.write_text("seed: " + "1" * 5000 + "\n")  # Python >= 3.10.7 refuses to convert it (ValueError)
    with pytest.raises(ConfigError) as err:
        parse_args(["--config", str(path)])
    assert "\n" not in str(err.value)
    assert "a value cannot be read ('Exceeds the limit" in str(err.value) or "--seed must be <=" in str(err.value)


def test_yaml_numbers_and_booleans_that_are_meant_are_taken(tmp_path):
    path = tmp_path / "recipe.yaml"
    # PyYAML alone reads 1e-3 as text; `yes` is a YAML 1.1 boolean; checkpointing_steps may be a number.
    path.write_text("lr: 1e-3\nweight_decay: 5E-2\nprofile: yes\ndebug: false\ncheckpointing_steps: 100\n"
                    "dataset: synthetic\nsynthetic_shape: 784\nnum_workers: null\nmax_grad_norm: 2\n")
    cfg = parse_args(["--config", str(path)])
    assert (cfg.lr, cfg.weight_decay, cfg.profile, cfg.debug) == (1e-3, 5e-2, True, False)
    assert (cfg.checkpointing_steps, cfg.synthetic_shape, cfg.num_workers) == ("100", (784,), None)
    assert cfg.max_grad_norm == 2.0 and isinstance(cfg.max_grad_norm, float)


@pytest.mark.parametrize("spelling, value", [("true", True), ("YES", True), ("on", True), ("1", True),
                                             ("false", False), ("no", False), ("Off", False), ("0", False)])
def test_cli_booleans_take_the_documented_spellings(spelling, value):
    assert parse_args(["--profile", spelling]).profile is value
    assert parse_args(["--profile"]).profile is True


def test_renamed_flags_and_values_still_work(tmp_path, capsys):
    path = tmp_path / "recipe.yaml"
    path.write_text("fast_loader_max_mb: 12\nloader: fast\n")
    cfg = parse_args(["--config", str(path)])
    assert (cfg.device_loader_max_mb, cfg.loader) == (12, "device")
    assert parse_args(["--fast_loader_max_mb", "7"]).device_loader_max_mb == 7
    assert "--fast_loader_max_mb is deprecated" in capsys.readouterr().err


def test_every_field_is_a_flag_with_help():
    from accel_ddp.cli.args import build_parser

    help_text = build_parser().format_help()
    for name in (f.name for f in dataclasses.fields(TrainConfig)):
        assert f"--{name}" in help_text



def test_the_repeated_flags_are_declared_on_the_config_but_are_no_option(tmp_path):
    """``TrainConfig.repeated_flags``: what parse_args found given twice (said once the run starts, tested in
    tests/lifecycle/test_red_team.py), declared on the class; no flag, no recipe key, not in config.yaml."""
    from accel_ddp.cli.args import build_parser

    assert TrainConfig().repeated_flags == ()  # a config made in Python: nothing said
    cfg = parse_args(["--epochs", "2", "--epochs", "3"])
    assert cfg.repeated_flags == ["--epochs 2 and --epochs 3: --epochs is given 2 times; the last, --epochs 3, is "
                                  "used (give it once to silence this)"] and TrainConfig.repeated_flags == ()
    assert "repeated_flags" not in {f.name for f in dataclasses.fields(TrainConfig)} | set(cfg.to_dict())
    assert "repeated_flags" not in build_parser().format_help()
    with pytest.raises(ConfigError, match="repeated_flags"):
        parse_args(["--repeated_flags", "x"])
    (tmp_path / "recipe.yaml").write_text("repeated_flags: [x]\n")
    with pytest.raises(ConfigError, match="repeated_flags"):
        parse_args(["--config", str(tmp_path / "recipe.yaml")])
