"""train.py's command line: flags and the ``--config`` YAML recipe, parsed into a ``TrainConfig``.

Order of precedence (timm's): dataclass defaults < ``--config recipe.yaml`` < CLI flags. Old
spellings (``RENAMED_FLAGS``, ``EXPANDED_VALUES`` in config/choices.py) are translated here, with a warning.
No torch import, like accel_ddp/config/.

    >>> cfg = parse_args(["--dataset", "digits", "--lr", "0.01"])
    >>> cfg = parse_args(["--config", "recipe.yaml", "--epochs", "2"])   # the flag wins over the recipe
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import os
import re
import sys
import typing
from typing import Any

from accel_ddp.config import (
    EXPANDED_VALUES,
    FOREIGN_FLAGS,
    HF_ALIASES,
    HF_SCHEDULES,
    LR_SCHEDULES,
    RENAMED_FLAGS,
    SWITCH_ALIASES,
    TrainConfig,
    field_types,
    new_spelling,
    sections,
    warn_deprecated,
)
from accel_ddp.config.saved import REPLAYED_KEYS
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

    def parse_args(self, args=None, namespace=None):  # type: ignore[override]
        parsed, unknown = self.parse_known_args(args, namespace)
        if unknown:
            self.error(_unknown_flag(unknown))
        return parsed


def _known_names() -> list[str]:
    return ["config", *(f.name for f in dataclasses.fields(TrainConfig)), *HF_ALIASES]


def did_you_mean(name: str) -> str:
    """`` did you mean --learning_rate (= --lr)?`` for a mistyped option name, or ''.

    A name of the Trainer's or Accelerate's examples that we lack (``FOREIGN_FLAGS``) gets its replacement instead;
    otherwise only a near spelling is suggested (``_near``): ``--gradient_checkpointing`` is not a typo of
    ``--async_checkpointing``, nor ``--overwrite_output_dir`` of ``--output_dir``.
    """
    names = _known_names()
    spelled = name.replace("-", "_")
    if spelled in FOREIGN_FLAGS and spelled not in names:
        return f"; not a flag here: {FOREIGN_FLAGS[spelled]}"  # a recipe's key
    match = [spelled] if spelled in names else difflib.get_close_matches(spelled, names, n=1, cutoff=0.6)
    if not match or not _near(spelled, match[0]):
        return ""
    alias = f" (= --{HF_ALIASES[match[0]][0]})" if match[0] in HF_ALIASES else ""
    return f"; did you mean --{match[0]}{alias}?"


def _near(typed: str, known: str) -> bool:
    """A typo of ``known``: a few edits away (one per four letters, at least two), its beginning (``--lr_sched``),
    or some of its words (``--warmup`` of ``--warmup_steps``)."""
    words = set(known.split("_"))
    return (_edits(typed, known) <= max(2, len(typed) // 4) or known.startswith(typed)
            or set(typed.split("_")) <= words)


def _edits(a: str, b: str) -> int:
    """Levenshtein distance (insertions, deletions, substitutions)."""
    row = list(range(len(b) + 1))
    for i, char in enumerate(a, 1):
        previous, row[0] = row[0], i
        for j, other in enumerate(b, 1):
            previous, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, previous + (char != other))
    return row[-1]


def _unknown_flag(leftover: list[str]) -> str:
    """What argparse could not place: the first unknown --flag with a suggestion (no prefix matching)."""
    flag = next((arg for arg in leftover if arg.startswith("--")), None)
    if flag is None:
        return f"unrecognized arguments: {' '.join(leftover)}"
    name = flag[2:].partition("=")[0]
    if name.replace("-", "_") in FOREIGN_FLAGS:
        return f"--{name} is not a flag here: {FOREIGN_FLAGS[name.replace('-', '_')]}"
    return f"unknown flag --{name}{did_you_mean(name)}"


# --help's description: what no flag of train.py sets (docs/launch.md).
LAUNCH_CONFIG_NOTE = (
    "Data-parallel training with Accelerate. The launch config, not these flags, says how many processes and "
    "machines, CPU or GPU, and the default mixed precision: `accelerate launch --config_file "
    "accelerate_configs/4gpu.yaml train.py ...` (accelerate_configs/, docs/launch.md); `python train.py ...` is one "
    "process. Flags override --config recipe.yaml; the groups below are docs/flags.md's tables.")


def build_parser() -> argparse.ArgumentParser:
    parser = _OneLineParser(
        prog="train.py",
        usage="accelerate launch [--config_file LAUNCH.yaml] train.py [--config RECIPE.yaml] [--flag value ...]\n"
              "       python train.py [--config RECIPE.yaml] [--flag value ...]",  # not 80 flags in one line
        description=LAUNCH_CONFIG_NOTE,
        epilog="Before its first step a run prints what it got, the launch config's part included: processes, "
               "device, precision and where it came from (docs/outputs.md#the-start-up-block).",
        argument_default=argparse.SUPPRESS,  # so we know which flags the user really gave
        allow_abbrev=False,  # `--epoch 1` is a typo, not --epochs (docs.python.org/3/library/argparse.html)
    )
    parser.add_argument("--config", help="YAML recipe with any of the flags below as keys (also a run's config.yaml)")
    hints = field_types()
    for title, note, fields in sections():  # the same groups as docs/flags.md (config.sections)
        group = parser.add_argument_group(title, note or None)
        for f in fields:
            _add_option(group, f, hints)
    for old, new in RENAMED_FLAGS.items():
        parser.add_argument(f"--{old}", type=scalar_type(hints[new])[0], help=argparse.SUPPRESS)
    _add_aliases(parser, hints)
    return parser


def _add_option(group, f: dataclasses.Field, hints: dict[str, Any]) -> None:
    kind, is_tuple = scalar_type(hints[f.name])
    help_text = f"{f.metadata['help']} (default: {f.default})".replace("%", "%%")  # argparse formats help with %
    if kind is bool:
        parse = _parse_with_tracking if f.name == "with_tracking" else _parse_bool
        group.add_argument(f"--{f.name}", type=parse, nargs="?", const=True, help=help_text)
    elif is_tuple:
        group.add_argument(f"--{f.name}", type=kind, nargs="+", help=help_text)
    else:
        group.add_argument(f"--{f.name}", type=kind, help=help_text)


def _add_aliases(parser: argparse.ArgumentParser, hints: dict[str, Any]) -> None:
    """The Hugging Face names (config.HF_ALIASES), in a --help group of their own."""
    group = parser.add_argument_group("Hugging Face names", "aliases of ours, as in run_clm_no_trainer.py and the "
                                      "Trainer (docs/flags.md#hugging-face-names)")
    for alias, (ours, note) in HF_ALIASES.items():
        if alias in SWITCH_ALIASES:  # --bf16, as in the Trainer: a switch
            group.add_argument(f"--{alias}", type=_parse_bool, nargs="?", const=True,
                               help=f"= --{ours}" + (f"; {note}" if note else ""))
            continue
        field_name = ours.split()[0]
        kind = {"num_train_epochs": float, "dataset_name": str, "block_size": int}.get(
            alias, scalar_type(hints.get(field_name, str))[0])
        group.add_argument(f"--{alias}", type=kind, help=f"= --{ours}" + (f"; {note}" if note else ""))


def _recipe_loader() -> type:
    """PyYAML's safe loader, plus YAML 1.2 floats: PyYAML (YAML 1.1) reads ``lr: 1e-3`` and ``1.0e10`` as text,
    wanting a dot and a signed exponent (yaml/pyyaml#173)."""
    import yaml

    class RecipeLoader(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):  # PyYAML keeps a repeated key's last value, without a word
            seen: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=deep)
                line = key_node.start_mark.line + 1
                if isinstance(key, typing.Hashable) and key in seen:
                    raise ConfigError(f"--config {node.start_mark.name}: key {show(key)} is given twice (lines "
                                      f"{seen[key]} and {line}); which one? keep one of them")
                seen[key] = line
            return super().construct_mapping(node, deep)

    RecipeLoader.add_implicit_resolver(
        "tag:yaml.org,2002:float",
        re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
        list("-+0123456789"),
    )
    return RecipeLoader


