"""accel_ddp.util.converters: each converter of the list gets its own section of the run's options, read by the
caller's reader, and applies in order; the lines of those that applied, in that order."""

from __future__ import annotations

from dataclasses import dataclass

from accel_ddp.util.converters import ModelBuild, ModelConverter, NoOptions, convert_model


@dataclass(frozen=True)
class _Scale:
    factor: int


@dataclass(frozen=True)
class _Shift:
    offset: int


def test_each_converter_is_given_the_section_it_declares_and_only_those_that_apply_run_in_order():
    sections = {_Scale: _Scale(3), _Shift: _Shift(0), NoOptions: NoOptions()}
    asked, seen = [], []

    def read(cls):
        asked.append(cls)
        return sections[cls]

    def scale(model, options, build):
        seen.append(("scale", options, build))
        return model * options.factor, f"x{options.factor}"

    def shift(model, options, build):
        seen.append(("shift", options, build))
        return model + options.offset, "shifted"

    def mark(model, options, build):
        seen.append(("mark", options, build))
        return model, None  # applied, adds no line

    build = ModelBuild(accelerator="the accelerator", task="the task")
    converters = (ModelConverter("scale", _Scale, applies=lambda o: o.factor != 1, apply=scale),
                  ModelConverter("shift", _Shift, applies=lambda o: o.offset != 0, apply=shift),
                  ModelConverter("mark", NoOptions, applies=lambda o: True, apply=mark))
    model, lines = convert_model(2, build, converters, read)
    assert (model, lines) == (6, ["x3"])
    assert asked == [_Scale, _Shift, NoOptions]  # each converter's own section, read once
    assert seen == [("scale", _Scale(3), build), ("mark", NoOptions(), build)]  # shift asked for nothing
