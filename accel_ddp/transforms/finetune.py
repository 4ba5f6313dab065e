"""Fine-tuning a pretrained model: LoRA adapters on a frozen base (``--peft lora``), activation checkpointing
(``--gradient_checkpointing``), the base's fingerprint, and the adapter's export.

    model, _ = convert_model(model, build, (GRADIENT_CHECKPOINTING, PEFT), read)  # before DDP: checkpointing, LoRA
    facts = finetune_facts(model)                      # trainable/total parameters, the frozen base's fingerprint
    export_adapter(accelerator, model, tokenizer, "outputs/run", merge=True)    # adapter/ and hf_model/

What DDP needs for this is nothing special, by construction: DDP registers only the parameters that require a
gradient (the adapters), every adapter is used in every forward, so ``find_unused_parameters`` stays off (its
per-step graph walk is not paid); activation checkpointing is non-reentrant, which DDP supports with
accumulation and without ``static_graph`` (the reentrant kind re-runs the forward inside the backward, and DDP
sees its parameters "marked ready twice"). Checkpoints of a model with frozen parameters hold the trainable
state only (``checkpoint/weights.py``'s ``trainable_state_dict``), with the fingerprint of the frozen base in
``checkpoint.json``, checked on resume (``checkpoint/hyperparameters.py``).

``peft`` is an optional extra: ``pip install "accel_ddp[finetune]"``.
"""

from __future__ import annotations

import copy
import hashlib
import os
import shutil
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from accel_ddp.checkpoint.hyperparameters import FULL_FINGERPRINT
from accel_ddp.checkpoint.weights import load_weights
from accel_ddp.config.views import config_section
from accel_ddp.lifecycle.failure import main_process_decides
from accel_ddp.outputs.names import ADAPTER_SUBDIR, PRETRAINED_SUBDIR
from accel_ddp.util.atomic import follow_umask
from accel_ddp.util.converters import ModelBuild, ModelConverter
from accel_ddp.util.messages import note
from accel_ddp.util.optional import require
from accel_ddp.util.validation import ConfigError

DIGEST_VALUES = 64  # values per frozen tensor in the sampled fingerprint of earlier versions (sampled_fingerprint)
FINGERPRINT_THREADS = 4  # tensors hashed at once; each holds one tensor's host copy


@config_section
@dataclass(frozen=True)
class FinetuneOptions:
    """What this module's converters read (config/views.py): the base's weights, checkpointing, the adapters."""

    init_from: str | None
    gradient_checkpointing: bool
    peft: str | None
    lora_r: int
    lora_alpha: float
    lora_dropout: float
    lora_target_modules: str
    merge_adapter: bool


def _init_from(model: nn.Module, options: FinetuneOptions, build: ModelBuild) -> tuple[nn.Module, None]:
    load_weights(model, options.init_from)  # every rank reads the same file before DDP wraps the model
    return model, None


def _gradient_checkpointing(model: nn.Module, options: FinetuneOptions, build: ModelBuild) -> tuple[nn.Module, None]:
    enable_activation_checkpointing(model)
    return model, None


def _peft(model: nn.Module, options: FinetuneOptions, build: ModelBuild) -> tuple[nn.Module, None]:
    """``--peft lora``'s adapters added (the base frozen), after ``--init_from`` loaded the base's weights. Under
    FSDP --peft is refused (its trainable-only checkpoints and exports are written for DDP)."""
    if build.accelerator.is_fsdp2:
        raise ConfigError(f"--peft {options.peft} under FSDP is not supported yet; launch with a DDP config (the "
                          "frozen base is not trained, so its memory is weights only), or drop --peft")
    model = add_lora(model, options.lora_r, options.lora_alpha, options.lora_dropout, options.lora_target_modules)
    tie = tied_output_adapted(model) if options.merge_adapter else None
    if tie is not None:
        output, embedding, size = tie
        note(f"--lora_target_modules: {output} is tied to {embedding} (the input embedding), and its adapter "
             f"changes the output layer only; the merged hf_model/ gets an output layer of its own (untied: "
             f"+{size:,} parameters, tie_word_embeddings false), so that it computes what the trained model does",
             ranks="main")
    return model, None


