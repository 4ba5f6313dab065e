"""Issue 40: the README's set-up is one user install and one test command; the user install pulls no test, cloud,
tracker or vision package, and the README says how to get CPU-only torch; torchvision missing is one line."""

from __future__ import annotations

import configparser
import re
import sys

import pytest

from tests.helpers.runs import REPO

MAIN_RUN_NEEDS = {"torch", "accelerate", "datasets", "scikit-learn", "safetensors", "tqdm", "pyyaml", "matplotlib"}


def _names(block: str) -> set[str]:
    return {re.split(r"[<>=\[ ]", line.strip())[0].lower() for line in block.splitlines() if line.strip()}


def test_the_user_install_is_what_the_main_run_needs():
    setup = configparser.ConfigParser()
    setup.read(REPO / "setup.cfg")
    assert _names(setup["options"]["install_requires"]) == MAIN_RUN_NEEDS
    extras = setup["options.extras_require"]
    assert "torchvision" in _names(extras["vision"]) and "torchvision" in _names(extras["test"])


def test_the_readme_has_one_install_and_one_test_command_and_the_cpu_torch_line():
    readme = (REPO / "README.md").read_text()
    install = readme[readme.index("## Install"):readme.index("## The main run")]
    assert "pip install torch --index-url https://download.pytorch.org/whl/cpu" in install
    commands = re.findall(r"```bash\n(.*?)```", install, flags=re.S)
    assert commands == ["git clone <this repo> accel_ddp && cd accel_ddp && pip install -e .\n"]
    tests = readme[readme.index("## Tests"):]
    assert re.findall(r"```bash\n(.*?)```", tests, flags=re.S)[0] == 'pip install -e ".[test]" && python -m pytest -q\n'


def test_without_torchvision_its_features_say_how_to_install_it(monkeypatch, tmp_path):
    from accel_ddp.data.builtin import build_imagefolder
    from accel_ddp.util.validation import ConfigError

    monkeypatch.setitem(sys.modules, "torchvision", None)  # as if not installed: its import raises ImportError
    with pytest.raises(ConfigError, match=r"^--dataset imagefolder needs the torchvision package, which is not "
                                          r"installed; pip install 'accel_ddp\[vision\]'"):
        build_imagefolder(str(tmp_path), download=False)
