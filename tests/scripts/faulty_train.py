"""train.py with the faults of tests/helpers/faults.py injected from FAULT_* environment variables."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tests.helpers import faults  # noqa: E402

faults.install_from_env()

from accel_ddp.cli.train import run  # noqa: E402

run(sys.argv[1:])
