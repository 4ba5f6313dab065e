"""A trained run's options read back: what its ``config.yaml`` held, as the ``TrainConfig`` it trained with, and that
config made ready to evaluate (``accel_ddp.inference``).

    options = {key: value for key, value in yaml.safe_load(text).items() if key not in REPLAYED_KEYS}
    cfg = saved_config(options, "outputs/run/config.yaml")            # one ConfigError line naming the file
    cfg = evaluation_config(options, "outputs/run/config.yaml", world_size=2, checkpoint=False)

The file itself (where it is, how it is read) is ``outputs/trained.py``'s; no torch here, so a bad file is refused
before anything heavy is imported.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from types import SimpleNamespace
from typing import Any

from accel_ddp.config.dependents import unused_flags
from accel_ddp.config.options import TrainConfig, option_defaults
from accel_ddp.util.validation import ConfigError

# What a run adds to config.yaml beside its options: its facts and its start-up block. Never options: ``--config``
# (cli/args.py) and the reading back here leave them out.
REPLAYED_KEYS = ("resolved", "startup")


def saved_config(options: Mapping[str, Any], source: str) -> TrainConfig:
    """``options`` (a run's config.yaml without ``REPLAYED_KEYS``) as its TrainConfig. It is read as written
    (``yaml.safe_dump`` of every option), so no option is missing and none is a recipe's spelling; an option this
    version does not know, or a value it refuses, is one ConfigError line naming ``source``."""
    known = {field.name for field in dataclasses.fields(TrainConfig)}
    unknown = sorted(str(key) for key in options if key not in known)
    if unknown:
        raise ConfigError(f"{source}: option(s) {', '.join(unknown[:5])} unknown to this accel_ddp; evaluate it with "
                          "the version that trained it")
    try:
        return TrainConfig(**_without_unused_flags(options))
    except ConfigError as err:
        raise ConfigError(f"{source}: {err}") from None


def _without_unused_flags(options: Mapping[str, Any]) -> dict[str, Any]:
    """``options`` with the flags its run never used put back to their defaults: a run trained before such a flag was
    refused (``config/dependents.py``) still evaluates, and nothing it trained with changes (nothing read them)."""
    defaults = option_defaults()
    unused = unused_flags(SimpleNamespace(**{**defaults, **options}), defaults)
    dropped = {flag[2:] for flags in unused.values() for flag in flags}
    return {key: defaults[key] if key in dropped else value for key, value in options.items()}


def evaluation_config(options: Mapping[str, Any], source: str, world_size: int, checkpoint: bool) -> TrainConfig:
    """The run's config for evaluation on ``world_size`` ranks: no compilation (the same figures without its warm-up),
    no trackers, no resume, and ``--init_from`` only where the weights to load leave the base out (``checkpoint``: a
    checkpoint's weights, which for a fine-tuned run hold the adapter only). A launch whose world size does not divide
    the run's global batch still evaluates: the batch only sizes the eval batches."""
    cfg = saved_config(options, source)
    keeps_base = checkpoint and cfg.peft is not None
    cfg = dataclasses.replace(cfg, compile=False, compile_regions=False, cuda_graphs=False, with_tracking=False,
                              resume_from_checkpoint=None, init_from=cfg.init_from if keeps_base else None)
    try:
        dataclasses.replace(cfg).batch_layout(world_size)  # on a copy: it resolves --gradient_accumulation_steps
    except ConfigError:
        share = max(1, (cfg.global_batch_size or world_size) // world_size)
        cfg = dataclasses.replace(cfg, global_batch_size=share * world_size, per_device_batch_size=share,
                                  gradient_accumulation_steps=None, eval_batch_size=cfg.eval_batch_size or 2 * share)
    return cfg
