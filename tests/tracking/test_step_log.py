"""One place ends the progress bar, ``tracking/meters.end_progress``: at the loop's end (``StepLog.close``) and, on
any other exit, first in the teardown (``assemble._watches``). Nothing else closes it: a new exit path cannot end it
its own way or leave an error on its line."""

from __future__ import annotations

import ast
from pathlib import Path

import accel_ddp

ROOT = Path(accel_ddp.__file__).resolve().parent
CLOSERS = {"tracking/meters.py bar.close"}


def _bar_closes(root: Path = ROOT) -> set[str]:
    """Every ``<...>bar.close`` in the package, called or handed on (the teardown's callback): "path text"."""
    found = set()
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Attribute) and node.attr == "close" and ast.unparse(node.value).endswith("bar"):
                found.add(f"{path.relative_to(root).as_posix()} {ast.unparse(node)}")
    return found


def test_only_end_progress_closes_the_bar(tmp_path):
    assert _bar_closes() == CLOSERS
    (tmp_path / "planted.py").write_text("def stop(run):\n    run.bar.close()\n")
    assert _bar_closes(tmp_path) == {"planted.py run.bar.close"}
