"""The training run, read top to bottom: ``setup`` -> ``fit`` -> ``evaluate_and_log`` -> ``finish``.

``train()`` is the Python API; ``main()`` the CLI (returns an exit code); ``run()`` the script
entry point (``train.py``, ``accel-ddp train``), which exits the process safely.

    accelerate launch --config_file accelerate_configs/cpu_2proc.yaml train.py --dataset digits

    from accel_ddp import TrainConfig, train
    summary = train(TrainConfig(epochs=3), model=my_model, train_dataset=ds, eval_dataset=ds_eval)
"""

from __future__ import annotations

import math
import os
import sys
import time
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, NamedTuple, NoReturn, TypeVar

import torch
from accelerate import Accelerator, DataLoaderConfiguration, PartialState
from accelerate.utils import (
    DDPCommunicationHookType,
    DistributedDataParallelKwargs,
    DistributedType,
    gather_object,
    send_to_device,
    set_seed,
)
from torch.utils.data import Dataset, IterableDataset, Subset
from tqdm.auto import tqdm

from accel_ddp import failure
from accel_ddp.checkpoint import HYPERPARAMETERS, CheckpointManager, flags_in_force
from accel_ddp.config import TEXT_TASKS, ConfigError, TrainConfig, parse_args
from accel_ddp.data import HFSource, build_datasets, build_loaders
from accel_ddp.data.loaders import first_samples
from accel_ddp.data.text import PadCollate, TextOptions, build_text, has_tokenizer, pad_token_id
from accel_ddp.evaluate import evaluate
from accel_ddp.failure import main_process_decides
from accel_ddp.meters import (
    EpochTimer,
    StepProfiler,
    ThroughputMeter,
    largest,
    memory_record,
    progress_bar,
    timed,
)
from accel_ddp.model_card import launch_command, write_model_card
from accel_ddp.models import (
    MODELS,
    build_lr_scheduler,
    build_model,
    build_optimizer,
    build_transformers_model,
    export_pretrained,
    is_pretrained_folder,
    use_fused_optimizer,
)
from accel_ddp.outputs import SUMMARY_NAME
from accel_ddp.preemption import (
    EXIT_NON_FINITE,
    EXIT_PREEMPTED,
    LossWatch,
    NonFiniteLoss,
    Preempted,
    PreemptionWatcher,
    exit_process,
    ignore_preemption_signals,
    restart_hazard,
)
from accel_ddp.preflight import build_fsdp_plugin, check_fsdp, check_launch_devices, check_shared_output_dir
from accel_ddp.registry import resolve
from accel_ddp.run_dir import check_output_dir, claim_output_dir, finished_summary
from accel_ddp.startup import StartupClock
from accel_ddp.tasks import LossAccumulator, Task, build_task
from accel_ddp.trackers import tracking_kwargs
from accel_ddp.tracking import RunRecorder
from accel_ddp.update import build_update
from accel_ddp.weights import export_weights, load_weights

DEBUG_MAX_STEPS = 10  # --debug: a handful of optimizer steps is enough to surface shape or sync bugs


T = TypeVar("T")


class LaunchError(RuntimeError):
    """The processes did not form the world the launcher announced."""


# Where a launcher puts the world size: torchrun, then MPI's (the names Accelerate reads for MULTI_CPU).
_WORLD_SIZE_VARS = ("WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE")


def single_process_trap(env=os.environ) -> str | None:
    """Why this lone process is not the world its launch config asked for, or None.

    Accelerate's simple launcher (``distributed_type: MULTI_CPU`` without mpirun, ``NO``, or
    ``--cpu``) starts ONE process whatever ``num_processes`` says, and it marks it: it always sets
    ``ACCELERATE_USE_CPU``, and ``MASTER_ADDR``/``MASTER_PORT`` only when the config asked for more
    than one process or machine; no world size, since neither torchrun nor mpirun started it
    (accelerate/utils/launch.py, ``prepare_simple_launcher_cmd_env``; huggingface/accelerate#2741).
    The process cannot know how many were meant, so it cannot train on them: it refuses.
    """
    simple_launcher = "ACCELERATE_USE_CPU" in env and not any(name in env for name in _WORLD_SIZE_VARS)
    if not (simple_launcher and "MASTER_ADDR" in env and "MASTER_PORT" in env):
        return None
    return ("accelerate launch started 1 process, but its config asks for several (distributed_type MULTI_CPU "
            "without mpirun, NO, or --cpu start just one); use distributed_type: MULTI_GPU, which trains on CPU over "
            "gloo when there is no GPU (answer multi-GPU in `accelerate config`, or launch with --config_file "
            "accelerate_configs/cpu_2proc.yaml); for one process, num_processes: 1 and no MASTER_ADDR set")


