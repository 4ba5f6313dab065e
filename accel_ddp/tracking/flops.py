"""Model FLOPs per sample or token, the device's peak dense FLOP/s, and MFU.

    flops = ModelFlops(model)              # how: "6N+12LdT" (Transformers) or "counted" (FlopCounterMode), or None
    flops.of_batch(batch)                  # (FLOPs of one forward+backward, samples, positions): host-side shapes
    peak = peak_flops("NVIDIA H100 80GB HBM3", "bf16")   # 989.4e12; None where the device is not in the table
    mfu(achieved_per_device, peak)         # None without a peak

Model FLOPs follow the MFU convention (PaLM, arXiv:2204.02311 appendix B): the matmul FLOPs of the
model's forward and backward, without recomputation, without the optimizer, without element-wise
work. Two ways to get them, both host-only, never touching the device:

- Transformers models (a ``config`` with layers and a hidden size): ``6N + 12*L*d*T`` per token,
  ``T`` the processed sequence length, ``d`` the attention width (heads x head size), ``N`` every
  parameter but lookup-only embedding tables (position embeddings; a token embedding counts only
  when it is tied to the output layer, whose matmul is real). nanoGPT's ``estimate_mfu`` and
  torchtitan's ``get_num_flop_per_token`` use the same formula. A frozen parameter (a LoRA base) counts
  4 a token, not 6: it gets no weight gradient (``6*Nt + 4*Nf + 12*L*d*T``).
- Any other model built of torch's, accel_ddp's or Transformers' modules:
  ``torch.utils.flop_counter.FlopCounterMode`` over one forward and backward of a one-sample batch on
  the meta device (no memory, no compute; parameters swapped in with ``torch.func.functional_call``,
  the model untouched). Only ops with registered formulas count
  (matmuls, convolutions, attention), as the convention asks; the backward is counted, not taken
  as 2x the forward (a first layer computes no input gradient).

A model with modules of its user's own gets no figure (null): its forward is never called outside
training (it may count its calls, print, draw random numbers). The figure is computed once per batch
shape and cached, so the per-micro-step cost is a dict lookup.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

# At import, not at the first batch: a process that gave up its privileges since (or lost its venv) must not fail.
from torch.func import functional_call
from torch.utils.flop_counter import FlopCounterMode

# Peak dense (no 2:4 sparsity) FLOP/s by device, in TFLOP/s: (name tokens, full SM count, {precision: peak}).
# Datasheets quote "with sparsity" (2x); these are half that. Most specific names first: "H100 PCIE" before
# "H100", "L40S" before "L4". Sources: NVIDIA's data-center datasheets (h100, h200, a100, l40s, l4, a10, v100,
# t4); H100/H200/A100/L40S as in torchtitan's get_peak_flops (torchtitan/tools/utils.py); H100 TF32/FP32 as in
# NVIDIA's H100 datasheet (BF16 989.4, TF32 494.7, FP32 66.9). A10G (AWS) has no NVIDIA datasheet: absent.
PEAK_TFLOPS: tuple[tuple[tuple[str, ...], int | None, dict[str, float]], ...] = (
    (("H100", "PCIE"), 114, {"bf16": 756.0, "tf32": 378.0, "fp32": 51.0}),
    (("H100", "NVL"), 132, {"bf16": 835.0, "tf32": 417.5, "fp32": 60.0}),
    (("H100",), 132, {"bf16": 989.4, "tf32": 494.7, "fp32": 66.9}),  # SXM5: its name lacks "SXM"
    (("H200", "NVL"), 132, {"bf16": 835.0, "tf32": 417.5, "fp32": 60.0}),
    (("H200",), 132, {"bf16": 989.4, "tf32": 494.7, "fp32": 66.9}),
    (("GH200",), 132, {"bf16": 989.4, "tf32": 494.7, "fp32": 66.9}),
    (("B200",), None, {"bf16": 2250.0, "tf32": 1125.0}),
    (("A100",), 108, {"bf16": 312.0, "tf32": 156.0, "fp32": 19.5}),
    (("L40S",), 142, {"bf16": 362.0, "tf32": 183.0, "fp32": 91.6}),
    (("L4",), 58, {"bf16": 121.0, "tf32": 60.0, "fp32": 30.3}),
    (("A10",), 72, {"bf16": 125.0, "tf32": 62.5, "fp32": 31.2}),
    (("V100",), 80, {"fp16": 125.0, "fp32": 15.7}),  # no BF16 tensor cores
    (("T4",), 40, {"fp16": 65.0, "fp32": 8.1}),
    (("RTX", "4090"), 128, {"bf16": 165.2, "tf32": 82.6, "fp32": 82.6}),
)


def precision_of(mixed_precision: str, tf32: bool) -> str | None:
    """The peak to compare with: bf16/fp16 autocast -> their tensor peak; fp32 -> TF32 when allowed, else FP32.

    fp8 gives None: Accelerate's fp8 runs only some layers in fp8, so neither peak is the honest one."""
    if mixed_precision in ("bf16", "fp16"):
        return mixed_precision
    if mixed_precision in ("no", None):
        return "tf32" if tf32 else "fp32"
    return None


