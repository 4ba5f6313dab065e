"""The GPU tests get the machine's GPUs under the suite's own command: every pytest-xdist worker sees what the
machine offered (``tests.helpers.env.OFFERED_GPUS``), though the controller hid the GPUs before starting it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.helpers.env import OFFERED_VARIABLE
from tests.helpers.runs import REPO, suite_env

PROBE = '''
import json, os
from pathlib import Path

from tests.helpers.env import OFFERED_GPUS
from tests.helpers.runs import gpu_env


def test_probe():
    worker = os.environ.get("PYTEST_XDIST_WORKER", "controller")
    seen = {"offered": OFFERED_GPUS, "visible": os.environ["CUDA_VISIBLE_DEVICES"], "gpu_env": gpu_env()}
    Path(__file__).with_name(f"seen-{worker}.json").write_text(json.dumps(seen))
'''


@pytest.mark.slow  # a fresh pytest starting its xdist workers is the behaviour
def test_every_xdist_worker_sees_the_gpus_the_machine_offered(tmp_path):
    """A pytest run of two xdist workers, started with a made-up ``CUDA_VISIBLE_DEVICES``: its conftest imports
    tests.helpers.env first, as tests/conftest.py does, in the controller before the workers start. Each worker
    still hides the GPUs from its own tests and forked ranks, and hands the offered ones to ``gpu_env()``."""
    (tmp_path / "conftest.py").write_text("import tests.helpers.env  # noqa: F401\n")
    (tmp_path / "test_probe.py").write_text(PROBE)
    env = suite_env({"CUDA_VISIBLE_DEVICES": "7,3", OFFERED_VARIABLE: None})  # as a GPU machine starts pytest
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2",
                             "--dist", "each", "--rootdir", str(tmp_path), "-c", "/dev/null", str(tmp_path)],
                            env=env, cwd=REPO, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr
    seen = {path.stem: json.loads(path.read_text()) for path in tmp_path.glob("seen-*.json")}
    assert set(seen) == {"seen-gw0", "seen-gw1"}, seen
    for worker in seen.values():
        assert worker == {"offered": "7,3", "visible": "", "gpu_env": {"CUDA_VISIBLE_DEVICES": "7,3"}}
