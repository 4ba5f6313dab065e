"""What setup.cfg promises about the package holds, and the bytecode the suite's interpreters load it from."""

from __future__ import annotations

import configparser
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

from tests.helpers.runs import REPO


def test_python_requires_is_what_the_code_needs():
    """vermin (the test extra) computes the minimum Python from the syntax, modules and members the code uses.

    setup.cfg's ``python_requires`` must not promise an older Python than that: a missing function
    on an older Python fails only at the line that uses it (``hashlib.file_digest``, 3.11+, failed
    the first checkpoint save on 3.10, with the other ranks left waiting in a barrier).
    """
    setup = configparser.ConfigParser()
    setup.read(REPO / "setup.cfg")
    claim = re.fullmatch(r">=\s*(3\.\d+)", setup["options"]["python_requires"].strip())
    assert claim, "python_requires should read '>=3.N'"
    vermin = Path(sys.executable).with_name("vermin")  # the console script of this environment
    result = subprocess.run([str(vermin), "--no-tips", "--violations", f"-t={claim.group(1)}-", "accel_ddp",
                             "train.py"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, f"the code needs a newer Python than python_requires says:\n{result.stdout}"


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
