"""``--per_device_batch_size auto``: the largest micro-batch that fits, found once at start, the global batch unchanged.

The probe runs before the model is wrapped for DDP, so no rank can enter a gradient all-reduce that a rank which ran
out of memory never reaches (the hang a DDP backward would make). At each candidate size every rank runs the
training forward and backward of a batch of that size locally (two micro-steps where the step accumulates, so that
the second runs with the gradients held) next to a buffer the size of the optimizer's state and of the data the
device loader will put on the GPU (``device_data_bytes``), catches an out-of-memory error, then the ranks agree with
one all-reduce (MAX) of the flag. If any rank failed, every rank drops the gradients, frees the device cache and
tries the largest size that divides its share of the global batch and is at most half the last one (accumulation
doubles); at 1, one line and exit 2. Once all ranks fit, the probe's gradients are dropped and the random-number
generators and the model's buffers (batch norm statistics) are put back as they were, so the run is the run started
with ``--per_device_batch_size <that size>``: the loaders are built at it, the samples of every step are those of
such a run (the order is a function of seed, epoch and position, accel_ddp/data/sampler.py).

The size is recorded with the run facts (config.yaml's ``resolved``, every checkpoint.json, summary.json) and a
resume reuses the checkpoint's without probing again.

    >>> chosen = choose_micro_batch(options, start, accelerator, model, task, data)   # before accelerator.prepare
    >>> chosen.size, chosen.accumulation, chosen.facts()
    (8, 2, {'requested': 'auto', 'tried': [32, 16, 8], 'from': 'probe'})
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType, send_to_device
from accelerate.utils.memory import clear_device_cache, should_reduce_batch_size

from accel_ddp.checkpoint.start import StartOptions, recorded_layout
from accel_ddp.config import accumulation_steps, largest_micro_batch
from accel_ddp.config.layout import auto_batch_cap
from accel_ddp.config.views import config_section
from accel_ddp.data.in_memory import as_in_memory, is_in_memory
from accel_ddp.data.loaders import choose_loader, data_source, first_samples
from accel_ddp.util.messages import note
from accel_ddp.util.validation import ConfigError

# Where the probe cannot stand for a rank's memory: the model is sharded, or the step runs elsewhere.
UNPROBED = (DistributedType.FSDP, DistributedType.DEEPSPEED, DistributedType.XLA, DistributedType.MEGATRON_LM)
STATE_SLOTS = {"adamw": 2, "sgd": 1}  # parameter-sized tensors of optimizer state: Adam's two moments; momentum


@config_section
@dataclass(frozen=True)
class AutoBatchOptions:
    """The options the probe reads: the batch asked for, and what sizes the memory it must leave free."""

    per_device_batch_size: int | str | None  # "auto" or "auto:CAP" here
    global_batch_size: int | None  # resolved by the batch layout before the probe runs
    loader: str  # with device_loader_max_mb: whether the training set will sit on the device
    device_loader_max_mb: int
    optimizer: str  # its state's size (STATE_SLOTS)
    ddp_gradient_as_bucket_view: bool  # without it DDP's buckets copy the gradients

    @property
    def cap(self) -> int | None:
        """The CAP of ``auto:CAP`` (config/layout.py), or None."""
        return auto_batch_cap(self.per_device_batch_size)


@dataclass
class ChosenBatch:
    """The micro-batch ``--per_device_batch_size auto`` settled on, and how."""

    requested: str  # "auto" or "auto:CAP"
    size: int  # samples per forward pass on one rank
    accumulation: int  # micro-steps per optimizer step
    source: str  # "probe", or "checkpoint": the size the resumed checkpoint recorded
    tried: list[int] = field(default_factory=list)  # the probe's sizes, largest first; the last one fitted

    def facts(self) -> dict[str, Any]:
        """The run facts' ``auto_batch`` entry (config.yaml, checkpoint.json, summary.json)."""
        return {"requested": self.requested, "tried": self.tried, "from": self.source}


