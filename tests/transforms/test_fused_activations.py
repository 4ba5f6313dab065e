"""accel_ddp/transforms/fused_activations.py: Transformers' Python tanh GELUs become torch's one kernel, with the
same outputs and gradients, in a DDP run by default and not with ``fused_kernels=False``."""

from __future__ import annotations

import copy

import pytest
import torch
import yaml
from torch import nn

transformers = pytest.importorskip("transformers")

from transformers.activations import FastGELUActivation, NewGELUActivation  # noqa: E402

from accel_ddp import TrainConfig, train  # noqa: E402
from accel_ddp.transforms.fused_activations import TanhGELU, fuse_activations  # noqa: E402
from tests.helpers.multiproc import run_ranks  # noqa: E402
from tests.helpers.runs import load_weights  # noqa: E402
from tests.helpers.text import VOCAB, Sequences, tiny_gpt  # noqa: E402


def _modules_of(model: nn.Module, kind: type) -> int:
    return sum(type(m) is kind for m in model.modules())


@pytest.mark.parametrize("activation, python_gelu",
                         [("gelu_new", NewGELUActivation), ("gelu_fast", FastGELUActivation)])
def test_a_python_tanh_gelu_becomes_one_kernel_with_the_same_outputs_and_gradients(activation, python_gelu):
    torch.manual_seed(0)
    model = tiny_gpt(activation=activation)
    reference = copy.deepcopy(model)
    assert _modules_of(model, python_gelu) == 2  # one per block's MLP

    assert fuse_activations(model) == 2
    assert _modules_of(model, python_gelu) == 0 and _modules_of(model, TanhGELU) == 2
    assert fuse_activations(model) == 0  # nothing left to replace
    mine, theirs = model.state_dict(), reference.state_dict()
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)  # no weight renamed

    ids = torch.randint(0, VOCAB, (4, 16), generator=torch.Generator().manual_seed(1))
    outputs = [m(input_ids=ids, labels=ids) for m in (model, reference)]
    for out in outputs:
        out.loss.backward()
    torch.testing.assert_close(outputs[0].logits, outputs[1].logits, rtol=0, atol=1e-5)
    for (name, fused), (_, own) in zip(model.named_parameters(), reference.named_parameters(), strict=True):
        torch.testing.assert_close(fused.grad, own.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_a_subclass_and_other_modules_are_left_as_they_are():
    class ScaledGELU(NewGELUActivation):  # a user's variant: not the function the kernel computes
        def forward(self, x):
            return 2 * super().forward(x)

    model = nn.Sequential(nn.Linear(4, 4), ScaledGELU(), nn.GELU(), nn.ReLU())
    before = [type(m) for m in model]
    assert fuse_activations(model) == 0
    assert [type(m) for m in model] == before


def _run(out, **cfg) -> dict:
    def fn():
        torch.manual_seed(0)
        config = TrainConfig(task="causal_lm", global_batch_size=8, max_steps=12, optimizer="sgd", lr=0.2,
                             lr_schedule="constant", max_grad_norm=0, output_dir=str(out), **cfg)
        return train(config, model=tiny_gpt(), train_dataset=Sequences(96))

    return run_ranks(fn, world_size=2)[0]


def test_a_ddp_run_fuses_by_default_says_so_and_trains_the_same_weights(tmp_path):
    fused, own = tmp_path / "fused", tmp_path / "own"
    _run(fused)
    _run(own, fused_kernels=False)
    said = {run: yaml.safe_load((run / "config.yaml").read_text())["startup"]["model"] for run in (fused, own)}
    assert "2 tanh-GELU modules on torch's one kernel (--fused_kernels)" in said[fused]
    assert "tanh-GELU" not in said[own]
    weights = {run: load_weights(run) for run in (fused, own)}
    torch.manual_seed(0)
    initial = tiny_gpt().state_dict()
    key = "transformer.h.0.mlp.c_fc.weight"
    assert (weights[own][key] - initial[key]).abs().max() > 1e-2  # training moved it far beyond the tolerance below
    for name, tensor in weights[own].items():
        torch.testing.assert_close(weights[fused][name], tensor, rtol=0, atol=1e-4, msg=name)
