"""config/views.py: a component's typed section of TrainConfig, checked against the options when declared."""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil

import pytest

import accel_ddp
from accel_ddp.config import TrainConfig
from accel_ddp.config.views import SECTIONS, config_section, defaults_of, section_of, section_problems


@dataclasses.dataclass(frozen=True)
class _Good:
    epochs: int
    lr: float


def test_a_section_reads_its_options_from_the_config():
    assert section_of(TrainConfig(epochs=3, lr=0.5), _Good) == _Good(epochs=3, lr=0.5)


def test_a_sections_defaults_are_its_options_defaults():
    """What a component compares against to name the flags a run changed (optim/user.py's refusals)."""
    assert defaults_of(_Good) == {"epochs": TrainConfig().epochs, "lr": TrainConfig().lr}
    assert section_of(TrainConfig(), _Good) == _Good(**defaults_of(_Good))


def test_a_field_that_is_no_option_or_typed_otherwise_is_refused_at_declaration():
    @dataclasses.dataclass(frozen=True)
    class Bad:
        epochs: str
        no_such_option: int

    assert section_problems(Bad) == ["epochs is typed str, the option int",
                                     "no_such_option is no option of TrainConfig"]
    with pytest.raises(TypeError, match="no_such_option is no option of TrainConfig"):
        config_section(Bad)
    assert Bad not in SECTIONS


def test_every_section_of_the_package_matches_the_options():
    """Importing every module declares every section; each one reads a default config without error."""
    for module in pkgutil.walk_packages(accel_ddp.__path__, "accel_ddp."):
        if not module.name.endswith("__main__"):
            importlib.import_module(module.name)
    for cls in SECTIONS:
        assert section_problems(cls) == [], cls
        section_of(TrainConfig(), cls)
