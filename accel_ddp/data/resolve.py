"""What a run trains and evaluates on: the datasets from the config (built once per machine first) or the
caller's, and how to batch them.

    data = resolve_data(options, accelerator, train_dataset, eval_dataset)   # built once per machine, or the caller's
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple, TypeVar

from accelerate import Accelerator
from torch.utils.data import Dataset, IterableDataset, Subset

from accel_ddp.config import TEXT_TASKS
from accel_ddp.config.debug import debug_mode
from accel_ddp.config.views import config_section
from accel_ddp.data import HFSource, build_datasets
from accel_ddp.data.in_memory import TokenBlocks, without_subsets
from accel_ddp.data.memory_budget import in_memory_limit
from accel_ddp.data.text import PadCollate, TextOptions, build_text, has_tokenizer, import_text_libraries, pad_token_id
from accel_ddp.data.text_cache import cache_root
from accel_ddp.lifecycle.preemption import PreemptionWatcher
from accel_ddp.util.optional import import_quietly
from accel_ddp.util.registry import resolve
from accel_ddp.util.validation import ConfigError

T = TypeVar("T")


@config_section
@dataclass(frozen=True)
class DataOptions:
    """The options that name, build and cut the run's data sets (``resolve_data``)."""

    dataset: str
    data_dir: str
    download: bool
    task: str  # a text task tokenizes (--tokenizer, else --model's own)
    model: str
    loader: str  # not the device loader: the machine's memory budget decides what is held in memory
    device_loader_max_mb: int
    hf_name: str | None
    hf_config: str | None
    hf_train_split: str
    hf_eval_split: str | None
    image_column: str | None
    label_column: str | None
    streaming: bool
    shuffle_buffer: int
    synthetic_samples: int
    synthetic_shape: tuple[int, ...]
    synthetic_classes: int
    image_size: int | None
    text_column: str | None
    tokenizer: str | None
    max_length: int
    packing: bool
    text_cache: str | None
    collate_fn: str | None
    debug: bool  # the sets cut to a few global batches
    global_batch_size: int | None  # resolved by the batch layout before the data is built


class Data(NamedTuple):
    """The datasets of a run and what the model and the loaders need to know about them."""

    train: Dataset
    eval: Dataset | None
    num_classes: int | None  # None: read from the dataset if a built-in model needs it
    input_shape: tuple[int, ...] | None  # one (input, label) sample's input shape; None for dict samples
    tokenizer: Any = None  # text tasks: the tokenizer (saved beside a Transformers model)
    collate_fn: Callable | None = None  # dict samples: padded per batch; None: torch's default_collate
    memory_limit: Any = None  # memory_budget.InMemoryLimit (None with --loader device): what --loader auto holds


