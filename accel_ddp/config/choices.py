"""The options' vocabulary: allowed values, limits, Hugging Face aliases, renamed flags, store schemes."""

from __future__ import annotations

import re
from typing import Any

SEED_MAX = 2**32 - 1  # NumPy's np.random.seed accepts 0 .. 2**32 - 1, and set_seed seeds NumPy too

# A collective that waits longer than a week for a missing rank is a hang, not a slow peer; the bound also
# keeps the value within what timedelta and the backends' millisecond counters hold.
DDP_TIMEOUT_MAX = 7 * 24 * 3600
# --hang_timeout's default: far above a healthy optimizer step (a large model's, with many micro-steps, takes seconds to
# a minute), a third of --ddp_timeout's 30 minutes, so that a hang is named even in a save or an evaluation (twice it).
HANG_TIMEOUT_DEFAULT = 600.0

# Sanity bounds for sizes that are typos when huge: model state (weights, gradients and AdamW's two
# moments: 16 bytes per fp32 parameter) and the synthetic dataset (float32, on every rank) must fit in
# what an 80 GB accelerator holds. Bigger than this is an out-of-memory crash minutes later.
MODEL_STATE_MAX_BYTES = 64 * 2**30

SYNTHETIC_MAX_BYTES = 16 * 2**30

RESNET18_PARAMS_AT_WIDTH_64 = 11.2e6  # parameters scale with width squared

DEBUG_MAX_STEPS = 10  # --debug: a handful of optimizer steps is enough to surface shape or sync bugs

LR_SCHEDULES = ("constant", "linear", "cosine")

# --report_to names: Accelerate's trackers (accelerate.tracking.LOGGER_TYPE_TO_CLASS, listed here because
# this module imports no torch) and accel_ddp's csv. "all" = every one whose package is installed, plus csv.
ACCELERATE_TRACKERS = ("tensorboard", "wandb", "mlflow", "comet_ml", "aim", "clearml", "dvclive", "swanlab", "trackio")

REPORT_TO = (*ACCELERATE_TRACKERS, "csv", "all")

COMM_HOOKS = ("none", "fp16", "bf16")

LOADERS = ("auto", "device", "dataloader")
# --attn_implementation: the names Transformers' from_pretrained / from_config take (transformers 5.25,
# PreTrainedModel.get_correct_attn_implementation); whether a model supports one is checked when it is built.
ATTN_IMPLEMENTATIONS = ("eager", "sdpa", "flash_attention_2", "flash_attention_3", "flex_attention")

ON_ANOMALY = ("stop", "skip", "rollback")  # what a nan/inf or spiking step does (accel_ddp/bad_steps/)

# --task: what a batch and a loss mean (accel_ddp/tasks/protocol.py); the text tasks read text with a tokenizer.
TASKS = ("classification", "sequence_classification", "causal_lm")

TEXT_TASKS = ("sequence_classification", "causal_lm")
PEFT_METHODS = ("lora",)  # --peft (accel_ddp/transforms/finetune.py)

# Old spellings that keep working for one release, each with a warning naming the new one.
RENAMED_FLAGS = {"fast_loader_max_mb": "device_loader_max_mb"}

RENAMED_VALUES = {("loader", "fast"): "device"}

DEFAULT_GLOBAL_BATCH = 64  # --global_batch_size unless --gradient_accumulation_steps derives it
DEFAULT_LOG_EVERY = 10  # optimizer steps between metrics lines unless --log_every (--logging_steps) says

MIXED_PRECISIONS = ("no", "fp16", "bf16", "fp8")  # Accelerate's PrecisionType (accelerate/utils/dataclasses.py)


