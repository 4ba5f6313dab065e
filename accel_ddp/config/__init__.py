"""Training options: TrainConfig, every option with its default, one-line help and range, and their checks.

    >>> from accel_ddp.config import TrainConfig
    >>> cfg = TrainConfig(dataset="digits", epochs=2)

- ``options``: TrainConfig, every field and its type and range checks, the batch layout derived from it
  (``batch_layout``);
- ``layout``: the batch layout's arithmetic (``accumulation_steps``, ``largest_micro_batch``,
  ``accumulation_resolved``), shared by ``batch_layout``, the samplers and the micro-batch probe;
- ``sections``: TrainConfig's groups (``sections()``: docs/flags.md's tables and ``--help``'s groups);
- ``checks``: the checks ``__post_init__`` calls (known values, sizes that fit, the options that only make sense
  together, the waits below --ddp_timeout), each refused with one ``ConfigError`` line;
- ``dependents``: the one table of flags that only mean something with another option (flag -> when a run uses it
  -> the fix); one given where nothing would use it is refused in one line;
- ``plan``: a run's ``Plan`` (the batch layout, total steps) and ``Cadence`` (when to log, evaluate, save),
  derived once by ``assemble.setup`` (``plan_run``);
- ``debug``: what --debug switches on (``debug_mode(cfg)``: the one place; each module reads its behaviour);
- ``views``: typed sections of TrainConfig (``config_section``, ``section_of``): what a component reads, and only that;
- ``saved``: a trained run's config.yaml read back (``saved_config``) and made ready to evaluate
  (``evaluation_config``); ``REPLAYED_KEYS``, what a run adds to it beside its options;
- ``choices``: the vocabulary: allowed values, limits, the Hugging Face aliases, renamed flags (``new_spelling``),
  store schemes.

The command line and the ``--config`` YAML recipe are read by ``accel_ddp/cli/args.py``. No torch here, so that
``--help`` and bad-input errors are instant.

May import: ``accel_ddp.util`` only.
"""

from __future__ import annotations

from accel_ddp.config.checks import warn_deprecated  # noqa: F401
from accel_ddp.config.choices import (  # noqa: F401 - the layer's names, as before the split
    ACCELERATE_TRACKERS,
    BOUNDED_TRACKER_CALLS,
    COMM_HOOKS,
    DDP_TIMEOUT_MAX,
    DEBUG_MAX_STEPS,
    DEFAULT_GLOBAL_BATCH,
    DEFAULT_LOG_EVERY,
    EXPANDED_VALUES,
    FOREIGN_FLAGS,
    HF_ALIASES,
    HF_FIELDS,
    HF_SCHEDULES,
    LOADERS,
    LR_SCHEDULES,
    MIXED_PRECISIONS,
    MODEL_STATE_MAX_BYTES,
    ON_ANOMALY,
    PATH_FLAGS,
    RENAMED_FLAGS,
    RENAMED_VALUES,
    REPORT_TO,
    RESNET18_PARAMS_AT_WIDTH_64,
    SEED_MAX,
    STORE_PACKAGES,
    SWITCH_ALIASES,
    SYNTHETIC_MAX_BYTES,
    TASKS,
    TEXT_TASKS,
    URL_SCHEME,
    new_spelling,
)
from accel_ddp.config.layout import accumulation_steps, largest_micro_batch  # noqa: F401
from accel_ddp.config.options import TrainConfig, field_types  # noqa: F401
from accel_ddp.config.sections import Section, sections  # noqa: F401
