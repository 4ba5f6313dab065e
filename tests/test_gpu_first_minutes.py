"""benchmarks/gpu_first_minutes.sh, the one GPU entry: its stages and groups, each stage under its own timeout within
one budget (checked with a stand-in interpreter), benchmarks/env.sh's offline install, and one dry run on the CPU
through the stages the suite needs (the plumbing, not the GPU)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.multiproc import run_ranks

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "gpu_first_minutes.sh"
FIRST = ["carry", "setup", "chunked", "graphs", "compile_count", "sync", "mfu", "tax"]


def _listed() -> dict[str, tuple[int, list[str]]]:
    """`--list`: each stage's cap on the GPU and its groups, in the order they run."""
    done = subprocess.run(["bash", str(SCRIPT), "--list"], capture_output=True, text=True, timeout=60, check=True)
    stages = {}
    for row in done.stdout.splitlines():
        name, cap, groups = (row.split() + [""])[:3]
        stages[name] = (int(cap), [g for g in groups.split(",") if g])
    return stages


def test_every_stage_has_a_cap_and_a_group_and_the_default_budget_fits_eight_minutes():
    stages = _listed()
    assert [name for name, (_, groups) in stages.items() if "first" in groups] == FIRST
    assert sum(stages[name][0] for name in FIRST) <= 9 * 60  # the first group's caps; the budget cuts them to 470
    assert all(cap > 0 and groups for cap, groups in stages.values()), stages
    # what each of the five folded drivers did is a stage: gpu_check.sh's checks, gpu_all's measurements, gpu.sh's
    for name in ("doctor", "resume_bitwise", "nccl_one_rank", "fsdp2_one_rank", "auto_batch_oom", "pytest_gpu",
                 "tax_full", "ops_per_step", "peers", "compare", "tta"):
        assert name in stages
    text = SCRIPT.read_text()
    assert "BUDGET=$((${BUDGET:-470} * CAP_SCALE))" in text and 'timeout --kill-after=5 "$share"' in text
    for old in ("gpu.sh", "gpu_all.sh", "gpu_all.py", "gpu_check.sh", "gpu_probe.py"):
        assert not (REPO / "benchmarks" / old).exists()


def test_an_unknown_stage_is_refused_naming_the_groups(tmp_path):
    done = subprocess.run(["bash", str(SCRIPT), "--only", "first,nope"], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "OUT": str(tmp_path)})
    assert done.returncode == 2 and "unknown stage or group 'nope'" in done.stderr and "first" in done.stderr


# A stand-in interpreter for four stages (the rest goes to this Python): one hangs with a child, one reports the
# seconds it was given and writes results, one fails after 200 lines. compile_count's pattern is the script's whole
# line for the four gpu_first_checks stages (the dry run below runs their main with these arguments, forked).
STAND_IN = """#!/usr/bin/env bash
case "$*" in
  *"gpu_first_checks graphs"*) sleep 60 & echo $! > "$OUT/child.pid"; sleep 60 ;;
  *"-m benchmarks.gpu_first_checks compile_count --dry-run --out $OUT")
    echo '{"table_text": "head\\n----\\nrow one\\nnote"}' > "$OUT/compile_count.json"
    echo "PASS compile_count given $STAGE_SECONDS" ;;
  *"gpu_first_checks sync"*) for i in $(seq 0 199); do echo "line $i"; done; echo "RuntimeError: the cause"; exit 1 ;;
  *) exec "%s" "$@" ;;
esac
"""


