"""What a batch and a model's outputs hold, read the same way by every task: the labels, the model's own loss, the
forward's named arguments, the device, whether the logits fit the labels; and per-item averages.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import torch
from accelerate.utils import extract_model_from_parallel

from accel_ddp.util.model_outputs import logits_of
from accel_ddp.util.validation import ConfigError


def model_loss(outputs: Any) -> torch.Tensor | None:
    """The loss a model returned itself (``outputs.loss`` or ``outputs["loss"]``), or None."""
    if isinstance(outputs, Mapping):
        return outputs.get("loss")
    return getattr(outputs, "loss", None)


def labels_of(batch: Any) -> torch.Tensor | None:
    """The targets of a batch: the second element of a tuple, or ``batch["labels"]``."""
    if isinstance(batch, Mapping):
        return batch.get("labels")
    return batch[1] if len(batch) > 1 else None


def forward_keys(model: torch.nn.Module) -> set[str] | None:
    """The keyword arguments ``model.forward`` names, or None when it takes only ``**kwargs`` (then pass all).

    Like the Hugging Face Trainer, a forward with named parameters and ``**kwargs`` gets only the
    named ones: a dataset's leftover columns (raw text, ids) must not reach the model.
    """
    params = inspect.signature(extract_model_from_parallel(model).forward).parameters.values()
    named = {p.name for p in params if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
    return named or None


def without_kv_cache(model: torch.nn.Module) -> dict[str, Any]:
    """``{"use_cache": False}`` where the model's forward takes ``use_cache`` (a Transformers model, also under
    peft's LoRA), else ``{}``: the extra keyword argument of every forward the package runs.

    Training and evaluation never decode step by step, so a key/value cache is pure cost, and under
    ``torch.compile`` a defect: Transformers 5 takes ``use_cache`` from ``config.use_cache`` (True for GPT-2, Llama,
    ...; utils/generic.py ``merge_with_config_defaults``) and then builds a ``DynamicCache`` in every forward, whose
    per-layer state each block updates at its own index (cache_utils.py ``DynamicLayer.update``: ``if not
    self.is_initialized``). Dynamo guards on that state, so ``--compile_regions`` compiles each block again until
    its recompile limit (8) and runs the rest eagerly (docs/performance.md). Given per call, not written into the
    config: the exported ``hf_model/config.json`` keeps the cache on for the user's generation."""
    inner = extract_model_from_parallel(model, keep_torch_compile=False)
    get_base = getattr(inner, "get_base_model", None)  # peft's PeftModel passes **kwargs on to the base model
    base = get_base() if callable(get_base) else inner
    try:
        takes = "use_cache" in inspect.signature(base.forward).parameters
    except (TypeError, ValueError):  # a forward without a signature Python can read: pass nothing extra
        takes = False
    return {"use_cache": False} if takes else {}


def batch_device(batch: Any) -> torch.device:
    values = batch.values() if isinstance(batch, Mapping) else batch
    return next(v.device for v in values if isinstance(v, torch.Tensor))


def per_item(total: float, items: float) -> float | None:
    """``total / items``; None when nothing was counted (an empty eval set, or texts without a token to predict)."""
    return total / items if items else None


def check_logit_shapes(outputs: Any, labels: torch.Tensor) -> None:
    """``(input, label)`` batches with the default cross-entropy: the model's logits must fit the labels.

    Shapes only, the same on every rank: a mismatch ends every rank with one line naming both.
    """
    logits = logits_of(outputs)
    if logits is None:
        raise ConfigError(f"the model returned {type(outputs).__name__} from forward; expected a tensor of logits "
                          f"(batch, num_classes) for labels of shape {tuple(labels.shape)}")
    soft_labels = labels.is_floating_point() and labels.shape == logits.shape  # class probabilities
    if labels.ndim == 1 and (labels.is_floating_point() or labels.dtype == torch.bool):  # cross-entropy's dtype error
        raise ConfigError(f"the labels are {str(labels.dtype).removeprefix('torch.')} values; the default "
                          "cross-entropy takes integer class ids (int64, torch.long): return the label as an int "
                          "(e.g. int(label) or labels.long()), or class probabilities of shape (batch, num_classes)")
    if logits.ndim != 2 or (labels.ndim != 1 and not soft_labels) or logits.shape[0] != labels.shape[0]:
        raise ConfigError(f"the model's output has shape {tuple(logits.shape)} but the labels have shape "
                          f"{tuple(labels.shape)}; the model must return logits of shape "
                          f"({labels.shape[0]}, num_classes)")
