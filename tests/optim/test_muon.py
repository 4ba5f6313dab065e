"""accel_ddp/optim/muon.py: Muon's share of a model (hidden matrices) and AdamW's (the rest), one optimizer whose
state survives a checkpoint exactly."""

from __future__ import annotations

import io

import pytest
import torch

from accel_ddp.models import build_model
from accel_ddp.optim.build import build_lr_scheduler, build_optimizer
from accel_ddp.optim.muon import MuonWithAdamW, muon_split
from accel_ddp.util.validation import ConfigError


def _names(model: torch.nn.Module, params: list[torch.nn.Parameter]) -> list[str]:
    chosen = {id(p) for p in params}
    return [name for name, p in model.named_parameters() if id(p) in chosen]


def test_hidden_matrices_go_to_muon_biases_and_the_output_layer_to_adamw():
    mlp = build_model("mlp", num_classes=3, input_shape=(4,), hidden_size=8)  # Flatten, Linear, ReLU, Linear, ...
    split = muon_split(mlp)
    assert _names(mlp, split.matrices) == ["1.weight", "3.weight"]
    assert _names(mlp, split.rest) == ["1.bias", "3.bias", "5.weight", "5.bias"]  # 5: the classifier
    cnn = build_model("mnist_cnn", num_classes=10, input_shape=(1, 28, 28))
    split = muon_split(cnn)
    assert [tuple(p.shape) for p in split.matrices] == [(128, 9216)]  # fc1; the convolutions are 4-D
    assert split.kinds == {"biases and norms": 4, "embeddings": 0, "output layer weights": 1, "convolution kernels": 2}


def test_a_transformer_keeps_its_embeddings_and_tied_head_out_of_muon():
    from tests.helpers.text import tiny_gpt

    model = tiny_gpt()
    split = muon_split(model)
    names = _names(model, split.rest)
    assert "transformer.wte.weight" in names and "transformer.wpe.weight" in names  # the head is tied to wte
    assert all(p.ndim == 2 for p in split.matrices) and split.matrices
    assert all("wte" not in n and "wpe" not in n and "ln_" not in n for n in _names(model, split.matrices))
    frozen = tiny_gpt()
    frozen.transformer.h[0].attn.c_attn.weight.requires_grad_(False)
    assert len(muon_split(frozen).matrices) == len(split.matrices) - 1  # only what trains


def test_one_schedule_sets_both_learning_rates_and_both_optimizers_step():
    model = build_model("mlp", num_classes=3, input_shape=(4,), hidden_size=8)
    optimizer = build_optimizer("muon", model, lr=0.02, weight_decay=0.1, fused=True)
    assert isinstance(optimizer, MuonWithAdamW) and len(optimizer.param_groups) == 3  # Muon's, AdamW's two
    assert optimizer.param_groups[0]["adjust_lr_fn"] == "match_rms_adamw"  # one --lr for both
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.1, 0.1, 0.0]
    scheduler = build_lr_scheduler(optimizer, "linear", warmup_steps=0, total_steps=4)
    before = [p.clone() for p in model.parameters()]
    model(torch.randn(5, 4)).sum().backward()
    optimizer.step()
    scheduler.step()
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))  # every tensor moved
    assert [g["lr"] for g in optimizer.muon.param_groups + optimizer.adamw.param_groups] == [0.015] * 3


def test_a_model_without_hidden_matrices_is_refused_in_one_line():
    model = torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3), torch.nn.Flatten(), torch.nn.Linear(4 * 26 * 26, 10))
    with pytest.raises(ConfigError, match=r"--optimizer muon: Sequential has no hidden 2-D matrix for Muon \(its 4 "
                                          r"other tensors .*: 2 biases and norms, 1 output layer weights, 1 "
                                          r"convolution kernels\) go to AdamW\); choose another optimizer"):
        build_optimizer("muon", model, 1e-3, 0.0)


def _train(model, optimizer, scheduler, steps: int, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x, y = torch.randn(16, 4, generator=generator), torch.randint(0, 3, (16,), generator=generator)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()


def test_its_state_dict_is_torchs_format_loads_safely_and_resumes_bit_for_bit():
    """Saved after 3 steps (torch.save, loaded with weights_only=True as Accelerate's load_state does) and resumed in
    a fresh optimizer: 3 more steps give the uninterrupted run's bits."""
    def fresh():
        torch.manual_seed(0)
        model = build_model("mlp", num_classes=3, input_shape=(4,), hidden_size=8)
        optimizer = build_optimizer("muon", model, 1e-2, 0.01, fused=True)
        return model, optimizer, build_lr_scheduler(optimizer, "cosine", 2, 10)

    model, optimizer, scheduler = fresh()
    _train(model, optimizer, scheduler, 3, seed=1)
    saved = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()},
               saved)
    _train(model, optimizer, scheduler, 3, seed=2)

    state = optimizer.state_dict()
    assert sorted(state["state"]) == list(range(6)) and [g["params"] for g in state["param_groups"]] == [
        [0, 1], [2], [3, 4, 5]]  # Muon's two matrices first, then AdamW's head weight, then the biases
    saved.seek(0)
    loaded = torch.load(saved, weights_only=True)
    again, resumed, schedule = fresh()
    again.load_state_dict(loaded["model"])
    resumed.load_state_dict(loaded["optimizer"])
    schedule.load_state_dict(loaded["scheduler"])
    assert resumed.param_groups[0] is resumed.muon.param_groups[0]  # the schedule still reaches both after a load
    _train(again, resumed, schedule, 3, seed=2)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters(), strict=True))
    with pytest.raises(ValueError, match="the state holds 2 parameter groups, this optimizer 3"):
        resumed.load_state_dict({"state": {}, "param_groups": state["param_groups"][:2]})
