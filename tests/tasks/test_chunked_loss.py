"""--chunked_loss: the causal-LM loss in chunks of tokens, equal to the plain loss in value and gradients."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

transformers = pytest.importorskip("transformers")

from accel_ddp import TrainConfig, train  # noqa: E402
from accel_ddp.tasks.chunked_loss import HiddenStatesHead, linear_cross_entropy, split_output_layer  # noqa: E402
from accel_ddp.tasks.protocol import IGNORE_INDEX, build_task  # noqa: E402
from accel_ddp.util.validation import ConfigError  # noqa: E402
from tests.helpers.multiproc import run_ranks  # noqa: E402
from tests.helpers.runs import load_weights  # noqa: E402
from tests.helpers.text import Sequences, tiny_gpt  # noqa: E402


def _inputs(tokens=70, hidden=24, vocab=301, bias=True, seed=0):
    generator = torch.Generator().manual_seed(seed)
    h = torch.randn(tokens, hidden, generator=generator)
    w = torch.randn(vocab, hidden, generator=generator) / hidden**0.5
    b = torch.randn(vocab, generator=generator) if bias else None
    y = torch.randint(0, vocab, (tokens,), generator=generator)
    y[::9] = IGNORE_INDEX
    return h, w, b, y


def _grads(fn, *tensors):
    leaves = [None if t is None else t.detach().clone().requires_grad_() for t in tensors]
    value = fn(*leaves)
    value.backward()
    return value.detach(), [None if t is None else t.grad for t in leaves]


def _relative(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("rows", [7, 70, 1000])
def test_fp32_values_and_gradients_equal_the_plain_loss(rows):
    """Chunks of 7 (the last one short), one chunk, and a chunk larger than the tokens: within 1e-5 relative."""
    h, w, b, y = _inputs()

    def plain(h, w, b):
        return F.cross_entropy(F.linear(h, w, b), y, reduction="sum", ignore_index=IGNORE_INDEX)

    want, want_grads = _grads(plain, h, w, b)
    got, got_grads = _grads(lambda h, w, b: linear_cross_entropy(h, w, b, y, rows=rows), h, w, b)
    assert got.dtype == torch.float32 and _relative(got, want) < 1e-5
    for got_grad, want_grad in zip(got_grads, want_grads, strict=True):
        assert _relative(got_grad, want_grad) < 1e-5


def test_bf16_matmuls_stay_within_the_plain_bf16_loss_tolerance():
    """compute_dtype bf16 (the matmuls in bf16, softmax and sums in fp32) against the fp32 loss: within 1e-2
    relative in value and 2e-2 in gradients, as close as the plain loss under bf16 autocast gets."""
    h, w, b, y = _inputs(tokens=64, hidden=32, vocab=257)

    def plain(h, w, b):
        return F.cross_entropy(F.linear(h, w, b), y, reduction="sum", ignore_index=IGNORE_INDEX)

    exact, exact_grads = _grads(plain, h, w, b)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        autocast, autocast_grads = _grads(lambda h, w, b: F.cross_entropy(F.linear(h, w, b).float(), y,
                                                                          reduction="sum", ignore_index=-100), h, w, b)
    got, got_grads = _grads(lambda h, w, b: linear_cross_entropy(h, w, b, y, torch.bfloat16, rows=16), h, w, b)
    assert _relative(got, exact) < 1e-2 and _relative(autocast, exact) < 1e-2
    assert all(g.dtype == torch.float32 for g in got_grads)  # the fp32 parameters get fp32 gradients
    for got_grad, exact_grad, autocast_grad in zip(got_grads, exact_grads, autocast_grads, strict=True):
        assert _relative(got_grad, exact_grad) < 2e-2
        assert _relative(got_grad, exact_grad) < 3 * _relative(autocast_grad, exact_grad) + 1e-3


def test_fp16_loss_scaling_reaches_the_gradients_in_fp32():
    """A loss scaled by 2**24 (fp16's largest finite is 65504): the weight's gradient is float32, finite and the
    unscaled gradient times the scale, where an fp16 gradient of the logits would have overflowed to inf."""
    h, w, b, y = _inputs(tokens=32, hidden=16, vocab=97, bias=False)
    scale = 2.0**24
    _, (want_h, want_w) = _grads(lambda h, w: F.cross_entropy(h @ w.T, y, reduction="sum"), h, w)
    _, (got_h, got_w) = _grads(lambda h, w: linear_cross_entropy(h, w, None, y, torch.float16) * scale, h, w)
    assert got_w.dtype == torch.float32 and torch.isfinite(got_w).all() and torch.isfinite(got_h).all()
    assert _relative(got_w / scale, want_w) < 5e-3 and _relative(got_h / scale, want_h) < 5e-3
    assert not torch.isfinite((want_w * scale).half()).all()  # the same gradient held in fp16 overflows


class _Ops(TorchDispatchMode):
    """Every ATen op run under it: (name, first input's shape and dtype, output's shape, dtype and storage)."""

    def __init__(self):
        super().__init__()
        self.rows = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        first = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if isinstance(out, torch.Tensor):
            self.rows.append((func.__name__, None if first is None else (tuple(first.shape), first.dtype),
                              tuple(out.shape), out.dtype, out.untyped_storage().data_ptr()))
        return out


def _forward_ops(h, w, b, y, *, frozen_head: bool):
    h, w = h.clone().requires_grad_(), w.clone().requires_grad_(not frozen_head)
    with _Ops() as ops:
        value = linear_cross_entropy(h, w, b, y, torch.bfloat16, rows=16)
    value.backward()
    return ops.rows, h.grad, w.grad


def test_each_chunk_casts_its_softmax_gradient_once_and_adds_dw_in_place():
    """bf16 matmuls, 4 chunks of 16 tokens: one cast of each chunk's (16, V) float32 softmax gradient (not one per
    matmul), and a single float32 (V, H) tensor in the forward, the accumulator (no float32 copy of each chunk's
    product to add); the values as the plain loss's within bf16's tolerance (as above)."""
    h, w, _, y = _inputs(tokens=64, hidden=32, vocab=257, bias=False)
    rows, got_h, got_w = _forward_ops(h, w, None, y, frozen_head=False)
    chunk = {((16, 257), torch.float32), ((257, 16), torch.float32)}  # the chunk's gradient, either way round
    casts = [r for r in rows if r[0].startswith("_to_copy") and r[1] in chunk]
    assert len(casts) == 4 and all(r[3] == torch.bfloat16 for r in casts)
    assert len({r[4] for r in rows if r[2:4] == ((257, 32), torch.float32)}) == 1
    _, (want_h, want_w) = _grads(lambda h, w: F.cross_entropy(h @ w.T, y, reduction="sum", ignore_index=-100), h, w)
    assert _relative(got_h, want_h) < 2e-2 and _relative(got_w, want_w) < 2e-2


def test_a_frozen_output_layer_gets_no_gradient_and_none_is_computed():
    """A frozen head (LoRA's base): no weight gradient, and no (V, H) product made for one; the hidden states'
    gradient is the plain loss's."""
    h, w, b, y = _inputs(tokens=64, hidden=32, vocab=257)
    rows, got_h, got_w = _forward_ops(h, w, b.requires_grad_(False), y, frozen_head=True)
    assert got_w is None
    assert not [r for r in rows if r[2] == (257, 32) and r[0] != "_to_copy.default"]  # only the weight's bf16 copy
    assert not [r for r in rows if r[2] == (257,) and r[3] == torch.float32 and r[0].startswith("zeros")]  # no dbias
    _, (want_h,) = _grads(lambda h: F.cross_entropy(F.linear(h, w, b), y, reduction="sum", ignore_index=-100), h)
    assert _relative(got_h, want_h) < 2e-2


def _lm_batch():
    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(2, 48, (4, 12), generator=generator)
    mask = torch.ones_like(ids)
    mask[1, 8:] = 0  # padding: ignored
    return {"input_ids": ids, "attention_mask": mask}


def test_a_split_gpt2_trains_on_the_same_loss_and_gradients_and_keeps_its_weights_names_and_eval_logits():
    batch = _lm_batch()
    torch.manual_seed(0)
    plain_model, task = tiny_gpt(), build_task("causal_lm")
    torch.manual_seed(0)
    split_model, split_task = tiny_gpt(), build_task("causal_lm")
    names = list(split_model.state_dict())
    split_task.split_head = head = split_output_layer(split_model)
    assert isinstance(split_model.lm_head, HiddenStatesHead) and list(split_model.state_dict()) == names
    assert split_model.lm_head.weight is split_model.transformer.wte.weight  # still tied
    want = task.training_loss(plain_model, batch)
    got = split_task.training_loss(split_model, batch)
    assert split_model(**{k: batch[k] for k in ("input_ids",)}).logits.shape[-1] == 32  # hidden states in training
    assert int(got.items) == int(want.items) == 4 * 11 - 4
    assert _relative(got.value, want.value) < 1e-5
    want.value.backward()
    got.value.backward()
    split_grads = dict(split_model.named_parameters())
    for name, param in plain_model.named_parameters():
        assert _relative(split_grads[name].grad, param.grad) < 1e-4, name
    split_model.eval()
    plain_model.eval()
    assert not head.training
    with torch.no_grad():
        torch.testing.assert_close(split_model(**batch).logits, plain_model(**batch).logits)
        torch.testing.assert_close(split_task.eval_stats(split_model(**batch), batch),
                                   task.eval_stats(plain_model(**batch), batch))


def test_a_model_it_cannot_split_is_refused_with_one_line():
    with pytest.raises(ConfigError, match="no plain nn.Linear output layer.*drop --chunked_loss"):
        split_output_layer(torch.nn.Sequential(torch.nn.Linear(4, 4)))
    capped = transformers.Gemma2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                       num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    assert capped.final_logit_softcapping is not None
    with pytest.raises(ConfigError, match="final_logit_softcapping"):
        split_output_layer(transformers.Gemma2ForCausalLM(capped))
    with pytest.raises(ConfigError, match="--chunked_loss under FSDP"):
        split_output_layer(tiny_gpt(), sharded=True)
    with pytest.raises(ConfigError, match="--chunked_loss computes --task causal_lm's own loss"):
        TrainConfig(chunked_loss=True)  # --task classification
    with pytest.raises(ConfigError, match="not --loss"):
        TrainConfig(chunked_loss=True, task="causal_lm", loss="tests.tasks.test_chunked_loss:_lm_batch")


def test_two_ranks_with_chunked_loss_end_with_the_weights_of_the_plain_loss(tmp_path):
    """Through train() on 2 forked ranks under DDP (the output layer's weight gets its gradient outside the
    model's forward, tied to the embeddings): the same weights after 6 SGD steps within 1e-5 (AdamW would divide
    float rounding by its tiny second moments)."""

    def run(out, **cfg):
        def fn():
            torch.manual_seed(0)
            config = TrainConfig(task="causal_lm", global_batch_size=8, max_steps=6, optimizer="sgd", lr=0.2,
                                 log_every=3, output_dir=str(out), **cfg)
            model = tiny_gpt()
            summary = train(config, model=model, train_dataset=Sequences(64), eval_dataset=Sequences(16, seed=1))
            return summary, type(model.lm_head).__name__

        return run_ranks(fn, world_size=2)[0]

    (plain, plain_head), (chunked, chunked_head) = run(tmp_path / "plain"), run(tmp_path / "chunked", chunked_loss=True)
    assert (plain_head, chunked_head) == ("Linear", "HiddenStatesHead")
    assert chunked["eval_loss"] == pytest.approx(plain["eval_loss"], rel=1e-5)
    a, b = load_weights(tmp_path / "plain"), load_weights(tmp_path / "chunked")
    assert a.keys() == b.keys()
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-5
    torch.manual_seed(0)
    initial = tiny_gpt().state_dict()["transformer.wte.weight"]
    assert (a["transformer.wte.weight"] - initial).abs().max() > 1e-3  # trained far beyond the tolerance
