"""The batch layout's arithmetic: ``global batch = world size x per-device batch x accumulation steps``.

``TrainConfig.batch_layout`` derives a run's layout with these once; the samplers and the micro-batch probe check
theirs with the same functions. No torch, no TrainConfig: plain integers in, integers (or one ConfigError) out.
"""

from __future__ import annotations

from accel_ddp.util.validation import ConfigError


def accumulation_steps(per_device_batch_size: int, global_batch_size: int, world_size: int) -> int:
    """Micro-steps per optimizer step of a batch layout: ``global = world_size * per_device * accumulation``.

    The one place the layout is derived and checked (``TrainConfig.batch_layout``, the samplers built from it).
    """
    if per_device_batch_size <= 0 or global_batch_size % (world_size * per_device_batch_size) != 0:
        raise ConfigError(
            f"--global_batch_size {global_batch_size} is not divisible by world size {world_size} "
            f"x --per_device_batch_size {per_device_batch_size}; pick a global batch that is a multiple of "
            f"{world_size * max(per_device_batch_size, 1)}"
        )
    return global_batch_size // (world_size * per_device_batch_size)


def largest_micro_batch(global_batch_size: int, world_size: int, at_most: int | None = None) -> int:
    """The largest micro-batch that divides this rank's share of the global batch (``global / world``), at most
    ``at_most``: where ``--per_device_batch_size auto`` starts, and (``at_most`` = half the last) where it goes next.

        >>> largest_micro_batch(96, 2), largest_micro_batch(96, 2, at_most=20), largest_micro_batch(96, 2, at_most=11)
        (48, 16, 8)
    """
    if global_batch_size % world_size:
        raise ConfigError(f"--global_batch_size {global_batch_size} is not divisible by world size {world_size}; "
                          f"pick a global batch that is a multiple of {world_size}")
    share = global_batch_size // world_size
    at_most = share if at_most is None else max(1, min(at_most, share))
    return next(size for size in range(at_most, 0, -1) if share % size == 0)


def auto_batch_cap(per_device_batch_size: int | str | None) -> int | None:
    """The CAP of ``--per_device_batch_size auto:CAP`` (the probe starts at most there); None for plain ``auto`` or a
    fixed size.

        >>> auto_batch_cap("auto:16"), auto_batch_cap("auto"), auto_batch_cap(8)
        (16, None, None)
    """
    if not isinstance(per_device_batch_size, str) or ":" not in per_device_batch_size:
        return None
    return int(per_device_batch_size.partition(":")[2])
