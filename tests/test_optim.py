"""accel_ddp/optim.py: the optimizer (parameter groups, fused or multi-tensor kernels) and the LR schedule."""

from __future__ import annotations

import math

import pytest
import torch

from accel_ddp.models import build_model
from accel_ddp.optim import build_lr_scheduler, build_optimizer, lr_multiplier, use_fused_optimizer
from accel_ddp.util.validation import ConfigError


def test_fused_optimizer_is_requested():
    model = build_model("mlp", num_classes=3, input_shape=(4,), hidden_size=8)
    assert build_optimizer("adamw", model, lr=1e-3, weight_decay=0.0, fused=True).defaults["fused"] is True
    unfused = build_optimizer("adamw", model, lr=1e-3, weight_decay=0.0, fused=False)
    assert not unfused.defaults.get("fused") and unfused.defaults["foreach"] is True  # multi-tensor on the CPU
    assert build_optimizer("sgd", model, lr=1e-3, weight_decay=0.0, fused=True).defaults["fused"] is True


def test_fused_kernels_only_where_they_run():
    """Fused on CUDA and the CPU, except SGD under FSDP2 (no DTensor rule for aten._fused_sgd_ in torch 2.14):
    foreach there and on other devices."""
    for device in ("cuda", "cpu"):
        assert use_fused_optimizer("adamw", device) and use_fused_optimizer("sgd", device)
        assert use_fused_optimizer("adamw", device, fsdp2=True)
        assert not use_fused_optimizer("sgd", device, fsdp2=True)
    assert not use_fused_optimizer("adamw", "mps") and not use_fused_optimizer("sgd", "xpu")


def test_biases_and_norms_get_no_weight_decay():
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.LayerNorm(6), torch.nn.Linear(6, 2))
    model[2].weight.requires_grad_(False)  # frozen: in no group
    for name in ("sgd", "adamw"):
        decay, no_decay = build_optimizer(name, model, lr=0.1, weight_decay=0.05).param_groups
        assert [tuple(p.shape) for p in decay["params"]] == [(6, 4)] and decay["weight_decay"] == 0.05
        assert [tuple(p.shape) for p in no_decay["params"]] == [(6,), (6,), (6,), (2,)]
        assert no_decay["weight_decay"] == 0.0
    with pytest.raises(ConfigError, match="unknown optimizer 'lamb'; choose sgd or adamw"):
        build_optimizer("lamb", model, lr=0.1, weight_decay=0.0)


def test_warmup_is_linear_then_each_schedule_decays_as_named():
    # Warmup: step s of w gets (s + 1) / (w + 1) of the peak, never 0 and never the peak itself.
    assert [lr_multiplier(s, "cosine", 3, 13) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_multiplier(8, "linear", 3, 13) == 0.5  # halfway through the 10 decay steps
    assert lr_multiplier(8, "cosine", 3, 13) == pytest.approx(0.5)
    assert lr_multiplier(13, "linear", 3, 13) == 0.0 and lr_multiplier(13, "cosine", 3, 13) == 0.0
    assert lr_multiplier(20, "cosine", 3, 13) == 0.0  # past the end: held at 0, never back up
    assert lr_multiplier(5, "cosine", 0, 10) == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.5)))
    assert {lr_multiplier(s, "constant", 2, 10) for s in range(2, 12)} == {1.0}


def test_the_scheduler_steps_the_lr_of_every_group_once_per_call():
    model = build_model("mlp", num_classes=3, input_shape=(4,), hidden_size=8)
    optimizer = build_optimizer("sgd", model, lr=0.2, weight_decay=0.01)
    scheduler = build_lr_scheduler(optimizer, "linear", warmup_steps=1, total_steps=5)
    seen = []
    for _ in range(6):
        seen.append([group["lr"] for group in optimizer.param_groups])
        optimizer.step()
        scheduler.step()
    assert seen == [[pytest.approx(0.2 * lr_multiplier(s, "linear", 1, 5))] * 2 for s in range(6)]
    assert seen[0] == [pytest.approx(0.1)] * 2 and seen[5] == [0.0, 0.0]


def test_an_unknown_schedule_is_refused_when_built_not_at_the_first_step():
    model = build_model("mlp", num_classes=3, input_shape=(4,), hidden_size=8)
    with pytest.raises(ConfigError, match="unknown lr schedule 'step'; choose constant, linear or cosine"):
        build_lr_scheduler(build_optimizer("sgd", model, 0.1, 0.0), "step", warmup_steps=0, total_steps=10)
