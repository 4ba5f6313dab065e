"""Issue 40: ``accel-ddp summary`` fits 100 columns; a long value (``startup_phases_sec``) wraps under itself."""

from __future__ import annotations

import json

from accel_ddp.tracking.report import COLUMNS, format_summary


def test_the_summary_fits_100_columns_and_keeps_every_phase(tmp_path):
    phases = {"imports": 3.612, "process_group": 0.412, "data": 0.213, "model": 0.051, "loaders": 0.004,
              "optimizer_and_prepare": 0.034, "resume_and_config": 0.021, "trackers": 0.0, "first_step": 1.25}
    (tmp_path / "summary.json").write_text(json.dumps({"world_size": 2, "eval_accuracy": 0.98,
                                                       "startup_phases_sec": phases}))
    text = format_summary(str(tmp_path))
    assert max(len(line) for line in text.splitlines()[1:]) <= COLUMNS == 100, text  # the first line: the path
    rows = [line for line in text.splitlines() if line.startswith("startup_phases_sec")]
    assert len(rows) == 1
    start = text.index("startup_phases_sec")
    joined = " ".join(part.strip() for part in text[start + len("startup_phases_sec"):].split("\n")[:3])
    assert all(f"{name} {sec:g}" in joined for name, sec in phases.items()), joined