def load_recipe(path: str) -> dict[str, Any]:
    """Read a YAML recipe whose keys are TrainConfig fields (values are checked by ``TrainConfig``)."""
    import yaml

    if os.path.isdir(path):
        raise ConfigError(f"--config {path} is a folder; give the path of a YAML recipe file in it")
    if not os.path.isfile(path):
        raise ConfigError(f"--config {path}: no such file; give the path of a YAML recipe")
    try:
        with open(path, encoding="utf-8") as fh:
            data = yaml.load(fh, Loader=_recipe_loader())  # noqa: S506 - a SafeLoader subclass
    except ConfigError:
        raise
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
    known = {f.name for f in dataclasses.fields(TrainConfig)} | set(RENAMED_FLAGS) | set(HF_ALIASES)
    data = {key: value for key, value in data.items() if key not in REPLAYED_KEYS}  # a run's own config.yaml
    unknown = [str(key) for key in data if key not in known]  # keys may be numbers, dates, ... in YAML
    if unknown:
        hint = did_you_mean(unknown[0]).replace("; did you mean --", "; did you mean ").replace(" (= --", " (= ")
        raise ConfigError(
            f"--config {path}: unknown key(s) {show(', '.join(unknown))[1:-1]}{hint}; valid keys are the flags of "
            "train.py --help"
        )
    return data


