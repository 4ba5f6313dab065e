"""Comparing a run with its reference: final weights bitwise, the checkpoints it kept; a planted pickle."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from accel_ddp.checkpoint.manager import list_checkpoints
from accel_ddp.outputs.names import MARKER_NAME
from tests.helpers.runs import load_weights


def assert_same_weights(output_dir: Path, reference: Path) -> None:
    got, expected = load_weights(output_dir), load_weights(reference)
    assert got.keys() == expected.keys()
    for key in expected:
        assert torch.equal(got[key], expected[key]), f"{key} differs from the uninterrupted run's"


def steps_of(output_dir: Path) -> list[int]:
    return [step for step, _ in list_checkpoints(str(output_dir / "checkpoints"))]


class _Payload:
    """Unpickled without weights_only, it would create the file ``path`` (proof that it ran)."""

    def __init__(self, path: Path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def plant_pickle(folder: Path, name: str, proof: Path) -> None:
    """Replace ``folder/name`` with a pickle whose load would run code (create ``proof``), and record its size and
    sha256 in checkpoint.json as a save would: the manifest vouches for it, only a safe load can refuse it."""
    path = folder / name
    torch.save({"state": {0: _Payload(proof)}, "param_groups": []}, path)
    meta = json.loads((folder / MARKER_NAME).read_text())
    meta["files"][name] = {"bytes": path.stat().st_size, "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}
    (folder / MARKER_NAME).write_text(json.dumps(meta))


def save_stream_position(loader, folder) -> None:
    """What a checkpoint writes of a stream's position (the run's TrainState's ``position_files``), into ``folder``."""
    from accel_ddp.checkpoint.train_state import POSITION_FILE

    (Path(folder) / POSITION_FILE.format(rank=loader.rank)).write_text(json.dumps(loader.state_dict()))


def load_stream_position(loader, folder) -> None:
    """What a resume reads of a stream's position (the run's TrainState's ``load_files``), from ``folder``."""
    from accel_ddp.checkpoint.train_state import saved_positions

    loader.load_state_dict(saved_positions(str(folder), loader.rank))
