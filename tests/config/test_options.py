"""accel_ddp/config/: TrainConfig's checks (the batch layout, the Python API checked as the CLI is) and the property
that any value, from YAML or the command line, gives a valid config or one ConfigError line (fast, in-process)."""

from __future__ import annotations

import dataclasses
import re

import pytest
import yaml
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from accel_ddp.cli.args import parse_args
from accel_ddp.config import TrainConfig
from accel_ddp.util.validation import ConfigError


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


def test_python_api_is_checked_like_the_cli():
    for kwargs, message in [({"epochs": 2.5}, "--epochs expects a whole number"),
                            ({"debug": "no"}, "--debug expects true or false"),
                            ({"lr": float("nan")}, "--lr must be a finite number"),
                            ({"synthetic_shape": (1, True)}, "--synthetic_shape expects a list of whole numbers"),
                            ({"seed": 2**32}, "--seed must be <= 4294967295"),
                            ({"epochs": 10**5000}, "--epochs must be <= 2147483647, got <an integer of 16610 bits>")]:
        with pytest.raises(ConfigError, match=re.escape(message)):
            TrainConfig(**kwargs)
    assert TrainConfig(lr=1, seed=2**32 - 1).lr == 1.0


# ----------------------------------------------------------------------------- property-based

_FIELDS = sorted(f.name for f in dataclasses.fields(TrainConfig))  # the options (not repeated_flags, a ClassVar)


_ANY_VALUE = st.one_of(
    st.none(), st.booleans(), st.integers(), st.integers(min_value=-3, max_value=3000),
    st.integers(min_value=1, max_value=64), st.floats(min_value=0, max_value=10),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12),
    st.sampled_from(["no", "yes", "epoch", "auto", "nan", "inf", "1e-3", "", " ", "caf\udce9", "a\0b", "mlp",
                     "cosine", "synthetic", "adamw", "1 28 28", "x.safetensors"]),
    st.lists(st.one_of(st.integers(-2, 40), st.text(max_size=3), st.booleans(), st.floats()), max_size=4),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)


def _outcome(parse) -> None:
    """The property: a valid TrainConfig (that survives its own round trip) or one ConfigError line."""
    try:
        cfg = parse()
    except ConfigError as err:
        assert str(err) and "\n" not in str(err)
        event("ConfigError")
        return
    event("valid config")
    assert TrainConfig(**cfg.to_dict()) == cfg


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(values=st.dictionaries(st.sampled_from(_FIELDS + ["fast_loader_max_mb", "no_such_key"]), _ANY_VALUE,
                              max_size=5))
def test_any_yaml_value_gives_a_config_or_one_config_error(tmp_path, values):
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(values, allow_unicode=False))
    _outcome(lambda: parse_args(["--config", str(path)]))


_CLI_TEXT = st.one_of(
    st.text(max_size=12).filter(lambda v: not v.startswith("-")),  # a leading dash makes argparse see an option
    st.integers().map(str), st.floats(allow_nan=True, allow_infinity=True).map(str),
    st.sampled_from(["true", "no", "On", "0", "epoch", "auto", "-1", "-0.5", "1e20", "caf\udce9", "a\0b", "",
                     "\u00b2"]),
)


@settings(max_examples=150, deadline=None)
@given(flags=st.lists(st.tuples(st.sampled_from(_FIELDS), st.lists(_CLI_TEXT, min_size=0, max_size=3)), max_size=4))
def test_any_cli_value_gives_a_config_or_one_config_error(flags):
    argv = [item for name, values in flags for item in (f"--{name}", *values)]
    _outcome(lambda: parse_args(argv))

