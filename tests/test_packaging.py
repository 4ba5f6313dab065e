"""The bytecode the suite's interpreters load the package from (setup.cfg's python_requires: vermin, in .ci/run)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from tests.helpers.runs import REPO


def test_every_interpreter_the_suite_starts_finds_the_packages_bytecode_current():
    """tests/helpers/env.py compiles accel_ddp before the suite starts launches: with PYTHONDONTWRITEBYTECODE set
    (this project's machines), no import writes bytecode and each launched worker would compile the package again.
    Each module's .pyc is where the import system looks and was made from the source as it is now (the timestamp
    header: source mtime and size)."""
    stale = []
    for source in sorted((REPO / "accel_ddp").rglob("*.py")):
        cached = Path(importlib.util.cache_from_source(str(source)))
        header = cached.read_bytes()[:16] if cached.is_file() else b""
        stat = source.stat()
        expected = (int(stat.st_mtime) & 0xFFFFFFFF, stat.st_size & 0xFFFFFFFF)
        if len(header) < 16 or (int.from_bytes(header[8:12], "little"), int.from_bytes(header[12:16], "little")) \
                != expected:
            stale.append(str(source.relative_to(REPO)))
    assert not stale, f"no current bytecode for {len(stale)} modules, e.g. {stale[:3]}"
