"""The world of processes a run trains in: checked against the launch, joined, and the model wrapped for it.

    accelerator, per_device, accumulation = build_accelerator(options, batch_layout, hang_seconds)  # the group formed
    model, optimizer, scheduler = prepare(accelerator, model, optimizer, scheduler)

A launch that started fewer processes than its config asked for (Accelerate's simple launcher)
is a ``LaunchError``, never a quiet single-process run.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
from accelerate import Accelerator, DataLoaderConfiguration, PartialState
from accelerate.utils import DDPCommunicationHookType, DistributedDataParallelKwargs, DistributedType

from accel_ddp.config.debug import debug_mode
from accel_ddp.config.views import config_section
from accel_ddp.distributed.preflight import build_fsdp_plugin, check_launch_devices
from accel_ddp.lifecycle.hang import flight_recorder_env
from accel_ddp.lifecycle.peers import group_forming
from accel_ddp.util.host_memory import keep_freed_host_memory
from accel_ddp.util.messages import note
from accel_ddp.util.ranks import WORLD_SIZE_VARS, launch_world_size
from accel_ddp.util.validation import ConfigError, LaunchError


def single_process_trap(env=os.environ) -> str | None:
    """Why this lone process is not the world its launch config asked for, or None.

    Accelerate's simple launcher (``distributed_type: MULTI_CPU`` without mpirun, ``NO``, or
    ``--cpu``) starts ONE process whatever ``num_processes`` says, and it marks it: it always sets
    ``ACCELERATE_USE_CPU``, and ``MASTER_ADDR``/``MASTER_PORT`` only when the config asked for more
    than one process or machine; no world size, since neither torchrun nor mpirun started it
    (accelerate/utils/launch.py, ``prepare_simple_launcher_cmd_env``; huggingface/accelerate#2741).
    The process cannot know how many were meant, so it cannot train on them: it refuses.
    """
    simple_launcher = "ACCELERATE_USE_CPU" in env and not any(name in env for name in WORLD_SIZE_VARS)
    if not (simple_launcher and "MASTER_ADDR" in env and "MASTER_PORT" in env):
        return None
    return ("accelerate launch started 1 process, but its config asks for several (distributed_type MULTI_CPU "
            "without mpirun, NO, or --cpu start just one); use distributed_type: MULTI_GPU, which trains on CPU over "
            "gloo when there is no GPU (answer multi-GPU in `accelerate config`, or launch with --config_file "
            "accelerate_configs/cpu_2proc.yaml); for one process, num_processes: 1 and no MASTER_ADDR set")


def end_world(accelerator: Accelerator, failed: bool = False) -> None:
    """``train()``'s teardown: the trackers finished and the process group destroyed (``end_training``), in an order
    that lets a second ``train()`` in the same process (a sweep, a notebook) form its group again. ``failed``: the
    run raised (no barrier then: a rank may be gone).

    Over ``env://`` rank 0's process hosts the group's store at MASTER_PORT (torch/distributed/rendezvous.py
    ``_create_c10d_store``): a rank that left first and formed its next group could join rank 0's old store, whose
    keys are the last group's, and wait there for an address that is gone. So the other ranks return only once that
    store has closed (:func:`_old_store`, :func:`_wait_closed`). Accelerate's state is left as it is, for the
    caller's ``PartialState().is_main_process`` after ``train()``; the next run forgets it
    (:func:`forget_ended_world`).
    """
    old_store = None
    if not failed and accelerator.num_processes > 1:
        old_store = _old_store(accelerator.process_index)  # connected before the barrier: rank 0's store of this run
        accelerator.wait_for_everyone()
    accelerator.end_training()
    if old_store is not None:
        _wait_closed(old_store, STORE_CLOSE_WAIT_S)


STORE_CLOSE_WAIT_S = 10.0  # how long another rank waits for rank 0's store to close as its train() returns


def _old_store(rank: int) -> socket.socket | None:
    """A plain connection to the store rank 0 hosts for this group (env://, not torchrun's agent store), or None."""
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT", "")
    if rank == 0 or not addr or not port.isdigit() or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return None
    try:
        return socket.create_connection((addr, int(port)), timeout=1.0)
    except OSError:
        return None


def _wait_closed(connection: socket.socket, seconds: float) -> None:
    """Until the server closes ``connection`` (its process dropped the store), ``seconds`` at most."""
    with connection:
        connection.settimeout(seconds)
        with contextlib.suppress(OSError):  # a timeout, or a reset: either way no longer ours to wait for
            connection.recv(1)


def import_dynamo_before_the_group() -> None:
    """Import ``torch._dynamo`` before the process group forms, so that ``end_training`` really ends the group.

    Imported while a group exists (the first optimizer step imports it: torch.optim's ``add_param_group``), it keeps
    that group alive after ``destroy_process_group`` (measured, torch 2.14: gloo's worker threads still run after
    ``end_training`` and a collection; imported first, they are gone). A group left to the interpreter's exit is
    destroyed during finalization, where gloo's threads may need the GIL that Python 3.11-3.13 no longer gives:
    ``terminate called without an active exception``, SIGABRT, after a run that succeeded (issue 40: about 1 in 4
    two-rank scripts that ended without ``exit_process``). It costs nothing: the run imports it anyway.
    """
    import torch._dynamo  # noqa: F401


@config_section
@dataclass(frozen=True)
class WorldOptions:
    """The options of forming the world: precision, the group's timeout, the process-wide switches and DDP's."""

    debug: bool  # Accelerate's cross-rank shape checks
    mixed_precision: str | None
    tf32: bool
    compile: bool  # Accelerate's dynamo backend, applied at prepare
    seed: int  # the seedable sampler's data seed
    ddp_timeout: int
    output_dir: str  # where NCCL's flight recorder dumps a hang
    ddp_bucket_cap_mb: int
    ddp_gradient_as_bucket_view: bool
    ddp_static_graph: bool
    ddp_find_unused_parameters: bool
    ddp_comm_hook: str


def build_accelerator(options: WorldOptions, batch_layout: Callable[[int], tuple[int, int]], hang_seconds: float,
                      trackers: Callable[[PartialState], dict[str, Any]] | None = None
                      ) -> tuple[Accelerator, int, int]:
    """Join the process group and derive (per-device batch, accumulation) from the world size.

    ``batch_layout(world_size)``: the run's layout for that many ranks (the config's ``batch_layout``, which resolves
    the config's batch in place); ``hang_seconds``: --hang_timeout resolved (0: off), which switches NCCL's flight
    recorder on. ``trackers(state)``: the ``Accelerator`` keyword arguments of the run's trackers, once the group
    exists (the loop passes ``tracking.trackers.tracking_kwargs``: forming the world knows no trackers).

    Without a GPU we must ask for CPU ourselves: Accelerate only forms a gloo group for a
    torchrun launch when the script requests CPU; otherwise it would start N lone processes.
    """
    if debug_mode(options).accelerate_checks:
        os.environ["ACCELERATE_DEBUG_MODE"] = "1"  # cross-rank shape checks on every collective
    import_dynamo_before_the_group()
    cpu = not torch.cuda.is_available()
    if options.mixed_precision is not None:  # issue 22: --mixed_precision wins over the launch config (a note says so)
        override_mixed_precision(options.mixed_precision, cpu)
    if cpu and os.environ.get("ACCELERATE_MIXED_PRECISION") == "fp8":  # else Accelerate's ValueError, per rank
        raise ConfigError("the launch config's mixed_precision fp8 needs a GPU with FP8 support (NVIDIA Ada or Hopper "
                          "and later) and none is usable here; launch with --mixed_precision no (or bf16) on CPU")
    check_launch_devices(cuda_available=not cpu)  # one process per GPU; GPUs this torch cannot use
    if cpu:  # the step's freed tensors reused, not faulted in again each step (util/host_memory.py)
        keep_freed_host_memory()
    if not cpu and options.tf32:  # TF32 tensor cores for fp32 matmuls/convs: ~8x on Ampere+, 10-bit mantissa
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    if problem := single_process_trap():
        raise LaunchError(problem)
    if not cpu:  # NCCL's flight recorder, read as the process group forms: on with --hang_timeout
        flight_recorder_env(options.output_dir, hang_seconds)
    forget_ended_world()  # a second run in this process (train, then evaluate): the group formed again
    with group_forming():  # its sockets: what a failing train() shuts to end its peers' collectives (failure.py)
        state = PartialState(cpu=cpu, timeout=timedelta(seconds=options.ddp_timeout))
    launched_world = launch_world_size()
    if state.num_processes != launched_world:
        raise LaunchError(
            f"the launcher started {launched_world} processes but they formed a group of "
            f"{state.num_processes}; launch with an accelerate config of distributed_type MULTI_GPU "
            "(see accelerate_configs/README.md), not MULTI_CPU without mpirun"
        )
    per_device, accumulation = batch_layout(state.num_processes)
    accelerator = Accelerator(
        cpu=cpu,
        gradient_accumulation_steps=accumulation,
        # Accelerate would otherwise step the schedule num_processes times per optimizer step.
        step_scheduler_with_optimizer=False,
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=options.seed,
                                                  non_blocking=not cpu),
        kwargs_handlers=[ddp_kwargs(options)],
        dynamo_backend="inductor" if options.compile else None,
        fsdp_plugin=build_fsdp_plugin(cuda_available=not cpu),  # FSDP2 launches: gradients reduced in fp32
        **(trackers(state) if trackers is not None else {}),
    )
    return accelerator, per_device, accumulation


