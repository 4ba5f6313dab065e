"""A run's folder as the trust-nothing tests see it: checkpoints to edit, snapshots to compare, files an
unprivileged child cannot read; the error lines a run printed."""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

from accel_ddp.outputs.names import MARKER_NAME

# 256 samples / global batch 32 = 8 optimizer steps per epoch. A constant LR makes the run's total step
# count irrelevant to its first steps: a run stopped at 20 and resumed to 30 must equal a 30-step run.
# A 2-rank run that checkpoints every 5 steps and keeps them all; tests add --max_steps and --output_dir. Its three
# parts apart, for a test that gives its own --model or --dataset (a size that its model or dataset would not read
# is refused: accel_ddp/config/dependents.py).
SYNTHETIC_8X8 = ["--dataset", "synthetic", "--synthetic_samples", "256", "--synthetic_shape", "1", "8", "8"]
MLP_16 = ["--model", "mlp", "--hidden_size", "16"]
CHECKPOINTED_STEPS = ["--global_batch_size", "32", "--num_workers", "0", "--log_every", "4", "--lr_schedule",
                      "constant", "--checkpointing_steps", "5", "--keep_last", "10"]
CHECKPOINTED_ARGS = [*SYNTHETIC_8X8, *MLP_16, *CHECKPOINTED_STEPS]


def wait_for_file(path: Path, seconds: float = 30) -> bool:
    """Has ``path`` appeared within ``seconds``? Polled every 10 ms: an order between processes (one acts once the
    other has written its file), without a fixed sleep."""
    deadline = time.monotonic() + seconds
    while not path.exists():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


NOBODY = 65534


def error_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("accel_ddp: error")]


def snapshot(folder: Path) -> dict[str, tuple[str, int]]:
    """sha256 and mtime (ns) of every file under ``folder``: equal snapshots = nothing was touched."""
    return {str(p.relative_to(folder)): (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
            for p in sorted(folder.rglob("*")) if p.is_file()}


def ckpt(out: Path, step: int) -> Path:
    return out / "checkpoints" / f"step_{step:08d}"


def edit_marker(folder: Path, **changes) -> None:
    meta = json.loads((folder / MARKER_NAME).read_text())
    meta.update(changes)
    (folder / MARKER_NAME).write_text(json.dumps(meta))


def as_unprivileged() -> None:
    """In a forked child: drop root, so that file permissions apply to it (no-op when not root)."""
    if os.geteuid() == 0:
        # Root's home (the venv) is private: what the run imports lazily must be loaded before.
        import encodings.latin_1  # noqa: F401 - torch.load of the NumPy RNG state in random_states_*.pkl

        import matplotlib.backends.backend_agg  # noqa: F401 - curves.png
        import numpy.ctypeslib  # noqa: F401 - safetensors' save_file
        import torch.utils.serialization  # noqa: F401 - torch.load of the checkpoints' small state files

        os.setgid(NOBODY)
        os.setuid(NOBODY)


def chown_tree(path: Path) -> None:
    if os.geteuid() == 0:
        for p in [path, *path.rglob("*")]:
            os.chown(p, NOBODY, NOBODY)
