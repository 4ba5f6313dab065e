"""``--cuda_graphs``: the optimizer step (forward, backward, token-exact rescale, clip, AdamW) captured once as a
CUDA graph and replayed, one launch per step instead of one per operation. Unmeasured on a GPU so far
(docs/performance.md): off by default.

Why ``torch.cuda.CUDAGraph`` (whole-network capture) and not ``torch.compile(mode="reduce-overhead")``: the
target is the host's cost per step of small models (a tiny GPT-2's step is ~10 ms of CPU for far less GPU work,
issue 38), and all of it must go, the optimizer and the clipping included. reduce-overhead graphs only what
dynamo compiled: the model's forward and backward, split at DDP's bucket boundaries (DDPOptimizer), with the
optimizer, the clipping and the loss bookkeeping still launched op by op, and it costs a compile (tens of seconds
of an 8-minute GPU budget). Capturing the whole step records every kernel of it, the NCCL all-reduces included,
and replays them with one call (torch docs, CUDA semantics, "Whole-network capture":
https://docs.pytorch.org/docs/stable/notes/cuda.html#whole-network-capture).

What the capture needs, and where it comes from:

- Static shapes and addresses: the batch is copied into buffers made at the capture (:class:`StepGraph`); a batch
  of another shape is refused with one line (it cannot happen on the paths allowed: the device loader and packed
  text blocks, whose train loaders drop the last partial batch). ``graph_problem`` refuses the rest.
- No host sync inside the step: the loop's step has none (the loss, the item counts and the non-finite watch stay
  on the device; issue 38 item 2 counts them). ``--debug`` (a sync per step), ``--on_anomaly skip|rollback`` (a
  host decision per step off the fused path) and fp16 (GradScaler's ``found_inf`` check) are refused.
- A capturable optimizer: AdamW with ``capturable=True`` keeps its step count on the device, and its learning rate
  as a device tensor that the schedule updates in place (torch's LRScheduler ``fill_``s a tensor LR), so a replay
  reads the current LR instead of the one baked in at the capture (``build_optimizer(capturable=True)``).
- Warm-up before the capture, eagerly, on a side stream: 3 steps (the docs' example), 11 under DDP ("Usage with
  DistributedDataParallel": DDP's own first iterations do one-off work; DDP is also built in a side-stream context,
  :func:`construction_stream`). Those steps train like any other: the run's steps are the same steps.
- NCCL: collectives can be captured since NCCL 2.9.6 (same section); gloo's cannot, so several ranks need NCCL.
  torch's NCCL watchdog skips work enqueued under capture since torch 2.2 (NVIDIA's CUDA graph guide, quick
  checklist), so async error handling stays on.

Accumulation is refused for now: a captured step would have to hold all its micro-steps and DDP's ``no_sync``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from accel_ddp.util.validation import ConfigError

EAGER_WARMUP = 3  # eager steps before the capture (the torch docs' whole-network example)
DDP_WARMUP = 11  # under DDP: "at least 11 DDP-enabled eager iterations before capture" (torch docs)
GRAPH_TYPES = ("NO", "MULTI_GPU")  # Accelerate's distributed types a capture supports (no FSDP, DeepSpeed, XLA)


def refuse_graphs(accelerator: Any, accumulation: int, loader_kind: str, packing: bool) -> None:
    """--cuda_graphs where this launch (``accelerator``) and these loaders cannot be captured: one line."""
    backend = torch.distributed.get_backend() if torch.distributed.is_initialized() else None
    problem = graph_problem(device_type=accelerator.device.type, distributed_type=accelerator.distributed_type.value,
                            num_processes=accelerator.num_processes, backend=backend, accumulation=accumulation,
                            loader_kind=loader_kind, packing=packing, mixed_precision=str(accelerator.mixed_precision))
    if problem is not None:
        raise ConfigError(problem)


def graph_problem(*, device_type: str, distributed_type: str, num_processes: int, backend: str | None,
                  accumulation: int, loader_kind: str, packing: bool, mixed_precision: str) -> str | None:
    """Why ``--cuda_graphs`` cannot run with this launch and these loaders (one line naming the fix), or None.

        >>> graph_problem(device_type="cpu", distributed_type="NO", num_processes=1, backend=None, accumulation=1,
        ...               loader_kind="device", packing=False, mixed_precision="no")
        '--cuda_graphs needs a CUDA device (this run trains on cpu); drop --cuda_graphs'
    """
    if device_type != "cuda":
        return f"--cuda_graphs needs a CUDA device (this run trains on {device_type}); drop --cuda_graphs"
    if distributed_type not in GRAPH_TYPES:
        return (f"--cuda_graphs captures plain or DDP steps, not {distributed_type}; launch without FSDP/DeepSpeed "
                "or drop --cuda_graphs")
    if num_processes > 1 and backend != "nccl":
        return (f"--cuda_graphs with {num_processes} processes needs NCCL (a {backend} all-reduce cannot be captured "
                "in a CUDA graph); launch one process per GPU over NCCL or drop --cuda_graphs")
    if accumulation > 1:
        return (f"--cuda_graphs captures one micro-step per optimizer step, this run accumulates {accumulation}; "
                "raise --per_device_batch_size to global batch / processes or drop --cuda_graphs")
    if not (loader_kind == "device" or (loader_kind == "dataloader" and packing)):
        return (f"--cuda_graphs needs batches of one shape (the device loader or --packing text blocks); the "
                f"{loader_kind} path's shapes vary; use --loader device or drop --cuda_graphs")
    if mixed_precision == "fp16":
        return ("--cuda_graphs with fp16: the loss scaler checks for inf on the host every step; use bf16 or drop "
                "--cuda_graphs")
    return None


@contextlib.contextmanager
def construction_stream(enabled: bool) -> Iterator[None]:
    """DDP built in a side-stream context before a whole-backward capture (torch docs, "Usage with
    DistributedDataParallel"); nothing where ``enabled`` is false or there is no GPU."""
    if not (enabled and torch.cuda.is_available()):
        yield
        return
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        yield
    torch.cuda.current_stream().wait_stream(side)


def device_learning_rates(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    """Every group's LR a tensor on ``device``: what a captured capturable AdamW reads at each replay.

    Loading a checkpoint replaces each group's LR with the saved one (a tensor where the optimizer was built with
    one, on the device it was loaded to); the capture must see the tensor the schedule will update."""
    for group in optimizer.param_groups:
        lr = group["lr"]
        if not isinstance(lr, torch.Tensor) or lr.device != device:
            group["lr"] = torch.as_tensor(lr, dtype=torch.float32).to(device)


class CudaGraphs:
    """The capture on a real GPU: eager warm-up steps on a side stream, then ``torch.cuda.graph``."""

    def __init__(self) -> None:
        self.stream = torch.cuda.Stream()

    def eager(self, fn: Callable[[Any], None], batch: Any) -> None:
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            fn(batch)
        torch.cuda.current_stream().wait_stream(self.stream)

    def capture(self, fn: Callable[[Any], None], static: Any) -> Callable[[], None]:
        graph = torch.cuda.CUDAGraph()
        # thread_local: a DataLoader's pin-memory thread or a tracker's thread may touch CUDA during the capture.
        with torch.cuda.graph(graph, stream=self.stream, capture_error_mode="thread_local"):
            fn(static)
        return graph.replay


class StepGraph:
    """``fn(batch)`` (one whole optimizer step) run eagerly ``warmup`` times, then captured once and replayed.

    The capture records ``fn``'s device work on buffers made for it (``static``), without running it; each call
    from then on copies its batch into those buffers and replays. ``fn``'s host work (Python state) runs at the
    warm-up steps and once at the capture, never at a replay: what must happen every step stays outside ``fn``.

        >>> step = StepGraph(train_one_step, warmup=3, backend=CudaGraphs())
        >>> for batch in loader:
        ...     step(batch)

    ``backend`` makes the warm-up and the capture (:class:`CudaGraphs` on a GPU; the tests give a stand-in).
    """

    def __init__(self, fn: Callable[[Any], None], warmup: int, backend) -> None:
        self.fn, self.warmup, self.backend = fn, warmup, backend
        self.eager_steps = 0
        self.replays = 0
        self.static: Any = None
        self._replay: Callable[[], None] | None = None

    @property
    def captured(self) -> bool:
        return self._replay is not None

    def __call__(self, batch: Any) -> None:
        if self.eager_steps < self.warmup:
            self.backend.eager(self.fn, batch)
            self.eager_steps += 1
            return
        if self._replay is None:
            self.static = static_copy(batch)
            self._replay = self.backend.capture(self.fn, self.static)
        else:
            copy_into(self.static, batch)
        self._replay()
        self.replays += 1


def static_copy(batch: Any) -> Any:
    """A copy of ``batch`` (tensors in tuples, lists and dicts; other leaves as they are) in buffers of its own."""
    if isinstance(batch, torch.Tensor):
        return batch.detach().clone()
    if isinstance(batch, dict):
        return {key: static_copy(value) for key, value in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(static_copy(value) for value in batch)
    return batch


def copy_into(static: Any, batch: Any) -> None:
    """Copy ``batch`` into the buffers ``static_copy`` made; a batch of another structure or shape is refused."""
    if isinstance(static, torch.Tensor):
        if not isinstance(batch, torch.Tensor) or batch.shape != static.shape or batch.dtype != static.dtype:
            got = f"{tuple(batch.shape)} {batch.dtype}" if isinstance(batch, torch.Tensor) else type(batch).__name__
            raise ConfigError(f"--cuda_graphs: a batch of {got} after capturing {tuple(static.shape)} {static.dtype}: "
                              "the captured step needs batches of one shape; drop --cuda_graphs for this data")
        static.copy_(batch, non_blocking=True)
    elif isinstance(static, dict):
        if not isinstance(batch, dict) or batch.keys() != static.keys():
            raise ConfigError(f"--cuda_graphs: a batch with keys {sorted(batch) if isinstance(batch, dict) else '?'} "
                              f"after capturing {sorted(static)}; drop --cuda_graphs for this data")
        for key, value in static.items():
            copy_into(value, batch[key])
    elif isinstance(static, (tuple, list)):
        if not isinstance(batch, (tuple, list)) or len(batch) != len(static):
            raise ConfigError("--cuda_graphs: a batch of another structure than the captured one; drop --cuda_graphs "
                              "for this data")
        for mine, theirs in zip(static, batch, strict=True):
            copy_into(mine, theirs)
    elif static != batch:
        raise ConfigError(f"--cuda_graphs: a batch holds {batch!r} where the captured one held {static!r}; drop "
                          "--cuda_graphs for this data")
