"""What a run is built from: its datasets (and how to batch them) and its model, checked before any write.

    data = resolve_data(cfg, accelerator, train_dataset, eval_dataset)   # built once per machine, or the caller's
    model = build_configured_model(cfg, data)                            # what --model / --model_config name
    probe_task(task, accelerator, model, data, evaluates=True)           # one forward: bad input now, not at step 1
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple, TypeVar

import torch
from accelerate import Accelerator
from accelerate.utils import send_to_device
from torch.utils.data import Dataset, IterableDataset, Subset

from accel_ddp import label_check
from accel_ddp.config import DEBUG_MAX_STEPS, TEXT_TASKS, TrainConfig
from accel_ddp.data import HFSource, build_datasets
from accel_ddp.data.loaders import first_samples
from accel_ddp.data.text import PadCollate, TextOptions, build_text, has_tokenizer, pad_token_id
from accel_ddp.models import MODELS, build_model, build_transformers_model, is_pretrained_folder
from accel_ddp.preemption import PreemptionWatcher
from accel_ddp.registry import describe, resolve
from accel_ddp.tasks import Task
from accel_ddp.validation import ConfigError

T = TypeVar("T")


class Data(NamedTuple):
    """The datasets of a run and what the model and the loaders need to know about them."""

    train: Dataset
    eval: Dataset | None
    num_classes: int | None  # None: read from the dataset if a built-in model needs it
    input_shape: tuple[int, ...] | None  # one (input, label) sample's input shape; None for dict samples
    tokenizer: Any = None  # text tasks: the tokenizer (saved beside a Transformers model)
    collate_fn: Callable | None = None  # dict samples: padded per batch; None: torch's default_collate


def resolve_data(cfg: TrainConfig, accelerator: Accelerator, train_dataset, eval_dataset, collate_fn=None, *,
                 preemption: PreemptionWatcher | None = None) -> Data:
    """The datasets from the config (built once per machine first) or the caller, and how to batch them.

    ``preemption``: a signal during the build stops it, and every rank (``local_main_first``)."""
    tokenizer = None
    hf = HFSource(cfg.hf_name, cfg.hf_config, cfg.hf_train_split, cfg.hf_eval_split, cfg.image_column,
                  cfg.label_column, streaming=cfg.streaming, shuffle_buffer=cfg.shuffle_buffer,
                  # in memory below the threshold (the device loader can serve it), memory-mapped above
                  in_memory_max_mb=math.inf if cfg.loader == "device" else cfg.device_loader_max_mb)
    if train_dataset is None and cfg.task in TEXT_TASKS and cfg.dataset == "hf":
        text = TextOptions(cfg.tokenizer or (cfg.model if has_tokenizer(cfg.model) else None), cfg.text_column,
                           cfg.max_length, cfg.packing, labels=cfg.task == "sequence_classification")
        # Tokenized on each machine's first process, then read from the datasets cache by the others.
        bundle, tokenizer = local_main_first(accelerator, lambda: build_text(cfg.data_dir, hf, text),
                                             preemption=preemption, phase="data: tokenizing")
    elif train_dataset is None:
        bundle = local_main_first(accelerator, lambda: build_datasets(  # one download per --data_dir
            cfg.dataset, cfg.data_dir, cfg.download, samples=cfg.synthetic_samples,
            shape=cfg.synthetic_shape, classes=cfg.synthetic_classes, image_size=cfg.image_size, hf=hf,
        ), main_first=cfg.download, preemption=preemption)
    if train_dataset is None:
        train_dataset, eval_dataset = bundle.train, bundle.eval
        num_classes, input_shape = bundle.num_classes, bundle.input_shape
    else:
        num_classes, input_shape = None, None
    streamed = isinstance(train_dataset, IterableDataset)  # a stream has no [0]: its bundle gave the shape
    if not streamed and isinstance(train_dataset[0], Mapping):  # dict samples: no single input shape
        input_shape = None
    elif input_shape is None:
        input_shape = tuple(train_dataset[0][0].shape)
    if eval_dataset is not None and not isinstance(eval_dataset, IterableDataset) and len(eval_dataset) == 0:
        raise ConfigError(f"the eval set ({type(eval_dataset).__name__}) holds no samples, so there is nothing to "
                          "evaluate; give it samples, or train without one (no eval_dataset)")
    if cfg.debug and not streamed:  # a small subset: errors show up in seconds
        train_dataset = Subset(train_dataset, range(min(len(train_dataset), DEBUG_MAX_STEPS * cfg.global_batch_size)))
        if eval_dataset is not None:
            eval_dataset = Subset(eval_dataset, range(min(len(eval_dataset), 4 * cfg.global_batch_size)))
    collate_fn = collate_fn or (resolve(cfg.collate_fn, {}, kind="collate_fn") if cfg.collate_fn else None)
    if collate_fn is None and input_shape is None:  # dict samples, maybe of different lengths
        collate_fn = PadCollate(pad_token_id(tokenizer))
    return Data(train_dataset, eval_dataset, num_classes, input_shape, tokenizer, collate_fn)


def local_main_first(accelerator: Accelerator, build: Callable[[], T], main_first: bool = False, *,
                     preemption: PreemptionWatcher | None = None, phase: str = "data") -> T:
    """Run ``build`` on each machine's first process, then on the others (they reuse its download).

    ``main_first`` (``--download``): the main process goes first, alone; then the other machines'
    first processes; then the rest. Not a file lock (``flock`` is unreliable or off on the network
    file systems a shared ``--data_dir`` lives on): with one ``--data_dir`` for every machine, their
    first processes would otherwise download into the same files at once, one machine reading a
    file another is still writing; now the main process downloads and the others find the files.
    A ``--data_dir`` local to each machine still gets one download per machine.

    Unlike ``accelerator.local_main_process_first()``, an error on a process that goes first still
    lets the others pass the barriers: they run ``build`` themselves and hit the same error, so every
    rank reports bad input and exits, instead of one rank dying inside a barrier.

    With ``preemption`` (connected to the other ranks) the barriers compare preemption flags, and one
    more follows the last build: a process waiting for the first learns there of a signal any process
    got, a signal interrupts ``build`` where it runs (tokenizing can take minutes; torchrun SIGKILLs
    30 s after its SIGTERM), and every rank raises ``Preempted`` at the same barrier, naming ``phase``.
    A preemption wins over an error of ``build``: the relaunch meets the error again.
    """
    firsts = [accelerator.is_main_process, accelerator.is_local_main_process] if main_first \
        else [accelerator.is_local_main_process]
    turn = next((i for i, first in enumerate(firsts) if first), len(firsts))  # 0 goes first
    barriers = len(firsts) + (preemption is not None)

    def barrier() -> None:
        if preemption is None:
            accelerator.wait_for_everyone()
        else:
            preemption.check_start_up(phase)  # raises on every rank at once, so none waits at the next one

    for _ in range(turn):  # the barriers of the turns before this process's
        barrier()
    try:
        if preemption is None:
            return build()
        return preemption.interruptible(build)[1]  # interrupted: None, and the next barrier raises Preempted
    finally:
        for _ in range(turn, barriers):  # every process passes every barrier, also when build fails
            barrier()


def build_configured_model(cfg: TrainConfig, data: Data) -> torch.nn.Module:
    """The model named by --model / --model_config: a Transformers model, a built-in one or the user's builder."""
    if os.path.isdir(cfg.model) and not is_pretrained_folder(cfg.model):
        raise ConfigError(f"--model {cfg.model}: a folder without a config.json; give a folder written by "
                          "save_pretrained (a run's final model is OUTPUT_DIR/hf_model)")
    transformers_model = cfg.model_config is not None or is_pretrained_folder(cfg.model) or (
        cfg.model not in MODELS and ":" not in cfg.model and "/" in cfg.model)  # a Hub id: org/name
    if transformers_model:
        return build_transformers_model(
            cfg.task, None if cfg.model_config else cfg.model, cfg.model_config, num_labels=data.num_classes,
            tokenizer=data.tokenizer, max_length=cfg.max_length if data.tokenizer is not None else None)
    if cfg.task in TEXT_TASKS and ":" not in cfg.model:
        raise ConfigError(f"--task {cfg.task} needs a Transformers model: --model FOLDER (save_pretrained) or "
                          f"--model_config config.json, or your own --model pkg.module:function")
    if data.input_shape is None and ":" not in cfg.model:
        raise ConfigError(f"--model {cfg.model} takes (input, label) samples, but the dataset yields dicts; give a "
                          "model that takes them (model=, a Transformers folder, or pkg.module:function)")
    return build_model(cfg.model, data.num_classes or _infer_num_classes(data.train), data.input_shape,
                       cfg.hidden_size, width=cfg.width)


