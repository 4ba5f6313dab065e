"""Performance knobs are really applied, and the loop logs its own timing figures."""

from __future__ import annotations

import json
import time

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from accel_ddp import TrainConfig, train
from accel_ddp.models import build_model, build_optimizer
from tests.conftest import SCRIPTS, check, launch, read_metrics, read_summary


def _inspect(tmp_path, *flags: str) -> dict:
    out = tmp_path / "knobs.json"
    check(launch([str(out), *flags], script=SCRIPTS / "inspect_knobs.py"))
    return json.loads(out.read_text())


@pytest.mark.slow
def test_ddp_knobs_reach_the_ddp_module(tmp_path):
    defaults = _inspect(tmp_path)
    assert defaults["ddp"] == "DistributedDataParallel"
    assert defaults["bucket_cap_bytes"] == 25 * 1024 * 1024
    assert defaults["gradient_as_bucket_view"] is True  # our default: no extra gradient copy
    assert defaults["static_graph"] is False and defaults["find_unused_parameters"] is False
    assert defaults["comm_hook"] in (None, "", "builtin_allreduce")

    tuned = _inspect(tmp_path, "--ddp_bucket_cap_mb", "7", "--ddp_gradient_as_bucket_view", "false",
                     "--ddp_static_graph", "--ddp_comm_hook", "fp16")
    assert tuned["bucket_cap_bytes"] == 7 * 1024 * 1024
    assert tuned["gradient_as_bucket_view"] is False and tuned["static_graph"] is True
    assert tuned["comm_hook"] == "fp16_compress_hook"

    other = _inspect(tmp_path, "--ddp_find_unused_parameters", "--ddp_comm_hook", "bf16")
    assert other["find_unused_parameters"] is True and other["comm_hook"] == "bf16_compress_hook"


@pytest.mark.slow
def test_compile_wraps_the_ddp_model(tmp_path):
    facts = _inspect(tmp_path, "--compile")
    assert facts["wrapper"] == "OptimizedModule" and facts["ddp"] == "DistributedDataParallel"


@pytest.mark.slow
def test_process_group_timeout_fails_a_missing_rank_fast(tmp_path):
    started = time.monotonic()
    result = launch(["--ddp_timeout", "5"], script=SCRIPTS / "timeout_probe.py", timeout=120)
    elapsed = time.monotonic() - started
    assert result.returncode != 0 and "barrier passed" not in result.stdout
    assert elapsed < 45, f"a 5 s timeout took {elapsed:.0f}s to end the job"
    assert "timed out" in result.stderr.lower() or "timeout" in result.stderr.lower()


@pytest.mark.slow
def test_gradient_compression_trains_under_two_ranks(tmp_path):
    for hook in ("fp16", "bf16"):
        out = tmp_path / hook
        check(launch(["--ddp_comm_hook", hook, "--epochs", "3", "--output_dir", str(out)]))
        assert read_summary(out)["eval_accuracy"] >= 0.9, hook


class LayoutProbe(nn.Module):
    """A conv net that records the memory format of each training batch and of its weight."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.head = nn.Linear(4 * 6 * 6, 2)
        self.formats: list[tuple[bool, bool]] = []

    def forward(self, x):
        if self.training:
            self.formats.append((x.is_contiguous(memory_format=torch.channels_last),
                                 self.conv.weight.is_contiguous(memory_format=torch.channels_last)))
        return self.head(self.conv(x).flatten(1))


@pytest.mark.parametrize("channels_last", [True, False])
def test_channels_last_reaches_model_and_batches(tmp_path, channels_last):
    data = TensorDataset(torch.randn(64, 3, 8, 8), torch.randint(0, 2, (64,)))
    probe = LayoutProbe()
    cfg = TrainConfig(global_batch_size=16, epochs=1, channels_last=channels_last, output_dir=str(tmp_path))
    train(cfg, model=probe, train_dataset=data)
    assert len(probe.formats) == 4
    assert all(batch == channels_last and weight == channels_last for batch, weight in probe.formats)


def test_fused_optimizer_is_requested():
    model = build_model("mlp", num_classes=3, input_shape=(4,), hidden_size=8)
    assert build_optimizer("adamw", model, lr=1e-3, weight_decay=0.0, fused=True).defaults["fused"] is True
    unfused = build_optimizer("adamw", model, lr=1e-3, weight_decay=0.0, fused=False)
    assert not unfused.defaults.get("fused") and unfused.defaults["foreach"] is True  # multi-tensor on the CPU
    assert build_optimizer("sgd", model, lr=1e-3, weight_decay=0.0, fused=True).defaults["fused"] is True


@pytest.mark.skipif(not torch.cuda.is_available(), reason="TF32 is a CUDA setting; this machine has no GPU")
def test_tf32_switches_on_with_cuda():
    from accel_ddp.loop import build_accelerator

    build_accelerator(TrainConfig(tf32=True))
    assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32


def test_timing_figures_are_logged_per_epoch_and_in_the_summary(tmp_path):
    data = TensorDataset(torch.randn(128, 6), torch.randint(0, 3, (128,)))
    cfg = TrainConfig(global_batch_size=16, epochs=2, output_dir=str(tmp_path), profile=True)
    summary = train(cfg, model=build_model("mlp", 3, (6,), 8), train_dataset=data)
    records = read_metrics(tmp_path)
    epochs = [r for r in records if "step_time_p50_ms" in r]
    assert [r["epoch"] for r in epochs] == [0, 1] and [r["step"] for r in epochs] == [8, 16]
    for record in [*epochs, summary]:
        assert record["step_time_p90_ms"] >= record["step_time_p50_ms"] > 0
        assert 0.0 <= record["data_wait_share"] <= 1.0
    assert summary["train_samples_per_sec"] > 0
    trace = json.loads((tmp_path / "profile" / "rank0.json").read_text())
    assert any("ProfilerStep" in str(event.get("name")) for event in trace["traceEvents"])
