"""Comparing a run with its reference: final weights bitwise, the checkpoints it kept."""

from __future__ import annotations

from pathlib import Path

import torch

from accel_ddp.checkpoint.manager import list_checkpoints
from tests.helpers.runs import load_weights


def assert_same_weights(output_dir: Path, reference: Path) -> None:
    got, expected = load_weights(output_dir), load_weights(reference)
    assert got.keys() == expected.keys()
    for key in expected:
        assert torch.equal(got[key], expected[key]), f"{key} differs from the uninterrupted run's"


def steps_of(output_dir: Path) -> list[int]:
    return [step for step, _ in list_checkpoints(str(output_dir / "checkpoints"))]


def save_stream_position(loader, folder) -> None:
    """What a checkpoint writes of a stream's position (the run's TrainState's ``position_files``), into ``folder``."""
    for name, text in loader.position_files().items():
        (Path(folder) / name).write_text(text)
