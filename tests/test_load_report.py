"""Issue 40: Transformers' LOAD REPORT is printed by the first rank only (accel_ddp/models.py); the other ranks load
the same folder, and their reports said nothing new, once per rank."""

from __future__ import annotations

import pytest

from accel_ddp.models import build_transformers_model

pytest.importorskip("transformers")
from tests.helpers.text import tiny_gpt  # noqa: E402


@pytest.mark.parametrize("rank, printed", [("0", True), ("1", False)])
def test_the_load_report_comes_from_the_first_rank_only(tmp_path, monkeypatch, caplog, rank, printed):
    tiny_gpt().save_pretrained(tmp_path)  # a causal LM: as a sequence classifier its score head is new, reported
    monkeypatch.setenv("RANK", rank)
    model = build_transformers_model("sequence_classification", str(tmp_path), num_labels=3)
    assert model.config.num_labels == 3
    assert ("LOAD REPORT" in caplog.text) is printed  # a warning of Transformers' logger