def choose_micro_batch(options: AutoBatchOptions, start: StartOptions, accelerator: Accelerator, model: torch.nn.Module,
                       task, data) -> ChosenBatch:
    """The run's micro-batch (collective): the resumed checkpoint's (``start``: what the run resumes from), or the
    largest that fits on every rank.

    Call it with the model built but not prepared. Sets the Accelerator's accumulation to match
    (``Accelerator.gradient_accumulation_steps`` has a setter: accelerate/accelerator.py).
    """
    world = accelerator.num_processes
    if accelerator.distributed_type in UNPROBED:
        raise ConfigError(f"--per_device_batch_size {options.per_device_batch_size} with "
                          f"{accelerator.distributed_type.value}: the probe measures a whole model on one device; "
                          "give a number (e.g. --per_device_batch_size 8)")
    share = options.global_batch_size // world
    meta = recorded_layout(start, accelerator) or {}
    recorded = meta.get("per_device_batch_size")
    reusable = type(recorded) is int and recorded > 0 and share % recorded == 0 and \
        meta.get("global_batch_size") == options.global_batch_size and recorded <= (options.cap or share)
    if reusable:
        chosen = ChosenBatch(options.per_device_batch_size, recorded, share // recorded, "checkpoint")
    else:
        if type(recorded) is int and accelerator.is_main_process:  # not the run's layout any more: said, not silent
            note(f"--per_device_batch_size {options.per_device_batch_size}: the checkpoint's micro-batch {recorded} "
                 f"(global batch {meta.get('global_batch_size')}) does not fit this run's global batch "
                 f"{options.global_batch_size} x {world} ranks or cap; probing again")
        chosen = _probe(options, accelerator, model, task, data)
    accelerator.gradient_accumulation_steps = chosen.accumulation
    if accelerator.is_main_process:
        how = f"tried {', '.join(map(str, chosen.tried))}" if chosen.source == "probe" else "the checkpoint's"
        note(f"--per_device_batch_size {chosen.requested}: {chosen.size} per device x {chosen.accumulation} "
             f"accumulation steps ({how}; global batch {options.global_batch_size})")
    return chosen


def _probe(options: AutoBatchOptions, accelerator: Accelerator, model: torch.nn.Module, task, data) -> ChosenBatch:
    """Halve from the largest candidate until every rank fits (one all-reduce per size), restoring what it moved."""
    world = accelerator.num_processes
    size = largest_micro_batch(options.global_batch_size, world, options.cap)
    model.to(accelerator.device)  # where accelerator.prepare puts it (device_placement); a no-op there then
    reserve = _state_bytes(options, model, world) + device_data_bytes(options, accelerator, data)
    was_training, buffers = model.training, [b.detach().clone() for b in model.buffers()]
    tried = []
    py_state, np_state = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(**rng_fork(accelerator.device)):  # torch's CPU and this device's generators restored
        model.train()
        while True:
            tried.append(size)
            accumulation = accumulation_steps(size, options.global_batch_size, world)
            fits = _fits(accelerator, model, task, data, size, min(accumulation, 2), reserve)
            _drop_gradients(model)
            if not _any_rank(accelerator, not fits):
                break
            if size == 1:
                raise ConfigError(f"--per_device_batch_size {options.per_device_batch_size}: a micro-batch of 1 does "
                                  f"not fit in memory on some rank (tried {', '.join(map(str, tried))}); use a "
                                  "smaller model, --mixed_precision bf16, or a device with more memory")
            size = largest_micro_batch(options.global_batch_size, world, size // 2)
    random.setstate(py_state)
    np.random.set_state(np_state)
    with torch.no_grad():
        for buffer, saved in zip(model.buffers(), buffers, strict=True):
            buffer.copy_(saved)
    model.train(was_training)
    return ChosenBatch(options.per_device_batch_size, size, accumulation, "probe", tried)


def _fits(accelerator: Accelerator, model, task, data, size: int, micro_steps: int, reserve: int) -> bool:
    """Whether this rank runs ``micro_steps`` training forwards and backwards of ``size`` samples, with
    ``reserve`` bytes held for the optimizer's state, without running out of memory (no collective inside)."""
    collate = data.collate_fn or torch.utils.data.default_collate
    try:
        held = torch.empty(reserve, dtype=torch.uint8, device=accelerator.device) if reserve else None
        batch = send_to_device(collate(probe_samples(data.train, size)), accelerator.device)
        with accelerator.autocast():  # mixed precision as accelerator.prepare will wrap the forward
            for _ in range(micro_steps):
                task.training_loss(model, batch).value.backward()
        del held
        return True
    except RuntimeError as err:  # leaving the block lets go of the traceback, and so of the step's activations
        # torch.OutOfMemoryError, and what Accelerate's own batch finder takes for one (a cuDNN refusal, the CPU
        # allocator's failure: accelerate/utils/memory.py should_reduce_batch_size)
        if isinstance(err, torch.OutOfMemoryError) or should_reduce_batch_size(err):
            return False
        raise


def probe_samples(dataset, size: int) -> list:
    """``size`` samples to measure a micro-batch of ``size`` with: the first ones, repeated where the source has
    fewer (a stream holds only the few rows it read at start-up; a small set fewer than the share)."""
    rows = first_samples(dataset, size)
    if rows and len(rows) < size:
        rows = (rows * -(-size // len(rows)))[:size]
    return rows


def rng_fork(device: torch.device) -> dict[str, Any]:
    """``torch.random.fork_rng``'s arguments for the generators a step on ``device`` draws from: the CPU's
    (always forked) and this one device's, of its own type (fork_rng's default type is the machine's accelerator,
    else CUDA: torch/random.py), so the probe leaves MPS's and XPU's generators as it found them too."""
    if device.type == "cpu":
        return {"devices": []}
    return {"devices": [device], "device_type": device.type}


def device_data_bytes(options: AutoBatchOptions, accelerator: Accelerator, data) -> int:
    """Device memory the loaders will take after the probe: with the device loader on an accelerator, the whole
    in-memory training set (DeviceLoader moves it there) and this rank's share of an in-memory eval set
    (DeviceEvalLoader); 0 where the data stays on the host (a DataLoader, a stream, a collate_fn, a CPU run).
    The same choice as build_loaders makes, asked before it (quietly: it says it then)."""
    if accelerator.device.type == "cpu" or data_source(data.train) == "streaming" or data.collate_fn is not None:
        return 0
    kind = choose_loader(options.loader, data.train, options.device_loader_max_mb, data.memory_limit, quiet=True)
    if kind != "device":
        return 0
    total = as_in_memory(data.train).nbytes
    if data.eval is not None and is_in_memory(data.eval):  # its rank share at most (DeviceEvalLoader's slice)
        total += -(-as_in_memory(data.eval).nbytes // accelerator.num_processes)
    return total


def _drop_gradients(model: torch.nn.Module) -> None:
    """The probe's gradients go (``set_to_none``), and the memory of its activations back to the device."""
    for p in model.parameters():
        p.grad = None
    clear_device_cache(garbage_collection=True)  # gc first: a traceback cycle may still hold tensors


def _any_rank(accelerator: Accelerator, flag: bool) -> bool:
    """``flag`` on any rank: the probe's one collective per size (an all-reduce MAX of one number)."""
    if accelerator.num_processes == 1:
        return flag
    value = torch.tensor([float(flag)], device=accelerator.device)
    torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MAX)
    return bool(value.item())


def _state_bytes(options: AutoBatchOptions, model: torch.nn.Module, world: int) -> int:
    """Device memory the real steps hold beside the forward and backward that the probe does not make: the
    optimizer's state (allocated at its first step) and, without ``--ddp_gradient_as_bucket_view``, DDP's
    gradient buckets (a copy of the gradients; with it the gradients are views into them)."""
    trainable = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    buckets = 1 if world > 1 and not options.ddp_gradient_as_bucket_view else 0
    return trainable * (STATE_SLOTS.get(options.optimizer, 2) + buckets)