def resolve_data(options: DataOptions, accelerator: Accelerator, train_dataset, eval_dataset, collate_fn=None, *,
                 preemption: PreemptionWatcher | None = None) -> Data:
    """The datasets from the config (built once per machine first) or the caller, and how to batch them.

    ``preemption``: a signal during the build stops it, and every rank (``local_main_first``)."""
    tokenizer = None
    # The machine's memory budget (cgroup-aware host memory / local ranks, device memory): collective, agreed.
    limit = in_memory_limit(accelerator, options.device_loader_max_mb) if options.loader != "device" else None
    hf = HFSource(options.hf_name, options.hf_config, options.hf_train_split, options.hf_eval_split,
                  options.image_column, options.label_column, streaming=options.streaming,
                  shuffle_buffer=options.shuffle_buffer,
                  # in memory below the threshold (the device loader can serve it), memory-mapped above
                  in_memory_max_mb=math.inf if limit is None else limit.decode_mb, memory_limit=limit)
    if train_dataset is None and options.task in TEXT_TASKS and options.dataset == "hf":
        text = TextOptions(options.tokenizer or (options.model if has_tokenizer(options.model) else None),
                           options.text_column, options.max_length, options.packing,
                           labels=options.task == "sequence_classification",
                           cache_dir=cache_root(options.text_cache),
                           cache_write=accelerator.is_local_main_process)  # goes first (local_main_first)
        # Tokenized on each machine's first process, then read from the datasets cache by the others.
        bundle, tokenizer = local_main_first(accelerator, lambda: build_text(options.data_dir, hf, text),
                                             preemption=preemption, phase="data: tokenizing",
                                             while_waiting=lambda: import_text_libraries(options.data_dir, hf, text))
    elif train_dataset is None:
        bundle = local_main_first(accelerator, lambda: build_datasets(  # one download per --data_dir
            options.dataset, options.data_dir, options.download, samples=options.synthetic_samples,
            shape=options.synthetic_shape, classes=options.synthetic_classes, image_size=options.image_size, hf=hf,
        ), main_first=options.download, preemption=preemption,
            while_waiting=(lambda: import_quietly("datasets")) if options.dataset == "hf" else None)
    if train_dataset is None:
        train_dataset, eval_dataset = bundle.train, bundle.eval
        num_classes, input_shape = bundle.num_classes, bundle.input_shape
    else:
        num_classes, input_shape = None, None
    streamed = isinstance(train_dataset, IterableDataset)  # a stream has no [0]: its bundle gave the shape
    if not streamed and hasattr(train_dataset, "__len__") and len(train_dataset) == 0:
        raise ConfigError(f"the training set of --dataset {options.dataset} ({type(train_dataset).__name__}) holds no "
                          "samples (0 rows), so there is nothing to train on; check its files or filters, or give a "
                          "dataset with samples")
    if not streamed and isinstance(train_dataset[0], Mapping):  # dict samples: no single input shape
        input_shape = None
    elif input_shape is None:
        input_shape = tuple(train_dataset[0][0].shape)
    elif not streamed:
        _check_input_shape(options.dataset, input_shape, train_dataset[0][0])
    if eval_dataset is not None and not isinstance(eval_dataset, IterableDataset) and len(eval_dataset) == 0:
        raise ConfigError(f"the eval set ({type(eval_dataset).__name__}) holds no samples, so there is nothing to "
                          "evaluate; give it samples, or train without one (no eval_dataset)")
    debug, batch = debug_mode(options), options.global_batch_size
    if debug.train_batches and not streamed:  # a small subset: errors show up in seconds
        train_dataset = Subset(train_dataset, range(min(len(train_dataset), debug.train_batches * batch)))
        if eval_dataset is not None:
            eval_dataset = Subset(eval_dataset, range(min(len(eval_dataset), debug.eval_batches * batch)))
    collate_fn = collate_fn or (resolve(options.collate_fn, {}, kind="collate_fn") if options.collate_fn else None)
    if collate_fn is None and input_shape is None and not isinstance(without_subsets(train_dataset), TokenBlocks):
        collate_fn = PadCollate(pad_token_id(tokenizer))  # dict samples, maybe of different lengths
    return Data(train_dataset, eval_dataset, num_classes, input_shape, tokenizer, collate_fn, limit)


def _check_input_shape(dataset: str, declared: tuple[int, ...], sample: Any) -> None:
    """A builder's ``input_shape`` sizes the model's first layer: one that does not hold a sample's values would fail
    inside the first forward (``mat1 and mat2 shapes cannot be multiplied``). Sizes compared, not shapes: a flat
    model takes (1, 8, 8) and (64,) alike."""
    shape = getattr(sample, "shape", None)
    if shape is None or math.prod(shape) == math.prod(declared):
        return
    raise ConfigError(f"--dataset {dataset} declares input_shape {tuple(declared)}, but its first sample's input has "
                      f"shape {tuple(shape)}; return the samples' shape as input_shape, e.g. {tuple(shape)}")


def local_main_first(accelerator: Accelerator, build: Callable[[], T], main_first: bool = False, *,
                     preemption: PreemptionWatcher | None = None, phase: str = "data",
                     while_waiting: Callable[[], None] | None = None) -> T:
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

    ``while_waiting``: what a process that does not go first runs before it waits, e.g. importing the libraries
    ``build`` needs (no data, no files). The first process pays that inside its build anyway; a waiting one
    would pay it after the wait, on the start-up's critical path (datasets and the tokenizer classes: ~1.6 s of
    the causal-LM start-up on the development machine).
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

    if turn and while_waiting is not None:
        while_waiting()
    for _ in range(turn):  # the barriers of the turns before this process's
        barrier()
    try:
        if preemption is None:
            return build()
        return preemption.interruptible(build)[1]  # interrupted: None, and the next barrier raises Preempted
    finally:
        for _ in range(turn, barriers):  # every process passes every barrier, also when build fails
            barrier()


