"""Throughput as people compare it (accel_ddp/tracking/meters.py, accel_ddp/tracking/flops.py): samples/s and real
tokens/s per device and in all, model FLOPs per sample/token, achieved FLOP/s, MFU from a peak table.

The CPU has no peak: MFU is null here, and the table lookup and the arithmetic are tested with faked device names.
Runs are forked gloo ranks (tests/helpers/multiproc.py).
"""

from __future__ import annotations

import pytest
import torch

from accel_ddp.tracking import flops
from accel_ddp.tracking.flops import ModelFlops, counted_flops, peak_flops, precision_of, transformer_shape
from accel_ddp.tracking.meters import ThroughputMeter
from tests.helpers.multiproc import run_ranks
from tests.helpers.runs import read_metrics, read_summary

transformers = pytest.importorskip("transformers")
from tests.helpers.text import Sequences, tiny_gpt  # noqa: E402


@pytest.mark.parametrize("name, precision, expected", [
    ("NVIDIA H100 80GB HBM3", "bf16", 989.4e12),  # SXM: the name has no "SXM"
    ("NVIDIA H100 PCIe", "bf16", 756e12),
    ("NVIDIA H100 NVL", "tf32", 417.5e12),
    ("NVIDIA H200", "fp32", 66.9e12),
    ("NVIDIA A100-SXM4-80GB", "tf32", 156e12),
    ("NVIDIA A100 80GB PCIe", "fp16", 312e12),  # fp16 takes the bf16 tensor peak
    ("NVIDIA L4", "bf16", 121e12),
    ("NVIDIA L40S", "bf16", 362e12),  # not L4's
    ("NVIDIA A10", "bf16", 125e12),
    ("Tesla V100-SXM2-32GB", "bf16", None),  # no bf16 tensor cores
    ("NVIDIA A10G", "bf16", None),  # no datasheet: never A10's figure
    ("NVIDIA GeForce GTX 1080", "fp32", None),
    (None, "bf16", None),
    ("NVIDIA H100 80GB HBM3", None, None),  # fp8: no honest peak
])
def test_peak_table_matches_whole_words_most_specific_first(name, precision, expected):
    assert peak_flops(name, precision) == (None if expected is None else pytest.approx(expected))


def test_a_mig_slice_scales_the_peak_by_its_share_of_the_chip():
    assert peak_flops("NVIDIA A100-SXM4-40GB MIG 3g.20gb", "bf16", sm_count=42) == pytest.approx(312e12 * 42 / 108)


def test_precision_follows_mixed_precision_and_tf32():
    assert [precision_of("bf16", True), precision_of("fp16", False), precision_of("no", True),
            precision_of("no", False), precision_of("fp8", True)] == ["bf16", "fp16", "tf32", "fp32", None]


def test_device_peak_reads_this_ranks_cuda_device(monkeypatch):
    seen = []
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d: seen.append(d) or "NVIDIA H100 PCIe")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: type("P", (), {"multi_processor_count": 114}))
    device = torch.device("cuda", 3)
    assert flops.device_peak_flops(device, "no", tf32=True) == ("NVIDIA H100 PCIe", 378e12)
    assert seen == [device]
    assert flops.device_peak_flops(torch.device("cpu"), "bf16", True) == (None, None)


def test_counted_flops_are_the_matmuls_of_forward_and_backward_on_meta():
    """Linear(6,5)-ReLU-Linear(5,4): forward 2*(30+20) per sample; backward: both weight gradients, and the input
    gradient of the second layer only (the batch needs none)."""
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 4))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert counted_flops(model, (torch.zeros(32, 6), torch.zeros(32))) == 2 * 50 * 2 + 2 * 20
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items()) and model[0].weight.grad is None
    assert ModelFlops(model).of_batch((torch.zeros(32, 6), torch.zeros(32))) == (240.0 * 32, 32, 32)


def test_transformer_flops_are_6n_plus_12ldt_without_lookup_tables():
    model = tiny_gpt()  # wte tied to lm_head (a real matmul), wpe a lookup table
    n = sum(p.numel() for p in model.parameters()) - model.transformer.wpe.weight.numel()
    assert transformer_shape(model) == (n, 2, 32)
    batch = {"input_ids": torch.zeros(4, 10, dtype=torch.long)}
    assert ModelFlops(model).of_batch(batch) == (float((6 * n + 12 * 2 * 32 * 10) * 40), 4, 40)


