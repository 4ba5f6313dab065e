"""Config parsing, precedence, validation and the launch configs (fast, in-process)."""

from __future__ import annotations

import pytest
import yaml

from accel_ddp.config import ConfigError, TrainConfig, parse_args
from tests.conftest import REPO


@pytest.mark.parametrize(
    "global_batch, per_device, world, expected",
    [(64, None, 1, (64, 1)), (64, None, 2, (32, 1)), (64, 16, 2, (16, 2)), (64, 8, 4, (8, 2)), (32, 16, 1, (16, 2))],
)
def test_batch_layout_keeps_the_global_batch(global_batch, per_device, world, expected):
    cfg = TrainConfig(global_batch_size=global_batch, per_device_batch_size=per_device)
    per_device_batch, accumulation = cfg.batch_layout(world)
    assert (per_device_batch, accumulation) == expected
    assert per_device_batch * accumulation * world == global_batch


@pytest.mark.parametrize("global_batch, per_device, world", [(64, 24, 2), (10, None, 4), (30, 4, 2)])
def test_indivisible_global_batch_is_refused(global_batch, per_device, world):
    cfg = TrainConfig(global_batch_size=global_batch, per_device_batch_size=per_device)
    with pytest.raises(ConfigError, match="not divisible by world size"):
        cfg.batch_layout(world)


def test_yaml_recipe_then_cli_overrides(tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("lr: 0.05\nepochs: 7\noptimizer: sgd\nsynthetic_shape: [3, 4, 4]\n")
    cfg = parse_args(["--config", str(recipe), "--epochs", "2", "--download"])
    assert cfg.lr == 0.05 and cfg.optimizer == "sgd"  # from the recipe
    assert cfg.epochs == 2  # the flag wins over the recipe
    assert cfg.download is True and cfg.synthetic_shape == (3, 4, 4)
    assert parse_args([]).epochs == TrainConfig().epochs  # defaults untouched


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--lr", "-0.1"], "--lr must be > 0"),
        (["--global_batch_size", "0"], "--global_batch_size must be > 0"),
        (["--optimizer", "lamb"], "choose one of sgd, adamw"),
        (["--lr_schedule", "step"], "choose one of constant, linear, cosine"),
        (["--checkpointing_steps", "often"], "positive step count or 'epoch'"),
        (["--epochs", "three"], "invalid int value"),
        (["--no_such_flag"], "unrecognized arguments"),
    ],
)
def test_bad_values_raise_one_clear_config_error(argv, message):
    with pytest.raises(ConfigError, match=message) as err:
        parse_args(argv)
    assert "\n" not in str(err.value)


def test_yaml_errors_name_the_file(tmp_path):
    bad_syntax = tmp_path / "bad.yaml"
    bad_syntax.write_text("lr: [0.1\nepochs: 2\n")
    with pytest.raises(ConfigError, match=r"bad.yaml: not valid YAML at line \d+"):
        parse_args(["--config", str(bad_syntax)])
    unknown = tmp_path / "unknown.yaml"
    unknown.write_text("lr: 0.1\nlearning_rate: 0.2\n")
    with pytest.raises(ConfigError, match="unknown key\\(s\\) learning_rate"):
        parse_args(["--config", str(unknown)])
    with pytest.raises(ConfigError, match="no such file"):
        parse_args(["--config", str(tmp_path / "missing.yaml")])


def test_every_field_is_a_flag_with_help():
    from accel_ddp.config import build_parser

    help_text = build_parser().format_help()
    for name in TrainConfig.__dataclass_fields__:
        assert f"--{name}" in help_text


@pytest.mark.parametrize(
    "name, distributed_type, processes, mixed_precision, debug",
    [("cpu_2proc", "MULTI_GPU", 2, "no", False), ("4gpu", "MULTI_GPU", 4, "bf16", False),
     ("1gpu_debug", "NO", 1, "bf16", True)],
)
def test_launch_configs_load_with_accelerates_loader(name, distributed_type, processes, mixed_precision, debug):
    from accelerate.commands.config.config_args import load_config_from_file

    path = REPO / "accelerate_configs" / f"{name}.yaml"
    config = load_config_from_file(str(path))
    assert config.distributed_type.value == distributed_type
    assert config.num_processes == processes
    assert str(config.mixed_precision) == mixed_precision
    assert config.debug is debug
    assert config.use_cpu is False  # the script, not the config, decides CPU vs GPU
    # every key carries a comment saying what it does, on its line or just above it
    lines = path.read_text().splitlines()
    for previous, line in zip([""] + lines, lines, strict=False):
        if line and not line.startswith("#"):
            key = line.split(":")[0]
            assert "#" in line or previous.startswith("#"), f"{name}.yaml: key {key!r} has no comment"
    assert yaml.safe_load(path.read_text())["num_processes"] == processes
