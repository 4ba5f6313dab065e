"""The checks ``TrainConfig.__post_init__`` calls (``cfg``: a TrainConfig): known values, sizes that fit, the options
that go together, the waits that must end before --ddp_timeout; one ``ConfigError`` line each."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os
from typing import Any

from accel_ddp.config.choices import (
    ATTN_IMPLEMENTATIONS,
    BOUNDED_TRACKER_CALLS,
    COMM_HOOKS,
    LOADERS,
    LR_SCHEDULES,
    MIXED_PRECISIONS,
    MODEL_STATE_MAX_BYTES,
    ON_ANOMALY,
    PATH_FLAGS,
    PEFT_METHODS,
    REPORT_TO,
    RESNET18_PARAMS_AT_WIDTH_64,
    STORE_PACKAGES,
    SYNTHETIC_MAX_BYTES,
    TASKS,
    TEXT_TASKS,
    URL_SCHEME,
)
from accel_ddp.config.debug import debug_mode
from accel_ddp.util.messages import warn
from accel_ddp.util.validation import INT_MAX, ConfigError, show


def check_per_device(cfg: Any) -> None:
    """--per_device_batch_size: a whole number, ``auto`` or ``auto:CAP`` (CAP a whole number > 0)."""
    value = cfg.per_device_batch_size
    if not isinstance(value, str):
        return
    word, colon, cap = value.partition(":")
    if word != "auto" or (colon and not (cap.isascii() and cap.isdigit() and 0 < int(cap) <= INT_MAX)):
        raise ConfigError(f"--per_device_batch_size {show(value)} is neither a whole number nor auto; give e.g. "
                          "--per_device_batch_size 16, auto, or auto:32 (auto, trying 32 first at most)")
    if cfg.gradient_accumulation_steps is not None:
        raise ConfigError(f"--per_device_batch_size {value} with --gradient_accumulation_steps "
                          f"{cfg.gradient_accumulation_steps}: auto derives the accumulation from the micro-batch "
                          "that fits; give --global_batch_size instead of --gradient_accumulation_steps")


def optimizer_kwargs_text(value: Any) -> Any:
    """``--optimizer_kwargs`` as JSON text: a mapping (YAML, ``TrainConfig(optimizer_kwargs={...})``) is written as
    JSON, so that config.yaml replays it and the flag has one type; anything else is checked as given."""
    return json.dumps(value) if isinstance(value, dict) else value


def optimizer_kwargs(cfg: Any) -> dict[str, Any]:
    """``--optimizer_kwargs`` parsed (``{}`` when unset); ``check_optimizer_options`` checked that it is JSON."""
    return json.loads(cfg.optimizer_kwargs) if cfg.optimizer_kwargs else {}


def check_optimizer_options(cfg: Any) -> None:
    """--optimizer (a torch.optim class by name, any case, or 'pkg.module:function') and --optimizer_kwargs (a JSON
    object). Whether the name is a class of the installed torch, and the keywords its signature, is checked once
    torch is imported (accel_ddp/optim/build.py ``check_optimizer_options``, at start-up)."""
    name = cfg.optimizer.strip()
    if ":" in name:
        module, _, function = name.partition(":")
        if not module or not function:
            raise ConfigError(f"--optimizer {show(name)}: give a torch.optim class name (e.g. adamw) or "
                              "'pkg.module:function'")
    cfg.optimizer = name if ":" in name else name.lower()  # AdamW, adamw and ADAMW are one optimizer
    if cfg.optimizer_kwargs is None:
        return
    example = "e.g. --optimizer_kwargs '{\"betas\": [0.9, 0.95]}'"
    try:
        kwargs = json.loads(cfg.optimizer_kwargs)
    except ValueError as err:
        raise ConfigError(f"--optimizer_kwargs {show(cfg.optimizer_kwargs)} is not JSON ({err}); {example}") from None
    if not isinstance(kwargs, dict):
        raise ConfigError(f"--optimizer_kwargs must be a JSON object of keyword arguments, got "
                          f"{show(cfg.optimizer_kwargs)}; {example}")
    for key, flag in (("lr", "--lr"), ("weight_decay", "--weight_decay"), ("params", None)):
        if key in kwargs and (flag is None or ":" not in name):  # a user's function takes any keyword it names
            fix = f"use {flag} (it applies to the right parameter groups)" if flag else "the run gives the parameters"
            raise ConfigError(f"--optimizer_kwargs sets {key!r}: {fix}; drop it from --optimizer_kwargs")


def warn_deprecated(old: str, new: str) -> None:
    """One line on stderr, from the first rank only (every rank parses the same command line)."""
    warn(f"{old} is deprecated and will be removed in the next release; use {new}", ranks="first")


def check_tracking(cfg: Any) -> None:
    """--with_tracking is a switch, --report_to a comma list of known trackers (normalised: lower case, no repeats)."""
    if not isinstance(cfg.with_tracking, bool):
        raise ConfigError(f"--with_tracking is a switch (true or false), got {cfg.with_tracking!r}; name the trackers "
                          f"with --report_to, e.g. --with_tracking --report_to {cfg.with_tracking}")
    if cfg.report_to is None:  # not given: --with_tracking alone reports to all, as before; else no trackers
        cfg.report_to = "all" if cfg.with_tracking else None
        return _check_tracker_names(cfg)
    names = [name.strip().lower() for name in str(cfg.report_to).split(",") if name.strip()]
    if names == ["none"]:  # the Trainer's "no trackers" (metrics.jsonl is still written)
        if cfg.with_tracking:
            raise ConfigError("--report_to none and --with_tracking contradict each other; give one of them")
        cfg.report_to = None
        return _check_tracker_names(cfg)
    unknown = [name for name in names if name not in REPORT_TO]
    if unknown or not names:
        raise ConfigError(f"--report_to {cfg.report_to!r}: unknown tracker {', '.join(unknown) or '(none given)'}; "
                          f"give one or more of {', '.join(REPORT_TO)}, separated by commas")
    cfg.report_to = ",".join(dict.fromkeys(names))
    # Trackers named: tracking on, as the Trainer's report_to does (transformers' TrainingArguments: "none" is off).
    cfg.with_tracking = True
    _check_tracker_names(cfg)


def _check_tracker_names(cfg: Any) -> None:
    for name in ("tracker_project_name", "run_name"):
        value = getattr(cfg, name)
        if value is not None and not str(value).strip():
            raise ConfigError(f"--{name} is empty; give a name or leave the flag out")


def check_hf_fields(cfg: Any) -> None:
    """The options with Hugging Face names and derived meanings (HF_FIELDS)."""
    if cfg.warmup_ratio is not None:
        if not cfg.warmup_ratio < 1:
            raise ConfigError(f"--warmup_ratio must be below 1 (a fraction of the total steps), got "
                              f"{cfg.warmup_ratio}; e.g. --warmup_ratio 0.06")
        if cfg.warmup_steps:
            raise ConfigError(f"--warmup_ratio {cfg.warmup_ratio} and --warmup_steps {cfg.warmup_steps} both set the "
                              "warmup; give one of them")
    if cfg.mixed_precision is not None and cfg.mixed_precision not in MIXED_PRECISIONS:
        raise ConfigError(f"--mixed_precision {show(cfg.mixed_precision)} is unknown; choose one of "
                          f"{', '.join(MIXED_PRECISIONS)}")
    if (cfg.task in TEXT_TASKS and cfg.tokenizer is None and ":" not in cfg.model and "/" in cfg.model
            and not os.path.exists(cfg.model)):  # a Hub id (org/name): its tokenizer, as run_clm_no_trainer.py
        cfg.tokenizer = cfg.model


def _gib(num_bytes: float) -> str:
    return f"{num_bytes / 2**30:,.3g} GiB"


def check_task(cfg: Any) -> None:
    """--task and the options that only make sense with some tasks (no dead flags)."""
    if cfg.task not in TASKS:
        raise ConfigError(f"--task {show(cfg.task)} is unknown; choose one of {', '.join(TASKS)}")
    if cfg.attn_implementation is not None and cfg.attn_implementation not in ATTN_IMPLEMENTATIONS:
        raise ConfigError(f"--attn_implementation {show(cfg.attn_implementation)} is unknown; choose one of "
                          f"{', '.join(ATTN_IMPLEMENTATIONS)}")
    if cfg.compile_regions and cfg.compile:
        raise ConfigError("--compile_regions and --compile: the first compiles the model's repeated blocks, the "
                          "second the whole model; give one")
    if cfg.chunked_loss and (cfg.task != "causal_lm" or cfg.loss is not None):
        raise ConfigError("--chunked_loss computes --task causal_lm's own loss" + (
            f", not --loss {cfg.loss}" if cfg.task == "causal_lm" else "") + "; drop --chunked_loss")
    if cfg.task == "causal_lm" and cfg.max_length < 2:  # else loss 0.0 and perplexity 1.0 over no token at all
        raise ConfigError(f"--max_length {cfg.max_length} with --task causal_lm leaves no next token to predict "
                          "(each sequence predicts its tokens after the first); use --max_length 2 or more")
    if cfg.model_config is not None:
        if cfg.model != _default(cfg, "model"):
            raise ConfigError(f"--model {cfg.model} and --model_config {cfg.model_config}: give one of them "
                              "(a config trains from scratch, a model folder from its weights)")
        if not os.path.isfile(cfg.model_config):
            raise ConfigError(f"--model_config {cfg.model_config}: no such file; give a Transformers config.json "
                              "(e.g. examples/configs/tiny_gpt2.json)")


def _default(cfg: Any, name: str) -> Any:
    return next(f.default for f in dataclasses.fields(cfg) if f.name == name)


def check_data(cfg: Any) -> None:
    """The data options that only make sense together (--streaming and its companions)."""
    if not cfg.streaming:
        return
    if cfg.dataset != "hf":
        raise ConfigError(f"--streaming reads Hugging Face datasets; add --dataset hf (got --dataset {cfg.dataset})")
    if cfg.max_steps is None:
        raise ConfigError("--streaming: a stream has no length to count epochs by; set --max_steps")
    if cfg.loader == "device":
        raise ConfigError("--streaming and --loader device: a stream is not kept on the device; drop --loader")
    if cfg.task in TEXT_TASKS:
        raise ConfigError(f"--streaming with --task {cfg.task}: text is tokenized once into a memory-mapped dataset, "
                          "which reads a batch at a time at any size; drop --streaming")
    if cfg.checkpointing_steps == "epoch":  # the loop's one epoch is the whole run (data/streaming.py)
        raise ConfigError("--streaming with --checkpointing_steps epoch: a stream has no epochs (the run is one, of "
                          "--max_steps steps), so it would save once, at the end; give --checkpointing_steps N "
                          "(optimizer steps)")
    if not cfg.eval_every:
        warn("--streaming evaluates once, at the end: a stream has no epochs to evaluate after; give --eval_every N "
             "(optimizer steps) to evaluate during the run", kind="note", ranks="first")


def check_urls(cfg: Any) -> None:
    """A URL is a local path (``file://``), a --checkpoint_dir store, or refused: Accelerate's save_state would
    write ``s3://b/r`` into a local folder named ``s3:/b/r`` (``os.makedirs``/``Path``, accelerate/accelerator.py)."""
    if cfg.checkpoint_dir is not None:
        cfg.checkpoint_dir = _checked_store(cfg.checkpoint_dir)
    for name in PATH_FLAGS:
        value = getattr(cfg, name)
        match = URL_SCHEME.match(value) if isinstance(value, str) else None
        if match is None:
            continue
        if match.group(1).lower() == "file":
            setattr(cfg, name, value[len(match.group(0)):] or "/")  # file:///abs/path -> /abs/path
            continue
        store = cfg.checkpoint_dir
        if name == "resume_from_checkpoint" and store and value.rstrip("/").startswith(f"{store}/"):
            continue  # one of this run's checkpoints in the store
        fix = {"output_dir": "give a local or shared folder, and send the checkpoints to the store with "
                             f"--checkpoint_dir {value}",
               "resume_from_checkpoint": "give a checkpoint under --checkpoint_dir, or auto",
               "init_from": "download the file and give its local path"}[name]
        raise ConfigError(f"--{name} {value}: {match.group(1)}:// URLs are not supported here; {fix}")


def _checked_store(url: str) -> str:
    """``--checkpoint_dir``: a URL of a known scheme whose fsspec package is installed (found, not imported)."""
    match = URL_SCHEME.match(url)
    if match is None:
        raise ConfigError(f"--checkpoint_dir {url} is not a URL; give s3://bucket/prefix (or gs://, az://, file://), "
                          "or drop it: checkpoints then go to OUTPUT_DIR/checkpoints")
    scheme = match.group(1).lower()
    if scheme not in STORE_PACKAGES:
        raise ConfigError(f"--checkpoint_dir {url}: {scheme}:// is not supported; use one of "
                          f"{', '.join(s + '://' for s in STORE_PACKAGES)}")
    if not url[len(match.group(0)):].strip("/"):
        raise ConfigError(f"--checkpoint_dir {url} names no bucket or folder; e.g. --checkpoint_dir {scheme}://bucket/run")
    package, extra = STORE_PACKAGES[scheme]
    if importlib.util.find_spec("fsspec") is None or importlib.util.find_spec(package) is None:
        needed = f'"accel_ddp[{extra}]"' if extra else "fsspec"
        raise ConfigError(f"--checkpoint_dir {url} needs the {package} package, which is not installed; "
                          f"pip install {needed}")
    return url.rstrip("/")


def check_rollback(cfg: Any) -> None:
    """--on_anomaly rollback reloads the last checkpoint: without --checkpointing_steps there is none to go back to
    (the first bad step would stop the run with exit 3, as --on_anomaly stop does)."""
    if cfg.on_anomaly == "rollback" and cfg.checkpointing_steps is None:
        raise ConfigError("--on_anomaly rollback reloads the last checkpoint, but no checkpoint is saved; add "
                          "--checkpointing_steps N, or use --on_anomaly skip")


def check_best_model(cfg: Any) -> None:
    """--load_best_model_at_end needs every checkpoint at an evaluation (the Trainer's rule), or the best is lost
    (--greater_is_better and --early_stopping_threshold without what uses them: config/dependents.py)."""
    if not cfg.load_best_model_at_end:
        return
    save, every = cfg.checkpointing_steps, cfg.eval_every
    if save is None:
        raise ConfigError("--load_best_model_at_end exports the best checkpoint, but no checkpoint is saved; add "
                          "--checkpointing_steps (a multiple of --eval_every, or 'epoch' with --eval_every 0)")
    if save == "epoch" and every:
        raise ConfigError(f"--load_best_model_at_end with --checkpointing_steps epoch evaluates at the end of each "
                          f"epoch: drop --eval_every {every}, or save every N steps with N a multiple of it")
    if save != "epoch" and (not every or int(save) % every):
        raise ConfigError(f"--load_best_model_at_end: --checkpointing_steps {save} must be a multiple of --eval_every "
                          f"({every or 'unset: evaluates per epoch'}), so that every checkpoint is evaluated; e.g. "
                          f"--eval_every {save}")


def check_peft(cfg: Any) -> None:
    """--peft lora and its options: a known method, a dropout below 1, target names (--lora_*/--merge_adapter without
    --peft: config/dependents.py)."""
    if cfg.peft is not None and cfg.peft not in PEFT_METHODS:
        raise ConfigError(f"--peft {show(cfg.peft)} is unknown; choose one of {', '.join(PEFT_METHODS)}")
    if not cfg.lora_dropout < 1:
        raise ConfigError(f"--lora_dropout must be < 1, got {cfg.lora_dropout:g}; give a value from 0 to 0.5, say")
    if not [name for name in cfg.lora_target_modules.split(",") if name.strip()]:
        raise ConfigError("--lora_target_modules is empty; give module names such as c_attn,c_proj, or all-linear")


def check_cuda_graphs(cfg: Any) -> None:
    """``--cuda_graphs`` with options whose guarantees a captured step cannot keep (accel_ddp/step/graph.py; the
    launch-dependent refusals, no CUDA, gloo, accumulation, the loader, fp16, come once the run is set up)."""
    if not cfg.cuda_graphs:
        return
    why = {"debug": "--debug checks every loss on the host (a sync per step)",
           "on_anomaly": f"--on_anomaly {cfg.on_anomaly} decides each step's update on the host",
           "streaming": "--streaming batches vary in shape",
           "compile": "--compile graphs the model its own way (torch.compile's mode reduce-overhead)",
           "optimizer": f"--optimizer {cfg.optimizer} is not capturable (AdamW is)",
           "ddp_comm_hook": f"--ddp_comm_hook {cfg.ddp_comm_hook} completes on host callbacks",
           "loader": "--loader dataloader (without --packing) has batches of varying shapes",
           # torch/utils/checkpoint.py get_device_states: non-reentrant checkpointing saves the CUDA RNG state in the
           # forward (torch.cuda.get_rng_state), which CUDA forbids during a capture (CUDAGeneratorImpl's check)
           "gradient_checkpointing": "--gradient_checkpointing reads the CUDA random state in each forward, which a "
                                     "capture forbids",
           # DDP's reducer decides on the host each step: which parameters the autograd graph reached
           # (find_unused_parameters), or which buckets to rebuild after its first iterations (static_graph)
           "ddp_find_unused_parameters": "--ddp_find_unused_parameters searches the autograd graph on the host each "
                                         "step (a replay would reuse the captured step's answer)",
           "ddp_static_graph": "--ddp_static_graph rebuilds DDP's buckets on the host after its first steps (a replay "
                               "would keep the captured buckets)"}
    clashes = {"debug": debug_mode(cfg).check_micro_steps, "on_anomaly": cfg.on_anomaly != "stop",
               "streaming": cfg.streaming,
               "compile": cfg.compile, "optimizer": cfg.optimizer != "adamw",
               "ddp_comm_hook": cfg.ddp_comm_hook != "none",
               "loader": cfg.loader == "dataloader" and not cfg.packing,
               "gradient_checkpointing": cfg.gradient_checkpointing,
               "ddp_find_unused_parameters": cfg.ddp_find_unused_parameters, "ddp_static_graph": cfg.ddp_static_graph}
    for name, clash in clashes.items():
        if clash:
            raise ConfigError(f"--cuda_graphs cannot keep its guarantees here: {why[name]}; drop one of them")


def check_values(cfg: Any) -> None:
    """Known choices, a positive --lr, something to train, no empty name."""
    for name, choices in (("loader", LOADERS), ("lr_schedule", LR_SCHEDULES),
                          ("ddp_comm_hook", COMM_HOOKS), ("on_anomaly", ON_ANOMALY)):
        if getattr(cfg, name) not in choices:
            raise ConfigError(f"--{name} {show(getattr(cfg, name))} is unknown; "
                              f"choose one of {', '.join(choices)}")
    if not cfg.lr > 0:
        raise ConfigError(f"--lr must be > 0, got {cfg.lr}; try --lr 3e-3")
    if cfg.epochs == 0 and cfg.max_steps is None:
        raise ConfigError("--epochs is 0 and --max_steps is not set: nothing to train; set one of them")
    for name in ("dataset", "model", "output_dir"):
        if not getattr(cfg, name).strip():
            raise ConfigError(f"--{name} is empty; give a {'folder' if name == 'output_dir' else 'name'}")


def checkpointing_steps_text(value: Any) -> str | None:
    """--checkpointing_steps as text: a positive step count or ``epoch`` (None: no scheduled saves)."""
    if value is None:
        return None
    value = str(value)
    if value != "epoch" and not (value.isascii() and value.isdigit() and len(value) <= 10
                                 and 0 < int(value) <= INT_MAX):
        raise ConfigError(f"--checkpointing_steps must be a positive step count or 'epoch', got {show(value)}")
    return value


def check_sizes(cfg: Any) -> None:
    """A positive --synthetic_shape, and sizes whose memory is known before anything is built: refuse what cannot
    fit (see the *_MAX_BYTES)."""
    if not cfg.synthetic_shape or any(d < 1 for d in cfg.synthetic_shape):
        raise ConfigError(f"--synthetic_shape must be one or more positive sizes, got "
                          f"{show(list(cfg.synthetic_shape))}; e.g. --synthetic_shape 1 28 28")
    mlp = cfg.hidden_size**2  # the hidden-to-hidden layer alone
    resnet = RESNET18_PARAMS_AT_WIDTH_64 * (cfg.width / 64) ** 2
    for name, params in (("hidden_size", mlp), ("width", resnet)):
        if 16 * params > MODEL_STATE_MAX_BYTES:
            raise ConfigError(f"--{name} {getattr(cfg, name)} is too large: ~{params:.2g} parameters need "
                              f"~{_gib(16 * params)} for weights, gradients and AdamW state (at most "
                              f"{_gib(MODEL_STATE_MAX_BYTES)}); use a smaller --{name}")
    shape = " ".join(map(str, cfg.synthetic_shape))
    one_sample = math.prod(cfg.synthetic_shape)
    for name, rows in (("synthetic_samples", cfg.synthetic_samples + cfg.synthetic_samples // 4),
                       ("synthetic_classes", cfg.synthetic_classes)):  # inputs; the labelling teacher
        if 4 * one_sample * rows > SYNTHETIC_MAX_BYTES:
            raise ConfigError(f"--{name} {getattr(cfg, name)} with --synthetic_shape {shape} needs "
                              f"~{_gib(4 * one_sample * rows)} of float32 on every rank (at most "
                              f"{_gib(SYNTHETIC_MAX_BYTES)}); lower --{name} or the shape")


def check_spike(cfg: Any) -> None:
    """--spike_factor: above 1, and not with --on_anomaly skip."""
    if cfg.spike_factor and cfg.on_anomaly == "skip":  # a spike is seen at a log line, after its updates
        raise ConfigError(f"--spike_factor {cfg.spike_factor:g} with --on_anomaly skip: a spike is found at a "
                          "log line, once its steps are trained; use --on_anomaly rollback (or stop)")
    if cfg.spike_factor and cfg.spike_factor <= 1:
        raise ConfigError(f"--spike_factor must be > 1 (a loss that many times the median), got "
                          f"{cfg.spike_factor:g}; e.g. --spike_factor 3, or 0 for no spike check")


def check_timeouts(cfg: Any) -> None:
    """The waits that must end before --ddp_timeout fails a collective on every rank, naming nothing."""
    if cfg.with_tracking and "all" not in cfg.report_to.split(","):  # `all`: checked once it is resolved
        check_tracker_wait(cfg, len(cfg.report_to.split(",")))
    if cfg.checkpoint_dir and cfg.store_timeout >= cfg.ddp_timeout:  # the other ranks wait for the main's call
        raise ConfigError(f"--store_timeout {cfg.store_timeout:g} s is not less than --ddp_timeout "
                          f"{cfg.ddp_timeout} s: the other ranks' wait for a save would fail first, without "
                          "naming the store; lower --store_timeout or raise --ddp_timeout")
    if cfg.hang_timeout and cfg.hang_timeout >= cfg.ddp_timeout:  # a collective's timeout would come first
        raise ConfigError(f"--hang_timeout {cfg.hang_timeout:g} s is not less than --ddp_timeout "
                          f"{cfg.ddp_timeout} s: a hang would end in a collective's timeout, naming no line; "
                          "lower --hang_timeout or raise --ddp_timeout")


def check_tracker_wait(cfg: Any, trackers: int) -> None:
    """The other ranks' wait for ``trackers`` trackers' start must end before --ddp_timeout fails their
    broadcast: a collective timeout on every rank instead of the one line naming the tracker."""
    longest = cfg.tracker_start_timeout * BOUNDED_TRACKER_CALLS * trackers
    if longest >= cfg.ddp_timeout:
        raise ConfigError(
            f"--tracker_start_timeout {cfg.tracker_start_timeout:g} s with {trackers} tracker(s) can keep the "
            f"other ranks waiting {longest:g} s (each tracker's start, its config and, after a failed start, its "
            f"close, in turn), not less than --ddp_timeout {cfg.ddp_timeout} s; lower --tracker_start_timeout "
            f"below {cfg.ddp_timeout / (BOUNDED_TRACKER_CALLS * trackers):g} or raise --ddp_timeout above "
            f"{longest:g}")