def build_accelerator(cfg: TrainConfig) -> tuple[Accelerator, int, int]:
    """Join the process group and derive (per-device batch, accumulation) from the world size.

    Without a GPU we must ask for CPU ourselves: Accelerate only forms a gloo group for a
    torchrun launch when the script requests CPU; otherwise it would start N lone processes.
    """
    if cfg.debug:
        os.environ["ACCELERATE_DEBUG_MODE"] = "1"  # cross-rank shape checks on every collective
    cpu = not torch.cuda.is_available()
    check_launch_devices(cuda_available=not cpu)  # one process per GPU; GPUs this torch cannot use
    if not cpu and cfg.tf32:  # TF32 tensor cores for fp32 matmuls/convs: ~8x on Ampere+, 10-bit mantissa
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    if problem := single_process_trap():
        raise LaunchError(problem)
    state = PartialState(cpu=cpu, timeout=timedelta(seconds=cfg.ddp_timeout))
    launched_world = int(os.environ.get("WORLD_SIZE", "1"))
    if state.num_processes != launched_world:
        raise LaunchError(
            f"the launcher started {launched_world} processes but they formed a group of "
            f"{state.num_processes}; launch with an accelerate config of distributed_type MULTI_GPU "
            "(see accelerate_configs/README.md), not MULTI_CPU without mpirun"
        )
    per_device, accumulation = cfg.batch_layout(state.num_processes)
    accelerator = Accelerator(
        cpu=cpu,
        gradient_accumulation_steps=accumulation,
        # Accelerate would otherwise step the schedule num_processes times per optimizer step.
        step_scheduler_with_optimizer=False,
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=cfg.seed, non_blocking=not cpu),
        kwargs_handlers=[ddp_kwargs(cfg)],
        dynamo_backend="inductor" if cfg.compile else None,
        fsdp_plugin=build_fsdp_plugin(cuda_available=not cpu),  # FSDP2 launches: gradients reduced in fp32
        # --with_tracking: the trackers of --report_to (a missing package stops every rank here, before any data)
        **(tracking_kwargs(state, cfg.report_to, cfg.output_dir, cfg.tracker_project_name, cfg.run_name)
           if cfg.with_tracking else {}),
    )
    return accelerator, per_device, accumulation


def ddp_kwargs(cfg: TrainConfig) -> DistributedDataParallelKwargs:
    """The DistributedDataParallel options from the config (Accelerate applies them in ``prepare``)."""
    return DistributedDataParallelKwargs(
        bucket_cap_mb=cfg.ddp_bucket_cap_mb,
        gradient_as_bucket_view=cfg.ddp_gradient_as_bucket_view,
        static_graph=cfg.ddp_static_graph,
        find_unused_parameters=cfg.ddp_find_unused_parameters,
        comm_hook=DDPCommunicationHookType("no" if cfg.ddp_comm_hook == "none" else cfg.ddp_comm_hook),
    )


def _infer_num_classes(dataset: Dataset) -> int:
    if hasattr(dataset, "classes"):
        return len(dataset.classes)
    tensors = getattr(dataset, "tensors", None)
    if tensors is not None and len(tensors) >= 2:
        return int(tensors[1].max()) + 1
    raise ConfigError("cannot tell the number of classes of train_dataset; pass model= built for it")


def local_main_first(accelerator: Accelerator, build: Callable[[], T]) -> T:
    """Run ``build`` on each machine's first process, then on the others (they reuse its download).

    Unlike ``accelerator.local_main_process_first()``, an error on the first process still lets
    the others pass the barrier: they run ``build`` themselves and hit the same error, so every
    rank reports bad input and exits, instead of one rank dying inside a barrier.
    """
    if not accelerator.is_local_main_process:
        accelerator.wait_for_everyone()
        return build()
    try:
        return build()
    finally:
        accelerator.wait_for_everyone()


class Data(NamedTuple):
    """The datasets of a run and what the model and the loaders need to know about them."""

    train: Dataset
    eval: Dataset | None
    num_classes: int | None  # None: read from the dataset if a built-in model needs it
    input_shape: tuple[int, ...] | None  # one (input, label) sample's input shape; None for dict samples
    tokenizer: Any = None  # text tasks: the tokenizer (saved beside a Transformers model)
    collate_fn: Callable | None = None  # dict samples: padded per batch; None: torch's default_collate


