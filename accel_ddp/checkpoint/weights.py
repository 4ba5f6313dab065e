"""Model weights as files: safetensors in, safetensors out, whatever wrapped the model that wrote them.

    load_weights(model, "outputs/pretrain/model.safetensors")   # --init_from; every key and shape checked
    export_weights(accelerator, model, "outputs/run")            # the final OUTPUT_DIR/model.safetensors

Keys are always the plain model's: no DDP ``module.`` prefix, no torch.compile ``_orig_mod.``
(``plain_state_dict``), so a file loads at any world size, compiled or not. This module imports no
Accelerate (``models.py`` uses it).
"""

from __future__ import annotations

import os
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import load_file, save_file

from accel_ddp.lifecycle.failure import main_process_decides
from accel_ddp.outputs.files import OUTPUTS_FIX, written
from accel_ddp.outputs.names import WEIGHTS_NAME
from accel_ddp.util.atomic import follow_umask
from accel_ddp.util.messages import first_line
from accel_ddp.util.validation import ConfigError

if TYPE_CHECKING:
    from accelerate import Accelerator


def load_weights(model: torch.nn.Module, path: str, source: str = "--init_from", keep_frozen: bool = False) -> None:
    """Copy a safetensors file into ``model`` (unwrapped); every key and shape must match.

    A file written by a DDP-wrapped model (keys ``module.*``) or by a compiled one (``_orig_mod.``,
    as earlier versions wrote under ``--compile``) is accepted too, and ``model`` may be compiled.
    ``keep_frozen``: the file may leave out frozen parameters (a checkpoint's ``trainable_state_dict``); the
    model keeps its own.

        >>> load_weights(model, "outputs/pretrain/model.safetensors")
    """
    if not os.path.isfile(path):
        raise ConfigError(f"{source} {path}: no such file; give a .safetensors weights file such as "
                          "OUTPUT_DIR/model.safetensors")
    try:
        state = load_file(path)
    except Exception as err:  # safetensors raises its own error types for truncated or foreign files
        raise ConfigError(f"{source} {path}: not a readable safetensors file ({first_line(err)}); "
                          "the file is damaged or of another format") from None
    own = model.state_dict()
    own_names = {plain_name(k): k for k in own}  # plain name -> the model's own (compiled regions keep _orig_mod.)
    expected = {plain: own[k] for plain, k in own_names.items()}
    state = plain_state_dict(state)
    if state and all(k.startswith("module.") for k in state) and not any(k.startswith("module.") for k in expected):
        state = {k.removeprefix("module."): v for k, v in state.items()}
    _fill_tied(state, expected)
    missing = sorted(expected.keys() - state.keys() - (frozen_keys(model) if keep_frozen else set()))
    unexpected = sorted(state.keys() - expected.keys())
    reshaped = sorted(k for k in expected.keys() & state.keys() if expected[k].shape != state[k].shape)
    _refuse_lora_mismatch(source, path, state, expected, unexpected, reshaped)
    if missing or unexpected or reshaped:
        problems = []
        if missing:
            problems.append(f"missing keys {_few(missing)}")
        if unexpected:
            problems.append(f"unexpected keys {_few(unexpected)}")
        if reshaped:
            problems.append("shape mismatch " + ", ".join(
                f"{k} {tuple(state[k].shape)} vs model {tuple(expected[k].shape)}" for k in reshaped[:3]))
        raise ConfigError(f"{source} {path} holds the weights of a different model: {'; '.join(problems)}; "
                          "use the --model and sizes (e.g. --hidden_size) of the run that wrote it")
    damaged = next((k for k, v in sorted(state.items()) if v.is_floating_point() and not bool(torch.isfinite(v).all())),
                   None)
    if damaged is not None:  # else exit 3 at the first step, "lower --lr": no learning rate trains from nan weights
        bad = int((~torch.isfinite(state[damaged])).sum())
        raise ConfigError(f"{source} {path}: its tensor {damaged} holds nan or inf values ({bad} of "
                          f"{state[damaged].numel()}); these weights are damaged (saved by a run that diverged?); "
                          "give weights without them, e.g. an earlier checkpoint's model.safetensors")
    model.load_state_dict({own_names[k]: v for k, v in state.items()}, strict=not keep_frozen)


PEFT_PREFIX = "base_model.model."  # how a PeftModel names its base's tensors (and .base_layer, lora_A/B inside)