def _words(name: str) -> set[str]:
    return set(name.upper().replace("-", " ").replace("_", " ").split())


def peak_flops(device_name: str | None, precision: str | None, sm_count: int | None = None) -> float | None:
    """Peak dense FLOP/s of ``device_name`` (``torch.cuda.get_device_name``) at ``precision``; None when unknown.

    Name tokens match whole words ("L4" is not "L40S"; "A10" is not "A100" nor "A10G"). ``sm_count``
    (``get_device_properties().multi_processor_count``) below the full chip's (a MIG slice) scales the
    peak down. fp16 on a device listed with bf16 only takes the bf16 figure (the same tensor cores).

        >>> peak_flops("NVIDIA A100-SXM4-80GB", "bf16")
        312000000000000.0
    """
    if not device_name or precision is None:
        return None
    words = _words(device_name)
    for tokens, full_sms, peaks in PEAK_TFLOPS:
        if all(token in words for token in tokens):
            tflops = peaks.get(precision, peaks.get("bf16") if precision == "fp16" else None)
            if tflops is None:
                return None
            share = min(sm_count / full_sms, 1.0) if sm_count and full_sms else 1.0
            return tflops * 1e12 * share
    return None


def device_peak_flops(device: torch.device, mixed_precision: str, tf32: bool) -> tuple[str | None, float | None]:
    """(this rank's device name, its peak dense FLOP/s at the run's precision); (None, None) off CUDA."""
    if device.type != "cuda":
        return None, None
    name = torch.cuda.get_device_name(device)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return name, peak_flops(name, precision_of(mixed_precision, tf32), sms)


def mfu(flops_per_sec_per_device: float | None, peak: float | None) -> float | None:
    """Model FLOPs utilisation: achieved model FLOP/s of one device over its peak; None without both."""
    if not flops_per_sec_per_device or not peak:
        return None
    return flops_per_sec_per_device / peak


def transformer_shape(model: torch.nn.Module) -> tuple[int, int, int] | None:
    """(N matmul parameters, layers L, attention width d) of a Transformers model; None for other models."""
    config = getattr(model, "config", None)
    layers = getattr(config, "num_hidden_layers", None)
    hidden = getattr(config, "hidden_size", None)
    if not isinstance(layers, int) or not isinstance(hidden, int):
        return None
    heads, head_dim = getattr(config, "num_attention_heads", None), getattr(config, "head_dim", None)
    width = heads * head_dim if isinstance(heads, int) and isinstance(head_dim, int) else hidden
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    tied = getattr(output, "weight", None)
    lookups = sum(m.weight.numel() for m in model.modules()
                  if isinstance(m, torch.nn.Embedding) and m.weight is not tied)
    params = sum(p.numel() for p in model.parameters())
    return params - lookups, layers, width


def frozen_matmul_params(model: torch.nn.Module) -> int:
    """Parameters that take part in matmuls but get no gradient (a LoRA base, a frozen head): 4 FLOPs per token
    each, not 6 (the forward's 2 and the input gradient's 2, no weight gradient). Lookup-only embedding tables are
    left out, as in :func:`transformer_shape`."""
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    tied = getattr(output, "weight", None)
    lookups = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding) and m.weight is not tied}
    return sum(p.numel() for p in model.parameters() if not p.requires_grad and id(p) not in lookups)