# The model converters this module owns, in the order assemble.MODEL_CONVERTERS applies them (util/converters.py).
INIT_FROM = ModelConverter("init_from", FinetuneOptions, applies=lambda o: bool(o.init_from), apply=_init_from)
GRADIENT_CHECKPOINTING = ModelConverter("gradient_checkpointing", FinetuneOptions,
                                        applies=lambda o: o.gradient_checkpointing, apply=_gradient_checkpointing)
PEFT = ModelConverter("peft", FinetuneOptions, applies=lambda o: o.peft == "lora", apply=_peft)


def enable_activation_checkpointing(model: nn.Module) -> None:
    """Non-reentrant activation checkpointing of a Transformers model's blocks, or a ConfigError for another model.

    Non-reentrant (torch.utils.checkpoint's ``use_reentrant=False``): DDP and accumulation work with it, and the
    gradients reach parameters inside a checkpointed block whether or not its input requires a gradient, so a
    frozen embedding needs no ``enable_input_require_grads`` (the reentrant kind needs it, and breaks DDP).
    Transformers and peft register that hook anyway; it is taken off again (``add_lora``), which saves the
    backward of the first block's input.
    """
    enable = getattr(model, "activation_checkpointing_enable", None)  # Transformers 5.x's name
    kwargs_name = "activation_checkpointing_kwargs"
    if enable is None:
        enable, kwargs_name = getattr(model, "gradient_checkpointing_enable", None), "gradient_checkpointing_kwargs"
    if enable is None or not getattr(model, "supports_gradient_checkpointing", False):
        raise ConfigError(f"--gradient_checkpointing: {type(model).__name__} is not a Transformers model that supports "
                          "it; drop the flag, or wrap your model's blocks in torch.utils.checkpoint.checkpoint(block, "
                          "x, use_reentrant=False) yourself")
    enable(**{kwargs_name: {"use_reentrant": False}})
    if getattr(model.config, "use_cache", False):
        model.config.use_cache = False  # a key/value cache is for generation; with checkpointing it warns each step
    _input_grads_off(model)


def _input_grads_off(model: nn.Module) -> None:
    """Remove Transformers'/peft's hook that makes the input embeddings' output require a gradient (needed by
    reentrant checkpointing only)."""
    for module in model.modules():
        hooked = getattr(module, "_require_grads_hooks", None) or getattr(module, "_require_grads_hook", None)
        if hooked and hasattr(module, "disable_input_require_grads"):
            module.disable_input_require_grads()


def add_lora(model: nn.Module, r: int, alpha: float, dropout: float, targets: str) -> nn.Module:
    """``model`` frozen, with LoRA adapters (peft) on the ``targets`` modules: a ``PeftModel``.

    ``targets``: comma-separated module names (each must name at least one linear layer of ``model``: the last
    part of its dotted name, or the whole name), or ``all-linear``. The adapters' B starts at zero, so the model
    computes what the base does until the first update.
    """
    if not hasattr(model, "config") or not hasattr(model, "save_pretrained"):
        raise ConfigError(f"--peft lora: {type(model).__name__} is not a Transformers model; give --model a "
                          "save_pretrained folder (or --model_config), or pass a Transformers model to train()")
    peft = require("peft", "--peft lora")  # the finetune extra
    names = [name.strip() for name in targets.split(",") if name.strip()]
    target_modules: str | list[str] = "all-linear" if names == ["all-linear"] else names
    if target_modules != "all-linear":
        _check_targets(model, names)
    config = peft.LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=target_modules,
                             fan_in_fan_out=_uses_conv1d(model), task_type=_task_type(model))
    with warnings.catch_warnings():  # peft reads is_gradient_checkpointing, which Transformers 5 deprecates
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing", category=FutureWarning)
        # On every rank, and handled: a tied layer adapted (the merge unties it: merged_copy), fan_in_fan_out set
        # per layer (GPT-2's Conv1D blocks and its nn.Linear lm_head; peft corrects it for each, then warns).
        warnings.filterwarnings("ignore", message=".*ensure_weight_tying", category=UserWarning)
        warnings.filterwarnings("ignore", message="fan_in_fan_out is set to", category=UserWarning)
        tuned = peft.get_peft_model(model, config)
    # get_peft_model hooks the input embeddings to require a gradient (for reentrant checkpointing, which we never
    # use: enable_activation_checkpointing); without it the backward stops at the first adapter, as it should.
    _input_grads_off(tuned)
    return tuned


