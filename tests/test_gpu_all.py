"""benchmarks/gpu_all.py (every GPU measurement of issue 38 in one budget, one results file) and benchmarks/env.sh's
offline install from wheelhouse/: their plumbing on this CPU machine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def _stage(name: str, code: str, cap: float = 60, floor: float = 1, **kw):
    from benchmarks.gpu_all import Stage

    cmd = [sys.executable, "-c", code, "{out}"]
    return Stage(name, cap, floor, cmd, cmd, "r.json", **kw)


WRITES = ("import json, sys; json.dump({'table_text': 'head\\n----\\nrow one\\nnote'}, "
          "open(sys.argv[1] + '/r.json', 'w'))")
FAILS = "for i in range(200): print(f'line {i}')\nraise RuntimeError('the cause')"
HANGS = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); " \
        "print('started', flush=True); time.sleep(60)"


@pytest.mark.slow
def test_each_stage_within_the_budget_into_one_results_file(tmp_path, capsys, monkeypatch):
    from benchmarks import gpu_all

    monkeypatch.setattr(gpu_all, "stages", lambda: [
        _stage("starved", WRITES, cap=30, floor=50), _stage("writes", WRITES), _stage("fails", FAILS),
        _stage("hangs", HANGS, cap=3), _stage("elsewhere", WRITES, needs="not_in_this_checkout.py")])
    started = time.perf_counter()
    code = gpu_all.main(["--dry-run", "--out", str(tmp_path), "--budget", "400"])
    assert time.perf_counter() - started < 60  # the hanging stage ended at its cap
    out = capsys.readouterr().out
    assert code == 1, out
    saved = json.loads((tmp_path / "gpu_all.json").read_text())
    status = {r["name"]: r["status"] for r in saved["stages"]}
    assert status == {"starved": "SKIP", "writes": "PASS", "fails": "FAIL", "hangs": "TIMEOUT", "elsewhere": "SKIP"}
    stages = {r["name"]: r for r in saved["stages"]}
    assert stages["writes"]["results"]["table_text"].endswith("row one\nnote")  # embedded: the one file to read
    assert "PASS    writes" in out and "row one" in out
    whole = (tmp_path / "fails" / "log.txt").read_text().splitlines()
    assert whole[:200] == [f"line {i}" for i in range(200)]  # the whole log kept
    assert "RuntimeError: the cause" in stages["fails"]["log_tail"] and "RuntimeError: the cause" in out
    assert "not in this checkout" in stages["elsewhere"]["reason"]
    assert "budget spent" in stages["starved"]["reason"] and "--only starved" in stages["starved"]["reason"]
    assert saved["dry_run"] is True and out.splitlines()[-1].startswith(
        "gpu_all: 1 passed, 1 failed, 1 out of time, 2 skipped")


def test_a_stage_gets_what_the_later_stages_floors_leave(tmp_path, capsys, monkeypatch):
    from benchmarks import gpu_all

    seen = {}
    real = gpu_all.run_stage

    def spy(stage, command, folder, limit):
        seen[stage.name] = limit
        return real(stage, command, folder, limit)

    monkeypatch.setattr(gpu_all, "run_stage", spy)
    monkeypatch.setattr(gpu_all, "stages", lambda: [_stage("first", WRITES, cap=300, floor=5),
                                                    _stage("second", WRITES, cap=300, floor=40)])
    assert gpu_all.main(["--dry-run", "--out", str(tmp_path), "--budget", "100"]) == 0
    assert 55 < seen["first"] <= 60  # 100 s less the second stage's floor
    assert 90 < seen["second"] <= 100  # the budget less what the first stage spent (not its share)


@pytest.mark.slow
def test_the_dry_run_of_the_gpu_check_stage_runs_its_real_script(tmp_path, capsys):
    from benchmarks import gpu_all

    code = gpu_all.main(["--dry-run", "--only", "gpu_check", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0, out
    [stage] = json.loads((tmp_path / "gpu_all.json").read_text())["stages"]
    assert stage["status"] == "PASS"
    assert [(r["name"], r["status"]) for r in stage["results"]["results"]] == [("doctor", "PASS"),
                                                                                ("pytest_gpu", "SKIP")]


def _ensure_installed(tmp_path: Path, missing: str, pip_rc: int, wheels: bool) -> tuple[subprocess.CompletedProcess,
                                                                                        list[str]]:
    """env.sh's ensure_installed with a stand-in interpreter: it reports ``missing`` and records its pip calls."""
    calls = tmp_path / "calls"
    fake = tmp_path / "python"
    fake.write_text(f'#!/usr/bin/env bash\nif [[ "$1" == "-c" ]]; then echo "{missing}"; exit 0; fi\n'
                    f'echo "$@" >> {calls}\nexit {pip_rc}\n')
    fake.chmod(0o755)
    house = tmp_path / "wheelhouse"
    house.mkdir(exist_ok=True)
    if wheels:
        (house / "datasets-5.2.0-py3-none-any.whl").touch()
    env = {**os.environ, "PYTHON": str(fake), "WHEELHOUSE": str(house)}
    done = subprocess.run(["bash", "-c", f"source {REPO}/benchmarks/env.sh && ensure_installed test"],
                          env=env, capture_output=True, text=True, timeout=60)
    return done, calls.read_text().splitlines() if calls.exists() else []


def test_what_is_missing_is_installed_from_the_wheelhouse_with_no_network(tmp_path):
    done, calls = _ensure_installed(tmp_path, "datasets pexpect", pip_rc=0, wheels=True)
    assert done.returncode == 0, done.stderr
    assert calls == [f"-m pip install -q --no-index --find-links {tmp_path / 'wheelhouse'} datasets pexpect"]
    assert "no network" in done.stderr


def test_a_wheelhouse_without_the_wheel_fails_naming_the_script_that_fills_it(tmp_path):
    done, calls = _ensure_installed(tmp_path, "pexpect", pip_rc=1, wheels=True)
    assert done.returncode == 1 and len(calls) == 1 and "--no-index" in calls[0]
    assert "bash benchmarks/wheelhouse.sh pexpect" in done.stderr


def test_nothing_missing_installs_nothing_and_no_wheelhouse_uses_the_index(tmp_path):
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    done, calls = _ensure_installed(tmp_path / "a", "", pip_rc=0, wheels=True)
    assert done.returncode == 0 and calls == []
    done, calls = _ensure_installed(tmp_path / "b", "datasets", pip_rc=0, wheels=False)
    assert done.returncode == 0 and calls == [f"-m pip install -q -e {REPO}[test]"]
