"""What setup.cfg promises about the package holds."""

from __future__ import annotations

import configparser
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