def _infer_num_classes(dataset: Dataset) -> int:
    if hasattr(dataset, "classes"):
        return len(dataset.classes)
    tensors = getattr(dataset, "tensors", None)
    if tensors is not None and len(tensors) >= 2:
        return int(tensors[1].max()) + 1
    raise ConfigError("cannot tell the number of classes of train_dataset; pass model= built for it")


def probe_task(task: Task, accelerator: Accelerator, model, data: Data, evaluates: bool, loaders=None) -> None:
    """One forward of two training samples: a collate_fn that makes no batch, a missing or non-scalar loss,
    logits that do not fit the labels, a metric that returns no numbers, labels or token ids the model cannot
    take, is bad input, reported before any write.

    Tuple samples with the default cross-entropy only need their shapes checked: the model runs without
    torch.compile's wrapper, which would otherwise compile an extra graph for it. With ``loaders``, the
    labels the probe found out of range are checked over the in-memory sets now, and over each host
    batch of the other loaders later (:mod:`accel_ddp.label_check`).
    """
    collate = data.collate_fn or torch.utils.data.default_collate
    with torch.random.fork_rng(devices=[]):  # a sample's augmentation draws: the run's RNG stream stays as it was
        batch = collate(first_samples(data.train, 2))
    if (problem := not_a_batch(batch)) is not None:
        raise ConfigError(f"the collate_fn {describe(collate)} returned {problem}, not a batch; return a tuple "
                          "(inputs, labels, ...) or a dict of tensors (torch.utils.data.default_collate makes one)")
    forward = label_check.forward_ranges(task, model)
    if (line := label_check.problem(forward, batch, lambda row: f"training sample {row}")) is not None:
        raise ConfigError(line)  # before the forward that it would crash
    batch = send_to_device(batch, accelerator.device)
    shapes_only = data.input_shape is not None and task.loss_fn is None
    outputs = task.check(getattr(model, "_orig_mod", model) if shapes_only else model, batch, evaluates, shapes_only)
    if loaders is not None:
        figures = label_check.figure_ranges(task, outputs, batch)
        label_check.check_before_training(task, forward, figures, data, loaders)


def not_a_batch(batch: Any) -> str | None:
    """What a collate_fn returned if it is no batch the tasks take (None: it is one): a tuple or list holding a
    tensor, or a mapping (a dict, Transformers' BatchEncoding) holding one."""
    values = batch.values() if isinstance(batch, Mapping) else batch if isinstance(batch, (tuple, list)) else None
    if values is not None and any(isinstance(value, torch.Tensor) for value in values):
        return None
    if batch is None:
        return "None"
    if isinstance(batch, torch.Tensor):
        return f"one tensor of shape {tuple(batch.shape)}"
    if isinstance(batch, (tuple, list, Mapping)):
        inside = {type(value).__name__ for value in values}
        return f"a {type(batch).__name__} of {len(batch)} without a tensor ({', '.join(sorted(inside)) or 'empty'})"
    return f"a {type(batch).__name__}"
