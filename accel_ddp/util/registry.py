"""Name lookup shared by the dataset and model registries: a built-in name or ``pkg.module:function``.

A user's function is checked before it runs: it must import (a syntax error in it is one line, not a
traceback), be callable, and accept the keyword arguments it will be called with.
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from collections.abc import Callable
from typing import Any

from accel_ddp.util.messages import first_line
from accel_ddp.util.validation import ConfigError


def resolve(name: str, table: dict[str, Callable[..., Any]], kind: str, call_with: tuple[str, ...] = (),
            expected: str = "") -> Callable[..., Any]:
    """Return ``table[name]``, or import ``pkg.module:function`` for user code.

    ``call_with`` names the keyword arguments a user's function will get, ``expected`` shows the signature
    it should have (for the error line).

        >>> resolve("os.path:join", {}, kind="model")  # doctest: +ELLIPSIS
        <function join at ...>
    """
    if name in table:
        return table[name]
    if ":" not in name:
        raise ConfigError(
            f"unknown {kind} {name!r}; choose one of {', '.join(sorted(table))} or give 'pkg.module:function'"
        )
    module_name, _, attr = name.partition(":")
    # `accelerate launch train.py` puts the script's folder on sys.path, not the working directory
    # where a user's own module usually lives.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ConfigError(
            f"--{kind} {name}: cannot import module {module_name!r} ({err}); "
            "check the name and that it is on PYTHONPATH"
        ) from None
    except SyntaxError as err:
        raise ConfigError(f"--{kind} {name}: module {module_name!r} has a syntax error ({err.msg}, "
                          f"{err.filename} line {err.lineno}); fix the module") from None
    except Exception as err:  # noqa: BLE001 - the user's module raised while being imported
        raise ConfigError(f"--{kind} {name}: importing module {module_name!r} raised {type(err).__name__}: "
                          f"{first_line(err, 200)}; fix the module") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ConfigError(f"--{kind} {name}: module {module_name!r} has no function {attr!r}")
    _check_signature(fn, name, kind, call_with, expected)
    return fn


def describe(fn: Callable[..., Any]) -> str:
    """How an error line names a user's function: ``pkg.module:function`` (as ``--loss`` takes it), or its class.

        >>> describe(os.path.join)
        'posixpath:join'
    """
    qualname, module = getattr(fn, "__qualname__", None), getattr(fn, "__module__", None)
    if qualname is None or module is None:  # an object with __call__, e.g. a Transformers data collator
        return f"{type(fn).__name__} object"
    return f"{module}:{qualname}"


def _check_signature(fn: Callable[..., Any], name: str, kind: str, call_with: tuple[str, ...], expected: str) -> None:
    if not call_with:
        return
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # some builtins have no signature to inspect: let the call decide
        return
    try:
        signature.bind(**dict.fromkeys(call_with))
    except TypeError as err:
        raise ConfigError(f"--{kind} {name} cannot be called as a {kind} builder ({err}); expected "
                          f"{expected or 'a function taking ' + ', '.join(call_with)}") from None
