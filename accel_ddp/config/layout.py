"""The batch layout's arithmetic: ``global batch = world size x per-device batch x accumulation steps``.

``TrainConfig.batch_layout`` derives a run's layout with these once; the samplers and the micro-batch probe check
theirs with the same functions. No torch, no TrainConfig: plain integers in, integers (or one ConfigError) out.
"""

from __future__ import annotations

from accel_ddp.config.choices import DEFAULT_GLOBAL_BATCH
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


def accumulation_resolved(accumulation: int, per_device_batch_size: int | None, global_batch_size: int | None,
                          world_size: int) -> tuple[int, int]:
    """--gradient_accumulation_steps N (the Hugging Face meaning): global = world x per-device x N, as
    ``(global batch, per-device batch)``.

    ``TrainConfig.batch_layout`` resolves N into --global_batch_size and --per_device_batch_size (N unset), once, so
    that config.yaml replays the same optimizer steps on another world size (the global batch is the unit).
    """
    n, per_device = accumulation, per_device_batch_size
    if per_device is not None:
        derived = world_size * per_device * n
        if global_batch_size is not None and global_batch_size != derived:
            raise ConfigError(
                f"--gradient_accumulation_steps {n} x --per_device_batch_size {per_device} x {world_size} "
                f"process(es) = {derived}, but --global_batch_size {global_batch_size}; drop one of them")
    else:
        derived = global_batch_size or DEFAULT_GLOBAL_BATCH
        if derived % (world_size * n):
            raise ConfigError(
                f"--gradient_accumulation_steps {n}: --global_batch_size {derived} is not divisible by "
                f"{world_size} process(es) x {n}; give --per_device_batch_size, or a global batch that is a "
                f"multiple of {world_size * n}")
        per_device = derived // (world_size * n)
    return derived, per_device