def _resolve_data(cfg: TrainConfig, accelerator: Accelerator, train_dataset, eval_dataset, collate_fn=None) -> Data:
    """The datasets from the config (built once per machine first) or the caller, and how to batch them."""
    tokenizer = None
    hf = HFSource(cfg.hf_name, cfg.hf_config, cfg.hf_train_split, cfg.hf_eval_split, cfg.image_column,
                  cfg.label_column, streaming=cfg.streaming, shuffle_buffer=cfg.shuffle_buffer,
                  # in memory below the threshold (the device loader can serve it), memory-mapped above
                  in_memory_max_mb=math.inf if cfg.loader == "device" else cfg.device_loader_max_mb)
    if train_dataset is None and cfg.task in TEXT_TASKS and cfg.dataset == "hf":
        text = TextOptions(cfg.tokenizer or (cfg.model if has_tokenizer(cfg.model) else None), cfg.text_column,
                           cfg.max_length, cfg.packing, labels=cfg.task == "sequence_classification")
        # Tokenized on each machine's first process, then read from the datasets cache by the others.
        bundle, tokenizer = local_main_first(accelerator, lambda: build_text(cfg.data_dir, hf, text))
    elif train_dataset is None:
        bundle = local_main_first(accelerator, lambda: build_datasets(  # one download per machine
            cfg.dataset, cfg.data_dir, cfg.download, samples=cfg.synthetic_samples,
            shape=cfg.synthetic_shape, classes=cfg.synthetic_classes, image_size=cfg.image_size, hf=hf,
        ))
    if train_dataset is None:
        train_dataset, eval_dataset = bundle.train, bundle.eval
        num_classes, input_shape = bundle.num_classes, bundle.input_shape
    else:
        num_classes, input_shape = None, None
    streamed = isinstance(train_dataset, IterableDataset)  # a stream has no [0]: its bundle gave the shape
    if not streamed and isinstance(train_dataset[0], Mapping):  # dict samples: no single input shape
        input_shape = None
    elif input_shape is None:
        input_shape = tuple(train_dataset[0][0].shape)
    if cfg.debug and not streamed:  # a small subset: errors show up in seconds
        train_dataset = Subset(train_dataset, range(min(len(train_dataset), DEBUG_MAX_STEPS * cfg.global_batch_size)))
        if eval_dataset is not None:
            eval_dataset = Subset(eval_dataset, range(min(len(eval_dataset), 4 * cfg.global_batch_size)))
    collate_fn = collate_fn or (resolve(cfg.collate_fn, {}, kind="collate_fn") if cfg.collate_fn else None)
    if collate_fn is None and input_shape is None:  # dict samples, maybe of different lengths
        collate_fn = PadCollate(pad_token_id(tokenizer))
    return Data(train_dataset, eval_dataset, num_classes, input_shape, tokenizer, collate_fn)


def _build_model(cfg: TrainConfig, data: Data) -> torch.nn.Module:
    """The model named by --model / --model_config: a Transformers model, a built-in one or the user's builder."""
    if os.path.isdir(cfg.model) and not is_pretrained_folder(cfg.model):
        raise ConfigError(f"--model {cfg.model}: a folder without a config.json; give a folder written by "
                          "save_pretrained (a run's final model is OUTPUT_DIR/hf_model)")
    transformers_model = cfg.model_config is not None or is_pretrained_folder(cfg.model) or (
        cfg.model not in MODELS and ":" not in cfg.model and "/" in cfg.model)  # a Hub id: org/name
    if transformers_model:
        return build_transformers_model(
            cfg.task, None if cfg.model_config else cfg.model, cfg.model_config, num_labels=data.num_classes,
            tokenizer=data.tokenizer, max_length=cfg.max_length if data.tokenizer is not None else None)
    if cfg.task in TEXT_TASKS and ":" not in cfg.model:
        raise ConfigError(f"--task {cfg.task} needs a Transformers model: --model FOLDER (save_pretrained) or "
                          f"--model_config config.json, or your own --model pkg.module:function")
    if data.input_shape is None and ":" not in cfg.model:
        raise ConfigError(f"--model {cfg.model} takes (input, label) samples, but the dataset yields dicts; give a "
                          "model that takes them (model=, a Transformers folder, or pkg.module:function)")
    return build_model(cfg.model, data.num_classes or _infer_num_classes(data.train), data.input_shape,
                       cfg.hidden_size, width=cfg.width)


def _probe_task(task: Task, accelerator: Accelerator, model, data: Data, evaluates: bool) -> None:
    """One forward of two training samples: a missing or non-scalar loss, or logits that do not fit the labels,
    is bad input, reported before any write.

    Tuple samples with the default cross-entropy only need their shapes checked: the model runs without
    torch.compile's wrapper, which would otherwise compile an extra graph for it.
    """
    collate = data.collate_fn or torch.utils.data.default_collate
    with torch.random.fork_rng(devices=[]):  # a sample's augmentation draws: the run's RNG stream stays as it was
        batch = send_to_device(collate(first_samples(data.train, 2)), accelerator.device)
    if data.input_shape is not None and task.loss_fn is None:
        task.check_logits(getattr(model, "_orig_mod", model), batch)
    else:
        task.check(model, batch, evaluates)


