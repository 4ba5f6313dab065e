"""``--chunked_loss``: the causal-LM loss without the ``(tokens, vocabulary)`` float32 logits in memory.

The plain loss has the model's output layer write ``(B, T, V)`` logits (bf16 under autocast), then
upcasts them to float32 for the cross-entropy, and its backward makes another tensor of that size: at
GPT-2's vocabulary (50,304) and 16 x 1024 tokens, 3.3 GB in float32 per copy. Here the output layer of
a Transformers causal LM is split off (:func:`split_output_layer`): in training the model returns its
last hidden states ``(B, T, H)`` instead of logits, and :func:`linear_cross_entropy` multiplies them by
the output layer's weight a chunk of tokens at a time (the chunk's logits in float32, about
``CHUNK_BYTES``), adds up the loss and makes that chunk's gradients right away (the gradient of a
summed cross-entropy is ``softmax - one_hot``), so no chunk's logits outlive it and the backward only
scales the stored gradients by the incoming one (a custom ``autograd.Function``, as Liger Kernel's
fused linear cross-entropy does; recomputing each chunk with ``torch.utils.checkpoint`` would cost a
second matmul). The matmuls run in the run's autocast dtype (bf16/fp16, ``compute_dtype``), the
softmax, the loss and the gradients' accumulation in float32; under fp16 the loss scale reaches the
gradients in float32, so a scaled gradient does not overflow here (the scaler's inf check is unchanged).

In evaluation (the model in eval mode) the layer computes its logits as before: the eval statistics
(accuracy) need them. The layer keeps its parameter under the same name (``lm_head.weight``, tied to the
embeddings where the model ties them): checkpoints, ``model.safetensors`` and ``hf_model/`` are unchanged.
GPU-only in its purpose and unmeasured on a GPU (docs/performance.md); equal to the plain loss within
float rounding (tests/tasks/test_chunked_loss.py: fp32 1e-5 relative, bf16 2e-2).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from accel_ddp.config.views import config_section
from accel_ddp.util.converters import ModelBuild, ModelConverter
from accel_ddp.util.precision import autocast_dtype
from accel_ddp.util.validation import ConfigError

IGNORE_INDEX = -100  # as accel_ddp.tasks.protocol: labels that count for nothing
CHUNK_BYTES = 256 * 2**20  # float32 logits of one chunk (and its softmax): the loss's peak memory
# Config attributes of models whose logits are not just lm_head(hidden): soft-capped (Gemma 2), scaled (Cohere,
# Granite, MiniCPM's scale_width), or divided by a temperature-like width factor. Refused: the split would skip it.
LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "scale_width", "output_multiplier")


class HiddenStatesHead(torch.nn.Module):
    """The output layer, split: in training mode its input (the hidden states) passes through unchanged; in
    eval mode it is the ``nn.Linear`` it replaces. ``weight`` (and ``bias``) are that layer's own parameters."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.training:
            return hidden
        return F.linear(hidden, self.weight, self.bias)


def split_output_layer(model: torch.nn.Module, sharded: bool = False) -> HiddenStatesHead:
    """Replace a Transformers causal LM's output layer by a :class:`HiddenStatesHead` (in place, before DDP wraps
    the model) and return it; a model it cannot split is refused with one line. ``sharded`` (FSDP2): refused, the
    layer's weight is gathered only inside the model's forward, and the loss uses it outside."""
    if sharded:
        raise ConfigError("--chunked_loss under FSDP: the output layer's sharded weight is gathered only inside the "
                          "model's forward, and the chunked loss needs it outside; drop --chunked_loss")
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    name = type(model).__name__
    if not isinstance(head, torch.nn.Linear) or type(head) is not torch.nn.Linear:
        raise ConfigError(f"--chunked_loss: {name} has no plain nn.Linear output layer (get_output_embeddings()) to "
                          "split off; it needs a Transformers causal LM (GPT-2, Llama, ...): drop --chunked_loss")
    config = getattr(model, "config", None)
    transformed = [attr for attr in LOGIT_TRANSFORMS if getattr(config, attr, None) not in (None, 1, 1.0)]
    if transformed:
        raise ConfigError(f"--chunked_loss: {name} changes its logits after the output layer ({transformed[0]} in "
                          "its config), which the chunked loss would skip; drop --chunked_loss")
    split = HiddenStatesHead(head)
    setter = getattr(model, "set_output_embeddings", None)
    if callable(setter):
        setter(split)
    if model.get_output_embeddings() is not split:
        raise ConfigError(f"--chunked_loss: {name} did not take a new output layer (set_output_embeddings); "
                          "drop --chunked_loss")
    return split


def chunk_rows(vocab: int) -> int:
    """Tokens per chunk: ``CHUNK_BYTES`` of float32 logits, at least 128."""
    return max(128, CHUNK_BYTES // (4 * vocab))


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, labels: torch.Tensor,
                         compute_dtype: torch.dtype | None = None, rows: int | None = None) -> torch.Tensor:
    """``F.cross_entropy(F.linear(hidden, weight, bias).float(), labels, reduction="sum", ignore_index=-100)``
    over the flattened tokens, in chunks of ``rows`` tokens (default :func:`chunk_rows`).

        >>> h, w, y = torch.randn(6, 4), torch.randn(10, 4), torch.tensor([1, 2, -100, 3, 4, 5])
        >>> torch.allclose(linear_cross_entropy(h, w, None, y),
        ...                F.cross_entropy(h @ w.T, y, reduction="sum", ignore_index=-100))
        True
    """
    hidden, labels = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
    dtype = compute_dtype or hidden.dtype
    return _LinearCrossEntropy.apply(hidden, weight, bias, labels, dtype, rows or chunk_rows(weight.shape[0]))