def test_frozen_parameters_count_4_flops_a_token_not_6():
    """A LoRA base (frozen: no weight gradient) and its trainable adapters: 6 per trainable and 4 per frozen matmul
    parameter a token, the lookup-only position table in neither; the same model all trainable gives 6N."""
    from accel_ddp.transforms.finetune import add_lora

    model = add_lora(tiny_gpt(), r=2, alpha=4, dropout=0.0, targets="c_attn")
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    frozen -= model.base_model.model.transformer.wpe.weight.numel()
    assert trainable > 0 and frozen > 10 * trainable
    flops = ModelFlops(model)
    batch = {"input_ids": torch.zeros(4, 10, dtype=torch.long)}
    assert flops.of_batch(batch) == (float((6 * trainable + 4 * frozen + 12 * 2 * 32 * 10) * 40), 4, 40)
    assert flops.method == "6Nt+4Nf+12LdT" and ModelFlops(tiny_gpt()).method == "6N+12LdT"


class FixedFlops:
    method = "fixed"

    def of_batch(self, batch):  # 100 FLOPs a sample, 4 samples, 8 positions a micro-batch
        return 400.0, 4, 8


def test_mfu_is_achieved_model_flops_per_device_over_the_peak():
    meter = ThroughputMeter(global_batch_size=16, world_size=2, flops=FixedFlops(), peak=1e3, device_name="fake")
    for _ in range(2):  # 2 micro-steps of 4 samples on this rank: one optimizer step of 16 over 2 ranks
        meter.add_batch(None)
    record = meter.record(1)
    assert record["flops_per_sec"] == pytest.approx(record["samples_per_sec"] * 100)
    assert record["flops_per_sec_per_device"] == pytest.approx(record["flops_per_sec"] / 2)
    assert record["samples_per_sec_per_device"] == pytest.approx(record["samples_per_sec"] / 2)
    assert record["mfu"] == pytest.approx(record["flops_per_sec_per_device"] / 1e3)
    tokens = meter.record(3, tokens=90, token_steps=2)  # per token: 400 / 8 positions
    assert tokens["tokens"] == 90 and tokens["flops_per_sec"] == pytest.approx(tokens["tokens_per_sec"] * 50)
    summary = meter.summary(seconds=2.0, steps=3)
    assert summary["train_tokens"] == 90 and summary["train_tokens_per_sec_per_device"] == pytest.approx(22.5)
    assert summary["model_flops_per_token"] == 50 and summary["model_flops_per_sample"] == 100
    assert summary["mfu"] == pytest.approx(90 * 50 / 2.0 / 2 / 1e3)
    assert ThroughputMeter(16, world_size=2, flops=FixedFlops()).summary(1.0, 1)["mfu"] is None  # no peak


def _lm(out, world: int, per_device: int):
    def fn():
        from accel_ddp import TrainConfig, train

        torch.manual_seed(0)
        config = TrainConfig(task="causal_lm", global_batch_size=8, per_device_batch_size=per_device, max_steps=12,
                             optimizer="sgd", lr=0.1, log_every=5, eval_every=3, output_dir=str(out))
        return train(config, model=tiny_gpt(), train_dataset=Sequences(96), eval_dataset=Sequences(8, seed=1))

    return run_ranks(fn, world_size=world)[0]


def test_real_tokens_are_counted_exactly_with_padding_and_accumulation(tmp_path):
    """12 steps of 8 = one epoch of 96 sequences of 3 to 16 tokens, padded per batch: every rank's real tokens (each
    sequence predicts its length - 1) are counted once, with accumulation (2 ranks x 2 x 2 micro-steps) and without
    (1 process x 8); the log lines' counts add up to the summary's; the FLOP figures are per real token."""
    expected = sum(len(row) - 1 for row in Sequences(96).rows)
    for world, per_device in ((2, 2), (1, 8)):
        out = tmp_path / f"w{world}"
        summary = _lm(out, world, per_device)
        assert summary["train_tokens"] == expected
        logged = [r for r in read_metrics(out) if "loss" in r]
        assert sum(r["tokens"] for r in logged) == expected and len(logged) == 3  # steps 5, 10, 12
        assert summary["grad_accum_steps"] == (2 if world == 2 else 1)
        assert summary["train_tokens_per_sec_per_device"] == pytest.approx(summary["train_tokens_per_sec"] / world)
        assert summary["train_flops_per_sec"] == pytest.approx(summary["train_tokens_per_sec"]
                                                               * summary["model_flops_per_token"])
        assert summary["flops_method"] == "6N+12LdT" and summary["mfu"] is None and summary["device_name"] is None
        assert all("mfu" not in r and r["tokens_per_sec_per_device"] > 0 for r in logged)  # null: not logged