@dataclass
class Plan:
    """What an optimizer step means for this run, derived once from the config and the world size."""

    per_device_batch: int  # samples per forward pass on one rank
    accumulation: int  # micro-steps per optimizer step
    steps_per_epoch: int  # optimizer steps; the trailing partial global batch is dropped
    total_steps: int  # optimizer steps of the whole run
    num_epochs: int


@dataclass
class Run:
    """Everything ``fit`` and ``finish`` need, built by ``setup``. Collective objects are on every rank."""

    cfg: TrainConfig
    accelerator: Accelerator
    model: torch.nn.Module  # wrapped by accelerator.prepare (DDP, FSDP or as is)
    task: Task  # how batches reach the model, the loss, the eval metrics
    optimizer: Any
    scheduler: Any
    train_loader: Any  # a DeviceLoader, HostLoader (a DataLoader) or StreamingLoader: batches on the device
    eval_loader: Any  # None when there is no eval set
    plan: Plan
    facts: dict[str, Any]  # world size, batch layout, loader... : config.yaml, checkpoints and summary.json
    recorder: RunRecorder
    checkpoints: CheckpointManager
    preemption: PreemptionWatcher
    start_step: int  # 0, or the optimizer step of the checkpoint resumed from
    started: float  # time.perf_counter() when train() began
    startup: StartupClock  # process start -> first optimizer step, by phase (summary.json's startup_sec)
    tokenizer: Any = None  # text tasks: saved beside a Transformers model's final weights


def train(
    cfg: TrainConfig,
    model: torch.nn.Module | None = None,
    train_dataset: Dataset | None = None,
    eval_dataset: Dataset | None = None,
    *,
    loss_fn: Callable[[Any, Any], Any] | None = None,
    metrics: Sequence[Any] = (),
    collate_fn: Callable[[list], Any] | None = None,
) -> dict[str, Any]:
    """Train on every rank of the current launch; return the summary (the same on every rank).

    ``model`` and the datasets default to those named in ``cfg``. Datasets yield ``(input,
    label)`` pairs or dicts of tensors (``model(**batch)``), batched by ``collate_fn`` (default:
    dicts padded per batch); without ``eval_dataset`` no evaluation runs. ``loss_fn(outputs,
    batch)`` returns a mean or a ``(sum, num_items)`` pair; ``metrics`` are objects with
    ``update(outputs, batch)`` and ``compute() -> dict`` (see :mod:`accel_ddp.tasks`). On SIGTERM or
    SIGUSR1 every rank stops after the same optimizer step, saves a checkpoint and raises ``Preempted``.
    """
    with ExitStack() as teardown:  # on any exit: signal handlers back, files closed, lock and process group gone
        try:
            run = setup(cfg, teardown, model, train_dataset, eval_dataset, loss_fn=loss_fn, metrics=metrics,
                        collate_fn=collate_fn)
        except RunFinished as done:  # the same command again after the run ended: nothing to do, nothing touched
            return done.summary
        return finish(run, fit(run))