def forget_ended_world() -> None:
    """Forget Accelerate's state of a process group that an earlier run in this process ended, so that the next
    ``PartialState`` forms the group again (``train()`` then ``evaluate()`` in one script, on several ranks).

    ``Accelerator.end_training`` destroys the process group but keeps Accelerate's singletons (accelerate/state.py:
    ``PartialState.destroy_process_group`` leaves ``_shared_state`` as it was); a new ``PartialState`` would then skip
    ``init_process_group`` and every collective fail with "Default process group has not been initialized". The
    reset is Accelerate's own ``_reset_state`` (what its test utilities call between runs).

    torch names the default group by its count of groups made, which ``destroy_process_group`` sets back to 0
    (torch/distributed/distributed_c10d.py, ``_process_group_name``): the new group would find the ended one's gloo
    addresses under the same keys of the launcher's store (torchrun's store outlives the group) and, reading them
    before a peer rewrote its own, connect to a port nobody listens on ("Gloo connectFullMesh failed"). So each
    group formed again counts from a number no earlier group of this process used: the same on every rank, which
    ends and forms its groups in the same order.
    """
    from accelerate.state import AcceleratorState, GradientState

    ended = PartialState._shared_state.get("distributed_type", DistributedType.NO) != DistributedType.NO
    if ended and torch.distributed.is_available() and not torch.distributed.is_initialized():
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
        world = torch.distributed.distributed_c10d._world
        world.accel_ddp_groups_ended = getattr(world, "accel_ddp_groups_ended", 0) + 1
        world.group_count = GROUP_NAMES_PER_WORLD * world.accel_ddp_groups_ended