def test_a_sample_task_reports_counted_flops_per_sample(tmp_path):
    def fn():
        from accel_ddp import TrainConfig, train

        config = TrainConfig(dataset="synthetic", synthetic_samples=256, synthetic_shape=(1, 8, 8), model="mlp",
                             hidden_size=32, global_batch_size=16, max_steps=4, log_every=2, output_dir=str(tmp_path))
        return train(config)

    summary = run_ranks(fn, world_size=2)[0]
    assert summary["flops_method"] == "counted" and summary["model_flops_per_sample"] > 0
    assert summary["train_tokens"] is None and summary["mfu"] is None
    assert summary["train_samples_per_sec_per_device"] == pytest.approx(summary["train_samples_per_sec"] / 2)
    assert summary["train_flops_per_sec"] == pytest.approx(summary["train_samples_per_sec"]
                                                           * summary["model_flops_per_sample"])
    logged = [r for r in read_metrics(tmp_path) if "loss" in r]
    assert all(r["flops_per_sec"] == pytest.approx(r["samples_per_sec"] * summary["model_flops_per_sample"])
               for r in logged)
    assert read_summary(tmp_path)["flops_method"] == "counted"


def test_the_token_count_is_all_reduced_asynchronously_beside_the_backward(tmp_path):
    """2 ranks, 6 steps, a log line every 3: each step's token count goes out as one async all-reduce launched
    before that step's backward (no blocking reduce per step); Accelerate's blocking reduce runs at log lines only."""
    def fn():
        import torch.distributed as dist
        from accelerate import Accelerator

        from accel_ddp import TrainConfig, train

        events, real_all_reduce, real_reduce = [], dist.all_reduce, Accelerator.reduce
        real_backward = torch.Tensor.backward

        def all_reduce(tensor, *args, async_op=False, **kwargs):
            if async_op and tensor.dtype == torch.float64 and tensor.ndim == 0:
                events.append("count")
            return real_all_reduce(tensor, *args, async_op=async_op, **kwargs)

        def backward(self, *args, **kwargs):
            events.append("backward")
            return real_backward(self, *args, **kwargs)

        def reduce(self, *args, **kwargs):
            events.append("reduce")
            return real_reduce(self, *args, **kwargs)

        dist.all_reduce, torch.Tensor.backward, Accelerator.reduce = all_reduce, backward, reduce
        torch.manual_seed(0)
        config = TrainConfig(task="causal_lm", global_batch_size=8, per_device_batch_size=4, max_steps=6,
                             optimizer="sgd", lr=0.1, log_every=3, output_dir=str(tmp_path))
        train(config, model=tiny_gpt(), train_dataset=Sequences(48))
        return events

    events = run_ranks(fn, world_size=2)[0]
    steps = [e for e in events if e in ("count", "backward")]
    assert steps == ["count", "backward"] * 6
    assert events.count("reduce") <= 2 + 4  # the 2 log lines', and a few outside the loop (summary, checks)


def test_a_processs_peak_memory_never_reads_lower_than_it_read_before(monkeypatch):
    """Linux's VmHWM can fall below a figure it showed (its high-water mark is brought up to date only at some
    unmaps): the peak reported is the highest read so far, so summary.json's is never below an epoch's."""
    from accel_ddp.tracking import meters

    readings = iter([2048.0, 1024.0, 3072.0])
    monkeypatch.setattr(meters, "_peak_rss_kib", lambda pid="self": next(readings) if pid == "self" else 0.0)
    monkeypatch.setattr(meters, "_OWN_PEAK_KIB", [0.0])
    assert [meters.peak_memory_mb()[0] for _ in range(3)] == [2.0, 2.0, 3.0]