# The Hugging Face names (run_clm_no_trainer.py, the Trainer, the accelerate examples), CLI and YAML: the one
# table cli/args.py translates and tools/flag_table.py prints in docs/flags.md. alias -> (ours, what differs).
# An alias takes OUR default, never the Trainer's. A name set twice in one source with two values (`--lr 3e-3
# --learning_rate 1e-4`) is an error; across sources the usual order holds (the command line over the recipe).
HF_ALIASES: dict[str, tuple[str, str]] = {
    "learning_rate": ("lr", ""),
    "num_train_epochs": ("epochs", "a whole number (2.0 is 2); for part of an epoch use --max_steps"),
    "max_train_steps": ("max_steps", ""),
    "per_device_train_batch_size": (
        "per_device_batch_size", "without --global_batch_size, as in the Trainer: global = processes x this x "
        "--gradient_accumulation_steps (default 1); with it, accumulation = global / (processes x this)"),
    "per_device_eval_batch_size": ("eval_batch_size", ""),
    "lr_scheduler_type": ("lr_schedule", "linear, cosine, constant_with_warmup (= constant); constant only "
                          "without warmup (the Hugging Face constant has none); the others are refused"),
    "num_warmup_steps": ("warmup_steps", "optimizer steps, as in run_clm_no_trainer.py"),
    "logging_steps": ("log_every", "optimizer steps; the last step is logged too"),
    "eval_steps": ("eval_every", "alone switches to evaluating every N steps (the Trainer also needs "
                   "--eval_strategy steps)"),
    "save_steps": ("checkpointing_steps", "folders checkpoints/step_N kept by --keep_last; none unless given"),
    "model_name_or_path": ("model", "also names the tokenizer unless --tokenizer is given"),
    "tokenizer_name": ("tokenizer", ""),
    "dataset_name": ("dataset hf --hf_name", "without an eval split a tenth of train is held out (not 5 percent)"),
    "dataset_config_name": ("hf_config", ""),
    "block_size": ("max_length --packing true", "causal_lm: texts concatenated and cut into blocks of this size"),
    "bf16": ("mixed_precision bf16", "a switch, as in the Trainer (--bf16 false: unset)"),
    "fp16": ("mixed_precision fp16", "a switch, as in the Trainer (--fp16 false: unset)"),
    "save_total_limit": ("keep_last", "newest complete checkpoints kept (the best one besides them)"),
}

# The HF_ALIASES that are switches (--bf16, --bf16 true): each sets ``mixed_precision`` to its own name.
SWITCH_ALIASES = ("bf16", "fp16")


# Names a Trainer or Accelerate-example user types that have no alias here: refused with their replacement, before
# any "did you mean" (a similar-looking flag of ours means something else). ``--report_to none`` is accepted
# (config/checks.py). The command line and the recipe's keys alike (cli/args.py).
FOREIGN_FLAGS: dict[str, str] = {
    "overwrite_output_dir": "a run never overwrites a finished run's folder; give a new --output_dir or delete the "
                            "old one first (--resume_from_checkpoint auto continues the run in it)",
    "do_train": "training always runs; drop it",
    "do_eval": "evaluation runs whenever there is an eval set (--eval_every sets how often); drop it",
    "evaluation_strategy": "evaluation runs each epoch, or every N optimizer steps with --eval_every N",
    "eval_strategy": "evaluation runs each epoch, or every N optimizer steps with --eval_every N",
    "save_strategy": "checkpoints are saved every N optimizer steps with --checkpointing_steps N (none by default)",
    "logging_dir": "trackers write under --output_dir; choose them with --with_tracking --report_to",
    "local_rank": "the launcher sets LOCAL_RANK in the environment; drop it (accelerate launch passes no flag)",
}


# Hugging Face names that are options of their own (their meaning is derived): listed in the same docs table.
HF_FIELDS = ("gradient_accumulation_steps", "warmup_ratio", "mixed_precision")


# --lr_scheduler_type values -> --lr_schedule; "constant" also needs no warmup (checked in cli/args.py).
HF_SCHEDULES = {"linear": "linear", "cosine": "cosine", "constant_with_warmup": "constant", "constant": "constant"}


# Old values that now set several options (CLI and YAML): `--with_tracking csv` = `--with_tracking --report_to csv`.
EXPANDED_VALUES = {
    ("with_tracking", "none"): {"with_tracking": False},
    ("with_tracking", "tensorboard"): {"with_tracking": True, "report_to": "tensorboard"},
    ("with_tracking", "csv"): {"with_tracking": True, "report_to": "csv"},
    ("with_tracking", "all"): {"with_tracking": True, "report_to": "tensorboard,csv"},  # the old all: these two
}


URL_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


PATH_FLAGS = ("output_dir", "resume_from_checkpoint", "init_from")


# --checkpoint_dir schemes -> (the fsspec implementation's package, the accel_ddp extra that installs it).
STORE_PACKAGES = {"s3": ("s3fs", "s3"), "gs": ("gcsfs", "gcs"), "gcs": ("gcsfs", "gcs"), "az": ("adlfs", "azure"),
                  "abfs": ("adlfs", "azure"), "abfss": ("adlfs", "azure"), "file": ("fsspec", None)}


# The calls into one tracker that the main process bounds by --tracker_start_timeout, each in turn, while the
# other ranks wait in one broadcast (tracking/recorder.py, ``start_trackers``): its start, its config (Accelerate's
# ``init_trackers`` starts every tracker, then gives each the config) and, after a failed start, its close.
BOUNDED_TRACKER_CALLS = 3


def new_spelling(options: dict[str, Any]) -> str:
    """The flags for an ``EXPANDED_VALUES`` entry: ``{"with_tracking": True, "report_to": "csv"}`` ->
    ``--with_tracking --report_to csv``."""
    flags = [f"--{key}" if value is True else f"--{key} {value}"
             for key, value in options.items() if value is not False]
    return " ".join(flags) or " ".join(f"--{key} false" for key in options)