def _refuse_lora_mismatch(source: str, path: str, state: dict[str, torch.Tensor], expected: dict[str, torch.Tensor],
                          unexpected: list[str], reshaped: list[str]) -> None:
    """The mismatches that have a name: a LoRA run's weights (peft's names) given to a plain model, and adapters of
    another rank (--lora_r); a ConfigError saying so, instead of the lists of keys and shapes."""
    if source == "--init_from" and unexpected and all(k.startswith(PEFT_PREFIX) for k in unexpected) and not any(
            k.startswith(PEFT_PREFIX) for k in expected):  # a resume of such a run is refused by its fingerprint
        raise ConfigError(f"{source} {path} holds a LoRA run's model (the same model under peft's names, its adapters "
                          f"not merged): point {source} to RUN/hf_model/model.safetensors (the merged model, written "
                          "with --merge_adapter true), or load RUN/adapter/ on the base with peft "
                          "(PeftModel.from_pretrained)")
    adapters = [k for k in reshaped if ".lora_A." in k]
    if adapters and all(".lora_" in k for k in reshaped):
        theirs, ours = state[adapters[0]].shape[0], expected[adapters[0]].shape[0]  # lora_A: r x in
        raise ConfigError(f"{source} {path}: its adapters have rank --lora_r {theirs}, this run has --lora_r {ours}; "
                          f"use --lora_r {theirs}, or start in another --output_dir")


def frozen_keys(model: torch.nn.Module) -> set[str]:
    """The plain state-dict keys of ``model``'s frozen parameters (``requires_grad`` False), tied aliases included."""
    frozen = {id(p) for p in model.parameters() if not p.requires_grad}
    return {plain_name(k) for k, t in model.state_dict(keep_vars=True).items() if id(t) in frozen}


def trainable_state_dict(model: torch.nn.Module) -> dict[str, Any]:
    """What a checkpoint holds of ``model``: its state dict without the frozen parameters (a fine-tuned base,
    fingerprinted instead: ``finetune.base_fingerprint``), plain names; the whole state dict when nothing is
    frozen. Buffers are kept: they may change while training (BatchNorm's statistics)."""
    state = plain_state_dict(model.state_dict())
    frozen = frozen_keys(model)
    if not frozen:
        return state
    return OrderedDict((k, v) for k, v in state.items() if k not in frozen)


def plain_name(key: str) -> str:
    """A state-dict key without torch.compile's ``_orig_mod.`` components: the name in the uncompiled model."""
    return key.replace("_orig_mod.", "")


def plain_state_dict(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` with ``plain_name`` keys: weights load into a model whether or not it (or the writer) was compiled.

    An OrderedDict, as ``state_dict()`` returns: Accelerate's ``save`` removes tied-weight aliases
    (which safetensors refuses) only from an OrderedDict.
    """
    if not any("_orig_mod." in k for k in state):
        return state
    return OrderedDict((plain_name(k), v) for k, v in state.items())


def _fill_tied(state: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    """Add the tied aliases a file leaves out: Accelerate's save_state (like safetensors' save_model) stores a
    tensor shared by several names once, e.g. a language model's output layer tied to its embedding."""
    by_storage = {(t.untyped_storage().data_ptr(), t.storage_offset(), t.shape): name
                  for name, t in expected.items() if name in state}
    for name, tensor in expected.items():
        alias = by_storage.get((tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tensor.shape))
        if name not in state and alias is not None:
            state[name] = state[alias]


def export_weights(accelerator: Accelerator, model: torch.nn.Module, output_dir: str) -> str:
    """Write the unwrapped model's weights to ``output_dir/model.safetensors``.

    Every rank must call this (``get_state_dict`` is collective under sharded strategies); only
    the main process writes, into a temporary file renamed into place, so a crash mid-write
    never leaves a truncated ``model.safetensors`` behind. Keys are the uncompiled model's:
    Accelerate 1.15's ``get_state_dict`` keeps the ``torch.compile`` wrapper (``_orig_mod.`` keys)
    under ``--compile``, which a plain model could not load.
    """
    state = plain_state_dict(accelerator.get_state_dict(model))
    path = os.path.join(output_dir, WEIGHTS_NAME)

    def write() -> None:
        # safetensors refuses tensors that share storage; clone into plain contiguous CPU copies.
        tensors = {name: t.detach().to("cpu").contiguous().clone() for name, t in state.items()}
        tmp = f"{path}.tmp"
        try:
            save_file(tensors, tmp, metadata={"format": "pt"})
            follow_umask(tmp)  # safetensors writes 0600, whatever the umask
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):  # what a refused write left: never loaded, but it takes the space
                os.remove(tmp)

    # The main process writes; every rank gets its outcome (a full disk: one line on every rank).
    main_process_decides(accelerator, lambda: written(write, WEIGHTS_NAME, output_dir, OUTPUTS_FIX))
    return path


def _few(keys: list[str], limit: int = 5) -> str:
    shown = ", ".join(keys[:limit])
    return f"{shown} (+{len(keys) - limit} more)" if len(keys) > limit else shown
