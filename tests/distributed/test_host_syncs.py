"""No device-to-host synchronisation inside training steps except on log, eval and save steps, on every training
path (device loader, DataLoader workers, a causal LM, streaming), counted on 2 forked CPU ranks.

Counted (tests/helpers/syncs.py): ``.item()``, ``.tolist()``, ``.cpu()``, ``.numpy()``, a tensor's ``__bool__``,
``__int__``, ``__float__``, and ``torch.cuda.synchronize``, from the first micro-step to the end of the training
loop, whatever the tensor's device (on the CPU none waits; on a GPU each would). N optimizer steps with
``--log_every K``, no evaluation and no checkpoint inside them, must make at most ``C_PER_LOG * N / K + CONSTANT``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.helpers.multiproc import run_ranks
from tests.helpers.syncs import count_step_syncs

STEPS, LOG_EVERY = 16, 4
# A log line reads the loss of every rank once: one all-reduced tensor turned into Python numbers (.tolist() or
# .item(), step/losses.py LossAccumulator.mean_since_log). The loss's sanity (non-finite, a sum over no items) rides on
# that same read.
C_PER_LOG = 1
# Once per run of N steps: the epoch's end, where every rank's peak memory is gathered for metrics.jsonl
# (tracking/meters.py memory_record: one .tolist()). N steps fit in one epoch on every path below.
CONSTANT = 1
BOUND = C_PER_LOG * STEPS // LOG_EVERY + CONSTANT

COMMON = ["--max_steps", str(STEPS), "--log_every", str(LOG_EVERY), "--eval_every", "1000"]  # no eval inside
SYNTHETIC = ["--dataset", "synthetic", "--synthetic_samples", "512", "--synthetic_shape", "6", "--model", "mlp",
             "--hidden_size", "16", "--global_batch_size", "16"]  # 32 steps per epoch


def _stream(root: Path) -> Path:
    """Parquet image files for --streaming: 2 per rank, 96 rows in all (8 per step: 12 steps a pass)."""
    import datasets
    from PIL import Image

    folder = root / "stream"
    folder.mkdir()
    rng = np.random.default_rng(0)
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(num_classes=4)})
    for k in range(4):
        images = [Image.fromarray(rng.integers(0, 256, (8, 8), dtype=np.uint8), mode="L") for _ in range(40)]
        datasets.Dataset.from_dict({"image": images, "label": [i % 4 for i in range(40)]},
                                   features=features).to_parquet(str(folder / f"train-{k:05d}-of-00004.parquet"))
    return folder


class AskNothing:
    """A callback that reads the state every step and asks for nothing: the agreement of its requests runs anyway."""

    def on_step_end(self, state):
        state.should_stop = state.step > STEPS


def _args(path: str, tmp_path: Path) -> list[str]:
    if path == "device":
        return [*SYNTHETIC, "--num_workers", "0"]
    if path == "callbacks":  # the flags' all-reduce after each step is over a CPU tensor read through numpy: no sync
        return [*SYNTHETIC, "--num_workers", "0", "--callbacks", "tests.distributed.test_host_syncs:AskNothing"]
    if path == "dataloader":
        return [*SYNTHETIC, "--loader", "dataloader", "--num_workers", "1"]
    if path == "text":  # the tiny GPT-2 on token sequences of 3-16 tokens: the token-exact (sum, items) loss
        pytest.importorskip("transformers")
        import tests.helpers.text  # noqa: F401 - GPT-2 and its export's weight conversions loaded here, for the ranks
        return ["--task", "causal_lm", "--dataset", "tests.helpers.text:build_sequences", "--model",
                "tests.helpers.text:build_gpt", "--global_batch_size", "4"]  # 64 sequences: 16 steps per epoch
    assert path == "streaming"
    return ["--dataset", "hf", "--data_dir", str(_stream(tmp_path)), "--streaming", "--shuffle_buffer", "0",
            "--num_workers", "1", "--model", "mnist_cnn", "--global_batch_size", "8"]


@pytest.mark.parametrize("path", ["device", "dataloader", "text", "streaming", "callbacks"])
def test_host_syncs_only_on_log_steps(path, tmp_path):
    args = [*_args(path, tmp_path), *COMMON, "--output_dir", str(tmp_path / "run")]
    results = run_ranks(lambda: count_step_syncs(args), world_size=2)
    for rank, (counter, steps) in enumerate(results):
        assert steps == STEPS
        total = sum(counter.counts.values())
        assert total <= BOUND, f"rank {rank}: {total} syncs > {BOUND}: {dict(counter.where)}"
        assert counter.counts["tolist"] + counter.counts["item"] >= STEPS // LOG_EVERY  # the counting sees the logs'
        if path != "text":
            assert not counter.model, counter.model  # only the GPT-2 checks its padding mask
