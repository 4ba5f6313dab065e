"""accelerate_configs/: every launch config loads with Accelerate's own loader as documented, each key commented."""

from __future__ import annotations

import pytest
import yaml

from tests.helpers.runs import REPO


@pytest.mark.parametrize(
    "name, distributed_type, processes, mixed_precision, debug",
    [("cpu_2proc", "MULTI_GPU", 2, "no", False), ("4gpu", "MULTI_GPU", 4, "bf16", False),
     ("1gpu_debug", "NO", 1, "bf16", False)],
)
def test_launch_configs_load_with_accelerates_loader(name, distributed_type, processes, mixed_precision, debug):
    from accelerate.commands.config.config_args import load_config_from_file

    path = REPO / "accelerate_configs" / f"{name}.yaml"
    config = load_config_from_file(str(path))
    assert config.distributed_type.value == distributed_type
    assert config.num_processes == processes
    assert str(config.mixed_precision) == mixed_precision
    assert config.debug is debug
    assert config.use_cpu is False  # the script, not the config, decides CPU vs GPU
    # every key carries a comment saying what it does, on its line or just above it
    lines = path.read_text().splitlines()
    for previous, line in zip([""] + lines, lines, strict=False):
        if line and not line.startswith("#"):
            key = line.split(":")[0]
            assert "#" in line or previous.startswith("#"), f"{name}.yaml: key {key!r} has no comment"
    assert yaml.safe_load(path.read_text())["num_processes"] == processes