def setup(cfg: TrainConfig, teardown: ExitStack, model=None, train_dataset=None, eval_dataset=None, *,
          loss_fn=None, metrics=(), collate_fn=None) -> Run:
    """Join the process group, build data, model, optimizer and schedule, and agree on where to start."""
    started = time.perf_counter()
    startup = StartupClock()  # "imports": interpreter start, imports and option parsing, up to here
    accelerator, per_device_batch, accumulation = build_accelerator(cfg)
    teardown.callback(accelerator.end_training)
    main_process_decides(accelerator, lambda: check_output_dir(cfg.output_dir))  # a bad folder: now, not after data
    check_shared_output_dir(accelerator, cfg.output_dir)  # several machines: one folder for all of them
    # From now on a SIGTERM means "save, then stop"; the flag's all-reduce waits --ddp_timeout at most.
    preemption = PreemptionWatcher(accelerator, timedelta(seconds=cfg.ddp_timeout)).install()
    teardown.callback(preemption.uninstall)
    if accelerator.is_main_process and (hazard := restart_hazard()):
        print(f"accel_ddp: warning: {hazard}", file=sys.stderr, flush=True)
    startup.mark("process_group")

    if cfg.debug:
        torch.autograd.set_detect_anomaly(True)
        torch.use_deterministic_algorithms(True, warn_only=True)
    set_seed(cfg.seed)  # same model init on every rank; DDP also broadcasts rank 0's weights
    memory_format = torch.channels_last if cfg.channels_last else torch.contiguous_format
    task = build_task(cfg.task, loss_fn or (resolve(cfg.loss, {}, kind="loss") if cfg.loss else None), metrics,
                      memory_format)
    data = _resolve_data(cfg, accelerator, train_dataset, eval_dataset, collate_fn)
    train_dataset, eval_dataset = data.train, data.eval
    startup.mark("data")
    if model is None:
        model = _build_model(cfg, data)
    if accelerator.is_fsdp2:  # before anything is built on it: what FSDP2 cannot shard or cast
        check_fsdp(model, channels_last=cfg.channels_last, mixed_precision=accelerator.mixed_precision)
    if cfg.init_from:
        load_weights(model, cfg.init_from)  # every rank reads the same file before DDP wraps the model
    model = model.to(memory_format=memory_format)  # NHWC convolutions: faster on tensor cores
    startup.mark("model")

    # The device loader where the data fits (--loader), else a DataLoader over the same order, or a stream.
    loaders = build_loaders(
        accelerator, train_dataset, eval_dataset, per_device_batch_size=per_device_batch,
        global_batch_size=cfg.global_batch_size, eval_batch_size=cfg.eval_batch_size, loader=cfg.loader,
        num_workers=0 if cfg.debug else cfg.num_workers, device_loader_max_mb=cfg.device_loader_max_mb,
        collate_fn=data.collate_fn, max_steps=cfg.max_steps,
    )
    train_loader, eval_loader = loaders.train, loaders.eval
    plan = _plan(cfg, loaders.steps_per_epoch, per_device_batch, accumulation)
    startup.mark("loaders")

    optimizer = build_optimizer(cfg.optimizer, model, cfg.lr, cfg.weight_decay,
                                fused=use_fused_optimizer(cfg.optimizer, accelerator.device.type, accelerator.is_fsdp2))
    scheduler = build_lr_scheduler(optimizer, cfg.lr_schedule, cfg.warmup_steps, plan.total_steps)
    model, optimizer, scheduler = prepare(accelerator, model, optimizer, scheduler)
    _probe_task(task, accelerator, model, data, evaluates=eval_loader is not None)
    startup.mark("optimizer_and_prepare")

    # The input is checked. Before anything is written: the folder is created, and ours alone until we exit.
    teardown.callback(claim_output_dir(accelerator, cfg.output_dir).release)
    recorder = RunRecorder(cfg.output_dir, accelerator.is_main_process, accelerator=accelerator)
    teardown.callback(recorder.close)
    if cfg.resume_from_checkpoint:
        _stop_if_finished(cfg, accelerator, plan)

    facts = _run_facts(cfg, accelerator, plan, loaders.kind, loaders.source)
    checkpoints = CheckpointManager(accelerator, cfg.output_dir, cfg.keep_last,
                                    {**facts, "seed": cfg.seed, "optimizer": cfg.optimizer, "model": cfg.model,
                                     **{name: getattr(cfg, name) for name in HYPERPARAMETERS}})
    if cfg.resume_from_checkpoint:  # weights, optimizer, schedule, scaler and every rank's RNG
        with flags_in_force(optimizer, scheduler):  # ... but this run's lr, schedule, decay win (with a warning)
            start_step = checkpoints.resume(cfg.resume_from_checkpoint)
    else:
        checkpoints.check_fresh_start()
        start_step = 0
    resolved = {**cfg.to_dict(), "resolved": facts}
    recorder.start_trackers(cfg.tracker_project_name, resolved, start_step)  # one that cannot start: exit 2 here
    # Only now, with the input checked and the start point agreed, touch what earlier runs left.
    recorder.rewind(start_step)  # metrics past the checkpoint belong to the lost steps
    recorder.write_config(resolved)
    startup.mark("resume_and_config")
    return Run(cfg, accelerator, model, task, optimizer, scheduler, train_loader, eval_loader, plan, facts, recorder,
               checkpoints, preemption, start_step, started, startup, data.tokenizer)


class RunFinished(Exception):  # noqa: N818 - an outcome, not a failure
    """``setup`` found that ``cfg.output_dir`` holds a run that already finished what ``cfg`` asks."""

    def __init__(self, summary: dict[str, Any]):
        super().__init__(f"already finished at step {summary['optimizer_steps']}")
        self.summary = summary


def _stop_if_finished(cfg: TrainConfig, accelerator: Accelerator, plan: Plan) -> None:
    """Raise ``RunFinished`` (every rank) if the run to resume already ended, before any file is touched."""
    summary = main_process_decides(accelerator, lambda: finished_summary(cfg.output_dir, plan.total_steps,
                                                                    cfg.global_batch_size))
    if summary is not None:
        if accelerator.is_main_process:
            print(f"accel_ddp: {cfg.output_dir} already finished at step {summary['optimizer_steps']} "
                  f"(see its {SUMMARY_NAME}); nothing to do", flush=True)
        raise RunFinished(summary)


