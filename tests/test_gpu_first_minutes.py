"""benchmarks/gpu_first_minutes.sh: the prepared first run on a GPU machine fits its budget, and its dry run on the
CPU goes through every stage (the plumbing, not the GPU)."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "gpu_first_minutes.sh"


def _caps() -> dict[str, int]:
    """Each stage's cap on the GPU: `stage NAME CAP ...` lines and the correctness loop's NAME:CAP words."""
    text = SCRIPT.read_text()
    caps = {name: int(cap) for name, cap in re.findall(r"^\s*stage (\w+) (\d+) ", text, re.M)}
    loop = re.search(r"^for check in ([\w: ]+); do", text, re.M).group(1)
    caps.update({name: int(cap) for name, cap in (word.split(":") for word in loop.split())})
    return caps


def test_every_stage_has_its_own_timeout_and_together_they_fit_nine_minutes():
    caps = _caps()
    assert list(caps) == ["carry", "setup", "mfu", "tax", "chunked", "graphs", "compile_count", "sync"]
    assert sum(caps.values()) <= 9 * 60
    assert "timeout --kill-after=5 \"$cap\"" in SCRIPT.read_text()


@pytest.mark.slow
def test_the_dry_run_goes_through_every_stage_on_the_cpu(tmp_path):
    pytest.importorskip("transformers")
    done = subprocess.run(["bash", str(SCRIPT), "--dry-run"], cwd=REPO, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "OUT": str(tmp_path)})
    lines = (tmp_path / "gpu_first_minutes.txt").read_text().splitlines()
    words = [line.split()[:2] for line in lines[:-1]]
    assert words == [["PASS", "carry"], ["PASS", "setup"], ["PASS", "chunked"], ["SKIP", "graphs"],
                     ["PASS", "compile_count"], ["SKIP", "sync"], ["PASS", "mfu"], ["PASS", "tax"]], done.stdout
    assert done.returncode == 0 and lines[-1].startswith("gpu_first_minutes: done in") and "dry run" in lines[-1]
    assert json.loads((tmp_path / "compile_count.json").read_text())["graphs"] <= 3
    assert "needs a CUDA device" in json.loads((tmp_path / "graphs.json").read_text())["refusal"]
    mfu = json.loads((tmp_path / "mfu.json").read_text())["results"]
    assert [r["variant"] for r in mfu] == ["defaults", "flash_attention"] and mfu[0]["tokens_per_sec"] > 0
    assert all((tmp_path / f"{stage}.log").is_file() for stage in ("chunked", "graphs", "mfu", "tax"))
    carried = int(re.search(r"carry (\d+) MiB", lines[0]).group(1))
    assert carried <= 60
