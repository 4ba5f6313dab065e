"""Name lookup shared by the dataset and model registries: a built-in name or ``pkg.module:function``."""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable
from typing import Any

from accel_ddp.config import ConfigError


def resolve(name: str, table: dict[str, Callable[..., Any]], kind: str) -> Callable[..., Any]:
    """Return ``table[name]``, or import ``pkg.module:function`` for user code.

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
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ConfigError(f"--{kind} {name}: module {module_name!r} has no function {attr!r}")
    return fn
