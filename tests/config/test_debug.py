"""accel_ddp/config/debug.py: what --debug switches on is decided in one place, and only there is the flag read."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import accel_ddp.config.debug as debug
from accel_ddp.config import DEBUG_MAX_STEPS, TrainConfig
from accel_ddp.config.debug import DEBUG_OFF, DEBUG_ON, DebugMode, debug_mode
from accel_ddp.config.plan import plan_run

ROOT = Path(debug.__file__).resolve().parent.parent
# `accel-ddp launch --debug` is the launcher's own switch (its log), not TrainConfig's.
OTHER_DEBUG_FLAGS = {"cli/launch.py args.debug"}


def test_debug_switches_every_behaviour_on_and_none_without_it():
    assert debug_mode(TrainConfig(debug=True)) is DEBUG_ON and debug_mode(TrainConfig()) is DEBUG_OFF
    for field in dataclasses.fields(DebugMode):
        assert getattr(DEBUG_ON, field.name), field.name
        assert not getattr(DEBUG_OFF, field.name), field.name
    assert DEBUG_ON.max_steps == DEBUG_ON.train_batches == DEBUG_MAX_STEPS
    assert (DEBUG_ON.workers(8), DEBUG_OFF.workers(8)) == (0, 8)


def test_the_start_up_line_is_made_from_the_switches():
    assert DEBUG_ON.changes() == ("0 DataLoader workers; anomaly detection, deterministic kernels, Accelerate's "
                                  "cross-rank shape checks, every micro-step's loss checked")
    assert DebugMode(detect_anomaly=True).changes() == "anomaly detection"
    assert DEBUG_OFF.changes() == ""


def test_the_plan_cuts_the_steps_where_the_switchboard_says(monkeypatch):
    """plan.py asks the switchboard, not the flag: a board that cuts at 3 steps cuts the run at 3."""
    cfg = TrainConfig(debug=True, epochs=5)
    plan = plan_run(cfg, 100, 16, 1, evaluates=False, auto_batch=None)
    assert plan.total_steps == DEBUG_MAX_STEPS
    monkeypatch.setattr(debug, "DEBUG_ON", dataclasses.replace(DEBUG_ON, max_steps=3))
    assert plan_run(cfg, 100, 16, 1, evaluates=False, auto_batch=None).total_steps == 3
    assert plan_run(TrainConfig(epochs=5), 100, 16, 1, evaluates=False, auto_batch=None).total_steps == 500


def _debug_reads(root: Path = ROOT) -> set[str]:
    """``x.debug`` read anywhere in the package but config/debug.py: "path text"."""
    found = set()
    for path in root.rglob("*.py"):
        if path.relative_to(root).as_posix() == "config/debug.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Attribute) and node.attr == "debug" and isinstance(node.ctx, ast.Load):
                found.add(f"{path.relative_to(root).as_posix()} {ast.unparse(node)}")
    return found


def test_only_the_switchboard_reads_the_debug_flag(tmp_path):
    """Every other module reads a behaviour of ``debug_mode(cfg)``; proven on a planted ``if cfg.debug``."""
    assert _debug_reads() == OTHER_DEBUG_FLAGS
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "planted.py").write_text("def f(cfg):\n    return 0 if cfg.debug else 2\n")
    assert _debug_reads(tmp_path) == {"data/planted.py cfg.debug"}