def _linear_names(model: nn.Module) -> list[str]:
    linear = (nn.Linear,) + ((_conv1d(),) if _conv1d() else ())
    return [name for name, module in model.named_modules() if isinstance(module, linear)]


def _conv1d():
    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:
        return None
    return Conv1D


def _uses_conv1d(model: nn.Module) -> bool:
    """GPT-2's linear layers are Transformers' Conv1D, whose weight is (in, out): peft must be told."""
    conv1d = _conv1d()
    return conv1d is not None and any(isinstance(m, conv1d) for m in model.modules())


def _check_targets(model: nn.Module, names: list[str]) -> None:
    """Every name of --lora_target_modules names a linear layer (peft itself only refuses when none does)."""
    linear = _linear_names(model)
    missing = [name for name in names if not any(full == name or full.endswith(f".{name}") for full in linear)]
    if missing:
        known = sorted({full.rsplit(".", 1)[-1] for full in linear})
        raise ConfigError(f"--lora_target_modules: {', '.join(missing)} names no linear layer of "
                          f"{type(model).__name__}; its linear layers are {', '.join(known[:12]) or '(none)'}, "
                          "or give all-linear")


def _task_type(model: nn.Module) -> str | None:
    """peft's task type, which decides the PeftModel class (its forward takes the batch's labels)."""
    name = type(model).__name__
    if name.endswith("ForCausalLM") or name.endswith("LMHeadModel"):
        return "CAUSAL_LM"
    if name.endswith("ForSequenceClassification"):
        return "SEQ_CLS"
    return None


def is_peft_model(model: nn.Module) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "merge_and_unload")


# ----------------------------------------------------------------------------- facts and the base's fingerprint


def parameter_counts(model: nn.Module) -> tuple[int, int]:
    """(trainable, total) parameters, each tensor counted once (tied weights too)."""
    params = list(model.parameters())  # parameters() yields a shared tensor once
    return sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)


def describe_parameters(model: nn.Module) -> str:
    """``1,234 parameters``, or ``12 trainable of 1,234 parameters (0.97%)`` where some are frozen."""
    trainable, total = parameter_counts(model)
    if trainable == total:
        return f"{total:,} parameters"
    return f"{trainable:,} trainable of {total:,} parameters ({100 * trainable / max(total, 1):.2f}%)"


def base_fingerprint(model: nn.Module) -> str | None:
    """``sha256:<hex>`` over the frozen parameters: each one's name as in the base model, shape, dtype and every byte
    of its values; None when nothing is frozen. The same base gives the same fingerprint with or without adapters,
    whatever modules they target; one changed value gives another.

    Streamed: one tensor at a time is copied to the host (a few at once, ``FINGERPRINT_THREADS``: hashlib releases
    the GIL while it hashes), never the whole base. Cost (benchmarks/base_fingerprint.py): 0.84 s for GPT-2 124M in
    float32 on the 2-core development CPU at a load of 8.5 (one sha256 call over the same bytes: 0.93 s); under 1 s,
    so it is computed at every start, fresh or resumed, not cached by the base files' size and mtime."""
    frozen = [(base_name(name), param) for name, param in model.named_parameters() if not param.requires_grad]
    if not frozen:
        return None
    with ThreadPoolExecutor(max_workers=FINGERPRINT_THREADS) as pool:
        digests = list(pool.map(lambda item: _tensor_digest(*item), frozen))
    whole = hashlib.sha256()
    for digest in digests:
        whole.update(digest)
    return f"{FULL_FINGERPRINT}{whole.hexdigest()}"


def _tensor_digest(name: str, param: torch.Tensor) -> bytes:
    digest = hashlib.sha256(f"{name}|{tuple(param.shape)}|{param.dtype}|".encode())
    values = param.detach().to("cpu").contiguous().reshape(-1)
    if values.numel():
        digest.update(values.view(torch.uint8).numpy().data)  # the bytes as stored (bf16 too: NumPy has no bf16)
    return digest.digest()


