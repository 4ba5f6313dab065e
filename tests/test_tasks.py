"""The task protocol (accel_ddp/tasks.py): dict batches, Transformers models, user losses and metrics,
token-exact accumulation, exact eval counts, text data, resume and outputs of Transformers runs.

Multi-process tests run on forked gloo ranks (tests/multiproc.py). transformers is imported here, in the
test process, so that the forked ranks start with it loaded.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import GPT2Config, GPT2LMHeadModel  # noqa: E402

from accel_ddp import TrainConfig, train  # noqa: E402
from accel_ddp.data.text import PadCollate  # noqa: E402
from accel_ddp.tasks import IGNORE_INDEX  # noqa: E402
from tests.conftest import load_weights, run_ranks  # noqa: E402

VOCAB = 48


def tiny_gpt(vocab: int = VOCAB, positions: int = 32, dropout: float = 0.0) -> GPT2LMHeadModel:
    """A two-layer GPT-2 small enough for a CPU test step in milliseconds."""
    config = GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=vocab, n_positions=positions,
                        resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout, bos_token_id=1, eos_token_id=1)
    return GPT2LMHeadModel(config)


class Sequences(torch.utils.data.Dataset):
    """Token sequences of 3 to 16 tokens: samples are dicts {"input_ids": 1-D tensor}."""

    def __init__(self, count: int, seed: int = 0, min_len: int = 3, max_len: int = 16):
        generator = torch.Generator().manual_seed(seed)
        lengths = torch.randint(min_len, max_len + 1, (count,), generator=generator)
        self.rows = [torch.randint(2, VOCAB, (int(n),), generator=generator) for n in lengths]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.rows[index]}


def token_mean(outputs, batch):
    """A per-micro-batch token mean: what a mean-of-means implementation averages."""
    logits, labels = outputs.logits[:, :-1], batch["input_ids"][:, 1:].masked_fill(batch["attention_mask"][:, 1:] == 0,
                                                                                   IGNORE_INDEX)
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX)


def _lm_run(out: Path, world: int, per_device: int, loss_fn=None, steps: int = 24, **cfg) -> dict:
    def fn():
        torch.manual_seed(0)
        model = tiny_gpt()
        config = TrainConfig(task="causal_lm", global_batch_size=8, per_device_batch_size=per_device, max_steps=steps,
                             optimizer="sgd", lr=0.2, lr_schedule="constant", max_grad_norm=0, log_every=4,
                             output_dir=str(out), **cfg)
        return train(config, model=model, train_dataset=Sequences(96), eval_dataset=Sequences(23, seed=1),
                     loss_fn=loss_fn)

    return run_ranks(fn, world_size=world)[0]


def _max_difference(a: Path, b: Path) -> float:
    wa, wb = load_weights(a), load_weights(b)
    assert wa.keys() == wb.keys()
    return max((wa[k] - wb[k]).abs().max().item() for k in wa)


@pytest.mark.parametrize("loss", ["token_exact", "mean_of_means"])
def test_token_exact_accumulation_gives_one_gradient_whatever_the_layout(tmp_path, loss):
    """2 ranks x 4, 1 process x 8 and 1 process x 2 with 4 accumulation micro-steps: the same weights after 24 steps
    when each step's gradient is grad(total loss / total tokens); a mean of micro-batch means differs."""
    loss_fn = None if loss == "token_exact" else token_mean
    runs = {name: tmp_path / name for name in ("2x4", "1x8", "1x2")}
    _lm_run(runs["2x4"], 2, 4, loss_fn)
    _lm_run(runs["1x8"], 1, 8, loss_fn)
    summary = _lm_run(runs["1x2"], 1, 2, loss_fn)
    assert summary["grad_accum_steps"] == 4 and summary["optimizer_steps"] == 24
    differences = {name: _max_difference(runs[name], runs["1x8"]) for name in ("2x4", "1x2")}
    print(f"{loss}: largest weight difference against 1 process x 8: {differences}")
    if loss == "token_exact":
        assert all(d < 1e-6 for d in differences.values()), differences
        torch.manual_seed(0)
        initial = tiny_gpt().state_dict()  # sanity: training moved the weights far beyond the tolerance
        trained = load_weights(runs["1x8"])
        key = "transformer.h.0.mlp.c_fc.weight"
        assert (trained[key] - initial[key]).abs().max() > 1e-2
    else:
        assert all(d > 1e-4 for d in differences.values()), differences


# ----------------------------------------------------------------------------- evaluation counts each item once


class SeenCounter:
    """A user metric: sequences and real tokens it was shown, and the next-token accuracy from the gathered logits."""

    def __init__(self):
        self.sequences = self.tokens = self.hits = self.predicted = 0

    def update(self, outputs, batch):
        self.sequences += len(batch["input_ids"])
        self.tokens += int(batch["attention_mask"].sum())
        mask = batch["attention_mask"][:, 1:] == 1
        predictions = outputs.logits[:, :-1].argmax(-1)
        self.hits += int(((predictions == batch["input_ids"][:, 1:]) & mask).sum())
        self.predicted += int(mask.sum())

    def compute(self):
        return {"sequences": self.sequences, "eval_real_tokens": self.tokens, "my_accuracy": self.hits / self.predicted}


def _evaluate_lm(world: int, count: int = 23, batch_size: int = 4) -> list[dict]:
    def fn():
        from accel_ddp.data.loaders import build_eval_loader
        from accel_ddp.evaluate import evaluate
        from accel_ddp.loop import build_accelerator
        from accel_ddp.tasks import build_task

        accelerator, _, _ = build_accelerator(TrainConfig(global_batch_size=2))
        torch.manual_seed(0)
        model = accelerator.prepare(tiny_gpt())
        loader = accelerator.prepare(build_eval_loader(Sequences(count, seed=1), batch_size, 0, PadCollate(0)))
        return evaluate(accelerator, model, loader, build_task("causal_lm", metrics=[SeenCounter()]))

    return run_ranks(fn, world_size=world)


def test_eval_of_an_odd_set_of_variable_length_sequences_is_exact_at_any_world_size():
    one, (rank0, rank1) = _evaluate_lm(1)[0], _evaluate_lm(2)
    assert rank0 == rank1 == one  # every figure, bit for bit
    lengths = [len(row) for row in Sequences(23, seed=1).rows]
    assert one["eval_samples"] == one["eval_sequences"] == 23
    assert one["eval_real_tokens"] == sum(lengths)  # the padding of the gathered batches is not counted
    assert one["eval_tokens"] == sum(n - 1 for n in lengths)  # each sequence predicts all but its first token
    assert one["eval_my_accuracy"] == one["eval_accuracy"]  # the user metric saw the same gathered logits
    assert one["eval_perplexity"] == pytest.approx(math.exp(one["eval_loss"]))
    # The reference: each sequence on its own, no padding, no batching.
    torch.manual_seed(0)
    model = tiny_gpt().eval()
    with torch.no_grad():
        total = sum(torch.nn.functional.cross_entropy(model(row[None]).logits[0, :-1], row[1:], reduction="sum")
                    for row in Sequences(23, seed=1).rows)
    assert one["eval_loss"] == pytest.approx(total.item() / one["eval_tokens"], rel=1e-6)
