"""TrainConfig's options in groups: docs/flags.md's tables (one per ``### Title``) and ``--help``'s groups.

A group starts at the field whose ``_opt(..., section="name (note)")`` names it and runs to the next one.
"""

from __future__ import annotations

import dataclasses
import typing

from accel_ddp.config.options import TrainConfig


class Section(typing.NamedTuple):
    """One group of options: docs/flags.md's table under ``### Title`` (then the note), and a ``--help`` group."""

    title: str  # "Task"
    note: str  # "How a batch reaches the model, its loss and the eval metrics: docs/tasks.md." or ""
    fields: list[dataclasses.Field]


def sections() -> list[Section]:
    """TrainConfig's fields in groups, in order: each ``_opt(..., section="name (note)")`` starts one."""
    grouped: list[Section] = []
    for f in dataclasses.fields(TrainConfig):
        if "section" in f.metadata:
            name, _, note = f.metadata["section"].partition(" (")
            note = note.removesuffix(")")
            grouped.append(Section(name[0].upper() + name[1:], f"{note[:1].upper()}{note[1:]}." if note else "", []))
        if not grouped:
            raise TypeError(f"TrainConfig.{f.name}, the first field, must name its section (_opt(..., section=...))")
        grouped[-1].fields.append(f)
    return grouped