class _LinearCrossEntropy(torch.autograd.Function):
    """The summed loss in the forward, with each chunk's gradients made there; the backward scales them.

    Only the gradients autograd asks for are made: a frozen output layer (LoRA's base) gets no ``dW``, the
    ``(V, H)`` product that costs as much as the logits. Per chunk the softmax gradient is cast to the matmuls'
    dtype once, and ``dW`` is added into its float32 accumulator in place (:func:`_add_weight_grad`)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, dtype, rows):
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        need_bias = need_bias and bias is not None
        w = weight.to(dtype)
        fp32 = torch.float32
        total = torch.zeros((), dtype=fp32, device=hidden.device)
        grad_hidden = torch.empty(hidden.shape, dtype=fp32, device=hidden.device) if need_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=fp32, device=weight.device) if need_weight else None
        grad_bias = torch.zeros(weight.shape[0], dtype=fp32, device=weight.device) if need_bias else None
        for start in range(0, hidden.shape[0], rows):
            h, y = hidden[start:start + rows].to(dtype), labels[start:start + rows]
            logits = (h @ w.T).float()
            if bias is not None:
                logits += bias.float()
            valid = y != IGNORE_INDEX
            target = torch.where(valid, y, 0)
            lse = torch.logsumexp(logits, dim=-1)
            total += ((lse - logits.gather(1, target[:, None]).squeeze(1)) * valid).sum()
            if not (need_hidden or need_weight or need_bias):
                continue
            # d(sum of -log softmax[target]) / d logits = softmax - one_hot(target), zero on ignored tokens
            grad = logits.sub_(lse[:, None]).exp_()
            grad[torch.arange(len(y), device=y.device), target] -= 1
            grad *= valid[:, None]
            low = grad.to(dtype)  # the one cast of the chunk (none in fp32): both matmuls read it
            if need_hidden:
                grad_hidden[start:start + rows] = low @ w  # cast to float32 on the copy into the rows
            if need_weight:
                _add_weight_grad(grad_weight, low, grad, h)
            if need_bias:
                grad_bias += grad.sum(0)
        ctx.save_for_backward(grad_hidden, grad_weight, grad_bias)
        ctx.dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        return total

    @staticmethod
    def backward(ctx, grad_total):
        grad_hidden, grad_weight, grad_bias = ctx.saved_tensors
        scale = grad_total.float()  # under fp16 the loss scale: applied in float32, cast once at the end
        hidden_dtype, weight_dtype, bias_dtype = ctx.dtypes
        return ((grad_hidden * scale).to(hidden_dtype) if ctx.needs_input_grad[0] else None,
                (grad_weight * scale).to(weight_dtype) if ctx.needs_input_grad[1] else None,
                (grad_bias * scale).to(bias_dtype) if ctx.needs_input_grad[2] and grad_bias is not None else None,
                None, None, None)


def _add_weight_grad(grad_weight: torch.Tensor, low: torch.Tensor, grad: torch.Tensor, h: torch.Tensor) -> None:
    """``grad_weight += low.T @ h`` into the float32 accumulator, without a ``(V, H)`` temporary.

    Same dtype (fp32 runs): ``addmm_`` in place. bf16/fp16 on CUDA: ``torch.addmm(..., out_dtype=float32,
    out=grad_weight)``, the half-precision product accumulated in float32 by the GEMM itself (torch's ``addmm``
    ``out_dtype`` overload, CUDA only: ``aten::addmm.dtype_out``). Elsewhere (the CPU has no such kernel) the float32
    softmax gradient itself times the chunk's hidden states, in place: a float32 matmul of the same inputs."""
    if low.dtype == grad_weight.dtype:
        grad_weight.addmm_(low.T, h)
        return
    if grad_weight.device.type == "cuda":
        try:
            torch.addmm(grad_weight, low.T, h, out_dtype=grad_weight.dtype, out=grad_weight)
            return
        except (TypeError, NotImplementedError, RuntimeError):  # an older torch, or a GPU without that GEMM
            pass  # the dispatch failed before writing: the float32 matmul below
    grad_weight.addmm_(grad.T, h.to(grad_weight.dtype))


@config_section
@dataclass(frozen=True)
class ChunkedLossOptions:
    """What ``CHUNKED_LOSS`` reads (config/views.py)."""

    chunked_loss: bool


def _split_for_loss(model: torch.nn.Module, options: ChunkedLossOptions,
                    build: ModelBuild) -> tuple[torch.nn.Module, str]:
    """Before DDP wraps it: training forwards return hidden states, the task applies the layer."""
    build.task.split_head = split_output_layer(model, sharded=build.accelerator.is_fsdp2)
    build.task.compute_dtype = autocast_dtype(build.accelerator.mixed_precision)  # None: the hidden states' dtype
    return model, "output layer chunked into the loss (--chunked_loss)"


CHUNKED_LOSS = ModelConverter("chunked_loss", ChunkedLossOptions, applies=lambda o: o.chunked_loss,
                              apply=_split_for_loss, training_only=True)  # in assemble.MODEL_CONVERTERS
