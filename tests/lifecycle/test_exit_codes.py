"""accel_ddp.lifecycle.exit_codes: one list of exit codes (``ExitCode``), written as a number nowhere else."""

from __future__ import annotations

import ast
import json
import signal
from pathlib import Path

import accel_ddp
from accel_ddp.lifecycle.exit_codes import EXIT_CODES_DIR, ExitCode, killed_by, record, recorded

PACKAGE = Path(accel_ddp.__file__).parent
# What exits, or carries the code it exits with: sys.exit, os._exit, SystemExit, preemption.exit_process, failure's
# report/claim/_leave_now, exit_codes.record.
EXIT_CALLS = {"exit", "_exit", "SystemExit", "exit_process", "_leave_now", "report", "claim", "record"}
CODE_NAMES = {"code", "exit_code"}  # a variable (or a record's key) that holds an exit code


def _names_a_code(node: ast.expr) -> bool:
    if isinstance(node, ast.Name | ast.Attribute):
        return (node.id if isinstance(node, ast.Name) else node.attr) in CODE_NAMES
    return isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) and node.slice.value in CODE_NAMES


def _numbers(node: ast.expr | None) -> list[ast.Constant]:
    """The int literals ``node`` is, or picks between (``0 if ok else 1``)."""
    if isinstance(node, ast.IfExp):
        return _numbers(node.body) + _numbers(node.orelse)
    return [node] if isinstance(node, ast.Constant) and type(node.value) is int else []


def _code_returns(path: Path, package: Path) -> bool:
    """Do this module's ``-> int`` functions return exit codes? The commands (cli/) and the failure path."""
    where = path.relative_to(package).as_posix()
    return where.startswith("cli/") or where == "lifecycle/failure.py"


def raw_exit_codes(package: Path) -> list[str]:
    """``path:line N`` for each exit code written as a number in ``package``: passed to what exits, returned by a
    command, assigned to or compared with a ``code``."""
    found = []
    for path in sorted(package.rglob("*.py")):
        numbers: list[ast.Constant] = []
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call):
                func = node.func
                name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
                if name in EXIT_CALLS:
                    numbers += [n for arg in node.args for n in _numbers(arg)]
            elif isinstance(node, ast.FunctionDef) and _code_returns(path, package) and \
                    isinstance(node.returns, ast.Name) and node.returns.id == "int":
                numbers += [n for ret in ast.walk(node) if isinstance(ret, ast.Return) for n in _numbers(ret.value)]
            elif isinstance(node, ast.Assign) and any(_names_a_code(target) for target in node.targets):
                numbers += _numbers(node.value)
            elif isinstance(node, ast.Compare) and isinstance(node.ops[0], ast.Eq | ast.NotEq) and \
                    any(_names_a_code(side) for side in (node.left, *node.comparators)):
                numbers += [n for side in (node.left, *node.comparators) for n in _numbers(side)]
        found += [f"{path.relative_to(package)}:{n.lineno} {n.value}" for n in sorted(numbers, key=lambda n: n.lineno)]
    return found


def test_no_exit_code_is_written_as_a_number():
    assert raw_exit_codes(PACKAGE) == []


def test_a_planted_exit_code_written_as_a_number_is_found(tmp_path):
    (tmp_path / "cli").mkdir()
    (tmp_path / "cli" / "main.py").write_text(
        "import os, sys\n\n\ndef main() -> int:\n    return 0 if ok() else 1\n\n\n"
        "def run():\n    code = 2\n    if code == 75:\n        os._exit(124)\n    sys.exit(ExitCode.OK)\n")
    (tmp_path / "other.py").write_text("def size() -> int:\n    return 3\n")  # not a command: a number
    assert raw_exit_codes(tmp_path) == ["cli/main.py:5 0", "cli/main.py:5 1", "cli/main.py:9 2", "cli/main.py:10 75",
                                        "cli/main.py:11 124"]


def test_the_codes_mean_what_the_docs_say():
    assert [(c.name, int(c)) for c in ExitCode] == [
        ("OK", 0), ("FAILED", 1), ("BAD_INPUT", 2), ("NON_FINITE", 3), ("PREEMPTED", 75), ("HUNG", 124),
        ("HANGUP", 129), ("INTERRUPTED", 130)]
    assert killed_by(signal.SIGKILL) == 137 and killed_by(signal.SIGINT) == ExitCode.INTERRUPTED


def test_a_code_is_written_as_its_number(tmp_path, monkeypatch):
    """In the rank's file for accel-ddp launch, in JSON (the failure's claim) and in a line, whatever the Python."""
    monkeypatch.setenv(EXIT_CODES_DIR, str(tmp_path))
    monkeypatch.setenv("RANK", "1")
    record(ExitCode.PREEMPTED)
    assert (tmp_path / "1").read_text() == "75" and recorded(str(tmp_path)) == {1: 75}
    assert json.dumps({"code": ExitCode.BAD_INPUT}) == '{"code": 2}'
    assert f"exit code {ExitCode.HUNG}" == "exit code 124" and str(ExitCode.NON_FINITE) == "3"
