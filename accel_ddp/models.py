"""Models, optimizers and learning-rate schedules.

Your own model: ``--model my_pkg.my_models:build`` where

    def build(num_classes: int, input_shape: tuple[int, ...]) -> torch.nn.Module: ...

``input_shape`` is one sample's shape without the batch dimension, e.g. ``(1, 28, 28)``; the
model maps a float batch ``(B, *input_shape)`` to logits ``(B, num_classes)``.

Transformers models (``pip install 'accel_ddp[nlp]'``): ``--model FOLDER`` (written by
``save_pretrained``) or ``--model_config config.json`` (from scratch), loaded with the
``AutoModelFor...`` class of ``--task`` (:data:`AUTO_CLASSES`). The final model of such a run is
also saved with ``save_pretrained`` (:func:`export_pretrained`).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils.data import Dataset

from accel_ddp.checkpoint.weights import plain_state_dict
from accel_ddp.config import TEXT_TASKS
from accel_ddp.config.views import config_section
from accel_ddp.outputs.names import PRETRAINED_SUBDIR
from accel_ddp.transforms.finetune import export_adapter, is_peft_model
from accel_ddp.util.atomic import follow_umask
from accel_ddp.util.messages import prints
from accel_ddp.util.optional import require
from accel_ddp.util.registry import resolve
from accel_ddp.util.validation import ConfigError

if TYPE_CHECKING:
    from accel_ddp.data.resolve import Data


def build_mlp(num_classes: int, input_shape: tuple[int, ...], hidden_size: int = 256) -> nn.Module:
    """Two hidden ReLU layers on the flattened input; trains any small dataset in seconds."""
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(math.prod(input_shape), hidden_size),
        nn.ReLU(),
        nn.Linear(hidden_size, hidden_size),
        nn.ReLU(),
        nn.Linear(hidden_size, num_classes),
    )


class MnistCNN(nn.Module):
    """The classic two-conv MNIST network (PyTorch's examples/mnist), sized from the input shape."""

    def __init__(self, num_classes: int, input_shape: tuple[int, ...]):
        super().__init__()
        channels, height, width = input_shape
        if height < 6 or width < 6:
            raise ConfigError(f"--model mnist_cnn needs inputs of at least 6x6 pixels, got {height}x{width}")
        self.features = nn.Sequential(
            nn.Conv2d(channels, 32, 3), nn.ReLU(),
            nn.Conv2d(32, 64, 3), nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Dropout(0.25),
            nn.Flatten(),
        )
        flat = 64 * ((height - 4) // 2) * ((width - 4) // 2)
        self.classifier = nn.Sequential(
            nn.Linear(flat, 128), nn.ReLU(), nn.Dropout(0.5), nn.Linear(128, num_classes)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


class ResNet18(nn.Module):
    """torchvision's ResNet-18 for small images: a 3x3 stride-1 stem and no max-pool (the CIFAR recipe).

    Any channel count and image size of at least 8x8 (the four stages halve it three times, the
    head pools globally). ``width`` sets the first stage's channels (then x2, x4, x8); 64 gives
    torchvision's layer shapes and parameter names. BatchNorm statistics are per device batch, so
    unlike ``mlp`` runs of different world sizes agree closely but not bit for bit.

        >>> ResNet18(10, (3, 32, 32), width=16).fc
        Linear(in_features=128, out_features=10, bias=True)
    """

    def __init__(self, num_classes: int, input_shape: tuple[int, ...], width: int = 64):
        super().__init__()
        if len(input_shape) != 3:
            raise ConfigError(
                f"--model resnet18 needs image inputs (C, H, W), got shape {input_shape}; try --model mlp"
            )
        channels, height, width_px = input_shape
        if height < 8 or width_px < 8:
            raise ConfigError(f"--model resnet18 needs images of at least 8x8 pixels, got {height}x{width_px}")
        self.conv1 = nn.Conv2d(channels, width, kernel_size=3, stride=1, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self._planes = width
        self.layer1 = self._stage(width, stride=1)
        self.layer2 = self._stage(2 * width, stride=2)
        self.layer3 = self._stage(4 * width, stride=2)
        self.layer4 = self._stage(8 * width, stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(8 * width, num_classes)
        for module in self.modules():  # torchvision's initialisation
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(module, nn.BatchNorm2d):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)

    def _stage(self, planes: int, stride: int) -> nn.Sequential:
        BasicBlock = require("torchvision", "--model resnet18").models.resnet.BasicBlock  # noqa: N806 - its class

        downsample = None
        if stride != 1 or self._planes != planes:
            downsample = nn.Sequential(
                nn.Conv2d(self._planes, planes, kernel_size=1, stride=stride, bias=False), nn.BatchNorm2d(planes)
            )
        first = BasicBlock(self._planes, planes, stride, downsample)
        self._planes = planes
        return nn.Sequential(first, BasicBlock(planes, planes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.bn1(self.conv1(x)))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def build_resnet18(num_classes: int, input_shape: tuple[int, ...], width: int = 64) -> nn.Module:
    """:class:`ResNet18` (``--model resnet18 --width W``)."""
    return ResNet18(num_classes, input_shape, width)


MODELS: dict[str, Callable[..., nn.Module]] = {"mlp": build_mlp, "mnist_cnn": MnistCNN, "resnet18": build_resnet18}


def build_model(
    name: str, num_classes: int, input_shape: tuple[int, ...], hidden_size: int = 256, width: int = 64
) -> nn.Module:
    """Build a registered model or a user's ``pkg.module:function``.

    ``hidden_size`` sizes ``mlp``; ``width`` sizes ``resnet18``.

        >>> build_model("mlp", num_classes=10, input_shape=(1, 8, 8))[1]
        Linear(in_features=64, out_features=256, bias=True)
    """
    builder = resolve(name, MODELS, kind="model", call_with=("num_classes", "input_shape"),
                      expected="def build(num_classes: int, input_shape: tuple[int, ...]) -> torch.nn.Module")
    if name == "mnist_cnn" and len(input_shape) != 3:
        raise ConfigError(f"--model mnist_cnn needs image inputs (C, H, W), got shape {input_shape}; try --model mlp")
    if builder is build_mlp:
        model = build_mlp(num_classes, input_shape, hidden_size)
    elif builder is build_resnet18:
        model = build_resnet18(num_classes, input_shape, width)
    else:
        model = builder(num_classes=num_classes, input_shape=input_shape)
    if not isinstance(model, nn.Module):
        raise ConfigError(f"--model {name} returned {type(model).__name__}; it must return a torch.nn.Module")
    return model


# ----------------------------------------------------------------------------- Transformers models

AUTO_CLASSES = {"sequence_classification": "AutoModelForSequenceClassification", "causal_lm": "AutoModelForCausalLM"}


def is_pretrained_folder(name: str) -> bool:
    """Whether ``--model name`` is a folder written by ``save_pretrained`` (it holds a config.json)."""
    return os.path.isfile(os.path.join(name, "config.json"))


@contextlib.contextmanager
def _load_report_on_the_first_rank():
    """Transformers' LOAD REPORT (a fresh head's missing keys, unused weights) once per launch, not once per rank:
    every rank loads the same folder, so the others' reports say nothing new. It is a warning of the
    ``transformers.modeling_utils`` logger (transformers/utils/loading_report.py ``log_state_dict_report``), which
    the other ranks raise to errors for the load only."""
    import logging

    if prints("first"):
        yield
        return
    log = logging.getLogger("transformers.modeling_utils")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


def build_transformers_model(
    task: str, folder: str | None = None, config_file: str | None = None, *, num_labels: int | None = None,
    tokenizer: Any = None, max_length: int | None = None, attn_implementation: str | None = None,
) -> nn.Module:
    """``AutoModelFor<task>`` from a ``save_pretrained`` folder, or from a config file with fresh weights.

    From a config, the vocabulary size and special token ids follow the tokenizer (the config is
    then reusable with any tokenizer). A folder's weights load in float32, whatever they were saved
    in (mixed precision is ``--mixed_precision``'s job); a classification head of another size is
    replaced by a fresh one for ``num_labels`` classes. ``attn_implementation`` (``--attn_implementation``)
    goes to ``from_config``/``from_pretrained`` as is; one the model or this machine cannot run is refused.
    """
    what = f"--model_config {config_file}" if config_file else f"--model {folder}"
    if task not in AUTO_CLASSES:
        raise ConfigError(f"{what} is a Transformers model; pick its task with --task "
                          f"{' or --task '.join(AUTO_CLASSES)}")
    transformers = require("transformers", what)
    auto = getattr(transformers, AUTO_CLASSES[task])
    overrides: dict[str, Any] = {"num_labels": num_labels} if task == "sequence_classification" and num_labels else {}
    if tokenizer is not None and tokenizer.pad_token_id is not None:
        overrides["pad_token_id"] = tokenizer.pad_token_id  # sequence classifiers find each text's last token by it
    attention = {"attn_implementation": attn_implementation} if attn_implementation else {}
    try:
        if config_file:
            if tokenizer is not None:
                overrides.update(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                                 eos_token_id=tokenizer.eos_token_id)
            # Overrides go in before the config is built: it checks its token ids against its vocabulary size.
            with open(config_file, encoding="utf-8") as fh:
                values = {**json.load(fh), **overrides}
            model = auto.from_config(transformers.AutoConfig.for_model(**values), **attention)
        else:
            with _load_report_on_the_first_rank():
                model = auto.from_pretrained(folder, dtype=torch.float32, **overrides, **attention,
                                             ignore_mismatched_sizes="num_labels" in overrides)
    except (ImportError, ValueError) as err:
        if attention and ("attn" in str(err) or "ttention" in str(err)):  # Transformers' own check of the name
            raise ConfigError(attention_refused(what, attn_implementation, err)) from None
        if isinstance(err, ImportError):
            raise
        raise ConfigError(built_refused(what, task, err)) from None
    except (OSError, KeyError, TypeError) as err:  # bad JSON, an unknown model type, missing weights...
        raise ConfigError(built_refused(what, task, err)) from None
    positions = getattr(model.config, "max_position_embeddings", None)
    if max_length and positions and max_length > positions:
        raise ConfigError(f"--max_length {max_length} exceeds the {positions} positions of {what}; "
                          f"use --max_length {positions} or less")
    return model


def built_refused(what: str, task: str, err: BaseException) -> str:
    first = (str(err).strip().splitlines() or [type(err).__name__])[0][:300]
    return (f"{what}: cannot build a {AUTO_CLASSES[task]} from it ({first}); give a Transformers config.json or "
            "save_pretrained folder of a model that has one")


def attention_refused(what: str, name: str, err: BaseException) -> str:
    first = (str(err).strip().splitlines() or [type(err).__name__])[0][:300]
    return f"--attn_implementation {name}: {what} cannot use it ({first}); choose sdpa or eager, or drop the flag"


def set_attn_implementation(model: nn.Module, name: str) -> None:
    """``--attn_implementation`` for a model the caller built: Transformers' ``set_attn_implementation``, else
    refused with one line (the flag means nothing to a model that is not a Transformers one)."""
    setter = getattr(model, "set_attn_implementation", None)
    what = f"the model {type(model).__name__}"
    if not callable(setter):
        raise ConfigError(f"--attn_implementation {name}: {what} is not a Transformers model (no "
                          "set_attn_implementation); drop the flag")
    try:
        setter(name)
    except (ImportError, ValueError) as err:
        raise ConfigError(attention_refused(what, name, err)) from None


def export_pretrained(accelerator, model: nn.Module, tokenizer: Any, output_dir: str,
                      merge_adapter: bool = False) -> str | None:
    """Save a Transformers model (and its tokenizer) with ``save_pretrained`` to ``OUTPUT_DIR/hf_model``.

    Loadable with ``AutoModelFor...from_pretrained(OUTPUT_DIR/hf_model)``. Every rank calls this
    (the state dict is collective under sharded strategies); the main process writes a temporary
    folder and renames it into place. Returns the folder, or None for a model without ``save_pretrained``.
    A model with LoRA adapters (``--peft lora``) writes ``OUTPUT_DIR/adapter`` instead, and with ``merge_adapter``
    the merged model as ``hf_model`` (``finetune.export_adapter``).
    """
    unwrapped = accelerator.unwrap_model(model, keep_torch_compile=False)  # --compile: the model, not its wrapper
    if is_peft_model(unwrapped):  # the adapter from the unwrapped model: no DDP "module." in its names
        return export_adapter(accelerator, unwrapped, tokenizer, output_dir, merge_adapter)
    if not hasattr(unwrapped, "save_pretrained"):
        return None
    state = plain_state_dict(accelerator.get_state_dict(model))  # no _orig_mod. keys under --compile
    final = os.path.join(output_dir, PRETRAINED_SUBDIR)
    if accelerator.is_main_process:
        tmp = f"{final}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        unwrapped.save_pretrained(tmp, state_dict=state)  # safetensors
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        follow_umask(tmp)  # its safetensors files are 0600, whatever the umask
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
    accelerator.wait_for_everyone()
    return final


@config_section
@dataclass(frozen=True)
class ModelOptions:
    """The options that name and size the run's model (``build_configured_model``)."""

    model: str
    model_config: str | None
    task: str
    max_length: int  # a text task's longest sequence: a Transformers model's positions are checked against it
    attn_implementation: str | None
    hidden_size: int
    width: int


def build_configured_model(options: ModelOptions, data: Data) -> torch.nn.Module:
    """The model named by --model / --model_config: a Transformers model, a built-in one or the user's builder."""
    model = options.model
    if os.path.isdir(model) and not is_pretrained_folder(model):
        raise ConfigError(f"--model {model}: a folder without a config.json; give a folder written by "
                          "save_pretrained (a run's final model is OUTPUT_DIR/hf_model)")
    transformers_model = options.model_config is not None or is_pretrained_folder(model) or (
        model not in MODELS and ":" not in model and "/" in model)  # a Hub id: org/name
    if transformers_model:
        return build_transformers_model(
            options.task, None if options.model_config else model, options.model_config,
            num_labels=data.num_classes, tokenizer=data.tokenizer,
            max_length=options.max_length if data.tokenizer is not None else None,
            attn_implementation=options.attn_implementation)
    if options.attn_implementation is not None:
        raise ConfigError(f"--attn_implementation {options.attn_implementation} chooses a Transformers model's "
                          f"attention; --model {model} is not one: drop the flag")
    if options.task in TEXT_TASKS and ":" not in model:
        raise ConfigError(f"--task {options.task} needs a Transformers model: --model FOLDER (save_pretrained) or "
                          f"--model_config config.json, or your own --model pkg.module:function")
    if data.input_shape is None and ":" not in model:
        raise ConfigError(f"--model {model} takes (input, label) samples, but the dataset yields dicts; give a "
                          "model that takes them (model=, a Transformers folder, or pkg.module:function)")
    return build_model(model, data.num_classes or _infer_num_classes(data.train), data.input_shape,
                       options.hidden_size, width=options.width)


def _infer_num_classes(dataset: Dataset) -> int:
    if hasattr(dataset, "classes"):
        return len(dataset.classes)
    tensors = getattr(dataset, "tensors", None)
    if tensors is not None and len(tensors) >= 2:
        return int(tensors[1].max()) + 1
    raise ConfigError("cannot tell the number of classes of train_dataset; pass model= built for it")
