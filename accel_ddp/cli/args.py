"""train.py's command line: flags and the ``--config`` YAML recipe, parsed into a ``TrainConfig``.

Order of precedence (timm's): dataclass defaults < ``--config recipe.yaml`` < CLI flags. Old
spellings (``RENAMED_FLAGS``, ``EXPANDED_VALUES`` in config.py) are translated here, with a warning.
No torch import, like config.py.

    >>> cfg = parse_args(["--dataset", "digits", "--lr", "0.01"])
    >>> cfg = parse_args(["--config", "recipe.yaml", "--epochs", "2"])   # the flag wins over the recipe
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys
import typing
from typing import Any

from accel_ddp.config import EXPANDED_VALUES, RENAMED_FLAGS, TrainConfig, field_types, new_spelling, warn_deprecated
from accel_ddp.util.validation import ConfigError, scalar_type, show


def _parse_bool(text: str) -> bool:
    lowered = str(text).lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def _parse_with_tracking(text: str) -> bool | str:
    """A switch, whose old values (``none``, ``tensorboard``, ``csv``, ``all``) ``_renamed`` translates."""
    if ("with_tracking", text) in EXPANDED_VALUES:
        return text
    try:
        return _parse_bool(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"a switch now, got {text!r}; name the trackers with --report_to, e.g. "
                                         f"--with_tracking --report_to {text}") from None


class _OneLineParser(argparse.ArgumentParser):
    """argparse prints usage plus the error; we want one line and exit code 2 via ConfigError."""

    def error(self, message: str) -> typing.NoReturn:
        # An argument may hold a line break ("unrecognized arguments: <newline>"): shown escaped, one line stays one.
        one_line = message.replace("\r", "\\r").replace("\n", "\\n")
        raise ConfigError(f"{one_line}; see --help")


def build_parser() -> argparse.ArgumentParser:
    parser = _OneLineParser(
        prog="train.py",
        description="Data-parallel training with Accelerate. Flags override --config recipe.yaml.",
        argument_default=argparse.SUPPRESS,  # so we know which flags the user really gave
    )
    parser.add_argument("--config", help="YAML recipe with any of the flags below as keys")
    hints = field_types()
    for f in dataclasses.fields(TrainConfig):
        kind, is_tuple = scalar_type(hints[f.name])
        help_text = f"{f.metadata['help']} (default: {f.default})"
        if kind is bool:
            parse = _parse_with_tracking if f.name == "with_tracking" else _parse_bool
            parser.add_argument(f"--{f.name}", type=parse, nargs="?", const=True, help=help_text)
        elif is_tuple:
            parser.add_argument(f"--{f.name}", type=kind, nargs="+", help=help_text)
        else:
            parser.add_argument(f"--{f.name}", type=kind, help=help_text)
    for old, new in RENAMED_FLAGS.items():
        parser.add_argument(f"--{old}", type=scalar_type(hints[new])[0], help=argparse.SUPPRESS)
    return parser


def _recipe_loader() -> type:
    """PyYAML's safe loader, plus YAML 1.2 floats: PyYAML (YAML 1.1) reads ``lr: 1e-3`` and ``1.0e10`` as text,
    wanting a dot and a signed exponent (yaml/pyyaml#173)."""
    import yaml

    class RecipeLoader(yaml.SafeLoader):
        pass

    RecipeLoader.add_implicit_resolver(
        "tag:yaml.org,2002:float",
        re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
        list("-+0123456789"),
    )
    return RecipeLoader


def load_recipe(path: str) -> dict[str, Any]:
    """Read a YAML recipe whose keys are TrainConfig fields (values are checked by ``TrainConfig``)."""
    import yaml

    if not os.path.isfile(path):
        raise ConfigError(f"--config {path}: no such file; give the path of a YAML recipe")
    try:
        with open(path, encoding="utf-8") as fh:
            data = yaml.load(fh, Loader=_recipe_loader())  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"--config {path}: not valid YAML{where}; fix the file's syntax") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"--config {path}: cannot read it ({err.__class__.__name__}); check the file") from None
    except ValueError as err:  # a value YAML's constructors refuse, e.g. an integer of 5000 digits
        raise ConfigError(f"--config {path}: a value cannot be read ({show(str(err), 100)}); fix it") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"--config {path}: expected a mapping of option: value, got {type(data).__name__}; "
                          "write one `flag: value` per line, e.g. lr: 0.01")
    known = {f.name for f in dataclasses.fields(TrainConfig)} | set(RENAMED_FLAGS)
    unknown = [str(key) for key in data if key not in known]  # keys may be numbers, dates, ... in YAML
    if unknown:
        raise ConfigError(
            f"--config {path}: unknown key(s) {show(', '.join(unknown))[1:-1]}; valid keys are the flags of "
            "train.py --help"
        )
    return data


def _renamed(values: dict[str, Any]) -> dict[str, Any]:
    """Old option names and values replaced by their new spelling (the new spelling wins if both are given)."""
    for old, new in RENAMED_FLAGS.items():
        if old in values:
            warn_deprecated(f"--{old}", f"--{new}")
            value = values.pop(old)
            values.setdefault(new, value)
    for (name, old), new in EXPANDED_VALUES.items():
        if isinstance(values.get(name), str) and values[name].lower() == old:
            warn_deprecated(f"--{name} {old}", new_spelling(new))
            values[name] = new[name]
            for key, value in new.items():
                values.setdefault(key, value)
    return values


def parse_args(argv: list[str] | None = None) -> TrainConfig:
    """Defaults, then the ``--config`` recipe, then CLI flags."""
    args = vars(build_parser().parse_args(sys.argv[1:] if argv is None else argv))
    values = _renamed(load_recipe(args.pop("config"))) if "config" in args else {}
    values.update(_renamed(args))
    return TrainConfig(**values)