def _sleeping(pid: int) -> bool:
    """The stand-in's `sleep` still runs: its pid holds a `sleep` that is not a zombie (here the init process reaps
    orphans late, and a killed child can stay a zombie a while)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        command = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return state != "Z" and command.startswith(b"sleep")


@pytest.mark.slow  # a real bash running the stages, a 3 s hang
def test_each_stage_within_its_share_of_the_budget_into_one_results_file(tmp_path):
    """BUDGET 80 s: chunked's cap (300) leaves less than its floor once the later stages' are kept: SKIP; graphs hangs
    and is killed at its 3 s cap with its child; compile_count gets the budget less sync's floor, below its cap;
    sync fails, its whole log kept and its end shown."""
    fake = tmp_path / "python"
    fake.write_text(STAND_IN % sys.executable)
    fake.chmod(0o755)
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "PYTHON": str(fake), "BUDGET": "80", "CAP_SCALE": "1",  # caps as given
           "CAPS": "chunked=300 graphs=3 compile_count=80 sync=30"}
    started = time.perf_counter()
    done = subprocess.run(["bash", str(SCRIPT), "--dry-run", "--only", "chunked,graphs,compile_count,sync"], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=120)
    assert time.perf_counter() - started < 60, done.stdout  # the hang ended at its cap
    assert done.returncode == 1, done.stdout + done.stderr
    lines = (out / "gpu_first_minutes.txt").read_text().splitlines()
    assert [line.split()[:2] for line in lines[:-1]] == [["SKIP", "chunked"], ["FAIL", "graphs"],
                                                          ["PASS", "compile_count"], ["FAIL", "sync"]], lines
    assert "budget spent" in lines[0] and "--only chunked" in lines[0]
    assert "graphs timed out after 3s" in lines[1]
    assert not _sleeping(int((out / "child.pid").read_text()))  # the stage's child went with it
    given = int(re.search(r"given (\d+)", lines[2]).group(1))
    assert 80 / 3 <= given <= 80 - 30 // 3 - 3  # under its cap: the budget less graphs' 3 s and sync's floor
    assert (out / "sync.log").read_text().splitlines()[:200] == [f"line {i}" for i in range(200)]  # kept whole
    assert "RuntimeError: the cause" in done.stdout  # the failed stage's end, on the console
    assert lines[-1].startswith("gpu_first_minutes: done in") and "1 passed, 2 failed, 1 skipped" in lines[-1]
    saved = json.loads((out / "gpu_first_minutes.json").read_text())
    stages = {s["name"]: s for s in saved["stages"]}
    assert [s["status"] for s in saved["stages"]] == ["SKIP", "FAIL", "PASS", "FAIL"] and stages["graphs"]["timed_out"]
    assert stages["compile_count"]["results"]["table_text"].endswith("row one\nnote")  # embedded: the one file
    assert stages["compile_count"]["share"] == given and "RuntimeError: the cause" in stages["sync"]["log_tail"]
    assert saved["dry_run"] is True and saved["budget_sec"] == 80 and saved["machine"]["torch"]


def _ensure_installed(tmp_path: Path, missing: str, pip_rc: int, wheels: bool) -> tuple[subprocess.CompletedProcess,
                                                                                        list[str]]:
    """env.sh's ensure_installed (the setup stage's, on the GPU machine) with a stand-in interpreter: it reports
    ``missing`` and records its pip calls."""
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


# The one dry run of the suite: the first group, and the paths stages that were test_gpu_check's and test_gpu_all's
# (the doctor, the one-rank group probe, the GPU-only ones skipping with their reason), each stage once. The first
# group's four in-process stages share one line of the script (`$PY -m benchmarks.gpu_first_checks NAME --dry-run
# --out $OUT`): the stand-in above matches that whole line; the dry run's `collect` (and nccl_one_rank's probe)
# start that module in a fresh interpreter; and chunked, graphs, compile_count and sync run its main with those
# arguments in processes forked from the test's (below), not four more interpreters importing torch and Transformers.
FORKED = ["chunked", "graphs", "compile_count", "sync"]
DRY = ["carry", "setup", "mfu", "tax", "doctor", "nccl_one_rank", "gpu_guard", "fsdp2_one_rank", "nccl_two_ranks",
       "pytest_gpu", "peers"]


@pytest.mark.slow
def test_the_dry_run_goes_through_every_stage_on_the_cpu(tmp_path):
    pytest.importorskip("transformers")
    assert [name for name in FIRST if name not in DRY] == FORKED  # the rest of the first group, run below
    done = subprocess.run(["bash", str(SCRIPT), "--dry-run", "--only", ",".join(DRY)], cwd=REPO, capture_output=True,
                          text=True, timeout=900, env={**os.environ, "OUT": str(tmp_path)})
    lines = (tmp_path / "gpu_first_minutes.txt").read_text().splitlines()
    words = [line.split()[:2] for line in lines[:-1]]
    assert words == [["PASS", "carry"], ["PASS", "setup"], ["PASS", "mfu"], ["PASS", "tax"], ["PASS", "doctor"],
                     ["PASS", "nccl_one_rank"], ["SKIP", "gpu_guard"], ["SKIP", "fsdp2_one_rank"],
                     ["SKIP", "nccl_two_ranks"], ["SKIP", "pytest_gpu"], ["SKIP", "peers"]], done.stdout
    assert done.returncode == 0 and lines[-1].startswith("gpu_first_minutes: done in") and "dry run" in lines[-1]
    assert "6 passed, 0 failed, 5 skipped" in lines[-1]
    # the first group's speed stages
    mfu = json.loads((tmp_path / "mfu.json").read_text())["results"]
    assert [r["variant"] for r in mfu] == ["defaults", "flash_attention"] and mfu[0]["tokens_per_sec"] > 0
    assert all((tmp_path / f"{stage}.log").is_file() for stage in ("mfu", "tax"))
    carried = int(re.search(r"carry (\d+) MiB", lines[0]).group(1))
    assert carried <= 60
    # the GPU paths (benchmarks/gpu_check.py): one line and one JSON per check, the launches' logs beside them
    by_name = {line.split()[1]: line for line in lines[:-1]}
    assert "flag all-reduce" in by_name["nccl_one_rank"] and "needs two GPUs" in by_name["nccl_two_ranks"]
    assert "needs a GPU" in by_name["gpu_guard"] and "needs a GPU" in by_name["pytest_gpu"]
    assert "plumbing only: ready" in by_name["doctor"]
    assert (tmp_path / "doctor.log").read_text().startswith("gpu_check: dry run on the CPU (plumbing only")
    assert (tmp_path / "nccl_one_rank" / "probe.log").is_file()
    checked = json.loads((tmp_path / "nccl_one_rank.json").read_text())
    assert checked["dry_run"] is True and checked["status"] == "PASS" and checked["machine"]["gpus"] == 0
    # the one results file: every stage, the results each script wrote embedded
    saved = json.loads((tmp_path / "gpu_first_minutes.json").read_text())
    assert [s["name"] for s in saved["stages"]] == [w[1] for w in words] and saved["dry_run"] is True
    stages = {s["name"]: s for s in saved["stages"]}
    assert stages["tax"]["results"]["table_text"] and stages["doctor"]["results"]["status"] == "PASS"


def _dry_stage(name: str, out: str) -> int:
    """A forked process's ``python -m benchmarks.gpu_first_checks NAME --dry-run --out OUT``: dynamo's counters start
    at zero, as in a fresh interpreter (compile_count reads them)."""
    from torch._dynamo.utils import counters

    from benchmarks import gpu_first_checks

    counters.clear()
    return gpu_first_checks.main([name, "--dry-run", "--out", out])


@pytest.mark.slow
def test_the_first_groups_in_process_stages_dry_run_as_the_script_runs_them(tmp_path, capfd):
    """chunked, graphs, compile_count and sync through the script's own line (see FORKED): exit code, line and
    results file."""
    pytest.importorskip("transformers")
    from transformers import GPT2Config, GPT2LMHeadModel  # noqa: F401 - the model's modules once, not per fork

    from benchmarks import gpu_first_checks  # noqa: F401

    codes = [run_ranks(lambda name=name: _dry_stage(name, str(tmp_path)), world_size=1, timeout=300)[0]
             for name in FORKED]
    assert codes == [0, 0, 0, 0]
    lines = [line for line in capfd.readouterr().out.splitlines() if re.match(r"(PASS|FAIL|SKIP) ", line)]
    assert [line.split()[:2] for line in lines] == [["PASS", "chunked"], ["SKIP", "graphs"], ["PASS", "compile_count"],
                                                    ["SKIP", "sync"]]
    chunked = json.loads((tmp_path / "chunked.json").read_text())
    assert chunked["loss_rel_error"] < 1e-2 and chunked["stage"] == "chunked" and chunked["dry_run"] is True
    assert json.loads((tmp_path / "compile_count.json").read_text())["graphs"] <= 3
    assert "needs a CUDA device" in json.loads((tmp_path / "graphs.json").read_text())["refusal"]
    synced = json.loads((tmp_path / "sync.json").read_text())
    assert synced["steps"] == 10 and synced["dry_run"] is True and "without the sync debug mode" in synced["skipped"]
