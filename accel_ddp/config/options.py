"""TrainConfig: every option with its default, one-line help and range, checked whatever its source; the batch
layout derived from it (``batch_layout``, arithmetic in ``config/layout.py``)."""

from __future__ import annotations

import dataclasses
import math
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from accel_ddp.config.checks import (
    check_best_model,
    check_cuda_graphs,
    check_data,
    check_hf_fields,
    check_optimizer_options,
    check_peft,
    check_per_device,
    check_rollback,
    check_sizes,
    check_spike,
    check_task,
    check_timeouts,
    check_tracker_wait,
    check_tracking,
    check_urls,
    check_values,
    checkpointing_steps_text,
    optimizer_kwargs_text,
    warn_deprecated,
)
from accel_ddp.config.choices import (
    DDP_TIMEOUT_MAX,
    DEFAULT_GLOBAL_BATCH,
    HANG_TIMEOUT_DEFAULT,
    RENAMED_VALUES,
    REPORT_TO,
    SEED_MAX,
)
from accel_ddp.config.dependents import check_dependents
from accel_ddp.config.layout import accumulation_resolved, accumulation_steps, auto_batch_cap, largest_micro_batch
from accel_ddp.util.validation import ConfigError, check_range, checked_type, show


def _opt(default: Any, help: str, low: float | None = None, high: float | None = None, *,
         section: str | None = None) -> Any:
    """A field with its one-line help and, for numbers, its inclusive range (checked in ``__post_init__``).

    ``section`` ("title (note)") starts a group of options, up to the next field that names one: docs/flags.md's
    tables (tools/flag_table.py) and ``--help``'s groups (cli/args.py), both through ``sections()``."""
    metadata = {"help": help, "low": low, "high": high}
    if section is not None:
        metadata["section"] = section
    return field(default=default, metadata=metadata)


