"""accel_ddp.util.ranks: the launch's environment read in one place, the rule of each value (the rank rule itself:
tests/util/test_messages.py)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import accel_ddp
from accel_ddp.util import ranks
from accel_ddp.util.ranks import launch_machines, launch_world_size, local_world_size

PACKAGE = Path(accel_ddp.__file__).parent
# What launchers tell their workers about the launch: torchrun's, MPI's and Accelerate's names.
LAUNCH_VARS = {*ranks.RANK_VARS, *ranks.WORLD_SIZE_VARS, *ranks.LOCAL_WORLD_SIZE_VARS, *ranks.MACHINES_VARS,
               "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "NODE_RANK"}


def launch_reads(package: Path) -> list[str]:
    """``path:line NAME`` for each string constant naming a launch variable in a module of ``package`` outside
    util/ranks.py: an ``os.environ`` read (or a mapping's ``get``) that bypasses the one rule."""
    found = []
    for path in sorted(package.rglob("*.py")):
        if path.relative_to(package).as_posix() == "util/ranks.py":
            continue
        names = [node for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
                 if isinstance(node, ast.Constant) and node.value in LAUNCH_VARS]
        found += [f"{path.relative_to(package)}:{node.lineno} {node.value}"
                  for node in sorted(names, key=lambda node: node.lineno)]
    return found


def test_no_module_but_util_ranks_reads_the_launch_environment():
    assert launch_reads(PACKAGE) == []


def test_a_planted_read_of_the_launch_environment_is_found(tmp_path):
    (tmp_path / "util").mkdir()
    (tmp_path / "util" / "ranks.py").write_text('import os\nos.environ.get("WORLD_SIZE")\n')  # the one allowed
    (tmp_path / "loader.py").write_text('import os\n\nlocal = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))\n'
                                        'machines = os.environ["GROUP_WORLD_SIZE"]\n')
    assert launch_reads(tmp_path) == ["loader.py:3 LOCAL_WORLD_SIZE", "loader.py:4 GROUP_WORLD_SIZE"]


@pytest.mark.parametrize(("env", "default", "local"), [
    ({}, 1, 1), ({}, 4, 4),  # no launcher said: the caller's default (the whole world, for preflight)
    ({"LOCAL_WORLD_SIZE": "2"}, 4, 2), ({"LOCAL_WORLD_SIZE": "0"}, 4, 4), ({"LOCAL_WORLD_SIZE": "x"}, 1, 1),
])
def test_the_processes_on_this_machine_are_torchruns_local_world_size(env, default, local):
    assert local_world_size(default, env) == local


@pytest.mark.parametrize(("env", "machines"), [
    ({}, 1), ({"GROUP_WORLD_SIZE": "2"}, 2), ({"ACCELERATE_NUM_MACHINES": "3", "GROUP_WORLD_SIZE": "2"}, 3),
    ({"ACCELERATE_NUM_MACHINES": "", "GROUP_WORLD_SIZE": "2"}, 2),  # an empty value says nothing
])
def test_the_machines_are_accelerates_count_else_torchruns(env, machines):
    assert launch_machines(env) == machines


def test_each_rule_reads_the_process_environment_unless_given_one(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setenv("GROUP_WORLD_SIZE", "2")
    monkeypatch.delenv("ACCELERATE_NUM_MACHINES", raising=False)
    assert (launch_world_size(), local_world_size(), launch_machines()) == (8, 4, 2)
    assert (launch_world_size({}), local_world_size(1, {}), launch_machines({})) == (1, 1, 1)
