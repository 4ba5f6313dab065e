"""The flags that only mean something with another option: one table, :data:`DEPENDENTS` (flag -> when a run uses it
-> the fix), and its check. A flag given (other than its default) in a run that would not use it is refused with one
line, exit 2, instead of doing nothing:

    accel_ddp: error: --store_timeout without an object store --checkpoint_dir: nothing would use it; add
    --checkpoint_dir s3://bucket/run (or gs://, az://), or drop it

Conflicts (two flags that cannot go together) and values out of range are ``checks.py``'s. Not rows, on purpose:

- what a run uses whether or not it saves every N steps: ``--keep_last``, ``--async_checkpointing`` and
  ``--checkpoint_dir`` also serve the save a preemption makes (lifecycle/preemption.py);
- ``--epochs`` with ``--max_steps`` (the Hugging Face scripts' recipes give both; the help says which wins);
- what the launch or the model decides, known once the run is set up: the ``--ddp_*`` knobs (one process has no
  DDP), ``--tf32`` and ``--cuda_graphs`` (CUDA), ``--gradient_checkpointing`` and ``--attn_implementation`` (checked
  on the model built), ``--fused_kernels``, ``--channels_last`` and ``--compile_regions`` (what the model built
  holds), ``--num_workers`` under ``--loader device`` (an eval set not in memory still has a DataLoader),
  ``--text_cache`` under the Python API's own dataset;
- ``--data_dir`` beside ``digits`` or ``synthetic`` (which read no files): it is every dataset's default
  location, and ``accel_ddp evaluate --data_dir`` moves any run's, whatever its dataset;
- the Python API's own ``model=`` or ``train_dataset=``: ``--hidden_size``/``--width``, the ``--synthetic_*`` sizes
  and the other data flags then size or load nothing either, but the config cannot know it.

The model sizes: ``--hidden_size`` is ``mlp``'s, ``--width`` is ``resnet18``'s (models.py build_model). A
``pkg.module:function`` model is called with ``num_classes`` and ``input_shape`` only (its own sizes are its own
defaults or flags of its own), and a Transformers model's sizes are its config.json's: both are rows' refusals.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from accel_ddp.config.choices import TEXT_TASKS
from accel_ddp.util.validation import ConfigError


@dataclass(frozen=True)
class Needs:
    """One condition under which a flag is used: ``used(cfg)``; else the run is described by ``where`` (formatted with
    ``cfg``: "on --task {cfg.task}") and ``fix`` says what would use it."""

    used: Callable[[Any], bool]
    where: str
    fix: str


@dataclass(frozen=True)
class Dependent:
    """A flag and every condition under which a run uses it (all must hold; the first that does not is named)."""

    flag: str
    needs: tuple[Needs, ...]


PEFT = Needs(lambda cfg: cfg.peft is not None, "without --peft", "add --peft lora")
TRACKING = Needs(lambda cfg: cfg.with_tracking, "without --with_tracking", "add --with_tracking")
HF = Needs(lambda cfg: cfg.dataset == "hf", "with --dataset {cfg.dataset}", "add --dataset hf")
TEXT = Needs(lambda cfg: cfg.task in TEXT_TASKS, "on --task {cfg.task}",
             "add --task sequence_classification or --task causal_lm")
CAUSAL_LM = Needs(lambda cfg: cfg.task == "causal_lm", "on --task {cfg.task}", "add --task causal_lm")
PACKING = Needs(lambda cfg: cfg.packing, "without --packing", "add --packing")
SYNTHETIC = Needs(lambda cfg: cfg.dataset == "synthetic", "with --dataset {cfg.dataset}", "add --dataset synthetic")
# A Transformers model (--model_config) is sized by its config.json; only --model's built-in default stands beside it.
NOT_A_CONFIG = Needs(lambda cfg: cfg.model_config is None, "with --model_config (its config.json sizes the model)",
                     "set the size in that config.json")
BUILT_IN_ONLY = "a pkg.module:function model is called with num_classes and input_shape only"


def _model(name: str) -> Needs:
    """Used where --model builds ``name`` (also as models.py's own builder, which build_model sizes the same)."""
    builder = f"accel_ddp.models:build_{name}"
    return Needs(lambda cfg: cfg.model in (name, builder), "with --model {cfg.model}",
                 f"add --model {name} ({BUILT_IN_ONLY})")


DEPENDENTS: tuple[Dependent, ...] = (
    # data
    Dependent("shuffle_buffer", (Needs(lambda cfg: cfg.streaming, "without --streaming",
                                       "add --streaming (with --dataset hf and --max_steps)"),)),
    *(Dependent(flag, (HF,)) for flag in ("hf_name", "hf_config", "hf_train_split", "hf_eval_split", "image_column",
                                          "label_column")),
    Dependent("image_size", (Needs(lambda cfg: cfg.dataset in ("imagefolder", "hf"), "with --dataset {cfg.dataset}",
                                   "add --dataset imagefolder or --dataset hf"),)),
    *(Dependent(flag, (TEXT,)) for flag in ("text_column", "tokenizer", "max_length")),
    *(Dependent(flag, (SYNTHETIC,)) for flag in ("synthetic_samples", "synthetic_shape", "synthetic_classes")),
    # data/builtin.py: digits and synthetic read no files, imagefolder reads the user's; a pkg.module:function gets
    # the flag; hf: the main process loads first (the Hub's one download per machine, data/resolve.py main_first)
    Dependent("download", (Needs(lambda cfg: cfg.dataset in ("mnist", "fashion_mnist", "cifar10", "hf")
                                 or ":" in cfg.dataset, "with --dataset {cfg.dataset}, which downloads nothing",
                                 "give --dataset mnist, fashion_mnist, cifar10 or hf"),)),
    # data/loaders.py: the device loader's limit under auto and device; with dataloader, only hf's (kept in memory
    # up to it, memory-mapped above: data/resolve.py)
    Dependent("device_loader_max_mb", (Needs(lambda cfg: cfg.loader != "dataloader" or cfg.dataset == "hf",
                                             "with --loader dataloader", "use --loader auto (or --dataset hf, whose "
                                             "decoded size it bounds)"),)),
    Dependent("packing", (CAUSAL_LM,)),
    # data/text_cache.py: the packed blocks of a local --data_dir's texts (a Hub dataset's files are the datasets
    # cache's, whose revisions its key cannot see)
    Dependent("text_cache", (Needs(lambda cfg: cfg.task == "causal_lm", "on --task {cfg.task}",
                                   "add --task causal_lm --packing"), PACKING, HF, Needs(
        lambda cfg: cfg.hf_name is None, "with --hf_name (a Hub dataset is not cached)",
        "save it with save_to_disk and give that folder as --data_dir instead of --hf_name"))),
    # model
    Dependent("hidden_size", (NOT_A_CONFIG, _model("mlp"))),
    Dependent("width", (NOT_A_CONFIG, _model("resnet18"))),
    *(Dependent(flag, (PEFT,)) for flag in ("lora_r", "lora_alpha", "lora_dropout", "lora_target_modules",
                                            "merge_adapter")),
    # bad steps (bad_steps/): under stop the first anomaly ends the run; the window is the spike check's
    Dependent("spike_window", (Needs(lambda cfg: cfg.spike_factor > 0, "without --spike_factor",
                                     "add --spike_factor 3"),)),
    Dependent("max_anomalies", (Needs(lambda cfg: cfg.on_anomaly != "stop",
                                      "with --on_anomaly stop (the first anomaly ends the run)",
                                      "add --on_anomaly skip or --on_anomaly rollback"),)),
    # checkpoints: the store's calls are bounded by --store_timeout (checkpoint/storage.py)
    Dependent("store_timeout", (Needs(lambda cfg: cfg.checkpoint_dir is not None,
                                      "without an object store --checkpoint_dir",
                                      "add --checkpoint_dir s3://bucket/run (or gs://, az://)"),)),
    Dependent("greater_is_better", (Needs(
        lambda cfg: bool(cfg.metric_for_best_model or cfg.load_best_model_at_end or cfg.early_stopping_patience),
        "without --metric_for_best_model", "add --metric_for_best_model NAME"),)),
    Dependent("early_stopping_threshold", (Needs(lambda cfg: cfg.early_stopping_patience is not None,
                                                 "without --early_stopping_patience",
                                                 "add --early_stopping_patience K"),)),
    # trackers (tracking/trackers.py): started only with --with_tracking (which --report_to NAME turns on itself,
    # as the Trainer's report_to does: checks.py, so it has no row)
    *(Dependent(flag, (TRACKING,)) for flag in ("tracker_project_name", "run_name", "tracker_start_timeout")),
)


def check_dependents(cfg: Any) -> None:
    """A ConfigError naming the flags of the first unmet condition (in the table's order) that were given in a run
    that would not use them, with the fix; nothing when every given flag is used. ``cfg``: a TrainConfig."""
    defaults = {f.name: f.default for f in dataclasses.fields(cfg)}
    unused: dict[Needs, list[str]] = {}
    for row in DEPENDENTS:
        if getattr(cfg, row.flag) == defaults[row.flag]:
            continue
        unmet = next((needs for needs in row.needs if not needs.used(cfg)), None)
        if unmet is not None:
            unused.setdefault(unmet, []).append(f"--{row.flag}")
    if not unused:
        return
    needs, flags = next(iter(unused.items()))
    them = "them" if len(flags) > 1 else "it"
    raise ConfigError(f"{', '.join(flags)} {needs.where.format(cfg=cfg)}: nothing would use {them}; {needs.fix}, or "
                      f"drop {them}")