@dataclass
class TrainConfig:
    """Every option of a training run. Field names are the CLI flags (``--global_batch_size``); a field with
    ``section=`` starts a group (``sections()``)."""

    dataset: str = _opt(
        "digits",
        "dataset: digits, mnist, fashion_mnist, cifar10, imagefolder, hf, synthetic or 'pkg.module:function'",
        section="data",
    )
    data_dir: str = _opt("data", "folder holding (or receiving, with --download) the dataset files")
    download: bool = _opt(
        False, "download the dataset into --data_dir if missing (one process per machine, the main process first)")
    loader: str = _opt(
        "auto", "auto (the device loader where the training set is tensors in memory and fits, else a DataLoader), "
        "device or dataloader"
    )
    device_loader_max_mb: int = _opt(
        4096, "--loader auto: largest in-memory training set (MiB as stored) kept on the device; hf: larger "
        "sets stay memory-mapped and are decoded per batch", low=0
    )
    streaming: bool = _opt(
        False, "hf: stream the training split (datasets.IterableDataset, split over ranks); needs --max_steps"
    )
    shuffle_buffer: int = _opt(10_000, "--streaming: examples in the shuffle buffer (0: read in file order)", low=0)
    num_workers: int | None = _opt(
        None, "DataLoader workers per rank; default 0 for in-memory data, else up to 8 (CPUs / local ranks)",
        low=0, high=256,
    )
    image_size: int | None = _opt(None, "imagefolder, hf: resize images to this square size; default: keep",
                                  low=1, high=4096)
    hf_name: str | None = _opt(None, "hf: Hub dataset name (online or cached); unset: load --data_dir")
    hf_config: str | None = _opt(None, "hf: dataset configuration name on the Hub, if it has several")
    hf_train_split: str = _opt("train", "hf: split to train on")
    hf_eval_split: str | None = _opt(None, "hf: eval split; default test or validation, else a tenth of train held out")
    image_column: str | None = _opt(None, "hf: input column; default the first Image column, else all numbers")
    label_column: str | None = _opt(None, "hf: label column; default the ClassLabel column, else 'label'")
    synthetic_samples: int = _opt(2048, "synthetic dataset: number of training samples (eval gets a quarter)", low=1)
    synthetic_shape: tuple[int, ...] = _opt((1, 28, 28), "synthetic dataset: shape of one input, e.g. 1 28 28")
    synthetic_classes: int = _opt(10, "synthetic dataset: number of classes (2 or more)", low=2, high=1_000_000)
    text_column: str | None = _opt(None, "hf with a text --task: the column of raw text; default 'text'")
    tokenizer: str | None = _opt(
        None, "text tasks: tokenizer folder (save_pretrained) or Hub name; default the --model folder's own"
    )
    max_length: int = _opt(
        512, "text tasks: tokens per sequence (longer texts are cut; the block size with --packing)", low=1
    )
    packing: bool = _opt(False, "causal_lm: concatenate the texts and cut them into --max_length blocks (no padding)")
    text_cache: str | None = _opt(
        None, "causal_lm --packing from --data_dir: folder caching the packed blocks between runs, keyed by the data "
        "files, tokenizer and block size; default $ACCEL_DDP_CACHE/text_blocks or ~/.cache/accel_ddp/text_blocks; "
        "'off': tokenize every run")
    collate_fn: str | None = _opt(
        None, "'pkg.module:function' turning a list of samples into a batch; default pads text, stacks tensors"
    )

    model: str = _opt(
        "mlp", "model name (mlp, mnist_cnn, resnet18), a Transformers save_pretrained folder, or 'pkg.module:function'",
        section="model",
    )
    hidden_size: int = _opt(256, "mlp: width of its two hidden layers", low=1)
    width: int = _opt(64, "resnet18: channels of its first stage (64 as torchvision; 16 trains fast on CPU)", low=1)
    model_config: str | None = _opt(
        None, "a Transformers config.json: train that model from scratch (AutoModelFor... chosen by --task)"
    )

    peft: str | None = _opt(
        None, "lora: train LoRA adapters (the peft library) on a frozen Transformers model; unset: train every "
        "parameter", section="fine-tuning (LoRA adapters on a pretrained Transformers model: docs/tasks.md)")
    lora_r: int = _opt(8, "--peft lora: rank of each adapter (its A is r x in, its B out x r)", low=1, high=65536)
    lora_alpha: float = _opt(16.0, "--peft lora: scale; an adapter's update is (lora_alpha / lora_r) x B A",
                             low=1e-6)
    lora_dropout: float = _opt(0.0, "--peft lora: dropout on each adapter's input (0 <= p < 1)", low=0)
    lora_target_modules: str = _opt(
        "all-linear", "--peft lora: comma-separated module names that get adapters (e.g. c_attn,c_proj), or "
        "all-linear (every linear layer but the output layer)")
    merge_adapter: bool = _opt(
        False, "--peft lora: also export the adapter merged into the base (OUTPUT_DIR/hf_model, loadable by "
        "Transformers without peft)")
    gradient_checkpointing: bool = _opt(
        False, "Transformers models: recompute each block's activations in the backward (non-reentrant; less memory, "
        "~30% more compute)")

    task: str = _opt(
        "classification", "classification ((input, label) or dict batches), sequence_classification or causal_lm",
        section="task (how a batch reaches the model, its loss and the eval metrics: docs/tasks.md)",
    )
    loss: str | None = _opt(
        None, "'pkg.module:function' loss_fn(outputs, batch) -> mean, or (sum, num_items) for token-exact averaging"
    )
    callbacks: str | None = _opt(
        None, "comma-separated 'pkg.module:Name' callbacks, each made with no arguments: hooks on every rank after "
        "each step, evaluation and save, which may ask every rank to stop, save or evaluate (docs/tasks.md#callbacks)")

    epochs: int = _opt(15, "passes over the training set; ignored when --max_steps is set", low=0,
                       section="optimisation (units: optimizer steps, samples)")
    max_steps: int | None = _opt(None, "stop after this many optimizer steps (overrides --epochs)", low=1)
    global_batch_size: int | None = _opt(
        None, f"samples per optimizer step summed over all ranks; fixed whatever the world size; default "
        f"{DEFAULT_GLOBAL_BATCH}, or processes x --per_device_batch_size x --gradient_accumulation_steps (1) when "
        "a per-device batch is given (the Trainer's meaning)", low=1)
    per_device_batch_size: int | str | None = _opt(
        None, "samples per forward pass on one rank; default global/world (no accumulation); without "
        "--global_batch_size it sets the global batch (x processes); auto (or auto:CAP): "
        "the largest that fits in memory, found by a probe at start (docs/long-runs.md)", low=1
    )
    gradient_accumulation_steps: int | None = _opt(
        None, "micro-batches per optimizer step: the global batch is then processes x per-device x this "
        "(resolved once the world size is known; config.yaml holds the result)", low=1, high=65536)
    lr: float = _opt(3e-3, "peak learning rate, reached after --warmup_steps")
    optimizer: str = _opt(
        "adamw", "any torch.optim optimizer by name, any case (adamw, sgd: momentum 0.9 nesterov, adam, radam, nadam, "
        "rmsprop, adagrad, adafactor, muon: hidden matrices, the rest AdamW, ...) or 'pkg.module:function' (called "
        "with the parameter groups, returns an optimizer; docs/optimizers.md)")
    optimizer_kwargs: str | None = _opt(
        None, "JSON object of the optimizer's keyword arguments, checked against its signature, e.g. "
        "'{\"betas\": [0.9, 0.95]}' (lr and weight_decay: --lr and --weight_decay, but for a pkg.module:function, "
        "which gets them all)")
    weight_decay: float = _opt(0.0, "decoupled weight decay (adamw) or L2 penalty (sgd)", low=0)
    warmup_steps: int = _opt(0, "optimizer steps of linear warmup from 0 to --lr", low=0)
    warmup_ratio: float | None = _opt(
        None, "warmup as a fraction of the total steps, rounded up (0 <= r < 1; with --debug of the cut total); "
        "instead of --warmup_steps", low=0)
    lr_schedule: str = _opt("cosine", "decay after warmup: constant, linear or cosine (to 0 at the last step)")
    max_grad_norm: float = _opt(1.0, "clip the global gradient L2 norm to this; 0 disables clipping", low=0)
    seed: int = _opt(0, "seed for model init, data order and every rank's RNG", low=0, high=SEED_MAX)
    # Bad steps (docs/long-runs.md): what a nan/inf or spiking step does.
    on_anomaly: str = _opt("stop", "a nan/inf loss or gradient norm (or a spike): stop (exit 3), skip its update "
                           "on every rank, or rollback to the last checkpoint and leave its step out")
    spike_factor: float = _opt(0.0, "also an anomaly: a logged loss above this x the median of the last "
                               "--spike_window logged losses (0: off; with stop or rollback)", low=0)
    spike_window: int = _opt(20, "logged losses (log lines) in the --spike_factor median", low=1)
    max_anomalies: int = _opt(5, "stop (exit 3) after this many anomalous steps in a row", low=1)

    eval_every: int = _opt(0, "evaluate every N optimizer steps; 0 = at the end of each epoch", low=0,
                           section="evaluation, logging, outputs")
    eval_batch_size: int | None = _opt(None, "per-device eval batch; default 2 x per-device train batch", low=1)
    log_every: int | None = _opt(
        None, "write a metrics line every N optimizer steps (default 10); given, the main process also prints one "
        "line per N steps, as the Trainer's --logging_steps: step, epoch, loss, learning rate", low=1)
    output_dir: str = _opt("outputs/run", "where config.yaml, metrics.jsonl, summary.json and weights go")
    checkpointing_steps: str | None = _opt(None, "save full state every N optimizer steps, or 'epoch'")
    checkpoint_dir: str | None = _opt(
        None, "an object store URL for the checkpoints (s3://bucket/run, gs://, az://, file://) instead of "
        "OUTPUT_DIR/checkpoints; logs, metrics and the final weights stay in --output_dir"
    )
    store_timeout: float = _opt(
        60.0, "--checkpoint_dir: seconds each call to the object store may take (plus 1 s per MiB it carries, retries "
        "included) before the run stops with exit code 2 (a store that stopped answering)", low=1, high=86400
    )
    async_checkpointing: bool = _opt(
        False, "copy the state to host memory at each save and write it in a background thread while training goes on"
    )
    keep_last: int = _opt(3, "keep this many newest complete checkpoints (and the best one besides them)", low=1)
    # The best model and early stopping: the Hugging Face Trainer's names (docs/checkpoints.md)...
    metric_for_best_model: str | None = _opt(
        None, "evaluation metric that ranks checkpoints, e.g. loss or accuracy ('eval_' is prepended); default loss "
        "when --load_best_model_at_end or --early_stopping_patience is given"
    )
    greater_is_better: bool | None = _opt(
        None, "a higher --metric_for_best_model is better; default false for names ending in loss or perplexity, "
        "else true"
    )
    load_best_model_at_end: bool = _opt(
        False, "export the best evaluated checkpoint's weights as OUTPUT_DIR/model.safetensors (summary: best_step)"
    )
    early_stopping_patience: int | None = _opt(
        None, "stop every rank after this many evaluations in a row without improving --metric_for_best_model",
        low=1
    )
    early_stopping_threshold: float = _opt(
        0.0, "--early_stopping_patience: an improvement must exceed this (absolute) to restart the count", low=0
    )
    resume_from_checkpoint: str | None = _opt(
        None, "checkpoint folder to resume from, or 'auto' for the newest complete one in --output_dir or "
        "--checkpoint_dir (or start fresh)"
    )
    init_from: str | None = _opt(
        None, "start from these weights (a .safetensors file, e.g. a run's model.safetensors) to fine-tune"
    )
    with_tracking: bool = _opt(False, "also log to the trackers of --report_to, all without it (metrics.jsonl is "
                               "always written)")
    report_to: str | None = _opt(
        None, "trackers to log to, comma-separated (given, it turns tracking on, as in the Trainer): "
        + ", ".join(REPORT_TO[:-1]) + "; all = every installed one configured to run here (docs/tracking.md), plus "
        "csv; none = no trackers; default all with --with_tracking, else none"
    )
    tracker_project_name: str = _opt(
        "accel_ddp", "--with_tracking: the project (W&B, Comet, SwanLab, Trackio) or experiment (MLflow, Aim, ClearML)"
    )
    run_name: str | None = _opt(
        None, "--with_tracking: the run's name in the trackers; default the --output_dir folder's name"
    )
    tracker_start_timeout: float = _opt(
        30.0, "--with_tracking: seconds each tracker may take to start (a server that does not answer) before the "
        "run stops with exit code 2", low=0.1, high=3600
    )
    debug: bool = _opt(False, "debug mode: anomaly detection, deterministic kernels, few steps, small data")
    mixed_precision: str | None = _opt(
        None, "no, fp16, bf16 or fp8; default the launch config's; given, it wins over the launch config (a note "
        "says so)")

    ddp_bucket_cap_mb: int = _opt(25, "DDP gradient bucket size in MiB: larger = fewer, bigger all-reduces", low=1,
                                  section="performance and distributed knobs (DDP ones follow the Hugging Face "
                                  "Trainer's names)")
    ddp_gradient_as_bucket_view: bool = _opt(
        True, "DDP: gradients are views into the all-reduce buckets (saves one gradient-sized copy)"
    )
    ddp_static_graph: bool = _opt(False, "DDP: the graph never changes between steps (enables more overlap)")
    ddp_find_unused_parameters: bool = _opt(
        False, "DDP: tolerate parameters that get no gradient in a step (costs a graph walk per step)"
    )
    ddp_comm_hook: str = _opt("none", "compress gradients for the all-reduce: none, fp16 or bf16")
    ddp_timeout: int = _opt(1800, "seconds a collective may wait for a missing rank before the job fails",
                            low=1, high=DDP_TIMEOUT_MAX)
    hang_timeout: float | None = _opt(
        None, "seconds without an optimizer step on some rank (start-up, an evaluation or a save: twice that) before "
        "every rank writes its stacks to OUTPUT_DIR/hang/ and the run ends naming the stuck rank's line (exit 124); "
        "default 600, off where --ddp_timeout is not above it; 0: off; must be below --ddp_timeout", low=0,
        high=DDP_TIMEOUT_MAX)
    compile: bool = _opt(False, "torch.compile the model (first steps are slower while it compiles)")
    cuda_graphs: bool = _opt(
        False, "CUDA only, unmeasured: capture the whole optimizer step once as a CUDA graph and replay it (AdamW, "
        "one micro-step per step, batches of one shape; docs/performance.md)"
    )
    fused_kernels: bool = _opt(
        True, "one-kernel versions of the same math in Transformers models (tanh GELU); false keeps the model's own"
    )
    compile_regions: bool = _opt(
        False, "torch.compile each repeated block of the model in place (regional compilation, as Accelerate's "
        "compile_regions): compiles in seconds, not minutes; its time is in the first_step start-up phase")
    attn_implementation: str | None = _opt(
        None, "Transformers models: attention kernels, eager, sdpa, flash_attention_2, flash_attention_3 or "
        "flex_attention; default Transformers' own (sdpa where the model supports it)")
    chunked_loss: bool = _opt(
        False, "causal_lm with a Transformers model: the output layer and loss computed a chunk of tokens at a time, "
        "no (tokens, vocabulary) float32 logits (GPU memory; unmeasured on a GPU)")
    channels_last: bool = _opt(False, "store image models and batches channels-last (faster convs on GPUs)")
    tf32: bool = _opt(True, "CUDA only: TF32 tensor cores for fp32 matmuls and convolutions")
    profile: bool = _opt(False, "record a torch.profiler trace of a few steps into OUTPUT_DIR/profile")

    # Not an option (a ClassVar, not a field: no flag, no recipe key, not in config.yaml): a warning line for each
    # flag the command line gave twice with different values, set by cli/args.py's parse_args and said once the run
    # starts (assemble.py), after every check of its input.
    repeated_flags: ClassVar[Sequence[str]] = ()
    # Not an option either: whether the global batch was derived from --per_device_batch_size (no
    # --global_batch_size given), set by __post_init__ and named in the start-up block.
    global_batch_derived: ClassVar[bool] = False

    def __post_init__(self) -> None:
        """Check every field's type and range, whatever the source (Python, YAML or CLI): one ConfigError each."""
        check_tracking(self)  # first: an old --with_tracking value gets its own message, not "expects true or false"
        self.optimizer_kwargs = optimizer_kwargs_text(self.optimizer_kwargs)  # a YAML or Python mapping: its JSON
        hints = field_types()
        for f in dataclasses.fields(self):
            value = checked_type(f.name, getattr(self, f.name), hints[f.name], f.default)
            check_range(f.name, value, f.metadata.get("low"), f.metadata.get("high"))
            setattr(self, f.name, value)
        # A per-device batch without a global one means what it means in the Trainer: global = processes x it x
        # accumulation (1 unless given), resolved once the world size is known (batch_layout). The start-up block
        # then says how to keep it fixed across world sizes (--global_batch_size).
        self.global_batch_derived = self.global_batch_size is None and isinstance(self.per_device_batch_size, int)
        if self.global_batch_derived and self.gradient_accumulation_steps is None:
            self.gradient_accumulation_steps = 1
        if self.global_batch_size is None and self.gradient_accumulation_steps is None:
            self.global_batch_size = DEFAULT_GLOBAL_BATCH
        check_hf_fields(self)
        for (name, old), new in RENAMED_VALUES.items():
            if getattr(self, name) == old:
                warn_deprecated(f"--{name} {old}", f"--{name} {new}")
                setattr(self, name, new)
        check_values(self)
        check_urls(self)
        check_per_device(self)
        self.checkpointing_steps = checkpointing_steps_text(self.checkpointing_steps)
        check_spike(self)
        check_dependents(self)  # a flag that nothing in this run would use (the one table)
        check_sizes(self)  # after it: the sizes left are those the run builds
        check_task(self)
        check_optimizer_options(self)
        check_peft(self)
        check_data(self)
        check_best_model(self)
        check_cuda_graphs(self)
        check_rollback(self)
        check_timeouts(self)
        if self.init_from is not None and not self.init_from.endswith(".safetensors"):
            raise ConfigError(f"--init_from {show(self.init_from)}: expected a .safetensors weights file, "
                              "e.g. OUTPUT_DIR/model.safetensors")

    def check_tracker_wait(self, trackers: int) -> None:
        """The other ranks' wait for ``trackers`` trackers' start ends before --ddp_timeout (``checks.py``)."""
        check_tracker_wait(self, trackers)

    def batch_layout(self, world_size: int) -> tuple[int, int]:
        """(per-device batch, gradient accumulation steps) for ``world_size`` ranks.

        The global batch is the unit: ``global = world_size * per_device * accumulation``.

            >>> TrainConfig(global_batch_size=64, per_device_batch_size=16).batch_layout(2)
            (16, 2)
        """
        if self.gradient_accumulation_steps is not None:  # resolved once: config.yaml replays the same steps
            self.global_batch_size, self.per_device_batch_size = accumulation_resolved(
                self.gradient_accumulation_steps, self.per_device_batch_size, self.global_batch_size, world_size)
            self.gradient_accumulation_steps = None
        if self.auto_batch:  # the probe's first candidate (accel_ddp/auto_batch.py)
            per_device = largest_micro_batch(self.global_batch_size, world_size, self.auto_batch_cap)
        else:
            per_device = self.per_device_batch_size or self.global_batch_size // world_size
        return per_device, accumulation_steps(per_device, self.global_batch_size, world_size)

    @property
    def auto_batch(self) -> bool:
        """``--per_device_batch_size auto`` or ``auto:CAP``: the micro-batch is found by a probe at start."""
        return isinstance(self.per_device_batch_size, str)

    @property
    def auto_batch_cap(self) -> int | None:
        """The CAP of ``auto:CAP`` (the probe starts at most there); None for plain ``auto`` or a fixed size."""
        return auto_batch_cap(self.per_device_batch_size)

    def hang_seconds(self) -> float:
        """--hang_timeout resolved: given, it; else ``HANG_TIMEOUT_DEFAULT`` where --ddp_timeout is above it, else 0
        (off: a collective would time out first)."""
        if self.hang_timeout is not None:
            return float(self.hang_timeout)
        return HANG_TIMEOUT_DEFAULT if self.ddp_timeout > HANG_TIMEOUT_DEFAULT else 0.0

    def warmup_for(self, total_steps: int) -> int:
        """Warmup in optimizer steps: --warmup_steps, or ceil(--warmup_ratio x total steps)."""
        if self.warmup_ratio is None:
            return self.warmup_steps
        return math.ceil(self.warmup_ratio * total_steps)

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["synthetic_shape"] = list(self.synthetic_shape)
        return out


def field_types() -> dict[str, Any]:
    return typing.get_type_hints(TrainConfig)


def option_defaults() -> dict[str, Any]:
    """Each option's default (``dataclasses.MISSING`` for one made by a factory)."""
    return {option.name: option.default for option in dataclasses.fields(TrainConfig)}
