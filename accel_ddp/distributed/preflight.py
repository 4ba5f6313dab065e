"""Preflight: what this machine's devices (and, over several machines, file system) can run; FSDP2's policy.

Each check raises ``DeviceError``, a ``ConfigError``: one line ``problem; fix`` on stderr and exit
code 2, on every rank, before anything is written. They catch what would otherwise fail late and
obscurely on a GPU machine or a cluster, or, worse, not fail at all:

* more processes on a machine than GPUs it shows: Accelerate puts rank r on GPU ``r % count``, so
  two ranks share a device and NCCL stops at the first collective ("Duplicate GPU detected");
* GPUs the NVIDIA driver lists but this torch cannot use (a CUDA build newer than the driver):
  ``torch.cuda.is_available()`` is False and the launch would quietly train on the CPU;
* option combinations FSDP2 cannot run (``check_fsdp``);
* an ``--output_dir`` that is not one folder for every machine (``check_shared_output_dir``).

    >>> check_launch_devices(cuda_available=torch.cuda.is_available())   # before the group forms
"""

from __future__ import annotations

import os
import secrets

import torch
import torch.distributed as dist
from torch import nn

from accel_ddp.util.precision import autocast_dtype
from accel_ddp.util.ranks import launch_machines, local_world_size
from accel_ddp.util.validation import ConfigError

# FSDP2 in torch 2.14 casts a BatchNorm's weight to the policy's param_dtype but not its running
# statistics, and the forward stops with "Expected running_mean to have type BFloat16 but got Float"
# (pytorch/torchtitan#674; FSDP1 kept BatchNorm in fp32 by itself, FSDP2 has no such exception).
FSDP_BATCHNORM = "https://github.com/pytorch/torchtitan/issues/674"


class DeviceError(ConfigError):
    """The launch asks for something this machine's devices cannot run as asked."""


def nvml_gpu_count() -> int:
    """GPUs the NVIDIA driver lists and ``CUDA_VISIBLE_DEVICES`` lets through, asked without initialising CUDA.

    0 when there is no driver (no NVML library) or the count is unknown.
    """
    try:
        return max(torch.cuda._device_count_nvml(), 0)  # torch's own pre-initialisation count (NVML)
    except Exception:  # noqa: BLE001 - a private helper: any failure means "unknown", i.e. no evidence of GPUs
        return 0


def cuda_init_error() -> str:
    """Why CUDA does not initialise here (one line, e.g. "The NVIDIA driver on your system is too old ...")."""
    try:
        torch.cuda.init()
    except Exception as err:  # noqa: BLE001 - the message is the finding
        return " ".join(str(err).split())[:300] or type(err).__name__
    return "torch.cuda.is_available() is False"


def unusable_gpus() -> tuple[int, str]:
    """``(count, why)`` for GPUs the driver lists but this CUDA build of torch cannot use; ``(0, "")`` otherwise.

    A CPU-only build of torch, a machine without an NVIDIA driver, and GPUs hidden with
    ``CUDA_VISIBLE_DEVICES=''`` all give ``(0, "")``: training on the CPU is then what was asked for.
    """
    if not torch.version.cuda or torch.cuda.is_available():
        return 0, ""
    listed = nvml_gpu_count()
    return (listed, cuda_init_error()) if listed else (0, "")


def check_launch_devices(cuda_available: bool) -> None:
    """Refuse a launch this machine's GPUs cannot run, before the process group forms.

    Skipped when the caller has already formed a non-NCCL group itself (a wrapper that puts
    several gloo ranks on one GPU on purpose, as ``benchmarks/gpu_check.py`` does).
    """
    if not cuda_available:
        listed, why = unusable_gpus()
        if listed:
            raise DeviceError(
                f"this machine has {listed} NVIDIA GPU(s) but this torch (CUDA {torch.version.cuda}) cannot use them "
                f"({why}), so the run would quietly train on the CPU; install the torch build that matches the driver "
                "(see nvidia-smi and https://pytorch.org/get-started/locally/) or update the driver, or set "
                "CUDA_VISIBLE_DEVICES='' to train on the CPU on purpose")
        return
    if dist.is_available() and dist.is_initialized() and dist.get_backend() != "nccl":
        return
    local_world = local_world_size()
    gpus = torch.cuda.device_count()  # honours CUDA_VISIBLE_DEVICES (and the launch config's gpu_ids, set through it)
    if local_world > gpus:
        machines = launch_machines()
        raise DeviceError(
            f"{local_world} processes on this machine but only {gpus} GPU(s) visible: Accelerate would put two ranks "
            "on one GPU and NCCL stops at the first collective ('Duplicate GPU detected'); launch at most one process "
            f"per GPU (--num_processes {gpus * machines}, the total over all machines), or set CUDA_VISIBLE_DEVICES='' "
            "to train on the CPU")


