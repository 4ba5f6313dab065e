"""A run assembled: ``setup()`` joins the process group, builds the data, the model (its micro-batch probed with
``--per_device_batch_size auto``), the loaders, optimizer and schedule, claims the output folder and agrees, on every
rank, where the run starts; what it returns (``Run``) is everything ``loop.fit`` needs.

A preemption signal during start-up stops every rank together at the end of the phase it came in.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from datetime import timedelta
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
from accelerate import Accelerator, PartialState
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.scheduler import AcceleratedScheduler
from accelerate.utils import set_seed
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

from accel_ddp.auto_batch import AutoBatchOptions, choose_micro_batch
from accel_ddp.bad_steps import BadStepOptions, BadSteps
from accel_ddp.callbacks import Callbacks
from accel_ddp.checkpoint.best import BestModel, BestModelOptions, check_eval_set
from accel_ddp.checkpoint.manager import HYPERPARAMETERS, CheckpointManager
from accel_ddp.checkpoint.start import StartOptions, agree_start
from accel_ddp.checkpoint.storage import check_store
from accel_ddp.checkpoint.train_state import Stateful, TrainState
from accel_ddp.config import TrainConfig
from accel_ddp.config.debug import debug_mode
from accel_ddp.config.plan import Plan, plan_run
from accel_ddp.config.views import section_of
from accel_ddp.data import DeviceEvalLoader, DeviceLoader, HostLoader, StreamingLoader, build_loaders, usable_cpus
from accel_ddp.data.resolve import DataOptions, resolve_data
from accel_ddp.distributed.preflight import check_fsdp, check_shared_output_dir
from accel_ddp.distributed.world import WorldOptions, build_accelerator, end_world, prepare
from accel_ddp.lifecycle import failure
from accel_ddp.lifecycle.failure import main_process_decides
from accel_ddp.lifecycle.hang import HangWatch, pauses_after
from accel_ddp.lifecycle.preemption import (
    Preempted,
    PreemptionWatcher,
    restart_hazard,
)
from accel_ddp.models import ModelOptions, build_configured_model, set_attn_implementation
from accel_ddp.optim.user import OptimizerOptions, build_optimization, check_optimization
from accel_ddp.outputs.run_dir import (
    check_output_dir,
    claim_output_dir,
)
from accel_ddp.step.graph import CudaGraphs, construction_stream, refuse_graphs
from accel_ddp.step.train_step import TrainStep
from accel_ddp.tasks.chunked_loss import CHUNKED_LOSS
from accel_ddp.tasks.probe import probe_task
from accel_ddp.tasks.protocol import CHANNELS_LAST, Task, build_task
from accel_ddp.tracking.console_log import ConsoleLog
from accel_ddp.tracking.meters import end_progress, progress_bar
from accel_ddp.tracking.recorder import RunRecorder
from accel_ddp.tracking.startup import StartupClock
from accel_ddp.tracking.startup_block import StartupOptions, describe_run
from accel_ddp.tracking.trackers import tracking_kwargs
from accel_ddp.transforms.finetune import GRADIENT_CHECKPOINTING, INIT_FROM, PEFT, describe_parameters, finetune_facts
from accel_ddp.transforms.fused_activations import FUSED_KERNELS
from accel_ddp.transforms.regional_compile import COMPILE_REGIONS, slower_here
from accel_ddp.util.converters import ModelBuild, convert_model
from accel_ddp.util.messages import warn
from accel_ddp.util.ranks import launch_machines
from accel_ddp.util.registry import resolve
from accel_ddp.util.validation import ConfigError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase  # imported by text tasks only


# The model's transforms, one ordered list (util/converters.py), each in the module that owns its feature; the
# training-only ones last: a trained run rebuilt for evaluation (inference.py) stops before them. Before DDP wraps
# the model, in this order: --init_from, --gradient_checkpointing, --peft, the task's layout (--channels_last),
# --fused_kernels, --compile_regions, --chunked_loss (--compile is Accelerate's, at prepare: distributed/world.py).
MODEL_CONVERTERS = (INIT_FROM, GRADIENT_CHECKPOINTING, PEFT, CHANNELS_LAST, FUSED_KERNELS, COMPILE_REGIONS,
                    CHUNKED_LOSS)


TrainLoader = DeviceLoader | HostLoader | StreamingLoader  # batches on the device, in the global-batch order
EvalLoader = DataLoader | DeviceEvalLoader  # a prepared DataLoader (gather_for_metrics), or sliced on the device


@dataclass(kw_only=True)
class Run:
    """Everything ``fit`` and ``finish`` need, built by ``setup``, each part complete. Collective objects are on every
    rank. ``start_step`` is the one field that changes: a rollback (``--on_anomaly rollback``) moves it back."""

    cfg: TrainConfig
    accelerator: Accelerator
    model: torch.nn.Module  # wrapped by accelerator.prepare (DDP, FSDP or as is)
    task: Task  # how batches reach the model, the loss, the eval metrics
    optimizer: AcceleratedOptimizer
    scheduler: AcceleratedScheduler
    train_loader: TrainLoader
    eval_loader: EvalLoader | None  # None when there is no eval set
    plan: Plan
    facts: dict[str, Any]  # world size, batch layout, loader... : config.yaml, checkpoints and summary.json
    recorder: RunRecorder
    checkpoints: CheckpointManager  # saves and restores the run's TrainState (checkpoint/train_state.py) as one
    preemption: PreemptionWatcher
    start_step: int  # 0, or the optimizer step of the checkpoint resumed from
    started: float  # time.perf_counter() when train() began
    startup: StartupClock  # process start -> first optimizer step, by phase (summary.json's startup_sec)
    tokenizer: PreTrainedTokenizerBase | None  # text tasks: saved beside a Transformers model's final weights
    bar: tqdm  # the progress bar: closed by the teardown, so an error never shares its line
    bad_steps: BadSteps  # nan/inf losses, --on_anomaly, --spike_factor: found, acted on, recorded (bad_steps/)
    hang: HangWatch  # --hang_timeout: after_step tells it of every step (lifecycle/hang.py; off: no thread)
    callbacks: Callbacks = field(default_factory=Callbacks)  # --callbacks, train(callbacks=): none by default


def setup(cfg: TrainConfig, teardown: ExitStack, model=None, train_dataset=None, eval_dataset=None, *,
          loss_fn=None, metrics=(), collate_fn=None, preemption: PreemptionWatcher | None = None,
          optimizer=None, lr_scheduler=None, callbacks=None, console: ConsoleLog | None = None) -> Run:
    """Join the process group, build data, model, optimizer and schedule, and agree on where to start.

    ``optimizer`` and ``lr_scheduler``: the Python API's own (accel_ddp/optim/user.py), else the flags'.

    A preemption signal during start-up stops every rank together at the end of the phase it came in
    (``Preempted`` with nothing saved): the ranks compare their flags there. ``console``: what the main process
    prints, for run.log (None: teed from here to the end of ``train()``; the CLI's outlives it, for the last line).
    """
    started = time.perf_counter()
    console, preemption = _console_and_signals(teardown, console, preemption)
    startup = StartupClock()  # "imports": interpreter start, imports and option parsing, up to here

    def phase_done(name: str) -> None:  # collective: every rank stops here if any got a signal
        startup.mark(name)
        preemption.check_start_up(name)

    accelerator, per_device_batch, accumulation = _join(cfg, teardown, preemption)
    check_optimization(section_of(cfg, OptimizerOptions), model, optimizer, lr_scheduler)  # a bad one: before data
    phase_done("process_group")

    task, hooks, data = _task_and_data(cfg, accelerator, (loss_fn, metrics, callbacks),
                                       (train_dataset, eval_dataset, collate_fn), preemption)
    phase_done("data")
    model, named, tuned = _model(cfg, accelerator, model, data, task)
    # --per_device_batch_size auto: the largest micro-batch that fits on every rank, before DDP wraps the model
    chosen = choose_micro_batch(section_of(cfg, AutoBatchOptions), section_of(cfg, StartOptions), accelerator, model,
                                task, data) if cfg.auto_batch else None
    if chosen is not None:
        per_device_batch, accumulation = chosen.size, chosen.accumulation
    phase_done("model")

    loaders, plan = _loaders_and_plan(cfg, accelerator, data, per_device_batch, accumulation, chosen)
    phase_done("loaders")

    model, optimizer, scheduler, optimization = _optimize_and_prepare(cfg, accelerator, model, plan, loaders.kind,
                                                                      (optimizer, lr_scheduler))
    probe_task(task, accelerator, model, data, evaluates=loaders.eval is not None, loaders=loaders,
               skips_bad_inputs=cfg.on_anomaly != "stop")  # then a nan/inf input is its step's anomaly
    phase_done("optimizer_and_prepare")

    recorder, facts, bad_steps, checkpoints = _records_and_checkpoints(
        cfg, accelerator, teardown, plan, loaders, {**tuned, "optimizer": optimization.name},
        (model, optimizer, scheduler), preemption, console)
    block = describe_run(section_of(cfg, StartupOptions), facts, plan.num_epochs, loaders.train, named, data,
                         optimization.lines, usable_cpus(), warmup=cfg.warmup_for(plan.total_steps),
                         global_batch_derived=cfg.global_batch_derived, counts_tokens=task.counts_tokens)
    start_step = agree_start(section_of(cfg, StartOptions), accelerator, checkpoints,
                             (optimizer, scheduler, optimization.schedule_from_flags), plan.total_steps, recorder,
                             {**cfg.to_dict(), "resolved": facts}, block, preemption)
    bad_steps.begin(start_step, checkpoints, loaders.train)  # a resumed run's anomaly log continues, else forgotten
    phase_done("resume_and_config")
    bar, hang = _watches(cfg, teardown, accelerator, plan, start_step)
    return Run(cfg=cfg, accelerator=accelerator, model=model, task=task, optimizer=optimizer, scheduler=scheduler,
               train_loader=loaders.train, eval_loader=loaders.eval, plan=plan, facts=facts, recorder=recorder,
               checkpoints=checkpoints, preemption=preemption, start_step=start_step, started=started,
               startup=startup, tokenizer=data.tokenizer, bar=bar, bad_steps=bad_steps, hang=hang,
               callbacks=hooks.connect(accelerator, preemption.group, plan, evaluates=loaders.eval is not None))


def _console_and_signals(teardown: ExitStack, console: ConsoleLog | None,
                         preemption: PreemptionWatcher | None) -> tuple[ConsoleLog, PreemptionWatcher]:
    """What the main process prints, teed for run.log (the caller's, else one until the teardown), and the
    preemption watch: from now on a SIGTERM means "stop, saving what was trained"; under torchrun a lost launcher
    means the same."""
    if console is None:
        console = ConsoleLog().install()
        teardown.callback(console.close)
    preemption = PreemptionWatcher().install() if preemption is None else preemption
    teardown.callback(preemption.uninstall)
    preemption.watch_launcher()
    return console, preemption


def _task_and_data(cfg: TrainConfig, accelerator: Accelerator, user: tuple, given: tuple,
                   preemption: PreemptionWatcher) -> tuple[Task, Callbacks, Any]:
    """The task (the caller's loss and metrics), the callbacks, and the data sets (``data/resolve.py``), checked.
    ``user``: (loss_fn, metrics, callbacks); ``given``: the caller's (train_dataset, eval_dataset, collate_fn)."""
    loss_fn, metrics, callbacks = user
    if slower := slower_here(accelerator.device.type, compile=cfg.compile, compile_regions=cfg.compile_regions):
        warn(slower, ranks="main")  # off by default here; asked for, it runs, and says what was measured
    if debug_mode(cfg).detect_anomaly:
        torch.autograd.set_detect_anomaly(True)
    if debug_mode(cfg).deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)
    set_seed(cfg.seed)  # same model init on every rank; DDP also broadcasts rank 0's weights
    task = configured_task(cfg, loss_fn, metrics)
    hooks = Callbacks.build(cfg.callbacks, callbacks)  # imported, made and checked before any data is read
    data = resolve_data(section_of(cfg, DataOptions), accelerator, *given, preemption=preemption)
    check_eval_set(section_of(cfg, BestModelOptions), has_eval=data.eval is not None)
    return task, hooks, data


def _model(cfg: TrainConfig, accelerator: Accelerator, model, data, task: Task) -> tuple[torch.nn.Module, str,
                                                                                          dict[str, Any]]:
    """The run's model through every converter (``MODEL_CONVERTERS``), checked to have something to train; its
    start-up description, and its fine-tuning facts (``finetune_facts``)."""
    source = f"--model_config {cfg.model_config}" if cfg.model_config else f"--model {cfg.model}"
    named = f" ({source})" if model is None else ""  # --model_config wins over --model (models.py)
    model = build_run_model(cfg, accelerator, model, data, task)
    if not any(p.requires_grad for p in model.parameters()):  # else DDP's RuntimeError, or an optimizer of nothing
        raise ConfigError(f"the model {type(model).__name__}{named} has no trainable parameters, so there is nothing "
                          "to train; give a model with parameters (nn.Parameter, or layers such as nn.Linear) that "
                          "require gradients")
    named = f"{type(model).__name__}{named}, {describe_parameters(model)}"  # trainable of total where some are frozen
    tuned = finetune_facts(model)  # a frozen base: the parameter counts and its fingerprint (checkpoints, summary)
    model, lines = convert_model(model, ModelBuild(accelerator, task),
                                 (c for c in MODEL_CONVERTERS if c.training_only), partial(section_of, cfg))
    return model, "".join([named, *(f", {line}" for line in lines)]), tuned


def _loaders_and_plan(cfg: TrainConfig, accelerator: Accelerator, data, per_device_batch: int, accumulation: int,
                      chosen) -> tuple[Any, Plan]:
    """The device loader where the data fits (--loader), else a DataLoader over the same order, or a stream; and
    what an optimizer step means for this run."""
    loaders = build_loaders(
        accelerator, data.train, data.eval, per_device_batch_size=per_device_batch,
        global_batch_size=cfg.global_batch_size, eval_batch_size=cfg.eval_batch_size, loader=cfg.loader,
        num_workers=debug_mode(cfg).workers(cfg.num_workers), device_loader_max_mb=cfg.device_loader_max_mb,
        collate_fn=data.collate_fn, max_steps=cfg.max_steps,
        memory_limit=data.memory_limit,  # the machine's budget (data/memory_budget.py): device memory left for data
    )
    plan = plan_run(cfg, loaders.steps_per_epoch, per_device_batch, accumulation, evaluates=loaders.eval is not None,
                 auto_batch=chosen.facts() if chosen is not None else None)
    return loaders, plan


def _optimize_and_prepare(cfg: TrainConfig, accelerator: Accelerator, model: torch.nn.Module, plan: Plan,
                          loader_kind: str, given: tuple) -> tuple[torch.nn.Module, AcceleratedOptimizer,
                                                                   AcceleratedScheduler, Any]:
    """The optimizer and schedule (the caller's ``given`` (optimizer, lr_scheduler), else the flags'), and the model,
    optimizer and schedule through ``accelerator.prepare`` (DDP, FSDP); the optimization's description too."""
    if cfg.cuda_graphs:  # what only the launch and the loaders tell (the options' clashes: config/checks.py)
        refuse_graphs(accelerator, plan.accumulation, loader_kind, packing=cfg.packing)
    # --warmup_ratio (issue 22): a fraction of this run's total steps, so resolved here, once the total is known
    warmup = cfg.warmup_for(plan.total_steps)
    optimization = build_optimization(section_of(cfg, OptimizerOptions), model, accelerator, plan.total_steps, warmup,
                                      *given)
    if warmup > plan.total_steps:  # still a run (a smoke test, a short resume), but not the schedule asked for
        warn(f"--warmup_steps {warmup} is longer than this run's {plan.total_steps} optimizer steps: the learning rate "
             f"never reaches --lr {cfg.lr:g} (at most {cfg.lr * plan.total_steps / warmup:.3g}); lower --warmup_steps "
             "or train longer", ranks="main")
    optimizer, scheduler = optimization.optimizer, optimization.scheduler
    with construction_stream(cfg.cuda_graphs):  # DDP built on a side stream before a whole-step capture
        model, optimizer, scheduler = prepare(accelerator, model, optimizer, scheduler)
    return model, optimizer, scheduler, optimization


def _watches(cfg: TrainConfig, teardown: ExitStack, accelerator: Accelerator, plan: Plan,
             start_step: int) -> tuple[tqdm, HangWatch]:
    """The repeated flags' warnings, then the progress bar and the hang watch, each closed by the teardown."""
    for line in cfg.repeated_flags:  # the command line's flags given twice (cli/args.py)
        warn(line, ranks="main")
    bar = progress_bar(plan.total_steps, start_step, accelerator.is_local_main_process)
    teardown.callback(end_progress, bar)  # first on an error: the bar's line ends before any rank prints the error
    hang = HangWatch.start(cfg.hang_seconds(), cfg.output_dir, start_step, pauses_after=pauses_after(plan))
    teardown.callback(hang.stop)  # before the failure's claim: a watch that found a hang ends the process itself
    return bar, hang


def _records_and_checkpoints(cfg: TrainConfig, accelerator: Accelerator, teardown: ExitStack, plan: Plan, loaders,
                             more_facts: dict[str, Any], prepared: tuple, preemption: PreemptionWatcher,
                             console: ConsoleLog) -> tuple[
                                 RunRecorder, dict[str, Any], BadSteps, CheckpointManager]:
    """The output folder claimed, the run's recorder, facts and bad steps' room, and its checkpoints of the run's
    ``TrainState`` (``prepared``: the model, optimizer and schedule as ``accelerator.prepare`` returned them)."""
    model, optimizer, scheduler = prepared
    # The input is checked. Before anything is written: the folder is created, and ours alone until we exit.
    teardown.callback(claim_output_dir(accelerator, cfg.output_dir).release)
    recorder = RunRecorder(cfg.output_dir, accelerator.is_main_process, accelerator=accelerator, console=console)
    teardown.callback(recorder.close)
    # more_facts: the fine-tuning facts, and a user's optimizer by its class (a resume must give the same)
    facts = {**_run_facts(cfg, accelerator, plan, loaders.kind, loaders.source), **more_facts}
    bad_steps = BadSteps(section_of(cfg, BadStepOptions), accelerator, model, recorder)
    state = TrainState(accelerator=accelerator, model=model, optimizer=optimizer, scheduler=scheduler,
                       # the best model and early stopping (checkpoint/best.py): their records go with each checkpoint
                       best=BestModel.from_options(section_of(cfg, BestModelOptions), plan.steps_per_epoch,
                                                   plan.total_steps),
                       anomalies=bad_steps.guard,  # --on_anomaly, --spike_factor: the anomaly log (None: no guard)
                       positions=loaders.train if isinstance(loaders.train, Stateful) else None)
    checkpoints = _checkpoints(cfg, accelerator, teardown, facts, state)
    checkpoints.store.stopping = lambda: preemption.signalled  # a store call under way gives up soon after a signal
    return recorder, facts, bad_steps, checkpoints


def build_train_step(run: Run, start_step: int) -> TrainStep:
    """The run's optimizer step (``fit`` builds it, again after a rollback) from ``start_step`` on, given the bad steps'
    hooks: the guard's decision in its update, --debug's check of each micro-step's loss (accel_ddp/bad_steps/)."""
    cfg = run.cfg
    return TrainStep(run.accelerator, run.model, run.task, run.optimizer, run.scheduler, run.plan.accumulation,
                     cfg.global_batch_size, cfg.max_grad_norm, start_step, check_loss=run.bad_steps.check_loss,
                     guard=run.bad_steps.step_guard, per_device_batch=run.plan.per_device_batch,
                     graphs=CudaGraphs() if cfg.cuda_graphs else None)  # --cuda_graphs: checked in setup


def _checkpoints(cfg: TrainConfig, accelerator: Accelerator, teardown: ExitStack, facts: dict[str, Any],
                 state: TrainState) -> CheckpointManager:
    """Where checkpoints go (the output folder or --checkpoint_dir's store, claimed), what they hold (``state``)
    and, with --async_checkpointing, their writer thread."""
    checkpoints = CheckpointManager(accelerator, cfg.output_dir, cfg.keep_last,
                                    {**facts, "seed": cfg.seed, "model": cfg.model,
                                     **{name: getattr(cfg, name) for name in HYPERPARAMETERS}},
                                    state=state, checkpoint_dir=cfg.checkpoint_dir, store_timeout=cfg.store_timeout,
                                    async_timeout=cfg.ddp_timeout if cfg.async_checkpointing else None)
    teardown.callback(checkpoints.remove_hooks)
    checkpoints.claim_store(cfg.output_dir)  # --checkpoint_dir: one run per prefix, like the output folder's lock
    teardown.callback(checkpoints.release_store)
    return checkpoints


def _join(cfg: TrainConfig, teardown: ExitStack, preemption: PreemptionWatcher) -> tuple[Accelerator, int, int]:
    """The process group and the Accelerator (with the run's batch layout), checked before any data is touched."""
    def trackers(state) -> dict[str, Any]:  # --with_tracking: a missing package stops every rank here, before data
        kwargs = tracking_kwargs(state, cfg.report_to, cfg.output_dir, cfg.tracker_project_name, cfg.run_name)
        cfg.check_tracker_wait(len(kwargs["log_with"]))  # every rank: the same names; `all` is known only now
        return kwargs

    accelerator, per_device_batch, accumulation = build_world(cfg, trackers if cfg.with_tracking else None)
    teardown.push(lambda kind, err, tb: failure.outlive_readers(err))  # after the group ends: the peers then claim
    teardown.push(lambda kind, err, tb: end_world(accelerator, failed=err is not None))  # train() again, later
    preemption.connect(accelerator, timedelta(seconds=cfg.ddp_timeout))  # its all-reduce waits --ddp_timeout at most
    teardown.push(claim_failure)  # before the group goes: the ranks it then stops know that they are not first
    main_process_decides(accelerator, lambda: check_output_dir(cfg.output_dir))  # a bad folder: now, not after data
    if cfg.checkpoint_dir:  # a store that cannot even be opened (no account, bad settings): now too, one line
        main_process_decides(accelerator, lambda: check_store(cfg.checkpoint_dir))
    check_shared_output_dir(accelerator, cfg.output_dir)  # several machines: one folder for all of them
    if accelerator.is_main_process and (hazard := restart_hazard()):
        warn(hazard)
    return accelerator, per_device_batch, accumulation


def build_world(cfg: TrainConfig, trackers: Callable[[PartialState], dict[str, Any]] | None = None
                ) -> tuple[Accelerator, int, int]:
    """The process group and the Accelerator (distributed/world.py) with ``cfg``'s batch layout for its size,
    resolved in ``cfg``: (accelerator, per-device batch, accumulation). ``setup`` and ``inference`` join here."""
    return build_accelerator(section_of(cfg, WorldOptions), cfg.batch_layout, cfg.hang_seconds(), trackers)


def configured_task(cfg: TrainConfig, loss_fn=None, metrics=()) -> Task:
    """``--task`` with the caller's loss (else ``--loss``'s) and metrics, batches in ``--channels_last``'s layout."""
    memory_format = torch.channels_last if cfg.channels_last else torch.contiguous_format
    return build_task(cfg.task, loss_fn or (resolve(cfg.loss, {}, kind="loss") if cfg.loss else None), metrics,
                      memory_format)


def build_run_model(cfg: TrainConfig, accelerator: Accelerator, model, data, task: Task) -> torch.nn.Module:
    """The caller's model or the configured one, checked for FSDP2, through the converters that a trained run's
    model needs too (``--init_from``'s weights, ``transforms/finetune.py``'s, ``task``'s layout: ``MODEL_CONVERTERS``).
    ``setup`` and a trained run's evaluation (``inference.py``) build it here."""
    if model is None:
        model = build_configured_model(section_of(cfg, ModelOptions), data)
    elif cfg.attn_implementation is not None:
        set_attn_implementation(model, cfg.attn_implementation)
    if accelerator.is_fsdp2:  # before anything is built on it: what FSDP2 cannot shard or cast
        check_fsdp(model, channels_last=cfg.channels_last, mixed_precision=accelerator.mixed_precision)
    model, _ = convert_model(model, ModelBuild(accelerator, task),
                             (c for c in MODEL_CONVERTERS if not c.training_only), partial(section_of, cfg))
    return model


def _run_facts(cfg: TrainConfig, accelerator: Accelerator, plan: Plan, loader_kind: str,
               data_source: str) -> dict[str, Any]:
    return {
        "world_size": accelerator.num_processes,
        "global_batch_size": cfg.global_batch_size,
        "per_device_batch_size": plan.per_device_batch,
        "grad_accum_steps": plan.accumulation,
        **({"auto_batch": plan.auto_batch} if plan.auto_batch else {}),  # the size was found by the probe, or reused
        "steps_per_epoch": plan.steps_per_epoch,
        "total_steps": plan.total_steps,
        "distributed_type": str(accelerator.distributed_type.value),
        "mixed_precision": accelerator.mixed_precision,
        "loader": loader_kind,  # device, dataloader or streaming
        "data_source": data_source,  # in_memory, memory_mapped, streaming or map_style
        "device": str(accelerator.device.type),
        "num_machines": launch_machines(),
    }


def claim_failure(kind, err, tb) -> None:
    """The teardown of ``train()`` and ``inference``, on an error: claim it (``failure.claim``) while the process group
    still stands."""
    if isinstance(err, Exception) and not isinstance(err, Preempted):
        named = failure.peer_named(err, failure.claim(err, failure.exit_code(err)))
        if named is not err:  # a peer's failure seen as a lost connection: the peer and its error, not gloo's words
            raise named from None