def _alias_values(alias: str, value: Any) -> dict[str, Any]:
    """What one Hugging Face name sets, in our options."""
    if alias == "dataset_name":
        return {"dataset": "hf", "hf_name": value}
    if alias == "block_size":
        return {"max_length": value, "packing": True}
    if alias == "num_train_epochs":
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value):
            raise ConfigError(f"--num_train_epochs {show(value)}: only whole epochs here; for part of an epoch "
                              "give --max_steps (optimizer steps)")
        return {"epochs": int(value)}
    if alias in SWITCH_ALIASES:
        if not isinstance(value, bool):
            raise ConfigError(f"--{alias} {show(value)}: a switch (true or false); or give --mixed_precision {alias}")
        return {"mixed_precision": alias} if value else {}
    if alias == "lr_scheduler_type":
        if value not in HF_SCHEDULES:
            raise ConfigError(f"--lr_scheduler_type {show(value)} has no equivalent here; choose one of "
                              f"{', '.join(HF_SCHEDULES)} (or --lr_schedule {'/'.join(LR_SCHEDULES)})")
        return {"lr_schedule": HF_SCHEDULES[value]}
    return {HF_ALIASES[alias][0]: value}


def _translated(values: dict[str, Any]) -> dict[str, Any]:
    """One source's Hugging Face names replaced by ours; two names for one option with two values: ConfigError."""
    out = {key: value for key, value in values.items() if key not in HF_ALIASES}
    given = {key: f"--{key} {show(value)}" for key, value in out.items()}
    for alias in (key for key in values if key in HF_ALIASES):
        for name, value in _alias_values(alias, values[alias]).items():
            if name in out and out[name] != value:
                raise ConfigError(f"--{alias} {show(values[alias])} and {given[name]} both set --{name} to different "
                                  "values; give one of them")
            out[name], given[name] = value, f"--{alias} {show(values[alias])}"
    return out


def _check_constant_schedule(values: dict[str, Any], sources: list[dict[str, Any]]) -> None:
    """The Hugging Face ``constant`` schedule has no warmup (``constant_with_warmup`` has): with one, refuse."""
    named_constant = any(source.get("lr_scheduler_type") == "constant" for source in sources)
    if named_constant and (values.get("warmup_steps") or values.get("warmup_ratio")):
        raise ConfigError("--lr_scheduler_type constant means no warmup, but a warmup is set; use "
                          "--lr_scheduler_type constant_with_warmup, or drop the warmup")


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


def repeated_flags(argv: list[str]) -> list[str]:
    """A line for each flag given twice with different values (``--lr 1e-3 --lr 1e-4``), which argparse settles
    without a word: the last wins. Said, not refused: appending overrides to a base command line is how wrapper
    scripts (and ~20 of this suite's tests) vary a run, and the run is the one the last value describes. The same
    value twice is harmless. A tuple flag's values run to the next ``--flag``."""
    given: dict[str, list[str]] = {}
    name = None
    for arg in argv:
        if arg.startswith("--") and len(arg) > 2:
            name, equals, value = arg[2:].partition("=")
            given.setdefault(name, []).append(value if equals else "")
            name = None if equals else name
        elif name is not None:
            given[name][-1] = f"{given[name][-1]} {arg}".strip()
    return [f"{' and '.join(f'--{name} {value}'.strip() for value in values)}: --{name} is given {len(values)} "
            f"times; the last, {f'--{name} {values[-1]}'.strip()}, is used (give it once to silence this)"
            for name, values in given.items() if len(set(values)) > 1]


def parse_args(argv: list[str] | None = None) -> TrainConfig:
    """Defaults, then the ``--config`` recipe, then CLI flags."""
    argv = sys.argv[1:] if argv is None else argv
    args = vars(build_parser().parse_args(argv))
    recipe = load_recipe(args.pop("config")) if "config" in args else {}
    values = _translated(_renamed(dict(recipe)))
    values.update(_translated(_renamed(dict(args))))
    _check_constant_schedule(values, [recipe, args])
    cfg = TrainConfig(**values)
    # Said once the run starts (accel_ddp/assemble.py), after every check of its input: bad input stays one line.
    cfg.repeated_flags = repeated_flags(argv)
    return cfg