def prepare(accelerator: Accelerator, model: torch.nn.Module, optimizer, scheduler) -> tuple[Any, Any, Any]:
    """``accelerator.prepare``, without the 1-rank DDP Accelerate gives a CPU model launched as one process.

    Accelerate wraps every ``MULTI_CPU`` model in DistributedDataParallel, one process included (a
    launcher's ``LOCAL_RANK`` makes a CPU run ``MULTI_CPU``; its GPU branch asks for two processes):
    a 1-rank DDP copies each gradient into its buckets and all-reduces it with itself, a fifth of a
    small model's step. Such a run trains the plain model, as ``python train.py`` does (same bits).
    """
    if accelerator.distributed_type == DistributedType.MULTI_CPU and accelerator.num_processes == 1:
        model = accelerator.prepare_model(model, evaluation_mode=True)  # mixed precision and compile, no DDP
        return (model, *accelerator.prepare(optimizer, scheduler))
    return accelerator.prepare(model, optimizer, scheduler)


def _plan(cfg: TrainConfig, steps_in_epoch: int, per_device_batch: int, accumulation: int) -> Plan:
    total_steps = cfg.max_steps or cfg.epochs * steps_in_epoch
    if cfg.debug:
        total_steps = min(total_steps, DEBUG_MAX_STEPS)
    return Plan(per_device_batch, accumulation, steps_in_epoch, total_steps, math.ceil(total_steps / steps_in_epoch))


def _run_facts(cfg: TrainConfig, accelerator: Accelerator, plan: Plan, loader_kind: str,
               data_source: str) -> dict[str, Any]:
    return {
        "world_size": accelerator.num_processes,
        "global_batch_size": cfg.global_batch_size,
        "per_device_batch_size": plan.per_device_batch,
        "grad_accum_steps": plan.accumulation,
        "steps_per_epoch": plan.steps_per_epoch,
        "total_steps": plan.total_steps,
        "distributed_type": str(accelerator.distributed_type.value),
        "mixed_precision": accelerator.mixed_precision,
        "loader": loader_kind,  # device, dataloader or streaming
        "data_source": data_source,  # in_memory, memory_mapped, streaming or map_style
        "device": str(accelerator.device.type),
        "num_machines": int(os.environ.get("ACCELERATE_NUM_MACHINES", os.environ.get("GROUP_WORLD_SIZE", "1"))),
    }


@dataclass
class FitResult:
    step: int  # optimizer steps done
    eval_metrics: dict[str, Any]  # the last evaluation's, empty without an eval set
    timer: EpochTimer  # step times and data-wait share over the run


