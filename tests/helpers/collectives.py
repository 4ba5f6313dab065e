"""Recording the torch.distributed collectives a forked rank calls while ``fit`` runs, in order."""

from __future__ import annotations

import torch

from accel_ddp.cli.args import parse_args

# Every torch.distributed entry point that talks to the other ranks (DDP's gradient buckets go through C++: not here).
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "broadcast",
               "broadcast_object_list", "barrier", "gather", "gather_object", "reduce", "scatter", "reduce_scatter",
               "reduce_scatter_tensor", "all_to_all", "monitored_barrier")


def _what(name: str, args: tuple) -> str:
    """``all_reduce int64[2]``: a tensor collective with its first tensor's dtype and size; the name alone else."""
    tensor = next((a for a in args if isinstance(a, torch.Tensor)), None)
    if tensor is None:
        return name
    return f"{name} {str(tensor.dtype).removeprefix('torch.')}[{tensor.numel()}]"


def record_fit_collectives(args: list[str]) -> list[str]:
    """In a forked rank: ``train(parse_args(args))``, returning the collectives called inside ``fit`` (outermost
    calls only: ``all_gather_object``'s own ``all_gather`` is part of it). The preemption flag's comparisons
    follow the step count alone here (every step fits in its interval: 1, 2, 4, 8, ... steps apart)."""
    import torch.distributed as dist

    import accel_ddp.lifecycle.preemption as preemption
    import accel_ddp.loop as loop

    preemption.CHECK_EVERY_SECONDS = 1e9  # the interval doubles at each comparison, whatever the machine's speed
    calls: list[str] = []
    depth, recording = [0], [False]

    def wrap(name, original):
        def recorded(*a, **k):
            if recording[0] and depth[0] == 0:
                calls.append(_what(name, a))
            depth[0] += 1
            try:
                return original(*a, **k)
            finally:
                depth[0] -= 1
        return recorded

    for name in COLLECTIVES:
        if hasattr(dist, name):
            setattr(dist, name, wrap(name, getattr(dist, name)))
    fit = loop.fit

    def recorded_fit(run):
        recording[0] = True
        try:
            return fit(run)
        finally:
            recording[0] = False

    loop.fit = recorded_fit
    loop.train(parse_args(args))
    return calls
