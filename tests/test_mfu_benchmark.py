"""benchmarks/mfu.py runs its plumbing on the CPU (--dry-run): a tiny GPT-2 per variant, a results file."""

from __future__ import annotations

import json
import math

import pytest

pytest.importorskip("transformers")


@pytest.mark.slow
def test_mfu_dry_run_trains_each_variant_in_its_own_process_and_writes_the_results_file(tmp_path, capsys):
    from benchmarks import mfu

    out = tmp_path / "mfu.json"
    assert mfu.main(["--dry-run", "--variants", "defaults,chunked_loss", "--out", str(out)]) == 0
    saved = json.loads(out.read_text())
    assert saved["dry_run"] is True and saved["steps"] == 3
    assert [r["variant"] for r in saved["results"]] == ["defaults", "chunked_loss"]
    for result in saved["results"]:
        assert "error" not in result, result
        assert result["tokens_per_step"] == 4 * 32 and result["tokens_per_sec"] > 0 and result["step_time_p50_ms"] > 0
        assert math.isfinite(result["final_loss"]) and result["startup_phases_sec"]["first_step"] >= 0
        assert result["mfu"] is None and result["peak_memory_gib"] is None  # no GPU: no peak to divide by
    # The same weights and data: the chunked loss trains the same first steps within float rounding.
    assert saved["results"][1]["final_loss"] == pytest.approx(saved["results"][0]["final_loss"], rel=1e-4)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("defaults ") and "/ defaults 1.000" in lines[0] and lines[-1] == f"wrote {out}"
