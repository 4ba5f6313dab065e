"""Host operations per optimizer step: accel_ddp's defaults dispatch at most 3 ATen ops per step more than a bare
loop built here on the same model, optimizer (fused AdamW, as accel_ddp picks it) and clipping (1.0), counted by
benchmarks/ops_per_step.py's ``OpCounter`` (a ``TorchDispatchMode``) on one forked CPU rank. On a GPU each op is
a kernel launch from the host: a small model's step is bound by them (docs/performance.md, "Host operations per
step").
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from accel_ddp.cli.args import parse_args
from accel_ddp.data import DatasetBundle, build_datasets
from accel_ddp.data.in_memory import TokenBlocks
from accel_ddp.models import build_model
from accel_ddp.optim.build import build_optimizer, use_fused_optimizer
from accel_ddp.transforms.fused_activations import fuse_activations
from benchmarks.ops_per_step import SKIP, TARGET, OpCounter, difference
from tests.helpers.multiproc import run_ranks

STEPS = 12  # counted after the first SKIP; one log line among them (--log_every 10)
BATCH = 8


def blocks(data_dir, download):
    """``--dataset tests.step.test_update:blocks``: packed token blocks for the tiny GPT-2 (16 steps of 8)."""
    generator = torch.Generator().manual_seed(0)
    make = lambda n: TokenBlocks(torch.randint(2, 48, (n, 32), generator=generator))  # noqa: E731
    return DatasetBundle(make(16 * BATCH), make(BATCH), num_classes=48, input_shape=(32,))


def _accel(args: list[str]) -> dict[str, float]:
    from accel_ddp.loop import train

    with OpCounter() as ops:
        train(parse_args([*args, "--global_batch_size", str(BATCH), "--max_steps", str(SKIP + STEPS),
                          "--eval_every", "1000"]))
    return ops.per_step(SKIP, STEPS)


def _bare(model: torch.nn.Module, inputs: torch.Tensor, labels: torch.Tensor | None, loss_of) -> dict[str, float]:
    """The hand-written loop: data already normalised in memory, gather, forward, loss, backward, clip, step."""
    fuse_activations(model)  # as accel_ddp's --fused_kernels default (benchmarks/bare_ddp.py does the same)
    optimizer = build_optimizer("adamw", model, 3e-3, 0.0, fused=use_fused_optimizer("adamw", "cpu"))
    params = list(model.parameters())
    indices = torch.randperm(len(inputs))[:(SKIP + STEPS) * BATCH].view(-1, BATCH)
    with OpCounter() as ops:
        for step in range(SKIP + STEPS):
            index = indices[step]
            x = torch.index_select(inputs, 0, index)
            loss = loss_of(model, x, None if labels is None else torch.index_select(labels, 0, index))
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return ops.per_step(SKIP, STEPS)


def _digits_bare() -> dict[str, float]:
    data = build_datasets("digits", "data", False).train
    model = build_model("mlp", 10, (64,), hidden_size=256)
    return _bare(model, data.transform(data.inputs), data.labels,
                 lambda model, x, y: torch.nn.functional.cross_entropy(model(x), y))


def _gpt_bare() -> dict[str, float]:
    from tests.helpers.text import tiny_gpt

    def next_token_loss(model, ids, _):  # the mean next-token cross-entropy, as benchmarks/bare_ddp.py's lm
        logits = model(input_ids=ids).logits
        labels = torch.nn.functional.pad(ids[:, 1:], (0, 1), value=-100)
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100)

    return _bare(tiny_gpt(), blocks("", False).train.inputs, None, next_token_loss)


@pytest.mark.parametrize("workload", ["digits_mlp", "tiny_gpt2"])
def test_accel_ddp_dispatches_at_most_3_ops_per_step_more_than_a_bare_loop(workload, tmp_path):
    """The digits MLP (the device loader's normalised uint8 data, a mean loss) and the tiny GPT-2 on packed blocks
    (causal_lm's token-exact (sum, items) loss), each against the bare loop's work; the extra ops are named."""
    if workload == "digits_mlp":
        args, bare = ["--dataset", "digits", "--model", "mlp"], _digits_bare
    else:
        pytest.importorskip("transformers")
        args = ["--task", "causal_lm", "--dataset", "tests.step.test_update:blocks", "--model",
                "tests.helpers.text:build_gpt"]
        bare = _gpt_bare
    [accel] = run_ranks(lambda: _accel([*args, "--output_dir", str(tmp_path)]), world_size=1)
    [plain] = run_ranks(bare, world_size=1)
    extra = Counter(difference(accel, plain))
    assert sum(accel.values()) <= sum(plain.values()) + TARGET, f"{workload}: accel_ddp - bare per step: {extra}"
