"""benchmarks/gpu_check.py, the prepared GPU readiness check, runs its plumbing on this CPU machine."""

from __future__ import annotations

import json

import pytest


@pytest.mark.slow
def test_gpu_check_dry_run_reports_one_line_per_check_and_a_results_file(tmp_path, capsys):
    """Two real checks (the doctor, the one-rank group probe) on the CPU; the GPU-only ones skip with a reason.

    The script's ``main`` runs here (the test process has torch loaded); its checks start their processes.
    """
    from benchmarks import gpu_check

    code = gpu_check.main(["--dry-run", "--out", str(tmp_path),
                           "--only", "doctor,nccl_one_rank,gpu_guard,fsdp2_one_rank,nccl_two_ranks"])
    out, err = capsys.readouterr()
    assert code == 0, out + err
    lines = out.splitlines()
    assert lines[0].startswith("gpu_check: dry run on the CPU (plumbing only")
    status = {line.split()[1]: line.split()[0] for line in lines[1:-1]}
    assert status == {"doctor": "PASS", "nccl_one_rank": "PASS", "gpu_guard": "SKIP", "fsdp2_one_rank": "SKIP",
                      "nccl_two_ranks": "SKIP"}
    assert "flag all-reduce" in next(line for line in lines if "nccl_one_rank" in line)
    assert "needs two GPUs" in next(line for line in lines if "nccl_two_ranks" in line)
    assert lines[-1].startswith("gpu_check: 2 passed, 0 failed, 3 skipped")
    saved = json.loads((tmp_path / "gpu_check.json").read_text())
    assert saved["dry_run"] is True and [r["name"] for r in saved["results"]][:2] == ["doctor", "nccl_one_rank"]
    assert (tmp_path / "gpu_check.txt").read_text().splitlines() == lines[1:]
    assert (tmp_path / "nccl_one_rank" / "probe.log").is_file()
