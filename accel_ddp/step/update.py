"""The backward and the optimizer update (clip, step, zero_grad) without Accelerate's per-call work where it adds
nothing.

Accelerate's ``AcceleratedOptimizer.step`` looks for the ``lomo_optim`` package twice per call
(``importlib.util.find_spec`` over ``sys.path``, not cached), its ``zero_grad`` inspects the
optimizer's signature on every call, and ``Accelerator.clip_grad_norm_`` compares torch versions
and sorts DTensor gradients from plain ones on every call; torch's own ``clip_grad_norm_`` then
groups the gradients by device and dtype twice. Together about 0.3 ms of host time per optimizer
step, a tenth of a small model's step on two CPU ranks (docs/performance.md, "Framework tax").
``Accelerator.backward`` divides every loss by the accumulation steps, 1 included: one more
operation forward and one more node backward (~50 us of the same step).

Where none of that can apply (one device or plain DDP, no fp16 loss scaler, a plain
``AcceleratedOptimizer``) ``build_update`` steps the torch optimizer itself and clips with one
multi-tensor norm, bit for bit what ``torch.nn.utils.clip_grad_norm_`` computes, and, without
accumulation, ``build_backward`` calls ``loss.backward()`` (dividing by 1 changes no bit). Everywhere
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from accelerate import Accelerator
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.utils import DistributedType

# Distributed types whose optimizer step and clipping Accelerate does nothing special for (no sharding, no XLA).
PLAIN_TYPES = (DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU)


def build_update(
    accelerator: Accelerator, model: torch.nn.Module, optimizer, max_grad_norm: float, guard=None
) -> Callable[[], None]:
    """The update at the end of an optimizer step: clip to ``max_grad_norm`` (0: no clipping), step, zero_grad.

    Call it once per optimizer step, when ``accelerator.sync_gradients`` is true (after the last
    micro-step's backward), with the model and optimizer ``accelerator.prepare`` returned.

        >>> update = build_update(accelerator, model, optimizer, max_grad_norm=1.0)
        >>> if accelerator.sync_gradients:
        ...     update()

    ``guard`` (``--on_anomaly skip|rollback``: an ``AnomalyGuard``): the update is left out, on every rank, of a
    step whose all-reduced gradient norm ``guard.decide`` finds bad (see accel_ddp/bad_steps/).
    """
    plain = (type(optimizer) is AcceleratedOptimizer and optimizer.scaler is None
             and accelerator.distributed_type in PLAIN_TYPES)
    if not plain:
        def accelerate_update() -> None:
            if max_grad_norm > 0 or guard is not None:  # inf: the global norm (FSDP: over every shard), no scaling
                norm = accelerator.clip_grad_norm_(model.parameters(), max_grad_norm or math.inf)
            # The guard's decision on this path: one host sync per step (FSDP, DeepSpeed: no found_inf hand-off).
            if guard is None or not bool(guard.decide(norm)):
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        return accelerate_update

    torch_optimizer = optimizer.optimizer
    params = [p for p in model.parameters() if p.requires_grad]
    clip = build_clip(params, max_grad_norm) if max_grad_norm > 0 else None
    if guard is not None:
        return guarded_update(torch_optimizer, params, clip or build_norm(params), guard)

    def update() -> None:
        if clip is not None:
            clip()
        torch_optimizer.step()
        torch_optimizer.zero_grad(set_to_none=True)

    return update


def guarded_update(torch_optimizer, params, clip: Callable[[], torch.Tensor], guard) -> Callable[[], None]:
    """The plain update, left out where ``guard.decide`` (on the clipped norm) says so.

    Here, not in the bad steps' room (accel_ddp/bad_steps/, which decides): the decision is applied inside the
    step, between the clip and the optimizer's kernels, and on a fused optimizer by those kernels themselves.

    A fused optimizer (CUDA) takes the decision as its ``found_inf`` flag, on the device: float32, exactly 1.0 to
    skip (its kernels compare ``== 1``; GradScaler hands it the same way, torch/amp/grad_scaler.py), no host sync.
    Its step counter goes +1 then -1, Adam's moments and the weight decay are untouched. Fused SGD allocates its
    momentum buffers uninitialised on its first step (torch/optim/sgd.py ``_fused_sgd``, ``torch.empty_like``)
    and keeps them even when the kernel skipped: they start as zeros here instead (``0.9 * 0 + g == g``, the
    bits of its own first step). Other optimizers (multi-tensor, the CPU's) reject ``found_inf``: one ``bool()``
    per step, free on the CPU, whose kernels have run by the time the host gets there.
    """
    fused = bool(torch_optimizer.defaults.get("fused")) and getattr(torch_optimizer, "_step_supports_amp_scaling",
                                                                   False)
    if fused and isinstance(torch_optimizer, torch.optim.SGD):
        for group in torch_optimizer.param_groups:
            for p in group["params"]:
                if group["momentum"] and "momentum_buffer" not in torch_optimizer.state[p]:
                    torch_optimizer.state[p]["momentum_buffer"] = torch.zeros_like(p)

    def update() -> None:
        bad = guard.decide(clip())
        if fused:
            torch_optimizer.found_inf = bad.float()
            try:
                torch_optimizer.step()
            finally:
                del torch_optimizer.found_inf
        elif not bool(bad):
            torch_optimizer.step()
        torch_optimizer.zero_grad(set_to_none=True)

    return update


def build_norm(params: list[torch.nn.Parameter]) -> Callable[[], torch.Tensor]:
    """The global L2 norm of the gradients of ``params``, not clipping (``--max_grad_norm 0`` with a guard)."""
    def norm() -> torch.Tensor:
        grads = [p.grad for p in params if p.grad is not None]
        return torch.nn.utils.get_total_norm(grads) if grads else torch.zeros(())

    return norm


def build_clip(params: list[torch.nn.Parameter], max_norm: float) -> Callable[[], torch.Tensor]:
    """Clip the gradients of ``params`` to a global L2 norm of ``max_norm``; returns the norm before clipping.

    ``torch.nn.utils.clip_grad_norm_``'s arithmetic, the same bits, without its per-call grouping
    where every parameter shares one device and dtype (the common case); otherwise torch's. No host
    sync: the scale factor stays on the device.
    """
    if len({(p.device, p.dtype) for p in params}) > 1:
        return lambda: torch.nn.utils.clip_grad_norm_(params, max_norm)

    def clip() -> torch.Tensor:
        grads = [p.grad for p in params if p.grad is not None]
        if not grads:
            return torch.zeros(())
        total = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2.0)), 2.0)
        torch._foreach_mul_(grads, torch.clamp(max_norm / (total + 1e-6), max=1.0))
        return total

    return clip


def build_backward(accelerator: Accelerator) -> Callable[[torch.Tensor], None]:
    """``accelerator.backward``, or ``Tensor.backward`` where Accelerate would only divide the loss by 1.

        >>> backward = build_backward(accelerator)
        >>> backward(loss)
    """
    plain = (accelerator.gradient_accumulation_steps == 1 and accelerator.scaler is None
             and accelerator.distributed_type in PLAIN_TYPES)
    return torch.Tensor.backward if plain else accelerator.backward
