"""What bad input is (``ConfigError``) and how one option's value is checked: its type, range and text.

    checked_type("lr", "0.1", float, 3e-3)   # ConfigError: --lr expects a finite number, got '0.1' (str); ...
    check_range("keep_last", 0, low=1, high=None)   # ConfigError: --keep_last must be > 0, got 0; ...

The options' ``__post_init__`` (config/options.py) runs these on every field, whatever the source (Python,
YAML or CLI). No torch import, like accel_ddp/config/.
"""

from __future__ import annotations

import math
import types
import typing
from typing import Any


class ConfigError(ValueError):
    """Bad user input. ``main()`` prints it as one line and exits with code 2."""


class LaunchError(RuntimeError):
    """The processes did not form the world the launcher announced (one line, exit 2, like bad input)."""


class ServiceFailure(RuntimeError):
    """A service the run depends on (an object store) failed once the run was under way: not bad input (its
    settings worked at the start), so one line and exit 1, a failure a launcher's requeue may retry."""


class UserCodeFailed(RuntimeError):
    """A user's code raised once the run was under way (a callback's hook): one line naming the code and where it
    raised, exit 1 like any failure (a bug to fix, not bad input); the traceback is the exception's ``__cause__``
    (in torchelastic's error file, and what a caller of ``train()`` sees)."""


# Every int without a range of its own stays below this: nothing sensible is bigger, and torch's C++
# side (batch sizes, bucket sizes, step counters) stores 32- or 64-bit integers.
INT_MAX = 2**31 - 1


def int_or_text(text: str) -> int | str:
    """The command line's type of an option that takes a whole number or a word (``--per_device_batch_size 16``
    or ``auto``): the number where the text is one, else the text, which the option's own check reads."""
    try:
        return int(text)
    except ValueError:
        return text


def checked_type(name: str, value: Any, annotation: Any, default: Any) -> Any:
    """``value`` as the field's type (an int where a float is wanted, a tuple for a list), or ConfigError.

    Strict on purpose: YAML's ``"no"`` is text, not false; ``5.7`` is not a step count; a bool is not a number.
    ``default`` (the field's) is the example a number's fix shows.
    """
    kind, is_tuple = scalar_type(annotation)
    if value is None:
        if type(None) in typing.get_args(annotation):
            return None
        raise ConfigError(f"--{name} needs a value ({_KIND_NAMES[kind]}), got null; {_kind_fix(name, kind, default)}")
    if is_tuple:
        items = [value] if isinstance(value, int) and not isinstance(value, bool) else value
        if not isinstance(items, (list, tuple)) or not all(_is_kind(v, kind) for v in items):
            raise ConfigError(f"--{name} expects a list of whole numbers, got {show(value)}; "
                              f"e.g. --{name} 1 28 28 (YAML: {name}: [1, 28, 28])")
        return tuple(items)
    if name == "checkpointing_steps" and _is_kind(value, int):
        return str(value)  # YAML reads `checkpointing_steps: 100` as a number; the flag is text
    if not _is_kind(value, kind):
        raise ConfigError(f"--{name} expects {_KIND_NAMES[kind]}, got {show(value)} ({_type_name(value)}); "
                          f"{_kind_fix(name, kind, default)}")
    if kind is float:
        value = float(value)
        if not math.isfinite(value):
            raise ConfigError(f"--{name} must be a finite number, got {value}; {_kind_fix(name, float, default)}")
    if kind is str or (kind is int_or_text and isinstance(value, str)):
        _check_text(name, value)
    return value


_KIND_NAMES = {bool: "true or false", int: "a whole number", float: "a finite number", str: "text",
               int_or_text: "a whole number or a word"}
_KIND_FIXES = {bool: "use true or false (CLI: also yes/no, on/off, 1/0)", int: "give a whole number, e.g. {example}",
               float: "give a finite number, e.g. {example}", str: "give text; in YAML quote it, e.g. \"123\"",
               int_or_text: "give a whole number, e.g. {example}, or a word the option takes"}


def _kind_fix(name: str, kind: Any, default: Any) -> str:
    example = default if isinstance(default, (int, float)) and not isinstance(default, bool) else 10
    return _KIND_FIXES[kind].format(example=f"--{name} {example}")


def _is_kind(value: Any, kind: Any) -> bool:
    if kind is bool:
        return isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind is int_or_text:
        return isinstance(value, (int, str)) and not isinstance(value, bool)
    return isinstance(value, kind)


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _check_text(name: str, value: str) -> None:
    """Text goes into file names, config.yaml and log lines: it must be UTF-8 and free of NUL characters."""
    if "\0" in value:
        raise ConfigError(f"--{name} {show(value)} contains a NUL character; remove it")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:  # bytes that are not UTF-8, e.g. a Latin-1 path decoded by Python as surrogates
        raise ConfigError(f"--{name} {show(value)} is not valid UTF-8 (config.yaml and the logs record it as "
                          "text); use a name in UTF-8") from None


def check_range(name: str, value: Any, low: float | None, high: float | None) -> None:
    """A number from ``low`` to ``high`` (inclusive; an int without ``high`` at most ``INT_MAX``), or ConfigError."""
    if value is None or not isinstance(value, (int, float)) or isinstance(value, bool):
        return
    if high is None and isinstance(value, int):
        high = INT_MAX
    if low is not None and value < low:
        bound = "> 0" if low == 1 and isinstance(value, int) else f">= {low}"
        raise ConfigError(f"--{name} must be {bound}, got {show(value)}; {_range_fix(name, low, high)}")
    if high is not None and value > high:
        raise ConfigError(f"--{name} must be <= {high}, got {show(value)}; {_range_fix(name, low, high)}")


def _range_fix(name: str, low: float | None, high: float | None) -> str:
    if name == "ddp_timeout":
        return f"give seconds between {low} and {high} (a week): longer than that is a hang, not a slow rank"
    if low is not None and high is not None:
        return f"give a value from {low} to {high}"
    return f"give a value >= {low}" if low is not None else f"give a value <= {high}"


def show(value: Any, limit: int = 60) -> str:
    """A user's value in an error line: repr (quotes, escapes), on one line, cut short."""
    try:
        text = repr(value).replace("\n", " ")
    except ValueError:  # an int too long to print (Python >= 3.10.7 limits int-to-text conversion)
        text = f"<an integer of {value.bit_length()} bits>"
    return text if len(text) <= limit else f"{text[:limit]}..."


def scalar_type(annotation: Any) -> tuple[Any, bool]:
    """(element type, is_tuple) for ``int``, ``int | None``, ``tuple[int, ...]``; ``int | str`` is ``int_or_text``."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in typing.get_args(annotation) if a is not type(None)]
        if set(inner) == {int, str}:
            return int_or_text, False
        return scalar_type(inner[0])
    if origin is tuple:
        return typing.get_args(annotation)[0], True
    return annotation, False