def fit(run: Run) -> FitResult:
    """The training loop, from ``run.start_step`` to the last optimizer step.

    ``micro_step`` = one forward/backward per rank; ``step`` = one optimizer step over the global batch.
    """
    cfg, accelerator, model, optimizer, scheduler = run.cfg, run.accelerator, run.model, run.optimizer, run.scheduler
    plan, recorder = run.plan, run.recorder
    save_every = 0 if cfg.checkpointing_steps in (None, "epoch") else int(cfg.checkpointing_steps)
    step = run.start_step  # epochs have a fixed number of steps, so the step alone says where we are
    eval_metrics: dict[str, Any] = {}
    losses = LossAccumulator(accelerator, plan.accumulation, cfg.global_batch_size)  # backward, logged mean
    bar = progress_bar(plan.total_steps, step, accelerator.is_local_main_process)
    meter = ThroughputMeter(cfg.global_batch_size, step)  # samples/s between log lines
    timer = EpochTimer(cfg.global_batch_size)  # per-epoch step-time percentiles and data-wait share
    profiler = StepProfiler(cfg.profile, cfg.output_dir, accelerator.process_index)
    update = build_update(accelerator, model, optimizer, cfg.max_grad_norm)  # clip, step, zero_grad
    watch = LossWatch(accelerator, step)  # a nan/inf loss is noticed at the next sync point, named by its first step

    def fail(error: Exception) -> NoReturn:  # the progress bar's line ends first: the error gets a line of its own
        bar.close()
        raise error

    def stop_if_not_finite(step: int) -> None:  # collective; before every save and evaluation, at a bad log line
        if (bad := watch.first_bad_step(step)) is not None:
            fail(NonFiniteLoss(bad, run.checkpoints.last_saved_folder))

    def save(step: int) -> str:  # a nan/inf state is never saved
        stop_if_not_finite(step)
        return run.checkpoints.save(step)

    for epoch in range(step // plan.steps_per_epoch, plan.num_epochs):
        if step >= plan.total_steps:  # resumed from the last step's checkpoint
            break
        model.train()
        # A new permutation each epoch, identical on every rank; a resumed epoch skips what was trained on.
        skip = (step - epoch * plan.steps_per_epoch) * plan.accumulation
        timer.start_epoch()
        for batch in timed(_epoch_batches(run.train_loader, epoch, skip), timer):
            with accelerator.accumulate(model):
                loss = run.task.training_loss(model, batch)  # a mean, or a (sum, num_items) pair
                if cfg.debug and watch.any_rank(loss.value):  # debug syncs per step: stop before a nan backward
                    fail(NonFiniteLoss(step + 1, run.checkpoints.last_saved_folder,
                                       _anomaly(accelerator, model, loss.value)))
                losses.backward(loss)
                if accelerator.sync_gradients:  # the step's last micro-step: gradients are synced
                    losses.finish_step(model)  # (sum, num_items): the gradient of total loss / total items
                    update()  # clip (--max_grad_norm), optimizer step, zero_grad
            if not accelerator.sync_gradients:
                continue
            scheduler.step()  # exactly once per optimizer step
            step += 1
            watch.after_step(losses.running_loss)
            timer.step_done()
            if step == run.start_step + 1:
                run.startup.mark("first_step")
            profiler.step()
            bar.update(1)
            if step % cfg.log_every == 0 or step == plan.total_steps:
                mean_loss = losses.mean_since_log()  # only here do we sync with the host: .item() stalls the GPU
                if not math.isfinite(mean_loss):
                    stop_if_not_finite(step)
                recorder.log({"step": step, "epoch": epoch, "loss": mean_loss, "lr": scheduler.get_last_lr()[0],
                              "samples_per_sec": meter.rate(step)})
                bar.set_postfix(loss=f"{mean_loss:.4f}", refresh=False)  # shown at the bar's next redraw (<= 0.1 s)
            if run.preemption.stop_requested():  # ranks compare flags every ~0.25 s: all stop after the same step
                checkpoint = save(step)
                bar.close()
                raise Preempted(run.preemption.signal_name, step, checkpoint)
            if run.eval_loader is not None and cfg.eval_every and step % cfg.eval_every == 0:
                stop_if_not_finite(step)
                eval_metrics = evaluate_and_log(run, step, epoch)
                meter.reset(step)  # evaluation time is not training throughput
                timer.pause()
            if save_every and step % save_every == 0:
                save(step)
                meter.reset(step)  # nor is checkpointing time
                timer.pause()
            if step >= plan.total_steps:
                break
        recorder.log({"step": step, "epoch": epoch, **timer.end_epoch(), **memory_record(accelerator)})
        if run.eval_loader is not None and not cfg.eval_every:
            stop_if_not_finite(step)
            eval_metrics = evaluate_and_log(run, step, epoch)
        if cfg.checkpointing_steps == "epoch" and step == (epoch + 1) * plan.steps_per_epoch:
            save(step)
        meter.reset(step)  # the next log line's samples/s leaves out this epoch's evaluation and checkpoint
    bar.close()
    profiler.stop()
    stop_if_not_finite(step)  # before finish() exports the weights
    if run.eval_loader is not None and cfg.eval_every and step % cfg.eval_every != 0:
        eval_metrics = evaluate_and_log(run, step, plan.num_epochs - 1)
    return FitResult(step, eval_metrics, timer)


def _anomaly(accelerator: Accelerator, model: torch.nn.Module, loss: torch.Tensor) -> str:
    """--debug: the backward of a nan/inf loss under anomaly detection, without gradient sync, on the ranks that
    have one. We print torch's forward trace of the operation that made it (a warning, which filters could
    hide); every rank gets the error's first line for its message."""
    found = ""
    if not bool(torch.isfinite(loss.detach())):
        with warnings.catch_warnings(record=True) as traces:
            warnings.simplefilter("always")
            try:
                with accelerator.no_sync(model):
                    loss.backward()
            except RuntimeError as err:
                found = f" ({str(err).strip().splitlines()[0]})"
        for trace in traces:
            print(f"accel_ddp: rank {accelerator.process_index}: {trace.message}", file=sys.stderr, flush=True)
    return next((text for text in gather_object([found]) if text), "")  # collective


def finish(run: Run, result: FitResult) -> dict[str, Any]:
    """Export the final weights, write summary.json and curves.png; return the summary."""
    export_weights(run.accelerator, run.model, run.cfg.output_dir)
    export_pretrained(run.accelerator, run.model, run.tokenizer, run.cfg.output_dir)  # Transformers: hf_model/
    timing = result.timer.totals()
    summary = {
        **run.facts,
        "optimizer_steps": result.step,
        "epochs": run.plan.num_epochs,
        "eval_accuracy": result.eval_metrics.get("eval_accuracy"),
        "eval_loss": result.eval_metrics.get("eval_loss"),
        "eval_samples": result.eval_metrics.get("eval_samples", 0),
        **result.eval_metrics,  # and the task's others: eval_perplexity, eval_tokens, user metrics
        "train_samples_per_sec": timing.pop("samples_per_sec", 0.0),
        **timing,  # step_time_p50_ms, step_time_p90_ms, data_wait_share, cpu_ms_per_step over the whole run
        "train_seconds": sum(result.timer.all_steps),
        "elapsed_sec": time.perf_counter() - run.started,
        **_startup_figures(run),
        "lr_scheduler_steps": run.scheduler.scheduler.last_epoch,
        "resumed_from_step": run.start_step,
        **largest(memory_record(run.accelerator)),  # peak_rss_mb, peak_worker_rss_mb: max over ranks (MiB)
    }
    run.recorder.write_summary(summary, result.step)  # and to the trackers
    run.recorder.plot()  # OUTPUT_DIR/curves.png
    if run.accelerator.is_main_process:
        write_model_card(run.cfg.output_dir, run.cfg.to_dict(), summary, launch_command(sys.argv, os.environ))
    return summary


def _startup_figures(run: Run) -> dict[str, Any]:
    """``startup_sec``: worker process start -> first optimizer step, the slowest rank's (collective); and
    ``startup_phases_sec``: this rank's by phase. None where the run did no step or /proc is missing."""
    phases = run.startup.phases()
    mine = run.startup.seconds() if "first_step" in phases else None
    seconds = torch.tensor([-1.0 if mine is None else mine], dtype=torch.float64, device=run.accelerator.device)
    slowest = run.accelerator.gather(seconds)
    return {"startup_sec": None if bool((slowest < 0).any()) else float(slowest.max()),
            "startup_phases_sec": {name: round(sec, 3) for name, sec in phases.items()}}


def _epoch_batches(loader, epoch: int, skip: int) -> Iterable:
    """The batches of ``epoch`` on this rank, without its first ``skip`` (those a checkpoint already holds).

    The one place that fast-forwards a loader. Every loader of ours computes where to start from the
    position alone (no RNG replay) and draws nothing from torch's global generator, so the resumed
    run's dropout stream continues exactly where the checkpoint's RNG state left it.
    """
    loader.set_epoch(epoch)
    return loader if skip == 0 else loader.skip_first_batches(skip)


def evaluate_and_log(run: Run, step: int, epoch: int) -> dict[str, Any]:
    """Evaluate on every rank, log the metrics (main process) and return them."""
    # Evaluation must not move the training RNG stream (its loader draws a seed): a resumed run skips
    # the evaluations that came before its checkpoint and must still replay the same dropout masks.
    with torch.random.fork_rng(devices=[]):
        metrics = evaluate(run.accelerator, run.model, run.eval_loader, run.task)
    run.recorder.log({"step": step, "epoch": epoch, **metrics})
    if run.accelerator.is_main_process:
        shown = " ".join(f"{k} {v:.4f}" for k, v in metrics.items() if isinstance(v, float))
        tqdm.write(f"step {step} epoch {epoch}: {shown} ({metrics['eval_samples']} samples)")
    return metrics


def main(argv: list[str] | None = None) -> int:
    """CLI entry point: bad input is one line on stderr per launch (``accel_ddp.failure``) and exit code 2.

    Preemption (SIGTERM or SIGUSR1) saves a checkpoint and exits with ``EXIT_PREEMPTED`` (75); the
    exit codes are listed in ``accel_ddp/preemption.py``.
    """
    try:
        train(parse_args(argv))
    except (ConfigError, LaunchError) as err:
        failure.report_bad_input(err)
        return 2
    except NonFiniteLoss as err:
        failure.report_bad_input(err)  # one line per launch, like bad input: it is no bug of ours
        return EXIT_NON_FINITE
    except Preempted as stop:
        ignore_preemption_signals()  # exiting with 75: the launcher's follow-up SIGTERM must not make it a kill
        if os.environ.get("RANK", "0") == "0":
            print(f"accel_ddp: preempted: {stop} (exit code {EXIT_PREEMPTED})", file=sys.stderr, flush=True)
        return EXIT_PREEMPTED
    return 0


def run(argv: list[str] | None = None) -> NoReturn:
    """The script entry point (``python train.py``, ``accel-ddp train``): ``main()``, then exit.

    An unexpected exception is printed as Python would (and goes into the launcher's failure
    summary with its rank) and exits 1. The exit goes through ``exit_process`` so that a
    successful run cannot abort during interpreter teardown.
    """
    try:
        code = main(argv)
    except Exception as err:  # noqa: BLE001 - reported like an uncaught exception, then the same safe exit
        failure.report_unexpected(err)
        code = 1
    exit_process(code)


if __name__ == "__main__":
    run()