def counted_flops(model: torch.nn.Module, batch: Any) -> float | None:
    """FLOPs of one forward and backward of ``model`` on a one-sample slice of ``batch``, counted on the meta device.

    None when the model cannot run on meta tensors (data-dependent Python on values, say)."""

    def meta(t: Any) -> Any:
        if isinstance(t, torch.Tensor):
            return torch.empty((1, *t.shape[1:]), dtype=t.dtype, device="meta")
        return t

    params = {k: torch.empty_like(v, device="meta").requires_grad_(v.requires_grad)
              for k, v in model.named_parameters()}
    state = {**params, **{k: torch.empty_like(v, device="meta") for k, v in model.named_buffers()}}
    try:
        # Anomaly mode (--debug) checks each backward's outputs for nan, which meta tensors cannot answer: the count
        # would fail with torch's "Error detected in SumBackward0" warning, a false error. The count is not training.
        with torch.autograd.set_detect_anomaly(False), FlopCounterMode(display=False) as counter:
            if isinstance(batch, Mapping):
                outputs = functional_call(model, state, (), {k: meta(v) for k, v in batch.items()})
            else:
                outputs = functional_call(model, state, (meta(batch[0]),))
            from accel_ddp.util.model_outputs import logits_of

            logits = logits_of(outputs)
            trained = [p for p in params.values() if p.requires_grad]
            if logits is not None and trained and logits.requires_grad:
                torch.autograd.grad(logits.float().sum(), trained, allow_unused=True)
    except Exception:  # noqa: BLE001 - an estimate only: no figure rather than a failed run
        return None
    return float(counter.get_total_flops())


# Where the modules come from whose forward may be run once more on meta tensors to count its FLOPs.
_SIDE_EFFECT_FREE = ("torch.nn.", "accel_ddp.", "transformers.")


class ModelFlops:
    """The model FLOPs of a training batch, computed once per batch shape (host-side: shapes only, no sync).

        flops = ModelFlops(model)
        total, samples, positions = flops.of_batch(batch)   # positions: B*T of a token batch, else samples
    """

    def __init__(self, model: torch.nn.Module):
        from accelerate.utils import extract_model_from_parallel

        # The plain module: a compiled one would compile again for the meta tensors (Accelerate's unwrap keeps it).
        self.model = extract_model_from_parallel(model, keep_torch_compile=False)
        self.shape = transformer_shape(self.model)
        # The meta-device count runs the model's forward once more: only code known to have no side effects of its
        # own (torch's layers, ours, Transformers'). A user's module may count its calls or print: no figure then.
        # A forward hook is a user's code too.
        self.countable = all(type(m).__module__.startswith(_SIDE_EFFECT_FREE) and not m._forward_hooks
                             and not m._forward_pre_hooks for m in self.model.modules())
        # A frozen matmul parameter costs 4 FLOPs a token (no weight gradient): 6N - 2*frozen, "6Nt+4Nf" then.
        self.frozen = frozen_matmul_params(self.model) if self.shape is not None else 0
        formula = "6Nt+4Nf+12LdT" if self.frozen else "6N+12LdT"
        self.method: str | None = formula if self.shape is not None else "counted" if self.countable else None
        self._cache: dict[Any, tuple[float, int, int] | None] = {}

    def of_batch(self, batch: Any) -> tuple[float, int, int] | None:
        tokens = batch.get("input_ids") if isinstance(batch, Mapping) else None
        first = tokens if tokens is not None else _first_tensor(batch)
        if first is None:
            return None
        key = tuple(first.shape)
        if key not in self._cache:
            self._cache[key] = self._compute(batch, first)
        return self._cache[key]

    def _compute(self, batch: Any, first: torch.Tensor) -> tuple[float, int, int] | None:
        samples = int(first.shape[0])
        if self.shape is not None and first.ndim == 2:
            matmul_params, layers, width = self.shape
            length = int(first.shape[1])
            per_token = 6 * matmul_params - 2 * self.frozen + 12 * layers * width * length
            return float(per_token * samples * length), samples, samples * length
        if not self.countable:
            return None
        per_sample = counted_flops(self.model, batch)  # also a Transformers model fed images (pixel_values)
        self.method = None if per_sample is None else "counted"
        if per_sample is None:
            return None
        positions = samples * int(first.shape[1]) if tokens_like(first) else samples
        return per_sample * samples, samples, positions


def tokens_like(t: torch.Tensor) -> bool:
    return t.ndim == 2 and not t.is_floating_point()


def _first_tensor(batch: Any) -> torch.Tensor | None:
    values = batch.values() if isinstance(batch, Mapping) else batch if isinstance(batch, (tuple, list)) else [batch]
    return next((v for v in values if isinstance(v, torch.Tensor)), None)