def sampled_fingerprint(model: nn.Module) -> str | None:
    """The fingerprint earlier versions recorded (16 hex digits): a strided sample of ``DIGEST_VALUES`` values per
    frozen tensor. Kept to resume their checkpoints (``checkpoint/hyperparameters.py``): it tells another base model,
    not a few changed weights."""
    digest = hashlib.sha256()
    frozen = 0
    for name, param in model.named_parameters():
        if param.requires_grad:
            continue
        frozen += 1
        values = param.detach().reshape(-1)
        sample = values[:: max(1, values.numel() // DIGEST_VALUES)][:DIGEST_VALUES].to("cpu", torch.float64)
        digest.update(f"{base_name(name)}|{tuple(param.shape)}|{param.dtype}|".encode())
        digest.update(sample.numpy().tobytes())
    return digest.hexdigest()[:16] if frozen else None


def base_name(name: str) -> str:
    """A parameter's name in the base model: without peft's ``base_model.model.`` and ``.base_layer``."""
    return name.removeprefix("base_model.model.").replace(".base_layer.", ".")


def finetune_facts(model: nn.Module) -> dict[str, Any]:
    """What a run with frozen parameters records in config.yaml, checkpoint.json and summary.json: the parameter
    counts and the base's fingerprint (compared on resume); nothing for a run that trains every parameter."""
    fingerprint = base_fingerprint(model)
    if fingerprint is None:
        return {}
    trainable, total = parameter_counts(model)
    facts = {"trainable_parameters": trainable, "total_parameters": total, "base_fingerprint": fingerprint,
             "base_sampled_fingerprint": sampled_fingerprint(model)}  # to resume checkpoints of earlier versions
    lora = getattr(model, "peft_config", {}).get("default") if is_peft_model(model) else None
    if getattr(lora, "r", None) is not None:
        facts["lora_r"] = int(lora.r)  # a resume with another --lora_r is refused by name, not by tensor shapes
    return facts


# ----------------------------------------------------------------------------- the final export

MERGE_CHECK_TOKENS = 16  # tokens on which the merged model must give the adapter model's logits before it is written
MERGE_RTOL = 1e-4  # of the largest logit: a merge is exact up to float rounding (~1e-7 relative in float32)


def export_adapter(accelerator, model: nn.Module, tokenizer: Any, output_dir: str, merge: bool) -> str:
    """Write the adapter to ``OUTPUT_DIR/adapter`` (``adapter_model.safetensors`` + ``adapter_config.json``:
    ``PeftModel.from_pretrained(base, folder)``), and with ``merge`` the merged model to ``OUTPUT_DIR/hf_model``
    (``save_pretrained``: ``AutoModelFor....from_pretrained`` without peft). Every rank calls it; the main
    process writes (each folder written beside, then renamed into place). ``model``: the unwrapped PeftModel.

    The merge works on a copy (one more model in memory for a moment): the trained model, and the base a
    Python caller passed in, stay as they are. The merged folder is loaded back and must give the adapter model's
    logits on a few tokens before it is renamed into place (``check_merged``); else a ConfigError on every rank.
    """
    adapter = os.path.join(output_dir, ADAPTER_SUBDIR)
    if accelerator.is_main_process:
        _write_folder(adapter, lambda tmp: model.save_pretrained(tmp), tokenizer)  # the adapter's weights only
    if merge:  # the main process merges, checks and writes; every rank gets its outcome (a mismatch: one line)
        main_process_decides(accelerator, lambda: _write_merged(model, tokenizer,
                                                                os.path.join(output_dir, PRETRAINED_SUBDIR)))
    accelerator.wait_for_everyone()
    return adapter


def _write_merged(tuned: nn.Module, tokenizer: Any, final: str) -> None:
    _write_folder(final, lambda tmp: merged_copy(tuned).save_pretrained(tmp), tokenizer,
                  check=lambda tmp: check_merged(tuned, tmp))


def tied_output_adapted(tuned: nn.Module) -> tuple[str, str, int] | None:
    """(output layer's name, input embedding's name, its size) where ``tuned``'s output layer has an adapter and
    shares its weight with the input embedding (GPT-2's lm_head and wte); else None. peft's merge would add the
    adapter's update into the shared tensor, changing the embedding too (peft issue #2777 and PR #2972: peft leaves
    the decision to the user and warns)."""
    base = tuned.get_base_model() if hasattr(tuned, "get_base_model") else tuned
    output, embedding = _embeddings(base)
    layer = getattr(output, "base_layer", None)
    if layer is None or embedding is None or getattr(layer, "weight", None) is not getattr(embedding, "weight", 1):
        return None
    names = {id(module): name for name, module in base.named_modules()}
    return names.get(id(output), "the output layer"), names.get(id(embedding), "the embedding"), layer.weight.numel()


def _embeddings(model: nn.Module) -> tuple[Any, Any]:
    get_out, get_in = getattr(model, "get_output_embeddings", None), getattr(model, "get_input_embeddings", None)
    try:
        return (get_out() if callable(get_out) else None), (get_in() if callable(get_in) else None)
    except NotImplementedError:  # Transformers' default for a model without them
        return None, None


def merged_copy(tuned: nn.Module) -> nn.Module:
    """A merged copy of the PeftModel ``tuned``: the plain Transformers model that computes what ``tuned`` does.

    An adapted output layer tied to the input embedding gets a weight of its own first (and the config says
    ``tie_word_embeddings`` false, so that save_pretrained writes it and from_pretrained does not tie it back): the
    trained model applied the adapter to the output layer only, never to the embedding."""
    copied = copy.deepcopy(tuned)  # shared tensors stay shared in the copy (deepcopy's memo)
    if tied_output_adapted(copied) is not None:
        base = copied.get_base_model()
        layer = _embeddings(base)[0].base_layer
        layer.weight = nn.Parameter(layer.weight.detach().clone(), requires_grad=False)
        configs = {id(c): c for c in (base.config, getattr(base.config, "get_text_config", lambda: None)()) if c}
        for config in configs.values():
            config.tie_word_embeddings = False
    return copied.merge_and_unload()


def check_merged(tuned: nn.Module, folder: str) -> None:
    """The model saved in ``folder``, loaded back as Transformers would, gives ``tuned``'s logits (within
    ``MERGE_RTOL`` of the largest, TF32 off) on ``MERGE_CHECK_TOKENS`` tokens; else a ConfigError."""
    base = tuned.get_base_model()
    config = base.config
    vocab = int(getattr(config.get_text_config() if hasattr(config, "get_text_config") else config, "vocab_size", 2))
    count = min(MERGE_CHECK_TOKENS, int(getattr(config, "max_position_embeddings", 0) or MERGE_CHECK_TOKENS))
    tokens = (torch.arange(count) * 7919 % vocab).unsqueeze(0)  # spread over the vocabulary, the same every run
    expected = _logits(tuned, tokens)
    from transformers.utils import logging as hf_logging  # the folder was written by Transformers: it is there

    bar = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # no "Loading weights" bar at the end of a run
    try:
        merged = type(base).from_pretrained(folder, dtype=next(base.parameters()).dtype)
    finally:
        if bar:
            hf_logging.enable_progress_bar()
    got = _logits(merged, tokens)
    eps = torch.finfo(expected.dtype).eps if expected.is_floating_point() else 0.0
    allowed = max(MERGE_RTOL, 16 * eps) * max(1.0, float(expected.abs().max()))
    off = float((got.float() - expected.float()).abs().max())
    if not off <= allowed:
        raise ConfigError(f"--merge_adapter: the merged model's logits differ from the adapter model's (by up to "
                          f"{off:.3g} on {count} tokens, allowed {allowed:.2g}), so hf_model/ is not written; the "
                          "adapter/ folder is what was trained: load it on the base with peft's "
                          "PeftModel.from_pretrained, or drop --merge_adapter")


def _logits(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """``model``'s logits for ``tokens`` on the CPU, in eval mode (no dropout), with fp32 matmuls in full precision."""
    device = next(model.parameters()).device
    training, tf32 = model.training, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # TF32's ~1e-3 relative error would hide a bad merge (or fake one)
    model.eval()
    try:
        with torch.no_grad():
            out = model(input_ids=tokens.to(device))
    finally:
        model.train(training)
        torch.backends.cuda.matmul.allow_tf32 = tf32
    logits = out.logits if hasattr(out, "logits") else out[0]
    return logits.detach().float().cpu()


def _write_folder(final: str, save, tokenizer: Any, check=None) -> None:
    """``save(tmp)`` (and the tokenizer) into ``final``.tmp, ``check(tmp)``, then renamed into place; a refused
    check leaves neither."""
    tmp = f"{final}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    save(tmp)
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    if check is not None:
        try:
            check(tmp)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    follow_umask(tmp)  # its safetensors files are 0600, whatever the umask
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