GROUP_NAMES_PER_WORLD = 100_000  # far more groups than a run makes (the default group, the preemption flag's)


def override_mixed_precision(requested: str, cpu: bool, env=os.environ) -> None:
    """Make ``--mixed_precision`` the run's precision, as the accelerate examples' flag does.

    Accelerate takes the precision from ``ACCELERATE_MIXED_PRECISION`` (written by ``accelerate launch`` from
    the launch config) when ``Accelerator`` gets none (accelerate/state.py, ``AcceleratorState.__init__``);
    setting the variable also reaches what reads it after us (the FSDP plugin, the model card's command).
    """
    if cpu and requested == "fp16":  # the doctor's twin check (cli/doctor_checks.py) for launch configs
        raise ConfigError("--mixed_precision fp16 on CPU: Accelerate silently trains in fp32; use --mixed_precision "
                          "bf16 or no on CPU")
    if cpu and requested == "fp8":  # else Accelerate's ValueError from inside Accelerator()
        raise ConfigError("--mixed_precision fp8 needs a GPU with FP8 support (NVIDIA Ada or Hopper and later) and "
                          "none is usable here; use --mixed_precision bf16 or no on CPU")
    launched = env.get("ACCELERATE_MIXED_PRECISION")
    if launched is not None and launched != requested:  # every rank alike, before the group: the first says it
        note(f"--mixed_precision {requested} overrides the launch config's mixed_precision {launched}", ranks="first")
    env["ACCELERATE_MIXED_PRECISION"] = requested


def ddp_kwargs(options: WorldOptions) -> DistributedDataParallelKwargs:
    """The DistributedDataParallel options of the --ddp_* flags (Accelerate applies them in ``prepare``)."""
    return DistributedDataParallelKwargs(
        bucket_cap_mb=options.ddp_bucket_cap_mb,
        gradient_as_bucket_view=options.ddp_gradient_as_bucket_view,
        static_graph=options.ddp_static_graph,
        find_unused_parameters=options.ddp_find_unused_parameters,
        comm_hook=DDPCommunicationHookType("no" if options.ddp_comm_hook == "none" else options.ddp_comm_hook),
    )


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
