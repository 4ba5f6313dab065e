"""Typed sections of ``TrainConfig``: a component names the options it reads in a small dataclass of its own, whose
fields are options of the same name and type, and receives only that, never the whole config (issue 52 item 2;
torchtitan and litgpt hand each component its own section in the same spirit).

    @config_section
    @dataclass(frozen=True)
    class BadStepOptions:               # in the module that reads them (accel_ddp/bad_steps/stops.py)
        on_anomaly: str
        spike_factor: float

    bad_steps = BadSteps(section_of(cfg, BadStepOptions), ...)      # in assemble.py, which holds the TrainConfig

A section is a view: the flags, their defaults, help and checks stay in ``options.py``, so ``--help`` and
docs/flags.md are unchanged. A field whose name or type is not an option's is a programming error, raised when the
module defining the section is imported.
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

from accel_ddp.config.options import TrainConfig, option_defaults

Section = TypeVar("Section")
SECTIONS: list[type] = []  # every declared section, in import order (tests/config/test_views.py reads them)


def _spelling(annotation: Any) -> str:
    """A field's type as written (``from __future__ import annotations`` keeps it a string), spaces dropped."""
    return (annotation if isinstance(annotation, str) else getattr(annotation, "__name__", repr(annotation))).replace(
        " ", "")


def section_problems(cls: type) -> list[str]:
    """What makes ``cls`` no section of TrainConfig: fields that are no option, or typed otherwise."""
    if not dataclasses.is_dataclass(cls):
        return [f"{cls.__qualname__} is not a dataclass"]
    options = {f.name: _spelling(f.type) for f in dataclasses.fields(TrainConfig)}
    problems = []
    for field in dataclasses.fields(cls):
        if field.name not in options:
            problems.append(f"{field.name} is no option of TrainConfig")
        elif _spelling(field.type) != options[field.name]:
            problems.append(f"{field.name} is typed {_spelling(field.type)}, the option {options[field.name]}")
    return problems


def config_section(cls: type[Section]) -> type[Section]:
    """Declare ``cls`` (a dataclass) a section of TrainConfig; checked now, so a renamed option fails at import."""
    problems = section_problems(cls)
    if problems:
        raise TypeError(f"{cls.__module__}.{cls.__qualname__}: " + "; ".join(problems))
    SECTIONS.append(cls)
    return cls


def section_of(cfg: TrainConfig, cls: type[Section]) -> Section:
    """The options ``cls`` declares, read from ``cfg``."""
    return cls(**{field.name: getattr(cfg, field.name) for field in dataclasses.fields(cls)})


def defaults_of(cls: type) -> dict[str, Any]:
    """The default of each option ``cls`` declares (options.py's): which flags a run changed, for one."""
    defaults = option_defaults()
    return {field.name: defaults[field.name] for field in dataclasses.fields(cls)}