def has_batchnorm(model: nn.Module) -> bool:
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())


def check_fsdp(model: nn.Module, *, channels_last: bool, mixed_precision: str) -> None:
    """Refuse what FSDP2 (torch 2.14, Accelerate 1.15) cannot train; call only under ``distributed_type`` FSDP.

        >>> check_fsdp(model, channels_last=cfg.channels_last, mixed_precision=accelerator.mixed_precision)
    """
    if channels_last:
        raise DeviceError(
            "--channels_last with FSDP: FSDP2 cannot shard channels-last parameters ('FSDP does not support "
            "non-contiguous parameters yet'); drop --channels_last, or use a DDP config such as "
            "accelerate_configs/4gpu.yaml")
    if autocast_dtype(mixed_precision) is not None and has_batchnorm(model):  # its parameters cast to it
        raise DeviceError(
            f"a model with BatchNorm under FSDP with mixed_precision {mixed_precision}: FSDP2 casts BatchNorm's "
            f"weights but not its running statistics and the forward fails ({FSDP_BATCHNORM}); launch with "
            "--mixed_precision no, or use a DDP config such as accelerate_configs/4gpu.yaml")


def build_fsdp_plugin(cuda_available: bool):
    """The launch config's FSDP2 settings, with gradients reduced in fp32; None unless the launch asks for FSDP.

    Accelerate's own FSDP2 policy for ``mixed_precision: bf16`` computes in bf16 and also
    reduce-scatters the gradients in bf16, so the sum over ranks loses precision that DDP (which
    all-reduces fp32 gradients under autocast) keeps. Here only the compute is bf16 (or fp16):
    ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``. Without a GPU Accelerate applies
    no FSDP at all (the processes train DDP replicas on CPU), so there is nothing to configure.
    """
    if not cuda_available or os.environ.get("ACCELERATE_USE_FSDP", "false").lower() != "true":
        return None
    from accelerate.utils import FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin()  # every fsdp_* key of the launch config, read from the environment
    dtype = autocast_dtype(os.environ.get("ACCELERATE_MIXED_PRECISION", "no"))
    if plugin.fsdp_version == 2 and dtype is not None and plugin.mixed_precision_policy is None:
        from torch.distributed.fsdp import MixedPrecisionPolicy

        plugin.mixed_precision_policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32,
                                                             output_dtype=dtype)
    return plugin


def check_shared_output_dir(accelerator, output_dir: str) -> None:
    """Refuse a multi-machine run whose ``--output_dir`` is not the same folder on every machine.

    The main process seals each checkpoint from the files every rank wrote into it, and every rank
    reads the checkpoint back on resume: without a shared file system, machine 1's ranks write
    their RNG state where machine 0 never looks and find no checkpoint to resume from. The main
    process writes a probe file, every rank reads it. Collective; nothing to do on one machine.
    """
    if accelerator.num_processes <= local_world_size(default=accelerator.num_processes):
        return
    from accelerate.utils import broadcast_object_list

    token = [secrets.token_hex(8) if accelerator.is_main_process else None]
    broadcast_object_list(token)
    probe = os.path.join(output_dir, f".accel_ddp-shared-{token[0]}")
    created = accelerator.is_main_process and not os.path.isdir(output_dir)
    if accelerator.is_main_process:
        os.makedirs(output_dir, exist_ok=True)
        with open(probe, "w", encoding="utf-8") as fh:
            fh.write(token[0])
    accelerator.wait_for_everyone()
    blind = accelerator.reduce(torch.tensor(0 if _reads_token(probe, token[0]) else 1, device=accelerator.device),
                               "sum").item()
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        os.remove(probe)
        if created and blind:
            os.rmdir(output_dir)  # refused: leave no trace
    if blind:
        raise DeviceError(
            f"--output_dir {output_dir} is not shared: {blind} of {accelerator.num_processes} ranks cannot see the "
            "file the main process wrote there, so checkpoints could be neither sealed nor resumed; put --output_dir "
            "on a file system every machine mounts at the same path (NFS, Lustre, GPFS, ...)")


def _reads_token(path: str, token: str) -> bool:
    try:
        with open(path, encoding="utf-8") as fh:
            return fh.read() == token
    except OSError:
        return False
